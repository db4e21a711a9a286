"""Every kernforge call the transformers integration makes, in one place.

The modules and the cache call these names only, so routing them elsewhere (for example through
``torch.ops.kernforge`` custom ops, for ``torch.compile``) is a change to this file alone. The
attention wrappers are planned once per step outside any compiled region; ``attention_run`` is
the per-layer call.
"""

from __future__ import annotations

from kernforge.ops.activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from kernforge.ops.decode import BatchDecodeWithPagedKVCacheWrapper
from kernforge.ops.norm import rmsnorm
from kernforge.ops.page import append_paged_kv_cache, get_batch_indices_positions
from kernforge.ops.prefill import BatchPrefillWithPagedKVCacheWrapper
from kernforge.ops.rope import apply_rope_with_cos_sin_cache_inplace
from kernforge.ops.sampling import top_k_top_p_sampling_from_logits

# Hugging Face ``hidden_act`` -> the gated kernel of ``act(gate) * up``.
GATED_ACTIVATIONS = {
    "silu": silu_and_mul, "swish": silu_and_mul,
    "gelu": gelu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu_new": gelu_tanh_and_mul, "gelu_fast": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
}


def attention_run(wrapper, query, paged_kv_cache):
    """One layer's attention with the step's planned wrapper (decode or prefill)."""
    return wrapper.run(query, paged_kv_cache)


__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper", "GATED_ACTIVATIONS",
    "append_paged_kv_cache", "apply_rope_with_cos_sin_cache_inplace", "attention_run", "get_batch_indices_positions",
    "rmsnorm", "top_k_top_p_sampling_from_logits",
]
