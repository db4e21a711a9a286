from torchvision._standin import InterpolationMode, module_getattr
from torchvision.transforms import functional, v2

__all__ = ["InterpolationMode", "functional", "v2"]


def __getattr__(name: str) -> object:
    return module_getattr(__name__, name)
