"""Batched matmuls: sgl-kernel's ``bmm`` and FlashInfer's ``bmm_fp8``.

``bmm(out, a, b, scale=None)``, sgl-kernel's CPU semantics (``bmm_cpu(out, mat1, mat2, is_vnni, scale)``):
``out[i] = a[i] @ b[i].T`` for ``a [B, M, K]``, ``b [B, N, K]``, ``out [B, M, N]``, written into ``out``.

* ``b`` is either a tensor ``[B, N, K]`` (bf16, or float8_e4m3fn together with ``scale``), packed on
  every call as sgl-kernel does when ``is_vnni`` is false, or a sequence of ``B`` :class:`PackedWeight`
  (``convert_weight_packed(b[i])`` done once: sgl-kernel's ``is_vnni=True``).
* ``scale`` is sgl-kernel's per-tensor scale of the fp8 path (a 0-dim tensor; a Python float is also
  taken, and for a bf16 ``b`` it scales the product the same way): ``out = (a @ b.T) * scale``. The
  scale multiplies the fp32 sums, which are rounded once to ``out``'s dtype: fp8 weights widen to
  bf16 exactly, and no product is rounded on its own (folding the scale into bf16 weights would
  round each one, an error that grows with K).

This first version runs the bf16 micro-kernel once per batch entry (``weight_packed_linear`` on
``a[i]`` into ``out[i]``). Costs, stated plainly: an unpacked ``b`` is copied into the packed layout on
every call (reads and writes B*N*K elements, as sgl-kernel's non-VNNI path also does); with a scale,
``a`` is widened to fp32 (so that the GEMM writes fp32 sums) and the sums take one more pass; the B
kernel calls parallelize over each entry's M x N only, not over the batch.

``bmm_fp8(A, B, A_scale, B_scale, dtype, out=None, backend="cublas")``, FlashInfer's semantics:
``out[i] = (A[i] @ B[i]) * A_scale * B_scale`` for fp8 ``A [b, m, k]`` and ``B [b, k, n]`` (e4m3 or e5m2,
either or both; FlashInfer passes B column-major, the transpose of a contiguous ``[b, n, k]``, but any
layout is read), per-tensor float32 scales (one element each) and ``out [b, m, n]`` in ``dtype``
(bf16 or fp16). Every fp8 value is exactly a bf16 and an fp32, so the product runs on
``weight_packed_linear`` with exact operands: ``B[i]`` is packed on every call (as a bf16 weight
``[n, k]``), ``A`` is widened to fp32 so that the GEMM writes its fp32 sums unrounded, and the scales
are applied to those sums before the one rounding to ``dtype`` (an unscaled fp8 product would
overflow fp16). ``backend`` is checked against
FlashInfer's names and otherwise ignored: there is one CPU implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernforge.ops._common import _overlaps, check_no_overlap, checked_out, variant_for_input
from kernforge.ops._registry import export
from kernforge.ops.gemm._common import check_cpu_tensor
from kernforge.ops.gemm.bf16 import PackedWeight, convert_weight_packed, weight_packed_linear

_B_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)
BMM_FP8_BACKENDS = ("cudnn", "cublas", "cutlass", "auto")


def bmm(
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor | Sequence[PackedWeight],
    scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``out [B, M, N] = a [B, M, K] @ b[i].T (* scale)`` in ``a``'s dtype (fp32 accumulation); returns ``out``.
    ``b`` is ``[B, N, K]`` bf16 (or float8_e4m3fn with ``scale``) or ``B`` prepacked weights."""
    variant_for_input(weight_packed_linear.kernels, a, "a")  # the dtype and device checks
    if a.dim() != 3:
        raise ValueError(f"a must be 3-D [B, M, K], got shape {tuple(a.shape)}")
    batch, m, k = a.shape
    scale = checked_scale(scale, b)
    packed, n = _packed_batch(b, batch, k, scale)
    if n is None:  # an empty list for an empty batch: N is out's to say
        n = out.shape[-1] if isinstance(out, torch.Tensor) and out.dim() == 3 else 0
    checked_out(out, (batch, m, n), a)
    check_no_overlap(out, "out", a, "a")
    for weights in [b] if isinstance(b, torch.Tensor) else [p.packed for p in packed]:
        check_no_overlap(out, "out", weights, "b")
    if scale is None:
        _products(out, a, packed)
    else:
        _scaled_products(a, packed, scale, out)
    return out


export("bmm", bmm)


def checked_scale(scale: object, b: object, scale_name: str = "scale", b_name: str = "b") -> float | None:
    """sgl-kernel's per-tensor scale of the weights ``b`` (a 0-dim tensor, or a float) as a float; None
    for no scale, which an fp8 ``b`` tensor may not have. The names are the calling op's arguments."""
    if scale is None:
        if isinstance(b, torch.Tensor) and b.dtype is torch.float8_e4m3fn:
            raise ValueError(
                f"{scale_name} is required when {b_name} is float8_e4m3fn (sgl-kernel's fp8 bmm: a 0-dim tensor)"
            )
        return None
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0:
            raise ValueError(
                f"{scale_name} must be a 0-dim tensor (one per-tensor scale), got shape {tuple(scale.shape)}"
            )
        if not scale.is_floating_point():
            raise TypeError(f"{scale_name} has dtype {scale.dtype}; expected a floating dtype")
        return float(scale)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    raise TypeError(f"{scale_name} must be a 0-dim tensor or a float, got {type(scale).__name__}")


