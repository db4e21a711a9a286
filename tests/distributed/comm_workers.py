"""What each rank runs in test_comm.py (spawned processes import this module by name)."""

from __future__ import annotations

import os
import signal
import time
import warnings

import torch
import torch.distributed as dist

from kernforge.distributed import Communicator
from kernforge.distributed.communicator import by_handle

SMALL_SLOT = 1 << 20  # 1 MiB slots: tensors above it run in several calls


def _values(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank * 7919 + n * 31 + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    low, high = (0, 256) if dtype == torch.uint8 else (-1000, 1000)
    return torch.randint(low, high, (n,), generator=gen, dtype=dtype)


def _same_on_every_rank(t: torch.Tensor) -> bool:
    """Whether every rank holds the same bytes in t."""
    mine = t.view(torch.uint8)
    copies = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, mine)
    return all(torch.equal(c, copies[0]) for c in copies)


def all_reduce_matches(rank: int, world: int, sizes, dtypes) -> int:
    """all_reduce against its definition: bf16/fp16 bitwise equal to the fp32 sum of the ranks'
    tensors in rank order, rounded once (and within rounding of the float64 sum); fp32 within
    rounding of the float64 sum; ints exact (they go through the group); every rank holds the
    same bits."""
    comm = Communicator(slot_bytes=SMALL_SLOT)
    assert comm.uses_shared_memory
    checked = 0
    for dtype in dtypes:
        for n in sizes:
            x = _values(rank, n, dtype)
            exact = x.double()
            dist.all_reduce(exact)
            if dtype in (torch.bfloat16, torch.float16):
                expected = _sum_in_rank_order(x).to(dtype)
            comm.all_reduce(x)
            if dtype in (torch.bfloat16, torch.float16):
                assert torch.equal(x, expected), (dtype, n)
                torch.testing.assert_close(x.double(), exact, atol=1e-3, rtol=2**-7)
            elif dtype == torch.float32:
                torch.testing.assert_close(x.double(), exact, atol=1e-5, rtol=1e-6)
            else:
                assert torch.equal(x, exact.to(dtype)), (dtype, n)
            assert _same_on_every_rank(x), (dtype, n)
            checked += 1
    return checked


def _sum_in_rank_order(x: torch.Tensor) -> torch.Tensor:
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x)
    total = pieces[0].float()
    for piece in pieces[1:]:
        total += piece.float()
    return total


def reduce_scatter_matches(rank: int, world: int, dtypes) -> int:
    """reduce_scatter_tensor against its definition: each rank's output bitwise equal to its part of
    the fp32 sum of the ranks' inputs in rank order, rounded once (fp32 too: the same additions), so
    to all_reduce's bits, which every rank holds; ints exact (they go through the group). Sizes: odd
    ones, and around a call's piece (sizes above it run in several calls)."""
    comm = Communicator(slot_bytes=SMALL_SLOT)
    assert comm.uses_shared_memory
    checked = 0
    for dtype in dtypes:
        piece = SMALL_SLOT // world // dtype.itemsize
        for n in (1, 7, 31, 4097, piece - 1, piece, piece + 1, 2 * piece + 3):
            x = _values(rank, world * n, dtype, salt=1)
            out = torch.full((n,), 7, dtype=dtype)  # stale values must not survive
            comm.reduce_scatter_tensor(out, x)
            assert torch.equal(out, _my_part(_sum_in_rank_order(x).to(dtype), n)), (dtype, n)
            checked += 1
        if dtype.is_floating_point:
            x = _values(rank, world * 6 * 5, dtype, salt=2).reshape(5, world * 6).t()  # non-contiguous
            out = torch.empty(6, 5, dtype=dtype)
            comm.reduce_scatter_tensor(out, x)
            reduced = x.contiguous()
            comm.all_reduce(reduced)
            assert torch.equal(out, _my_part(reduced, 6)), dtype
    try:
        comm.reduce_scatter_tensor(torch.empty(4), torch.empty(4))
    except ValueError as exc:
        assert f"input must have shape ({4 * world},) (world_size {world}" in str(exc), str(exc)
    else:
        raise AssertionError("an input of output's shape was accepted")
    return checked


def _my_part(total: torch.Tensor, rows: int) -> torch.Tensor:
    rank = dist.get_rank()
    return total[rank * rows : (rank + 1) * rows]


