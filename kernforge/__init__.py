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
)

__all__ = [
    "__version__", "CompilerNotFoundError", "IsaError", "KernelCompileError", "KernelNotCachedError", "cpu_info",
    "fused_add_rmsnorm", "gelu_and_mul", "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm", "gemma_rmsnorm",
    "prewarm", "register_template_dir", "rmsnorm", "set_isa", "set_num_threads", "silu_and_mul", "use_isa",
]
