"""Gated activations ``[..., 2d] -> [..., d]``: ``act(x[..., :d]) * x[..., d:]``."""

from __future__ import annotations

import torch

from kernforge.jit.core import Variant
from kernforge.ops._common import (
    DTYPE_NAMES,
    float_tensor,
    num_threads,
    readable_rows,
    row_geometry,
    rows_view,
    same_dtype,
    writable_rows,
)

TEMPLATE = "activation.cpp.jinja"
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

VARIANTS = {
    (dtype, act): Variant(TEMPLATE, {"dtype": dtype, "act": act})
    for dtype in DTYPE_NAMES.values()
    for act in ACTIVATIONS
}


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` (SwiGLU)."""
    return _gated(input, out, "silu")


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` with the exact (erf) GELU (GeGLU)."""
    return _gated(input, out, "gelu")


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x[..., :d], approximate="tanh") * x[..., d:]``."""
    return _gated(input, out, "gelu_tanh")


def _gated(input, out, act):
    dtype = float_tensor(input, "input")
    if input.dim() == 0 or input.shape[-1] % 2:
        raise ValueError(f"input's last dimension must be even (2 * d), got shape {tuple(input.shape)}")
    d = input.shape[-1] // 2
    out_shape = (*input.shape[:-1], d)
    if out is None:
        out = torch.empty(out_shape, dtype=input.dtype)
    else:
        same_dtype(out, "out", input)
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out must have shape {out_shape} for input of shape {tuple(input.shape)}, got {tuple(out.shape)}")
        writable_rows(out, "out")
    if out.numel() == 0:
        return out
    rows_in = rows_view(readable_rows(input), "input", writable=False)
    rows_out = rows_view(out, "out", writable=True)
    n0, n1, in_s0, in_s1 = row_geometry(rows_in)
    _, _, out_s0, out_s1 = row_geometry(rows_out)
    VARIANTS[dtype, act].kernel()(
        rows_out.data_ptr(), out_s0, out_s1, rows_in.data_ptr(), in_s0, in_s1, n0, n1, d, num_threads()
    )
    return out
