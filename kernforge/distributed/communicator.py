"""A communicator for the ranks of one host, made from a ``torch.distributed`` process group.

The group (gloo) does the rendezvous, carries the setup's handshake and remains the path between
hosts; the collectives run through one shared-memory segment per group (``comm/shm.h``), written
and read by JIT-compiled kernels. The segment's file is removed from /dev/shm as soon as every rank
has mapped it, so nothing is left there after an exit or a crash: the memory lives while a rank maps
it.

Semantics follow ``torch.distributed`` on the same group: ``all_reduce`` sums in place (bf16/fp16
summed in fp32 and rounded once; every rank gets the same bits), ``reduce_scatter_tensor`` gives rank
r the part r (along dim 0) of that same sum, ``all_gather_into_tensor`` fills a ``[world * n, ...]``
output, ``all_gather(t, dim)`` concatenates along ``dim`` as sgl-kernel's ``shm_allgather`` does.
Dtypes the kernels do not reduce, and groups whose ranks are not all on this host, go through the
group itself (the latter said once).

A peer that exits, or stays away longer than ``timeout`` seconds, ends the call with
``torch.distributed.DistBackendError`` (and the communicator is unusable after it); ranks that pass
different shapes or dtypes get a ``ValueError`` naming both.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import secrets
import socket
import warnings
import weakref

import torch
import torch.distributed as dist

from kernforge.distributed._kernels import COMM, KIND, REDUCED_DTYPES, REPORT_INTS, STATUS
from kernforge.ops._common import num_threads
from kernforge.ops._registry import DTYPE_NAMES

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kernforge-comm-"
DEFAULT_SLOT_BYTES = 1 << 20  # per rank and set: larger collectives run in chunks of it (a core's L2)
DEFAULT_TIMEOUT_S = 300.0

_NEXT_HANDLE = itertools.count(1)
_LIVE: dict[int, weakref.ref] = {}  # handle -> communicator, for the torch.ops custom ops
_WARNED_FALLBACK = False


class Communicator:
    """Shared-memory collectives for ``group`` (default: the world group).

    ``slot_bytes``: the segment's chunk per rank (the segment holds ``2 * world`` of them);
    ``timeout``: seconds a rank waits for a peer before the call fails. Every rank of the group must
    construct it (collectively, as ``new_group``), and call the collectives in the same order.
    """

    def __init__(self, group=None, *, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout: float = DEFAULT_TIMEOUT_S):
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        if not isinstance(slot_bytes, int) or slot_bytes < 4096 or slot_bytes % 4096:
            raise ValueError(f"slot_bytes must be a positive multiple of 4096, got {slot_bytes!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        group = group if group is not None else dist.group.WORLD
        # Held weakly: a group kept alive past destroy_process_group() is torn down at interpreter
        # exit, where gloo's worker threads abort the process (they cannot take the GIL to free a
        # finished collective's tensors).
        self._group = weakref.ref(group)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.slot_bytes, self.timeout = slot_bytes, float(timeout)
        self.handle = next(_NEXT_HANDLE)
        _LIVE[self.handle] = weakref.ref(self)
        self._segment: _Segment | None = None
        self._shared_cores = False  # more ranks than the CPUs they may run on (set by _connect)
        self._broken: str | None = None
        self._report = torch.zeros(REPORT_INTS, dtype=torch.int64)
        self._reductions: dict[tuple[str, torch.dtype], object] = {}  # (entry, dtype) -> bound kernel
        self._gather = None
        if self.world_size > 1:
            self._segment = _connect(self)

    @property
    def group(self):
        """The process group (raises once ``torch.distributed.destroy_process_group`` dropped it)."""
        group = self._group()
        if group is None:
            raise dist.DistBackendError("kernforge.distributed: this communicator's process group was destroyed")
        return group

    @property
    def uses_shared_memory(self) -> bool:
        """Whether collectives go through the segment (False: through the group itself)."""
        return self._segment is not None

    # ---- collectives

    def all_reduce(self, tensor: torch.Tensor, op="sum") -> None:
        """In place: ``tensor`` = the sum of every rank's ``tensor`` (``torch.distributed.all_reduce``)."""
        _check_sum(op)
        _check_tensor(tensor, "tensor")
        if torch.compiler.is_compiling():
            torch.ops.kernforge.all_reduce(tensor, self.handle)
            return
        self._all_reduce(tensor)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op="sum") -> None:
        """``torch.distributed.reduce_scatter_tensor``: ``input`` ``[world * n, ...]`` is split along
        dim 0 in world parts, and ``output`` ``[n, ...]`` gets the sum over ranks of part ``rank``,
        with ``all_reduce``'s bits (fp32 sums in rank order, rounded once)."""
        _check_sum(op)
        _check_tensor(output, "output")
        _check_tensor(input, "input", contiguous=False)
        _check_scattered(output, input, self.world_size)
        if torch.compiler.is_compiling():
            torch.ops.kernforge.reduce_scatter_tensor(output, input, self.handle)
            return
        self._reduce_scatter(output, input.contiguous())

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim``, in rank order (sgl-kernel's
        ``shm_allgather``); ``out``, if given, receives it."""
        _check_tensor(tensor, "tensor", contiguous=False)
        dim = _checked_dim(dim, tensor.dim())
        shape = _gathered_shape(tensor.shape, dim, self.world_size)
        if out is None:
            if torch.compiler.is_compiling():
                return torch.ops.kernforge.all_gather(tensor, dim, self.handle)
            out = tensor.new_empty(shape)
        elif out.shape != shape or out.dtype != tensor.dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {tensor.dtype} tensor of shape {tuple(shape)}, "
                f"got {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (non-contiguous)'}"
            )
        self._all_gather(tensor.contiguous(), dim, out)
        return out

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        """``torch.distributed.all_gather_into_tensor``: ``output_tensor`` ``[world * n, ...]`` gets
        every rank's ``input_tensor`` ``[n, ...]`` in rank order."""
        _check_tensor(input_tensor, "input_tensor", contiguous=False)
        if input_tensor.dim() == 0:
            raise ValueError("input_tensor must have at least one dimension")
        self.all_gather(input_tensor, 0, out=output_tensor)

    # ---- the paths

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        self._check_usable()
        if self.world_size == 1 or tensor.numel() == 0:
            return
        key = ("all_reduce", tensor.dtype)
        reduce = self._reductions.get(key) or self._bind_reduction(*key)
        if reduce is None:
            dist.all_reduce(tensor, group=self.group)
            return
        self._finish(reduce(tensor.data_ptr(), tensor.numel(), num_threads()), "all_reduce", tensor)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._check_usable()
        if self.world_size == 1:
            output.copy_(input.view_as(output))
            return
        if output.numel() == 0:
            return
        key = ("reduce_scatter", input.dtype)
        scatter = self._reductions.get(key) or self._bind_reduction(*key)
        if scatter is None:
            dist.reduce_scatter_tensor(output, input, group=self.group)
            return
        status = scatter(input.data_ptr(), output.data_ptr(), output.numel(), num_threads())
        self._finish(status, "reduce_scatter_tensor", input)

    def _all_gather(self, tensor: torch.Tensor, dim: int, out: torch.Tensor) -> None:
        self._check_usable()
        if self.world_size == 1:
            out.copy_(tensor.reshape(out.shape))
            return
        if self._segment is None:
            _gather_through_group(self.group, tensor, dim, out)
            return
        gather = self._gather or self._bind_gather()
        rows = tensor.shape[:dim].numel()
        row_bytes = tensor.shape[dim:].numel() * tensor.element_size()
        if rows * row_bytes == 0:
            return
        status = gather(tensor.data_ptr(), rows, row_bytes, out.data_ptr(), num_threads())
        self._finish(status, "all_gather", tensor)

    def _bind_reduction(self, entry: str, dtype: torch.dtype):
        """The kernel's ``entry`` (all_reduce, reduce_scatter) for ``dtype``, bound once."""
        if self._segment is None or dtype not in DTYPE_NAMES:
            return None  # through the group: on another host, or a dtype the kernels do not sum
        kernel = COMM.variant(dtype=DTYPE_NAMES[dtype]).kernel()
        self._reductions[entry, dtype] = kernel.bind(entry, **self._call_args())
        return self._reductions[entry, dtype]

    def _bind_gather(self):
        self._gather = COMM.variant(dtype="fp32").kernel().bind("all_gather", **self._call_args())
        return self._gather

    def _call_args(self) -> dict:
        return {
            "base": self._segment.address,
            "world": self.world_size,
            "rank": self.rank,
            "timeout_s": self.timeout,
            "shared_cores": int(self._shared_cores),
            "report": self._report.data_ptr(),
        }

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise dist.DistBackendError(f"kernforge.distributed: this communicator is unusable ({self._broken})")

    def _finish(self, status: int, what: str, tensor: torch.Tensor) -> None:
        if status == STATUS.kOk:
            return
        peer, kind, nbytes, row_bytes = self._report.tolist()
        if status == STATUS.kMismatch:
            raise ValueError(
                f"kernforge.distributed.{what}: the ranks' tensors differ: rank {self.rank} passed a "
                f"{str(tensor.dtype).removeprefix('torch.')} tensor of shape {tuple(tensor.shape)}, rank {peer} "
                f"{_describe_descriptor(kind, nbytes, row_bytes)}"
            )
        reason = (
            f"rank {peer} exited"
            if status == STATUS.kPeerExited
            else f"rank {peer} did not join within the timeout of {self.timeout:g} s"
        )
        self._broken = f"{what} on rank {self.rank}: {reason}"
        raise dist.DistBackendError(f"kernforge.distributed: {self._broken}")

    # ---- lifetime

    def close(self) -> None:
        """Unmaps the segment (also done when the communicator is collected)."""
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._reductions.clear()
        self._gather = None
        self._broken = self._broken or "it was closed"

    def __repr__(self) -> str:
        path = "shared memory" if self._segment is not None else "the process group"
        return f"Communicator(rank {self.rank} of {self.world_size}, through {path})"


