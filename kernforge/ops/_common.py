"""Argument checks and row geometry shared by the ops.

Checks raise ``TypeError`` for a wrong type or dtype and ``ValueError`` for a
wrong device, shape or layout, always naming the argument. They are written
for the warm path: a few attribute reads per tensor, no new tensors.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch

from kernforge.jit.core import Variant
from kernforge.jit.module import DTYPE_ALIASES
from kernforge.ops._registry import DTYPE_NAMES, FP8_DTYPE_NAMES, OpKernels

TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
KV_TORCH_DTYPES = {name: dtype for dtype, name in {**DTYPE_NAMES, **FP8_DTYPE_NAMES}.items()}


def kv_cache_dtype(value: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a KV cache dtype in any spelling: the float ones and fp8 ('fp8_e4m3',
    'float8_e4m3fn', torch.float8_e5m2 ...)."""
    if isinstance(value, torch.dtype):
        found = value if value in KV_TORCH_DTYPES.values() else None
    else:
        found = KV_TORCH_DTYPES.get(DTYPE_ALIASES.get(str(value).lower().removeprefix("torch.")))
    if found is None:
        raise TypeError(
            f"unsupported KV cache dtype {value!r}; kernforge takes float32, bfloat16, float16, float8_e4m3fn and "
            "float8_e5m2"
        )
    return found


def dtype_name(value: str | torch.dtype) -> str:
    """'bf16' for torch.bfloat16, 'bfloat16', 'torch.bfloat16', 'bf16' ..."""
    if isinstance(value, torch.dtype):
        name = DTYPE_NAMES.get(value)
    else:
        name = DTYPE_ALIASES.get(str(value).lower().removeprefix("torch."))
    if name not in TORCH_DTYPES:
        raise TypeError(f"unsupported dtype {value!r}; kernforge ops take float32, bfloat16 or float16")
    return name


def variant_for_input(kernels: OpKernels, t: object, name: str) -> Variant:
    """The op's variant for a CPU float tensor ``t``: the dtype check and the lookup in one."""
    try:  # warm path: two attribute reads and a dict lookup
        if t.is_cpu:
            return kernels.by_dtype[t.dtype]
    except (AttributeError, KeyError):
        pass
    _explain_float_tensor(t, name)
    try:
        return kernels.variant(t.dtype)  # the first call with this dtype
    except ValueError as exc:
        raise TypeError(f"{name}: {exc}") from None


def same_dtype(t: object, name: str, like: torch.Tensor, like_name: str = "input") -> None:
    """Check a CPU tensor with ``like``'s dtype."""
    try:
        if t.dtype is like.dtype and t.is_cpu:
            return
    except AttributeError:
        pass
    _explain_float_tensor(t, name)
    raise TypeError(f"{name} has dtype {t.dtype} but {like_name} has {like.dtype}; they must match")


