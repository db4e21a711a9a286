"""Gated activations ``[..., 2d] -> [..., d]``: ``act(x[..., :d]) * x[..., d:]``."""

from __future__ import annotations

import functools

import torch

from kernforge.jit.module import DType, Entry, Enum, Module
from kernforge.ops._common import (
    BoundCall,
    check_no_overlap,
    checked_out,
    no_op,
    num_threads,
    readable_rows,
    row_geometry,
    rows_view,
    variant_for_input,
)
from kernforge.ops._registry import Traced, kernel_op, model_kernels

# out[i0, i1, :d] = act(input[i0, i1, :d]) * input[i0, i1, d:2d] over n0 x n1 rows at 2-D strides.
ACTIVATION = Module(
    "activation",
    "activation.cpp.jinja",
    params={"dtype": DType(), "act": Enum(("silu", "gelu", "gelu_tanh"))},
    entries=[
        Entry(
            "run",
            "int64_t out, int64_t out_s0, int64_t out_s1, int64_t input, int64_t in_s0, "
            "int64_t in_s1, int64_t n0, int64_t n1, int64_t d, int64_t num_threads",
        )
    ],
)


def _half_width(input):  # the custom op's output, [..., 2d] -> [..., d]
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


_GATED = Traced("Tensor", fake=_half_width, with_out=True)


@kernel_op(ACTIVATION, act="silu", traced=_GATED)
def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` (SwiGLU)."""
    return _gated(input, out, silu_and_mul.kernels)


@kernel_op(ACTIVATION, act="gelu", traced=_GATED)
def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` with the exact (erf) GELU (GeGLU)."""
    return _gated(input, out, gelu_and_mul.kernels)


@kernel_op(ACTIVATION, act="gelu_tanh", traced=_GATED)
def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x[..., :d], approximate="tanh") * x[..., d:]``."""
    return _gated(input, out, gelu_tanh_and_mul.kernels)


def _gated(input, out, kernels):
    out, call = _gated_call(input, out, kernels)
    if call is not None:
        call()
    return out


def bound_gated(op: str, input: torch.Tensor, out: torch.Tensor) -> BoundCall:
    """``op(input, out=out)`` (``op``: "silu_and_mul", "gelu_and_mul" or "gelu_tanh_and_mul") checked
    once, as a call of no arguments that runs the kernel on the same tensors."""
    ops = {f.__name__: f for f in (silu_and_mul, gelu_and_mul, gelu_tanh_and_mul)}
    if op not in ops:
        raise ValueError(f"op must be one of {', '.join(ops)}, got {op!r}")
    return _gated_call(input, out, ops[op].kernels)[1] or BoundCall(no_op)


def _gated_call(input, out, kernels) -> tuple[torch.Tensor, BoundCall | None]:
    """The output and the kernel call that fills it (None: nothing to compute)."""
    variant = variant_for_input(kernels, input, "input")
    shape = input.shape
    if not shape or shape[-1] % 2:
        raise ValueError(f"input's last dimension must be even (2 * d), got shape {tuple(shape)}")
    d = shape[-1] // 2
    out_shape = (*shape[:-1], d)
    if out is None:
        out = torch.empty(out_shape, dtype=input.dtype)
    else:
        checked_out(out, out_shape, input)
        check_no_overlap(out, "out", input, "input")
    rows_out = out
    if len(shape) > 3:  # kernels see at most 3 dims: merge the leading ones (a view where possible)
        input, rows_out = rows_view(input, "input", writable=False), rows_view(out, "out", writable=True)
    rows_in, in_strides = readable_rows(input, input.shape, input.stride())
    n0, n1, in_s0, in_s1 = row_geometry(rows_in.shape, in_strides)
    _, _, out_s0, out_s1 = row_geometry(rows_out.shape, rows_out.stride())
    if not n0 * n1 * d:
        return out, None
    call = functools.partial(
        variant.kernel().run,
        rows_out.data_ptr(),
        out_s0,
        out_s1,
        rows_in.data_ptr(),
        in_s0,
        in_s1,
        n0,
        n1,
        d,
        num_threads(),
    )
    return out, BoundCall(call, rows_in, rows_out)  # the rows read may be a copy: held while the call can run


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    if not spec.runs_gated_mlp:  # Mixtral, OLMoE: their experts gate inside fused_experts
        return []
    return [{"op": spec.gated_op, "dtype": spec.dtype}]  # the MLP's act(gate) * up
