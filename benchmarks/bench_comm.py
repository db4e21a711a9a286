"""kernforge.distributed against gloo on the same group: all_reduce latency and bandwidth, all_gather,
reduce_scatter_tensor.

    .venv/bin/python benchmarks/bench_comm.py [--world 2] [--calls 10000] [--quick] [--json out.json]

Spawns ``--world`` ranks on this machine (a gloo group), each bound to its share of the cores with
one thread (``kernforge.distributed.bind_threads``). In one run, interleaved in rounds so that
noise on this shared VM hits both alike:

* latency: ``[1, 4096]`` bf16 (a decode step's hidden state), every call timed alone, back to back
  as a model calls it: p50 and p99 over ``--calls`` calls of kernforge's all_reduce, and over a
  tenth as many of ``torch.distributed.all_reduce`` (gloo); the worst rank's figures;
* bandwidth: all_reduce of 64 KiB to 64 MiB of bf16 (``[1024, 4096]`` is 8 MiB, a prefill's
  hidden state): the tensor's bytes over the median time, against a one-thread copy of the same
  bytes (``dst.copy_(src)``) timed on every rank at once in the same rounds;
* all_gather of ``[1, 64128]`` bf16 (Llama-3.2-1B's vocabulary shard at TP=2) and ``[1024, 4096]``
  along the last dim into a preallocated ``out=``, against gloo's ``all_gather_into_tensor`` (along
  dim 0, so without the reordering copy a last-dim gather needs on top);
* reduce_scatter_tensor of ``[world * rows, 4096]`` bf16 into ``[rows, 4096]`` (1 row: a decode
  step's; 256: a prefill chunk's), against gloo's.

Times are per call of runs of back-to-back calls; allocating calls are not measured (every figure
here writes into a preallocated tensor: all_reduce in place, all_gather with ``out=``).

``--quick`` (a smoke): 1000 latency calls, the smallest all_reduce size, the first all_gather shape
and reduce_scatter size, 2 samples a round. Rank 0 hands its records (``_harness.emit``) to
the parent process, which writes them (``--jsonl``).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import _harness as H  # noqa: E402

LATENCY_SHAPE = (1, 4096)
BANDWIDTH_MIB = (0.0625, 0.25, 1, 4, 8, 16, 64)
GATHER_SHAPES = ((1, 64128), (1024, 4096))
SCATTER_ROWS = (1, 256)  # reduce_scatter_tensor's output rows of 4096 bf16 per rank
ROUNDS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_calls(call, n: int) -> list[float]:
    """Each of n back-to-back calls timed alone, in microseconds."""
    times = []
    for _ in range(n):
        start = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def latency(comm, calls: int) -> dict:
    x = torch.randn(LATENCY_SHAPE).to(torch.bfloat16)
    ours, gloo = [], []
    timed_calls(lambda: comm.all_reduce(x), 500)  # warm-up
    timed_calls(lambda: dist.all_reduce(x), 50)
    for _ in range(ROUNDS):
        dist.barrier()
        ours += timed_calls(lambda: comm.all_reduce(x), calls // ROUNDS)
        dist.barrier()
        gloo += timed_calls(lambda: dist.all_reduce(x), max(1, calls // 10 // ROUNDS))
    return {name: {"p50": percentile(t, 0.5), "p99": percentile(t, 0.99)} for name, t in (("kf", ours), ("gloo", gloo))}


def median_time(call, reps: int, nbytes: int) -> float:
    """Median seconds per call of `reps` samples, each a run of back-to-back calls started together
    on every rank (runs of 64 MiB at least, up to 100 calls: the ranks' skew leaving the barrier,
    tens of microseconds, stays out of the figure)."""
    inner = max(1, min(100, (64 << 20) // max(1, nbytes)))
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(inner):
            call()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def interleaved(calls: dict, reps: int, nbytes: int) -> dict:
    """Each call's median over ROUNDS rounds of median_time, the calls taking turns in every round."""
    samples = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            samples[name].append(median_time(call, reps, nbytes))
    return {name: statistics.median(t) for name, t in samples.items()}


