"""Before/after: the same kernels timed in two checkouts of kernforge, in alternating processes.

A change that should not move performance (a restructure, a new code path beside a fast one) is
checked by timing both trees on the same machine in the same minutes: this VM's DRAM bandwidth
drifts by tens of percent between minutes, so each round runs both trees in fresh processes (A
first in even rounds, B first in odd ones), and the report gives per-case medians over rounds and
the B/A ratio of each round.

    python benchmarks/investigations/bench_ab.py --a /path/to/old-checkout --b . --rounds 4

--pinned: A and B at the same time instead, one thread each, each process on a core of its own
(taskset), the cores swapped every round. For kernels bound by their arithmetic (the *_l2 / *_l3
cases) this removes the drift altogether: both trees see the same minutes. Not for DRAM-bound
cases, where the two processes share the memory bandwidth unevenly.

Cases (2 threads, bf16 unless named): paged decode B=16, L=4096, 32/8 heads, head_dim 128, pages of
16 shuffled (bf16 and fp8 e4m3 KV, and head_dim 64; _hnd: FlashInfer's HND layout, _b64: B=64
L=1024, _g1 / _g8: GQA groups 1 and 8), and with the KV in the caches (_l2: B=2 L=512, 4 MB; _l3:
B=16 L=64, 4 MB, one block per request; _b1_l3: B=1 L=2048, 8 MB, long requests; groups 1 and 8
too); causal ragged prefill of 2048 tokens; the
prepacked GEMM at M=1 (a 32 MiB weight, streamed) and M=256 on 4096x4096. Times are medians of
one process's calls after warm-up (out= preallocated); GB/s is the KV or weight bytes over time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = (
    "decode_bf16",
    "decode_fp8",
    "decode_bf16_d64",
    "decode_bf16_l2",
    "decode_bf16_l3",
    "decode_fp8_l3",
    "decode_bf16_g1_l3",
    "decode_bf16_g8_l3",
    "decode_bf16_hnd",
    "decode_fp8_hnd",
    "decode_bf16_hnd_b64",
    "decode_bf16_g1_hnd",
    "decode_bf16_g8_hnd",
    "decode_bf16_hnd_l2",
    "decode_bf16_hnd_l3",
    "decode_fp8_hnd_l3",
    "decode_bf16_hnd_b1_l3",
    "decode_fp8_hnd_b1_l3",
    "prefill_2048",
    "gemm_m1",
    "gemm_m256",
)


def _median_seconds(fn, budget: float = 1.0, min_calls: int = 15) -> float:
    fn()
    fn()
    samples, start = [], time.perf_counter()
    while len(samples) < min_calls or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _measure(cases: list[str], threads: int) -> dict[str, float]:
    """One process: the cases' median seconds (run in the tree PYTHONPATH selects)."""
    import torch

    import kernforge as kf

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)

    def decode(kv_dtype, batch=16, length=4096, heads=32, kv_heads=8, head_dim=128, page=16, layout="NHD"):
        per = length // page
        rows = (page, kv_heads) if layout == "NHD" else (kv_heads, page)
        cache = torch.randn(batch * per, 2, *rows, head_dim, generator=g).to(kv_dtype)
        indices = torch.randperm(batch * per, generator=g).int()
        wrapper = kf.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8), kv_layout=layout)
        wrapper.plan(
            torch.arange(0, batch * per + 1, per).int(),
            indices,
            torch.full((batch,), page).int(),
            heads,
            kv_heads,
            head_dim,
            page,
            q_data_type=torch.bfloat16,
            kv_data_type=kv_dtype,
        )
        q = torch.randn(batch, heads, head_dim, generator=g).bfloat16()
        out = torch.empty_like(q)
        return _median_seconds(lambda: wrapper.run(q, cache, out=out))

    def prefill(length=2048, heads=32, kv_heads=8, head_dim=128):
        q = torch.randn(length, heads, head_dim, generator=g).bfloat16()
        k, v = (torch.randn(length, kv_heads, head_dim, generator=g).bfloat16() for _ in range(2))
        wrapper = kf.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8))
        indptr = torch.tensor([0, length], dtype=torch.int32)
        wrapper.plan(indptr, indptr, heads, kv_heads, head_dim, causal=True, q_data_type=torch.bfloat16)
        out = torch.empty(length, heads, head_dim, dtype=torch.bfloat16)
        return _median_seconds(lambda: wrapper.run(q, k, v, out=out))

    def gemm(m, n=4096, k=4096):
        packed = kf.convert_weight_packed(torch.randn(n, k, generator=g).bfloat16())
        x = torch.randn(m, k, generator=g).bfloat16()
        out = torch.empty(m, n, dtype=torch.bfloat16)
        return _median_seconds(lambda: kf.weight_packed_linear(x, packed, out=out))

    timers = {
        "decode_bf16": lambda: decode(torch.bfloat16),
        "decode_fp8": lambda: decode(torch.float8_e4m3fn),
        "decode_bf16_d64": lambda: decode(torch.bfloat16, head_dim=64),
        # 1 MB of KV (in the L2s) and 4 MB (in the L3): the rate the kernel's arithmetic allows
        "decode_bf16_l2": lambda: decode(torch.bfloat16, batch=2, length=512),
        "decode_bf16_l3": lambda: decode(torch.bfloat16, length=64),
        "decode_fp8_l3": lambda: decode(torch.float8_e4m3fn, length=64),
        "decode_bf16_g1_l3": lambda: decode(torch.bfloat16, length=64, heads=8),
        "decode_bf16_g8_l3": lambda: decode(torch.bfloat16, length=64, heads=64),
        "decode_bf16_hnd": lambda: decode(torch.bfloat16, layout="HND"),
        "decode_fp8_hnd": lambda: decode(torch.float8_e4m3fn, layout="HND"),
        "decode_bf16_hnd_b64": lambda: decode(torch.bfloat16, batch=64, length=1024, layout="HND"),
        "decode_bf16_g1_hnd": lambda: decode(torch.bfloat16, heads=8, layout="HND"),
        "decode_bf16_g8_hnd": lambda: decode(torch.bfloat16, heads=64, layout="HND"),
        "decode_bf16_hnd_l2": lambda: decode(torch.bfloat16, batch=2, length=512, layout="HND"),
        "decode_bf16_hnd_l3": lambda: decode(torch.bfloat16, length=64, layout="HND"),
        "decode_fp8_hnd_l3": lambda: decode(torch.float8_e4m3fn, length=64, layout="HND"),
        # one request of 2048 tokens (8 MB bf16): long items, as in long-context decode
        "decode_bf16_hnd_b1_l3": lambda: decode(torch.bfloat16, batch=1, length=2048, layout="HND"),
        "decode_fp8_hnd_b1_l3": lambda: decode(torch.float8_e4m3fn, batch=1, length=2048, layout="HND"),
        "prefill_2048": prefill,
        "gemm_m1": lambda: gemm(1),
        "gemm_m256": lambda: gemm(256),
    }
    return {case: timers[case]() for case in cases}


