"""The hostile-input table's machinery: what a case is, how it runs, and the inputs it is built from.

A :class:`Case` is one public op (its name in ``docs/op-reference.md``; a wrapper's plan() and run()
are cases of the wrapper class) tried with one hostile input: a valid call (``setup``, a
:class:`Setup`: the function and its keyword arguments, deterministic), one change to it
(``change``: the base arguments -> the arguments that replace them) and what must happen:

* :class:`Refuses`: the exception type, raised with a message that names the argument (as a whole
  word, in the message or its notes), and every tensor the call could reach (the arguments,
  recursively through sequences and packed-weight objects, plus ``Setup.watch``) bit-identical
  afterwards: nothing written, not an output, not a KV cache.
* :class:`Runs`: the op runs, and ``check(result, args, plain)`` holds, where ``plain`` is the
  result of the unchanged call (``(result, args)``): NaN/Inf propagating as FlashInfer / torch
  propagate it, an aliased output computing what a separate one does.
* :class:`SameAsPlain`: the op runs and gives exactly what the unchanged call gives, its
  arguments (in-place outputs, caches) left as the unchanged call leaves them: inputs that end
  at an inaccessible page (:func:`guarded`), where reading one byte past the end faults.

``KINDS`` names the kinds of hostile input; ``docs/safety.md`` is the table rendered by kind.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import re
from collections.abc import Callable
from typing import Any

import torch

# kind -> its column heading in docs/safety.md, in the order the columns appear
KINDS = {
    "dtype": "wrong dtype",
    "device": "wrong device (meta)",
    "shape": "wrong rank / shape",
    "index": "negative / out-of-range index",
    "indptr": "bad indptr",
    "length": "length past page / buffer",
    "alias": "aliasing output",
    "misuse": "wrapper misuse",
    "nan": "NaN / Inf",
    "guard": "ends at a guard page",
}


class Setup:
    """A valid call: ``fn(**args)``; ``watch`` holds tensors besides the arguments that a refused call
    must leave unchanged (a wrapper's planned state)."""

    def __init__(self, fn: Callable[..., Any], watch: dict[str, Any] | None = None, **args: Any):
        self.fn, self.args, self.watch = fn, args, watch or {}


@dataclasses.dataclass(frozen=True)
class Refuses:
    exc: type[BaseException]
    arg: str  # the argument the message must name

    def describe(self) -> str:
        return f"{self.exc.__name__} naming `{self.arg}`"


@dataclasses.dataclass(frozen=True)
class Runs:
    check: Callable[[Any, dict, tuple], None]
    note: str = "runs"

    def describe(self) -> str:
        return self.note


@dataclasses.dataclass(frozen=True)
class SameAsPlain:
    note: str = "same result"

    def describe(self) -> str:
        return self.note


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # the public name
    kind: str  # a key of KINDS
    what: str  # the hostile input, in a few words (docs/safety.md's cell)
    setup: Callable[[], Setup]
    change: Callable[[dict], dict] | None
    expect: Refuses | Runs | SameAsPlain

    @property
    def id(self) -> str:
        return re.sub(r"[^\w.\[\]=<>+-]+", "_", f"{self.op}-{self.kind}-{self.what}").strip("_")


class CaseList(list):
    """The cases of one op: ``add(kind, what, change, expect)`` on one base call."""

    def __init__(self, op: str, setup: Callable[[], Setup]):
        super().__init__()
        self.op, self.setup = op, setup

    def add(self, kind: str, what: str, change, expect, setup: Callable[[], Setup] | None = None) -> CaseList:
        assert kind in KINDS, kind
        self.append(Case(self.op, kind, what, setup or self.setup, change, expect))
        return self

    # the common shapes of a case
    def dtype(self, arg: str, dtype: torch.dtype, exc=TypeError, named: str | None = None) -> CaseList:
        return self.add(
            "dtype", f"{arg} {_dtype(dtype)}", lambda a: {arg: to_dtype(a[arg], dtype)}, Refuses(exc, named or arg)
        )

    def meta(self, arg: str, exc=ValueError, named: str | None = None) -> CaseList:
        return self.add("device", f"{arg} on meta", lambda a: {arg: on_meta(a[arg])}, Refuses(exc, named or arg))

    def refuse(self, kind: str, what: str, change, arg: str, exc=ValueError) -> CaseList:
        return self.add(kind, what, change, Refuses(exc, arg))

    def guard(self, *args: str, setup: Callable[[], Setup] | None = None) -> CaseList:
        """``args`` copied to end at an inaccessible page: the same result (``setup``: another base call,
        of sizes off the vector width)."""
        what = ", ".join(args) + " end at a PROT_NONE page" + (" (unaligned sizes)" if setup else "")
        return self.add("guard", what, lambda a: {n: guarded_any(a[n]) for n in args}, SameAsPlain(), setup)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- inputs


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=gen(seed)).to(dtype)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def to_dtype(t: Any, dtype: torch.dtype) -> Any:
    """``t`` in ``dtype`` (by value; through an integer for the float8 types, which cannot take every
    conversion directly)."""
    if isinstance(t, (tuple, list)):
        return type(t)(to_dtype(x, dtype) for x in t)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or not t.is_floating_point():
        return t.float().clamp(-100, 100).to(dtype)
    return t.to(dtype)


