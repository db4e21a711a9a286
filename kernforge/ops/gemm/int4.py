"""Four-bit weights: int4 linear layers with sgl-kernel's CPU names (``sgl-kernel/csrc/cpu/gemm_int4.cpp``,
``gemm_int4_w4a16.cpp``), one packing for both ways of multiplying it.

* ``convert_weight_packed_scale_zp(qweight, qzeros, scales, quant_method_4bit)`` -> ``(w, w_zeros,
  w_scales)``: a checkpoint's 4-bit weight, zero points and group scales, as AWQ (``AWQ`` = 0), GPTQ
  (``GPTQ`` = 1) or compressed-tensors ``pack-quantized`` (``PACK_QUANTIZED`` = 2, kernforge's
  addition) store them, repacked for kernforge's kernels. Three tensors, as sgl-kernel returns them
  (callers wrap them in ``nn.Parameter``); every size follows from their shapes.
* ``int4_scaled_mm_cpu(x, w, w_zeros, w_scales, bias)`` (W4A8): ``x`` is quantized per token to
  int8 inside the call, as ``int8_scaled_mm_with_quant`` does, and multiplied on the int8
  micro-kernels (vpdpbusd with VNNI, vpmaddwd without, scalar on the generic tier); each group's
  int32 sum is exact, then scaled by its fp32 group scale.
* ``int4_w4a16_linear(x, w, w_zeros, w_scales, bias)`` (W4A16): ``x`` as it is (bf16, fp16, fp32) on the
  bf16 micro-kernels (vdpbf16ps where the CPU has it); the weight's ``code - zero`` values are exact in
  bf16, each group's sum is fp32, then scaled.
* ``quantize_int4(weight, group_size=128, symmetric=False)`` -> :class:`PackedInt4Weight`, for bf16
  weights: round to nearest per group of ``group_size`` K elements, GPTQ's grid (asymmetric:
  ``scale = (max - min) / 15`` over a range that holds 0, ``zero = round(-min / scale)``;
  symmetric: ``scale = 2 * amax / 15``, ``zero = 8``).

Both ops compute ``out[m, n] = sum_g scale[g, n] * sum_{k in g} a[m, k] * (code[n, k] - zero[g, n])``
(+ ``bias``), ``a`` being ``x`` or its int8 quantization times its per-token scale.

Layout (``LAYOUT_VERSION`` 1). ``w`` is uint8 ``[ceil(N / 64), K / 4, 128]``: N in panels of 64
columns, each panel K quad by K quad (4 K), each quad 128 bytes, two chunks of 32 columns; byte ``b`` of
chunk ``h`` holds column ``32h + b // 4`` at K ``4q + b % 4`` in its low nibble and column
``32h + 16 + b // 4`` in its high one (so a 64-byte load unpacks with one mask and one shift into two
vectors of the int8 kernels' VNNI-4 words). Columns past N hold code 0. ``w_zeros`` is uint8 ``[G, N]``
(0..16: GPTQ's stored ``z - 1`` plus one can be 16), ``w_scales`` fp32 ``[G, N]``; K is a whole number
of groups and of quads.
"""

from __future__ import annotations

import enum

import torch

from kernforge.jit import isa
from kernforge.jit.module import ALL_TIERS, DType, Entry, Int, Module, Struct
from kernforge.jit.tuning import Candidate, Candidates
from kernforge.ops._common import TORCH_DTYPES, dtype_name, num_threads
from kernforge.ops._registry import DTYPE_NAMES, Traced, export, kernel_op, model_kernels
from kernforge.ops.gemm._common import STATUS, check_cpu_tensor, checked_fp32_bias, matrix_rows, packed_weight
from kernforge.ops.gemm.bf16 import m_bucket

LAYOUT_VERSION = 1
PANEL_WIDTH = 64  # columns per panel; the kernels' tile width divides it
QUAD = 4  # K elements per packed quad (one VNNI-4 word per column once unpacked)
QUAD_BYTES = PANEL_WIDTH * QUAD // 2
DEFAULT_GROUP = 128  # K elements per scale and zero point where a weight is quantized here (checkpoints' usual)
CHUNK = 32  # columns per 64-byte chunk: low nibbles are its first 16, high nibbles its last 16
MAX_ZERO = 16  # GPTQ's "stored zero + 1" reaches 16


