"""Collectives for tensor parallelism across the processes of one host (and through the process
group beyond it), on ``torch.distributed``.

Make a :class:`Communicator` from a process group on every rank, or call the functions here, which
keep one per group::

    dist.init_process_group("gloo")
    kernforge.distributed.bind_threads()           # this rank's share of the cores
    kernforge.distributed.all_reduce(hidden)        # in place, as torch.distributed.all_reduce
    logits = kernforge.distributed.all_gather(part, dim=-1)
    kernforge.distributed.reduce_scatter_tensor(out, hidden)  # out = this rank's rows of the sum

sgl-kernel's CPU names work too: ``initialize(size, rank)``, ``shm_allreduce(data, op)``,
``shm_allgather(data, dim)``, ``shm_allgather_into_tensor(output_tensor, data)``,
``shm_reduce_scatter_tensor(output_tensor, data, op)``, ``init_cpu_threads_env(cpu_ids)``. Each
collective is also the custom op ``torch.ops.kernforge.<name>`` (``all_reduce(Tensor(a!) tensor,
int communicator)``, ``all_gather(Tensor tensor, int dim, int communicator)``,
``reduce_scatter_tensor(Tensor(a!) output, Tensor input, int communicator)``, and the ``shm_*``
names with sgl-kernel's schemas), so a compiled model keeps one graph.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from kernforge.distributed.communicator import Communicator, _gathered_shape, by_handle
from kernforge.distributed.threads import bind_threads, binding, init_cpu_threads_env, rank_cpus

__all__ = [
    "Communicator",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "bind_threads",
    "binding",
    "communicator_for",
    "init_cpu_threads_env",
    "initialize",
    "rank_cpus",
    "reduce_scatter_tensor",
    "shm_allgather",
    "shm_allgather_into_tensor",
    "shm_allreduce",
    "shm_reduce_scatter_tensor",
]

_BY_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> its communicator


def communicator_for(group=None) -> Communicator:
    """The communicator of ``group`` (default: the world group), made on first use: collective, so
    every rank of the group must reach its first collective together (as with any collective)."""
    group = group if group is not None else dist.group.WORLD
    found = _BY_GROUP.get(group)
    if found is None:
        found = _BY_GROUP[group] = Communicator(group)
    return found


def all_reduce(tensor: torch.Tensor, op="sum", group=None) -> None:
    """In place, as ``torch.distributed.all_reduce(tensor, op, group)`` (sum only)."""
    communicator_for(group).all_reduce(tensor, op)


def all_gather(tensor: torch.Tensor, dim: int = 0, group=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order."""
    return communicator_for(group).all_gather(tensor, dim, out=out)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None) -> None:
    """As ``torch.distributed.all_gather_into_tensor``."""
    communicator_for(group).all_gather_into_tensor(output_tensor, input_tensor)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op="sum", group=None) -> None:
    """As ``torch.distributed.reduce_scatter_tensor(output, input, op, group)`` (sum only)."""
    communicator_for(group).reduce_scatter_tensor(output, input, op)


# ---- sgl-kernel's CPU names (sgl-kernel/csrc/cpu/shm.cpp)


def initialize(size: int, rank: int) -> None:
    """sgl-kernel's ``initialize(size, rank)``: sets up the world group's communicator."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if (size, rank) != (dist.get_world_size(), dist.get_rank()):
        raise ValueError(
            f"initialize(size={size}, rank={rank}) does not match the world group "
            f"(size {dist.get_world_size()}, rank {dist.get_rank()})"
        )
    communicator_for(None)


def shm_allreduce(data: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    """sgl-kernel's ``shm_allreduce(data, op)``: in place over the world group."""
    communicator_for(None).all_reduce(data, op)


def shm_allgather(data: torch.Tensor, dim: int) -> torch.Tensor:
    """sgl-kernel's ``shm_allgather(data, dim)``: concatenated along ``dim`` over the world group."""
    return communicator_for(None).all_gather(data, dim)


def shm_allgather_into_tensor(output_tensor: torch.Tensor, data: torch.Tensor) -> None:
    """sgl-kernel's ``shm_allgather_into_tensor(output_tensor, data)``: every rank's ``data`` in rank
    order along dim 0 into ``output_tensor``, over the world group."""
    communicator_for(None).all_gather_into_tensor(output_tensor, data)


def shm_reduce_scatter_tensor(output_tensor: torch.Tensor, data: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    """sgl-kernel's ``shm_reduce_scatter_tensor(output_tensor, data, op)``: this rank's part (along
    dim 0) of the sum of every rank's ``data`` into ``output_tensor``, over the world group."""
    communicator_for(None).reduce_scatter_tensor(output_tensor, data, op)


# ---- torch.ops.kernforge.*: one graph node per collective


def _gathered_like(tensor, dim, world):
    return tensor.new_empty(_gathered_shape(tensor.shape, dim % tensor.dim(), world))


_LIB = torch.library.Library("kernforge", "FRAGMENT")
_LIB.define("all_reduce(Tensor(a!) tensor, int communicator) -> ()")
_LIB.impl("all_reduce", lambda tensor, handle: by_handle(handle)._all_reduce(tensor), "CPU")
_LIB.impl("all_reduce", lambda tensor, handle: None, "Meta")
_LIB.define("all_gather(Tensor tensor, int dim, int communicator) -> Tensor")
_LIB.impl("all_gather", lambda tensor, dim, handle: by_handle(handle).all_gather(tensor, dim), "CPU")
_LIB.impl(
    "all_gather",
    lambda tensor, dim, handle: _gathered_like(tensor, dim, by_handle(handle).world_size),
    "Meta",
)
_LIB.define("reduce_scatter_tensor(Tensor(a!) output, Tensor input, int communicator) -> ()")
_LIB.impl(
    "reduce_scatter_tensor",
    lambda output, input, handle: by_handle(handle)._reduce_scatter(output, input.contiguous()),
    "CPU",
)
_LIB.impl("reduce_scatter_tensor", lambda output, input, handle: None, "Meta")
_LIB.define("shm_allreduce(Tensor(a!) data, int op) -> ()")
_LIB.impl("shm_allreduce", lambda data, op: shm_allreduce(data, op), "CPU")
_LIB.impl("shm_allreduce", lambda data, op: None, "Meta")
_LIB.define("shm_allgather(Tensor data, int dim) -> Tensor")
_LIB.impl("shm_allgather", shm_allgather, "CPU")
_LIB.impl("shm_allgather", lambda data, dim: _gathered_like(data, dim, dist.get_world_size()), "Meta")
_LIB.define("shm_allgather_into_tensor(Tensor(a!) output_tensor, Tensor data) -> ()")
_LIB.impl("shm_allgather_into_tensor", shm_allgather_into_tensor, "CPU")
_LIB.impl("shm_allgather_into_tensor", lambda output_tensor, data: None, "Meta")
_LIB.define("shm_reduce_scatter_tensor(Tensor(a!) output_tensor, Tensor data, int reduce_op) -> ()")
_LIB.impl("shm_reduce_scatter_tensor", shm_reduce_scatter_tensor, "CPU")
_LIB.impl("shm_reduce_scatter_tensor", lambda output_tensor, data, reduce_op: None, "Meta")
