"""Every kernforge call the transformers integration makes, in one place.

They go through ``kernforge.torch_library``: eagerly each is kernforge's op, called directly;
while ``torch.compile`` traces the model each is one ``torch.ops.kernforge`` node, so an optimized
model compiles without graph breaks. The attention wrappers (torch_library's, whose ``run()`` is
the traceable ``attention_run`` op) are planned once per step outside any compiled region;
``attention_run`` is the per-layer call. (MLA's per-head products and latent append, imported from
``kernforge.ops``, are not custom ops yet: a DeepSeek model runs eagerly, or compiles with graph
breaks there.)
"""

from __future__ import annotations

from kernforge.model_spec import GATED_OP_BY_ACTIVATION
from kernforge.ops.activation import bound_gated
from kernforge.ops.attention.page import bound_append_paged_kv_cache, get_batch_indices_positions
from kernforge.ops.gemm.bmm import bmm
from kernforge.ops.mla.attention import append_paged_mla_kv_cache
from kernforge.ops.mla.projections import absorb_kv_b_proj, mla_output_proj
from kernforge.ops.norm import bound_rmsnorm
from kernforge.ops.rope import bound_rope_with_cos_sin_cache_inplace
from kernforge.torch_library import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchMLAPagedAttentionWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    append_paged_kv_cache,
    apply_rope_with_cos_sin_cache_inplace,
    biased_grouped_topk,
    fused_experts,
    gelu_and_mul,
    gelu_tanh_and_mul,
    gemma_rmsnorm,
    grouped_topk,
    rmsnorm,
    shared_expert,
    silu_and_mul,
    top_k_top_p_sampling_from_logits,
    topk_softmax,
)

# Hugging Face ``hidden_act`` -> the gated kernel of ``act(gate) * up`` (the model spec names it).
_GATED_OPS = {op.__name__: op for op in (silu_and_mul, gelu_and_mul, gelu_tanh_and_mul)}
GATED_ACTIVATIONS = {activation: _GATED_OPS[op] for activation, op in GATED_OP_BY_ACTIVATION.items()}
# The ``hidden_act`` values fused_experts runs: it gates with SiLU only.
EXPERT_ACTIVATIONS = tuple(activation for activation, op in GATED_OP_BY_ACTIVATION.items() if op == "silu_and_mul")


def attention_run(wrapper, *tensors):
    """One layer's attention with the step's planned wrapper: ``(query, paged_kv_cache)`` for decode
    and paged prefill, ``(q, k, v)`` for ragged prefill, ``(q_nope, q_pe, ckv_cache, kpe_cache)`` for MLA."""
    return wrapper.run(*tensors)


__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchMLAPagedAttentionWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "EXPERT_ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "attention_run",
    "absorb_kv_b_proj",
    "biased_grouped_topk",
    "bmm",
    "bound_append_paged_kv_cache",
    "bound_gated",
    "bound_rmsnorm",
    "bound_rope_with_cos_sin_cache_inplace",
    "fused_experts",
    "gemma_rmsnorm",
    "get_batch_indices_positions",
    "grouped_topk",
    "mla_output_proj",
    "rmsnorm",
    "shared_expert",
    "top_k_top_p_sampling_from_logits",
    "topk_softmax",
]
