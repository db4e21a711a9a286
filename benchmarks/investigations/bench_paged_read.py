"""What bounds a paged KV read on this machine (issue 22): a load-only walk over the KV cache that
decode attention reads (investigations/templates/bench_paged_read.cpp.jinja), varying one thing at a
time, against the rate kernforge's M=1 GEMM streams a weight larger than the L3 and torch's sum
over 1 GiB, measured in the same run, round-robin (this VM's DRAM rate moves over minutes).

Baseline: batch 16 x 4096 tokens, 8 KV heads x 128, bf16 (268 MB of K and V), pages of 16 tokens,
NHD, page table shuffled, the requests split over the threads, decode.h's order (block by block of
32 tokens, head by head: K rows then V rows), one request at a time per thread, the next block
prefetched row by row. Variants change one of: prefetch distance (none, 2, 4 blocks), order
(token-major: every head of a token at once), streams (2, 4 requests per thread in turn), page size
(64, 256), layout (HND, pages of 16 to 256), dtype (fp8: 128-byte rows), the prefetch hint
(prefetcht1: into L2 only on Zen 4 and later; or prefetcht1 of a row's first line only, the rest
left to the hardware prefetchers), the OS's pages (the same values in 2 MiB huge pages from
kernforge.empty_kv_cache, against torch.empty's 4 KiB pages written front to back). Also
kernforge's decode itself on the baseline's cache (q bf16, group 4), and on the page-size (64, 128,
256), HND (pages of 16 to 256), fp8 and huge-page caches, so the load-only figures have the real
kernel beside them; and the kernel on 16 MB of KV (in the L3), the rate its arithmetic allows,
beside vdpbf16ps at its peak on every thread, stated as the KV bytes decode reads per as many dot
products (the bound on that arithmetic).

    .venv/bin/python benchmarks/investigations/bench_paged_read.py --wait-quiet 30      # about 1.5 minutes
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

import kernforge

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _harness and the routines
import _harness as H  # noqa: E402

HEADS, HEAD_DIM, BLOCK = 8, 128, 32
STREAM_NAME = f"weight_packed_linear M=1 ({H.DRAM_SPAN // H.MiB} MiB weight)"


class PagedCache:
    """K and V of `batch` requests of `tokens` each in pages of `page` tokens, shuffled."""

    def __init__(
        self,
        batch: int,
        tokens: int,
        page: int,
        layout: str,
        dtype: torch.dtype,
        g: torch.Generator,
        huge: bool = False,
    ):
        pages_per_request = tokens // page
        num_pages = batch * pages_per_request
        shape = (num_pages, 2, page, HEADS, HEAD_DIM) if layout == "NHD" else (num_pages, 2, HEADS, page, HEAD_DIM)
        if dtype == torch.bfloat16:
            self.cache = torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
        else:  # fp8 bytes: finite e4m3 values
            self.cache = torch.randint(0, 0x7F, shape, dtype=torch.uint8, generator=g)
        if huge:  # the same values in 2 MiB pages (torch.empty's are 4 KiB)
            self.cache = kernforge.empty_kv_cache(shape, dtype=self.cache.dtype).copy_(self.cache)
        self.indices = torch.randperm(num_pages, generator=g).to(torch.int32)
        self.indptr = torch.arange(0, num_pages + 1, pages_per_request, dtype=torch.int32)
        self.batch, self.tokens, self.page, self.layout = batch, tokens, page, layout
        elem = self.cache.element_size()
        self.row_bytes = HEAD_DIM * elem
        stride = [s * elem for s in self.cache.stride()]
        self.stride_page = stride[0]
        self.stride_token, self.stride_head = (stride[2], stride[3]) if layout == "NHD" else (stride[3], stride[2])
        self.v_offset = stride[1]

    @property
    def bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()


def probe():
    from kernforge.jit import Entry, Module, core

    kernforge.register_template_dir(Path(__file__).resolve().parent / "templates")
    module = Module(
        "bench_paged_read",
        "bench_paged_read.cpp.jinja",
        params={},
        entries=[
            Entry(
                "run",
                "int64_t k, int64_t v, int64_t indptr, int64_t indices, int64_t batch, int64_t tokens, "
                "int64_t page_size, int64_t heads, int64_t row_bytes, int64_t stride_page, int64_t stride_token, "
                "int64_t stride_head, int64_t order, int64_t streams, int64_t prefetch, int64_t hint, "
                "int64_t num_threads",
                returns="int64_t",
            ),
            Entry("dot_peak", "int64_t iterations, int64_t num_threads", returns="int64_t"),
        ],
        tiers={"avx512": "avx512"},
        register=False,
    )
    return core.load_kernel(module, {}, "avx512")


def walker(run, c: PagedCache, threads: int, order: int = 0, streams: int = 1, prefetch: int = 1, hint: int = 0):
    base = c.cache.data_ptr()
    arguments = (base, base + c.v_offset, c.indptr.data_ptr(), c.indices.data_ptr(), c.batch, c.tokens, c.page)
    rest = (HEADS, c.row_bytes, c.stride_page, c.stride_token, c.stride_head, order, streams, prefetch, hint, threads)
    return lambda: run(*arguments, *rest)


def dot_peak_call(probe_kernel, threads: int, iterations: int = 400_000):
    """vdpbf16ps at its peak on every thread, and the bf16 KV bytes decode would read doing as many:
    group 4 and head dim 128 take 32 per token and KV head (16 for q.k, 16 for p.V) for 512 bytes."""
    dots = 16 * iterations * threads
    return (lambda: probe_kernel.dot_peak(iterations, threads)), dots // 32 * 512


def decode_call(c: PagedCache, g: torch.Generator):
    """kernforge's decode over the cache (bf16 q, 32 query heads; fp8 KV read as e4m3)."""
    workspace = torch.empty(128 << 20, dtype=torch.uint8)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace, c.layout)
    last = torch.full((c.batch,), c.page, dtype=torch.int32)
    kv_dtype = torch.bfloat16 if c.cache.dtype == torch.bfloat16 else torch.float8_e4m3fn
    wrapper.plan(
        c.indptr, c.indices, last, 4 * HEADS, HEADS, HEAD_DIM, c.page, q_data_type=torch.bfloat16, kv_data_type=kv_dtype
    )
    q = torch.randn(c.batch, 4 * HEADS, HEAD_DIM, generator=g).bfloat16()
    kv = c.cache.view(kv_dtype)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, kv, out=out)


