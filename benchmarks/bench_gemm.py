"""Prepacked bf16 linear (weight_packed_linear) vs torch F.linear vs torch.compile, 2 threads.

Shapes are Llama-3-8B and Llama-3.2-1B projections, K x N (the weight is [N, K]): 4096x4096,
4096x28672 (gate+up as one), 14336x4096, 2048x2048, 2048x16384; M = 1, 16, 128, 1024 rows of x.
kernforge packs each weight once (outside the timing) and writes into a preallocated out=;
torch F.linear and the compiled linear allocate their output, as callers use them.

Columns
    kf / F.linear / compile   median us per call (H.timed: round-robin samples; a case is measured
                              again while other processes used > --max-bg of the CPUs).
    vs F.linear               F.linear time / kernforge time (> 1: kernforge faster).
    weight GB/s, % DRAM r     weight bytes (N * K * 2) / kernforge time: at small M a linear is a
                              weight read, compared with the DRAM read bandwidth measured in this
                              run (the STREAM-like probe's read-only sum, else roof.json's DRAM_r).
                              Each call reads another copy of the weight (copies rotate over
                              >= 256 MiB, 8x the L3 here; 4x a larger L3), so no weight is served
                              from the cache.
    GFLOP/s, % bf16 peak      2 * M * N * K / kernforge time, against the bf16 peak for the thread
                              count (the figure for large M), measured in the run
                              (_harness.bf16_peak: the AMX tile unit's on the amx tier, the
                              AVX512-BF16 dot product's on avx512), else roof.json's.
    int8 x, fp8 x             kernforge bf16 time / the time of the same weights quantized: int8 w8a8
                              (int8_scaled_mm_with_quant: the activation is quantized inside the call,
                              per-channel weight scales) and fp8 block-scaled (fp8_scaled_mm, e4m3 with
                              128 x 128 block scales); > 1: the quantized GEMM is faster.
    int4 x, w4a16 x           the same for four-bit weights (quantize_int4, groups of 128, asymmetric):
                              W4A8 (int4_scaled_mm_cpu) and W4A16 (int4_w4a16_linear).
    int4/int8 t               W4A8 time / int8 time on the same weights (issue 38: <= 0.55 at M = 1).
    int4 %, w4a16 %           against this run's limits: at M <= 16, the bytes they read (nibbles, fp32
                              scales, uint8 zeros) per second / kernforge bf16's weight GB/s on the same
                              rotating weights (the streaming rate; issue 38: >= 85 %); at M >= 128,
                              their G(FL)OP/s / the int8 (VNNI or AMX) peak for W4A8 (>= 75 %) and the
                              bf16 peak for W4A16 (>= 70 %), both measured at the start of the run.
    tuned vs default          where `python -m kernforge tune gemm` recorded a configuration (tile,
                              blocking, thread split) for the case's bucket that differs from the
                              default: default time / tuned time.

torch.compile compiles ``F.linear(x, w)`` with mode="max-autotune-no-cudagraphs" (Inductor's C++
GEMM template among its choices) where that works, else the default mode; the header says which.
The weight is an argument of the compiled function (rotating copies, as for the others), so
Inductor cannot constant-fold a prepacked weight as it would with freezing on a module.

    .venv/bin/python benchmarks/bench_gemm.py [--quick] [--no-compile] [--json out.json]
"""

from __future__ import annotations

import itertools
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernforge  # noqa: E402
import kernforge.nn  # noqa: E402,F401  (quantize_weight_fp8_block)
from kernforge.jit import tuning  # noqa: E402
from kernforge.ops.gemm import bf16  # noqa: E402

import _harness as H  # noqa: E402

SHAPES = [(4096, 4096), (4096, 28672), (14336, 4096), (2048, 2048), (2048, 16384)]  # K x N
ROWS = [1, 16, 128, 1024]
# --quick: every column on one small shape, at the full run's M (both sides of the M <= 16 split), over a
# few copies (a smoke run: the weights are cached, the figures mean nothing).
QUICK_SHAPES, QUICK_ROWS = [(512, 1024)], [1, 16, 128, 1024]
ROTATE_BYTES = H.DRAM_SPAN  # 8x the L3 here: no weight copy survives in the cache until its next turn
QUICK_ROTATE_BYTES = 4 * H.MiB
MAX_WEIGHT_BYTES = 2 << 30  # skip bigger weights (this VM has little memory to spare)

HEADERS = [
    "K x N",
    "M",
    "kf us",
    "F.linear us",
    "compile us",
    "vs F.linear",
    "vs compile",
    "weight GB/s",
    "% DRAM r",
    "GFLOP/s",
    "% bf16 peak",
    "int8 x",
    "fp8 x",
    "int4 x",
    "w4a16 x",
    "int4/int8 t",
    "int4 %",
    "w4a16 %",
    "tuned vs default",
    "bg",
]


