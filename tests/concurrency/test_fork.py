"""Child processes of a process that already ran kernforge's (and torch's) parallel kernels.

libgomp, the OpenMP runtime the kernels share with torch, keeps a pool of worker threads per thread
that starts parallel regions, and has no fork handler: a child forked after the forking thread ran
one inherits the pool's bookkeeping without its threads, and its first parallel region waits for
them forever (torch's own ops as well as kernforge's). kernforge releases the forking thread's pool
before os.fork() (``kernforge.ops._openmp``), so a forked child runs both on as many threads as the
parent; where a libgomp cannot release its pool, the child runs kernforge's kernels on one thread
and warns. The 'spawn' start method needs nothing of the kind. Every result is compared bit for bit
with the parent's; a child that sends nothing within its timeout fails the test as a hang.
"""

from __future__ import annotations

import multiprocessing
import os
import warnings

import fork_workers
import pytest
import torch
from thread_helpers import run_in_threads

import kernforge
from kernforge.ops import _openmp

FORK_TIMEOUT = 60.0  # seconds for a forked child (no imports) to report
SPAWN_TIMEOUT = 240.0  # a spawned one imports torch and kernforge on two busy cores first
COMPARED = ("rmsnorm", "torch_softmax", "linear", "rmsnorm_again")


def run_child(method: str, target, *args, timeout: float = FORK_TIMEOUT) -> dict:
    """Start ``target(conn, *args)`` in a child by ``method``; what it sent through ``conn``. Fails
    the test if the child sends nothing within ``timeout`` seconds (it is killed) or sent an error."""
    context = multiprocessing.get_context(method)
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=target, args=(sender, *args), daemon=True)
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout):
            pytest.fail(f"a child started by {method!r} sent nothing in {timeout:.0f} s: it hangs")
        result = receiver.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
    assert "error" not in result, f"the {method!r} child failed: {result['error']}"
    assert child.exitcode == 0, f"the {method!r} child exited with {child.exitcode}"
    return result


@pytest.fixture
def parent_ran_kernels():
    """This thread's OpenMP pool is up: the parent ran kernforge's kernels and torch's parallel ops
    on 2 threads. Yields their digests; the thread settings are restored after."""
    saved = torch.get_num_threads()
    try:
        yield fork_workers.run_ops(kernel_threads=2)
    finally:
        torch.set_num_threads(saved)
        kernforge.set_num_threads(None)


def assert_same_results(child: dict, parent: dict) -> None:
    for key in COMPARED:
        assert child[key] == parent[key], f"{key}: the child's result differs from the parent's"


def test_forked_child_runs_kernels_and_torch_ops_on_all_threads(parent_ran_kernels):
    child = run_child("fork", fork_workers.report)
    assert child["pid"] != os.getpid() and child["kernel_threads"] == 2
    assert_same_results(child, parent_ran_kernels)
    assert child["warnings"] == []
    # The parent's own pool was released before the fork: its next parallel regions start a new one.
    assert_same_results(fork_workers.run_ops(kernel_threads=2), parent_ran_kernels)


def test_fork_from_a_thread_that_has_its_own_pool(parent_ran_kernels):
    """The child is a copy of the forking thread alone: that thread's pool is the one released."""

    def ran_and_forked() -> tuple[dict, dict]:
        ops = fork_workers.run_ops(kernel_threads=2)  # this thread's own pool
        return ops, run_child("fork", fork_workers.report)

    ((ops, child),) = run_in_threads([ran_and_forked], timeout=2 * FORK_TIMEOUT)
    assert_same_results(ops, parent_ran_kernels)
    assert_same_results(child, parent_ran_kernels)


def test_repeated_forks(parent_ran_kernels):
    """Each fork releases the pool the parent started again since the last one."""
    for _ in range(3):
        assert_same_results(run_child("fork", fork_workers.report), parent_ran_kernels)
        assert_same_results(fork_workers.run_ops(kernel_threads=2), parent_ran_kernels)


def test_child_runs_kernels_on_one_thread_when_the_pool_cannot_be_released(parent_ran_kernels, monkeypatch):
    """A libgomp without omp_pause_resource_all (before GCC 9): the child's kernels run on the calling
    thread, which starts no parallel region, and it is told why. (No torch op runs there: the
    parent's pool being stale, any parallel one would hang, even the copy that makes the inputs.)"""
    monkeypatch.setattr(_openmp, "release_thread_pools", lambda: False)
    t = fork_workers.inputs()  # made here: the child has a copy

    def one_thread_kernels(conn) -> None:
        try:
            conn.send(
                {
                    "kernel_threads": kernforge.ops.num_threads(),
                    "rmsnorm": fork_workers.digest(kernforge.rmsnorm(t["x"], t["w"])),
                    "warnings": [str(w.message) for w in caught],  # the fork hook's, in this copy
                }
            )
        except BaseException as exc:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        child = run_child("fork", one_thread_kernels)
    assert child["kernel_threads"] == 1
    assert child["rmsnorm"] == parent_ran_kernels["rmsnorm"]  # the same bits on one thread
    assert len(child["warnings"]) == 1 and "'spawn'" in child["warnings"][0], child["warnings"]
    assert not caught, "the parent is not warned: its pool is intact"


def test_release_reaches_the_libgomp_torch_loaded():
    """The release finds the libgomp torch mapped, and it has omp_pause_resource_all."""
    files = _openmp._mapped_libgomp_files()
    assert files, "no libgomp mapped: torch's OpenMP build loads one"
    assert all(_openmp._pause_function(path) is not None for path in files), files
    assert _openmp.release_thread_pools()


@pytest.mark.slow  # a child that imports torch and kernforge
def test_spawned_child_runs_kernels_after_the_parent_did(parent_ran_kernels):
    child = run_child("spawn", fork_workers.report, timeout=SPAWN_TIMEOUT)
    assert child["pid"] != os.getpid() and child["kernel_threads"] == 2
    assert_same_results(child, parent_ran_kernels)


def test_bound_pool_is_pinned_again_after_a_fork(parent_ran_kernels):
    """kernforge.distributed pins the pool one thread per CPU; the release before a fork would leave
    the next pool's threads on the forking thread's one CPU, so the parent pins a new pool again.
    Checked in a forked child, so the binding stays out of this process."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")

    def bind_fork_and_look(conn) -> None:
        try:
            import kernforge.distributed as kd

            kd.bind_threads(cpus)
            t = fork_workers.inputs()

            def pinned() -> list[int]:
                kernforge.rmsnorm(t["x"], t["w"])  # a parallel region on the pool
                masks = [os.sched_getaffinity(int(task)) for task in os.listdir("/proc/self/task")]
                return sorted(next(iter(mask)) for mask in masks if len(mask) == 1)

            before = pinned()
            grandchild = os.fork()
            if grandchild == 0:
                os._exit(0)
            os.waitpid(grandchild, 0)
            conn.send({"before": before, "after": pinned()})
        except BaseException as exc:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})

    child = run_child("fork", bind_fork_and_look)
    assert child["before"] == cpus, child
    assert child["after"] == cpus, f"after a fork the pool's threads run on CPUs {child['after']}, not {cpus}"
