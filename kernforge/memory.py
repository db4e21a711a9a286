"""KV caches in huge pages: fewer TLB misses for attention's scattered page reads.

Decode reads a paged KV cache in pages of a few KiB scattered over gigabytes, so with the OS's
4 KiB pages nearly every KV page costs TLB misses and page walks (two-dimensional in a VM), taken
at the prefetches that first touch it; where the arithmetic is the bound (fp8 KV) they do not hide
behind the reads. On a Zen 4 VM, decode over a cache in 2 MiB transparent huge pages took
0.83-1.00x the time of the same cache in 4 KiB pages written in decode order
(benchmarks/investigations/bench_kv_pages.py), fp8 KV 0.72x on a cache written in slices (bench_decode.py;
docs/notes/2026-11-27-issue-22-pass-6-huge-pages.md).

Linux backs memory with transparent huge pages where the process asks (``madvise``) or always,
as ``/sys/kernel/mm/transparent_hugepage/enabled`` says; elsewhere these functions change nothing.
torch's own switch, ``THP_MEM_ALLOC_ENABLE=1`` in the environment before torch starts, does the
same for every allocation of 2 MiB or more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
_MADV_DONTNEED = 4  # drop the range's pages: private anonymous memory reads zeros at the next touch
_MADV_HUGEPAGE = 14  # back this range with huge pages from now on (at first touch, or by khugepaged)
_MADV_COLLAPSE = 25  # Linux 6.1+: move the range's populated pages into huge pages now


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


_madvise_fn = _madvise()


def _advise(start: int, length: int, advice: int) -> bool:
    return _madvise_fn is not None and length > 0 and _madvise_fn(start, length, advice) == 0


def _check_size(size: tuple[Any, ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in size):
        raise TypeError(f"size must be ints, got {size!r}")
    if any(s < 0 for s in size):
        raise ValueError(f"size must be non-negative, got {size!r}")
    return tuple(size)


def empty_kv_cache(*size: Any, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``torch.empty(*size, dtype=dtype)`` for a KV cache, its memory in 2 MiB huge pages where Linux
    allows: the tensor starts on a 2 MiB boundary of a fresh allocation that is advised
    (``MADV_HUGEPAGE``) before anything touches it, so its pages fault in as huge pages. Any shape
    (FlashInfer's ``[num_pages, 2, page_size, num_kv_heads, head_dim]``, one per layer or all layers
    at once); below 2 MiB, plain ``torch.empty``. Contiguous; like ``torch.empty``, uninitialized."""
    size = _check_size(size)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    nbytes = math.prod(size) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or _madvise_fn is None:
        return torch.empty(size, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole huge pages, all inside the allocation
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    _advise(raw.data_ptr() + offset, span, _MADV_HUGEPAGE)
    return raw[offset : offset + nbytes].view(dtype).view(size)


def advise_huge_pages(tensor: torch.Tensor, collapse: bool = True) -> int:
    """Asks Linux to back ``tensor``'s memory with 2 MiB huge pages, for a KV cache allocated
    elsewhere (an engine's): ``MADV_HUGEPAGE`` over the whole 2 MiB pages inside the tensor's
    storage, then, with ``collapse``, ``MADV_COLLAPSE`` (Linux 6.1+), which moves pages already
    written into huge pages at once (about 1 s per 500 MiB on the Zen 4 VM; without it, only pages
    first touched later, or the kernel's background scan, become huge). Returns the bytes advised:
    0 where nothing was (a storage smaller than a huge page, or not Linux)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor must be on the CPU, got {tensor.device}")
    storage = tensor.untyped_storage()
    begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    length = max(0, (end - start) // HUGE_PAGE * HUGE_PAGE)
    if not _advise(start, length, _MADV_HUGEPAGE):
        return 0
    if collapse:
        _advise(start, length, _MADV_COLLAPSE)  # best effort: EINVAL before Linux 6.1, EAGAIN under memory pressure
    return length


def zero_in_huge_pages(tensor: torch.Tensor) -> int:
    """``tensor.zero_()``, its memory in 2 MiB huge pages from the next touch on: the whole huge pages
    inside the tensor's bytes are advised (``MADV_HUGEPAGE``) and handed back to Linux
    (``MADV_DONTNEED``), so they read as zeros and come back as huge pages where they are first
    touched; the bytes before and after them are zeroed in place. For a cache an engine allocated
    and has not written yet: where :func:`advise_huge_pages` would copy every page of zeros into
    huge pages (about 5 s per 4 GiB on the Zen 4 VM), this takes no time. Contiguous tensors only
    (other views of the same storage keep their bytes). Returns the bytes handed back."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor must be on the CPU, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (its bytes, not its storage's, are zeroed)")
    data = tensor.reshape(-1).view(torch.uint8)
    begin = data.data_ptr()
    head = min(-begin % HUGE_PAGE, data.numel())
    length = (data.numel() - head) // HUGE_PAGE * HUGE_PAGE
    released = _advise(begin + head, length, _MADV_HUGEPAGE) and _advise(begin + head, length, _MADV_DONTNEED)
    if not released:
        head, length = data.numel(), 0
    data[:head].zero_()
    data[head + length :].zero_()
    return length


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere). A model
    loaded or quantized a layer at a time frees each layer's temporaries between long-lived packed
    weights, where glibc keeps them resident: trimmed per layer, peak memory is the packed model plus one
    layer's temporaries (untrimmed, 0.035 GB more per layer of Qwen3-30B-A3B's shape at four bits)."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function