def _compiled_linear(args) -> tuple[object | None, str]:
    if args.no_compile:
        return None, "skipped (--no-compile)"
    fn = lambda x, w: F.linear(x, w)  # noqa: E731
    # One graph per (shape, M), static shapes: keep them all rather than fall back to eager at the limit.
    limits = torch._dynamo.config
    limits.recompile_limit = limits.accumulated_recompile_limit = 256  # (older torch: cache_size_limit)
    x, w = torch.randn(16, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    # --quick: no autotuning (it times every GEMM template per shape, tens of seconds on a fresh cache)
    modes = ("default",) if args.quick else ("max-autotune-no-cudagraphs", "default")
    for mode in modes:
        try:
            compiled = torch.compile(fn, mode=mode, dynamic=False)
            compiled(x, w)
            return compiled, mode
        except Exception as exc:  # noqa: BLE001 (report and fall back)
            warnings.warn(f"torch.compile mode={mode} failed: {exc}", stacklevel=2)
    return None, "unavailable"


def _quantized(weights, n, k):
    """int8 w8a8 (per-channel scales), fp8 block-scaled (128 x 128) and int4 (groups of 128) packings of
    the same weights."""
    int8, fp8, int4 = [], [], []
    for w in weights:
        scale = w.float().abs().amax(1).clamp(min=1e-8) / 127
        int8.append(kernforge.convert_weight_packed_int8((w.float() / scale[:, None]).round().to(torch.int8), scale))
        q, block_scale = kernforge.nn.quantize_weight_fp8_block(w)
        fp8.append((kernforge.convert_weight_packed_fp8(q, block_scale), block_scale))
        int4.append(kernforge.quantize_int4(w, group_size=128))
    return int8, fp8, int4


def _int4_bytes(packed) -> int:
    return sum(t.numel() * t.element_size() for t in packed)


@dataclass
class Limits:
    """This run's machine limits the table's shares are taken against."""

    dram_r: float  # DRAM read GB/s
    peak: float  # bf16 GFLOP/s
    int8_peak: float | None  # int8 GOP/s, where a probe measured it


@dataclass
class Weights:
    """Rotating copies of one [N, K] weight in every packing the table times."""

    plain: list
    packed: list
    int8: list
    fp8: list
    int4: list

    @classmethod
    def make(cls, k: int, n: int, rotate_bytes: int, quantized: bool, generator) -> Weights:
        copies = max(1, -(-rotate_bytes // (n * k * 2)))
        plain = [torch.randn(n, k, generator=generator).bfloat16() for _ in range(copies)]
        packed = [kernforge.convert_weight_packed(w) for w in plain]
        int8, fp8, int4 = _quantized(plain, n, k) if quantized else ([], [], [])
        return cls(plain, packed, int8, fp8, int4)


def _fns(x, out, w: Weights, compiled, default_config: dict | None) -> dict:
    """The timed calls of one M; each call takes the next copy of the weight. ``default_config``: the
    default configuration where the tuner chose another (timed as "kf default")."""
    turn = itertools.cycle(range(len(w.plain)))
    fns = {
        "kf": lambda: kernforge.weight_packed_linear(x, w.packed[next(turn)], out=out),
        "F.linear": lambda: F.linear(x, w.plain[next(turn)]),
    }
    if compiled is not None:
        fns["compile"] = lambda: compiled(x, w.plain[next(turn)])
    if w.int8:
        fns["int8"] = lambda: kernforge.int8_scaled_mm_with_quant(x, w.int8[next(turn)], out_dtype=torch.bfloat16)
        fns["fp8"] = lambda: kernforge.fp8_scaled_mm(x, *w.fp8[next(turn)], out_dtype=torch.bfloat16)
        fns["int4"] = lambda: kernforge.int4_scaled_mm_cpu(x, w.int4[next(turn)])
        fns["w4a16"] = lambda: kernforge.int4_w4a16_linear(x, w.int4[next(turn)])
    if default_config is not None:
        fns["kf default"] = lambda: bf16.linear_with_config(x, w.packed[next(turn)], default_config, out=out)
    return fns


def _tuning(m: int, n: int, k: int) -> tuple[dict, dict, object]:
    """The configuration the tuner chose for this shape, the default one, and the tuning record (if any)."""
    shape = bf16.tile_shape(torch.bfloat16, m, n, k)
    tier = bf16.GEMM.built_tier(kernforge.jit.isa.selected_tier())
    recorded = tuning.TuningStore().lookup(bf16.TILE_CANDIDATES.kernel, bf16.TILE_CANDIDATES.bucket(shape), tier)
    tuned = dict(bf16.TILE_CANDIDATES.choose(shape, tier=tier).params)
    default = dict(bf16.TILE_CANDIDATES.default(shape, tier).params)
    return tuned, default, recorded


def _row(k, n, m, t, bg, int4_bytes, limits: Limits, tuned, recorded) -> list:
    kf = t["kf"].median_ns
    gbs, gflops = n * k * 2 / kf, 2 * m * n * k / kf
    other = lambda name: H.us(t.get(name)) if name in t else "n/a"  # noqa: E731
    ratio = lambda name: H.fmt(t[name].median_ns / kf, 2) if name in t else "n/a"  # noqa: E731
    speedup = lambda name: H.fmt(kf / t[name].median_ns, 2) if name in t else "n/a"  # noqa: E731

    def limit_share(name: str, ops_peak: float | None) -> str:
        """Bytes/s against bf16's streaming at small M, G(FL)OP/s against ops_peak at large M."""
        if name not in t or (m > 16 and not ops_peak):
            return "n/a"
        ns = t[name].median_ns
        share = int4_bytes / ns / gbs if m <= 16 else 2 * m * n * k / ns / ops_peak
        return f"{100 * share:.0f}%"

    return [
        f"{k}x{n}",
        m,
        H.us(t["kf"]),
        other("F.linear"),
        other("compile"),
        ratio("F.linear"),
        ratio("compile"),
        H.fmt(gbs),
        f"{100 * gbs / limits.dram_r:.0f}%",
        H.fmt(gflops, 0),
        f"{100 * gflops / limits.peak:.0f}%",
        speedup("int8"),
        speedup("fp8"),
        speedup("int4"),
        speedup("w4a16"),
        H.fmt(t["int4"].median_ns / t["int8"].median_ns, 2) if "int4" in t else "n/a",
        limit_share("int4", limits.int8_peak),
        limit_share("w4a16", limits.peak),
        (
            f"{ratio('kf default')} ({bf16.config_name(tuned)})"
            if "kf default" in t
            else "default won"
            if recorded
            else "no record"
        ),
        f"{100 * bg:.0f}%",
    ]


# Per timed column: (the case's dtype, record impl name, activation dtype, the peak its G(FL)OP/s is
# held to). W4A8 and W4A16 share the int4 weights: one case, the W4A16 kernel a kernforge variant.
COLUMNS = {
    "kf": ("bf16", "kernforge", "bf16", "bf16"),
    "F.linear": ("bf16", "torch", "bf16", "bf16"),
    "compile": ("bf16", "torch.compile", "bf16", "bf16"),
    "kf default": ("bf16", "kernforge default config", "bf16", "bf16"),
    "int8": ("int8", "kernforge", "int8", "int8"),
    "fp8": ("fp8", "kernforge", "bf16", "bf16"),
    "int4": ("int4", "kernforge", "int8", "int8"),
    "w4a16": ("int4", "kernforge w4a16", "bf16", "bf16"),
}


def _emit(k, n, m, t, int4_bytes, limits: Limits) -> None:
    """Records of one (shape, M): us and G(FL)OP/s per column; GB/s where the table has them (kernforge
    bf16's weight read; int4's bytes at M <= 16, against bf16's streaming of the same weights)."""
    kf_gbs = n * k * 2 / t["kf"].median_ns
    peaks = {"bf16": ("bf16 peak", limits.peak), "int8": ("int8 peak", limits.int8_peak)}
    for column, timing in t.items():
        dtype, impl, activation, peak = COLUMNS[column]
        case, params = f"{dtype} M={m} K={k} N={n}", {"dtype": dtype, "M": m, "K": k, "N": n, "activation": activation}
        H.emit(case, impl, "us", timing.us, "us", params=params)
        bound = peaks[peak] if peaks[peak][1] else None
        H.emit(case, impl, "gflops", 2 * m * n * k / timing.median_ns, "GFLOP/s", params=params, bound=bound)
        if column == "kf":
            H.emit(case, impl, "gbs", kf_gbs, "GB/s", params=params, bound=("DRAM read", limits.dram_r))
        elif column in ("int4", "w4a16") and m <= 16:
            gbs = int4_bytes / timing.median_ns
            H.emit(case, impl, "gbs", gbs, "GB/s", params=params, bound=("streaming rate", kf_gbs))


def _case(k, n, rows, args, compiled, limits: Limits):
    generator = torch.Generator().manual_seed(0)
    w = Weights.make(k, n, args.rotate_bytes, not args.no_quant, generator)
    int4_bytes = _int4_bytes(w.int4[0]) if w.int4 else 0
    for m in rows:
        x = torch.randn(m, k, generator=generator).bfloat16()
        out = torch.empty(m, n, dtype=torch.bfloat16)
        tuned, default, recorded = _tuning(m, n, k)
        # --quick times the compiled linear at the first M only: each M is a graph of its own to compile
        compiled_here = None if args.quick and m != rows[0] else compiled
        fns = _fns(x, out, w, compiled_here, default if tuned != default else None)
        t, bg = H.timed(fns, args)
        row = _row(k, n, m, t, bg, int4_bytes, limits, tuned, recorded)
        _emit(k, n, m, t, int4_bytes, limits)
        print(" | ".join(map(str, row)), file=sys.stderr, flush=True)
        record = {
            "k": k,
            "n": n,
            "m": m,
            "config": tuned,
            "default_config": default,
            "bg": bg,
            **{name: timing.to_json() for name, timing in t.items()},
        }
        yield row, record


def parse_args():
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--no-quant", action="store_true", help="skip the int8, fp8 and int4 columns")
    p.add_argument("--m", nargs="*", type=int, help="only these M")
    p.add_argument("--shapes", nargs="*", help="only these KxN")
    p.add_argument(
        "--max-bg",
        type=float,
        default=0.10,
        help="re-measure a case if other processes used more than this share of the CPUs",
    )
    p.add_argument("--retries", type=int, default=2, help="re-measurements per noisy case (2)")
    p.add_argument("--retry-wait", type=float, default=60, help="seconds to wait for quiet before a retry")
    args = p.parse_args()
    args.budget, args.rounds, args.min_samples = (0.05, 1, 3) if args.quick else (0.5, 3, 5)
    if args.quick:
        args.retries = 0  # a smoke run: no waiting for a quiet machine
    args.rotate_bytes = QUICK_ROTATE_BYTES if args.quick else ROTATE_BYTES
    return args


def measure_limits(args, roof: dict, roof_path) -> tuple[Limits, dict]:
    """This run's DRAM read rate, bf16 and int8 peaks, and the header lines that say where they came from."""
    # --quick takes the roof's DRAM read figure (measured in this run) rather than probing again
    stream = None if args.quick else H.stream_bandwidth(args.threads, budget_s=0.3)
    threads_roof = roof[str(args.threads)]
    dram_r = stream["DRAM"]["r"] if stream else threads_roof["DRAM_r"]
    dram_source = "stream probe" if stream else f"{roof_path.name}{', --quick' if args.quick else ', no probe'}"
    peak, peak_source = H.bf16_peak_or_roof(args.threads, roof, roof_path)
    measured_int8 = H.dot_peak("int8", args.threads)
    int8_peak = measured_int8[0] if measured_int8 else None
    header = {
        "roof": f"{roof_path.name}: bf16 peak {threads_roof['bf16_gflops']:.0f} GFLOP/s, DRAM read "
        f"{threads_roof['DRAM_r']:.1f} GB/s",
        "% bf16 peak against": f"{peak:.0f} GFLOP/s ({peak_source})",
        "int4 % against": f"{int8_peak:.0f} GOP/s ({measured_int8[1]}, measured now)"
        if measured_int8
        else "no int8 dot-product probe on this tier",
        "DRAM read now": f"{dram_r:.1f} GB/s ({dram_source})",
    }
    return Limits(dram_r, peak, int8_peak), header


def main() -> int:
    args = parse_args()
    shapes = (
        [tuple(map(int, s.lower().split("x"))) for s in args.shapes]
        if args.shapes
        else (QUICK_SHAPES if args.quick else SHAPES)
    )
    rows = args.m or (QUICK_ROWS if args.quick else ROWS)

    H.setup_threads(args.threads)
    roof, roof_path = H.load_roof()
    H.wait_for_quiet(args.wait_quiet)
    limits, header = measure_limits(args, roof, roof_path)
    compiled, compile_mode = _compiled_linear(args)
    info = H.print_header(
        "bench_gemm: weight_packed_linear vs F.linear vs torch.compile (bf16)",
        args,
        {**header, "torch.compile": compile_mode},
    )
    all_rows, records = [], []
    for k, n in shapes:
        if n * k * 2 > MAX_WEIGHT_BYTES:
            print(f"skipping {k}x{n}: weights over {MAX_WEIGHT_BYTES >> 30} GiB", file=sys.stderr)
            continue
        for row, record in _case(k, n, rows, args, compiled, limits):
            all_rows.append(row)
            records.append(record)
    print(H.table(HEADERS, all_rows, "lr" + "r" * (len(HEADERS) - 2)))
    H.write_json(
        args.json,
        {"info": info, "roof": roof, "dram_r_now": limits.dram_r, "compile_mode": compile_mode, "results": records},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
