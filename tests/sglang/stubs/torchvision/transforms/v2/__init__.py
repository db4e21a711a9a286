from torchvision._standin import module_getattr
from torchvision.transforms.v2 import functional

__all__ = ["functional"]


def __getattr__(name: str) -> object:
    return module_getattr(__name__, name)
