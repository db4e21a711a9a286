"""MLA decode attention (DeepSeek's absorbed form): kernforge's BatchMLAPagedAttentionWrapper vs
the unabsorbed path, one run.

Shapes (--shape): v3 (DeepSeek-V3/R1: 128 heads) and v2-lite (16 heads), both a 512-wide latent
and a 64-wide rope part per token; a batch of --batch requests of --kv tokens each (one query
token per request), pages of 64 tokens in a shuffled page table, 2 threads.

Paths compared per case (round-robin in one run, _harness.compare)
    kf          BatchMLAPagedAttentionWrapper.run on a bf16 latent cache (ckv and kpe adjacent views
                of one [pages, 64, 576] buffer, as SGLang and vLLM hold it), out= preallocated
    kf alloc    the same, allocating its output
    kf fp8      the same on an e4m3 latent cache (widened to bf16 in the kernel), out=
    unabsorbed  what a model without the absorption runs (v2-lite only: the expanded cache of v3
                would take 4 GiB): the latent expanded to per-head keys and values by kv_b_proj
                (kernforge's weight_packed_linear, [tokens, 512] x [512, H x 256]), then kernforge's
                decode attention (head dim 192 / 128 split as q.k over [k_nope | k_pe], padded to
                192 + 64 -> the ragged prefill kernel, qk 192 / vo 128), per call
Figures
    GFLOP/s   2 x batch x H x kv x (576 + 512) / time (q.k over 576, p.V over 512); % peak: against
              this CPU's bf16 dot peak measured in the run (_harness.bf16_peak)
    GB/s      the latent bytes read (batch x kv x 576 x bytes per element) / time; % stream: against
              kernforge's M=1 GEMM streaming a 256 MiB weight, measured at the start of this run
    x kf      the path's median time / kernforge's (out=): above 1, kernforge bf16 is faster
    err       max |out - float64 reference| on the first request (expanded per head)

Usage: python benchmarks/bench_mla.py [--quick] [--shape v3 v2-lite] [--batch 16] [--kv 4096]
       [--json out.json]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernforge  # noqa: E402

import _harness as H  # noqa: E402

SHAPES = {"v3": 128, "v2-lite": 16}  # query heads
CKV, KPE, NOPE, V_HEAD = 512, 64, 128, 128
PAGE = 64
SM_SCALE = 1.0 / math.sqrt(NOPE + KPE)


class Case:
    """One batch: the page table, the latent caches (bf16 and fp8) and the absorbed queries."""

    def __init__(self, heads: int, batch: int, kv: int):
        g = torch.Generator().manual_seed(heads * kv + batch)
        self.heads, self.batch, self.kv = heads, batch, kv
        pages = -(-kv // PAGE)
        self.qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
        self.kv_indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
        self.kv_indices = torch.randperm(batch * pages, generator=g).to(torch.int32)
        self.kv_len = torch.full((batch,), kv, dtype=torch.int32)
        latent = torch.randn(batch * pages, PAGE, CKV + KPE, generator=g) * 0.5
        self.caches = {"bf16": latent.bfloat16(), "fp8": latent.to(torch.float8_e4m3fn)}
        self.q = torch.randn(batch, heads, CKV + KPE, generator=g).bfloat16()
        self.out = torch.empty(batch, heads, CKV, dtype=torch.bfloat16)
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8)

    def wrapper(self, kind: str):
        w = kernforge.BatchMLAPagedAttentionWrapper(self.workspace)
        dtype = self.caches[kind].dtype
        w.plan(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_len, self.heads, CKV, KPE, PAGE, False,
               SM_SCALE, torch.bfloat16, dtype)  # fmt: skip
        buffer = self.caches[kind]
        return lambda out=self.out: w.run(
            self.q[..., :CKV], self.q[..., CKV:], buffer[..., :CKV], buffer[..., CKV:], out=out
        )

    def reference_first(self, kind: str) -> torch.Tensor:
        pages = self.kv_indices[: int(self.kv_indptr[1])].long()
        rows = self.caches[kind][pages].reshape(-1, CKV + KPE)[: self.kv].double()
        logits = self.q[0].double() @ rows.T * SM_SCALE
        return torch.softmax(logits, -1) @ rows[:, :CKV]


class Unabsorbed:
    """The latent expanded per head by kv_b_proj every call, then ragged attention (qk 192, vo 128)."""

    def __init__(self, case: Case):
        g = torch.Generator().manual_seed(7)
        heads = case.heads
        self.case = case
        w = torch.randn(heads * (NOPE + V_HEAD), CKV, generator=g).bfloat16() / CKV**0.5
        self.kv_b = kernforge.convert_weight_packed(w)
        tokens = case.batch * case.kv
        # Each request's latent rows in order (as a non-paged implementation would hold them).
        order = case.kv_indices.long()
        self.latent = case.caches["bf16"][order].reshape(tokens, CKV + KPE)[:, :CKV].contiguous()
        self.k_pe = case.caches["bf16"][order].reshape(tokens, CKV + KPE)[:, CKV:].contiguous()
        self.q = torch.randn(case.batch, heads, NOPE + KPE, generator=g).bfloat16()
        self.k = torch.empty(tokens, heads, NOPE + KPE, dtype=torch.bfloat16)
        self.expanded = torch.empty(tokens, heads * (NOPE + V_HEAD), dtype=torch.bfloat16)
        self.wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(case.workspace)
        self.wrapper.plan(case.qo_indptr, torch.arange(0, tokens + 1, case.kv, dtype=torch.int32), heads, heads,
                          NOPE + KPE, head_dim_vo=V_HEAD, q_data_type=torch.bfloat16, sm_scale=SM_SCALE)  # fmt: skip

    def __call__(self):
        heads = self.case.heads
        kernforge.weight_packed_linear(self.latent, self.kv_b, out=self.expanded)
        kv = self.expanded.view(-1, heads, NOPE + V_HEAD)
        self.k[..., :NOPE].copy_(kv[..., :NOPE])
        self.k[..., NOPE:].copy_(self.k_pe[:, None, :].expand(-1, heads, -1))
        return self.wrapper.run(self.q, self.k, kv[..., NOPE:])


def bench_case(shape: str, args) -> dict:
    case = Case(SHAPES[shape], args.batch, args.kv)
    fns = {"kf": case.wrapper("bf16"), "kf fp8": case.wrapper("fp8")}
    alloc = case.wrapper("bf16")
    fns["kf alloc"] = lambda: alloc(out=None)
    errors = {}
    for name, kind in (("kf", "bf16"), ("kf fp8", "fp8")):
        out = fns[name]().clone()
        errors[name] = (out[0].double() - case.reference_first(kind)).abs().max().item()
    if shape == "v2-lite" and not args.no_unabsorbed:
        fns["unabsorbed"] = Unabsorbed(case)
    timings, other = H.timed(fns, args)
    flops = 2 * case.batch * case.heads * case.kv * (CKV + KPE + CKV)
    base = timings["kf"].median_ns
    paths = {}
    for name, t in timings.items():
        nbytes = case.batch * case.kv * (CKV + KPE) * (1 if name == "kf fp8" else 2)
        paths[name] = {
            "us": t.us,
            "spread": t.spread(),
            "GFLOP/s": flops / t.median_ns,
            "GB/s": nbytes / t.median_ns,
            "x kf": t.median_ns / base,
        }
    return {"shape": shape, "heads": case.heads, "background": other, "errors": errors, "paths": paths}


def report(records: list[dict], limits: dict) -> None:
    rows = []
    for rec in records:
        for name, p in rec["paths"].items():
            rows.append(
                [
                    rec["shape"],
                    rec["heads"],
                    name,
                    H.fmt(p["us"], 0),
                    H.fmt(p["GFLOP/s"]),
                    H.fmt(100 * p["GFLOP/s"] / limits["peak"], 0, "%"),
                    H.fmt(p["GB/s"]),
                    H.fmt(100 * p["GB/s"] / limits["stream"], 0, "%"),
                    H.fmt(p["x kf"], 2),
                    f"{rec['errors'][name]:.1e}" if name in rec["errors"] else "",
                ]
            )
    print(
        H.table(
            ["shape", "H", "path", "us", "GFLOP/s", "% peak", "GB/s", "% stream", "x kf", "err"], rows, "lrlrrrrrrr"
        )
    )


# Record impl names of the paths (the performance page keys on them): kernforge writing into out= and
# allocating are both in the table, so the out= one carries the suffix; fp8 is a case of its own.
IMPLS = {
    "kf": "kernforge out=",
    "kf alloc": "kernforge",
    "kf fp8": "kernforge out=",
    "unabsorbed": "kernforge unabsorbed",
}


def emit_records(records: list[dict], limits: dict, args) -> None:
    """One record per path, case and metric of the table (us, GFLOP/s, GB/s, err)."""
    for rec in records:
        for name, p in rec["paths"].items():
            kv_dtype = "fp8" if name == "kf fp8" else "bf16"
            case = f"{kv_dtype} {rec['shape']} batch={args.batch} kv={args.kv}"
            params = {
                "model": rec["shape"],
                "num_heads": rec["heads"],
                "kv_lora_rank": CKV,
                "qk_rope_head_dim": KPE,
                "batch": args.batch,
                "kv_len": args.kv,
                "page_size": PAGE,
                "kv_dtype": kv_dtype,
            }
            impl = IMPLS[name]
            H.emit(case, impl, "us", p["us"], "us", params=params)
            H.emit(case, impl, "gflops", p["GFLOP/s"], "GFLOP/s", params=params, bound=("bf16 peak", limits["peak"]))
            H.emit(case, impl, "gbs", p["GB/s"], "GB/s", params=params, bound=("streaming rate", limits["stream"]))
            if name in rec["errors"]:
                H.emit(case, impl, "err", rec["errors"][name], "max abs", params=params)


def parse_args():
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["v3", "v2-lite"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kv", type=int, default=4096)
    p.add_argument("--no-unabsorbed", action="store_true")
    p.add_argument("--budget", type=float, default=2.0, help="seconds per path and case")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-samples", type=int, default=5)
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--retry-wait", type=float, default=20.0)
    p.add_argument("--max-bg", type=float, default=0.15)
    args = p.parse_args()
    if args.quick:  # a smoke run: small batches, no re-measuring (no waiting for a quiet machine)
        args.batch, args.kv, args.budget, args.rounds, args.min_samples, args.retries = 2, 256, 0.05, 1, 3, 0
    return args


def main() -> None:
    args = parse_args()
    H.setup_threads(args.threads)
    if args.wait_quiet:
        H.wait_for_quiet(args.wait_quiet)
    roof, roof_path = H.load_roof()
    peak, peak_source = H.bf16_peak_or_roof(args.threads, roof, roof_path)
    stream = H.streaming_rate(budget_s=0.3 if args.quick else 1.0)
    H.print_header(
        "MLA decode: kernforge vs the unabsorbed path",
        args,
        {"bf16 peak": f"{peak:.0f} GFLOP/s ({peak_source})", "streaming rate": f"{stream:.1f} GB/s"},
    )
    records = [bench_case(shape, args) for shape in args.shape]
    limits = {"peak": peak, "stream": stream}
    report(records, limits)
    emit_records(records, limits, args)
    H.write_json(args.json, {"limits": limits, "records": records})


if __name__ == "__main__":
    main()
