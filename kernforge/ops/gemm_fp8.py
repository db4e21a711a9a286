"""fp8 block-scaled linear layers (DeepSeek-V3 style) with sgl-kernel's CPU semantics
(``sgl-kernel/csrc/cpu/gemm_fp8.cpp``, ``fp8_scaled_mm_cpu(mat1, mat2, scales2, block_size, bias,
out_dtype, is_vnni)``).

* ``convert_weight_packed_fp8(weight, weight_scale, block_size=(128, 128))`` packs an e4m3fn weight
  ``[N, K]`` once; it stays fp8 (one byte per weight) and is widened to fp32 in registers.
* ``fp8_scaled_mm(x, packed, weight_scale, block_size=(128, 128), bias=None, out_dtype=torch.bfloat16)``
  = ``x @ (W * S)^T (+ bias)`` where ``S[n, k] = weight_scale[n // bn, k // bk]``, ``block_size =
  (bn, bk)`` (sgl-kernel: ``block_size[0]`` is N's block, ``block_size[1]`` K's) and ``weight_scale`` is
  fp32 ``[ceil(N / bn), ceil(K / bk)]`` (partial last blocks allowed). Each K block's partial sums
  are accumulated in fp32 and scaled before they join the tile. The weights are widened exactly
  (e4m3 -> fp16 bits -> fp32 on AVX2/AVX-512), so a weight holding NaN is refused when packed. ``out_dtype`` must be ``x``'s dtype
  (sgl-kernel writes ``mat1``'s scalar type); ``bias`` ``[N]`` is added in fp32.

The packed layout (``PackedFp8Weight.layout_version`` 1, read by ``kernforge/gemm/fp8_kernel.h``): N in
panels of ``panel_width`` columns, each panel K rows of ``panel_width`` bytes; N padded with zero
weights to whole panels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernforge.jit.module import DType, Entry, Module
from kernforge.ops._common import num_threads
from kernforge.ops._registry import export, kernel_op
from kernforge.ops._gemm import (
    STATUS,
    check_cpu_tensor,
    check_packed,
    checked_fp32_bias,
    checked_weight,
    matrix_rows,
    raise_for_status,
)

LAYOUT_VERSION = 1
PANEL_WIDTH = 64  # columns per packed panel: a multiple of every tier's NR
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

GEMM_FP8 = Module(
    "gemm_fp8", "gemm_fp8.cpp.jinja",
    params={"dtype": DType()},
    entries=[
        Entry("scaled_mm", "int64_t x, int64_t ldx, int64_t packed, int64_t panel_width, int64_t scales, "
                           "int64_t block_n, int64_t block_k, int64_t bias, int64_t out, int64_t ldo, int64_t m, "
                           "int64_t n, int64_t k, int64_t num_threads", returns="int64_t"),
    ],
)
_STATUS = {**STATUS, 2: "block_size must hold two positive sizes"}


@dataclass
class PackedFp8Weight:
    """An e4m3fn weight ``[n, k]`` packed for :func:`fp8_scaled_mm`, with the block scales and block
    size it was packed with (for callers such as ``kernforge.nn``); survives ``torch.save``/``torch.load``."""

    packed: torch.Tensor        # [ceil(n / panel_width), k, panel_width] float8_e4m3fn
    weight_scale: torch.Tensor  # [ceil(n / bn), ceil(k / bk)] fp32
    block_size: tuple[int, int]
    n: int
    k: int
    panel_width: int = PANEL_WIDTH
    layout_version: int = LAYOUT_VERSION

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)


torch.serialization.add_safe_globals([PackedFp8Weight])  # loads with torch.load's default weights_only=True


def convert_weight_packed_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                              block_size=(128, 128)) -> PackedFp8Weight:
    """Pack an e4m3fn ``weight [N, K]`` with its fp32 block scales ``[ceil(N / bn), ceil(K / bk)]``."""
    n, k = checked_weight(weight, torch.float8_e4m3fn, "convert_weight_packed_fp8")
    block = _checked_block_size(block_size)
    weight_scale = _checked_scale(weight_scale, n, k, block)
    if ((weight.view(torch.uint8) & 0x7F) == 0x7F).any():  # once per weight, not per call
        raise ValueError("weight holds NaN (e4m3fn code S.1111.111); fp8_scaled_mm's fast widening "
                         "does not propagate NaN, so NaN weights are refused")
    panels = -(-n // PANEL_WIDTH)
    padded = torch.zeros(panels * PANEL_WIDTH, k, dtype=torch.uint8)
    padded[:n] = weight.view(torch.uint8)
    packed = padded.view(panels, PANEL_WIDTH, k).transpose(1, 2).contiguous().view(torch.float8_e4m3fn)
    return PackedFp8Weight(packed, weight_scale.clone(), block, n, k)


export("convert_weight_packed_fp8", convert_weight_packed_fp8)


@kernel_op(GEMM_FP8, dtypes=DTYPES)
def fp8_scaled_mm(x: torch.Tensor, packed: PackedFp8Weight, weight_scale: torch.Tensor, block_size=(128, 128),
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
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
    block = _checked_block_size(block_size)
    weight_scale = _checked_scale(weight_scale, n, k, block)
    bias = checked_fp32_bias(bias, n)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    if m == 0:
        return out
    status = kernel.scaled_mm(x2.data_ptr(), ldx, packed.packed.data_ptr(), packed.panel_width,
                              weight_scale.data_ptr(), block[0], block[1], 0 if bias is None else bias.data_ptr(),
                              out.data_ptr(), n, m, n, k, num_threads())
    raise_for_status(status, "fp8 GEMM", _STATUS)
    return out


# --------------------------------------------------------------------------- checks


def _checked_block_size(block_size) -> tuple[int, int]:
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
    expected = (-(-n // block[0]), -(-k // block[1]))
    if tuple(weight_scale.shape) != expected:
        raise ValueError(f"weight_scale must have shape {expected} (ceil(N / {block[0]}), ceil(K / {block[1]})) "
                         f"for a [{n}, {k}] weight with block_size {block}, got {tuple(weight_scale.shape)}")
    return weight_scale.contiguous()


def _checked_packed(packed: object) -> tuple[int, int]:
    return check_packed(packed, PackedFp8Weight, "convert_weight_packed_fp8", LAYOUT_VERSION, lambda p: [
        ("packed", torch.float8_e4m3fn, (-(-p.n // p.panel_width), p.k, p.panel_width)),
    ])
