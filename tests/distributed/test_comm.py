"""kernforge.distributed: the shared-memory collectives (all-reduce, reduce-scatter, all-gather)
against torch.distributed (gloo) on 2 and 4 ranks spawned on this machine, a dead or late peer,
mismatched tensors, the fallback off-host, the custom ops under torch.compile, thread binding;
argument errors in this process."""

from __future__ import annotations

import gc
import glob
import weakref

import comm_workers
import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

import kernforge.distributed as kd
from kernforge.distributed import Communicator
from kernforge.distributed.communicator import SEGMENT_PREFIX, SHM_DIR
from kernforge.distributed.threads import parse_cpu_list, rank_cpus

pytestmark = pytest.mark.slow

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Elements: 1 element, odd sizes, the whole reduction (<= 64 KiB), the split one, several 1 MiB calls.
SIZES = (1, 7, 31, 4097, 16_385, 100_003, 1_000_003)
MIB_64_BF16 = 32 << 20  # 64 MiB of bf16


def segments() -> set[str]:
    return set(glob.glob(f"{SHM_DIR}/{SEGMENT_PREFIX}*"))


@pytest.fixture
def no_leaked_segments():
    before = segments()
    yield
    assert segments() <= before, f"left in /dev/shm: {segments() - before}"


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_equals_the_exact_sum_on_every_rank(world, no_leaked_segments):
    counts = run_ranks(comm_workers.all_reduce_matches, world, sizes=SIZES, dtypes=(*FLOATS, torch.int32))
    assert set(counts.values()) == {len(SIZES) * 4}


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_of_64_mib(world, no_leaked_segments):
    run_ranks(comm_workers.all_reduce_matches, world, sizes=(MIB_64_BF16,), dtypes=(torch.bfloat16,))


def test_all_reduce_on_every_tier(tier, no_leaked_segments):  # the ranks run the tier this test forces
    sizes = (7, 4097, 100_003)
    run_ranks(comm_workers.all_reduce_matches, 2, env={"KERNFORGE_ISA": tier}, sizes=sizes, dtypes=FLOATS)


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_equals_the_rank_order_sum(world, no_leaked_segments):
    counts = run_ranks(comm_workers.reduce_scatter_matches, world, dtypes=(*FLOATS, torch.int32))
    assert set(counts.values()) == {8 * 4}


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_matches_torch_distributed(world, no_leaked_segments):
    run_ranks(comm_workers.all_gather_matches, world)


@pytest.mark.parametrize("world", [2, 4])
def test_ten_thousand_calls_without_corruption(world, no_leaked_segments):
    assert set(run_ranks(comm_workers.many_calls, world, calls=10_000).values()) == {10_000}


def test_mismatched_tensors_raise_on_every_rank_and_the_communicator_recovers(no_leaked_segments):
    messages = run_ranks(comm_workers.mismatch_then_recover, 2)[0]
    reduce, scatter = messages[0], messages[3]
    assert "rank 0 passed a float32 tensor of shape (100,)" in reduce
    assert "rank 1 passed 404 bytes of fp32 to all_reduce" in reduce
    assert "reduce_scatter_tensor: the ranks' tensors differ: rank 0 passed a float32 tensor" in scatter
    assert "of shape (6,), rank 1 passed 32 bytes of fp32 to reduce_scatter_tensor" in scatter


def test_a_killed_rank_fails_the_others_quickly(no_leaked_segments):
    results = run_ranks(comm_workers.dies_or_waits, 3, expect_exit=(2,), victim=2, timeout=60.0)
    for rank in (0, 1):
        message, elapsed = results[rank]
        assert "rank 2 exited" in message
        assert elapsed < 5.0  # found by the liveness check, long before the 60 s timeout


def test_a_late_peer_times_out_with_a_clear_error(no_leaked_segments):
    results = run_ranks(comm_workers.late_peer, 2)
    assert "rank 1 did not join within the timeout of 0.5 s" in results[0]


def test_ranks_on_different_hosts_use_the_group(no_leaked_segments):
    run_ranks(comm_workers.falls_back_off_host, 2)