def on_meta(t: Any) -> Any:
    """``t`` (or each tensor of a pair) as a 'meta' tensor: the stand-in for another device."""
    if isinstance(t, (tuple, list)):
        return type(t)(on_meta(x) for x in t)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def with_value(t: torch.Tensor, index, value) -> torch.Tensor:
    """A copy of ``t`` with ``t[index] = value``."""
    t = t.clone()
    t[index] = value
    return t


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def guarded(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` whose last byte is the last before an inaccessible page (mmap, then
    mprotect(PROT_NONE) on the page after it): an op reading or writing one byte past the tensor's
    end faults. The tensor keeps its mapping alive."""
    nbytes, page = t.numel() * t.element_size(), mmap.PAGESIZE
    size = -(-nbytes // page) * page + page
    raw = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
    if _libc.mprotect(raw.data_ptr() + size - page, page, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect(PROT_NONE) failed")
    return raw[size - page - nbytes : size - page].view(t.dtype).view(t.shape).copy_(t)


def guarded_any(value: Any) -> Any:
    """:func:`guarded` for a tensor, each tensor of a pair, or each tensor field of a packed weight."""
    if isinstance(value, torch.Tensor):
        return guarded(value)
    if isinstance(value, (tuple, list)):
        return type(value)(guarded_any(x) for x in value)
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
        return type(value)(**{k: guarded(v) if isinstance(v, torch.Tensor) else v for k, v in fields.items()})
    raise TypeError(f"cannot guard a {type(value).__name__}")


# --------------------------------------------------------------------------- running a case


def tensors_of(value: Any, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor ``value`` reaches: itself, sequences' and dicts' items, dataclass fields (a packed
    weight's tensors), recursively; meta tensors (no data) are left out."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [] if value.is_meta else [value]
    if isinstance(value, (tuple, list)):
        return [t for x in value for t in tensors_of(x, seen)]
    if isinstance(value, dict):
        return [t for x in value.values() for t in tensors_of(x, seen)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_of(getattr(value, f.name), seen)]
    return []


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [bits(t) for t in tensors]


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as bytes (NaN compares equal to itself, -0 differs from 0)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(bits(a), bits(b))
        )
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(same_bits, a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):  # a packed weight: field by field
        names = [f.name for f in dataclasses.fields(a)]
        return type(a) is type(b) and all(same_bits(getattr(a, n), getattr(b, n)) for n in names)
    return a == b


def names_argument(exc: BaseException, arg: str) -> bool:
    """Whether the message (or a note on it) names ``arg`` as a whole word."""
    text = " ".join([str(exc), *getattr(exc, "__notes__", ())])
    return re.search(rf"(?<![\w]){re.escape(arg)}(?![\w])", text) is not None


def overlapping(args: dict, x_name: str, out_name: str, out_shape: tuple[int, ...], shift: int) -> dict:
    """``args[x_name]`` copied to the start of a larger buffer, and ``out_name`` a contiguous
    ``out_shape`` view of that buffer ``shift`` elements later (of x's dtype): an output that overlaps
    its input without being it."""
    x = args[x_name]
    count = max(x.numel(), shift + torch.Size(out_shape).numel())
    base = torch.empty(count, dtype=x.dtype)
    moved = base[: x.numel()].view(x.shape).copy_(x)
    return {x_name: moved, out_name: base[shift : shift + torch.Size(out_shape).numel()].view(out_shape)}