def bandwidth(comm, mib: float, reps: int) -> dict:
    n = int(mib * 2**20) // 2
    x, src, dst = (torch.randn(n).to(torch.bfloat16) for _ in range(3))
    calls = {"kf": lambda: comm.all_reduce(x), "gloo": lambda: dist.all_reduce(x), "copy": lambda: dst.copy_(src)}
    return interleaved(calls, reps, 2 * n) | {"bytes": 2 * n}


def gather(comm, shape: tuple[int, int], reps: int) -> dict:
    x = torch.randn(shape).to(torch.bfloat16)
    out = torch.empty(shape[0] * comm.world_size, shape[1], dtype=torch.bfloat16)
    gathered = torch.empty(shape[0], shape[1] * comm.world_size, dtype=torch.bfloat16)
    calls = {
        "kf": lambda: comm.all_gather(x, -1, out=gathered),
        "gloo": lambda: dist.all_gather_into_tensor(out, x),  # along dim 0: no reordering copy
    }
    return interleaved(calls, reps, x.numel() * 2)


def reduce_scatter(comm, rows: int, reps: int) -> dict:
    x = torch.randn(rows * comm.world_size, 4096).to(torch.bfloat16)
    out = torch.empty(rows, 4096, dtype=torch.bfloat16)
    calls = {
        "kf": lambda: comm.reduce_scatter_tensor(out, x),
        "gloo": lambda: dist.reduce_scatter_tensor(out, x),
    }
    return interleaved(calls, reps, x.numel() * 2)