def _packed_batch(b: object, batch: int, k: int, scale: float | None) -> tuple[list[PackedWeight], int | None]:
    """The B packed weights and N (None for an empty list)."""
    if isinstance(b, torch.Tensor):
        if b.dtype not in _B_DTYPES:
            raise TypeError(f"b has dtype {b.dtype}; bmm takes torch.bfloat16 or torch.float8_e4m3fn (with scale)")
        return _pack_tensor(b, batch, k), b.shape[1]
    if not isinstance(b, (list, tuple)) or not all(isinstance(p, PackedWeight) for p in b):
        raise TypeError(f"b must be a [B, N, K] tensor or a list of PackedWeight, got {type(b).__name__}")
    if scale is not None:
        raise ValueError("scale cannot be applied to prepacked b: fold it into the weights before packing")
    if len(b) != batch or any(p.k != k or p.n != b[0].n for p in b):
        shapes = [p.shape for p in b]
        raise ValueError(f"b must hold {batch} packed weights of one shape [N, {k}] to match a, got {shapes}")
    return list(b), (b[0].n if b else None)


def _pack_tensor(b: torch.Tensor, batch: int, k: int) -> list[PackedWeight]:
    """``b [batch, N, k]`` (bf16 or fp8, any strides) packed per entry."""
    if not b.is_cpu:
        raise ValueError(f"b is on device {b.device}; kernforge kernels run on the CPU")
    if b.dim() != 3 or b.shape[0] != batch or b.shape[2] != k:
        raise ValueError(f"b must be [{batch}, N, {k}] to match a [B, M, K], got shape {tuple(b.shape)}")
    return [convert_weight_packed(b_i.to(torch.bfloat16)) for b_i in b]  # fp8 -> bf16 is exact


def _products(out: torch.Tensor, a: torch.Tensor, packed: Sequence[PackedWeight]) -> None:
    """``out[i] = a[i] @ weight_i.T``."""
    for a_i, packed_i, out_i in zip(a, packed, out):
        weight_packed_linear(a_i, packed_i, out=out_i)


def _scaled_products(a: torch.Tensor, packed: Sequence[PackedWeight], scale, out: torch.Tensor) -> None:
    """``out[i] = (a[i] @ weight_i.T) * scale``, rounded once (:func:`scaled_once`)."""
    scaled_once(out, a, scale, lambda sums, a32: _products(sums, a32, packed))


def scaled_once(
    out: torch.Tensor,
    a: torch.Tensor,
    scale: float | torch.Tensor,
    products: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """``out = products(a) * scale``, rounded once: ``products(sums, a32)`` writes into fp32 ``sums``
    (``out``'s shape) the GEMM sums of ``a`` widened to fp32 (exact, so that the GEMM writes fp32),
    which the scale multiplies before the one rounding to ``out``'s dtype."""
    sums = torch.empty(out.shape, dtype=torch.float32)
    products(sums, a.to(torch.float32))
    out.copy_(sums.mul_(scale))


def bmm_fp8(
    A: torch.Tensor,
    B: torch.Tensor,
    A_scale: torch.Tensor,
    B_scale: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    backend: str = "cublas",
) -> torch.Tensor:
    """FlashInfer's ``bmm_fp8``: ``out [b, m, n] = (A [b, m, k] @ B [b, k, n]) * A_scale * B_scale`` in
    ``dtype`` (bf16 or fp16); ``A`` and ``B`` float8_e4m3fn or float8_e5m2, the scales float32 with one
    element. Returns ``out`` (allocated when None)."""
    if dtype not in _FP8_OUT_DTYPES:  # FlashInfer's message (its common check, made before anything else)
        raise ValueError(
            f"Unsupported output dtype: {dtype}. "
            "Only torch.bfloat16 and torch.float16 are supported for FP8 GEMM operations."
        )
    if backend not in BMM_FP8_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BMM_FP8_BACKENDS))}, got {backend!r}")
    for t, name in ((A, "A"), (B, "B")):
        check_cpu_tensor(t, name)
        if t.dtype not in _FP8_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; bmm_fp8 takes torch.float8_e4m3fn or torch.float8_e5m2")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
    if backend == "cutlass" and torch.float8_e5m2 in (A.dtype, B.dtype):  # FlashInfer's message
        raise ValueError("e5m2 is not supported for bmm_fp8 with cutlass backend")
    batch, m, k = A.shape
    if B.shape[0] != batch or B.shape[1] != k:
        raise ValueError(f"B must be [{batch}, {k}, n] to match A [b, m, k] = {list(A.shape)}, got {list(B.shape)}")
    n = B.shape[2]
    scale = _per_tensor_scale(A_scale, "A_scale") * _per_tensor_scale(B_scale, "B_scale")
    out = _checked_fp8_out(out, (batch, m, n), dtype)
    check_no_overlap(out, "out", A, "A")
    check_no_overlap(out, "out", B, "B")
    _scaled_products(A, _pack_tensor(B.transpose(1, 2), batch, k), scale, out)  # B as [b, n, k]
    return out


export("bmm_fp8", bmm_fp8)


def _per_tensor_scale(scale: object, name: str) -> torch.Tensor:
    check_cpu_tensor(scale, name)
    if scale.dtype is not torch.float32:
        raise TypeError(f"{name} has dtype {scale.dtype}; expected torch.float32 (a per-tensor scale)")
    if scale.numel() != 1:
        raise ValueError(f"{name} must hold one element (a per-tensor scale), got shape {tuple(scale.shape)}")
    return scale.reshape(())


def _checked_fp8_out(out: object, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype)
    check_cpu_tensor(out, "out")
    if out.dtype is not dtype:
        raise TypeError(f"out has dtype {out.dtype} but dtype is {dtype}; they must match")
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape} ([b, m, n] of A and B), got {tuple(out.shape)}")
    if _overlaps(out.shape, out.stride()):  # an expanded out: torch's copy into it would refuse it late
        raise ValueError(
            f"out's elements overlap (shape {tuple(out.shape)}, strides {out.stride()}): each needs memory of its own"
        )
    return out
