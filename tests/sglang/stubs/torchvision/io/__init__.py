from torchvision._standin import module_getattr


def __getattr__(name: str) -> object:
    return module_getattr(__name__, name)
