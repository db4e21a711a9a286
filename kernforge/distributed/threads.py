"""Thread and memory placement per rank: what sgl-kernel's ``init_cpu_threads_env`` does.

Ranks of one host that share its cores must not share them by accident: each rank's threads run on
its own CPUs (every thread of the process is confined to the set, and kernforge's OpenMP pool is
pinned one thread per CPU), torch and kernforge use as many threads as it has CPUs, and where the
machine has several NUMA nodes the rank's memory is bound to the nodes of its CPUs.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Any

import torch

from kernforge.ops import _openmp

_BINDING: dict[str, Any] | None = None  # what bind_threads last did, for kernforge.info
_PINNED_THREAD: int | None = None  # the thread whose OpenMP pool bind_threads pinned

_SYS_SET_MEMPOLICY = 238  # x86-64
_MPOL_BIND = 2


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (the kernel's and sgl-kernel's CPU list format)."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            cpus.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"cpu_ids must be a CPU list such as '0-3,8', got {text!r}") from None
    if not cpus:
        raise ValueError(f"cpu_ids must name at least one CPU, got {text!r}")
    return cpus


def rank_cpus(local_rank: int, local_world_size: int) -> list[int]:
    """This rank's share of the CPUs the process may use: the allowed CPUs in ``local_world_size``
    contiguous blocks (sizes differing by at most one), block ``local_rank``."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank must be in [0, {local_world_size}), got {local_rank}")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < local_world_size:  # more ranks than CPUs: ranks share, round robin
        return [allowed[local_rank % len(allowed)]]
    base, extra = divmod(len(allowed), local_world_size)
    begin = local_rank * base + min(local_rank, extra)
    return allowed[begin : begin + base + (local_rank < extra)]


def bind_threads(cpus: list[int] | str | None = None) -> str:
    """Runs this process's threads on ``cpus`` (a list or ``"0-3,8"``; default: this rank's share of
    the allowed CPUs, by ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` as torchrun sets them), one torch and
    kernforge thread per CPU, memory on their NUMA nodes. Returns what it did, as a line."""
    global _BINDING, _PINNED_THREAD
    if cpus is None:
        cpus = rank_cpus(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    elif isinstance(cpus, str):
        cpus = parse_cpu_list(cpus)
    cpus = list(dict.fromkeys(int(c) for c in cpus))
    unknown = sorted(set(cpus) - set(range(os.cpu_count() or 1)))
    if unknown:
        raise ValueError(f"cpus {unknown} are not CPUs of this machine (it has {os.cpu_count()})")
    for thread in os.listdir("/proc/self/task"):  # torch's pool too: threads keep their own masks
        try:
            os.sched_setaffinity(int(thread), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended
    torch.set_num_threads(len(cpus))
    pinned = _pin_kernforge_pool(cpus)
    _PINNED_THREAD = threading.get_ident()
    nodes = _bind_memory(cpus)
    _BINDING = {"cpus": cpus, "threads": len(cpus), "pinned": pinned, "numa_nodes": nodes}
    return describe(_BINDING)


def init_cpu_threads_env(cpu_ids: str) -> str:
    """sgl-kernel's spelling: bind to ``cpu_ids`` (``"0-3,8"``), return the binding as text."""
    return bind_threads(cpu_ids)


def binding() -> dict[str, Any] | None:
    """What :func:`bind_threads` did in this process, or None."""
    return _BINDING


def describe(b: dict[str, Any] | None) -> str:
    if b is None:
        return (
            f"not bound ({torch.get_num_threads()} torch threads on CPUs {_compact(sorted(os.sched_getaffinity(0)))})"
        )
    memory = f", memory on NUMA nodes {_compact(b['numa_nodes'])}" if b["numa_nodes"] else ""
    threads = f"{b['threads']} thread{'s' if b['threads'] != 1 else ''}"
    return f"{threads} on CPUs {_compact(b['cpus'])} ({b['pinned']} kernforge pinned){memory}"


def _pin_kernforge_pool(cpus: list[int]) -> int:
    from kernforge.distributed._kernels import COMM

    array = torch.tensor(cpus, dtype=torch.int32)
    pinned = COMM.variant(dtype="fp32").kernel().pin_threads(array.data_ptr(), len(cpus))
    if pinned < 0:
        raise OSError(-pinned, f"cannot pin kernforge's threads to CPUs {_compact(cpus)}: {os.strerror(-pinned)}")
    return pinned


def _pin_again_after_fork() -> None:
    """os.fork() released the forking thread's OpenMP pool (kernforge.ops._openmp); the workers of the
    next one would inherit that thread's own one-CPU mask, so pin a new pool one thread per CPU again."""
    if _BINDING is not None and _BINDING["pinned"] and _PINNED_THREAD == threading.get_ident():
        _pin_kernforge_pool(_BINDING["cpus"])


_openmp.on_pool_released(_pin_again_after_fork)


def _numa_nodes() -> dict[int, set[int]]:
    nodes = {}
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        with open(path) as f:
            text = f.read().strip()
        nodes[int(path.split("/node")[-1].split("/")[0])] = set(parse_cpu_list(text)) if text else set()
    return nodes


def _bind_memory(cpus: list[int]) -> list[int]:
    """Binds the calling thread's (and its future threads') allocations to the NUMA nodes of
    ``cpus`` where the machine has several; returns those nodes ([] with one node)."""
    nodes = _numa_nodes()
    if len(nodes) <= 1:
        return []
    mine = sorted(n for n, node_cpus in nodes.items() if node_cpus & set(cpus))
    mask = ctypes.c_ulong(sum(1 << n for n in mine))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_SET_MEMPOLICY, _MPOL_BIND, ctypes.byref(mask), ctypes.sizeof(mask) * 8 + 1) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot bind memory to NUMA nodes {mine}: {os.strerror(error)}")
    return mine


def _compact(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)
