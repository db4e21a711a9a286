"""fp8 block-scaled linear layers (DeepSeek-V3 style) with sgl-kernel's CPU semantics
(``sgl-kernel/csrc/cpu/gemm_fp8.cpp``, ``fp8_scaled_mm_cpu(mat1, mat2, scales2, block_size, bias,
out_dtype, is_vnni)``).

* ``convert_weight_packed_fp8(weight, weight_scale, block_size=(128, 128))`` packs an e4m3fn weight
  ``[N, K]`` once; it stays fp8 in memory (one byte per weight).
* ``fp8_scaled_mm(x, packed, weight_scale, block_size=(128, 128), bias=None, out_dtype=torch.bfloat16)``
  = ``x @ (W * S)^T (+ bias)`` where ``S[n, k] = weight_scale[n // bn, k // bk]``, ``block_size =
  (bn, bk)`` (sgl-kernel: ``block_size[0]`` is N's block, ``block_size[1]`` K's) and ``weight_scale`` is
  fp32 ``[ceil(N / bn), ceil(K / bk)]`` (partial last blocks allowed). Each K block's partial sums
  are accumulated in fp32 and scaled before they join the tile. ``out_dtype`` must be ``x``'s dtype
  (sgl-kernel writes ``mat1``'s scalar type); ``bias`` ``[N]`` is added in fp32.

Two kernel paths compute the same sums, chosen by the rows M of ``x`` (``convert_from_rows``):

* Few rows (decode): the weights are converted in registers where they are used, and prefetched
  ahead. bf16 x on AVX512-BF16 + VBMI: pairs of K rows become bf16 pair words by vpermt2b table
  lookups, multiplied by ``vdpbf16ps``; otherwise the weights are widened to fp32 (e4m3 -> fp16 bits ->
  fp32 on AVX2/AVX-512: NaN codes would read as finite numbers, so a weight holding NaN is refused
  when packed) and FMA'd. Each weight byte crosses the memory bus once per call: at M = 1 the GEMM is
  memory-bound, about twice as fast as the bf16 one.
* Many rows (prefill, AVX-512): converting per use would cost more than the multiply-adds, so each
  task converts every K block of its 32 columns once to bf16 pairs (vpermt2b lookups on AVX512-VBMI,
  fp32 widening elsewhere) and runs the bf16 micro-kernel (``vdpbf16ps`` on AVX512-BF16) over up to
  256 rows into a zeroed block tile, which it then adds times the block's scales.

Both convert exactly (every e4m3 value is a bf16) and sum each K block in fp32.

The packed layout (``PackedFp8Weight.layout_version`` 1, read by ``kernforge/gemm/fp8_kernel.h``): N in
panels of ``panel_width`` columns, each panel K rows of ``panel_width`` bytes; N padded with zero
weights to whole panels.
"""

from __future__ import annotations

import torch

from kernforge.jit import isa
from kernforge.jit.module import DType, Entry, Module
from kernforge.ops._common import dtype_name, num_threads
from kernforge.ops._registry import export, kernel_op, model_kernels
from kernforge.ops.gemm._common import (
    STATUS,
    check_cpu_tensor,
    check_packed,
    checked_fp32_bias,
    checked_weight,
    matrix_rows,
    packed_weight,
    raise_for_status,
)

LAYOUT_VERSION = 1
PANEL_WIDTH = 64  # columns per packed panel: a multiple of every tier's NR
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The first M that takes the converting path, per (built tier, x dtype): where it overtook the
# in-register path, timed on Zen 5 (one thread, K = N = 4096; bf16: 0.98x the in-register time at
# M = 96, 0.89x at 256; fp16 0.96x at 64; fp32 0.99x at 128). On AVX2 the converting path (its FMA
# micro-kernel) stayed 13-54% slower at every M up to 512, so dispatch never takes it there, nor on
# generic; the tests still run both paths on every tier (they replace convert_from_rows).
CONVERT_FROM_ROWS = {
    ("avx512", torch.bfloat16): 96,
    ("avx512", torch.float16): 64,
    ("avx512", torch.float32): 128,
}
NEVER = 1 << 62

