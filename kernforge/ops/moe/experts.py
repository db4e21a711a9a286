"""Fused MoE experts with sgl-kernel's CPU semantics (``fused_experts_cpu`` in
``sgl-kernel/csrc/cpu/moe.cpp``): for each token ``t``,

    out[t] = sum_j topk_weights[t, j] * W2_e (silu(W1g_e x_t) * W1u_e x_t),  e = topk_ids[t, j]

with ``w1 [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``w2 [E, H, I]``. The k
expert outputs of a token are summed in fp32 and rounded once (``kernforge/moe/experts.h`` has the
algorithm: tokens grouped by expert in C++, one pass over each expert's rows for gate/up with
silu * up in the tile epilogue, one for down with the weighted sum in its store).

Two kinds of weights:

* bf16: prepacked once with :func:`pack_experts` (``pack_experts(w1, gated=True)``,
  ``pack_experts(w2)``); raw stacked bf16 weights are accepted too and packed on every call (what
  sgl-kernel does with ``is_vnni=False``).
* int8 w8a8 (``use_int8_w8a8=True``, sgl-kernel's int8 MoE): symmetric int8 weights with fp32
  per-channel scales (``w1_scale [E, 2I]``, ``w2_scale [E, H]``, or with a trailing 1), prepacked
  with :func:`pack_experts_int8` or raw (packed per call); the activations and the intermediate are
  quantized per token, dynamically (uint8 + 128 with an fp32 scale, as ``per_token_quant_int8``),
  and the int32 products dequantized in the tile epilogue.

* fp8 w8a16 (``use_fp8_w8a16=True``, DeepSeek-V3's checkpoints): e4m3fn weights with fp32 block
  scales (``w1_scale [E, ceil(2I / bn), ceil(H / bk)]``, ``w2_scale [E, ceil(H / bn), ceil(I /
  bk)]``, ``block_size = [bn, bk]``, 128 x 128 by default), prepacked with :func:`pack_experts_fp8` or
  raw; converted in registers where they are used, each K block's sums scaled in fp32 (as
  ``fp8_scaled_mm``).

The packed layouts (``layout_version`` 1) are the GEMMs' per expert: ``kernforge.ops.gemm``'s
(``[E, parts, panels, ceil(K / 2), 32, 2]`` bf16), ``kernforge.ops.gemm.int8``'s (``[E, parts,
panels, ceil(K / 4), 64, 4]`` int8, with the compensation and scales ``[E, parts, panels * 64]``)
and ``kernforge.ops.gemm.fp8``'s (``[E, parts, panels, K, 64]`` e4m3fn, the block scales as given),
where a gated weight's gate and up halves are packed as two parts, each padded to whole panels.
"""

from __future__ import annotations

import torch

from kernforge.jit.module import ALL_TIERS, DType, Entry, Enum, Module
from kernforge.ops._common import checked_out, dtype_name, num_threads, variant_for_input
from kernforge.ops._registry import DTYPE_NAMES, Traced, kernel_op, model_kernels
from kernforge.ops.gemm import fp8 as gemm_fp8
from kernforge.ops.gemm import int8 as gemm_int8
from kernforge.ops.gemm._common import check_cpu_tensor, check_layout_version, packed_weight

LAYOUT_VERSION = 1
PANEL_WIDTH = 32  # bf16: columns per packed panel, as kernforge.ops.gemm's (a multiple of every tier's NR)
INT8_PANEL_WIDTH = gemm_int8.PANEL_WIDTH  # int8: as kernforge.ops.gemm.int8's
FP8_PANEL_WIDTH = gemm_fp8.PANEL_WIDTH  # fp8: as kernforge.ops.gemm.fp8's

