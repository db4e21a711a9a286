"""What every module of the torchvision stand-in shares (see __init__.py)."""

from __future__ import annotations

import enum
from typing import Any, NoReturn


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode's members: modules use them in default arguments at import."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(qualname: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"{qualname}: this environment has a torchvision stand-in (tests/sglang/stubs), not torchvision; "
            "PyPI's torchvision is a CUDA build that fails on import beside torch's CPU build"
        )

    call.__qualname__ = call.__name__ = qualname.rsplit(".", 1)[-1]
    return call


def module_getattr(module: str, name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(f"{module}.{name}")
