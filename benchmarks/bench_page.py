"""Paged KV cache: append_paged_kv_cache per call, against the torch scatter it replaces.

Cases append 64 tokens of 8 KV heads x 128 (bf16) to a page-16 cache: a decode step of 64
requests (one token each, each in its own page) and a 64-token prefill chunk of one request,
into a single-tensor NHD cache and into a (k, v) tuple. Columns: the whole op (argument
checks, cache unpack, index checks in C, the copy), the raw foreign call with the pointers
already extracted (the kernel alone), unpack_paged_kv_cache alone, and torch's equivalent
(page lookup, then index_put_ into the K and V views). The same slots are written every call,
so the written lines stay in cache: this measures the per-call cost, not DRAM write bandwidth.
Target (issue 8): 64 tokens <= 5 us per call.

    python benchmarks/bench_page.py [--quick] [--json PATH] [--threads N]
"""

from __future__ import annotations

import sys

import torch

import kernforge
from kernforge.ops.attention import page
from kernforge.ops.attention.page import unpack_paged_kv_cache

import _harness as H

HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 8, 128, 16, torch.bfloat16
CONTEXT = (500, 1500)  # tokens already in each request's pages, drawn uniformly


def _case(requests: int, tokens_per_request: int, as_tuple: bool) -> dict:
    """An append of requests x tokens_per_request tokens to requests of CONTEXT tokens. The lengths
    differ, as in a served batch, so the appended tokens land in different slots of their pages;
    equal lengths would put every request's slot at one offset of pages a power of two apart, all in
    the same few cache sets."""
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(*CONTEXT, (requests,), generator=g, dtype=torch.int32) + tokens_per_request
    pages_per_request = (seq_lens + PAGE_SIZE - 1) // PAGE_SIZE
    kv_indptr = torch.zeros(requests + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(pages_per_request, 0)
    num_pages = int(kv_indptr[-1])
    kv_indices = torch.randperm(num_pages, generator=g).to(torch.int32)  # scattered pages, as after churn
    kv_last_page_len = ((seq_lens - 1) % PAGE_SIZE + 1).to(torch.int32)
    append_indptr = torch.arange(requests + 1, dtype=torch.int32) * tokens_per_request
    nnz = requests * tokens_per_request
    batch_indices, positions = kernforge.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    cache = torch.zeros(num_pages, 2, PAGE_SIZE, HEADS, HEAD_DIM, dtype=DTYPE)
    if as_tuple:  # separate K and V buffers, as engines that keep them apart hand them over
        cache = (torch.zeros_like(cache[:, 0]), torch.zeros_like(cache[:, 1]))
    key = torch.randn(nnz, HEADS, HEAD_DIM, generator=g).to(DTYPE)
    value = torch.randn(nnz, HEADS, HEAD_DIM, generator=g).to(DTYPE)
    return dict(
        append_key=key,
        append_value=value,
        batch_indices=batch_indices,
        positions=positions,
        paged_kv_cache=cache,
        kv_indices=kv_indices,
        kv_indptr=kv_indptr,
        kv_last_page_len=kv_last_page_len,
    )


def _raw_call(a: dict):
    """The foreign call alone, its argument struct filled beforehand (the op minus its Python)."""
    cache = unpack_paged_kv_cache(a["paged_kv_cache"], "NHD")
    kernel = kernforge.append_paged_kv_cache.kernels.variant(DTYPE).kernel()
    key, value = a["append_key"], a["append_value"]
    fields = page._append_args(
        (key, key.stride(0), key.stride(1), len(key)),
        (value, value.stride(0), value.stride(1), len(value)),
        a["batch_indices"],
        a["positions"],
        ((cache.k_ptr, *cache.k_strides), (cache.v_ptr, *cache.v_strides)),
        a["kv_indices"],
        a["kv_indptr"],
        len(a["kv_indptr"]) - 1,
        page.CacheShape(cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim, cache.head_dim),
    )
    args = kernel.new("kf_append_args", fields)
    append = kernel.append
    return lambda: append(args)


def _torch_scatter(a: dict):
    """torch's way: page of each token from the page table, then index_put_ into K and V."""
    cache = a["paged_kv_cache"]
    k, v = cache if isinstance(cache, tuple) else cache.unbind(1)
    kv_indices, kv_indptr, batch_indices, positions = (
        a["kv_indices"],
        a["kv_indptr"],
        a["batch_indices"],
        a["positions"],
    )
    key, value = a["append_key"], a["append_value"]

    def scatter():
        pages = kv_indices[kv_indptr[batch_indices] + positions // PAGE_SIZE]
        slots = positions % PAGE_SIZE
        k.index_put_((pages, slots), key)
        v.index_put_((pages, slots), value)

    return scatter


CASES = {  # name: (requests, tokens per request, (k, v) tuple rather than one 5-D tensor)
    "decode: 64 requests x 1 token, 5-D cache": (64, 1, False),
    "decode: 64 requests x 1 token, (k, v) tuple": (64, 1, True),
    "prefill chunk: 1 request x 64 tokens, 5-D cache": (1, 64, False),
}
HEADERS = ["case", "op µs", "raw call µs", "unpack µs", "torch µs", "op vs torch", "raw GB/s (r+w)"]
# Record impl names of the timed columns (the performance page keys on them).
IMPLS = {"op": "kernforge", "raw": "kernforge raw call", "unpack": "kernforge unpack", "torch": "torch"}


def measure_case(shape: tuple[int, int, bool], budget: float) -> tuple[dict, int]:
    """Timings of the four columns on one case, and the bytes the append moves (K and V, read + write)."""
    a = _case(*shape)
    kernforge.append_paged_kv_cache(**a)  # compile and check once before timing
    fns = {
        "op": lambda: kernforge.append_paged_kv_cache(**a),
        "raw": _raw_call(a),
        "unpack": lambda: unpack_paged_kv_cache(a["paged_kv_cache"], "NHD"),
        "torch": _torch_scatter(a),
    }
    t = H.compare(fns, budget_s=budget, rounds=3, min_samples=9)
    return t, 2 * 2 * a["append_key"].numel() * a["append_key"].element_size()


def emit_case(name: str, shape: tuple[int, int, bool], t: dict, moved: int) -> None:
    requests, tokens_per_request, as_tuple = shape
    params = {
        "requests": requests,
        "tokens_per_request": tokens_per_request,
        "cache": "(k, v) tuple" if as_tuple else "5-D",
        "num_kv_heads": HEADS,
        "head_dim": HEAD_DIM,
        "page_size": PAGE_SIZE,
        "dtype": "bf16",
    }
    for column, impl in IMPLS.items():
        H.emit(name, impl, "us", t[column].us, "us", params=params)
    H.emit(name, IMPLS["raw"], "gbs", moved / t["raw"].median_ns, "GB/s", params=params)


def row(name: str, t: dict, moved: int) -> list:
    return [
        name,
        H.us(t["op"]),
        H.us(t["raw"]),
        H.us(t["unpack"]),
        H.us(t["torch"]),
        f"{t['torch'].us / t['op'].us:.1f}x",
        H.fmt(moved / t["raw"].median_ns),
    ]


def main() -> int:
    args = H.base_parser(__doc__.splitlines()[0]).parse_args()
    H.wait_for_quiet(args.wait_quiet)
    H.setup_threads(args.threads)
    info = H.print_header("append_paged_kv_cache: 64 tokens, 8 KV heads x 128, bf16, page 16", args)
    budget = 0.05 if args.quick else 0.6  # --quick: every case (each cache form), short budgets
    rows, results = [], {}
    for name, shape in CASES.items():
        t, moved = measure_case(shape, budget)
        emit_case(name, shape, t, moved)
        rows.append(row(name, t, moved))
        results[name] = {k: v.to_json() for k, v in t.items()}
    print(H.table(HEADERS, rows))
    H.write_json(args.json, {"machine": info, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
