"""kernforge: JIT-compiled CPU kernels for LLM inference, with FlashInfer's API."""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # what __getattr__ hands out, for type checkers
    from kernforge.integrations.transformers import from_gguf as from_gguf
    from kernforge.integrations.transformers import from_pretrained as from_pretrained
    from kernforge.integrations.transformers import generate as generate
    from kernforge.integrations.transformers import gguf_tokenizer as gguf_tokenizer
    from kernforge.integrations.transformers import optimize as optimize

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

# The transformers integration's entry points, as ``kernforge.optimize(model)`` and so on: resolved on
# first use (PEP 562), so that ``import kernforge`` neither needs transformers nor pays for importing
# it. They stay out of __all__: a star import would import transformers.
_TRANSFORMERS_ENTRY_POINTS = ("optimize", "generate", "from_pretrained", "from_gguf", "gguf_tokenizer")


def __getattr__(name: str) -> Any:
    if name in _TRANSFORMERS_ENTRY_POINTS:
        try:
            from kernforge.integrations import transformers as integration
        except ImportError as error:  # transformers (or gguf) not installed: say which extra brings it
            extra = "gguf" if "gguf" in name else "transformers"
            raise ImportError(f"kernforge.{name} needs pip install 'kernforge[{extra}]' ({error})") from error
        return getattr(integration, name)
    raise AttributeError(f"module 'kernforge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_TRANSFORMERS_ENTRY_POINTS})