GEMM_FP8 = Module(
    "gemm_fp8",
    "gemm_fp8.cpp.jinja",
    params={"dtype": DType()},
    entries=[
        Entry(
            "scaled_mm",
            "int64_t x, int64_t ldx, int64_t packed, int64_t panel_width, int64_t scales, "
            "int64_t block_n, int64_t block_k, int64_t bias, int64_t out, int64_t ldo, int64_t m, "
            "int64_t n, int64_t k, int64_t convert_from_rows, int64_t num_threads",
            returns="int64_t",
        ),
    ],
)
_STATUS = {**STATUS, 2: "block_size must hold two positive sizes"}


@packed_weight(saved_as="kernforge.ops.gemm_fp8")
class PackedFp8Weight:
    """An e4m3fn weight ``[n, k]`` packed for :func:`fp8_scaled_mm`, with the block scales and block
    size it was packed with (for callers such as ``kernforge.nn``); survives ``torch.save``/``torch.load``."""

    packed: torch.Tensor  # [ceil(n / panel_width), k, panel_width] float8_e4m3fn
    weight_scale: torch.Tensor  # [ceil(n / bn), ceil(k / bk)] fp32
    block_size: tuple[int, int]
    n: int
    k: int
    panel_width: int = PANEL_WIDTH
    layout_version: int = LAYOUT_VERSION


def convert_weight_packed_fp8(
    weight: torch.Tensor, weight_scale: torch.Tensor, block_size=(128, 128)
) -> PackedFp8Weight:
    """Pack an e4m3fn ``weight [N, K]`` with its fp32 block scales ``[ceil(N / bn), ceil(K / bk)]``."""
    n, k = checked_weight(weight, torch.float8_e4m3fn, "convert_weight_packed_fp8")
    block = checked_block_size(block_size)
    weight_scale = _checked_scale(weight_scale, n, k, block)
    if ((weight.view(torch.uint8) & 0x7F) == 0x7F).any():  # once per weight, not per call
        raise ValueError(
            "weight holds NaN (e4m3fn code S.1111.111); fp8_scaled_mm's fast widening "
            "does not propagate NaN, so NaN weights are refused"
        )
    panels = packed_shape(n, k)[0]
    padded = torch.zeros(panels * PANEL_WIDTH, k, dtype=torch.uint8)
    padded[:n] = weight.view(torch.uint8)
    packed = padded.view(panels, PANEL_WIDTH, k).transpose(1, 2).contiguous().view(torch.float8_e4m3fn)
    return PackedFp8Weight(packed, weight_scale.clone(), block, n, k)


export("convert_weight_packed_fp8", convert_weight_packed_fp8)


