"""kernforge: JIT-compiled CPU kernels for LLM inference, with FlashInfer's API."""

from kernforge import (
    ops,
    torch_library,  # noqa: F401,E402  (defines torch.ops.kernforge.*: the ops as graph nodes)
)
from kernforge._version import __version__
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
from kernforge.memory import advise_huge_pages, empty_kv_cache, zero_in_huge_pages  # KV caches in huge pages
from kernforge.ops import *  # noqa: F401,F403  (the registered ops, listed once in kernforge.ops)
from kernforge.prewarm import prewarm
from kernforge.tune import tune_gemm, tune_int4, tune_prefill  # tools: time the tile candidates, record the winners

__all__ = [
    "__version__",
    "advise_huge_pages",
    "CompilerNotFoundError",
    "cpu_info",
    "empty_kv_cache",
    "IsaError",
    "KernelCompileError",
    "KernelNotCachedError",
    "prewarm",
    "register_template_dir",
    "set_isa",
    "tune_gemm",
    "tune_int4",
    "tune_prefill",
    "use_isa",
    "zero_in_huge_pages",
    *ops.__all__,
]