def _start_tree(tree: str, cases: list[str], core: int | None = None) -> subprocess.Popen:
    """A child process timing `cases` in `tree` (2 threads; 1, pinned to `core`, when given)."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    command = [sys.executable, __file__, "--child", "--threads", "2" if core is None else "1", "--cases", *cases]
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, cwd=os.path.abspath(tree))


def _result(child: subprocess.Popen) -> dict[str, float]:
    out, _ = child.communicate()
    if child.returncode:
        raise RuntimeError(f"a timing process failed (exit {child.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _round(args, n: int) -> tuple[dict[str, float], dict[str, float]]:
    """One round's (A, B) medians: at the same time on swapped cores (--pinned), else one after
    the other, A first in even rounds and B first in odd ones (no order bias)."""
    if args.pinned:
        a, b = _start_tree(args.a, args.cases, n % 2), _start_tree(args.b, args.cases, 1 - n % 2)
        return _result(a), _result(b)
    if n % 2:
        b = _result(_start_tree(args.b, args.cases))
        return _result(_start_tree(args.a, args.cases)), b
    a = _result(_start_tree(args.a, args.cases))
    return a, _result(_start_tree(args.b, args.cases))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", help="checkout A (before)")
    parser.add_argument("--b", help="checkout B (after)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="cases to time (all)")
    parser.add_argument("--pinned", action="store_true", help="A and B at once, 1 thread each on its own core")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.cases, args.threads)))
        return
    rounds = [_round(args, n) for n in range(args.rounds)]
    print(f"{'case':16} {'A ms':>9} {'B ms':>9} {'B/A time, per round':>30}")
    for case in args.cases:
        a = statistics.median(r[0][case] for r in rounds) * 1e3
        b = statistics.median(r[1][case] for r in rounds) * 1e3
        ratios = " ".join(f"{r[1][case] / r[0][case]:.2f}" for r in rounds)
        print(f"{case:16} {a:9.3f} {b:9.3f}   {ratios}")


if __name__ == "__main__":
    main()
