"""Fused MoE experts: kernforge vs transformers' expert loop vs vLLM's CPU fused MoE, one run.

Shapes (--model): qwen3-30b-a3b (128 experts, H 2048, I 768, k 8), olmoe (64 experts, H 2048,
I 1024, k 8) and deepseek-v3 (H 7168, I 2048, k 8 of 256 experts in 8 groups, top-4 groups; 32 of
its experts are held in memory, fp8 and bf16 copies together would not fit this machine: a call
reads the same bytes as V3's, 8 experts of 44 M weights, routed by biased_grouped_topk over the 32
in 8 groups); T tokens per call (--tokens: 1 and 8 are decode steps, 128 and 1024 prefill chunks);
bf16 activations, 2 threads. Routing is uniform at random (top-k of random scores, the k weights a
softmax), as a trained router spreads tokens.

Paths compared per case (round-robin in one run, _harness.compare)
    kf        kernforge.fused_experts on pack_experts() bf16 weights, out= preallocated
    kf alloc  the same, allocating its output
    kf int8   int8 w8a8 weights (pack_experts_int8: per-channel scales, activations quantized per
              token in the call), out= preallocated (--quant int8)
    kf fp8    e4m3 weights with 128 x 128 block scales (pack_experts_fp8), out= (--quant fp8)
    kf int4   four-bit weights (pack_experts_int4: groups of 128, asymmetric), W4A8: activations
              quantized per token in the call, out= (--quant int4)
    eager     transformers 5.24's expert loop (Qwen3MoeExperts.forward, what a MoE model runs in
              transformers by default): per expert hit, F.linear on the gathered rows, act * up,
              F.linear, times the weight, index_add_ (bf16 throughout)
    vllm      vLLM's CPU MoE kernel (torch.ops._C.cpu_fused_moe, what its CPU engine runs for an
              unquantized MoE layer) on its own prepacked weights (prepack_moe_weight), isa "amx"
              where the CPU has AMX tiles, else "vec". Only vLLM's kernel library is loaded: run
              under .venv-vllm (`make vllm`) or pass --vllm DIR, else the column is skipped.

Cold weights: each call routes by the next of 16 routings drawn up front, so consecutive calls read
other experts (a layer's expert weights are far larger than the L3), as a decode step reads each
layer's experts once; every path cycles through the same routings.

Figures
    GB/s      bytes of the distinct experts' weights a call reads (experts hit x 3 x H x I x bytes
              per weight: 2 bf16, 1 int8 and fp8, 0.5 + 5 / 128 int4: nibbles, fp32 scale and uint8
              zero point per group) / time; % stream: against kernforge's M=1 GEMM
              streaming a 256 MiB weight, measured at the start and the end of this run (the
              better of the two is the reference)
    GFLOP/s   2 x T x k x 3 x H x I / time; % peak: against this CPU's bf16 peak measured in the
              run (_harness.bf16_peak) or roof.json's
    x kf      the path's median time / kernforge's bf16 (out=) time: above 1, kernforge bf16 is faster
    cos       output cosine vs the eager loop on the same bf16 weights (the quantized paths: vs the
              loop on their dequantized weights)

Usage: python benchmarks/bench_moe.py [--quick] [--model qwen3-30b-a3b olmoe deepseek-v3]
       [--tokens 1 8 128 1024] [--quant int8 fp8 int4] [--vllm DIR] [--json out.json]
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernforge  # noqa: E402
from kernforge.ops.moe.experts import (  # noqa: E402
    CPUQuantMethod,
    pack_experts,
    pack_experts_fp8,
    pack_experts_int4,
    pack_experts_int8,
)

import _harness as H  # noqa: E402

MODELS = {  # experts (held in memory), hidden, intermediate, k
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "olmoe": (64, 2048, 1024, 8),
    "deepseek-v3": (32, 7168, 2048, 8),
    "tiny": (16, 256, 128, 4),  # --quick: every path on a few MiB (fp8 blocks and int4 groups still whole)
}
GROUPED = {"deepseek-v3": (8, 4)}  # groups, groups kept: biased_grouped_topk
FP8_BLOCK = (128, 128)
ROUTINGS = 16
COSINE_MIN = 0.999


def eager_experts(x, w1, w2, topk_weights, topk_ids):
    """transformers 5.24's Qwen3MoeExperts.forward, as written there."""
    out = torch.zeros_like(x)
    experts = w1.shape[0]
    with torch.no_grad():
        mask = F.one_hot(topk_ids.long(), num_classes=experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit:
        expert = expert[0]
        if expert == experts:
            continue
        slot, token = torch.where(mask[expert])
        gate, up = F.linear(x[token], w1[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def routings(model: str, tokens: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ROUTINGS random routings of ``tokens`` tokens: top-k of random scores (kernforge's routing
    ops, the model's rule), the k weights a softmax."""
    experts, _, _, k = MODELS[model]
    found = []
    for _ in range(ROUTINGS):
        logits = torch.randn(tokens, experts, generator=g)
        if model in GROUPED:
            groups, kept = GROUPED[model]
            _, ids = kernforge.biased_grouped_topk(logits, logits, torch.zeros(experts), k, True, groups, kept)
        else:
            _, ids = kernforge.topk_softmax(logits, logits, k, False)
        found.append((torch.rand(tokens, k, generator=g).softmax(-1), ids))
    return found


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8 of ``w [E, N, K]``: (q, scale [E, N], the dequantized bf16)."""
    scale = w.float().abs().amax(-1).clamp_min(1e-8) / 127
    q = torch.round(w.float() / scale[..., None]).to(torch.int8)
    return q, scale, (q.float() * scale[..., None]).bfloat16()


def fp8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3fn with 128 x 128 block scales of ``w [E, N, K]``: (q, scale [E, N/128, K/128], dequantized)."""
    experts, n, k = w.shape
    bn, bk = FP8_BLOCK
    blocks = w.float().reshape(experts, n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-8) / 448
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    dequantized = (q.float() * scale[:, :, None, :, None]).reshape(experts, n, k).bfloat16()
    return q.reshape(experts, n, k), scale, dequantized


def cycling(call: Callable[[torch.Tensor, torch.Tensor], object], routes) -> Callable[[], object]:
    nxt = itertools.cycle(routes).__next__
    return lambda: call(*nxt())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


class VllmMoe:
    """vLLM's cpu_fused_moe on one layer's weights, prepacked its way."""

    def __init__(self, ops, w1: torch.Tensor, w2: torch.Tensor):
        self.ops = ops
        self.isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"  # as vLLM's CPU MoE experts pick it
        self.w1, self.w2 = (self._prepacked(w) for w in (w1, w2))

    def _prepacked(self, w: torch.Tensor) -> torch.Tensor:
        packed = torch.empty_like(w)
        self.ops.prepack_moe_weight(w, packed, self.isa)
        return packed

    def __call__(self, x, topk_weights, topk_ids, out):
        self.ops.cpu_fused_moe(out, x, self.w1, self.w2, None, None, topk_weights, topk_ids, False, "silu", self.isa)
        return out


class Layer:
    """One MoE layer's weights as every path takes them, built once per model."""

    def __init__(self, model: str, quants: list[str], vllm_ops):
        experts, hidden, inter, _ = MODELS[model]
        g = torch.Generator().manual_seed(experts * hidden + inter)
        self.w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
        self.w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).bfloat16()
        self.packed = {"kf": (pack_experts(self.w1, gated=True), pack_experts(self.w2), {})}
        self.dequantized = {}  # path -> (w1, w2) its reference loop runs on
        for quant in quants:
            if quant == "int4":
                w1, w2 = pack_experts_int4(self.w1, self.w2)
                self.packed["kf int4"] = (w1, w2, {"moe_comp_method": CPUQuantMethod.INT4_W4A8})
                self.dequantized["kf int4"] = (w1.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16))
                continue
            make, pack, flag = QUANTS[quant]
            (q1, s1, d1), (q2, s2, d2) = make(self.w1), make(self.w2)
            self.packed[f"kf {quant}"] = (pack(q1, s1, gated=True), pack(q2, s2), {flag: True})
            self.dequantized[f"kf {quant}"] = (d1, d2)
        self.vllm = VllmMoe(vllm_ops, self.w1, self.w2) if vllm_ops is not None else None


QUANTS = {  # --quant: weights, packer, fused_experts' flag (int4: pack_experts_int4, in Layer)
    "int8": (int8_weights, pack_experts_int8, "use_int8_w8a8"),
    "fp8": (fp8_weights, lambda w, s, gated=False: pack_experts_fp8(w, s, FP8_BLOCK, gated), "use_fp8_w8a16"),
    "int4": None,
}
BYTES_PER_WEIGHT = {"kf int8": 1, "kf fp8": 1, "kf int4": 0.5 + 5 / 128}


def bench_case(model: str, tokens: int, layer: Layer, args) -> dict:
    experts, hidden, inter, k = MODELS[model]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    routes = routings(model, tokens, g)
    out = torch.empty_like(x)

    def kf(path, allocate=False):
        p1, p2, flags = layer.packed[path]
        return cycling(
            lambda w, ids: kernforge.fused_experts(x, p1, p2, w, ids, **flags, out=None if allocate else out), routes
        )

    fns = {"kf": kf("kf"), "kf alloc": kf("kf", allocate=True)}
    fns.update({path: kf(path) for path in layer.packed if path != "kf"})
    if not args.no_eager:
        fns["eager"] = cycling(lambda w, ids: eager_experts(x, layer.w1, layer.w2, w, ids), routes)
    vllm_out = torch.empty_like(x)
    if layer.vllm is not None:
        fns["vllm"] = cycling(lambda w, ids: layer.vllm(x, w, ids, vllm_out), routes)
    checks = {}
    for path, (p1, p2, flags) in layer.packed.items():
        reference = layer.dequantized.get(path, (layer.w1, layer.w2))
        want = eager_experts(x, *reference, *routes[0]).float()
        checks[path] = cosine(kernforge.fused_experts(x, p1, p2, *routes[0], **flags).float(), want)
    if layer.vllm is not None:
        checks["vllm"] = cosine(
            layer.vllm(x, *routes[0], vllm_out).float(), eager_experts(x, layer.w1, layer.w2, *routes[0]).float()
        )
    timings, other = H.timed(fns, args)
    hit = sum(len(torch.unique(ids)) for _, ids in routes) / len(routes)
    weights = hit * 3 * hidden * inter
    flops = 2 * tokens * k * 3 * hidden * inter
    base = timings["kf"].median_ns
    paths = {}
    for name, t in timings.items():
        nbytes = weights * BYTES_PER_WEIGHT.get(name, 2)
        paths[name] = {
            "us": t.us,
            "spread": t.spread(),
            "bytes": nbytes,
            "GB/s": nbytes / t.median_ns,
            "GFLOP/s": flops / t.median_ns,
            "x kf": t.median_ns / base,
        }
    return {
        "model": model,
        "tokens": tokens,
        "experts_hit": hit,
        "flops": flops,
        "background": other,
        "checks": checks,
        "paths": paths,
    }


def report(records: list[dict], limits: dict) -> None:
    stream, peak = limits["stream"], limits["peak"]
    rows = []
    for rec in records:
        for name, p in rec["paths"].items():
            rows.append(
                [
                    rec["model"],
                    rec["tokens"],
                    f"{rec['experts_hit']:.0f}",
                    name,
                    H.fmt(p["us"], 0),
                    H.fmt(p["GB/s"]),
                    H.fmt(100 * p["GB/s"] / stream, 0, "%"),
                    H.fmt(p["GFLOP/s"]),
                    H.fmt(100 * p["GFLOP/s"] / peak, 0, "%"),
                    H.fmt(p["x kf"], 2),
                    H.fmt(rec["checks"].get(name if name in rec["checks"] else name.split()[0]), 5)
                    if name != "eager"
                    else "",
                ]
            )
    print(
        H.table(
            ["model", "T", "experts", "path", "us", "GB/s", "% stream", "GFLOP/s", "% peak", "x kf", "cos"],
            rows,
            "lrrlrrrrrrr",
        )
    )


# Record impl names of the paths (the performance page keys on them): kernforge writing into out= and
# allocating are both in the table, so the out= one carries the suffix; quantized weights are cases of
# their own (dtype first in the case name); eager is transformers' loop in eager torch.
IMPLS = {"kf": "kernforge out=", "kf alloc": "kernforge", "eager": "torch", "vllm": "vllm"}
WEIGHT_DTYPES = {"kf int8": "int8", "kf fp8": "fp8", "kf int4": "int4"}


def emit_records(records: list[dict], limits: dict) -> None:
    """One record per path, case and metric of the table (us, GB/s, GFLOP/s, cos)."""
    for rec in records:
        experts, hidden, inter, k = MODELS[rec["model"]]
        for name, p in rec["paths"].items():
            dtype = WEIGHT_DTYPES.get(name, "bf16")
            case = f"{dtype} {rec['model']} T={rec['tokens']}"
            params = {
                "model": rec["model"],
                "num_experts": experts,
                "hidden": hidden,
                "intermediate": inter,
                "topk": k,
                "tokens": rec["tokens"],
                "weight_dtype": dtype,
                "experts_hit": rec["experts_hit"],
            }
            impl = IMPLS.get(name, "kernforge out=")
            H.emit(case, impl, "us", p["us"], "us", params=params)
            H.emit(case, impl, "gbs", p["GB/s"], "GB/s", params=params, bound=("streaming rate", limits["stream"]))
            H.emit(case, impl, "gflops", p["GFLOP/s"], "GFLOP/s", params=params, bound=("bf16 peak", limits["peak"]))
            check = rec["checks"].get(name if name in rec["checks"] else name.split()[0])
            if check is not None and name != "eager":
                H.emit(case, impl, "cos", check, "cosine", params=params)


def parse_args():
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", choices=sorted(MODELS), help="default qwen3-30b-a3b (quick: tiny)")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 128, 1024])
    p.add_argument("--quant", nargs="*", choices=sorted(QUANTS), default=["int8", "fp8", "int4"])
    p.add_argument("--no-eager", action="store_true", help="skip transformers' loop (slow at large T)")
    p.add_argument("--vllm", metavar="DIR", help="folder holding vllm/_C*.so (else the installed vllm)")
    p.add_argument("--budget", type=float, default=2.0, help="seconds per path and case")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-samples", type=int, default=5)
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--retry-wait", type=float, default=20.0)
    p.add_argument("--max-bg", type=float, default=0.15)
    args = p.parse_args()
    if args.quick:  # a smoke run: every path on a tiny layer, no re-measuring (no waiting for quiet)
        args.tokens, args.budget, args.rounds, args.min_samples, args.retries = [1, 128], 0.05, 1, 3, 0
    args.model = args.model or (["tiny"] if args.quick else ["qwen3-30b-a3b"])
    return args


def run_models(args, vllm) -> list[dict]:
    records = []
    for model in args.model:
        layer = Layer(model, args.quant, vllm[0] if isinstance(vllm, tuple) and model not in GROUPED else None)
        for tokens in args.tokens:
            records.append(bench_case(model, tokens, layer, args))
            print(f"  done {model} T={tokens}", file=sys.stderr, flush=True)
        del layer
    return records


def main() -> None:
    args = parse_args()
    H.setup_threads(args.threads)
    if args.wait_quiet:
        H.wait_for_quiet(args.wait_quiet)
    vllm = H.vllm_kernels(args.vllm, ("cpu_fused_moe", "prepack_moe_weight"))
    roof, roof_path = H.load_roof()
    peak, peak_source = H.bf16_peak_or_roof(args.threads, roof, roof_path)
    # --quick keeps the 256 MiB weight for the second rate (building it takes seconds; the tiny layer
    # leaves the room); a full run frees it, for the layers' gigabytes
    stream_call = H.weight_streaming_call() if args.quick else None
    stream_start = H.streaming_rate(budget_s=0.3 if args.quick else 1.0, call=stream_call)
    H.print_header(
        "Fused MoE experts: kernforge vs transformers' loop vs vLLM",
        args,
        {
            "vllm": f"{vllm[2]} ({vllm[1]})" if isinstance(vllm, tuple) else vllm,
            "bf16 peak": f"{peak:.0f} GFLOP/s ({peak_source})",
            "M=1 GEMM streaming rate at start": f"{stream_start:.1f} GB/s",
        },
    )
    records = run_models(args, vllm)
    stream_end = H.streaming_rate(budget_s=0.3 if args.quick else 1.0, call=stream_call)
    limits = {"stream": max(stream_start, stream_end), "peak": peak}
    print(f"M=1 GEMM streaming rate: {stream_start:.1f} GB/s at start, {stream_end:.1f} at end\n")
    report(records, limits)
    emit_records(records, limits)
    H.write_json(args.json, {"limits": limits, "records": records})


if __name__ == "__main__":
    main()