EXPERTS = Module(
    "moe_experts",
    "moe_experts.cpp.jinja",
    params={"dtype": DType(), "weights": Enum(("bf16", "int8", "fp8"))},
    entries=[
        Entry(
            "fused_experts",
            "int64_t out, int64_t ldo, int64_t x, int64_t ldx, int64_t tokens, int64_t hidden, int64_t inter, "
            "int64_t w1_packed, int64_t w1_parts, int64_t w1_compensation, int64_t w1_scale, int64_t w2_packed, "
            "int64_t w2_compensation, int64_t w2_scale, int64_t block_n, int64_t block_k, int64_t panel_width, "
            "int64_t experts, "
            "int64_t topk_weights, int64_t topk_ids, int64_t topk, int64_t residual, int64_t ld_residual, "
            "double residual_scale, int64_t num_threads",
            returns="int64_t",
        )
    ],
    tiers=ALL_TIERS,  # the amx build multiplies blocks of 5 rows or more in AMX tiles
)


@packed_weight(saved_as="kernforge.ops.moe")
class PackedExperts:
    """Stacked bf16 expert weights ``[E, N, K]`` packed for :func:`fused_experts`; ``parts`` = 2 for
    a gated ``w1`` (its gate and up halves packed apart); survives ``torch.save``/``torch.load``."""

    packed: torch.Tensor  # [E, parts, panels, ceil(K / 2), 32, 2] bf16
    experts: int
    n: int
    k: int
    parts: int = 1
    layout_version: int = LAYOUT_VERSION


@packed_weight(saved_as="kernforge.ops.moe")
class PackedInt8Experts:
    """Stacked int8 expert weights ``[E, N, K]`` with per-channel scales, packed for
    :func:`fused_experts` (w8a8); survives ``torch.save``/``torch.load``."""

    packed: torch.Tensor  # [E, parts, panels, ceil(K / 4), 64, 4] int8
    compensation: torch.Tensor  # [E, parts, panels * 64] int32: 128 * sum_k W[n, k]
    scale: torch.Tensor  # [E, parts, panels * 64] fp32 (0 in the padding)
    experts: int
    n: int
    k: int
    parts: int = 1
    layout_version: int = LAYOUT_VERSION


@packed_weight(saved_as="kernforge.ops.moe")
class PackedFp8Experts:
    """Stacked e4m3fn expert weights ``[E, N, K]`` with fp32 block scales, packed for
    :func:`fused_experts` (w8a16); survives ``torch.save``/``torch.load``."""

    packed: torch.Tensor  # [E, parts, panels, K, 64] float8_e4m3fn
    scale: torch.Tensor  # [E, ceil(N / bn), ceil(K / bk)] fp32
    block_size: tuple[int, int]
    experts: int
    n: int
    k: int
    parts: int = 1
    layout_version: int = LAYOUT_VERSION


# Per weight kind: the dataclass, the element dtype, K values per packed word, the panel width.
_KINDS = {
    "bf16": (PackedExperts, torch.bfloat16, 2, PANEL_WIDTH),
    "int8": (PackedInt8Experts, torch.int8, 4, INT8_PANEL_WIDTH),
    "fp8": (PackedFp8Experts, torch.float8_e4m3fn, 1, FP8_PANEL_WIDTH),
}
_PACKED_CLASSES = {cls: kind for kind, (cls, *_) in _KINDS.items()}


