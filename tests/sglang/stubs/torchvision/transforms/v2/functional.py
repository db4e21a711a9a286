from torchvision._standin import InterpolationMode, module_getattr

__all__ = ["InterpolationMode"]


def __getattr__(name: str) -> object:
    return module_getattr(__name__, name)
