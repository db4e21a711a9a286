"""Batched matmul with sgl-kernel's CPU semantics (``bmm_cpu(out, mat1, mat2, is_vnni, scale)``):
``out[i] = a[i] @ b[i].T`` for ``a [B, M, K]``, ``b [B, N, K]``, ``out [B, M, N]``, written into ``out``.

* ``b`` is either a tensor ``[B, N, K]`` (bf16, or float8_e4m3fn together with ``scale``), packed on
  every call as sgl-kernel does when ``is_vnni`` is false, or a sequence of ``B`` :class:`PackedWeight`
  (``convert_weight_packed(b[i])`` done once: sgl-kernel's ``is_vnni=True``).
* ``scale`` is sgl-kernel's per-tensor scale of the fp8 path (a 0-dim tensor; a Python float is also
  taken, and for a bf16 ``b`` it scales the product the same way): ``out = a @ (b * scale).T``.

This first version runs the bf16 micro-kernel once per batch entry (``weight_packed_linear`` on
``a[i]`` into ``out[i]``). Costs, stated plainly: an unpacked ``b`` is copied into the packed layout on
every call (reads and writes B*N*K elements, as sgl-kernel's non-VNNI path also does), a scale or an
fp8 ``b`` adds one fp32 pass over ``b`` (the scale is folded into the bf16 weight, one bf16 rounding per
element), and the B kernel calls parallelize over each entry's M x N only, not over the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kernforge.ops._common import checked_out, variant_for_input
from kernforge.ops._registry import export
from kernforge.ops.gemm import PackedWeight, convert_weight_packed, weight_packed_linear

_B_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def bmm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor | Sequence[PackedWeight],
        scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """``out [B, M, N] = a [B, M, K] @ b[i].T (* scale)`` in ``a``'s dtype (fp32 accumulation); returns ``out``.
    ``b`` is ``[B, N, K]`` bf16 (or float8_e4m3fn with ``scale``) or ``B`` prepacked weights."""
    variant_for_input(weight_packed_linear.kernels, a, "a")  # the dtype and device checks
    if a.dim() != 3:
        raise ValueError(f"a must be 3-D [B, M, K], got shape {tuple(a.shape)}")
    batch, m, k = a.shape
    packed, n = _packed_batch(b, batch, k, _scale_value(scale, b))
    if n is None:  # an empty list for an empty batch: N is out's to say
        n = out.shape[-1] if isinstance(out, torch.Tensor) and out.dim() == 3 else 0
    checked_out(out, (batch, m, n), a)
    for a_i, packed_i, out_i in zip(a, packed, out):
        weight_packed_linear(a_i, packed_i, out=out_i)
    return out


export("bmm", bmm)


def _scale_value(scale: object, b: object) -> float | None:
    if scale is None:
        if isinstance(b, torch.Tensor) and b.dtype is torch.float8_e4m3fn:
            raise ValueError("scale is required when b is float8_e4m3fn (sgl-kernel's fp8 bmm: a 0-dim tensor)")
        return None
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0:
            raise ValueError(f"scale must be a 0-dim tensor (one per-tensor scale), got shape {tuple(scale.shape)}")
        if not scale.is_floating_point():
            raise TypeError(f"scale has dtype {scale.dtype}; expected a floating dtype")
        return float(scale)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    raise TypeError(f"scale must be a 0-dim tensor or a float, got {type(scale).__name__}")


def _packed_batch(b: object, batch: int, k: int, scale: float | None) -> tuple[list[PackedWeight], int | None]:
    """The B packed weights and N (None for an empty list)."""
    if isinstance(b, torch.Tensor):
        return _pack_tensor(b, batch, k, scale), b.shape[1]
    if not isinstance(b, (list, tuple)) or not all(isinstance(p, PackedWeight) for p in b):
        raise TypeError(f"b must be a [B, N, K] tensor or a list of PackedWeight, got {type(b).__name__}")
    if scale is not None:
        raise ValueError("scale cannot be applied to prepacked b: fold it into the weights before packing")
    if len(b) != batch or any(p.k != k or p.n != b[0].n for p in b):
        shapes = [p.shape for p in b]
        raise ValueError(f"b must hold {batch} packed weights of one shape [N, {k}] to match a, got {shapes}")
    return list(b), (b[0].n if b else None)


def _pack_tensor(b: torch.Tensor, batch: int, k: int, scale: float | None) -> list[PackedWeight]:
    if b.dtype not in _B_DTYPES:
        raise TypeError(f"b has dtype {b.dtype}; bmm takes torch.bfloat16 or torch.float8_e4m3fn (with scale)")
    if not b.is_cpu:
        raise ValueError(f"b is on device {b.device}; kernforge kernels run on the CPU")
    if b.dim() != 3 or b.shape[0] != batch or b.shape[2] != k:
        raise ValueError(f"b must be [{batch}, N, {k}] to match a [B, M, K], got shape {tuple(b.shape)}")
    if scale is not None:
        b = (b.float() * scale).bfloat16()  # the scale in the weight: one rounding per element, none per output
    return [convert_weight_packed(b_i) for b_i in b]
