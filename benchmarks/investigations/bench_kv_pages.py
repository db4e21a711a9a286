"""Decode over a KV cache in 4 KiB pages against the same cache in 2 MiB huge pages (issue 22).

kernforge's batch decode reads its KV pages scattered over the cache: with the OS's 4 KiB pages
nearly every KV page is a TLB miss and a page walk (two-dimensional in a VM), taken at the
prefetch that first touches it. This times the same decode on the same values held both ways
(torch.empty's 4 KiB pages; kernforge.empty_kv_cache's 2 MiB huge pages, what kernforge's
integrations allocate), each first written page by page in the order decode steps fill them, bf16
and fp8 e4m3 KV, NHD and HND, round-robin in one process with
kernforge's M=1 GEMM streaming a weight larger than the L3 (the DRAM rate of the same minutes),
so that the ratios do not carry this VM's minute-to-minute drift. A cache smaller than 3x the L3
is copied until the copies the calls rotate over are not, so every call reads from DRAM.

Shape: 32 query heads, 8 KV heads, head dim 128, pages of 16 tokens shuffled (bench_decode's).
Check (untimed): each decode's output on huge pages equals its output on 4 KiB pages bit for bit.

    # about 1 minute:
    .venv/bin/python benchmarks/investigations/bench_kv_pages.py [--cases 16:16384 16:4096 ...] [--rounds 5]
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _harness and the routines
from bench_decode import (  # noqa: E402
    BF16,
    FP8,
    HQ,
    PAGE,
    D,
    PagedBatch,
    kf_wrapper,
    kv_bytes,
    parse_case,
    quantize_fp8,
    random_cache,
)

import kernforge  # noqa: E402

import _harness as H  # noqa: E402

DEFAULT_CASES = "target"  # bench_decode's: 16:4096 64:1024 1:32768 16:16384


def written_as_decoded(cache: torch.Tensor, batch: PagedBatch, empty) -> torch.Tensor:
    """A copy of ``cache`` in memory from ``empty``, first written page by page in the order decode
    steps fill them (every request's next page in turn), not front to back: where the OS's pages
    come from is the order they are first touched, and an engine's cache is touched that way. A
    copy written front to back gets physically consecutive 4 KiB pages, which some CPUs (AMD's
    Zen) coalesce in the TLB: a best case no engine sees."""
    out = empty(cache.shape, dtype=cache.dtype)
    pages = [batch.pages_of(i).tolist() for i in range(len(batch.seq_lens))]
    for step in range(max(map(len, pages))):
        for request in pages:
            if step < len(request):
                out[request[step]] = cache[request[step]]
    return out


def bench_case(B: int, L: int, layouts: list[str], args) -> dict:
    g = torch.Generator().manual_seed(B * 100_003 + L)
    batch = PagedBatch.make([L] * B, g)
    q = torch.randn(B, HQ, D, generator=g, dtype=BF16)
    calls, bytes_of = {}, {}
    for layout in layouts:
        nhd = random_cache(batch.num_pages, g)
        bf16 = nhd if layout == "NHD" else nhd.transpose(2, 3).contiguous()
        del nhd
        fp8, k_scale, v_scale = quantize_fp8(bf16)
        for dtype, cache, scales in ((BF16, bf16, {}), (FP8, fp8, dict(k_scale=k_scale, v_scale=v_scale))):
            w, _ = kf_wrapper(batch, dtype, layout)
            out = torch.empty(B, HQ, D, dtype=BF16)
            copies = -(-H.COLD_SPAN // (cache.numel() * cache.element_size()))  # >= 3x the L3 in all
            for pages, empty in (("4K", torch.empty), ("2M", kernforge.empty_kv_cache)):
                name = f"{'bf16' if dtype == BF16 else 'fp8'} {layout} {pages}"
                rotation = itertools.cycle([written_as_decoded(cache, batch, empty) for _ in range(copies)])
                calls[name] = lambda w=w, r=rotation, out=out, scales=scales: w.run(q, next(r), out=out, **scales)
                bytes_of[name] = kv_bytes(B * L, cache.element_size())
    checks = {}
    for name in calls:
        if name.endswith("2M"):
            same = torch.equal(calls[name]().clone(), calls[name[:-2] + "4K"]())
            checks[name[:-3]] = "ok" if same else "FAIL (outputs differ)"
    stream, stream_bytes = H.weight_streaming_call()
    calls["stream"] = stream
    t, bg = H.timed(calls, args, 0.02)
    us = {n: v.us for n, v in t.items()}
    return {
        "B": B,
        "L": L,
        "us": us,
        "bytes": bytes_of,
        "stream_gbs": stream_bytes / (us["stream"] * 1e3),
        "checks": checks,
        "background_load": bg,
        "rounds": {n: v.to_json() for n, v in t.items()},
    }


def print_case(r: dict) -> None:
    print(f"### B={r['B']} L={r['L']}: stream {r['stream_gbs']:.1f} GB/s in the same rounds")
    print()
    rows = []
    for key in r["checks"]:
        small, huge = r["us"][key + " 4K"], r["us"][key + " 2M"]
        gbs = [r["bytes"][key + " 4K"] / (u * 1e3) for u in (small, huge)]
        rows.append(
            [key, H.fmt(small, 0), H.fmt(huge, 0), f"{small / huge:.3f}"]
            + [H.fmt(x, 1) for x in gbs]
            + [f"{100 * x / r['stream_gbs']:.0f}%" for x in gbs]
            + [r["checks"][key]]
        )
    print(
        H.table(
            ["KV", "4 KiB µs", "2 MiB µs", "4K/2M time", "GB/s 4K", "GB/s 2M", "% stream 4K", "% 2M", "same output"],
            rows,
        )
    )
    ratios = []
    for layout in ("NHD", "HND"):
        for pages in ("4K", "2M"):
            bf16, fp8 = r["us"].get(f"bf16 {layout} {pages}"), r["us"].get(f"fp8 {layout} {pages}")
            if bf16 and fp8:
                ratios.append(f"{layout} {pages} {bf16 / fp8:.2f}x")
    print()
    print("fp8 / bf16 speed (bf16 time / fp8 time): " + ", ".join(ratios))
    print()


def main() -> int:
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="*", metavar="B:L", type=parse_case, help="(default: bench_decode's target)")
    p.add_argument("--layouts", nargs="*", default=["NHD", "HND"], choices=["NHD", "HND"])
    p.add_argument("--rounds", type=int, default=5, help="round-robin rounds per case (5)")
    p.add_argument("--budget", type=float, default=0.5, help="seconds per call kind and round (0.5)")
    args = p.parse_args()
    args.min_samples, args.retries, args.retry_wait, args.max_bg = 3, 0, 60, 0.10
    cases = [c for group in (args.cases or [parse_case(DEFAULT_CASES)]) for c in group]
    H.setup_threads(args.threads)
    bg0 = H.wait_for_quiet(args.wait_quiet)
    H.print_header(
        "bench_kv_pages: decode over 4 KiB pages vs 2 MiB huge pages, same values, same rounds",
        args,
        {
            "cases": " ".join(f"{B}:{L}" for B, L in cases)
            + f"; layouts {' '.join(args.layouts)}; pages of {PAGE} shuffled",
            "THP": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
            if sys.platform.startswith("linux")
            else "n/a",
            "timing": f"median of samples, {args.rounds} round-robin rounds of {args.budget} s per call kind",
            "background CPU load before start (other processes)": f"{100 * bg0:.0f}% of all cores",
        },
    )
    results = []
    for B, L in cases:
        results.append(bench_case(B, L, args.layouts, args))
        gc.collect()
        print_case(results[-1])
    gains = {
        kind: statistics.median(r["us"][f"{kind} 4K"] / r["us"][f"{kind} 2M"] for r in results)
        for kind in results[0]["checks"]
    }
    print("Median 4K/2M time ratio over the cases: " + ", ".join(f"{k} {v:.3f}" for k, v in gains.items()))
    H.write_json(args.json, {"cases": results})
    failed = [k for r in results for k, c in r["checks"].items() if c != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