def all_gather_matches(rank: int, world: int) -> int:
    """all_gather along every dim (odd shapes, empty, non-contiguous, chunked across rows, out=) and
    all_gather_into_tensor, against torch.distributed on the same group."""
    comm = Communicator(slot_bytes=SMALL_SLOT)
    cases = [((3, 5), 0), ((3, 5), 1), ((3, 5), -1), ((1,), 0), ((2, 3, 4), 1), ((0, 4), 1), ((7, 100_003), 1)]
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for shape, dim in cases:
            x = _values(rank, max(1, torch.Size(shape).numel()), dtype)[: torch.Size(shape).numel()].reshape(shape)
            pieces = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(pieces, x)
            assert torch.equal(comm.all_gather(x, dim), torch.cat(pieces, dim)), (dtype, shape, dim)
    x = _values(rank, 60, torch.bfloat16).reshape(6, 10).t()  # non-contiguous
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x.contiguous())
    out = torch.empty(10 * world, 6, dtype=torch.bfloat16)
    assert comm.all_gather(x, 0, out=out) is out and torch.equal(out, torch.cat(pieces, 0))
    expected = torch.empty(5 * world, 3)
    got = torch.empty(5 * world, 3)
    y = _values(rank, 15, torch.float32).reshape(5, 3)
    dist.all_gather_into_tensor(expected, y)
    comm.all_gather_into_tensor(got, y)
    assert torch.equal(got, expected)
    comm.close()
    comm.close()  # twice: a no-op
    try:
        comm.all_reduce(y)
    except dist.DistBackendError as exc:
        assert "unusable (it was closed)" in str(exc)
    else:
        raise AssertionError("a closed communicator ran a collective")
    return len(cases)


def many_calls(rank: int, world: int, calls: int) -> int:
    """Back-to-back collectives of three sizes (the whole and the split reduction, one element) and
    gathers, each result checked: a slot reused too early would corrupt one of them."""
    comm = Communicator(slot_bytes=SMALL_SLOT)
    sizes = (4099, 70_001, 1)
    base = world * (world - 1) // 2
    for i in range(calls):
        k = i % 13
        x = torch.full((sizes[i % 3],), float(rank + k), dtype=torch.bfloat16)
        comm.all_reduce(x)
        if not bool((x == float(world * k + base)).all()):
            raise AssertionError(f"call {i}: got {x.unique().tolist()}, expected {world * k + base}")
        if i % 5 == 0:
            gathered = comm.all_gather(torch.full((2,), float(i + rank)), 0)
            assert gathered.tolist() == [float(i + r) for r in range(world) for _ in range(2)], (i, gathered)
    return calls


def mismatch_then_recover(rank: int, world: int) -> list[str]:
    """Ranks passing different sizes, or dtypes, each get a ValueError; the communicator still works."""
    comm = Communicator()
    messages = []
    for x in (torch.ones(100 + rank), torch.ones(8, dtype=torch.bfloat16 if rank else torch.float16)):
        try:
            comm.all_reduce(x)
        except ValueError as exc:
            messages.append(str(exc))
    try:
        comm.all_gather(torch.ones(2, 3 + rank), 0)
    except ValueError as exc:
        messages.append(str(exc))
    try:
        comm.reduce_scatter_tensor(torch.empty(3 + rank), torch.ones(world * (3 + rank)))
    except ValueError as exc:
        messages.append(str(exc))
    assert len(messages) == 4, messages
    x = torch.ones(10)
    comm.all_reduce(x)
    assert bool((x == world).all())
    return messages


def dies_or_waits(rank: int, world: int, victim: int, timeout: float) -> tuple[str, float]:
    """The victim rank is killed between two collectives; the others' next one must fail, naming it,
    long before `timeout` (the liveness check, not the timeout, catches it)."""
    comm = Communicator(timeout=timeout)
    x = torch.ones(4096, dtype=torch.bfloat16)
    comm.all_reduce(x)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.perf_counter()
    try:
        comm.all_reduce(x)
    except dist.DistBackendError as exc:
        elapsed = time.perf_counter() - start
        try:
            comm.all_reduce(x)
        except dist.DistBackendError as again:
            assert "unusable (all_reduce on rank" in str(again)
            return str(exc), elapsed
    raise AssertionError("the collective with a dead peer did not fail")