def test_collectives_compile_into_one_graph(no_leaked_segments):
    run_ranks(comm_workers.compiled_model, 2)


def test_sgl_kernel_names(no_leaked_segments):
    run_ranks(comm_workers.sgl_kernel_names, 2)


def test_bind_threads_gives_each_rank_its_cpus():
    results = run_ranks(comm_workers.binds_threads, 2)
    for rank, (cpus, threads, line) in results.items():
        assert cpus == rank_cpus(rank, 2) and threads == len(cpus)
        assert f"on CPUs {cpus[0]}" in line


# ---- in this process


def test_cpu_lists():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    with pytest.raises(ValueError, match="cpu_ids must be a CPU list"):
        parse_cpu_list("zero")
    with pytest.raises(ValueError, match="at least one CPU"):
        parse_cpu_list(" , ")


def test_rank_cpus_splits_the_allowed_cpus(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    assert [rank_cpus(r, 3) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert rank_cpus(5, 8) == [5]  # more ranks than CPUs: they share
    with pytest.raises(ValueError, match="local_rank"):
        rank_cpus(3, 3)


@pytest.fixture
def single_rank_group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def test_one_rank_is_the_identity(single_rank_group):
    comm = Communicator()
    x = torch.randn(5, 3)
    before = x.clone()
    comm.all_reduce(x)
    assert torch.equal(x, before)
    assert torch.equal(comm.all_gather(x, 1), x)
    out = torch.empty(5, 3)
    comm.reduce_scatter_tensor(out, x)
    assert torch.equal(out, x)


def test_bad_arguments(single_rank_group):
    comm = Communicator()
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        comm.all_reduce([1.0])
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        comm.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="Only torch.distributed.ReduceOp.SUM is supported"):
        comm.all_reduce(torch.ones(4), dist.ReduceOp.MAX)
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        comm.reduce_scatter_tensor(torch.empty(4), [1.0])
    with pytest.raises(TypeError, match=r"output must have input's dtype \(torch.float32\), got torch.bfloat16"):
        comm.reduce_scatter_tensor(torch.empty(4, dtype=torch.bfloat16), torch.ones(4))
    with pytest.raises(ValueError, match=r"input must have shape \(4, 3\) \(world_size 1 times output's"):
        comm.reduce_scatter_tensor(torch.empty(4, 3), torch.ones(4, 2))
    with pytest.raises(ValueError, match="output must have at least one dimension"):
        comm.reduce_scatter_tensor(torch.tensor(1.0), torch.ones(1))
    with pytest.raises(ValueError, match="output must be contiguous"):
        comm.reduce_scatter_tensor(torch.empty(3, 4).t(), torch.ones(4, 3))
    with pytest.raises(ValueError, match="Only torch.distributed.ReduceOp.SUM is supported"):
        comm.reduce_scatter_tensor(torch.empty(4), torch.ones(4), dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="dim must be an int"):
        comm.all_gather(torch.ones(4), 1)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        comm.all_gather(torch.ones(4), 0, out=torch.empty(5))
    with pytest.raises(ValueError, match="at least one dimension"):
        comm.all_gather(torch.tensor(1.0), 0)
    with pytest.raises(ValueError, match="slot_bytes"):
        Communicator(slot_bytes=1000)
    with pytest.raises(ValueError, match="timeout"):
        Communicator(timeout=0)
    with pytest.raises(ValueError, match="does not match the world group"):
        kd.initialize(2, 0)


def test_communicators_do_not_keep_a_destroyed_group_alive():
    # A group alive past destroy_process_group() is freed at interpreter exit, where gloo's threads
    # abort the process (SIGABRT, 'terminate called without an active exception').
    if dist.is_initialized():
        pytest.skip("a group is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm, shared = Communicator(), kd.communicator_for()
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    assert group() is None
    for communicator in (comm, shared):
        with pytest.raises(dist.DistBackendError, match="process group was destroyed"):
            _ = communicator.group


def test_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a group is initialized in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        Communicator()