class Int4Format(enum.IntEnum):
    """``quant_method_4bit``: how a checkpoint packs its nibbles (sgl-kernel's ``CPUQuantAlgo``
    numbers AWQ 0 and GPTQ 1)."""

    AWQ = 0  # qweight int32 [K, N/8], qzeros int32 [G, N/8], nibble order 0,4,1,5,2,6,3,7; scales [G, N]
    GPTQ = 1  # qweight int32 [K/8, N] (packed along K), qzeros int32 [G, N/8] holding z - 1; scales [G, N]
    PACK_QUANTIZED = 2  # compressed-tensors: weight_packed int32 [N, K/8], zero points int32 [N/8, G] or
    # None (symmetric, offset 8); weight_scale [N, G]


AWQ, GPTQ, PACK_QUANTIZED = Int4Format.AWQ, Int4Format.GPTQ, Int4Format.PACK_QUANTIZED
_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j of an AWQ word is its nibble _AWQ_ORDER[j]
_SEQUENTIAL = tuple(range(8))

_I64 = "int64_t"
INT4_GEMM_ARGS = Struct(
    "kf_int4_gemm",
    tuple(
        (name, _I64)
        for name in (
            "x",  # [m, k] rows, ldx elements apart
            "ldx",
            "packed",  # uint8 [ceil(n / 64), k / 4, 128]
            "zeros",  # uint8 [k / group_size, n]
            "scales",  # fp32 [k / group_size, n]
            "bias",  # fp32 [n] or 0
            "out",  # [m, n] rows, ldo elements apart (int32 [m, k / group_size, n] for group_sums)
            "ldo",
            "m",
            "n",
            "k",
            "group_size",
            "q",  # W4A8: uint8 [m, k] scratch for the quantized rows
            "q_scale",  # W4A8: fp32 [m] scratch for their scales
            "num_threads",
        )
    ),
)
GEMM_INT4 = Module(
    "gemm_int4",
    "gemm_int4.cpp.jinja",
    params={"dtype": DType(), "row_block": Int(choices=(64, 128, 256)), "few_rows": Int(choices=(1, 2, 4, 8, 16))},
    structs=[INT4_GEMM_ARGS],
    entries=[
        Entry("w4a8", "const kf_int4_gemm* args", returns="int64_t"),
        Entry("w4a16", "const kf_int4_gemm* args", returns="int64_t"),
        Entry("w4a8_group_sums", "const kf_int4_gemm* args", returns="int64_t"),
    ],
    tiers=ALL_TIERS,
)


DEFAULT_BLOCKING = {"row_block": 128, "few_rows": 4}


def _blocking(rank: int, when, **changed) -> Candidate:
    return Candidate({**DEFAULT_BLOCKING, **changed}, ALL_TIERS, rank, when=when)


# The tuner's candidates (python -m kernforge tune gemm_int4), per (x dtype, M bucket, N, K, group): rows
# per task (an unpacked block serves them all: more rows, fewer unpacks, a bigger tile) where M spans
# more than one task, and how many rows still go straight from the nibbles (decode; up to 16 rows in
# passes of 4) where M is that small.
INT4_CANDIDATES = Candidates(
    "int4_gemm",
    GEMM_INT4,
    candidates=[
        _blocking(0, lambda shape: True),
        _blocking(1, lambda shape: shape["m"] > 64, row_block=256),
        _blocking(2, lambda shape: shape["m"] > 64, row_block=64),
        _blocking(3, lambda shape: 2 < shape["m"] <= 4, few_rows=2),
        _blocking(4, lambda shape: 4 < shape["m"] <= 16, few_rows=16),  # small batches from the nibbles too
    ],
    reference=Candidate({"row_block": 64, "few_rows": 1}, ALL_TIERS),
    bucket=lambda s: f"{s['dtype']}_m{s['m']}_n{s['n']}_k{s['k']}_g{s['group']}",
)