def late_peer(rank: int, world: int) -> str:
    """Rank 0 waits for a late rank 1 with a short timeout: a clear error, not a hang."""
    comm = Communicator(timeout=0.5)
    if rank == 1:
        time.sleep(2.0)
        return "late"
    try:
        comm.all_reduce(torch.ones(16))
    except dist.DistBackendError as exc:
        return str(exc)
    raise AssertionError("no timeout")


def falls_back_off_host(rank: int, world: int) -> bool:
    """Ranks that look like different hosts use the group itself, warn once, and agree with it."""
    import kernforge.distributed.communicator as module

    module._host_key = lambda: f"host-{rank}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = Communicator()
        second = Communicator()
    assert not comm.uses_shared_memory and not second.uses_shared_memory
    assert len([w for w in caught if "hosts" in str(w.message)]) == 1, [str(w.message) for w in caught]
    x = torch.full((5,), float(rank), dtype=torch.bfloat16)
    comm.all_reduce(x)
    assert bool((x == world * (world - 1) / 2).all())
    assert comm.all_gather(torch.tensor([rank]), 0).tolist() == list(range(world))
    part = torch.empty(1, dtype=torch.bfloat16)
    comm.reduce_scatter_tensor(part, torch.arange(world, dtype=torch.bfloat16) + rank)
    assert part.item() == world * rank + world * (world - 1) / 2
    return True


def compiled_model(rank: int, world: int) -> bool:
    """A function with both collectives compiles into one graph (fullgraph) and matches eager."""
    comm = Communicator()

    def step(x):
        y = x * 2
        comm.all_reduce(y)
        part = y.new_empty(y.shape[0] // world, y.shape[1])
        comm.reduce_scatter_tensor(part, y)
        return comm.all_gather(y + part.sum(), -1)

    x = _values(rank, 4 * world, torch.float32).reshape(world, 4)
    eager = step(x.clone())
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x.clone())
    assert torch.equal(eager, compiled)
    y = x.clone()
    torch.ops.kernforge.all_reduce(y, comm.handle)
    assert by_handle(comm.handle) is comm
    return True


def sgl_kernel_names(rank: int, world: int) -> bool:
    """sgl-kernel's calls, as its test_comm.py makes them, through kernforge's names."""
    import kernforge.distributed as kd

    kd.initialize(world, rank)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensor = torch.randn(2, 10, dtype=dtype, generator=torch.Generator().manual_seed(rank))
        expected = tensor.clone()
        dist.all_reduce(expected)
        torch.ops.kernforge.shm_allreduce(tensor, dist.ReduceOp.SUM)
        torch.testing.assert_close(tensor, expected)
        shm = torch.ops.kernforge.shm_allgather(tensor, -1)
        pieces = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(pieces, tensor)
        assert torch.equal(shm, torch.cat(pieces, -1))
        gathered = torch.empty(2 * world, 10, dtype=dtype)
        torch.ops.kernforge.shm_allgather_into_tensor(gathered, tensor)
        assert torch.equal(gathered, torch.cat(pieces, 0))
        stacked = torch.randn(2 * world, 10, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)
        expected = torch.empty_like(tensor)
        dist.reduce_scatter_tensor(expected, stacked.clone())
        part = torch.empty_like(tensor)
        torch.ops.kernforge.shm_reduce_scatter_tensor(part, stacked, int(dist.ReduceOp.SUM))
        torch.testing.assert_close(part, expected)
        kd.shm_allreduce(tensor, dist.ReduceOp.SUM)
        kd.shm_reduce_scatter_tensor(part, stacked, dist.ReduceOp.SUM)
        kd.shm_allgather_into_tensor(gathered, part)
    return True


def binds_threads(rank: int, world: int) -> tuple[list[int], int, str]:
    """bind_threads gives each rank its block of the allowed CPUs, for every thread of the process."""
    import kernforge.distributed as kd

    x = torch.randn(256, 256)
    (x @ x).sum()  # torch's pool exists before the binding
    line = kd.bind_threads()
    tasks = [int(t) for t in os.listdir("/proc/self/task")]
    cpus = set(kd.binding()["cpus"])
    assert all(os.sched_getaffinity(t) <= cpus for t in tasks), [os.sched_getaffinity(t) for t in tasks]
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads(), line
