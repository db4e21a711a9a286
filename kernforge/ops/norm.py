"""RMSNorm family, with FlashInfer's signatures and in-place semantics."""

from __future__ import annotations

import functools

import torch

from kernforge.jit.core import Variant
from kernforge.jit.module import Bool, DType, Entry, Module
from kernforge.ops._common import (
    BoundCall,
    check_no_overlap,
    checked_out,
    no_op,
    num_threads,
    readable_rows,
    row_geometry,
    same_dtype,
    variant_for_input,
    writable_rows,
)
from kernforge.ops._registry import OpKernels, Traced, kernel_op, model_kernels

# out = norm(input [+ residual]) * weight over n0 x n1 rows of `hidden` elements at 2-D strides;
# with fused_add, residual is updated in place and out may be input.
NORM = Module(
    "norm",
    "norm.cpp.jinja",
    params={"dtype": DType(), "fused_add": Bool(), "gemma": Bool()},
    entries=[
        Entry(
            "run",
            "int64_t out, int64_t out_s0, int64_t out_s1, int64_t input, int64_t in_s0, "
            "int64_t in_s1, int64_t residual, int64_t res_s0, int64_t res_s1, int64_t weight, "
            "int64_t n0, int64_t n1, int64_t hidden, double eps, int64_t num_threads",
        )
    ],
)


def _rows_like(input, *args, **kwargs):
    # the custom op's output: empty_like of the rows it reads (a contiguous copy when the last
    # dimension is strided), as _normalize allocates it
    if input.stride(-1) == 1 or input.shape[-1] <= 1:
        return torch.empty_like(input)
    return input.new_empty(input.shape)


_NORMALIZES = Traced("Tensor", fake=_rows_like, with_out=True)
_NORMALIZES_IN_PLACE = Traced(writes=("input", "residual"))


@kernel_op(NORM, fused_add=False, gemma=False, traced=_NORMALIZES)
def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None):
    """``out = input / sqrt(mean(input**2, -1) + eps) * weight``; input ``[N, D]`` or ``[B, H, D]``."""
    return _normalize(input, weight, eps, out, rmsnorm.kernels)


@kernel_op(NORM, fused_add=False, gemma=True, traced=_NORMALIZES)
def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None):
    """Gemma's RMSNorm: scales by ``1 + weight``."""
    return _normalize(input, weight, eps, out, gemma_rmsnorm.kernels)


@kernel_op(NORM, fused_add=True, gemma=False, traced=_NORMALIZES_IN_PLACE)
def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> None:
    """In place: ``residual += input; input = rmsnorm(residual)``.

    The sum is formed in fp32 and normalized before rounding; ``residual``
    stores it rounded to the dtype.
    """
    _fused_add(input, residual, weight, eps, fused_add_rmsnorm.kernels)


@kernel_op(NORM, fused_add=True, gemma=True, traced=_NORMALIZES_IN_PLACE)
def gemma_fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    """In place, Gemma scaling: ``residual += input; input = gemma_rmsnorm(residual)``."""
    _fused_add(input, residual, weight, eps, gemma_fused_add_rmsnorm.kernels)


def _variant_and_shape(kernels: OpKernels, input: torch.Tensor) -> tuple[Variant, torch.Size]:
    variant = variant_for_input(kernels, input, "input")
    shape = input.shape
    if len(shape) not in (2, 3):
        raise ValueError(f"input must be 2-D [tokens, hidden] or 3-D [batch, heads, hidden], got shape {tuple(shape)}")
    return variant, shape


def _checked_weight(weight: torch.Tensor, input: torch.Tensor, hidden: int) -> torch.Tensor:
    same_dtype(weight, "weight", input)
    if weight.shape != (hidden,):
        raise ValueError(
            f"weight must have shape ({hidden},) to match input's last dimension, got {tuple(weight.shape)}"
        )
    return weight if weight.is_contiguous() else weight.contiguous()


def _normalize(input, weight, eps, out, kernels):
    out, call = _normalize_call(input, weight, eps, out, kernels)
    if call is not None:
        call()
    return out


def bound_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> BoundCall:
    """``rmsnorm(input, weight, eps, out=out)`` checked once, as a call of no arguments that runs the
    kernel on the same tensors (a prepared decode step's; the tensors must keep their shapes)."""
    return _normalize_call(input, weight, eps, out, rmsnorm.kernels)[1] or BoundCall(no_op)


def _normalize_call(input, weight, eps, out, kernels) -> tuple[torch.Tensor, BoundCall | None]:
    """The output and the kernel call that fills it (None: no rows)."""
    variant, shape = _variant_and_shape(kernels, input)
    weight = _checked_weight(weight, input, shape[-1])
    if out is not None:
        out_strides = checked_out(out, shape, input)
        check_no_overlap(out, "out", input, "input", same_ok=True)  # in place works: each row is read, then written
        check_no_overlap(out, "out", weight, "weight")
    input, strides = readable_rows(input, shape, input.stride())
    if out is None:
        out = torch.empty_like(input)  # as FlashInfer; keeps a dense input's layout
        out_strides = out.stride()
    n0, n1, in_s0, in_s1 = row_geometry(shape, strides)
    _, _, out_s0, out_s1 = row_geometry(shape, out_strides)
    if n0 * n1 * shape[-1] == 0:
        return out, None
    call = functools.partial(  # held with the tensors its addresses point into (input, weight may be copies)
        variant.kernel().run,
        out.data_ptr(),
        out_s0,
        out_s1,
        input.data_ptr(),
        in_s0,
        in_s1,
        0,
        0,
        0,
        weight.data_ptr(),
        n0,
        n1,
        shape[-1],
        float(eps),
        num_threads(),
    )
    return out, BoundCall(call, input, weight, out)


def _fused_add(input, residual, weight, eps, kernels):
    variant, shape = _variant_and_shape(kernels, input)
    same_dtype(residual, "residual", input)
    if residual.shape != shape:
        raise ValueError(f"residual must have the input's shape {tuple(shape)}, got {tuple(residual.shape)}")
    strides, res_strides = input.stride(), residual.stride()
    writable_rows(shape, strides, "input")
    writable_rows(shape, res_strides, "residual")
    weight = _checked_weight(weight, input, shape[-1])
    # both are written: aliased, what each holds would depend on the order of the writes
    check_no_overlap(residual, "residual", input, "input")
    check_no_overlap(input, "input", weight, "weight")
    check_no_overlap(residual, "residual", weight, "weight")
    n0, n1, in_s0, in_s1 = row_geometry(shape, strides)
    _, _, res_s0, res_s1 = row_geometry(shape, res_strides)
    if n0 * n1 * shape[-1] == 0:
        return
    variant.kernel().run(
        input.data_ptr(),
        in_s0,
        in_s1,
        input.data_ptr(),
        in_s0,
        in_s1,
        residual.data_ptr(),
        res_s0,
        res_s1,
        weight.data_ptr(),
        n0,
        n1,
        shape[-1],
        float(eps),
        num_threads(),
    )


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    names = ("gemma_rmsnorm", "gemma_fused_add_rmsnorm") if spec.gemma_norms else ("rmsnorm", "fused_add_rmsnorm")
    return [{"op": name, "dtype": spec.dtype} for name in names]
