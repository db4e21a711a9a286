"""The ops, and which compiled variants each one uses (for pre-warm)."""

from __future__ import annotations

from kernforge.jit.core import Variant
from kernforge.ops import activation, norm
from kernforge.ops._common import dtype_name, set_num_threads
from kernforge.ops.activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from kernforge.ops.norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, rmsnorm

# op name -> the variant it runs for a dtype short name ('bf16', 'fp16', 'fp32')
OP_VARIANTS = {
    "rmsnorm": lambda dt: norm.VARIANTS[dt, False, False],
    "fused_add_rmsnorm": lambda dt: norm.VARIANTS[dt, True, False],
    "gemma_rmsnorm": lambda dt: norm.VARIANTS[dt, False, True],
    "gemma_fused_add_rmsnorm": lambda dt: norm.VARIANTS[dt, True, True],
    "silu_and_mul": lambda dt: activation.VARIANTS[dt, "silu"],
    "gelu_and_mul": lambda dt: activation.VARIANTS[dt, "gelu"],
    "gelu_tanh_and_mul": lambda dt: activation.VARIANTS[dt, "gelu_tanh"],
}


def variant_for(op: str, dtype: str) -> Variant:
    if op not in OP_VARIANTS:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(OP_VARIANTS)}")
    return OP_VARIANTS[op](dtype_name(dtype))


__all__ = [
    "OP_VARIANTS", "fused_add_rmsnorm", "gelu_and_mul", "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm", "rmsnorm", "set_num_threads", "silu_and_mul", "variant_for",
]
