"""kernforge: JIT-compiled CPU kernels for LLM inference, with FlashInfer's API."""

from kernforge._version import __version__
from kernforge.cache.prewarm import prewarm
from kernforge.jit import (
    CompilerNotFoundError,
    IsaError,
    KernelCompileError,
    KernelNotCachedError,
    cpu_info,
    register_template_dir,
    set_isa,
    use_isa,
)
from kernforge.ops import (
    fused_add_rmsnorm,
    gelu_and_mul,
    gelu_tanh_and_mul,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    rmsnorm,
    set_num_threads,
    silu_and_mul,
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

__all__ = [
    "__version__", "CompilerNotFoundError", "cpu_info", "fused_add_rmsnorm", "gelu_and_mul",
    "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "IsaError", "KernelCompileError",
    "KernelNotCachedError", "min_p_sampling_from_probs", "prewarm", "register_template_dir", "rmsnorm",
    "sampling_from_logits", "sampling_from_probs", "set_isa", "set_num_threads", "silu_and_mul", "softmax",
    "top_k_mask_logits", "top_k_renorm_prob", "top_k_renorm_probs", "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits", "top_k_top_p_sampling_from_probs", "top_p_renorm_prob",
    "top_p_renorm_probs", "top_p_sampling_from_probs", "use_isa",
]
