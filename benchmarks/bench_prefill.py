"""Prefill attention (BatchPrefillWith{Ragged,Paged}KVCacheWrapper) vs torch SDPA vs a torch
block-wise path, bf16, 2 threads.

Cases (32 query heads, 8 KV heads, head_dim 128, causal):
    single L       one request of L = 1024, 4096, 8192 tokens (ragged K/V; planned once, run() timed);
    prefix batch   8 requests of 512 new tokens on 3584-token prefixes (paged, page size 16): each
                   query sees its prefix and the new tokens up to itself (bottom-right causal).
Columns
    kf / SDPA / blockwise   median ms per call (H.timed: round-robin samples). kernforge writes into a
                            preallocated out=; torch allocates.
    SDPA                    torch.nn.functional.scaled_dot_product_attention(is_causal=True,
                            enable_gqa=True) on [1, H, L, D]; for the prefix batch one call per request
                            with an explicit bottom-right mask (is_causal aligns top-left).
    blockwise               torch, 512 queries at a time: bf16 matmuls against the keys they can see,
                            the diagonal block masked, softmax in fp32 (what an engine does without a
                            fused kernel).
    GFLOP/s, % bf16 peak    4 * head_dim * heads * (visible query-key pairs, the causal triangle
                            counted once) / kernforge time, against roof.json's bf16 dot-product peak.
    tuned vs default        where `python -m kernforge tune prefill` recorded another tile for this
                            shape: default time / tuned time.

    .venv/bin/python benchmarks/bench_prefill.py [--quick] [--lengths 1024 4096] [--no-sdpa] [--json out.json]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernforge  # noqa: E402
from kernforge.ops.attention import prefill  # noqa: E402

import _harness as H  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LENGTHS, QUICK_LENGTHS = [1024, 4096, 8192], [256]
PREFIX_CASE = (8, 512, 3584)  # requests, new tokens each, prefix tokens each
QUICK_PREFIX_CASE = (2, 64, 192)  # --quick: the same paths on a few pages
PAGE_SIZE = 16
HEADERS = [
    "case",
    "kf ms",
    "SDPA ms",
    "blockwise ms",
    "vs SDPA",
    "vs blockwise",
    "GFLOP/s",
    "% bf16 peak",
    "tile",
    "tuned vs default",
    "bg",
]


def blockwise(q, k, v, prefix: int, block: int = 512):
    """Causal attention of q [L, H, D] over k/v [prefix + L, Hk, D], 512 queries at a time."""
    length, heads, head_dim = q.shape
    group = heads // k.shape[1]
    kk, vv = (t.transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))  # [H, S, D]
    out = torch.empty_like(q)
    for q0 in range(0, length, block):
        q1 = min(length, q0 + block)
        visible = prefix + q1
        logits = torch.matmul(q[q0:q1].transpose(0, 1), kk[:, :visible].transpose(1, 2)).float() / math.sqrt(head_dim)
        rows = torch.arange(q0, q1)[:, None] + prefix
        logits.masked_fill_(torch.arange(visible)[None, :] > rows, -math.inf)
        out[q0:q1] = torch.matmul(torch.softmax(logits, -1).to(q.dtype), vv[:, :visible]).transpose(0, 1)
    return out


def _tuned_and_default(group: int):
    params = prefill.prefill_variant_params(torch.bfloat16, torch.bfloat16, torch.bfloat16, HEAD_DIM, HEAD_DIM, group)
    shape = prefill.tile_shape(params, group)
    tier = prefill.PREFILL.built_tier(kernforge.jit.isa.selected_tier())
    return params["tile"], prefill.TILE_CANDIDATES.default(shape, tier).params["tile"]


def _ragged_wrapper(workspace, length, tile=None):
    wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    indptr = torch.tensor([0, length], dtype=torch.int32)
    wrapper.plan_with_tile(indptr, indptr, HEADS, KV_HEADS, HEAD_DIM, tile)
    return wrapper


def _row(case, t, flops, peak, tuned, bg):
    kf = t["kf"].median_ns
    gflops = flops / kf
    ms = lambda name: H.fmt(t[name].median_ns / 1e6, 1) if name in t else "n/a"  # noqa: E731
    ratio = lambda name: H.fmt(t[name].median_ns / kf, 2) if name in t else "n/a"  # noqa: E731
    return [
        case,
        ms("kf"),
        ms("SDPA"),
        ms("blockwise"),
        ratio("SDPA"),
        ratio("blockwise"),
        H.fmt(gflops, 0),
        f"{100 * gflops / peak:.0f}%",
        "x".join(map(str, tuned[0])),
        ratio("kf default") if "kf default" in t else "default",
        f"{100 * bg:.0f}%",
    ]


# Record impl names of the timed columns (the performance page keys on them).
IMPLS = {"kf": "kernforge", "SDPA": "torch", "blockwise": "torch blockwise", "kf default": "kernforge default tile"}


def emit_case(case: str, t: dict, flops: float, peak: float, params: dict) -> None:
    """One record per timed path: us and GFLOP/s (against the bf16 peak the table uses)."""
    params = {
        "num_qo_heads": HEADS,
        "num_kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "causal": True,
        "dtype": "bf16",
        **params,
    }
    for name, timing in t.items():
        H.emit(case, IMPLS[name], "us", timing.us, "us", params=params)
        H.emit(
            case, IMPLS[name], "gflops", flops / timing.median_ns, "GFLOP/s", params=params, bound=("bf16 peak", peak)
        )


def single_case(length, args, workspace, peak):
    g = torch.Generator().manual_seed(length)
    q = torch.randn(length, HEADS, HEAD_DIM, generator=g).bfloat16()
    k, v = (torch.randn(length, KV_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
    out = torch.empty_like(q)
    tuned = _tuned_and_default(HEADS // KV_HEADS)
    wrapper = _ragged_wrapper(workspace, length)
    fns = {"kf": lambda: wrapper.run(q, k, v, out=out)}
    if tuned[0] != tuned[1]:
        default_wrapper = _ragged_wrapper(workspace, length, tuned[1])
        fns["kf default"] = lambda: default_wrapper.run(q, k, v, out=out)
    if not args.no_sdpa:
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        fns["SDPA"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    fns["blockwise"] = lambda: blockwise(q, k, v, 0)
    t, bg = H.timed(fns, args)
    flops = 4 * HEAD_DIM * HEADS * length * (length + 1) / 2
    emit_case(f"single {length}", t, flops, peak, {"requests": 1, "qo_len": length, "prefix": 0, "layout": "ragged"})
    return _row(f"single {length}", t, flops, peak, tuned, bg), {
        "case": f"single {length}",
        "bg": bg,
        **{n: x.to_json() for n, x in t.items()},
    }


def prefix_case(args, workspace, peak, sizes=PREFIX_CASE):
    requests, new_tokens, prefix = sizes
    g = torch.Generator().manual_seed(1)
    kv_len = prefix + new_tokens
    pages_per = kv_len // PAGE_SIZE
    cache = torch.randn(requests * pages_per, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    q = torch.randn(requests * new_tokens, HEADS, HEAD_DIM, generator=g).bfloat16()
    out = torch.empty_like(q)
    qo_indptr = torch.arange(requests + 1, dtype=torch.int32) * new_tokens
    kv_indptr = torch.arange(requests + 1, dtype=torch.int32) * pages_per
    indices = torch.randperm(requests * pages_per, generator=g).to(torch.int32)
    last = torch.full((requests,), PAGE_SIZE, dtype=torch.int32)
    wrapper = kernforge.BatchPrefillWithPagedKVCacheWrapper(workspace)
    wrapper.plan(
        qo_indptr,
        kv_indptr,
        indices,
        last,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        PAGE_SIZE,
        causal=True,
        q_data_type=torch.bfloat16,
    )
    # torch sees each request's K/V gathered once (outside the timing), as a contiguous tensor.
    pages = indices.view(requests, pages_per).long()
    ks = [cache[pages[b], 0].reshape(kv_len, KV_HEADS, HEAD_DIM) for b in range(requests)]
    vs = [cache[pages[b], 1].reshape(kv_len, KV_HEADS, HEAD_DIM) for b in range(requests)]
    qs = [q[b * new_tokens : (b + 1) * new_tokens] for b in range(requests)]
    mask = torch.arange(kv_len)[None, :] <= torch.arange(new_tokens)[:, None] + prefix

    def sdpa():
        for b in range(requests):
            F.scaled_dot_product_attention(
                qs[b].transpose(0, 1)[None],
                ks[b].transpose(0, 1)[None],
                vs[b].transpose(0, 1)[None],
                attn_mask=mask,
                enable_gqa=True,
            )

    fns = {
        "kf": lambda: wrapper.run(q, cache, out=out),
        "blockwise": lambda: [blockwise(qs[b], ks[b], vs[b], prefix) for b in range(requests)],
    }
    if not args.no_sdpa:
        fns["SDPA"] = sdpa
    t, bg = H.timed(fns, args)
    pairs = requests * (new_tokens * prefix + new_tokens * (new_tokens + 1) / 2)
    case = f"prefix {requests}x{new_tokens}+{prefix}"
    tuned = _tuned_and_default(HEADS // KV_HEADS)
    case_params = {
        "requests": requests,
        "qo_len": new_tokens,
        "prefix": prefix,
        "layout": "paged",
        "page_size": PAGE_SIZE,
    }
    emit_case(case, t, 4 * HEAD_DIM * HEADS * pairs, peak, case_params)
    return _row(case, t, 4 * HEAD_DIM * HEADS * pairs, peak, tuned, bg), {
        "case": case,
        "bg": bg,
        **{n: x.to_json() for n, x in t.items()},
    }


def parse_args():
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--lengths", nargs="*", type=int, help="single-request lengths")
    p.add_argument("--no-sdpa", action="store_true", help="skip torch SDPA (slow at 8192)")
    p.add_argument(
        "--max-bg",
        type=float,
        default=0.10,
        help="re-measure a case if other processes used more than this share of the CPUs",
    )
    p.add_argument("--retries", type=int, default=1, help="re-measurements per noisy case (1)")
    p.add_argument("--retry-wait", type=float, default=60, help="seconds to wait for quiet before a retry")
    args = p.parse_args()
    args.budget, args.rounds, args.min_samples = (0.1, 1, 3) if args.quick else (2.0, 2, 3)
    if args.quick:
        args.retries = 0  # a smoke run: no waiting for a quiet machine
    return args


def main() -> int:
    args = parse_args()
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    H.setup_threads(args.threads)
    roof, roof_path = H.load_roof()
    H.wait_for_quiet(args.wait_quiet)
    peak = roof[str(args.threads)]["bf16_gflops"]
    info = H.print_header(
        "bench_prefill: prefill attention vs torch SDPA vs torch block-wise (bf16)",
        args,
        {
            "roof": f"{roof_path.name}: bf16 peak {peak:.0f} GFLOP/s",
            "shape": f"{HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, causal",
        },
    )
    workspace = torch.empty(64 << 20, dtype=torch.uint8)
    prefix_sizes = QUICK_PREFIX_CASE if args.quick else PREFIX_CASE
    cases = [single_case(n, args, workspace, peak) for n in lengths] + [
        prefix_case(args, workspace, peak, prefix_sizes)
    ]
    rows, records = [], []
    for row, record in cases:
        print(" | ".join(map(str, row)), file=sys.stderr, flush=True)
        rows.append(row)
        records.append(record)
    print(H.table(HEADERS, rows, "l" + "r" * (len(HEADERS) - 1)))
    H.write_json(args.json, {"info": info, "roof": roof, "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
