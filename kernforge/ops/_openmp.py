"""The kernels' OpenMP thread pools across ``os.fork()``.

The kernels run their parallel regions on GNU OpenMP (libgomp), the copy torch loaded, so torch's
ops and kernforge's share it: each thread that starts parallel regions keeps a pool of worker
threads. ``fork()`` copies only the calling thread. A child forked after that thread ran a parallel
region inherits its pool's bookkeeping without the workers, and its first parallel region (a torch
op's or a kernel's) waits for them forever: libgomp, unlike LLVM's and Intel's OpenMP runtimes, has
no fork handler.

So before ``os.fork()`` (multiprocessing's 'fork' start method, or a direct call) kernforge releases
the forking thread's pool with OpenMP 5.0's ``omp_pause_resource_all``, which joins its workers: the
child starts a pool of its own at its first parallel region, as the parent does at its next one
(a few thread starts per fork). Other threads' pools are left alone: the child has none of those
threads. ``subprocess`` does not run these hooks, nor needs them (its child execs at once).

Where a libgomp cannot release its pool (one without ``omp_pause_resource_all``, before GCC 9), a
forked child runs kernforge's kernels on one thread (``set_num_threads(1)``, which never starts a
parallel region) and warns: torch's parallel ops may still hang there unless it runs
``torch.set_num_threads(1)`` too, as torch's DataLoader workers do; the 'spawn' and 'forkserver'
start methods have no such limits.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Callable

from kernforge.ops import _common

_OMP_PAUSE_SOFT = 1  # omp_pause_soft; libgomp releases the calling thread's pool for either kind
_pause_functions: dict[str, Callable[[int], int] | None] = {}  # per mapped libgomp file
_released_before_fork = True  # in a child: whether the fork released the forking thread's pools
_after_release: list[Callable[[], None]] = []


def _mapped_libgomp_files() -> list[str]:
    """The libgomp files this process has mapped (torch's own copy, renamed or not, and any other)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].rstrip("\n") for line in maps if "libgomp" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libgomp") and not p.endswith(" (deleted)"))


def _pause_function(path: str) -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the already loaded ``path`` (RTLD_NOLOAD: never a second copy),
    or None where it has none."""
    if path not in _pause_functions:
        try:
            function = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all
        except (OSError, AttributeError):
            _pause_functions[path] = None
        else:
            function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            _pause_functions[path] = function
    return _pause_functions[path]


def release_thread_pools() -> bool:
    """Release the calling thread's OpenMP pool in every loaded libgomp (the next parallel region
    starts a new one); True if each did so, False if one cannot (then a child forked now would hang
    in its first parallel region)."""
    released = True
    for path in _mapped_libgomp_files():
        pause = _pause_function(path)
        released = pause is not None and pause(_OMP_PAUSE_SOFT) == 0 and released
    return released


def on_pool_released(callback: Callable[[], None]) -> None:
    """Call ``callback`` in the parent after each fork, on the forking thread, whose pool the fork
    released (kernforge.distributed pins the new pool's threads again)."""
    _after_release.append(callback)


def _before_fork() -> None:
    global _released_before_fork
    try:
        _released_before_fork = release_thread_pools()
    except Exception:  # a hook must not stop the fork; the child then takes the safe path
        _released_before_fork = False


def _after_fork_in_parent() -> None:
    if _released_before_fork:
        for callback in _after_release:
            callback()


def _after_fork_in_child() -> None:
    if _released_before_fork:
        return
    _common.set_num_threads(1)
    warnings.warn(
        "kernforge: this process was forked, and its OpenMP runtime (libgomp) could not release its thread pool "
        "before the fork: kernforge's kernels run on one thread here, and torch's parallel ops may hang unless "
        "torch.set_num_threads(1) is called first. Use multiprocessing's 'spawn' or 'forkserver' start method "
        "for children that run kernels.",
        RuntimeWarning,
        stacklevel=2,
    )


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
