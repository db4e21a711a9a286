"""RMSNorm family, with FlashInfer's signatures and in-place semantics."""

from __future__ import annotations

import torch

from kernforge.jit.core import Variant
from kernforge.ops._common import (
    DTYPE_NAMES,
    float_tensor,
    num_threads,
    readable_rows,
    row_geometry,
    same_dtype,
    writable_rows,
)

TEMPLATE = "norm.cpp.jinja"

# One compiled variant per (dtype, fused_add, gemma).
VARIANTS = {
    (dtype, fused_add, gemma): Variant(TEMPLATE, {"dtype": dtype, "fused_add": fused_add, "gemma": gemma})
    for dtype in DTYPE_NAMES.values()
    for fused_add in (False, True)
    for gemma in (False, True)
}


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None):
    """``out = input / sqrt(mean(input**2, -1) + eps) * weight``; input ``[N, D]`` or ``[B, H, D]``."""
    return _normalize(input, weight, eps, out, gemma=False)


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None):
    """Gemma's RMSNorm: scales by ``1 + weight``."""
    return _normalize(input, weight, eps, out, gemma=True)


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> None:
    """In place: ``residual += input; input = rmsnorm(residual)``.

    The sum is formed in fp32 and normalized before rounding; ``residual``
    stores it rounded to the dtype.
    """
    _fused_add(input, residual, weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    """In place, Gemma scaling: ``residual += input; input = gemma_rmsnorm(residual)``."""
    _fused_add(input, residual, weight, eps, gemma=True)


def _check_input(input: torch.Tensor) -> str:
    dtype = float_tensor(input, "input")
    if input.dim() not in (2, 3):
        raise ValueError(f"input must be 2-D [tokens, hidden] or 3-D [batch, heads, hidden], got shape {tuple(input.shape)}")
    return dtype


def _checked_weight(weight: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    same_dtype(weight, "weight", input)
    if weight.dim() != 1 or weight.shape[0] != input.shape[-1]:
        raise ValueError(f"weight must have shape ({input.shape[-1]},) to match input's last dimension, got {tuple(weight.shape)}")
    return weight if weight.stride(0) == 1 else weight.contiguous()


def _normalize(input, weight, eps, out, gemma):
    dtype = _check_input(input)
    weight = _checked_weight(weight, input)
    input = readable_rows(input)
    if out is None:
        out = torch.empty(input.shape, dtype=input.dtype)
    else:
        same_dtype(out, "out", input)
        if out.shape != input.shape:
            raise ValueError(f"out must have the input's shape {tuple(input.shape)}, got {tuple(out.shape)}")
        writable_rows(out, "out")
    if input.numel() == 0:
        return out
    n0, n1, in_s0, in_s1 = row_geometry(input)
    _, _, out_s0, out_s1 = row_geometry(out)
    VARIANTS[dtype, False, gemma].kernel()(
        out.data_ptr(), out_s0, out_s1, input.data_ptr(), in_s0, in_s1, 0, 0, 0,
        weight.data_ptr(), n0, n1, input.shape[-1], float(eps), num_threads(),
    )
    return out


def _fused_add(input, residual, weight, eps, gemma):
    dtype = _check_input(input)
    same_dtype(residual, "residual", input)
    if residual.shape != input.shape:
        raise ValueError(f"residual must have the input's shape {tuple(input.shape)}, got {tuple(residual.shape)}")
    writable_rows(input, "input")
    writable_rows(residual, "residual")
    weight = _checked_weight(weight, input)
    if input.numel() == 0:
        return
    n0, n1, in_s0, in_s1 = row_geometry(input)
    _, _, res_s0, res_s1 = row_geometry(residual)
    VARIANTS[dtype, True, gemma].kernel()(
        input.data_ptr(), in_s0, in_s1, input.data_ptr(), in_s0, in_s1, residual.data_ptr(), res_s0, res_s1,
        weight.data_ptr(), n0, n1, input.shape[-1], float(eps), num_threads(),
    )
