"""The ops, and which compiled variants each one uses (for pre-warm)."""

from __future__ import annotations

import torch

from kernforge.jit.core import Variant
from kernforge.ops import activation, norm
from kernforge.ops._common import TORCH_DTYPES, dtype_name, set_num_threads
from kernforge.ops.activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from kernforge.ops.norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, rmsnorm

# op name -> {torch.dtype: Variant}: the kernels each op runs (what pre-warm builds)
OP_VARIANTS = {**norm.OPS, **activation.OPS}


def variant_for(op: str, dtype: str | torch.dtype) -> Variant:
    if op not in OP_VARIANTS:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(OP_VARIANTS)}")
    return OP_VARIANTS[op][TORCH_DTYPES[dtype_name(dtype)]]


__all__ = [
    "OP_VARIANTS", "fused_add_rmsnorm", "gelu_and_mul", "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm", "rmsnorm", "set_num_threads", "silu_and_mul", "variant_for",
]
