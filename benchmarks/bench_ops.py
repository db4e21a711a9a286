"""kernforge ops vs torch eager vs torch.compile, same inputs, one run.

Norms (rmsnorm, gemma_rmsnorm, fused_add_rmsnorm, gemma_fused_add_rmsnorm) on
[T, 4096]; gated activations (silu/gelu/gelu_tanh _and_mul) on [T, 2*11008];
T in {1, 16, 256, 2048}; bf16 and fp32; 2 threads.

Modes
    alloc   every call allocates its output (kernforge without out=, torch
            as usual). Under glibc malloc a large fresh output is page-faulted
            again on every call, so this is the cost a caller without a
            buffer pool sees.
    out=    the output is preallocated (kernforge out=; torch eager with the
            out= variants where torch has them: for the activations
            torch._C._nn.silu/gelu(out=) then torch.mul(out=); rms_norm has no
            out= variant, so eager "out=" for the norms repeats the allocating
            figure, marked with "(a)". torch.compile always allocates, marked
            "(a)" in out= rows.)
    inplace fused_add_rmsnorm / gemma_fused_add_rmsnorm: kernforge writes
            input and residual in place (nothing allocated); the torch
            reference ``r.add_(x); rms_norm(r)`` allocates the normalized output.
    ... cold  rows for working sets that count as DRAM (>= the L3, 32 MiB here)
            but are < 3x the L3: called over the same buffers again and again
            they stay partly in the L3, so hot figures can beat the DRAM roof.
            Cold rows rotate over enough buffer sets (>= 3x the L3) that
            every call streams from DRAM; every implementation rotates alike.

Speedups are torch time / kernforge time (> 1: kernforge faster). GB/s counts
the bytes each op must move: norms read x (+ residual) and write the output
(+ residual) once, plus the weight once; activations read 2d and write d per
row. "% roof" compares kernforge's GB/s with the copy (``_rw``) bandwidth of
the level the working set (distinct bytes touched) falls in (L2 <= 1 MiB/core,
L3 < 32 MiB, else DRAM), from _harness.load_roof (measured in the run); "% now" with the same copy bandwidth
re-measured at the start of each pass of this run by a STREAM-like probe
(benchmarks/templates/bench_stream.cpp.jinja, built through kernforge's JIT;
falls back to a torch copy_).

Noise: this is a 2-vCPU VM whose cache and memory figures drift by up to
~1.5x between runs (as with an L3 and memory shared with other guests). So every case is
measured in ``--repeat`` passes (default 3) spread over the run, each cell is
the median over passes, and "kf spread" shows how far the passes disagreed.
A case during which other processes of this VM used > 10% of the CPUs is
measured again after waiting for quiet ("bg" column).

    .venv/bin/python benchmarks/bench_ops.py [--quick] [--repeat N] [--no-compile] [--json out.json]
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernforge  # noqa: E402

import _harness as H  # noqa: E402

HIDDEN = 4096
INTER = 11008
EPS = 1e-6
NORMS = ("rmsnorm", "gemma_rmsnorm", "fused_add_rmsnorm", "gemma_fused_add_rmsnorm")
ACTS = ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENS = (1, 16, 256, 2048)


# --------------------------------------------------------------------------- torch references


def t_rmsnorm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def t_rmsnorm_composite(x, w):
    """The plain composite, fp32 upcast (as Llama's HF RMSNorm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def t_gemma_rmsnorm(x, w):
    return F.rms_norm(x, (x.shape[-1],), 1.0 + w, EPS)


def t_fused_add_rmsnorm(x, r, w):
    r.add_(x)
    return F.rms_norm(r, (r.shape[-1],), w, EPS)


def t_gemma_fused_add_rmsnorm(x, r, w):
    r.add_(x)
    return F.rms_norm(r, (r.shape[-1],), 1.0 + w, EPS)


def t_silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def t_gelu_and_mul(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d]) * x[..., d:]


