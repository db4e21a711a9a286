"""Gated activations ``[..., 2d] -> [..., d]``: ``act(x[..., :d]) * x[..., d:]``."""

from __future__ import annotations

import torch

from kernforge.ops._common import (
    checked_out,
    num_threads,
    readable_rows,
    row_geometry,
    rows_view,
    variant_for_input,
    variants_by_dtype,
)

TEMPLATE = "activation.cpp.jinja"
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

# {act: {torch.dtype: Variant}}: a call finds its kernel without building a key.
_BY_ACT = {act: variants_by_dtype(TEMPLATE, act=act) for act in ACTIVATIONS}
OPS = {f"{act}_and_mul": _BY_ACT[act] for act in ACTIVATIONS}


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
    variant = variant_for_input(_BY_ACT[act], input, "input")
    shape = input.shape
    if not shape or shape[-1] % 2:
        raise ValueError(f"input's last dimension must be even (2 * d), got shape {tuple(shape)}")
    d = shape[-1] // 2
    out_shape = (*shape[:-1], d)
    if out is None:
        out = torch.empty(out_shape, dtype=input.dtype)
    else:
        checked_out(out, out_shape, input)
    rows_out = out
    if len(shape) > 3:  # kernels see at most 3 dims: merge the leading ones (a view where possible)
        input, rows_out = rows_view(input, "input", writable=False), rows_view(out, "out", writable=True)
    rows_in, in_strides = readable_rows(input, input.shape, input.stride())
    n0, n1, in_s0, in_s1 = row_geometry(rows_in.shape, in_strides)
    _, _, out_s0, out_s1 = row_geometry(rows_out.shape, rows_out.stride())
    if n0 * n1 * d:
        variant.kernel()(
            rows_out.data_ptr(), out_s0, out_s1, rows_in.data_ptr(), in_s0, in_s1, n0, n1, d, num_threads()
        )
    return out