def rank_main(rank: int, world: int, port: int, args, records_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import kernforge.distributed as kd

    binding = kd.bind_threads()
    comm = kd.Communicator()
    quick = args.quick
    reps = 2 if quick else 10
    results = {
        "binding": binding,
        "latency": latency(comm, 1000 if quick else args.calls),
        "bandwidth": {mib: bandwidth(comm, mib, reps) for mib in BANDWIDTH_MIB[: 1 if quick else None]},
        "gather": {shape: gather(comm, shape, reps) for shape in GATHER_SHAPES[: 1 if quick else None]},
        "scatter": {rows: reduce_scatter(comm, rows, reps) for rows in SCATTER_ROWS[: 1 if quick else None]},
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        report(everyone, args)
        Path(records_path).write_text(json.dumps(H.RECORDS))  # to the parent, which writes them out
    dist.destroy_process_group()


def worst(everyone: list[dict], *path) -> float:
    """The largest figure over the ranks at `path` in their results."""
    values = []
    for results in everyone:
        for key in path:
            results = results[key]
        values.append(results)
    return max(values)


IMPLS = {"kf": "kernforge", "gloo": "gloo", "copy": "torch copy_"}


def emit_collective(case: str, collective: str, world: int, t: dict, nbytes: int | None = None) -> None:
    """Records of one row: µs per call of each implementation; with ``nbytes``, GB/s of kernforge
    (bound: a one-thread copy of the same bytes, timed in the same rounds) and of the copy."""
    params = {"collective": collective, "world": world, **({"bytes": nbytes} if nbytes else {})}
    for name in ("kf", "gloo"):
        H.emit(case, IMPLS[name], "us", t[name] * 1e6, "us", params=params)
    if nbytes:
        copy_gbs = nbytes / t["copy"] / 1e9
        H.emit(
            case, "kernforge", "gbs", nbytes / t["kf"] / 1e9, "GB/s", params=params, bound=("copy bandwidth", copy_gbs)
        )
        H.emit(case, IMPLS["copy"], "gbs", copy_gbs, "GB/s", params=params)


def report(everyone: list[dict], args) -> None:
    world = len(everyone)
    H.print_header(f"bench_comm: kernforge.distributed vs gloo, {world} ranks", args)
    for r, results in enumerate(everyone):
        print(f"- rank {r}: {results['binding']}")
    print()
    lat = {name: {q: worst(everyone, "latency", name, q) for q in ("p50", "p99")} for name in ("kf", "gloo")}
    print(f"## all_reduce {list(LATENCY_SHAPE)} bf16, each call timed alone (worst rank)\n")
    rows = [[name, H.fmt(v["p50"], 2), H.fmt(v["p99"], 2), H.fmt(v["p99"] / v["p50"], 2)] for name, v in lat.items()]
    print(H.table(["", "p50 µs", "p99 µs", "p99 / p50"], rows))
    case = f"all_reduce {list(LATENCY_SHAPE)} bf16 latency"
    for name, v in lat.items():
        for q in ("p50", "p99"):
            H.emit(case, IMPLS[name], f"{q}_us", v[q], "us", params={"collective": "all_reduce", "world": world})
    print(f"\ngloo p50 / kernforge p50: **{lat['gloo']['p50'] / lat['kf']['p50']:.1f}x**\n")
    print("## all_reduce bandwidth, bf16 (median of rounds; worst rank)\n")
    rows = []
    for mib in everyone[0]["bandwidth"]:
        t = {name: worst(everyone, "bandwidth", mib, name) for name in ("kf", "gloo", "copy")}
        nbytes = everyone[0]["bandwidth"][mib]["bytes"]
        emit_collective(f"all_reduce {mib:g} MiB bf16", "all_reduce", world, t, nbytes)
        rows.append(
            [
                f"{mib:g} MiB",
                H.fmt(t["kf"] * 1e6, 1),
                H.fmt(t["gloo"] * 1e6, 1),
                H.fmt(t["gloo"] / t["kf"], 1),
                H.fmt(nbytes / t["kf"] / 1e9, 1),
                H.fmt(nbytes / t["copy"] / 1e9, 1),
                f"{t['copy'] / t['kf']:.0%}",
            ]
        )
    print(H.table(["size", "kf µs", "gloo µs", "gloo / kf", "kf GB/s", "copy GB/s", "kf % of copy"], rows))
    print("\n## all_gather bf16 along the last dim (median of rounds; worst rank)\n")
    rows = []
    for shape in everyone[0]["gather"]:
        t = {name: worst(everyone, "gather", shape, name) for name in ("kf", "gloo")}
        emit_collective(f"all_gather {list(shape)} bf16", "all_gather", world, t)
        rows.append(
            [str(list(shape)), H.fmt(t["kf"] * 1e6, 1), H.fmt(t["gloo"] * 1e6, 1), H.fmt(t["gloo"] / t["kf"], 1)]
        )
    print(H.table(["per rank", "kf µs", "gloo µs", "gloo / kf"], rows))
    print(f"\n## reduce_scatter_tensor bf16, [{world} * rows, 4096] -> [rows, 4096] (median of rounds; worst rank)\n")
    rows = []
    for n in everyone[0]["scatter"]:
        t = {name: worst(everyone, "scatter", n, name) for name in ("kf", "gloo")}
        emit_collective(f"reduce_scatter_tensor [{world} * {n}, 4096] bf16", "reduce_scatter_tensor", world, t)
        rows.append([str(n), H.fmt(t["kf"] * 1e6, 1), H.fmt(t["gloo"] * 1e6, 1), H.fmt(t["gloo"] / t["kf"], 1)])
    print(H.table(["rows", "kf µs", "gloo µs", "gloo / kf"], rows))
    H.write_json(args.json, {"world": world, "ranks": everyone})


def main() -> int:
    p = H.base_parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--calls", type=int, default=10_000, help="timed all_reduce calls for the latency (default 10000)")
    args = p.parse_args()
    if args.wait_quiet:
        H.wait_for_quiet(args.wait_quiet)
    with tempfile.TemporaryDirectory() as tmp:
        records = Path(tmp) / "records.json"
        mp.spawn(rank_main, args=(args.world, free_port(), args, str(records)), nprocs=args.world)
        H.RECORDS.extend(json.loads(records.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