def tile_shape(dtype: torch.dtype, m: int, n: int, k: int, group_size: int) -> dict:
    """The problem as the candidates see it: x's dtype name, M's power-of-two bucket, N, K, group."""
    return {
        "dtype": DTYPE_NAMES[dtype],
        "m": m_bucket(m),
        "n": n,
        "k": k,
        "group": group_size,
    }


_CHOSEN: dict[tuple, object] = {}  # (tile_shape items, tier) -> the variant dispatch runs


def reset_choices() -> None:
    """Forget the blocking dispatch chose, so the next calls read the tuning records again."""
    _CHOSEN.clear()


def _chosen_kernel(x: torch.Tensor, m: int, packed, config: dict | None = None):
    if config is not None:
        return GEMM_INT4.variant(dtype=DTYPE_NAMES[x.dtype], **config).kernel()
    shape = tile_shape(x.dtype, m, packed.n, packed.k, packed.group_size)
    key = (*shape.values(), isa.selected_tier())
    found = _CHOSEN.get(key)
    if found is None:
        params = INT4_CANDIDATES.choose(shape, tier=key[-1]).params
        found = _CHOSEN[key] = GEMM_INT4.variant(dtype=shape["dtype"], **params)
    return found.kernel()


@packed_weight(saved_as="kernforge.ops.gemm_int4")
class PackedInt4Weight:
    """A 4-bit weight ``[n, k]`` with its per-group zero points and scales, packed for both int4 ops;
    survives ``torch.save``/``torch.load``. ``tuple(p)`` is ``(w, w_zeros, w_scales)``, what the
    sgl-kernel-named ops take."""

    packed: torch.Tensor  # uint8 [ceil(n / 64), k / 4, 128]
    zeros: torch.Tensor  # uint8 [k / group_size, n]
    scales: torch.Tensor  # fp32 [k / group_size, n]
    n: int
    k: int
    group_size: int
    layout_version: int = LAYOUT_VERSION

    def __iter__(self):
        return iter((self.packed, self.zeros, self.scales))

    @classmethod
    def from_tensors(cls, w: torch.Tensor, w_zeros: torch.Tensor, w_scales: torch.Tensor) -> PackedInt4Weight:
        """The weight that ``convert_weight_packed_scale_zp``'s three tensors describe, checked,
        zero points included (the kernels take ``code - zero`` as a byte)."""
        weight = cls._described_by(w, w_zeros, w_scales)
        check_zero_points(w_zeros, "w_zeros")
        return weight

    @classmethod
    def _described_by(cls, w: torch.Tensor, w_zeros: torch.Tensor, w_scales: torch.Tensor) -> PackedInt4Weight:
        """The weight of three tensors whose layout is checked (not the zero points' values)."""
        for name, t, dtype in (("w", w, torch.uint8), ("w_zeros", w_zeros, torch.uint8), ("w_scales", w_scales, None)):
            check_cpu_tensor(t, name)
            if dtype is not None and t.dtype is not dtype:
                raise TypeError(f"{name} has dtype {t.dtype}; expected {dtype} (from convert_weight_packed_scale_zp)")
        if w_scales.dtype is not torch.float32:
            raise TypeError(f"w_scales has dtype {w_scales.dtype}; expected torch.float32")
        if w.dim() != 3 or w.shape[2] != QUAD_BYTES or w_scales.dim() != 2 or w_zeros.shape != w_scales.shape:
            raise ValueError(
                f"w, w_zeros, w_scales must be [ceil(N/64), K/4, {QUAD_BYTES}], [G, N], [G, N] "
                f"(from convert_weight_packed_scale_zp), got {tuple(w.shape)}, {tuple(w_zeros.shape)}, "
                f"{tuple(w_scales.shape)}"
            )
        groups, n = w_scales.shape
        k = w.shape[1] * QUAD
        if n < 1 or groups < 1 or k % groups or w.shape[0] != -(-n // PANEL_WIDTH):
            raise ValueError(
                f"w {tuple(w.shape)} does not match w_scales {tuple(w_scales.shape)}: "
                f"expected [{-(-n // PANEL_WIDTH)}, K/4, {QUAD_BYTES}] with K a multiple of G = {groups}"
            )
        for name, t in (("w", w), ("w_zeros", w_zeros), ("w_scales", w_scales)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (as convert_weight_packed_scale_zp returns it)")
        return cls(w, w_zeros, w_scales, int(n), int(k), int(k // groups))


# --------------------------------------------------------------------------- packing


def pack_int4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> PackedInt4Weight:
    """Pack 4-bit ``codes [N, K]`` (uint8 0..15) with ``zeros [G, N]`` (0..16) and ``scales [G, N]``:
    the weight is ``(codes - zeros) * scales``, group ``g`` covering K ``[g * K/G, (g + 1) * K/G)``."""
    for name, t in (("codes", codes), ("zeros", zeros), ("scales", scales)):
        check_cpu_tensor(t, name)
    if codes.dim() != 2 or zeros.dim() != 2 or scales.dim() != 2:
        raise ValueError("codes must be [N, K], zeros and scales [G, N]")
    n, k = codes.shape
    groups = scales.shape[0]
    if tuple(scales.shape) != (groups, n) or tuple(zeros.shape) != (groups, n):
        raise ValueError(
            f"zeros and scales must be [G, {n}] to match codes [{n}, {k}], got "
            f"{tuple(zeros.shape)} and {tuple(scales.shape)}"
        )
    check_group_size(k, groups)
    if not scales.is_floating_point():
        raise TypeError(f"scales has dtype {scales.dtype}; expected a floating dtype (stored as float32)")
    codes, zeros = _checked_codes(codes, "codes", 15), _checked_codes(zeros, "zeros", MAX_ZERO)
    return PackedInt4Weight(
        pack_nibbles(codes),
        zeros.contiguous(),
        scales.to(torch.float32, copy=True).contiguous(),
        int(n),
        int(k),
        k // groups,
    )


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit ``codes [N, K]`` (uint8 0..15, K a multiple of 4) -> uint8 ``[ceil(N / 64), K / 4, 128]`` in
    the layout of the module's docstring (columns past N hold 0). Also GGUF's 4-bit types' codes."""
    n, k = codes.shape
    padded = padded_to_panels(codes)
    panels = padded.shape[0] // PANEL_WIDTH
    # [panel, chunk, half, column, quad, 4] -> [panel, quad, chunk, column, 4] bytes: low | high << 4
    blocks = padded.view(panels, PANEL_WIDTH // CHUNK, 2, CHUNK // 2, k // QUAD, QUAD)
    low, high = blocks[:, :, 0], blocks[:, :, 1]
    return (low | (high << 4)).permute(0, 3, 1, 2, 4).reshape(panels, k // QUAD, QUAD_BYTES).contiguous()


def padded_to_panels(rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``rows [N, ...]`` (in ``dtype``, default its own) with zero rows appended up to whole panels of
    ``PANEL_WIDTH`` (what every panel-major packing starts from)."""
    panels = -(-rows.shape[0] // PANEL_WIDTH)
    padded = torch.zeros(panels * PANEL_WIDTH, *rows.shape[1:], dtype=dtype or rows.dtype)
    padded[: rows.shape[0]] = rows
    return padded


def unpack_nibbles(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """:func:`pack_nibbles` undone: codes uint8 ``[n, k]``."""
    panels = packed.shape[0]
    nibbles = packed.view(panels, k // QUAD, PANEL_WIDTH // CHUNK, CHUNK // 2, QUAD)
    halves = torch.stack((nibbles & 0xF, nibbles >> 4), dim=3)  # [panel, quad, chunk, half, column, 4]
    return halves.permute(0, 2, 3, 4, 1, 5).reshape(panels * PANEL_WIDTH, k)[:n]


def unpack_int4(packed: PackedInt4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [N, K], zeros [G, N], scales [G, N])``: :func:`pack_int4` undone (for checks, and for
    callers that dequantize)."""
    return unpack_nibbles(packed.packed, packed.n, packed.k), packed.zeros, packed.scales


def dequantize_int4(packed: PackedInt4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``[N, K]`` a packed one stands for: ``(code - zero) * scale``, in ``dtype``."""
    codes, zeros, scales = unpack_int4(packed)
    group = packed.group_size
    values = codes.to(torch.float32) - zeros.t().repeat_interleave(group, dim=1).to(torch.float32)
    return (values * scales.t().repeat_interleave(group, dim=1)).to(dtype)


def quantize_int4(
    weight: torch.Tensor, group_size: int | None = DEFAULT_GROUP, symmetric: bool = False
) -> PackedInt4Weight:
    """Round ``weight [N, K]`` (floating) to 4 bits per group of ``group_size`` K elements (``None``:
    :func:`default_group_size`), nearest value of GPTQ's grid (see the module's docstring), and pack it."""
    check_cpu_tensor(weight, "weight")
    if not weight.is_floating_point():
        raise TypeError(f"weight has dtype {weight.dtype}; expected a floating dtype")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    group_size = checked_group_size(k, group_size)
    groups = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if not bool(torch.isfinite(groups).all()):  # a NaN scale or zero would be cast to an arbitrary code
        raise ValueError("weight holds NaN or Inf: 4-bit codes cannot represent them")
    if symmetric:
        amax = groups.abs().amax(-1)
        scale = torch.where(amax > 0, amax * (2 / 15), torch.ones_like(amax))
        zero = torch.full_like(scale, 8)
    else:  # the range holds 0, so 0 is exact; a constant group gets GPTQ's [-1, 1]
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        flat = lo == hi
        lo, hi = torch.where(flat, -1.0, lo), torch.where(flat, 1.0, hi)
        scale = (hi - lo) / 15
        zero = torch.round(-lo / scale).clamp(0, 15)
    codes = torch.round(groups / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_int4(codes.reshape(n, k), zero.t().to(torch.uint8), scale.t())


export("quantize_int4", quantize_int4)


def convert_weight_packed_scale_zp(
    qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor, quant_method_4bit: int = AWQ
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A checkpoint's 4-bit weight (see :class:`Int4Format`) -> ``(w, w_zeros, w_scales)`` for
    :func:`int4_scaled_mm_cpu` and :func:`int4_w4a16_linear`. ``qzeros=None``: symmetric, zero 8.
    GPTQ with ``desc_act`` (a ``g_idx`` that is not ``k // group_size``) is not taken here: permute
    its K first (see ``kernforge.integrations.transformers``' loader). 3-D tensors (``[E, ...]``, a
    MoE's stacked experts) are converted expert by expert: ``w [E, ceil(N / 64), K / 4, 128]``,
    ``w_zeros`` and ``w_scales [E, G, N]`` (what ``kernforge.ops.moe.fused_experts`` takes)."""
    fmt = _format(quant_method_4bit)
    check_cpu_tensor(qweight, "qweight")
    if qweight.dim() == 3:
        return _convert_experts(qweight, qzeros, scales, fmt)
    check_cpu_tensor(scales, "scales")
    if qweight.dtype is not torch.int32 or qweight.dim() != 2:
        raise TypeError(
            f"qweight must be a 2-D torch.int32 tensor of packed nibbles, got {qweight.dtype} {tuple(qweight.shape)}"
        )
    if fmt is AWQ:
        codes = _unpack_words(qweight, _AWQ_ORDER).t()  # [K, N] -> [N, K]
    elif fmt is GPTQ:
        codes = _unpack_words(qweight.t(), _SEQUENTIAL)  # [N, K/8] words along K
    else:
        codes = _unpack_words(qweight, _SEQUENTIAL)
    n, k = codes.shape
    if fmt is PACK_QUANTIZED:
        scales = scales.t()
    if scales.dim() != 2 or scales.shape[1] != n:
        raise ValueError(
            f"scales must be [G, {n}] ({'[N, G] for pack-quantized' if fmt is PACK_QUANTIZED else ''}"
            f") to match qweight's N = {n}, got {tuple(scales.shape)}"
        )
    zeros = _checkpoint_zeros(qzeros, fmt, scales.shape[0], n)
    return tuple(pack_int4(codes, zeros, scales))


export("convert_weight_packed_scale_zp", convert_weight_packed_scale_zp)


def _convert_experts(qweight, qzeros, scales, fmt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """convert_weight_packed_scale_zp of each expert of stacked ``[E, ...]`` tensors, stacked."""
    check_cpu_tensor(scales, "scales")
    experts = qweight.shape[0]
    if qzeros is not None:
        check_cpu_tensor(qzeros, "qzeros")
    if experts < 1 or scales.dim() != 3 or scales.shape[0] != experts or (qzeros is not None and (
            qzeros.dim() != 3 or qzeros.shape[0] != experts)):  # fmt: skip
        raise ValueError(
            f"qweight {tuple(qweight.shape)} is 3-D: scales and qzeros must be 3-D too, with the same number "
            f"of experts, got {tuple(scales.shape)} and {None if qzeros is None else tuple(qzeros.shape)}"
        )
    converted = [
        convert_weight_packed_scale_zp(qweight[e], None if qzeros is None else qzeros[e], scales[e], fmt)
        for e in range(experts)
    ]
    return tuple(torch.stack(tensors) for tensors in zip(*converted))


def _unpack_words(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 ``[R, C]`` -> uint8 ``[R, 8 C]``: element ``8c + j`` is nibble ``order[j]`` of word ``c``."""
    shifts = torch.tensor([4 * i for i in order], dtype=torch.int32)
    return ((words.contiguous()[..., None] >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def _checkpoint_zeros(qzeros: torch.Tensor | None, fmt: Int4Format, groups: int, n: int) -> torch.Tensor:
    if qzeros is None:
        return torch.full((groups, n), 8, dtype=torch.uint8)
    check_cpu_tensor(qzeros, "qzeros")
    if qzeros.dtype is not torch.int32:
        raise TypeError(f"qzeros has dtype {qzeros.dtype}; expected torch.int32 packed nibbles")
    if fmt is PACK_QUANTIZED:
        zeros = _unpack_words(qzeros.t(), _SEQUENTIAL)  # [N/8, G] packed along N
    else:
        zeros = _unpack_words(qzeros, _AWQ_ORDER if fmt is AWQ else _SEQUENTIAL)
    if tuple(zeros.shape) != (groups, n):
        raise ValueError(f"qzeros unpacks to {tuple(zeros.shape)}; expected [G, N] = [{groups}, {n}]")
    return zeros + 1 if fmt is GPTQ else zeros  # GPTQ (v1) stores z - 1


def _format(quant_method_4bit: object) -> Int4Format:
    try:
        return Int4Format(quant_method_4bit)
    except ValueError:
        names = [f"{f.value} ({f.name})" for f in Int4Format]
        raise ValueError(f"quant_method_4bit must be one of {names}, got {quant_method_4bit!r}") from None


def default_group_size(k: int) -> int:
    """The group size kernforge quantizes a weight with K = ``k`` in: ``DEFAULT_GROUP`` where it
    divides K, else the largest multiple of 4 below it that does (K itself if K is smaller)."""
    for size in range(min(DEFAULT_GROUP, k) // QUAD * QUAD, 0, -QUAD):
        if k % size == 0:
            return size
    raise ValueError(f"four-bit weights need K to be a multiple of {QUAD}, got {k}")


def checked_group_size(k: int, group_size: object, k_name: str = "K") -> int:
    """``group_size`` for a weight with K = ``k`` (``k_name`` in errors): a multiple of ``QUAD`` that
    divides K, or ``None`` for :func:`default_group_size`. What every int4 packer takes."""
    if group_size is None:
        return default_group_size(k)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int or None, got {group_size!r}")
    if group_size < QUAD or group_size % QUAD or k % group_size:
        raise ValueError(f"group_size must be a multiple of {QUAD} that divides {k_name} = {k}, got {group_size}")
    return group_size


def check_group_size(k: int, groups: int) -> None:
    if groups < 1 or k % groups or (k // groups) % QUAD:
        raise ValueError(f"K = {k} must split into {groups} groups of a multiple of {QUAD} elements each")


def check_zero_points(zeros: torch.Tensor, name: str) -> None:
    """Zero points past MAX_ZERO would wrap the kernels' ``code - zero`` bytes: refused. One pass over
    [G, N] bytes (3 us for a 4096 x 4096 weight in groups of 128, 1 % of its GEMV), paid by calls that
    pass raw tensors; a PackedInt4Weight is checked once, where it is made."""
    if torch.compiler.is_compiling():  # traced: the op's implementation checks the real values when it runs
        return
    if zeros.numel() and int(zeros.max()) > MAX_ZERO:
        raise ValueError(f"{name} must lie in [0, {MAX_ZERO}] (4-bit zero points), got a maximum of {int(zeros.max())}")


def _checked_codes(t: torch.Tensor, name: str, limit: int) -> torch.Tensor:
    if t.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"{name} has dtype {t.dtype}; expected an integer dtype")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > limit):
        raise ValueError(f"{name} must lie in [0, {limit}], got values in [{int(t.min())}, {int(t.max())}]")
    return t.to(torch.uint8)


# --------------------------------------------------------------------------- the ops


def _to_schema(x, w, w_zeros=None, w_scales=None, bias=None):
    return (x, *_weight_tensors(w, w_zeros, w_scales), bias), None


def _traced(op_name: str) -> Traced:
    return Traced(
        "Tensor",
        fake=lambda x, w, w_zeros, w_scales, bias=None: x.new_empty((*x.shape[:-1], w_scales.shape[1])),
        arguments="Tensor x, Tensor w, Tensor w_zeros, Tensor w_scales, Tensor? bias=None",
        from_schema=lambda x, w, w_zeros, w_scales, bias=None: _run(op_name, x, w, w_zeros, w_scales, bias),
        to_schema=_to_schema,
    )


@kernel_op(GEMM_INT4, traced=_traced("w4a8"), **DEFAULT_BLOCKING)
def int4_scaled_mm_cpu(
    x: torch.Tensor,
    w: torch.Tensor | PackedInt4Weight,
    w_zeros: torch.Tensor | None = None,
    w_scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A8: ``x [..., K]`` (bf16, fp16, fp32) quantized per token to int8 in the call, times the
    4-bit weight, ``+ bias`` (fp32 ``[N]``) -> ``[..., N]`` in ``x``'s dtype. ``w, w_zeros, w_scales``
    from :func:`convert_weight_packed_scale_zp`, or ``w`` a :class:`PackedInt4Weight` alone."""
    return _run("w4a8", x, w, w_zeros, w_scales, bias)


@kernel_op(GEMM_INT4, traced=_traced("w4a16"), **DEFAULT_BLOCKING)
def int4_w4a16_linear(
    x: torch.Tensor,
    w: torch.Tensor | PackedInt4Weight,
    w_zeros: torch.Tensor | None = None,
    w_scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16: ``x [..., K]`` (bf16, fp16, fp32) as it is, times the 4-bit weight, fp32 sums,
    ``+ bias`` -> ``[..., N]`` in ``x``'s dtype. Arguments as :func:`int4_scaled_mm_cpu`'s."""
    return _run("w4a16", x, w, w_zeros, w_scales, bias)


def int4_group_sums(x: torch.Tensor, w: PackedInt4Weight) -> torch.Tensor:
    """W4A8's exact int32 sums before any scaling: ``[M, G, N]`` = ``sum_{k in g} q[m, k] * (code -
    zero)`` with ``q`` :func:`~kernforge.ops.gemm.int8.per_token_quant_int8`'s int8 values of ``x
    [M, K]`` (for tests, and callers that scale themselves)."""
    packed = _weight(w, None, None)
    _check_x(x)
    kernel = int4_scaled_mm_cpu.kernels.variant(x.dtype).kernel()
    m, _, x2, ldx = matrix_rows(x, "x", packed.k, "w's K")
    groups = packed.k // packed.group_size
    out = torch.empty(m, groups, packed.n, dtype=torch.int32)
    if m:
        _call(kernel.w4a8_group_sums, True, kernel, packed, x2, ldx, None, out, packed.n, m)
    return out


def _weight_tensors(w, w_zeros, w_scales) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_weight(w, w_zeros, w_scales))


def _weight(w, w_zeros, w_scales) -> PackedInt4Weight:
    if isinstance(w, PackedInt4Weight):
        if w.layout_version != LAYOUT_VERSION:
            raise ValueError(
                f"w has layout version {w.layout_version}; this kernforge reads version {LAYOUT_VERSION}: pack it again"
            )
        for name, given, own in (("w_zeros", w_zeros, w.zeros), ("w_scales", w_scales, w.scales)):
            if given is not None and given is not own:
                raise ValueError(f"{name} must be None or w.{name[2:]} when w is a PackedInt4Weight")
        # its zero points were checked where it was made: not again on every call
        packed = PackedInt4Weight._described_by(w.packed, w.zeros, w.scales)
        if (packed.n, packed.k) != (w.n, w.k):
            raise ValueError(f"w's tensors describe a [{packed.n}, {packed.k}] weight, not [{w.n}, {w.k}]")
        return packed
    if w_zeros is None or w_scales is None:
        raise TypeError("w_zeros and w_scales are required with a tensor w (from convert_weight_packed_scale_zp)")
    return PackedInt4Weight.from_tensors(w, w_zeros, w_scales)


def _check_x(x: object) -> None:
    check_cpu_tensor(x, "x")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"x has dtype {x.dtype}; expected torch.bfloat16, torch.float16 or torch.float32")


def _run(entry: str, x, w, w_zeros, w_scales, bias, config: dict | None = None) -> torch.Tensor:
    _check_x(x)
    packed = _weight(w, w_zeros, w_scales)
    m, _, x2, ldx = matrix_rows(x, "x", packed.k, "w's K")
    bias = checked_fp32_bias(bias, packed.n)
    out = torch.empty((*x.shape[:-1], packed.n), dtype=x.dtype)
    if m:
        kernel = _chosen_kernel(x, m, packed, config)
        _call(getattr(kernel, entry), entry == "w4a8", kernel, packed, x2, ldx, bias, out, packed.n, m)
    return out


def linear_with_config(x: torch.Tensor, packed: PackedInt4Weight, config: dict, w4a8: bool = True) -> torch.Tensor:
    """:func:`int4_scaled_mm_cpu` (or, ``w4a8=False``, :func:`int4_w4a16_linear`) with the blocking
    forced (what the tuner times): ``config`` is a candidate's ``params``."""
    return _run("w4a8" if w4a8 else "w4a16", x, packed, None, None, None, {**DEFAULT_BLOCKING, **config})


def _call(entry, quantizes: bool, kernel, packed: PackedInt4Weight, x2, ldx, bias, out, ldo, m) -> None:
    q = torch.empty(m, packed.k, dtype=torch.uint8) if quantizes else None
    q_scale = torch.empty(m, dtype=torch.float32) if q is not None else None
    args = {
        "x": x2.data_ptr(),
        "ldx": ldx,
        "packed": packed.packed.data_ptr(),
        "zeros": packed.zeros.data_ptr(),
        "scales": packed.scales.data_ptr(),
        "bias": 0 if bias is None else bias.data_ptr(),
        "out": out.data_ptr(),
        "ldo": ldo,
        "m": m,
        "n": packed.n,
        "k": packed.k,
        "group_size": packed.group_size,
        "q": 0 if q is None else q.data_ptr(),
        "q_scale": 0 if q_scale is None else q_scale.data_ptr(),
        "num_threads": num_threads(),
    }
    status = entry(kernel.new("kf_int4_gemm", args))
    if status:
        raise ValueError(STATUS.get(status, f"int4 GEMM failed with status {status}"))


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    """The variants dispatch picks for the model's linear shapes at every row bucket (tuned or default),
    at the group size kernforge.nn.Linear quantizes them with."""
    if quant not in QUANTS:
        return []
    tier, configs = isa.selected_tier(), []
    dtype = TORCH_DTYPES[dtype_name(spec.dtype)]
    for name, (n, k) in spec.linear_shapes().items():
        if name == "router" or k % QUAD:
            continue
        for m in sorted({1 << i for i in range(11)}):
            shape = tile_shape(dtype, m, n, k, default_group_size(k))
            params = {"dtype": shape["dtype"], **INT4_CANDIDATES.choose(shape, tier=tier).params}
            if params not in configs:
                configs.append(params)
    return [{"module": "gemm_int4", "params": params} for params in configs]


QUANTS = ("int4", "int4_w4a16")  # kernforge.nn.Linear's quant names for these ops