def t_gelu_tanh_and_mul(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


# eager with preallocated buffers (activation, then multiply, both out=)
def _act_out(act):
    def fn(x, tmp, out):
        d = x.shape[-1] // 2
        if act == "silu":
            torch._C._nn.silu(x[..., :d], out=tmp)
        elif act == "gelu":
            torch._C._nn.gelu(x[..., :d], out=tmp)
        else:
            torch._C._nn.gelu(x[..., :d], approximate="tanh", out=tmp)
        return torch.mul(tmp, x[..., d:], out=out)

    return fn


TORCH_REF = {
    "rmsnorm": t_rmsnorm,
    "gemma_rmsnorm": t_gemma_rmsnorm,
    "fused_add_rmsnorm": t_fused_add_rmsnorm,
    "gemma_fused_add_rmsnorm": t_gemma_fused_add_rmsnorm,
    "silu_and_mul": t_silu_and_mul,
    "gelu_and_mul": t_gelu_and_mul,
    "gelu_tanh_and_mul": t_gelu_tanh_and_mul,
}
ACT_NAME = {"silu_and_mul": "silu", "gelu_and_mul": "gelu", "gelu_tanh_and_mul": "gelu_tanh"}


def bytes_moved(op: str, T: int, esize: int) -> int:
    if op in ("rmsnorm", "gemma_rmsnorm"):
        return (2 * T * HIDDEN + HIDDEN) * esize
    if op in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm"):
        return (4 * T * HIDDEN + HIDDEN) * esize
    return 3 * T * INTER * esize


def footprint(op: str, T: int, esize: int) -> int:
    """Distinct bytes an op touches (picks the roof level; the in-place ops touch x and r twice)."""
    if op in NORMS:
        return (2 * T * HIDDEN + HIDDEN) * esize
    return 3 * T * INTER * esize


_compiled: dict = {}
_compile_seen: set = set()


def compiled(op: str):
    if op not in _compiled:
        _compiled[op] = torch.compile(TORCH_REF[op], dynamic=False)
    return _compiled[op]


def _close(a, b, dtype) -> bool:
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


# --------------------------------------------------------------------------- one case


def timed(fns, args):
    """H.compare under a LoadMeter; if other processes took > --max-bg of the CPUs meanwhile,
    wait for a quiet machine and measure again (up to --retries times). Returns (timings, load)."""
    for attempt in range(args.retries + 1):
        if attempt:
            H.wait_for_quiet(args.retry_wait)
        with H.LoadMeter() as m:
            t = H.compare(fns, budget_s=args.budget, rounds=args.rounds)
        if m.other <= args.max_bg:
            break
        print(
            f"  (other processes used {100 * m.other:.0f}% of the CPUs during this case: "
            f"{'measuring again' if attempt < args.retries else 'keeping it, flagged'})",
            file=sys.stderr,
            flush=True,
        )
    return t, m.other


class Rotation:
    """Cycles through ``n`` buffer sets, one per call (cold rows); n = 1: always the same set."""

    def __init__(self, sets):
        self.sets, self.i = sets, 0

    def next(self):
        s = self.sets[self.i]
        self.i = (self.i + 1) % len(self.sets)
        return s


def make_fns(op, dtype, sets, with_alloc, use_compile, compile_stats):
    """The implementations of one case over rotating buffer sets; returns (fns, modes).

    With one set the calls are bound with functools.partial (no per-call Python wrapper beyond
    what the op itself costs); with several, a small lambda picks the next set per call."""
    rot = Rotation(sets)
    kf_op, ref = getattr(kernforge, op), TORCH_REF[op]
    fns = {}

    def bind(f, *args, **kwargs):
        """f(*args, **kwargs), where str arguments name buffers of the current set."""
        pick = lambda s, a: s[a] if isinstance(a, str) else a  # noqa: E731
        if len(sets) == 1:
            s0 = sets[0]
            return functools.partial(f, *[pick(s0, a) for a in args], **{k: pick(s0, a) for k, a in kwargs.items()})

        def call():
            s = rot.next()
            return f(*[pick(s, a) for a in args], **{k: pick(s, a) for k, a in kwargs.items()})

        return call

    def compile_and_warm(*keys):
        c = compiled(op)
        inputs = [sets[0][k] for k in keys]
        t0 = time.perf_counter()
        c(*inputs)
        key = (op, dtype, tuple(inputs[0].shape))
        if key not in _compile_seen:  # the cold pass reuses the hot pass's graph
            _compile_seen.add(key)
            compile_stats.append(time.perf_counter() - t0)
        return bind(c, *keys)

    if op in ("rmsnorm", "gemma_rmsnorm"):
        if with_alloc:
            fns["kf_alloc"] = bind(kf_op, "x", "w", EPS)
        fns["kf_out"] = bind(kf_op, "x", "w", EPS, out="out")
        fns["eager"] = bind(ref, "x", "w")
        if op == "rmsnorm" and with_alloc:
            fns["composite"] = bind(t_rmsnorm_composite, "x", "w")
        if use_compile:
            fns["compile"] = compile_and_warm("x", "w")
        modes = [("alloc", "kf_alloc", "eager", False)] if with_alloc else []
        modes.append(("out=", "kf_out", "eager", True))
    elif op in NORMS:  # fused add, in place
        fns["kf_out"] = bind(kf_op, "xk", "rk", "w", EPS)
        fns["eager"] = bind(ref, "xe", "re", "w")
        if use_compile:
            fns["compile"] = compile_and_warm("xc", "rc", "w")
        modes = [("inplace", "kf_out", "eager", False)]
    else:
        if with_alloc:
            fns["kf_alloc"] = bind(kf_op, "x")
            fns["eager"] = bind(ref, "x")
        fns["kf_out"] = bind(kf_op, "x", out="out")
        fns["eager_out"] = bind(_act_out(ACT_NAME[op]), "x", "tmp", "out")
        if use_compile:
            fns["compile"] = compile_and_warm("x")
        modes = [("alloc", "kf_alloc", "eager", False)] if with_alloc else []
        modes.append(("out=", "kf_out", "eager_out", False))
    return fns, modes


def make_set(op, dtype, T, g):
    if op in NORMS:
        x = torch.randn(T, HIDDEN, generator=g).to(dtype)
        s = {"x": x, "w": (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype)}
        if "fused" in op:
            # The residual grows by x on every call; x itself is overwritten with normalized
            # values (|x| ~ 1), so magnitudes stay tame over the run. One copy per implementation.
            r = torch.randn(T, HIDDEN, generator=g).to(dtype)
            s.update(r=r, xk=x.clone(), rk=r.clone(), xe=x.clone(), re=r.clone(), xc=x.clone(), rc=r.clone())
        else:
            s["out"] = torch.empty_like(x)
        return s
    x = torch.randn(T, 2 * INTER, generator=g).to(dtype)
    return {"x": x, "out": torch.empty(T, INTER, dtype=dtype), "tmp": torch.empty(T, INTER, dtype=dtype)}


def check_case(op, dtype, s) -> str:
    """kernforge vs the torch reference on one set (copies for the in-place ops)."""
    kf_op, ref = getattr(kernforge, op), TORCH_REF[op]
    if "fused" in op:
        x1, r1, x2, r2 = s["x"].clone(), s["r"].clone(), s["x"].clone(), s["r"].clone()
        kf_op(x1, r1, s["w"], EPS)
        y = ref(x2, r2, s["w"])
        ok = _close(x1, y, dtype) and _close(r1, r2, dtype)
    elif op in NORMS:
        ok = _close(kf_op(s["x"], s["w"], EPS), ref(s["x"], s["w"]), dtype)
    else:
        want = ref(s["x"])
        ok = _close(kf_op(s["x"]), want, dtype) and _close(
            _act_out(ACT_NAME[op])(s["x"], s["tmp"], s["out"]), want, dtype
        )
    return "ok" if ok else "MISMATCH"


def bench_case(op, dname, T, args, now_bw, compile_stats):
    """Hot rows (the same buffers every call) and, where the working set is DRAM-sized but
    < 3x L3 (so it partly stays in the 32 MiB L3 between calls), cold rows that rotate over
    enough buffer sets to stream from DRAM."""
    dtype = DTYPES[dname]
    esize = torch.finfo(dtype).bits // 8
    g = torch.Generator().manual_seed(T * 7 + len(op))
    nbytes = bytes_moved(op, T, esize)
    fbytes = footprint(op, T, esize)
    level = H.roof_level(fbytes, args.threads)
    use_compile = not args.no_compile
    first = make_set(op, dtype, T, g)
    check = check_case(op, dtype, first)
    passes = [("", [first], True)]
    if level == "DRAM" and fbytes < H.COLD_SPAN and not args.no_cold:
        n_sets = -(-H.COLD_SPAN // fbytes)
        passes.append((" cold", [first] + [make_set(op, dtype, T, g) for _ in range(n_sets - 1)], False))
    record = []
    for suffix, sets, with_alloc in passes:
        fns, modes = make_fns(op, dtype, sets, with_alloc, use_compile, compile_stats)
        t, bg = timed(fns, args)
        for mode, kf_key, eager_key, eager_is_alloc in modes:
            cp = t.get("compile")
            comp = t.get("composite") if op == "rmsnorm" else None
            record.append(
                {
                    "op": op,
                    "dtype": dname,
                    "T": T,
                    "mode": mode + suffix,
                    "bytes": nbytes,
                    "level": level,
                    "footprint": fbytes,
                    "buffer_sets": len(sets),
                    "now_gbs": now_bw[level],
                    "kf": t[kf_key].to_json(),
                    "eager": t[eager_key].to_json(),
                    "eager_marked_alloc": eager_is_alloc,
                    "compile": cp.to_json() if cp else None,
                    "composite": comp.to_json() if comp else None,
                    "check": check,
                    "background_load": bg,
                }
            )
    return record


HEADERS = [
    "op",
    "dtype",
    "T",
    "mode",
    "kf µs",
    "eager µs",
    "compile µs",
    "eager/kf",
    "compile/kf",
    "kf GB/s",
    "% roof",
    "% now",
    "composite µs",
    "kf spread",
    "bg",
    "check",
]


def summarize(reps: list[dict], roof: dict, args) -> dict:
    """One JSON record from the repeats of one case: medians over repeats of each repeat's median;
    'kf spread' = (max - min) / median of kernforge over repeats (one repeat: its samples'
    interquartile range / median)."""
    med = statistics.median
    r0 = reps[0]

    def ns(key):
        vals = [r[key]["median_ns"] for r in reps if r[key]]
        return med(vals) if vals else None

    kf, eg, cp, comp = ns("kf"), ns("eager"), ns("compile"), ns("composite")
    kfs = [r["kf"]["median_ns"] for r in reps]
    spread = (
        (max(kfs) - min(kfs)) / kf
        if len(reps) > 1
        else (r0["kf"]["p75_ns"] - r0["kf"]["p25_ns"]) / r0["kf"]["median_ns"]
    )
    gbs = r0["bytes"] / kf
    level = r0["level"]
    roof_bw = H.roof_gbs(roof, level, "rw", args.threads)
    now = med(r["now_gbs"] for r in reps)
    return {
        "op": r0["op"],
        "dtype": r0["dtype"],
        "T": r0["T"],
        "mode": r0["mode"],
        "bytes": r0["bytes"],
        "footprint": r0["footprint"],
        "level": level,
        "buffer_sets": r0["buffer_sets"],
        "kf_us": kf / 1e3,
        "eager_us": eg / 1e3,
        "compile_us": cp / 1e3 if cp else None,
        "composite_us": comp / 1e3 if comp else None,
        "kf_us_repeats": [v / 1e3 for v in kfs],
        "speedup_eager": eg / kf,
        "speedup_compile": cp / kf if cp else None,
        "kf_gbs": gbs,
        "roof_gbs": roof_bw,
        "pct_roof": 100 * gbs / roof_bw,
        "now_gbs": now,
        "pct_now": 100 * gbs / now,
        "kf_spread": spread,
        "background_load_max": max(r["background_load"] for r in reps),
        "check": "ok" if {r["check"] for r in reps} == {"ok"} else "MISMATCH",
        "eager_marked_alloc": r0["eager_marked_alloc"],
        "repeats": reps,
    }


def table_row(s: dict, args) -> list:
    """The table's row of one case's summary."""
    us = lambda v: H.us(H.Timing(1e3 * v, 0, 0, 1, 1)) if v is not None else "n/a"  # noqa: E731
    bg = s["background_load_max"]
    return [
        s["op"],
        s["dtype"],
        s["T"],
        s["mode"],
        us(s["kf_us"]),
        us(s["eager_us"]) + (" (a)" if s["eager_marked_alloc"] else ""),
        (us(s["compile_us"]) + (" (a)" if s["mode"].startswith("out=") else "")) if s["compile_us"] else "n/a",
        H.fmt(s["speedup_eager"], 2),
        H.fmt(s["speedup_compile"], 2) if s["compile_us"] else "n/a",
        H.fmt(s["kf_gbs"], 1),
        f"{s['pct_roof']:.0f}% {s['level']}",
        f"{s['pct_now']:.0f}%",
        us(s["composite_us"]) if s["composite_us"] else "",
        f"{100 * s['kf_spread']:.0f}%",
        f"{100 * bg:.0f}%" + (" !" if bg > args.max_bg else ""),
        s["check"],
    ]


def emit_records(s: dict) -> None:
    """The records of one table row: µs per implementation, kernforge's GB/s against the copy
    bandwidth measured now ("% now")."""
    hidden = HIDDEN if s["op"] in NORMS else 2 * INTER  # the input's last dim
    case = f"{s['op']} {s['dtype']} [{s['T']}, {hidden}] {s['mode']}"
    params = {"op": s["op"], "dtype": s["dtype"], "tokens": s["T"], "hidden": hidden, "mode": s["mode"]}
    params.update(level=s["level"], buffer_sets=s["buffer_sets"], check=s["check"])
    impls = {"kernforge": "kf_us", "torch": "eager_us", "torch.compile": "compile_us"}
    for impl, key in {**impls, "torch composite": "composite_us"}.items():
        if s[key] is not None:
            H.emit(case, impl, "us", s[key], "us", params=params)
    H.emit(case, "kernforge", "gbs", s["kf_gbs"], "GB/s", params=params, bound=("copy bandwidth", s["now_gbs"]))


def parse_args():
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (--quick skips it unless --compile)")
    p.add_argument("--compile", action="store_true", help="with --quick: time torch.compile too")
    p.add_argument("--no-cold", action="store_true", help="skip the cold (rotating buffers) rows")
    p.add_argument("--ops", nargs="*", help=f"only these ops (--quick: {' '.join(QUICK_OPS)})")
    p.add_argument("--tokens", nargs="*", type=int, help="only these T (--quick: 1 2048)")
    p.add_argument("--dtypes", nargs="*", choices=list(DTYPES), help="only these dtypes (--quick: bf16)")
    p.add_argument(
        "--max-bg",
        type=float,
        default=0.10,
        help="re-measure a case if other processes used more than this share of the CPUs (0.10)",
    )
    p.add_argument("--retries", type=int, help="re-measurements per noisy case (3; --quick 0)")
    p.add_argument("--retry-wait", type=float, default=120, help="seconds to wait for quiet before a retry")
    p.add_argument(
        "--repeat", type=int, help="passes over all cases; cells are medians over passes (default 3, quick 1)"
    )
    args = p.parse_args()
    args.budget = 0.06 if args.quick else 0.3
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.rounds = 2 if args.quick else 3
    args.retries = args.retries if args.retries is not None else (0 if args.quick else 3)
    args.no_compile = args.no_compile or (args.quick and not args.compile)
    args.tokens = args.tokens or ((1, 2048) if args.quick else TOKENS)
    args.dtypes = args.dtypes or (["bf16"] if args.quick else list(DTYPES))
    args.ops = args.ops or (list(QUICK_OPS) if args.quick else [*NORMS, *ACTS])
    return args


# --quick: one op of each kind (norm, fused add in place, gated activation)
QUICK_OPS = ("rmsnorm", "fused_add_rmsnorm", "silu_and_mul")


def now_bandwidth(args) -> tuple[dict | None, dict]:
    """(the stream probe's figures or None, the copy bandwidth per level that "% now" uses)."""
    stream = H.stream_bandwidth(args.threads, budget_s=0.1 if args.quick else 0.3)
    if stream:
        return stream, {lv: stream[lv]["rw"] for lv in stream}
    return None, H.copy_bandwidth(budget_s=0.15 if args.quick else 0.3)


def header(args, roof, roof_path, stream, copy_bw, bg) -> dict:
    return H.print_header(
        "bench_ops: kernforge vs torch eager vs torch.compile",
        args,
        {
            "roof": f"{roof_path} ({args.threads} threads: "
            + ", ".join(f"{lv} copy {H.roof_gbs(roof, lv, 'rw', args.threads):.0f}" for lv in ("L2", "L3", "DRAM"))
            + " GB/s)",
            "roof measured now, stream probe (GB/s; copy, copy with NT stores, read-only)": ", ".join(
                f"{lv} " + "/".join(f"{v[k]:.0f}" for k in ("copy", "copy_nt", "r") if k in v)
                for lv, v in stream.items()
            )
            if stream
            else "unavailable",
            "torch copy_ measured now (GB/s, read+write)": ", ".join(f"{k} {v:.0f}" for k, v in copy_bw.items()),
            "background CPU load before start (other processes)": f"{100 * bg:.0f}% of all cores",
            "timing": f"median of samples, round-robin over implementations, {args.rounds} rounds, "
            f"{args.budget:.2f} s per implementation and case and pass; {args.repeat} passes over all "
            "cases, cells are the median over passes",
        },
    )


def run_passes(args, now_bw) -> tuple[dict, list, list]:
    """Every case, --repeat passes; returns (the per-pass records by case, compile seconds, the
    copy bandwidth "% now" used in each pass)."""
    records, compile_stats, now_all = {}, [], [now_bw]
    for rep in range(args.repeat):
        if rep:  # re-measure the roof for this pass too
            now_bw = now_bandwidth(args)[1]
            now_all.append(now_bw)
        for op in args.ops:
            for dname in args.dtypes:
                for T in args.tokens:
                    for r in bench_case(op, dname, T, args, now_bw, compile_stats):
                        records.setdefault((r["op"], r["dtype"], r["T"], r["mode"]), []).append(r)
                        print(
                            f"  [{rep + 1}/{args.repeat}] {r['op']} {r['dtype']} {r['T']} {r['mode']}: kf "
                            f"{r['kf']['median_ns'] / 1e3:.1f} µs, eager {r['eager']['median_ns'] / 1e3:.1f} µs"
                            + (f", compile {r['compile']['median_ns'] / 1e3:.1f} µs" if r["compile"] else ""),
                            file=sys.stderr,
                            flush=True,
                        )
    return records, compile_stats, now_all


def print_notes(args, now_what: str) -> None:
    print()
    print("µs: median per call. eager/kf, compile/kf: speedup of kernforge (> 1 = kernforge faster).")
    print("(a): that implementation allocates its output (no out= form), same figure as the alloc row.")
    print("% roof: kernforge GB/s against the roof's copy bandwidth for the level named (2 threads);")
    print(
        f"% now: against {now_what} bandwidth of that level, measured at the start of each pass of this run "
        "(median over passes; DRAM: the better of regular and non-temporal stores, as the roof)."
    )
    print("composite µs: torch eager x.float() * rsqrt(mean(x²) + eps) * w.float(), back to dtype (allocating).")
    print(
        f"Cells: median over {args.repeat} passes (each pass: the median of many samples); kf spread: "
        "(max - min) / median of kernforge's per-pass figures (one pass: its samples' IQR / median)."
    )
    print(
        f"bg: CPU share other processes used while the case was timed; '!' = above {100 * args.max_bg:.0f}% "
        f"after {args.retries} re-measurements (figure suspect)."
    )


def print_run_notes(compile_stats, stream, stream_end, now_all, copy_bw, copy_end, elapsed, bg_end) -> None:
    if compile_stats:
        print(
            f"torch.compile: {len(compile_stats)} graphs, first call (compile) median "
            f"{sorted(compile_stats)[len(compile_stats) // 2]:.1f} s, max {max(compile_stats):.1f} s."
        )
    if stream and stream_end:
        print(
            "stream probe copy GB/s at start / end of the run: "
            + ", ".join(
                f"{k} " + " / ".join(f"{nb[k]:.0f}" for nb in now_all) + f" / {stream_end[k]['rw']:.0f}" for k in stream
            )
            + " (one figure per pass, then the end; % now uses the median of the per-pass figures)"
        )
    print(
        "torch copy_ GB/s at start / end of the run: "
        + ", ".join(f"{k} {copy_bw[k]:.0f} / {copy_end[k]:.0f}" for k in copy_bw)
    )
    print(
        f"benchmark time {elapsed:.0f} s; background CPU load at end {100 * bg_end:.0f}% of all cores; "
        f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}"
    )


def main() -> int:
    args = parse_args()
    H.setup_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # one graph per (op, dtype, T): dynamic=False
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    warnings.filterwarnings("ignore")

    roof, roof_path = H.load_roof()
    bg = H.wait_for_quiet(args.wait_quiet)
    copy_bw = H.copy_bandwidth(budget_s=0.15 if args.quick else 0.5)
    stream = H.stream_bandwidth(args.threads, budget_s=0.1 if args.quick else 0.3)
    now_bw = {lv: stream[lv]["rw"] for lv in stream} if stream else copy_bw
    now_what = "the in-run stream probe's copy" if stream else "the in-run torch copy_"
    info = header(args, roof, roof_path, stream, copy_bw, bg)
    kernforge.prewarm({"kernels": [{"op": op, "dtype": list(args.dtypes)} for op in args.ops]}, progress=False)

    t_start = time.perf_counter()
    records, compile_stats, now_all = run_passes(args, now_bw)
    elapsed = time.perf_counter() - t_start
    bg_end = H.background_load(0.3 if args.quick else 1.0)
    copy_end = H.copy_bandwidth(budget_s=0.15 if args.quick else 0.5)
    stream_end = H.stream_bandwidth(args.threads, budget_s=0.1 if args.quick else 0.3)

    summaries = [summarize(reps, roof, args) for reps in records.values()]
    for s in summaries:
        emit_records(s)
    print(H.table(HEADERS, [table_row(s, args) for s in summaries], "llrl" + "r" * (len(HEADERS) - 5) + "l"))
    print_notes(args, now_what)
    print_run_notes(compile_stats, stream, stream_end, now_all, copy_bw, copy_end, elapsed, bg_end)
    mism = [r for r in summaries if r["check"] != "ok"]
    if mism:
        print(f"WARNING: {len(mism)} rows where kernforge and torch disagree beyond tolerance")
    H.write_json(
        args.json,
        {
            "info": info,
            "roof": roof,
            "roof_path": str(roof_path),
            "copy_gbs": copy_bw,
            "copy_gbs_end": copy_end,
            "stream_gbs": stream,
            "stream_gbs_end": stream_end,
            "stream_gbs_per_pass": now_all,
            "background_load": [bg, bg_end],
            "rows": [{k: v for k, v in s.items() if k != "eager_marked_alloc"} for s in summaries],
            "compile_seconds": compile_stats,
            "repeat": args.repeat,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