def _explain_float_tensor(t: object, name: str) -> None:
    """Raise the error that says what is wrong with ``t`` (returns if nothing is)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float32, torch.bfloat16 or torch.float16")
    if not t.is_cpu:
        raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")


# The helpers below work on a tensor's shape and stride tuples, read once per
# call: tensor.stride(i) and tensor.size(i) cost twice as much as the tuples.


def writable_rows(shape: torch.Size, strides: tuple[int, ...], name: str) -> None:
    """Tensors the kernel writes need a contiguous last dimension, and rows that do not
    overlap (an expanded tensor would be written by several threads at once)."""
    if strides[-1] != 1 and shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {strides}")
    # The common 2-D case costs two tuple reads on the warm path; other ranks take the general test.
    overlap = (shape[0] > 1 and strides[0] < shape[1]) if len(shape) == 2 else _overlaps(shape, strides)
    if overlap:
        raise ValueError(
            f"{name}'s rows overlap (shape {tuple(shape)}, strides {strides}): "
            "rows are written in parallel, so each element needs memory of its own"
        )


def _overlaps(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    """Whether two indices may share an element: dims by increasing stride must each step over
    everything the smaller ones span (sufficient, and what every non-exotic layout meets)."""
    span = 0  # elements covered by the dims seen so far, minus one
    for stride, size in sorted((s, n) for s, n in zip(strides, shape) if n > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def check_no_overlap(
    written: torch.Tensor, written_name: str, other: torch.Tensor, other_name: str, same_ok: bool = False
) -> None:
    """ValueError when ``written`` (a tensor the op writes) shares memory with ``other`` (one it reads
    or writes too): rows computed in parallel would read what another thread already overwrote, and
    the result would depend on the order. With ``same_ok``, ``written`` may be ``other`` itself (same
    address, shape, strides and dtype: an op that works in place). FlashInfer does not check this.

    Cheap on the warm path: tensors whose byte ranges do not meet return after a few attribute
    reads, and so do slices of one buffer that interleave token by token (q and k of a packed qkv, x
    and out side by side); other layouts whose ranges meet are checked element by element."""
    a_start, a_end = _byte_range(written)
    b_start, b_end = _byte_range(other)
    if a_end <= b_start or b_end <= a_start or a_start == a_end or b_start == b_end:
        return  # the byte ranges do not meet (or one is empty)
    a_shape, b_shape = written.shape, other.shape
    a_strides, b_strides = written.stride(), other.stride()
    if (
        same_ok
        and a_start == b_start
        and a_shape == b_shape
        and a_strides == b_strides
        and written.dtype == other.dtype
    ):
        return
    size = written.element_size()
    if (
        size == other.element_size()
        and (b_start - a_start) % size == 0
        and not _share_elements((b_start - a_start) // size, a_shape, a_strides, b_shape, b_strides)
    ):
        return
    raise ValueError(
        f"{written_name} overlaps {other_name} in memory ({written_name} shape {tuple(a_shape)} strides "
        f"{a_strides} at {a_start:#x}, {other_name} shape {tuple(b_shape)} strides {b_strides} at "
        f"{b_start:#x}): {written_name} is written while {other_name} is "
        + (
            "read; pass a separate tensor, or the very same one to work in place"
            if same_ok
            else "used; pass a separate tensor"
        )
    )


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The addresses of a tensor's first byte and one past its last (equal when it is empty)."""
    start = t.data_ptr()
    elements = t.numel() if t.is_contiguous() else _span(t.shape, t.stride())
    return start, start + elements * t.element_size()


def _span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from a tensor's first to its last element, plus one (0 when empty)."""
    span = 1
    for size, stride in zip(shape, strides):
        if size == 0:
            return 0
        span += (size - 1) * stride
    return span


_MAX_EXACT_OVERLAP = 1 << 26  # elements spanned by two tensors checked element by element, at most


def _share_elements(
    delta: int, a_shape: Sequence[int], a_strides: Sequence[int], b_shape: Sequence[int], b_strides: Sequence[int]
) -> bool:
    """Whether two tensors of one element size, ``b`` starting ``delta`` elements after ``a``, share an
    element. Slices of one buffer interleaved along a common leading dimension (each one's rest
    within that dimension's stride, the other sitting in the gap) are told apart in O(1); anything
    else is checked exactly over the elements (the rare layouts whose byte ranges meet)."""
    if len(a_shape) > 1 and len(b_shape) > 1 and a_shape[0] == b_shape[0] and a_strides[0] == b_strides[0]:
        stride = a_strides[0]
        rest_a, rest_b = _span(a_shape[1:], a_strides[1:]), _span(b_shape[1:], b_strides[1:])
        if stride > 0 and rest_a <= stride and rest_b <= stride:
            shift = delta % stride
            if rest_a <= shift and shift + rest_b <= stride:
                return False
    low = min(0, delta)
    count = max(_span(a_shape, a_strides), delta + _span(b_shape, b_strides)) - low
    if count > _MAX_EXACT_OVERLAP:  # a mask this large for a layout no engine uses: call it shared
        return True
    used = torch.zeros(count, dtype=torch.bool)
    used[_offsets(a_shape, a_strides, -low)] = True
    return bool(used[_offsets(b_shape, b_strides, delta - low)].any())


def _offsets(shape: Sequence[int], strides: Sequence[int], start: int) -> torch.Tensor:
    offsets = torch.tensor([start], dtype=torch.int64)
    for size, stride in zip(shape, strides):
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return offsets


def readable_rows(t: torch.Tensor, shape: torch.Size, strides: tuple[int, ...]):
    """Inputs only read may have any layout: copy when the last dim is strided.
    Returns the tensor to read and its strides."""
    if strides[-1] == 1 or shape[-1] <= 1:
        return t, strides
    t = t.contiguous()
    return t, t.stride()