@kernel_op(GEMM_FP8, dtypes=DTYPES)
def fp8_scaled_mm(
    x: torch.Tensor,
    packed: PackedFp8Weight,
    weight_scale: torch.Tensor,
    block_size=(128, 128),
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``x [..., K] @ (W * block scales)^T (+ bias)`` -> ``[..., N]`` in ``out_dtype`` (= ``x``'s dtype:
    bf16, fp16 or fp32). ``packed`` from :func:`convert_weight_packed_fp8`; ``weight_scale`` fp32
    ``[ceil(N / bn), ceil(K / bk)]`` for ``block_size = (bn, bk)``."""
    check_cpu_tensor(x, "x")
    if x.dtype not in DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected torch.bfloat16, torch.float16 or torch.float32")
    if out_dtype is not x.dtype:
        raise TypeError(f"out_dtype is {out_dtype} but x has dtype {x.dtype}; fp8_scaled_mm writes x's dtype")
    kernel = fp8_scaled_mm.kernels.variant(x.dtype).kernel()
    n, k = _checked_packed(packed)
    m, _, x2, ldx = matrix_rows(x, "x", k, "packed's K")
    block = checked_block_size(block_size)
    weight_scale = _checked_scale(weight_scale, n, k, block)
    bias = checked_fp32_bias(bias, n)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    if m == 0:
        return out
    status = kernel.scaled_mm(
        x2.data_ptr(),
        ldx,
        packed.packed.data_ptr(),
        packed.panel_width,
        weight_scale.data_ptr(),
        block[0],
        block[1],
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        m,
        n,
        k,
        convert_from_rows(x.dtype),
        num_threads(),
    )
    raise_for_status(status, "fp8 GEMM", _STATUS)
    return out


def convert_from_rows(dtype: torch.dtype) -> int:
    """The first M at which fp8_scaled_mm converts weights per K block (else it converts them in registers)."""
    return CONVERT_FROM_ROWS.get((GEMM_FP8.built_tier(isa.selected_tier()), dtype), NEVER)


# --------------------------------------------------------------------------- layout and checks


def packed_shape(n: int, k: int, panel_width: int = PANEL_WIDTH) -> tuple[int, int, int]:
    """Shape of the packed tensor of a weight ``[n, k]``: panels, K rows, columns."""
    return (-(-n // panel_width), k, panel_width)


def scale_shape(n: int, k: int, block_size: tuple[int, int]) -> tuple[int, int]:
    """Shape of the block scales of a weight ``[n, k]``: ``(ceil(n / bn), ceil(k / bk))``."""
    return (-(-n // block_size[0]), -(-k // block_size[1]))


def checked_block_size(block_size) -> tuple[int, int]:
    """``block_size`` as two positive ints ``(block_n, block_k)``, or a ValueError naming it (MoE's fp8
    experts check theirs with it)."""
    try:
        bn, bk = (int(s) for s in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be two sizes (block_n, block_k), got {block_size!r}") from None
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block_size must hold two positive sizes (block_n, block_k), got {block_size!r}")
    return bn, bk


def _checked_scale(weight_scale: object, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """``weight_scale`` as the contiguous fp32 ``[ceil(n / bn), ceil(k / bk)]`` tensor the kernel reads."""
    check_cpu_tensor(weight_scale, "weight_scale")
    if weight_scale.dtype is not torch.float32:
        raise TypeError(f"weight_scale has dtype {weight_scale.dtype}; expected torch.float32")
    expected = scale_shape(n, k, block)
    if tuple(weight_scale.shape) != expected:
        raise ValueError(
            f"weight_scale must have shape {expected} (ceil(N / {block[0]}), ceil(K / {block[1]})) "
            f"for a [{n}, {k}] weight with block_size {block}, got {tuple(weight_scale.shape)}"
        )
    return weight_scale.contiguous()


def _checked_packed(packed: object) -> tuple[int, int]:
    return check_packed(
        packed,
        PackedFp8Weight,
        "convert_weight_packed_fp8",
        LAYOUT_VERSION,
        lambda p: [
            ("packed", torch.float8_e4m3fn, packed_shape(p.n, p.k, _panel_width(p))),
        ],
    )


def _panel_width(packed: PackedFp8Weight) -> int:
    """A multiple of PANEL_WIDTH, which both kernel paths' tile widths divide on every tier."""
    width = packed.panel_width
    if isinstance(width, bool) or not isinstance(width, int) or width < PANEL_WIDTH or width % PANEL_WIDTH:
        raise ValueError(
            f"packed.panel_width must be a multiple of {PANEL_WIDTH} (convert_weight_packed_fp8's "
            f"layout), got {width!r}"
        )
    return width


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    """The fp8 block-scaled GEMM in the model's dtype, for quant="fp8_block"."""
    return [{"module": "gemm_fp8", "params": {"dtype": dtype_name(spec.dtype)}}] if quant == "fp8_block" else []
