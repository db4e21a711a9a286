"""A stand-in for torchvision in the SGLang test environment (.venv-sglang) only: `make sglang` copies
this package into that environment's site-packages. Nothing in kernforge uses it.

Why: SGLang 0.5.23 imports torchvision at module level on its text-model path (sglang.srt.configs
imports the multimodal processors' helpers, e.g. sglang/srt/multimodal/internvl_utils.py), and PyPI's
torchvision is a CUDA build that fails on import beside torch's CPU build (`operator torchvision::nms
does not exist`). The names those imports take exist here (InterpolationMode for real, as modules use
its members in default arguments); calling anything else raises NotImplementedError, so an image path
that reaches it fails loudly. There is no distribution metadata, so transformers reports torchvision as
not installed.
"""

from torchvision import io, transforms
from torchvision._standin import module_getattr

__version__ = "0.0.0+standin"
__all__ = ["io", "transforms"]


def __getattr__(name: str) -> object:
    return module_getattr(__name__, name)
