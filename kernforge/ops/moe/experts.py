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

The packed layouts (``layout_version`` 1) are the GEMMs' per expert: ``kernforge.ops.gemm``'s
(``[E, parts, panels, ceil(K / 2), 32, 2]`` bf16) and ``kernforge.ops.gemm.int8``'s (``[E, parts,
panels, ceil(K / 4), 64, 4]`` int8, with the compensation and scales ``[E, parts, panels * 64]``),
where a gated weight's gate and up halves are packed as two parts, each padded to whole panels.
"""

from __future__ import annotations

import torch

from kernforge.jit.module import ALL_TIERS, DType, Entry, Enum, Module
from kernforge.ops._common import checked_out, dtype_name, num_threads, variant_for_input
from kernforge.ops._registry import DTYPE_NAMES, Traced, kernel_op, model_kernels
from kernforge.ops.gemm import int8 as gemm_int8
from kernforge.ops.gemm._common import check_cpu_tensor, check_layout_version, packed_weight

LAYOUT_VERSION = 1
PANEL_WIDTH = 32  # bf16: columns per packed panel, as kernforge.ops.gemm's (a multiple of every tier's NR)
INT8_PANEL_WIDTH = gemm_int8.PANEL_WIDTH  # int8: as kernforge.ops.gemm.int8's

EXPERTS = Module(
    "moe_experts",
    "moe_experts.cpp.jinja",
    params={"dtype": DType(), "weights": Enum(("bf16", "int8"))},
    entries=[
        Entry(
            "fused_experts",
            "int64_t out, int64_t ldo, int64_t x, int64_t ldx, int64_t tokens, int64_t hidden, int64_t inter, "
            "int64_t w1_packed, int64_t w1_parts, int64_t w1_compensation, int64_t w1_scale, int64_t w2_packed, "
            "int64_t w2_compensation, int64_t w2_scale, int64_t panel_width, int64_t experts, "
            "int64_t topk_weights, int64_t topk_ids, int64_t topk, int64_t num_threads",
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


# Per weight kind: the dataclass, the element dtype, K values per packed word, the panel width.
_KINDS = {
    "bf16": (PackedExperts, torch.bfloat16, 2, PANEL_WIDTH),
    "int8": (PackedInt8Experts, torch.int8, 4, INT8_PANEL_WIDTH),
}


def packed_experts_shape(experts: int, n: int, k: int, parts: int, kind: str = "bf16") -> tuple[int, ...]:
    """Shape of the packed tensor of ``[experts, n, k]`` weights of ``kind`` in ``parts`` parts."""
    _, _, per_word, width = _KINDS[kind]
    return (experts, parts, -(-(n // parts) // width), -(-k // per_word), width, per_word)


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
    shape = packed_experts_shape(experts, n, k, parts, kind)
    _, _, panels, words, width, per_word = shape
    padded = w.new_zeros(experts, parts, panels * width, words * per_word)
    padded[:, :, : n // parts, :k] = w.view(experts, parts, n // parts, k)
    return padded.view(experts, parts, panels, width, words, per_word).permute(0, 1, 2, 4, 3, 5).contiguous()


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


def _kind_of(packed) -> str:
    return "int8" if isinstance(packed, PackedInt8Experts) else "bf16"


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


def _experts_weight(w: object, name: str, gated: bool, int8: bool, scale):
    """``w`` as packed experts: packed ones as they are, a raw stacked weight packed now."""
    if isinstance(w, (PackedExperts, PackedInt8Experts)):
        if int8 != isinstance(w, PackedInt8Experts):
            raise TypeError(f"{name} is a {type(w).__name__}; use_int8_w8a8={int8} takes the other kind of weights")
        return _checked_packed(w, name)
    if not isinstance(w, torch.Tensor):
        raise TypeError(
            f"{name} must be packed experts (pack_experts, pack_experts_int8) or a torch.Tensor, got {type(w).__name__}"
        )
    if not int8:
        _checked_stack(w, name, torch.bfloat16, gated, "fused_experts (bf16 weights; int8 with use_int8_w8a8=True)")
        return pack_experts(w, gated=gated)
    _checked_stack(w, name, torch.int8, gated, "fused_experts with use_int8_w8a8")
    if scale is None:
        raise ValueError(f"use_int8_w8a8 with raw int8 {name} needs {name}_scale, its per-channel scales")
    return pack_experts_int8(w, scale, gated=gated)


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


def _to_schema(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, use_int8_w8a8=False, **scales):
    out = scales.pop("out", None)
    w1, w2 = _packed_pair(w1, w2, use_int8_w8a8, **scales)
    arguments = [hidden_states]
    for packed in (w1, w2):
        check_layout_version(packed, LAYOUT_VERSION)
        int8 = _kind_of(packed) == "int8"
        compensation, scale = (packed.compensation, packed.scale) if int8 else (None, None)
        arguments += [packed.packed, compensation, scale, packed.n, packed.k]
    return (*arguments, topk_weights, topk_ids), hidden_states if inplace else out


def _from_schema(hidden_states, w1, w1_compensation, w1_scale, w1_n, w1_k, w2, w2_compensation, w2_scale, w2_n, w2_k,
                 topk_weights, topk_ids, out=None):  # fmt: skip
    def rebuilt(packed, compensation, scale, n, k):
        experts, parts = int(packed.shape[0]), int(packed.shape[1])
        if compensation is None:
            return PackedExperts(packed, experts, n, k, parts)
        return PackedInt8Experts(packed, compensation, scale, experts, n, k, parts)

    w1 = rebuilt(w1, w1_compensation, w1_scale, w1_n, w1_k)
    w2 = rebuilt(w2, w2_compensation, w2_scale, w2_n, w2_k)
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, use_int8_w8a8=_kind_of(w1) == "int8", out=out)


_TRACED = Traced(
    "Tensor",
    fake=lambda hidden_states, *args, **kwargs: torch.empty_like(hidden_states),
    with_out=True,
    arguments="Tensor hidden_states, Tensor w1, Tensor? w1_compensation, Tensor? w1_scale, int w1_n, int w1_k, "
    "Tensor w2, Tensor? w2_compensation, Tensor? w2_scale, int w2_n, int w2_k, Tensor topk_weights, Tensor topk_ids",
    from_schema=_from_schema,
    to_schema=_to_schema,
)


def run_kernel(kernel, out, x, w1, w2, topk_weights, topk_ids) -> int:
    """The module's entry on checked arguments (rows with unit stride, fp32 weights, int32 ids, w1
    and w2 packed alike); returns its status: 0, else 1 + the flat index of the first expert id out of
    range."""
    int8 = _kind_of(w1) == "int8"

    def addresses(packed):  # packed words, compensation, scale
        extra = (packed.compensation.data_ptr(), packed.scale.data_ptr()) if int8 else (0, 0)
        return (packed.packed.data_ptr(), *extra)

    w1_packed, w1_compensation, w1_scale = addresses(w1)
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
        INT8_PANEL_WIDTH if int8 else PANEL_WIDTH,
        w1.experts,
        topk_weights.data_ptr(),
        topk_ids.data_ptr(),
        topk_ids.shape[1],
        num_threads(),
    )


def _packed_pair(w1, w2, use_int8_w8a8, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None):
    for name, scale in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if scale is not None:
            raise ValueError(
                f"{name} must be None: kernforge quantizes activations per token, dynamically (no static scales)"
            )
    if not use_int8_w8a8 and (w1_scale is not None or w2_scale is not None):
        raise ValueError("w1_scale and w2_scale are for int8 weights: pass use_int8_w8a8=True")
    return (
        _experts_weight(w1, "w1", True, bool(use_int8_w8a8), w1_scale),
        _experts_weight(w2, "w2", False, bool(use_int8_w8a8), w2_scale),
    )


# (activation dtype, weight kind) -> variant; the op's own table holds the bf16 ones
_INT8_VARIANTS: dict = {}


@kernel_op(EXPERTS, traced=_TRACED, weights="bf16")
def fused_experts(
    hidden_states: torch.Tensor,
    w1: PackedExperts | PackedInt8Experts | torch.Tensor,
    w2: PackedExperts | PackedInt8Experts | torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    inplace: bool = False,
    use_int8_w8a8: bool = False,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE MLP of ``hidden_states [T, H]`` over each token's ``topk_ids [T, k]`` experts
    weighted by ``topk_weights [T, k]`` (any float dtype, read as fp32), in ``hidden_states``' dtype
    (fp32 accumulation): ``w1`` the stacked gate/up weights ``[E, 2I, H]`` and ``w2`` the down
    weights ``[E, H, I]``: bf16 (:class:`PackedExperts` or raw tensors), or with ``use_int8_w8a8``
    int8 (:class:`PackedInt8Experts`, or raw int8 tensors with ``w1_scale [E, 2I]`` and
    ``w2_scale [E, H]``). ``a1_scale``/``a2_scale`` (static activation scales) must be None.
    ``inplace=True`` writes the result into ``hidden_states``; ``out`` is a buffer to write."""
    variant = variant_for_input(fused_experts.kernels, hidden_states, "hidden_states")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [T, H], got shape {tuple(hidden_states.shape)}")
    tokens, hidden = map(int, hidden_states.shape)
    w1, w2 = _packed_pair(w1, w2, use_int8_w8a8, w1_scale, w2_scale, a1_scale, a2_scale)
    inter = w2.k
    if (w1.experts, w1.n, w1.k) != (w2.experts, 2 * inter, hidden) or w2.n != hidden:
        raise ValueError(
            f"w1 [{w1.experts}, {w1.n}, {w1.k}] and w2 [{w2.experts}, {w2.n}, {w2.k}] must be [E, 2I, H] and "
            f"[E, H, I] with H = {hidden} (hidden_states' last dimension)"
        )
    width = INT8_PANEL_WIDTH if use_int8_w8a8 else PANEL_WIDTH
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
    if use_int8_w8a8:
        key = hidden_states.dtype
        variant = _INT8_VARIANTS.get(key) or _INT8_VARIANTS.setdefault(
            key, EXPERTS.variant(dtype=DTYPE_NAMES[key], weights="int8")
        )
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    status = run_kernel(variant.kernel(), out, x, w1, w2, topk_weights, topk_ids)
    if status:
        bad = status - 1
        k = topk_ids.shape[1]
        raise ValueError(
            f"topk_ids[{bad // k}, {bad % k}] = {int(topk_ids.view(-1)[bad])} is not an expert id "
            f"in [0, {w1.experts}); nothing was written"
        )
    return out


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    """A MoE model's experts run fused_experts in its dtype, on int8 weights with quant="int8"."""
    if not spec.num_experts:
        return []
    weights = "int8" if quant == "int8" else "bf16"
    return [{"module": "moe_experts", "params": {"dtype": dtype_name(spec.dtype), "weights": weights}}]
