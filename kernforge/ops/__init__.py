"""The ops, and which compiled variants each one uses (for pre-warm)."""

from __future__ import annotations

import torch

from kernforge.jit.core import Variant
from kernforge.ops import activation, norm, sampling
from kernforge.ops._common import TORCH_DTYPES, dtype_name, set_num_threads
from kernforge.ops.activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from kernforge.ops.norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, rmsnorm
from kernforge.ops.sampling import (
    min_p_sampling_from_probs,
    sampling_from_logits,
    sampling_from_probs,
    softmax,
    top_k_mask_logits,
    top_k_renorm_prob,
    top_k_renorm_probs,
    top_k_sampling_from_probs,
    top_k_top_p_sampling_from_logits,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_prob,
    top_p_renorm_probs,
    top_p_sampling_from_probs,
)

# op name -> {torch.dtype: Variant}: the kernels each op runs (what pre-warm builds)
OP_VARIANTS = {**norm.OPS, **activation.OPS, **sampling.OPS}


def variant_for(op: str, dtype: str | torch.dtype) -> Variant:
    if op not in OP_VARIANTS:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(OP_VARIANTS)}")
    variants = OP_VARIANTS[op]
    torch_dtype = TORCH_DTYPES[dtype_name(dtype)]
    if torch_dtype not in variants:
        takes = ", ".join(str(d).removeprefix("torch.") for d in variants)
        raise ValueError(f"{op} does not take {torch_dtype} inputs (it takes {takes})")
    return variants[torch_dtype]


__all__ = [
    "fused_add_rmsnorm", "gelu_and_mul", "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm", "gemma_rmsnorm",
    "min_p_sampling_from_probs", "OP_VARIANTS", "rmsnorm", "sampling_from_logits", "sampling_from_probs",
    "set_num_threads", "silu_and_mul", "softmax", "top_k_mask_logits", "top_k_renorm_prob",
    "top_k_renorm_probs", "top_k_sampling_from_probs", "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs", "top_p_renorm_prob", "top_p_renorm_probs", "top_p_sampling_from_probs",
    "variant_for",
]