def checked_out(out: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> tuple[int, ...]:
    """Check a caller's ``out`` (dtype, device, shape, layout); returns its strides."""
    same_dtype(out, "out", like)
    if out.shape != shape:
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    strides = out.stride()
    writable_rows(shape, strides, "out")
    return strides


def row_geometry(shape: torch.Size, strides: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(n0, n1, stride0, stride1) of the rows of a tensor of rank <= 3.

    Row (i0, i1) starts at element i0*stride0 + i1*stride1: enough for 2-D
    and 3-D tensors with any row strides, without making views per call.
    """
    nd = len(shape)
    if nd == 2:
        return shape[0], 1, strides[0], 0
    if nd == 3:
        return shape[0], shape[1], strides[0], strides[1]
    return 1, 1, 0, 0  # rank 1: one row


def rows_view(t: torch.Tensor, name: str, writable: bool) -> torch.Tensor:
    """``t`` as a tensor of rank <= 3 over the same memory (ops with ``[..., D]`` inputs)."""
    if t.dim() <= 3:
        return t
    shape = (math.prod(t.shape[:-2]), *t.shape[-2:])  # not -1: ambiguous when the last two hold 0 elements
    try:
        return t.view(shape)
    except RuntimeError:
        if writable:
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} and strides {tuple(t.stride())}: its leading dimensions "
                "cannot be merged into one without a copy"
            ) from None
        return t.reshape(shape)


_threads_override: int | None = None


_INT32 = torch.int32
_INDEX_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


MAX_HEAD_DIM = 512


def check_head_dim(name: str, value, maximum: int = MAX_HEAD_DIM) -> int:
    """Head dims are compile-time constants of the attention, RoPE and append variants: any int in
    [1, maximum] (kernels take the last partial vector with masked loads)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{name} must be an int in [1, {maximum}], got {value!r}")
    return value


def index_vector(
    t, name: str, length: int | None = None, length_from: str | None = None, prefix: bool = False
) -> torch.Tensor:
    """``t`` as a contiguous 1-D int32 CPU tensor (of ``length`` entries if given; ``length_from``
    says where that length comes from).

    With ``prefix``, ``t`` may be longer and its first ``length`` entries are taken: FlashInfer's
    planners read only a batch's entries of an indptr, so callers pass buffers preallocated for a
    larger batch. The entries after those are neither read nor checked (they may be garbage)."""
    if prefix:
        t = _leading(t, length)
    try:  # warm path: attribute reads
        if (
            t.dtype is _INT32
            and t.is_cpu
            and t.dim() == 1
            and (length is None or t.numel() == length)
            and t.is_contiguous()
        ):
            return t
    except AttributeError:
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}") from None
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected an integer tensor (int32)")
    if not t.is_cpu:
        raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")
    if t.dim() != 1 or (length is not None and t.numel() != length):
        expected = "1-D" if length is None else f"1-D with {'at least ' if prefix else ''}{length} entries"
        source = f" ({length_from})" if length_from else ""
        raise ValueError(f"{name} must be {expected}{source}, got shape {tuple(t.shape)}")
    if t.numel() and t.dtype is torch.int64 and not -(2**31) <= int(t.min()) <= int(t.max()) < 2**31:
        raise ValueError(f"{name} holds values beyond int32")  # FlashInfer's .int() would wrap them
    return t.to(_INT32).contiguous()  # as FlashInfer's .int()


def _leading(t, length: int):
    """The first ``length`` entries of a 1-D tensor longer than that; anything else as it is, for
    index_vector to accept or explain."""
    if isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() > length:
        return t[:length]
    return t


def _read_thread_env() -> int | None:
    value = os.environ.get("KERNFORGE_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"KERNFORGE_NUM_THREADS must be a positive integer, not {value!r}")
    return int(value)


_threads_override = _read_thread_env()


def set_num_threads(n: int | None) -> None:
    """Threads per kernel call; None follows ``torch.get_num_threads()``."""
    global _threads_override
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"num_threads must be a positive integer or None, not {n!r}")
    _threads_override = n


def num_threads(_torch_threads=torch.get_num_threads) -> int:
    return _threads_override or _torch_threads()


def no_op() -> None:
    """A bound call with nothing to compute (an op's ``bound_*`` form over empty rows)."""


class BoundCall:
    """A kernel call with its arguments fixed (an op's ``bound_*`` form: checked once, run many
    times, as a prepared decode step runs its layers), or all but a layer's index. It holds the
    tensors whose addresses the arguments carry, so they live as long as the call can run."""

    __slots__ = ("_call", "_tensors")

    def __init__(self, call: Callable[..., object], *tensors: object):
        self._call, self._tensors = call, tensors

    def __call__(self, *layer: int) -> None:
        self._call(*layer)
