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

* int4 (``moe_comp_method=INT4_W4A8``, sgl-kernel's int4 MoE, or kernforge's ``INT4_W4A16``):
  four-bit weights with a uint8 zero point and an fp32 scale per group of K values, prepacked with
  :func:`pack_experts_int4` (from bf16 weights, ``quantize_int4``'s rounding) or
  :meth:`PackedInt4Experts.from_tensors`, or raw: a checkpoint's tensors through
  ``convert_weight_packed_scale_zp`` (3-D ``[E, ...]`` tensors are packed per expert), its ``w``
  as ``w1``/``w2``, its ``w_zeros`` as ``w1_zero``/``w2_zero`` and its ``w_scales`` as
  ``w1_scale``/``w2_scale``, as sgl-kernel takes them. W4A8 quantizes the activations and the
  intermediate per token to int8 as the int8 experts do (``int4_scaled_mm_cpu``'s arithmetic),
  W4A16 multiplies them as they are (``int4_w4a16_linear``'s); one packing serves both.

The quantization is named by sgl-kernel's flags (``use_int8_w8a8``, ``use_fp8_w8a16``) or by its newer
``moe_comp_method`` (:class:`CPUQuantMethod`'s numbers), as a keyword argument.

The packed layouts (``layout_version`` 1) are the GEMMs' per expert: ``kernforge.ops.gemm``'s
(``[E, parts, panels, ceil(K / 2), 32, 2]`` bf16), ``kernforge.ops.gemm.int8``'s (``[E, parts,
panels, ceil(K / 4), 64, 4]`` int8, with the compensation and scales ``[E, parts, panels * 64]``)
and ``kernforge.ops.gemm.fp8``'s (``[E, parts, panels, K, 64]`` e4m3fn, the block scales as given),
and ``kernforge.ops.gemm.int4``'s (``[E, parts, ceil(N / parts / 64), K / 4, 128]`` uint8 nibbles,
the zero points and scales ``[E, parts, G, N / parts]``), where a gated weight's gate and up halves
are packed as two parts, each padded to whole panels.
"""

from __future__ import annotations

import enum

import torch

from kernforge.jit.module import ALL_TIERS, DType, Entry, Enum, Module, Struct
from kernforge.ops._common import check_no_overlap, checked_out, dtype_name, num_threads, variant_for_input
from kernforge.ops._registry import DTYPE_NAMES, Traced, kernel_op, model_kernels
from kernforge.ops.gemm import check_cpu_tensor, check_layout_version, packed_weight
from kernforge.ops.gemm import fp8 as gemm_fp8
from kernforge.ops.gemm import int4 as gemm_int4
from kernforge.ops.gemm import int8 as gemm_int8

LAYOUT_VERSION = 1
PANEL_WIDTH = 32  # bf16: columns per packed panel, as kernforge.ops.gemm's (a multiple of every tier's NR)
INT8_PANEL_WIDTH = gemm_int8.PANEL_WIDTH  # int8: as kernforge.ops.gemm.int8's
FP8_PANEL_WIDTH = gemm_fp8.PANEL_WIDTH  # fp8: as kernforge.ops.gemm.fp8's
INT4_PANEL_WIDTH = gemm_int4.PANEL_WIDTH  # int4: as kernforge.ops.gemm.int4's
INT4_GROUP = gemm_int4.DEFAULT_GROUP  # pack_experts_int4's default K values per zero point and scale


class CPUQuantMethod(enum.IntEnum):
    """``moe_comp_method``: sgl-kernel's numbers for the experts' weights (its ``CPUQuantMethod``;
    its ``MXFP4`` = 4 is not taken here) and kernforge's ``INT4_W4A16``."""

    UNQUANT = 0  # bf16
    INT8_W8A8 = 1
    FP8_W8A16 = 2
    INT4_W4A8 = 3
    INT4_W4A16 = 5  # kernforge's addition: the int4 weights with the activations as they are


# moe_comp_method -> the module's `weights` parameter (the int4 packing serves two of them)
_WEIGHTS_OF_METHOD = {
    CPUQuantMethod.UNQUANT: "bf16",
    CPUQuantMethod.INT8_W8A8: "int8",
    CPUQuantMethod.FP8_W8A16: "fp8",
    CPUQuantMethod.INT4_W4A8: "int4",
    CPUQuantMethod.INT4_W4A16: "int4_w4a16",
}

_I64 = "int64_t"
# The fused_experts entry's arguments, filled by name per call (run_kernel); strides in elements.
EXPERTS_ARGS = Struct(
    "kf_fused_experts_args",
    (
        ("out", _I64),  # [tokens, hidden] rows, ldo apart
        ("ldo", _I64),
        ("x", _I64),  # [tokens, hidden] rows, ldx apart
        ("ldx", _I64),
        ("tokens", _I64),
        ("hidden", _I64),
        ("inter", _I64),
        ("w1_packed", _I64),
        ("w1_parts", _I64),
        ("w1_compensation", _I64),  # int8: the compensation; int4: the zero points; else 0
        ("w1_scale", _I64),  # int8 / fp8 / int4: the scales; else 0
        ("w2_packed", _I64),
        ("w2_compensation", _I64),
        ("w2_scale", _I64),
        ("block_n", _I64),  # fp8: the scale blocks; int4: w1's group size (block_n) and w2's (block_k)
        ("block_k", _I64),
        ("panel_width", _I64),
        ("experts", _I64),
        ("topk_weights", _I64),  # fp32 [tokens, topk]
        ("topk_ids", _I64),  # int32 [tokens, topk]
        ("topk", _I64),
        ("residual", _I64),  # out += residual_scale * residual ([tokens, hidden] rows, ld_residual apart), or 0
        ("ld_residual", _I64),
        ("residual_scale", "double"),
        ("num_threads", _I64),
    ),
)
EXPERTS = Module(
    "moe_experts",
    "moe_experts.cpp.jinja",
    params={"dtype": DType(), "weights": Enum(("bf16", "int8", "fp8", "int4", "int4_w4a16"))},
    structs=[EXPERTS_ARGS],
    entries=[Entry("fused_experts", "const kf_fused_experts_args* args", returns="int64_t")],
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


@packed_weight(saved_as="kernforge.ops.moe")
class PackedInt4Experts:
    """Stacked four-bit expert weights ``[E, N, K]`` with a zero point and a scale per group of
    ``group_size`` K values, each expert's (and part's) in ``kernforge.ops.gemm.int4``'s layout, packed
    for :func:`fused_experts` with ``moe_comp_method`` ``INT4_W4A8`` or ``INT4_W4A16``; survives
    ``torch.save``/``torch.load``."""

    packed: torch.Tensor  # [E, parts, ceil(N / parts / 64), K / 4, 128] uint8 nibbles
    zeros: torch.Tensor  # [E, parts, K / group_size, N / parts] uint8 (0..16)
    scales: torch.Tensor  # [E, parts, K / group_size, N / parts] fp32
    experts: int
    n: int
    k: int
    group_size: int
    parts: int = 1
    layout_version: int = LAYOUT_VERSION

    @classmethod
    def from_tensors(
        cls, w: torch.Tensor, w_zeros: torch.Tensor, w_scales: torch.Tensor, gated: bool = False
    ) -> PackedInt4Experts:
        """The experts that ``convert_weight_packed_scale_zp``'s three tensors of 3-D checkpoint
        tensors describe (``w [E, ceil(N / 64), K / 4, 128]``, ``w_zeros`` and ``w_scales [E, G, N]``),
        checked, without a copy; ``gated``: a ``w1 [E, 2I, H]`` (repacked in two parts where I is
        not a multiple of 32, so that its up half starts a chunk of the layout)."""
        return _int4_from_tensors(w, w_zeros, w_scales, "w", gated)

    def weight(self, expert: int, part: int = 0) -> gemm_int4.PackedInt4Weight:
        """Part ``part`` of expert ``expert`` as the int4 GEMM's weight (views, no copy)."""
        return gemm_int4.PackedInt4Weight(
            self.packed[expert, part],
            self.zeros[expert, part],
            self.scales[expert, part],
            self.n // self.parts,
            self.k,
            self.group_size,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[E, N, K]`` weights these stand for, ``(code - zero) * scale`` in ``dtype``."""
        return torch.stack(
            [
                torch.cat([gemm_int4.dequantize_int4(self.weight(e, p), dtype) for p in range(self.parts)])
                for e in range(self.experts)
            ]
        )


# Per weight kind: the dataclass, the element dtype, K values per packed word, the panel width.
_KINDS = {
    "bf16": (PackedExperts, torch.bfloat16, 2, PANEL_WIDTH),
    "int8": (PackedInt8Experts, torch.int8, 4, INT8_PANEL_WIDTH),
    "fp8": (PackedFp8Experts, torch.float8_e4m3fn, 1, FP8_PANEL_WIDTH),
    "int4": (PackedInt4Experts, torch.uint8, 8, INT4_PANEL_WIDTH),
}
_PACKED_CLASSES = {cls: kind for kind, (cls, *_) in _KINDS.items()}


def packed_experts_shape(experts: int, n: int, k: int, parts: int, kind: str = "bf16") -> tuple[int, ...]:
    """Shape of the packed tensor of ``[experts, n, k]`` weights of ``kind`` in ``parts`` parts."""
    _, _, per_word, width = _KINDS[kind]
    if kind == "int4":  # K quads of 128 bytes (two 32-column chunks of nibbles) per panel
        return (experts, parts, -(-(n // parts) // width), k // gemm_int4.QUAD, gemm_int4.QUAD_BYTES)
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
    block = gemm_fp8.checked_block_size(block_size)
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


def pack_experts_int4(
    w13: torch.Tensor, w2: torch.Tensor, group_size: int | None = INT4_GROUP, symmetric: bool = False
) -> tuple[PackedInt4Experts, PackedInt4Experts]:
    """Quantize stacked expert weights to four bits and pack them for :func:`fused_experts` with
    ``moe_comp_method`` ``INT4_W4A8`` or ``INT4_W4A16``: ``w13 [E, 2I, H]`` (each expert's gate
    rows, then its up rows) and ``w2 [E, H, I]``, floating (bf16), each expert rounded by
    ``quantize_int4`` per group of ``group_size`` K values (asymmetric, or ``symmetric`` with zero
    8). ``group_size`` must divide H and I; ``None`` takes 128 where it divides a weight's K, else
    the largest multiple of 4 below it that does (as ``kernforge.nn.Linear`` with
    ``quant="int4"``). Returns ``(w1, w2)``; :func:`quantize_experts_int4` packs one of them."""
    for name, w in (("w13", w13), ("w2", w2)):
        check_cpu_tensor(w, name)
        if w.dim() != 3:
            raise ValueError(f"{name} must be 3-D [E, N, K], got shape {tuple(w.shape)}")
    if tuple(w2.shape) != (w13.shape[0], w13.shape[2], w13.shape[1] // 2):
        raise ValueError(f"w13 and w2 must be [E, 2I, H] and [E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    w1 = quantize_experts_int4(w13, True, group_size, symmetric, name="w13")
    return w1, quantize_experts_int4(w2, False, group_size, symmetric, name="w2")


def quantize_experts_int4(
    w: torch.Tensor, gated: bool = False, group_size: int | None = None, symmetric: bool = False, *, name: str = "w"
) -> PackedInt4Experts:
    """One stacked weight ``w [E, N, K]`` (floating) quantized and packed as :func:`pack_experts_int4`
    packs its two, expert by expert (no fp32 copy of the whole stack); ``gated``: a ``w1 [E, 2I,
    H]``, its gate and up halves packed as two parts. ``group_size`` None: as kernforge.nn.Linear
    picks it (128 where it divides K)."""
    check_cpu_tensor(w, name)
    if not w.is_floating_point():
        raise TypeError(f"{name} has dtype {w.dtype}; int4 experts are quantized from floating (bf16) weights")
    if w.dim() != 3:
        raise ValueError(f"{name} must be 3-D [E, N, K], got shape {tuple(w.shape)}")
    if gated and w.shape[1] % 2:
        raise ValueError(f"a gated {name} [E, 2I, H] must have an even N, got shape {tuple(w.shape)}")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
    experts, n, k = map(int, w.shape)
    group = gemm_int4.checked_group_size(k, group_size)
    parts = 2 if gated else 1
    weights = [
        gemm_int4.quantize_int4(part, group, symmetric)
        for expert in w.detach()
        for part in expert.chunk(parts)  # (an empty expert has no chunks: nothing to pack)
    ]
    return _stacked_int4(weights, experts, parts, n, k, group)


def _stacked_int4(weights: list, experts: int, parts: int, n: int, k: int, group: int) -> PackedInt4Experts:
    """Per-part int4 weights (expert by expert, part by part) as one PackedInt4Experts."""
    if not weights:
        raise ValueError(f"int4 experts need at least one expert and one column, got [{experts}, {n}, {k}]")

    def field(name: str) -> torch.Tensor:
        values = torch.stack([getattr(weight, name) for weight in weights])
        return values.view(experts, parts, *values.shape[1:])

    return PackedInt4Experts(field("packed"), field("zeros"), field("scales"), experts, n, k, group, parts)


def _int4_from_tensors(w, zeros, scales, name: str, gated: bool) -> PackedInt4Experts:
    """Packed int4 experts from ``convert_weight_packed_scale_zp``'s tensors of 3-D checkpoint tensors
    (``w [E, ceil(N / 64), K / 4, 128]``, ``zeros``/``scales [E, G, N]``), named ``name`` in errors."""
    expected = {name: (w, torch.uint8), f"{name}_zero": (zeros, torch.uint8), f"{name}_scale": (scales, torch.float32)}
    for label, (t, dtype) in expected.items():
        check_cpu_tensor(t, label)
        if t.dtype is not dtype:
            raise TypeError(
                f"{label} has dtype {t.dtype}; int4 experts take {dtype} (from convert_weight_packed_scale_zp)"
            )
    if w.dim() != 4 or w.shape[3] != gemm_int4.QUAD_BYTES or scales.dim() != 3 or zeros.shape != scales.shape:
        raise ValueError(
            f"{name}, {name}_zero, {name}_scale must be [E, ceil(N/64), K/4, {gemm_int4.QUAD_BYTES}], [E, G, N], "
            f"[E, G, N] (convert_weight_packed_scale_zp of [E, ...] checkpoint tensors), got {tuple(w.shape)}, "
            f"{tuple(zeros.shape)}, {tuple(scales.shape)}"
        )
    experts, groups, n = map(int, scales.shape)
    k = int(w.shape[2]) * gemm_int4.QUAD
    if w.shape[0] != experts or w.shape[1] != -(-n // INT4_PANEL_WIDTH) or groups < 1 or k % groups:
        raise ValueError(
            f"{name} {tuple(w.shape)} does not match {name}_scale {tuple(scales.shape)}: expected "
            f"[{experts}, {-(-n // INT4_PANEL_WIDTH)}, K/4, {gemm_int4.QUAD_BYTES}] with K a multiple of G = {groups}"
        )
    gemm_int4.check_group_size(k, groups)
    gemm_int4.check_zero_points(zeros, f"{name}_zero")
    if gated and n % 2:
        raise ValueError(f"a gated {name} [E, 2I, H] must have an even N, got N = {n}")
    w, zeros, scales = (t.contiguous() for t in (w, zeros, scales))
    packed = PackedInt4Experts(w[:, None], zeros[:, None], scales[:, None], experts, n, k, k // groups, 1)
    if gated and (n // 2) % gemm_int4.CHUNK:
        return _split_gate_up(packed)
    return packed


def _split_gate_up(packed: PackedInt4Experts) -> PackedInt4Experts:
    """A one-part gated int4 weight repacked in two parts (its gate and up halves), each from whole
    panels: the products read whole 32-column chunks, which a half of I % 32 columns does not start."""
    half = packed.n // 2
    halves = []
    for e in range(packed.experts):
        codes, zeros, scales = gemm_int4.unpack_int4(packed.weight(e))
        for columns in (slice(0, half), slice(half, packed.n)):
            halves.append(gemm_int4.pack_int4(codes[columns], zeros[:, columns], scales[:, columns]))
    return _stacked_int4(halves, packed.experts, 2, packed.n, packed.k, packed.group_size)


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
    if kind == "int4":
        group = packed.group_size
        if packed.parts not in (1, 2) or packed.n % packed.parts:
            raise ValueError(f"{name} has {packed.parts!r} parts of its N = {packed.n}; expected 1, or 2 halves")
        if isinstance(group, bool) or not isinstance(group, int) or group < 4 or group % 4 or packed.k % group:
            raise ValueError(f"{name}.group_size must be a multiple of 4 that divides K = {packed.k}, got {group!r}")
    layout = [("packed", dtype, packed_experts_shape(packed.experts, packed.n, packed.k, packed.parts, kind))]
    if kind == "int8":
        columns = (packed.experts, packed.parts, layout[0][2][2] * width)
        layout += [("compensation", torch.int32, columns), ("scale", torch.float32, columns)]
    elif kind == "fp8":
        bn, bk = gemm_fp8.checked_block_size(packed.block_size)
        layout.append(("scale", torch.float32, (packed.experts, -(-packed.n // bn), -(-packed.k // bk))))
    elif kind == "int4":
        per_group = (packed.experts, packed.parts, packed.k // packed.group_size, packed.n // packed.parts)
        layout += [("zeros", torch.uint8, per_group), ("scales", torch.float32, per_group)]
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


def _experts_weight(w: object, name: str, gated: bool, kind: str, scale, block_size, zero=None):
    """``w`` as packed experts of ``kind``: packed ones as they are, a raw stacked weight packed now
    (int4: ``convert_weight_packed_scale_zp``'s tensors, with its zero points ``zero``)."""
    if type(w) in _PACKED_CLASSES:
        if _kind_of(w) != kind:
            raise TypeError(f"{name} is a {type(w).__name__}; {_KIND_FLAGS[kind]} takes {_KINDS[kind][0].__name__}")
        if kind == "fp8" and block_size is not None and tuple(block_size) != w.block_size:
            raise ValueError(
                f"block_size {list(block_size)} differs from the {list(w.block_size)} {name} was packed with"
            )
        if kind == "int4" and (zero is not None or scale is not None):
            raise ValueError(
                f"{name}_zero and {name}_scale must be None when {name} is PackedInt4Experts (it holds them)"
            )
        return _checked_packed(w, name)
    if not isinstance(w, torch.Tensor):
        raise TypeError(
            f"{name} must be packed experts (pack_experts, pack_experts_int8, pack_experts_fp8, pack_experts_int4) "
            f"or a torch.Tensor, got {type(w).__name__}"
        )
    if kind == "int4":
        if zero is None or scale is None:
            raise ValueError(
                f"{_KIND_FLAGS[kind]} with raw {name} needs {name}_zero and {name}_scale "
                "(convert_weight_packed_scale_zp's w_zeros and w_scales)"
            )
        return _int4_from_tensors(w, zero, scale, name, gated)
    _checked_stack(w, name, _KINDS[kind][1], gated, f"fused_experts with {_KIND_FLAGS[kind]}")
    if kind == "bf16":
        return pack_experts(w, gated=gated)
    if scale is None:
        raise ValueError(f"{_KIND_FLAGS[kind]} with raw {name} needs {name}_scale, its scales")
    if kind == "int8":
        return pack_experts_int8(w, scale, gated=gated)
    return pack_experts_fp8(w, scale, (128, 128) if block_size is None else block_size, gated=gated)


# How a call names each kind of weights (sgl-kernel's flags).
_KIND_FLAGS = {
    "bf16": "bf16 weights (no quantization flag)",
    "int8": "use_int8_w8a8",
    "fp8": "use_fp8_w8a16",
    "int4": "moe_comp_method=INT4_W4A8 or INT4_W4A16",
}


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
    if topk_ids.dtype is torch.int64 and topk_ids.numel():  # the kernel checks int32 ids; .to(int32) would wrap these
        low, high = torch.aminmax(topk_ids)
        if not -(2**31) <= int(low) <= int(high) < 2**31:
            bad = int(low) if int(low) < -(2**31) else int(high)
            raise ValueError(f"topk_ids holds {bad}, not an expert id in [0, {experts}); nothing was written")
    return topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int32).contiguous()


# --------------------------------------------------------------------------- the custom op

# The flags a custom op's arguments name the weights with: its int4 group sizes (non-zero for int4
# weights) and w4a16 choose between the two int4 ops.
_SCHEMA_QUANT = "int w1_group_size=0, int w2_group_size=0, bool w4a16=False"


def _schema_arguments(hidden_states, w1, w2, weights: str) -> tuple[list, tuple]:
    """The custom op's weight arguments ([hidden_states, w1's five, w2's five]) and its trailing
    ints (block_n, block_k, w1_group_size, w2_group_size, w4a16)."""
    arguments = [hidden_states]
    for packed in (w1, w2):
        check_layout_version(packed, LAYOUT_VERSION)
        if _kind_of(packed) == "int4":
            compensation, scale = packed.zeros, packed.scales
        else:
            compensation, scale = getattr(packed, "compensation", None), getattr(packed, "scale", None)
        # fp8 weights travel as their bytes: torch's schema checks compare tensors with arithmetic fp8 lacks
        words = packed.packed.view(torch.uint8) if _kind_of(packed) == "fp8" else packed.packed
        arguments += [words, compensation, scale, packed.n, packed.k]
    groups = (w1.group_size, w2.group_size) if _kind_of(w1) == "int4" else (0, 0)
    return arguments, (*getattr(w1, "block_size", (0, 0)), *groups, weights == "int4_w4a16")


def _to_schema(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, use_int8_w8a8=False,
               use_fp8_w8a16=False, **options):  # fmt: skip
    out = options.pop("out", None)
    w1, w2, weights = _packed_pair(w1, w2, use_int8_w8a8, use_fp8_w8a16, **options)
    arguments, trailing = _schema_arguments(hidden_states, w1, w2, weights)
    return (*arguments, topk_weights, topk_ids, *trailing), hidden_states if inplace else out


def _rebuilt(packed, compensation, scale, n, k, block_n, block_k, group_size=0):
    """Packed experts from a custom op's tensors and ints."""
    experts, parts = int(packed.shape[0]), int(packed.shape[1])
    if group_size:  # int4: the zero points in the compensation's place
        return PackedInt4Experts(packed, compensation, scale, experts, n, k, group_size, parts)
    if block_n:  # fp8, as its bytes
        return PackedFp8Experts(packed.view(torch.float8_e4m3fn), scale, (block_n, block_k), experts, n, k, parts)
    if compensation is not None:
        return PackedInt8Experts(packed, compensation, scale, experts, n, k, parts)
    return PackedExperts(packed, experts, n, k, parts)


def _rebuilt_pair(w1, w1_compensation, w1_scale, w1_n, w1_k, w2, w2_compensation, w2_scale, w2_n, w2_k, block_n,
                  block_k, w1_group_size, w2_group_size, w4a16) -> tuple:  # fmt: skip
    """(w1, w2, the flags that name their kind) from a custom op's arguments."""
    w1 = _rebuilt(w1, w1_compensation, w1_scale, w1_n, w1_k, block_n, block_k, w1_group_size)
    w2 = _rebuilt(w2, w2_compensation, w2_scale, w2_n, w2_k, block_n, block_k, w2_group_size)
    kind = _kind_of(w1)
    if kind == "int4":
        method = CPUQuantMethod.INT4_W4A16 if w4a16 else CPUQuantMethod.INT4_W4A8
        return w1, w2, {"moe_comp_method": method}
    return w1, w2, {"use_int8_w8a8": kind == "int8", "use_fp8_w8a16": kind == "fp8"}


def _from_schema(hidden_states, w1, w1_compensation, w1_scale, w1_n, w1_k, w2, w2_compensation, w2_scale, w2_n, w2_k,
                 topk_weights, topk_ids, block_n=0, block_k=0, w1_group_size=0, w2_group_size=0, w4a16=False,
                 out=None):  # fmt: skip
    w1, w2, flags = _rebuilt_pair(w1, w1_compensation, w1_scale, w1_n, w1_k, w2, w2_compensation, w2_scale, w2_n,
                                  w2_k, block_n, block_k, w1_group_size, w2_group_size, w4a16)  # fmt: skip
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, out=out, **flags)


_TRACED = Traced(
    "Tensor",
    fake=lambda hidden_states, *args, **kwargs: torch.empty_like(hidden_states),
    with_out=True,
    arguments="Tensor hidden_states, Tensor w1, Tensor? w1_compensation, Tensor? w1_scale, int w1_n, int w1_k, "
    "Tensor w2, Tensor? w2_compensation, Tensor? w2_scale, int w2_n, int w2_k, Tensor topk_weights, Tensor topk_ids, "
    f"int block_n=0, int block_k=0, {_SCHEMA_QUANT}",
    from_schema=_from_schema,
    to_schema=_to_schema,
)


def _shared_to_schema(hidden_states, w1, w2, fused_experts_out=None, routed_scaling_factor=None, inplace=False,
                      use_int8_w8a8=False, use_fp8_w8a16=False, w1_scale=None, w2_scale=None, block_size=None,
                      a1_scale=None, a2_scale=None, moe_comp_method=None, w1_zero=None, w2_zero=None,
                      out=None):  # fmt: skip
    weights = _weights_named(use_int8_w8a8, use_fp8_w8a16, moe_comp_method)
    w1, w1_scale, w1_zero = _single_expert(w1, "w1", w1_scale, w1_zero, weights)
    w2, w2_scale, w2_zero = _single_expert(w2, "w2", w2_scale, w2_zero, weights)
    w1, w2, weights = _packed_pair(w1, w2, use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size, a1_scale,
                                   a2_scale, moe_comp_method, w1_zero, w2_zero)  # fmt: skip
    arguments, trailing = _schema_arguments(hidden_states, w1, w2, weights)
    return (*arguments, fused_experts_out, routed_scaling_factor, *trailing), hidden_states if inplace else out


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
    w1_group_size=0,
    w2_group_size=0,
    w4a16=False,
    out=None,
):
    w1, w2, flags = _rebuilt_pair(w1, w1_compensation, w1_scale, w1_n, w1_k, w2, w2_compensation, w2_scale, w2_n,
                                  w2_k, block_n, block_k, w1_group_size, w2_group_size, w4a16)  # fmt: skip
    return shared_expert(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor, out=out, **flags)


_SHARED_TRACED = Traced(
    "Tensor",
    fake=lambda hidden_states, *args, **kwargs: torch.empty_like(hidden_states),
    with_out=True,
    arguments="Tensor hidden_states, Tensor w1, Tensor? w1_compensation, Tensor? w1_scale, int w1_n, int w1_k, "
    "Tensor w2, Tensor? w2_compensation, Tensor? w2_scale, int w2_n, int w2_k, Tensor? fused_experts_out, "
    f"float? routed_scaling_factor, int block_n=0, int block_k=0, {_SCHEMA_QUANT}",
    from_schema=_shared_from_schema,
    to_schema=_shared_to_schema,
)


def run_kernel(kernel, out, x, w1, w2, topk_weights, topk_ids, residual=None, residual_scale=0.0) -> int:
    """The module's entry on checked arguments (rows with unit stride, fp32 weights, int32 ids, w1
    and w2 packed alike; out += residual_scale * residual where given); returns its status: 0, else
    1 + the flat index of the first expert id out of range."""
    kind = _kind_of(w1)
    block_n, block_k = 0, 0
    if kind == "int4":  # the zero points as the compensation; each weight's group size as a block size
        extras = (w1.zeros, w1.scales, w2.zeros, w2.scales)
        block_n, block_k = w1.group_size, w2.group_size
    elif kind == "int8":
        extras = (w1.compensation, w1.scale, w2.compensation, w2.scale)
    elif kind == "fp8":
        extras = (None, w1.scale, None, w2.scale)
        block_n, block_k = w1.block_size
    else:
        extras = (None, None, None, None)
    fields = {
        "out": out.data_ptr(),
        "ldo": out.stride(0),
        "x": x.data_ptr(),
        "ldx": x.stride(0),
        "tokens": x.shape[0],
        "hidden": x.shape[1],
        "inter": w2.k,
        "w1_packed": w1.packed.data_ptr(),
        "w1_parts": w1.parts,
        "w2_packed": w2.packed.data_ptr(),
        "block_n": block_n,
        "block_k": block_k,
        "panel_width": _KINDS[kind][3],
        "experts": w1.experts,
        "topk_weights": topk_weights.data_ptr(),
        "topk_ids": topk_ids.data_ptr(),
        "topk": topk_ids.shape[1],
        "num_threads": num_threads(),
    }
    for name, t in zip(("w1_compensation", "w1_scale", "w2_compensation", "w2_scale"), extras):
        if t is not None:
            fields[name] = t.data_ptr()
    if residual is not None:
        fields.update(residual=residual.data_ptr(), ld_residual=residual.stride(0), residual_scale=residual_scale)
    return kernel.fused_experts(kernel.new("kf_fused_experts_args", fields))


def _weights_named(use_int8_w8a8=False, use_fp8_w8a16=False, moe_comp_method=None) -> str:
    """The module's ``weights`` parameter that the flags name: sgl-kernel's use_* flags or its
    ``moe_comp_method`` (which may repeat them, not contradict them)."""
    if use_int8_w8a8 and use_fp8_w8a16:
        raise ValueError("use_int8_w8a8 and use_fp8_w8a16 exclude each other")
    flagged = "int8" if use_int8_w8a8 else "fp8" if use_fp8_w8a16 else None
    if moe_comp_method is None:
        return flagged or "bf16"
    if isinstance(moe_comp_method, bool) or not isinstance(moe_comp_method, int):
        raise TypeError(f"moe_comp_method must be an int (CPUQuantMethod), got {moe_comp_method!r}")
    try:
        weights = _WEIGHTS_OF_METHOD[CPUQuantMethod(moe_comp_method)]
    except ValueError:
        taken = ", ".join(f"{m.value} ({m.name})" for m in CPUQuantMethod)
        raise ValueError(f"moe_comp_method must be one of {taken}, got {moe_comp_method!r}") from None
    if flagged is not None and flagged != weights:
        raise ValueError(
            f"moe_comp_method={CPUQuantMethod(moe_comp_method).name} contradicts "
            f"{'use_int8_w8a8' if flagged == 'int8' else 'use_fp8_w8a16'}=True"
        )
    return weights


def _packed_pair(w1, w2, use_int8_w8a8=False, use_fp8_w8a16=False, w1_scale=None, w2_scale=None, block_size=None,
                 a1_scale=None, a2_scale=None, moe_comp_method=None, w1_zero=None, w2_zero=None):  # fmt: skip
    """w1, w2 packed as the kind of weights the flags name (checked), and the module's ``weights``
    parameter for them."""
    for name, scale in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if scale is not None:
            raise ValueError(
                f"{name} must be None: kernforge quantizes activations per token, dynamically (no static scales)"
            )
    weights = _weights_named(use_int8_w8a8, use_fp8_w8a16, moe_comp_method)
    kind = "int4" if weights.startswith("int4") else weights
    if kind == "bf16" and (w1_scale is not None or w2_scale is not None):
        raise ValueError(
            "w1_scale and w2_scale are for quantized weights: pass use_int8_w8a8, use_fp8_w8a16 or moe_comp_method"
        )
    if kind != "int4" and (w1_zero is not None or w2_zero is not None):
        raise ValueError("w1_zero and w2_zero are for int4 weights (moe_comp_method=INT4_W4A8 or INT4_W4A16)")
    if kind != "fp8" and block_size is not None:
        raise ValueError("block_size is for fp8 weights (use_fp8_w8a16=True)")
    w1 = _experts_weight(w1, "w1", True, kind, w1_scale, block_size, w1_zero)
    w2 = _experts_weight(w2, "w2", False, kind, w2_scale, block_size, w2_zero)
    if kind == "fp8" and w1.block_size != w2.block_size:
        raise ValueError(f"w1 and w2 were packed with different block sizes, {w1.block_size} and {w2.block_size}")
    return w1, w2, weights


# weights -> {activation dtype -> variant}; the op's own table holds the bf16 ones
_QUANTIZED_VARIANTS: dict[str, dict] = {"int8": {}, "fp8": {}, "int4": {}, "int4_w4a16": {}}


def _variant(op, hidden_states, weights: str):
    """The module variant for ``hidden_states``' dtype (checked here) and the ``weights`` parameter."""
    variant = variant_for_input(op.kernels, hidden_states, "hidden_states")
    if weights == "bf16":
        return variant
    variants = _QUANTIZED_VARIANTS[weights]
    found = variants.get(hidden_states.dtype)
    if found is None:
        found = variants[hidden_states.dtype] = EXPERTS.variant(dtype=DTYPE_NAMES[hidden_states.dtype], weights=weights)
    return found


def _experts(op, hidden_states, w1, w2, weights, topk_weights, topk_ids, inplace, out, residual=None,
             residual_scale=0.0):  # fmt: skip
    """What fused_experts and shared_expert share, from their packed weights on: the checks, the
    output, the kernel call."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [T, H], got shape {tuple(hidden_states.shape)}")
    tokens, hidden = map(int, hidden_states.shape)
    kind = _kind_of(w1)
    variant = _variant(op, hidden_states, weights)
    inter = w2.k
    if (w1.experts, w1.n, w1.k) != (w2.experts, 2 * inter, hidden) or w2.n != hidden:
        raise ValueError(
            f"w1 [{w1.experts}, {w1.n}, {w1.k}] and w2 [{w2.experts}, {w2.n}, {w2.k}] must be [E, 2I, H] and "
            f"[E, H, I] with H = {hidden} (hidden_states' last dimension)"
        )
    width = gemm_int4.CHUNK if kind == "int4" else _KINDS[kind][3]  # int4 tiles start at whole chunks
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
        # in place (out is hidden_states, or fused_experts_out) works; other sharing reads rows overwritten
        check_no_overlap(out, "out", hidden_states, "hidden_states", same_ok=True)
        if residual is not None:
            check_no_overlap(out, "out", residual, "fused_experts_out", same_ok=True)
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


_ExpertsWeight = PackedExperts | PackedInt8Experts | PackedFp8Experts | PackedInt4Experts | torch.Tensor


@kernel_op(EXPERTS, traced=_TRACED, weights="bf16")
def fused_experts(
    hidden_states: torch.Tensor,
    w1: _ExpertsWeight,
    w2: _ExpertsWeight,
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
    moe_comp_method: int | None = None,
    w1_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE MLP of ``hidden_states [T, H]`` over each token's ``topk_ids [T, k]`` experts
    weighted by ``topk_weights [T, k]`` (any float dtype, read as fp32), in ``hidden_states``' dtype
    (fp32 accumulation), sgl-kernel's ``fused_experts_cpu`` (its arguments in its order). ``w1`` the
    stacked gate/up weights ``[E, 2I, H]`` and ``w2`` the down weights ``[E, H, I]``: bf16
    (:class:`PackedExperts` or raw); with ``use_int8_w8a8``, int8 (:class:`PackedInt8Experts`, or raw
    with per-channel ``w1_scale [E, 2I]`` and ``w2_scale [E, H]``); with ``use_fp8_w8a16``, e4m3fn
    (:class:`PackedFp8Experts`, or raw with block scales ``w1_scale``, ``w2_scale`` for
    ``block_size = [bn, bk]``, 128 x 128 by default). ``moe_comp_method`` (sgl-kernel's newer name
    for the quantization, :class:`CPUQuantMethod`'s numbers) may say the same, and names the int4
    weights: ``INT4_W4A8`` (3, the activations quantized per token to int8) or ``INT4_W4A16`` (5,
    kernforge's: as they are), :class:`PackedInt4Experts` (:func:`pack_experts_int4`) or raw
    ``convert_weight_packed_scale_zp`` tensors with their zero points ``w1_zero``/``w2_zero`` and
    scales ``w1_scale``/``w2_scale``. ``a1_scale``/``a2_scale`` (static activation scales) must be
    None. ``inplace=True`` writes the result into ``hidden_states``; ``out`` is a buffer to write."""
    w1, w2, weights = _packed_pair(w1, w2, use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size, a1_scale,
                                   a2_scale, moe_comp_method, w1_zero, w2_zero)  # fmt: skip
    return _experts(fused_experts, hidden_states, w1, w2, weights, topk_weights, topk_ids, inplace, out)


def _single_expert(w, name: str, scale, zero, weights: str):
    """A shared expert's weight (or its scales and zero points) as a stack of one; packed ones as they
    are. Raw ones are 2-D, an int4 one ``convert_weight_packed_scale_zp``'s 3-D packing."""
    dims = 3 if weights.startswith("int4") else 2
    if isinstance(w, torch.Tensor) and w.dim() == dims:
        stacked = [None if t is None else t.reshape(1, *t.shape) for t in (scale, zero)]
        return w[None], *stacked
    if isinstance(w, torch.Tensor):
        raise ValueError(f"{name} must be {dims}-D (one shared expert), got shape {tuple(w.shape)}")
    if type(w) in _PACKED_CLASSES and w.experts != 1:
        raise ValueError(f"{name} holds {w.experts} experts; a shared expert is one (pack w[None])")
    return w, scale, zero


@kernel_op(EXPERTS, traced=_SHARED_TRACED, weights="bf16")
def shared_expert(
    hidden_states: torch.Tensor,
    w1: _ExpertsWeight,
    w2: _ExpertsWeight,
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
    moe_comp_method: int | None = None,
    w1_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """sgl-kernel's ``shared_expert_cpu``: DeepSeek's always-on expert ``W2 (silu(W1g x) * W1u x)``
    on every token of ``hidden_states [T, H]``, plus ``routed_scaling_factor * fused_experts_out``
    (the routed experts' output, ``[T, H]``) in the same pass, rounded once. ``w1 [2I, H]``,
    ``w2 [H, I]`` (raw, with ``w1_scale``/``w2_scale`` as for :func:`fused_experts` less the expert
    dimension, or packed as a stack of one: ``pack_experts(w1[None], gated=True)``); the
    quantization flags (int4 too: ``moe_comp_method``, with ``w1_zero``/``w2_zero`` for raw
    weights), ``inplace`` and ``out`` as for :func:`fused_experts`."""
    if (fused_experts_out is None) != (routed_scaling_factor is None):
        raise ValueError("give fused_experts_out and routed_scaling_factor together (the output adds their product)")
    variant_for_input(shared_expert.kernels, hidden_states, "hidden_states")  # its dtype before fused_experts_out's
    if fused_experts_out is not None:
        check_cpu_tensor(fused_experts_out, "fused_experts_out")
        if fused_experts_out.dtype is not hidden_states.dtype or fused_experts_out.shape != hidden_states.shape:
            raise ValueError(
                f"fused_experts_out must match hidden_states ({hidden_states.dtype}, {tuple(hidden_states.shape)}), "
                f"got {fused_experts_out.dtype}, {tuple(fused_experts_out.shape)}"
            )
        if fused_experts_out.stride(-1) != 1:
            fused_experts_out = fused_experts_out.contiguous()
    weights = _weights_named(use_int8_w8a8, use_fp8_w8a16, moe_comp_method)
    w1, w1_scale, w1_zero = _single_expert(w1, "w1", w1_scale, w1_zero, weights)
    w2, w2_scale, w2_zero = _single_expert(w2, "w2", w2_scale, w2_zero, weights)
    w1, w2, weights = _packed_pair(w1, w2, use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size, a1_scale,
                                   a2_scale, moe_comp_method, w1_zero, w2_zero)  # fmt: skip
    tokens = hidden_states.shape[0] if hidden_states.dim() == 2 else 0
    every_token = torch.zeros(tokens, 1, dtype=torch.int32)
    scale = 0.0 if routed_scaling_factor is None else float(routed_scaling_factor)
    return _experts(shared_expert, hidden_states, w1, w2, weights, torch.ones(tokens, 1), every_token, inplace, out,
                    fused_experts_out, scale)  # fmt: skip


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    """A MoE model's experts run fused_experts in its dtype, on int8 weights with quant="int8", fp8
    ones with quant="fp8_block", int4 ones with quant="int4" (W4A8) or "int4_w4a16"."""
    if not spec.num_experts:
        return []
    weights = {"int8": "int8", "fp8_block": "fp8", "int4": "int4", "int4_w4a16": "int4_w4a16"}.get(quant, "bf16")
    return [{"module": "moe_experts", "params": {"dtype": dtype_name(spec.dtype), "weights": weights}}]