def by_handle(handle: int) -> Communicator:
    """The live communicator with this handle (the custom ops' argument)."""
    found = _LIVE.get(handle)
    found = found() if found is not None else None
    if found is None:
        raise ValueError(f"no live kernforge communicator has handle {handle}")
    return found


# --------------------------------------------------------------------------- setup


class _Segment:
    """A file in /dev/shm, mapped; ``address`` is where this process sees it."""

    def __init__(self, path: str, size: int, create: bool):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not with SIGBUS later
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, not {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(self._anchor)

    def close(self) -> None:
        if not self._map.closed:
            del self._anchor  # the buffer export that mmap.close() would refuse
            self._map.close()


def _connect(comm: Communicator) -> _Segment | None:
    """Maps the group's segment on every rank, or returns None (on every rank) where the ranks are
    not all on this host or cannot share it; collective over the group."""
    peers = _all_gather_object(comm.group, (_host_key(), os.getpid(), os.sched_getaffinity(0)))
    hosts = {host for host, _, _ in peers}
    if len(hosts) != 1:
        _warn_fallback(f"the ranks of the group are on {len(hosts)} hosts")
        return None
    comm._shared_cores = len(set().union(*(cpus for _, _, cpus in peers))) < comm.world_size
    kernel = COMM.variant(dtype="fp32").kernel()
    size = kernel.segment_bytes(comm.world_size, comm.slot_bytes)
    path, segment, error = _create_or_open(comm, size)
    sees_peers = all(os.path.exists(f"/proc/{pid}/stat") for _, pid, _ in peers)
    outcomes = _all_gather_object(comm.group, (error, sees_peers))
    if path is not None:  # rank 0: every rank has it mapped (or failed): nothing stays in /dev/shm
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    failures = [f"rank {r}: {e}" for r, (e, _) in enumerate(outcomes) if e is not None]
    if failures:
        if segment is not None:
            segment.close()
        _warn_fallback(f"the shared-memory segment could not be set up ({'; '.join(failures)})")
        return None
    pid = os.getpid() if all(sees for _, sees in outcomes) else 0  # other pid namespaces: no liveness checks
    status = kernel.attach(segment.address, comm.world_size, comm.rank, comm.slot_bytes, pid, 0)
    if status != STATUS.kOk:  # the header was checked when rank 0 wrote it: a broken invariant
        raise RuntimeError(f"kernforge.distributed: rank {comm.rank} could not attach to the segment")
    weakref.finalize(comm, segment.close)
    return segment


def _create_or_open(comm: Communicator, size: int):
    """Rank 0 creates the segment and writes its header; the others open it: (the path rank 0 created,
    else None; the segment; an error)."""
    kernel = COMM.variant(dtype="fp32").kernel()
    path, segment, error = None, None, None
    if comm.rank == 0:
        path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            segment = _Segment(path, size, create=True)
            if kernel.attach(segment.address, comm.world_size, 0, comm.slot_bytes, 0, 1) != STATUS.kOk:
                error = f"the shared-memory path takes at most 256 ranks, not {comm.world_size}"
        except OSError as exc:
            error = f"cannot create {path}: {exc}"
    names = [None if error else path]
    dist.broadcast_object_list(names, src=dist.get_global_rank(comm.group, 0), group=comm.group)
    if comm.rank != 0:
        if names[0] is None:
            error = "rank 0 could not create the segment"
        else:
            try:
                segment = _Segment(names[0], size, create=False)
            except (OSError, ValueError) as exc:
                error = f"cannot open {names[0]}: {exc}"
    return path, segment, error


def _all_gather_object(group, value) -> list:
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _host_key() -> str:
    """This host as the ranks compare it: the name and the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _warn_fallback(reason: str) -> None:
    global _WARNED_FALLBACK
    if not _WARNED_FALLBACK:
        _WARNED_FALLBACK = True
        warnings.warn(
            f"kernforge.distributed: {reason}; collectives go through the torch.distributed group itself",
            RuntimeWarning,
            stacklevel=4,
        )


# --------------------------------------------------------------------------- checks and shapes


def _check_sum(op) -> None:
    if not (op == "sum" or (not isinstance(op, str) and op == dist.ReduceOp.SUM)):
        raise ValueError(f"Only torch.distributed.ReduceOp.SUM is supported, got op={op!r}")


def _check_tensor(tensor, name: str, contiguous: bool = True) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {tensor.device}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is written in place)")


def _checked_dim(dim: int, ndim: int) -> int:
    if not isinstance(dim, int) or not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"dim must be an int in [{-ndim}, {ndim}), got {dim!r}")
    return dim % ndim if ndim else 0


def _check_scattered(output: torch.Tensor, input: torch.Tensor, world: int) -> None:
    """reduce_scatter_tensor's rule, as gloo's: ``input`` is ``output`` with ``world`` times its rows."""
    if output.dtype != input.dtype:
        raise TypeError(f"output must have input's dtype ({input.dtype}), got {output.dtype}")
    if output.dim() == 0:
        raise ValueError("output must have at least one dimension (input is split along dim 0)")
    expected = _gathered_shape(output.shape, 0, world)
    if input.shape != expected:
        raise ValueError(
            f"input must have shape {tuple(expected)} (world_size {world} times output's "
            f"{tuple(output.shape)} along dim 0), got {tuple(input.shape)}"
        )


def _gathered_shape(shape: torch.Size, dim: int, world: int) -> torch.Size:
    if len(shape) == 0:
        raise ValueError("tensor must have at least one dimension to be gathered")
    return torch.Size((*shape[:dim], shape[dim] * world, *shape[dim + 1 :]))


def _gather_through_group(group, tensor: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    world = dist.get_world_size(group)
    stacked = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_into_tensor(stacked, tensor, group=group)
    out.copy_(stacked.reshape(world, *tensor.shape).movedim(0, dim).reshape(out.shape))


_REDUCTIONS = {KIND.kAllReduce: "all_reduce", KIND.kReduceScatter: "reduce_scatter_tensor"}


def _describe_descriptor(kind: int, nbytes: int, row_bytes: int) -> str:
    if kind // 16 == KIND.kAllGather:
        return f"passed {nbytes} bytes in rows of {row_bytes} bytes to all_gather"
    if kind // 16 in _REDUCTIONS:
        return f"passed {nbytes} bytes of {REDUCED_DTYPES[kind % 16 - 1]} to {_REDUCTIONS[kind // 16]}"
    return "called another collective"
