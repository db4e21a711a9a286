"""Alternating torch ops and kernforge ops: one OpenMP pool, no slowdown.

kernforge kernels are built with -fopenmp and link libgomp.so.1 by soname;
torch's wheel ships (and has already loaded) a libgomp.so.1, so the dynamic
loader binds the kernels to that same library: one thread pool, no two sets
of spinning workers fighting over the 2 cores. Evidence printed:

* the distinct libgomp files mapped in /proc/self/maps (expect 1);
* the process's OS thread count after torch's pool is up, and again after
  kernforge's parallel kernels have run (expect no change);
* timings, per scenario: (a) N torch ops alone, (b) N kernforge ops alone,
  (c) the two alternating N times each. Ratio (c) / ((a) + (b)) is ~1.0 when
  switching between them costs nothing; > 1 means handoff, oversubscription
  or cache eviction. Control: the same ratio with the kernforge op replaced by
  torch's own copy_ of the same buffers (torch's pool only, same bytes), so
  the cache part can be told apart. Median over several trials.

    .venv/bin/python benchmarks/investigations/bench_threads.py [--quick] [--json out.json]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _harness and the routines
import torch  # noqa: E402

import kernforge  # noqa: E402

import _harness as H  # noqa: E402


def gomp_files() -> list[str]:
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "gomp" in os.path.basename(parts[-1]):
                paths.add(parts[-1])
    return sorted(paths)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def scenarios(quick: bool):
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    s = []
    # 1: a matmul (oneDNN/MKL, OpenMP) and a norm on the same activations
    a = torch.randn(256, 4096, generator=g).to(bf)
    b = torch.randn(4096, 4096, generator=g).to(bf)
    c = torch.empty(256, 4096, dtype=bf)
    x1, w1, o1 = (
        torch.randn(256, 4096, generator=g).to(bf),
        torch.ones(4096, dtype=bf),
        torch.empty(256, 4096, dtype=bf),
    )
    s.append(
        (
            "torch.mm [256,4096]x[4096,4096] bf16 out= / kf.rmsnorm [256,4096] bf16 out=",
            lambda: torch.mm(a, b, out=c),
            lambda: kernforge.rmsnorm(x1, w1, out=o1),
            lambda: o1.copy_(x1),
            6 if quick else 20,
        )
    )
    # 2: DRAM-sized elementwise torch op, DRAM-sized norm
    p = torch.randn(4 << 20, generator=g)
    q = torch.randn(4 << 20, generator=g)
    r = torch.empty(4 << 20)
    x2, o2 = torch.randn(2048, 4096, generator=g).to(bf), torch.empty(2048, 4096, dtype=bf)
    s.append(
        (
            "torch.add 4M fp32 out= / kf.rmsnorm [2048,4096] bf16 out=",
            lambda: torch.add(p, q, out=r),
            lambda: kernforge.rmsnorm(x2, w1, out=o2),
            lambda: o2.copy_(x2),
            20 if quick else 100,
        )
    )
    # 3: short ops (tens of µs), both multi-threaded: the case where a pool handoff would show
    u = torch.randn(256 << 10, generator=g)
    v = torch.randn(256 << 10, generator=g)
    y = torch.empty(256 << 10)
    x3, o3 = torch.randn(16, 4096, generator=g).to(bf), torch.empty(16, 4096, dtype=bf)
    s.append(
        (
            "torch.add 256K fp32 out= / kf.rmsnorm [16,4096] bf16 out=",
            lambda: torch.add(u, v, out=y),
            lambda: kernforge.rmsnorm(x3, w1, out=o3),
            lambda: o3.copy_(x3),
            300 if quick else 2000,
        )
    )
    return s


def run_loop(fn_a, fn_b, n, which):
    if which == "a":
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn_a()
    elif which == "b":
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn_b()
    else:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn_a()
            fn_b()
    return time.perf_counter_ns() - t0


def main() -> int:
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, help="trials per scenario (default 9, quick 3)")
    args = p.parse_args()
    trials = args.trials or (3 if args.quick else 9)
    H.setup_threads(args.threads)
    bg = H.wait_for_quiet(args.wait_quiet)
    info = H.print_header(
        "bench_threads: torch and kernforge ops alternating",
        args,
        {
            "background CPU load before start (other processes)": f"{100 * bg:.0f}% of all cores",
            "OMP_WAIT_POLICY / GOMP_SPINCOUNT": f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')} / "
            f"{os.environ.get('GOMP_SPINCOUNT', '(unset)')}",
        },
    )

    sc = scenarios(args.quick)
    # bring torch's pool up first, then kernforge's kernels
    for _, fa, _, fc, _ in sc:
        for _ in range(3):
            fa()
            fc()
    threads_torch, gomp_torch = os_threads(), gomp_files()
    for _, _, fb, _, _ in sc:
        for _ in range(3):
            fb()
    threads_both, gomp_both = os_threads(), gomp_files()

    print("## one OpenMP runtime\n")
    print(f"- libgomp files mapped after torch ops: {len(gomp_torch)} {gomp_torch}")
    print(f"- libgomp files mapped after kernforge ops too: {len(gomp_both)} {gomp_both}")
    print(f"- OS threads in this process: {threads_torch} after torch ops, {threads_both} after kernforge ops")
    kso = sorted(
        {
            line.split()[-1]
            for line in open("/proc/self/maps")
            if line.rstrip().endswith("kernel.so") and "/norm_" in line
        }
    )
    if kso:
        import subprocess

        try:
            dyn = subprocess.run(["readelf", "-d", kso[0]], capture_output=True, text=True).stdout
            needed = [line.split("[")[-1].rstrip("]") for line in dyn.splitlines() if "NEEDED" in line]
        except OSError:
            needed = ["(readelf not available)"]
        print(
            f"- the rmsnorm kernel.so NEEDS {needed}: libgomp by soname, which the loader satisfies with "
            "the libgomp.so.1 torch already loaded"
        )
    print()

    results = []
    rows = []
    for name, fa, fb, fc, n in sc:
        times = {"a": [], "b": [], "c": [], "b_ctrl": [], "c_ctrl": []}
        with H.LoadMeter() as meter:
            for trial in range(trials):
                order = ("a", "b", "c") if trial % 2 == 0 else ("c", "b", "a")
                for which in order:
                    times[which].append(run_loop(fa, fb, n, which))
                times["b_ctrl"].append(run_loop(fa, fc, n, "b"))
                times["c_ctrl"].append(run_loop(fa, fc, n, "c"))
        ratios = [c / (a + b) for a, b, c in zip(times["a"], times["b"], times["c"])]
        ctrl = [c / (a + b) for a, b, c in zip(times["a"], times["b_ctrl"], times["c_ctrl"])]
        med = {k: statistics.median(v) / n / 1e3 for k, v in times.items()}
        ratio, ratio_ctrl = statistics.median(ratios), statistics.median(ctrl)
        rows.append(
            [
                name,
                n,
                f"{med['a']:.1f}",
                f"{med['b']:.1f}",
                f"{med['c']:.1f}",
                f"{ratio:.3f}",
                f"{min(ratios):.3f}-{max(ratios):.3f}",
                f"{ratio_ctrl:.3f}",
                f"{100 * meter.other:.0f}%",
            ]
        )
        results.append(
            {
                "scenario": name,
                "n": n,
                "us_per_iter": med,
                "ratio": ratio,
                "ratios": ratios,
                "ratio_control": ratio_ctrl,
                "ratios_control": ctrl,
                "background_load": meter.other,
            }
        )
        print(f"  done: {name}", file=sys.stderr, flush=True)

    print(f"## timings ({trials} trials, medians; µs per iteration)\n")
    print(
        H.table(
            [
                "scenario (a) torch / (b) kernforge",
                "N",
                "(a) µs",
                "(b) µs",
                "(c) a+b alternating µs",
                "(c)/((a)+(b))",
                "range",
                "control",
                "bg",
            ],
            rows,
            "lrrrrrrrr",
        )
    )
    print("\n(c)/((a)+(b)) ~ 1.00: alternating costs nothing extra. control: the same ratio with the kernforge op")
    print("replaced by torch's copy_ of the same buffers (same bytes, torch's pool only): what alternating costs")
    print("through the caches alone (the torch op evicts the other op's data). bg: CPU share other processes used.")
    bg_end = H.background_load(1.0)
    print(f"background CPU load at end {100 * bg_end:.0f}% of all cores")
    H.write_json(
        args.json, {"info": info, "gomp_files": gomp_both, "threads": [threads_torch, threads_both], "results": results}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
