"""What the GEMM ops (bf16, int8 w8a8, fp8 block-scaled, bmm) share: the checks of a weight to pack,
of a packed weight, of activation rows and bias, and the kernels' status codes.

Each check raises TypeError (type, dtype) or ValueError (device, shape, layout) naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from typing_extensions import dataclass_transform

from kernforge.ops._common import readable_rows

# Status codes every GEMM entry returns besides 0 (op-specific ones are added by the op).
STATUS = {1: "packed.panel_width is not a multiple of this tier's tile width"}


_Class = TypeVar("_Class", bound=type)


@dataclass_transform()
def packed_weight(saved_as: str) -> Callable[[_Class], _Class]:
    """A packed-weight class: a dataclass with ``n`` and ``k`` fields, given ``shape`` = ``(n, k)``
    (the weight's) and registered with torch.load's safe globals, so it loads with the default
    ``weights_only=True``: under its module's name and under ``saved_as``, the name files saved
    before the GEMM ops became a package (kernforge 0.x, ``kernforge.ops.gemm.int8``...) refer to."""

    def register(cls: _Class) -> _Class:
        dataclass(cls)  # in place: the class gains its fields' __init__, __eq__, __repr__
        cls.shape = property(lambda self: (self.n, self.k), doc="The weight's shape, (N, K).")
        torch.serialization.add_safe_globals([cls, (cls, f"{saved_as}.{cls.__name__}")])
        return cls

    return register


def check_cpu_tensor(t: object, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")


def checked_weight(weight: object, dtype: torch.dtype, op: str) -> tuple[int, int]:
    """(N, K) of a 2-D CPU ``weight [N, K]`` of ``dtype``, which ``op`` packs."""
    check_cpu_tensor(weight, "weight")
    if weight.dtype is not dtype:
        raise TypeError(f"weight has dtype {weight.dtype}; {op} takes {dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    return int(weight.shape[0]), int(weight.shape[1])


def check_layout_version(packed: object, version: int) -> None:
    """A custom op rebuilds a packed weight at this kernforge's layout: refuse another one first."""
    if packed.layout_version != version:
        raise ValueError(
            f"packed has layout version {packed.layout_version}; this kernforge reads version {version} "
            "(pack the weight again)"
        )


def check_packed(
    packed: object,
    cls: type,
    converter: str,
    layout_version: int,
    layout: Callable[[Any], list[tuple[str, torch.dtype, tuple]]],
) -> tuple[int, int]:
    """(N, K) of ``packed``, a ``cls`` of this ``layout_version`` whose tensors, ``(field, dtype,
    shape)`` per ``layout(packed)``, are contiguous CPU tensors of the layout's dtype and shape (a
    hand-made or stale one is refused before a kernel reads it)."""
    if not isinstance(packed, cls):
        raise TypeError(f"packed must be a {cls.__name__} from {converter}, got {type(packed).__name__}")
    if packed.layout_version != layout_version:
        raise ValueError(
            f"packed has layout version {packed.layout_version}; this kernforge reads version "
            f"{layout_version}: pack the weight again with {converter}"
        )
    for field, dtype, shape in layout(packed):
        t = getattr(packed, field)
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype is not dtype
            or not t.is_cpu
            or t.shape != shape
            or not t.is_contiguous()
        ):
            raise ValueError(
                f"packed.{field} must be a contiguous CPU {dtype} tensor of shape {shape} "
                f"for a [{packed.n}, {packed.k}] weight"
            )
    return packed.n, packed.k


def matrix_rows(t: torch.Tensor, name: str, k: int | None = None, k_source: str = ""):
    """(m, k, 2-D rows with a contiguous last dim, row stride) of ``t [..., K]``."""
    shape = t.shape
    if t.dim() == 0 or (k is not None and shape[-1] != k):
        expected = f"[..., {k}] to match {k_source}" if k is not None else "[..., K]"
        raise ValueError(f"{name} must be {expected}, got shape {tuple(shape)}")
    k = shape[-1]
    m = math.prod(shape[:-1])
    t2 = t.reshape(m, k)
    t2, strides = readable_rows(t2, t2.shape, t2.stride())
    return m, k, t2, strides[0]


def checked_fp32_bias(bias: object, n: int) -> torch.Tensor | None:
    """``bias [N]`` as the contiguous fp32 tensor the kernel adds (the caller keeps it alive)."""
    if bias is None:
        return None
    check_cpu_tensor(bias, "bias")
    if not bias.is_floating_point():
        raise TypeError(f"bias has dtype {bias.dtype}; expected a floating dtype (added in float32)")
    if bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},) to match packed's N, got {tuple(bias.shape)}")
    return bias.to(torch.float32).contiguous()


def raise_for_status(status: int, what: str, statuses: dict[int, str] = STATUS) -> None:
    if status:
        raise ValueError(statuses.get(status, f"{what} failed with status {status}"))