def main() -> int:
    p = H.base_parser("load-only paged KV reads vs the weight-streaming rate")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--budget", type=float, default=1.5, help="seconds per variant, over --rounds rounds (1.5)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.quick:
        args.batch, args.tokens, args.budget, args.rounds = 4, 1024, 0.2, 2
    H.setup_threads(args.threads)
    if args.wait_quiet:
        H.wait_for_quiet(args.wait_quiet)
    g = torch.Generator().manual_seed(0)
    kernel = probe()
    run = kernel.run
    caches = {
        key: PagedCache(args.batch, args.tokens, page, layout, dtype, g, huge=key.endswith("_2m"))
        for key, (page, layout, dtype) in {
            "nhd16": (16, "NHD", torch.bfloat16),
            "nhd64": (64, "NHD", torch.bfloat16),
            "nhd256": (256, "NHD", torch.bfloat16),
            "hnd16": (16, "HND", torch.bfloat16),
            "hnd64": (64, "HND", torch.bfloat16),
            "hnd128": (128, "HND", torch.bfloat16),
            "hnd256": (256, "HND", torch.bfloat16),
            "nhd128": (128, "NHD", torch.bfloat16),
            "fp8": (16, "NHD", torch.uint8),
            "nhd16_2m": (16, "NHD", torch.bfloat16),  # in 2 MiB huge pages
            "hnd16_2m": (16, "HND", torch.bfloat16),
            "fp8_2m": (16, "NHD", torch.uint8),
        }.items()
    }
    base = caches["nhd16"]
    # 16 MB of KV, half the L3: decode's rate with no DRAM in the way
    hot = PagedCache(args.batch, 256, 16, "NHD", torch.bfloat16, g)
    hot_fp8 = PagedCache(args.batch, 512, 16, "NHD", torch.uint8, g)
    ordered = copy.copy(base)  # the same cache, each request's pages consecutive
    ordered.indices = torch.arange(base.indices.numel(), dtype=torch.int32)
    t = args.threads
    variants = {
        "baseline (NHD, page 16, head order, prefetch 1 block)": (walker(run, base, t), base.bytes),
        "no prefetch": (walker(run, base, t, prefetch=0), base.bytes),
        "prefetch 2 blocks ahead": (walker(run, base, t, prefetch=2), base.bytes),
        "prefetch 4 blocks ahead": (walker(run, base, t, prefetch=4), base.bytes),
        "prefetcht1 (L2) 1 block ahead": (walker(run, base, t, hint=1), base.bytes),
        "prefetcht1 (L2) 2 blocks ahead": (walker(run, base, t, prefetch=2, hint=1), base.bytes),
        "prefetcht1 (L2) 4 blocks ahead": (walker(run, base, t, prefetch=4, hint=1), base.bytes),
        "token order (all heads of a token)": (walker(run, base, t, order=1), base.bytes),
        "token order, no prefetch": (walker(run, base, t, order=1, prefetch=0), base.bytes),
        "token order, prefetcht1": (walker(run, base, t, order=1, hint=1), base.bytes),
        "2 requests per thread in turn": (walker(run, base, t, streams=2), base.bytes),
        "4 requests per thread in turn": (walker(run, base, t, streams=4), base.bytes),
        "token order, page 256": (walker(run, caches["nhd256"], t, order=1, prefetch=0), base.bytes),
        "token order, pages in order (not shuffled)": (walker(run, ordered, t, order=1, prefetch=0), base.bytes),
        "page 64": (walker(run, caches["nhd64"], t), base.bytes),
        "page 256": (walker(run, caches["nhd256"], t), base.bytes),
        "page 256, no prefetch": (walker(run, caches["nhd256"], t, prefetch=0), base.bytes),
        "HND, page 16": (walker(run, caches["hnd16"], t), base.bytes),
        "HND, page 16, no prefetch": (walker(run, caches["hnd16"], t, prefetch=0), base.bytes),
        "HND, page 16, prefetcht1": (walker(run, caches["hnd16"], t, hint=1), base.bytes),
        "HND, page 64": (walker(run, caches["hnd64"], t), base.bytes),
        "HND, page 128": (walker(run, caches["hnd128"], t), base.bytes),
        "HND, page 128, prefetcht1": (walker(run, caches["hnd128"], t, hint=1), base.bytes),
        "HND, page 128, prefetcht1 of each row's first line": (walker(run, caches["hnd128"], t, hint=2), base.bytes),
        "HND, page 256, prefetcht1": (walker(run, caches["hnd256"], t, hint=1), base.bytes),
        "fp8 rows (128 B), page 16": (walker(run, caches["fp8"], t), caches["fp8"].bytes),
        "fp8 rows (128 B), page 16, prefetcht1": (walker(run, caches["fp8"], t, hint=1), caches["fp8"].bytes),
        "2 MiB pages: prefetcht1 (L2) 1 block ahead": (walker(run, caches["nhd16_2m"], t, hint=1), base.bytes),
        "2 MiB pages: token order, prefetcht1": (walker(run, caches["nhd16_2m"], t, order=1, hint=1), base.bytes),
        "2 MiB pages: HND, page 16, prefetcht1": (walker(run, caches["hnd16_2m"], t, hint=1), base.bytes),
        "2 MiB pages: fp8 rows, prefetcht1": (walker(run, caches["fp8_2m"], t, hint=1), caches["fp8_2m"].bytes),
        "kernforge decode (bf16, group 4)": (decode_call(base, g), base.bytes),
        "kernforge decode, page 64": (decode_call(caches["nhd64"], g), base.bytes),
        "kernforge decode, page 256": (decode_call(caches["nhd256"], g), base.bytes),
        "kernforge decode, page 128": (decode_call(caches["nhd128"], g), base.bytes),
        "kernforge decode, HND": (decode_call(caches["hnd16"], g), base.bytes),
        "kernforge decode, HND, page 64": (decode_call(caches["hnd64"], g), base.bytes),
        "kernforge decode, HND, page 128": (decode_call(caches["hnd128"], g), base.bytes),
        "kernforge decode, HND, page 256": (decode_call(caches["hnd256"], g), base.bytes),
        "kernforge decode, fp8 KV": (decode_call(caches["fp8"], g), caches["fp8"].bytes),
        "kernforge decode, 2 MiB pages": (decode_call(caches["nhd16_2m"], g), base.bytes),
        "kernforge decode, HND, 2 MiB pages": (decode_call(caches["hnd16_2m"], g), base.bytes),
        "kernforge decode, fp8 KV, 2 MiB pages": (decode_call(caches["fp8_2m"], g), caches["fp8_2m"].bytes),
        "kernforge decode, KV in L3 (16 MB): its arithmetic's rate": (decode_call(hot, g), hot.bytes),
        "kernforge decode, fp8 KV in L3 (16 MB)": (decode_call(hot_fp8, g), hot_fp8.bytes),
    }
    big = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    references = {
        STREAM_NAME: H.weight_streaming_call(),
        "torch sum, 1 GiB fp32": (lambda: big.sum(), big.numel() * 4),
    }
    if H.machine_summary()["isa"]["avx512_bf16"]:
        references["vdpbf16ps peak, as decode's bf16 KV bytes (32 per token x KV head)"] = dot_peak_call(kernel, t)
    everything = {**references, **variants}
    H.print_header(
        "bench_paged_read: load-only paged KV reads (issue 22)",
        args,
        {"KV": f"batch {args.batch} x {args.tokens} tokens, {HEADS} KV heads x {HEAD_DIM}: {base.bytes / 1e6:.0f} MB"},
    )
    if base.bytes < H.COLD_SPAN:  # each variant walks its own cache once per call, again and again
        print(
            f"NOTE: the KV ({base.bytes / 1e6:.0f} MB) is smaller than 3x this CPU's L3 ({H.L3_SIZE // H.MiB} MiB): "
            "the walks partly read it from the L3. Raise --batch or --tokens for DRAM figures.\n"
        )
    with H.LoadMeter() as meter:
        times = H.compare(
            {name: fn for name, (fn, _) in everything.items()},
            budget_s=args.budget,
            rounds=args.rounds,
            min_samples=3,
            sample_ns=1e6,
        )
    stream = references[STREAM_NAME][1] / times[next(iter(references))].median_ns
    rows = []
    for name, (_, nbytes) in everything.items():
        gbs = nbytes / times[name].median_ns
        rows.append(
            [name, H.us(times[name]), H.fmt(gbs), f"{100 * gbs / stream:.0f}%", f"{100 * times[name].spread():.0f}%"]
        )
    print(H.table(["read", "µs", "GB/s", "of M=1 GEMM", "IQR"], rows, "lrrrr"))
    print(f"\nother processes used {100 * meter.other:.0f}% of the CPUs during the run")
    H.write_json(args.json, {name: times[name].to_json() for name in everything})
    return 0


if __name__ == "__main__":
    sys.exit(main())
