"""Runs a function on several ranks (processes spawned on this machine, a gloo group of them) and
collects what each returned, for the distributed tests."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
import traceback

RESULT_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world: int, port: int, env: dict, kwargs: dict, results) -> None:
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # pickled here: a tensor put as is goes through torch's shared-memory handles, which need
        # this process alive when the test unpickles it
        results.put((rank, "ok", pickle.dumps(fn(rank, world, **kwargs))))
    except BaseException:  # noqa: BLE001  (reported to the test, which fails with it)
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, env: dict | None = None, expect_exit: tuple[int, ...] = (), **kwargs) -> dict:
    """fn(rank, world, **kwargs) on `world` ranks; returns {rank: result}. A rank that raised fails
    the test with its traceback; ranks in `expect_exit` may end without a result (killed)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(fn, rank, world, port, env or {}, kwargs, results))
        for rank in range(world)
    ]
    for p in processes:
        p.start()
    outcomes = {}
    try:
        while len(outcomes) < world - len(expect_exit):
            rank, status, value = results.get(timeout=RESULT_TIMEOUT_S)
            outcomes[rank] = (status, value)
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world)) - set(outcomes))} gave no result in time") from None
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {rank: value for rank, (status, value) in outcomes.items() if status == "error"}
    assert not errors, "\n".join(f"rank {rank}:\n{tb}" for rank, tb in errors.items())
    return {rank: pickle.loads(value) for rank, (_, value) in outcomes.items()}