def packed_experts_shape(experts: int, n: int, k: int, parts: int, kind: str = "bf16") -> tuple[int, ...]:
    """Shape of the packed tensor of ``[experts, n, k]`` weights of ``kind`` in ``parts`` parts."""
    _, _, per_word, width = _KINDS[kind]
    shape = (experts, parts, -(-(n // parts) // width), -(-k // per_word), width, per_word)
    return shape[:-1] if per_word == 1 else shape


def _checked_stack(w: object, name: str, dtype: torch.dtype, gated: bool, op: str) -> tuple[int, int, int]:
    """(E, N, K) of a 3-D CPU stacked weight of ``dtype``; a gated one has an even N."""
    check_cpu_tensor(w, name)
    if w.dtype is not dtype:
        raise TypeError(f"{name} has dtype {w.dtype}; {op} takes {dtype}")
    if w.dim() != 3:
        raise ValueError(f"{name} must be 3-D [E, N, K], got shape {tuple(w.shape)}")
    if gated and w.shape[1] % 2:
        raise ValueError(f"a gated {name} [E, 2I, H] must have an even N, got shape {tuple(w.shape)}")
    return tuple(map(int, w.shape))


def _panels(w: torch.Tensor, parts: int, kind: str) -> torch.Tensor:
    """``w [E, N, K]`` in panels: ``[E, parts, panels, K words, width, per_word]``, zero-padded."""
    experts, n, k = w.shape
    _, _, per_word, width = _KINDS[kind]
    _, _, panels, words = packed_experts_shape(experts, n, k, parts, kind)[:4]
    bits = w.view(torch.uint8) if w.dtype is torch.float8_e4m3fn else w  # (zeros and copies of fp8 as bytes)
    padded = bits.new_zeros(experts, parts, panels * width, words * per_word)
    padded[:, :, : n // parts, :k] = bits.view(experts, parts, n // parts, k)
    packed = padded.view(experts, parts, panels, width, words, per_word).permute(0, 1, 2, 4, 3, 5).contiguous()
    if per_word == 1:
        packed = packed.view(experts, parts, panels, words, width)
    return packed.view(w.dtype)


def pack_experts(w: torch.Tensor, gated: bool = False) -> PackedExperts:
    """Pack stacked bf16 expert weights ``w [E, N, K]`` for :func:`fused_experts`: ``w1 [E, 2I, H]``
    with ``gated=True`` (its gate and up halves are packed apart, each to whole panels), ``w2 [E, H,
    I]`` as it is."""
    experts, n, k = _checked_stack(w, "w", torch.bfloat16, gated, "pack_experts")
    parts = 2 if gated else 1
    return PackedExperts(_panels(w, parts, "bf16"), experts, n, k, parts)


def pack_experts_int8(w: torch.Tensor, w_scale: torch.Tensor, gated: bool = False) -> PackedInt8Experts:
    """Pack stacked int8 expert weights ``w [E, N, K]`` and their per-channel scales ``w_scale
    [E, N]`` (or ``[E, N, 1]``) for :func:`fused_experts` with ``use_int8_w8a8``; ``gated`` as for
    :func:`pack_experts`."""
    experts, n, k = _checked_stack(w, "w", torch.int8, gated, "pack_experts_int8")
    check_cpu_tensor(w_scale, "w_scale")
    if not w_scale.is_floating_point():
        raise TypeError(f"w_scale has dtype {w_scale.dtype}; expected a floating dtype (stored as float32)")
    if tuple(w_scale.shape) not in ((experts, n), (experts, n, 1)):
        raise ValueError(
            f"w_scale must be [{experts}, {n}] (or with a trailing 1) to match w, got {tuple(w_scale.shape)}"
        )
    parts = 2 if gated else 1
    width = packed_experts_shape(experts, n, k, parts, "int8")[2] * INT8_PANEL_WIDTH

    def per_column(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [E, parts, padded columns]
        padded = torch.zeros(experts, parts, width, dtype=dtype)
        padded[:, :, : n // parts] = values.reshape(experts, parts, n // parts)
        return padded

    compensation = per_column(w.sum(2, dtype=torch.int32) * gemm_int8.ZERO_POINT, torch.int32)
    scale = per_column(w_scale.reshape(experts, n).float(), torch.float32)
    return PackedInt8Experts(_panels(w, parts, "int8"), compensation, scale, experts, n, k, parts)


def pack_experts_fp8(
    w: torch.Tensor, w_scale: torch.Tensor, block_size=(128, 128), gated: bool = False
) -> PackedFp8Experts:
    """Pack stacked e4m3fn expert weights ``w [E, N, K]`` and their fp32 block scales ``w_scale
    [E, ceil(N / bn), ceil(K / bk)]`` (``block_size = (bn, bk)``) for :func:`fused_experts` with
    ``use_fp8_w8a16``; ``gated`` as for :func:`pack_experts`."""
    experts, n, k = _checked_stack(w, "w", torch.float8_e4m3fn, gated, "pack_experts_fp8")
    block = gemm_fp8._checked_block_size(block_size)
    check_cpu_tensor(w_scale, "w_scale")
    if not w_scale.is_floating_point():
        raise TypeError(f"w_scale has dtype {w_scale.dtype}; expected a floating dtype (stored as float32)")
    blocks = (experts, -(-n // block[0]), -(-k // block[1]))
    if tuple(w_scale.shape) != blocks:
        raise ValueError(
            f"w_scale must be {list(blocks)} (one scale per {block[0]} x {block[1]} block of each expert), "
            f"got {tuple(w_scale.shape)}"
        )
    if ((w.view(torch.uint8) & 0x7F) == 0x7F).any():  # as convert_weight_packed_fp8: the widening drops NaN
        raise ValueError("w holds NaN (e4m3fn code S.1111.111); NaN weights are refused")
    parts = 2 if gated else 1
    scale = w_scale.to(torch.float32, copy=True).contiguous()
    return PackedFp8Experts(_panels(w, parts, "fp8"), scale, block, experts, n, k, parts)


def _kind_of(packed) -> str:
    return _PACKED_CLASSES[type(packed)]


def _checked_packed(packed, name: str):
    kind = _kind_of(packed)
    if packed.layout_version != LAYOUT_VERSION:
        raise ValueError(
            f"{name} has layout version {packed.layout_version}; this kernforge reads version "
            f"{LAYOUT_VERSION}: pack the weights again"
        )
    cls, dtype, _, width = _KINDS[kind]
    layout = [("packed", dtype, packed_experts_shape(packed.experts, packed.n, packed.k, packed.parts, kind))]
    if kind == "int8":
        columns = (packed.experts, packed.parts, layout[0][2][2] * width)
        layout += [("compensation", torch.int32, columns), ("scale", torch.float32, columns)]
    elif kind == "fp8":
        bn, bk = gemm_fp8._checked_block_size(packed.block_size)
        layout.append(("scale", torch.float32, (packed.experts, -(-packed.n // bn), -(-packed.k // bk))))
    for field, dtype, shape in layout:
        t = getattr(packed, field)
        if (
            packed.parts not in (1, 2)
            or not isinstance(t, torch.Tensor)
            or t.dtype is not dtype
            or not t.is_cpu
            or t.shape != shape
            or not t.is_contiguous()
        ):
            raise ValueError(
                f"{name}.{field} must be a contiguous CPU {dtype} tensor of shape {shape} for "
                f"[{packed.experts}, {packed.n}, {packed.k}] weights in {packed.parts} part(s) "
                f"({cls.__name__}'s layout)"
            )
    return packed


def _experts_weight(w: object, name: str, gated: bool, kind: str, scale, block_size):
    """``w`` as packed experts of ``kind``: packed ones as they are, a raw stacked weight packed now."""
    if type(w) in _PACKED_CLASSES:
        if _kind_of(w) != kind:
            raise TypeError(f"{name} is a {type(w).__name__}; {_KIND_FLAGS[kind]} takes {_KINDS[kind][0].__name__}")
        if kind == "fp8" and block_size is not None and tuple(block_size) != w.block_size:
            raise ValueError(
                f"block_size {list(block_size)} differs from the {list(w.block_size)} {name} was packed with"
            )
        return _checked_packed(w, name)
    if not isinstance(w, torch.Tensor):
        raise TypeError(
            f"{name} must be packed experts (pack_experts, pack_experts_int8, pack_experts_fp8) or a torch.Tensor, "
            f"got {type(w).__name__}"
        )
    _checked_stack(w, name, _KINDS[kind][1], gated, f"fused_experts with {_KIND_FLAGS[kind]}")
    if kind == "bf16":
        return pack_experts(w, gated=gated)
    if scale is None:
        raise ValueError(f"{_KIND_FLAGS[kind]} with raw {name} needs {name}_scale, its scales")
    if kind == "int8":
        return pack_experts_int8(w, scale, gated=gated)
    return pack_experts_fp8(w, scale, (128, 128) if block_size is None else block_size, gated=gated)


# How a call names each kind of weights (sgl-kernel's flags).
_KIND_FLAGS = {"bf16": "bf16 weights (no quantization flag)", "int8": "use_int8_w8a8", "fp8": "use_fp8_w8a16"}


def _checked_routing(topk_weights, topk_ids, tokens: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_cpu_tensor(topk_weights, "topk_weights")
    check_cpu_tensor(topk_ids, "topk_ids")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights has dtype {topk_weights.dtype}; expected a floating dtype (read as float32)")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; expected torch.int32 or torch.int64")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids must be [{tokens}, k] to match hidden_states, got shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[1] > experts:
        raise ValueError(f"topk_ids has k = {topk_ids.shape[1]} experts per token; there are only {experts} experts")
    return topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int32).contiguous()


# --------------------------------------------------------------------------- the custom op


def _to_schema(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, use_int8_w8a8=False,
               use_fp8_w8a16=False, **options):  # fmt: skip
    out = options.pop("out", None)
    w1, w2 = _packed_pair(w1, w2, use_int8_w8a8, use_fp8_w8a16, **options)
    arguments = [hidden_states]
    for packed in (w1, w2):
        check_layout_version(packed, LAYOUT_VERSION)
        compensation, scale = getattr(packed, "compensation", None), getattr(packed, "scale", None)
        # fp8 weights travel as their bytes: torch's schema checks compare tensors with arithmetic fp8 lacks
        words = packed.packed.view(torch.uint8) if _kind_of(packed) == "fp8" else packed.packed
        arguments += [words, compensation, scale, packed.n, packed.k]
    block = getattr(w1, "block_size", (0, 0))
    return (*arguments, topk_weights, topk_ids, *block), hidden_states if inplace else out


def _rebuilt(packed, compensation, scale, n, k, block_n, block_k):
    """Packed experts from a custom op's tensors and ints."""
    experts, parts = int(packed.shape[0]), int(packed.shape[1])
    if block_n:  # fp8, as its bytes
        return PackedFp8Experts(packed.view(torch.float8_e4m3fn), scale, (block_n, block_k), experts, n, k, parts)
    if compensation is not None:
        return PackedInt8Experts(packed, compensation, scale, experts, n, k, parts)
    return PackedExperts(packed, experts, n, k, parts)


def _from_schema(hidden_states, w1, w1_compensation, w1_scale, w1_n, w1_k, w2, w2_compensation, w2_scale, w2_n, w2_k,
                 topk_weights, topk_ids, block_n=0, block_k=0, out=None):  # fmt: skip
    w1 = _rebuilt(w1, w1_compensation, w1_scale, w1_n, w1_k, block_n, block_k)
    w2 = _rebuilt(w2, w2_compensation, w2_scale, w2_n, w2_k, block_n, block_k)
    kind = _kind_of(w1)
    return fused_experts(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        use_int8_w8a8=kind == "int8",
        use_fp8_w8a16=kind == "fp8",
        out=out,
    )


_TRACED = Traced(
    "Tensor",
    fake=lambda hidden_states, *args, **kwargs: torch.empty_like(hidden_states),
    with_out=True,
    arguments="Tensor hidden_states, Tensor w1, Tensor? w1_compensation, Tensor? w1_scale, int w1_n, int w1_k, "
    "Tensor w2, Tensor? w2_compensation, Tensor? w2_scale, int w2_n, int w2_k, Tensor topk_weights, Tensor topk_ids, "
    "int block_n=0, int block_k=0",
    from_schema=_from_schema,
    to_schema=_to_schema,
)


def _shared_to_schema(hidden_states, w1, w2, fused_experts_out=None, routed_scaling_factor=None, inplace=False,
                      use_int8_w8a8=False, use_fp8_w8a16=False, w1_scale=None, w2_scale=None, block_size=None,
                      a1_scale=None, a2_scale=None, out=None):  # fmt: skip
    (w1, w1_scale), (w2, w2_scale) = _single_expert(w1, "w1", w1_scale), _single_expert(w2, "w2", w2_scale)
    w1, w2 = _packed_pair(w1, w2, use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size, a1_scale, a2_scale)
    arguments, out = _to_schema(hidden_states, w1, w2, None, None, inplace, _kind_of(w1) == "int8",
                                _kind_of(w1) == "fp8", out=out)  # fmt: skip
    *weights, _, _, block_n, block_k = arguments
    return (*weights, fused_experts_out, routed_scaling_factor, block_n, block_k), out


def _shared_from_schema(
    hidden_states,
    w1,
    w1_compensation,
    w1_scale,
    w1_n,
    w1_k,
    w2,
    w2_compensation,
    w2_scale,
    w2_n,
    w2_k,
    fused_experts_out,
    routed_scaling_factor,
    block_n=0,
    block_k=0,
    out=None,
):
    w1 = _rebuilt(w1, w1_compensation, w1_scale, w1_n, w1_k, block_n, block_k)
    w2 = _rebuilt(w2, w2_compensation, w2_scale, w2_n, w2_k, block_n, block_k)
    kind = _kind_of(w1)
    return shared_expert(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor,
                         use_int8_w8a8=kind == "int8", use_fp8_w8a16=kind == "fp8", out=out)  # fmt: skip


_SHARED_TRACED = Traced(
    "Tensor",
    fake=lambda hidden_states, *args, **kwargs: torch.empty_like(hidden_states),
    with_out=True,
    arguments="Tensor hidden_states, Tensor w1, Tensor? w1_compensation, Tensor? w1_scale, int w1_n, int w1_k, "
    "Tensor w2, Tensor? w2_compensation, Tensor? w2_scale, int w2_n, int w2_k, Tensor? fused_experts_out, "
    "float? routed_scaling_factor, int block_n=0, int block_k=0",
    from_schema=_shared_from_schema,
    to_schema=_shared_to_schema,
)


def run_kernel(kernel, out, x, w1, w2, topk_weights, topk_ids, residual=None, residual_scale=0.0) -> int:
    """The module's entry on checked arguments (rows with unit stride, fp32 weights, int32 ids, w1
    and w2 packed alike; out += residual_scale * residual where given); returns its status: 0, else
    1 + the flat index of the first expert id out of range."""
    kind = _kind_of(w1)

    def addresses(packed):  # packed words, compensation, scale
        compensation, scale = getattr(packed, "compensation", None), getattr(packed, "scale", None)
        return tuple(0 if t is None else t.data_ptr() for t in (packed.packed, compensation, scale))

    w1_packed, w1_compensation, w1_scale = addresses(w1)
    block_n, block_k = getattr(w1, "block_size", (0, 0))
    return kernel.fused_experts(
        out.data_ptr(),
        out.stride(0),
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        x.shape[1],
        w2.k,
        w1_packed,
        w1.parts,
        w1_compensation,
        w1_scale,
        *addresses(w2),
        block_n,
        block_k,
        _KINDS[kind][3],
        w1.experts,
        topk_weights.data_ptr(),
        topk_ids.data_ptr(),
        topk_ids.shape[1],
        0 if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        residual_scale,
        num_threads(),
    )


def _packed_pair(w1, w2, use_int8_w8a8=False, use_fp8_w8a16=False, w1_scale=None, w2_scale=None, block_size=None,
                 a1_scale=None, a2_scale=None):  # fmt: skip
    """The kind of weights the flags name, and w1, w2 packed as that kind (checked)."""
    for name, scale in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if scale is not None:
            raise ValueError(
                f"{name} must be None: kernforge quantizes activations per token, dynamically (no static scales)"
            )
    if use_int8_w8a8 and use_fp8_w8a16:
        raise ValueError("use_int8_w8a8 and use_fp8_w8a16 exclude each other")
    kind = "int8" if use_int8_w8a8 else "fp8" if use_fp8_w8a16 else "bf16"
    if kind == "bf16" and (w1_scale is not None or w2_scale is not None):
        raise ValueError("w1_scale and w2_scale are for quantized weights: pass use_int8_w8a8 or use_fp8_w8a16")
    if kind != "fp8" and block_size is not None:
        raise ValueError("block_size is for fp8 weights (use_fp8_w8a16=True)")
    w1 = _experts_weight(w1, "w1", True, kind, w1_scale, block_size)
    w2 = _experts_weight(w2, "w2", False, kind, w2_scale, block_size)
    if kind == "fp8" and w1.block_size != w2.block_size:
        raise ValueError(f"w1 and w2 were packed with different block sizes, {w1.block_size} and {w2.block_size}")
    return w1, w2


# weight kind -> {activation dtype -> variant}; the op's own table holds the bf16 ones
_QUANTIZED_VARIANTS: dict[str, dict] = {"int8": {}, "fp8": {}}


def _variant(op, hidden_states, kind: str):
    """The module variant for ``hidden_states``' dtype (checked here) and the weights' kind."""
    variant = variant_for_input(op.kernels, hidden_states, "hidden_states")
    if kind == "bf16":
        return variant
    variants = _QUANTIZED_VARIANTS[kind]
    found = variants.get(hidden_states.dtype)
    if found is None:
        found = variants[hidden_states.dtype] = EXPERTS.variant(dtype=DTYPE_NAMES[hidden_states.dtype], weights=kind)
    return found


def _experts(op, hidden_states, w1, w2, topk_weights, topk_ids, inplace, out, residual=None, residual_scale=0.0):
    """What fused_experts and shared_expert share, from their packed weights on: the checks, the
    output, the kernel call."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [T, H], got shape {tuple(hidden_states.shape)}")
    tokens, hidden = map(int, hidden_states.shape)
    kind = _kind_of(w1)
    variant = _variant(op, hidden_states, kind)
    inter = w2.k
    if (w1.experts, w1.n, w1.k) != (w2.experts, 2 * inter, hidden) or w2.n != hidden:
        raise ValueError(
            f"w1 [{w1.experts}, {w1.n}, {w1.k}] and w2 [{w2.experts}, {w2.n}, {w2.k}] must be [E, 2I, H] and "
            f"[E, H, I] with H = {hidden} (hidden_states' last dimension)"
        )
    width = _KINDS[kind][3]
    if w1.parts == 1 and inter % width:
        raise ValueError(
            f"w1 was packed in one part, but I = {inter} is not a multiple of {width}: pack it with gated=True"
        )
    topk_weights, topk_ids = _checked_routing(topk_weights, topk_ids, tokens, w1.experts)
    if inplace:
        if out is not None and out is not hidden_states:
            raise ValueError("give either inplace=True or out, not both")
        out = hidden_states
    if out is None:
        out = torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
    else:
        checked_out(out, hidden_states.shape, hidden_states)
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    status = run_kernel(variant.kernel(), out, x, w1, w2, topk_weights, topk_ids, residual, residual_scale)
    if status:
        bad = status - 1
        k = topk_ids.shape[1]
        raise ValueError(
            f"topk_ids[{bad // k}, {bad % k}] = {int(topk_ids.view(-1)[bad])} is not an expert id "
            f"in [0, {w1.experts}); nothing was written"
        )
    return out


@kernel_op(EXPERTS, traced=_TRACED, weights="bf16")
def fused_experts(
    hidden_states: torch.Tensor,
    w1: PackedExperts | PackedInt8Experts | PackedFp8Experts | torch.Tensor,
    w2: PackedExperts | PackedInt8Experts | PackedFp8Experts | torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    inplace: bool = False,
    use_int8_w8a8: bool = False,
    use_fp8_w8a16: bool = False,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_size: list[int] | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE MLP of ``hidden_states [T, H]`` over each token's ``topk_ids [T, k]`` experts
    weighted by ``topk_weights [T, k]`` (any float dtype, read as fp32), in ``hidden_states``' dtype
    (fp32 accumulation), sgl-kernel's ``fused_experts_cpu`` (its arguments in its order). ``w1`` the
    stacked gate/up weights ``[E, 2I, H]`` and ``w2`` the down weights ``[E, H, I]``: bf16
    (:class:`PackedExperts` or raw); with ``use_int8_w8a8``, int8 (:class:`PackedInt8Experts`, or raw
    with per-channel ``w1_scale [E, 2I]`` and ``w2_scale [E, H]``); with ``use_fp8_w8a16``, e4m3fn
    (:class:`PackedFp8Experts`, or raw with block scales ``w1_scale``, ``w2_scale`` for
    ``block_size = [bn, bk]``, 128 x 128 by default). ``a1_scale``/``a2_scale`` (static activation
    scales) must be None. ``inplace=True`` writes the result into ``hidden_states``; ``out`` is a
    buffer to write."""
    w1, w2 = _packed_pair(w1, w2, use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size, a1_scale, a2_scale)
    return _experts(fused_experts, hidden_states, w1, w2, topk_weights, topk_ids, inplace, out)


def _single_expert(w, name: str, scale):
    """A shared expert's 2-D weight (or its scales) as a stack of one; packed ones as they are."""
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return w[None], None if scale is None else scale.reshape(1, *scale.shape)
    if isinstance(w, torch.Tensor):
        raise ValueError(f"{name} must be 2-D (one shared expert), got shape {tuple(w.shape)}")
    if type(w) in _PACKED_CLASSES and w.experts != 1:
        raise ValueError(f"{name} holds {w.experts} experts; a shared expert is one (pack w[None])")
    return w, scale


@kernel_op(EXPERTS, traced=_SHARED_TRACED, weights="bf16")
def shared_expert(
    hidden_states: torch.Tensor,
    w1: PackedExperts | PackedInt8Experts | PackedFp8Experts | torch.Tensor,
    w2: PackedExperts | PackedInt8Experts | PackedFp8Experts | torch.Tensor,
    fused_experts_out: torch.Tensor | None = None,
    routed_scaling_factor: float | None = None,
    inplace: bool = False,
    use_int8_w8a8: bool = False,
    use_fp8_w8a16: bool = False,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_size: list[int] | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """sgl-kernel's ``shared_expert_cpu``: DeepSeek's always-on expert ``W2 (silu(W1g x) * W1u x)``
    on every token of ``hidden_states [T, H]``, plus ``routed_scaling_factor * fused_experts_out``
    (the routed experts' output, ``[T, H]``) in the same pass, rounded once. ``w1 [2I, H]``,
    ``w2 [H, I]`` (raw, with ``w1_scale``/``w2_scale`` as for :func:`fused_experts` less the expert
    dimension, or packed as a stack of one: ``pack_experts(w1[None], gated=True)``); the
    quantization flags, ``inplace`` and ``out`` as for :func:`fused_experts`."""
    if (fused_experts_out is None) != (routed_scaling_factor is None):
        raise ValueError("give fused_experts_out and routed_scaling_factor together (the output adds their product)")
    if fused_experts_out is not None:
        check_cpu_tensor(fused_experts_out, "fused_experts_out")
        if fused_experts_out.dtype is not hidden_states.dtype or fused_experts_out.shape != hidden_states.shape:
            raise ValueError(
                f"fused_experts_out must match hidden_states ({hidden_states.dtype}, {tuple(hidden_states.shape)}), "
                f"got {fused_experts_out.dtype}, {tuple(fused_experts_out.shape)}"
            )
        if fused_experts_out.stride(-1) != 1:
            fused_experts_out = fused_experts_out.contiguous()
    (w1, w1_scale), (w2, w2_scale) = _single_expert(w1, "w1", w1_scale), _single_expert(w2, "w2", w2_scale)
    w1, w2 = _packed_pair(w1, w2, use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size, a1_scale, a2_scale)
    tokens = hidden_states.shape[0] if hidden_states.dim() == 2 else 0
    every_token = torch.zeros(tokens, 1, dtype=torch.int32)
    scale = 0.0 if routed_scaling_factor is None else float(routed_scaling_factor)
    return _experts(
        shared_expert, hidden_states, w1, w2, torch.ones(tokens, 1), every_token, inplace, out, fused_experts_out, scale
    )


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    """A MoE model's experts run fused_experts in its dtype, on int8 weights with quant="int8", fp8
    ones with quant="fp8_block"."""
    if not spec.num_experts:
        return []
    weights = {"int8": "int8", "fp8_block": "fp8"}.get(quant, "bf16")
    return [{"module": "moe_experts", "params": {"dtype": dtype_name(spec.dtype), "weights": weights}}]
