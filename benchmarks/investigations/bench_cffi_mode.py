"""Per-call overhead of cffi's ABI mode vs API mode (kernforge's default: api).

A trivial kernel with the norm's 15-argument signature (13 int64, a double,
an int64), declared as a module here, is rendered from a template in a temporary
directory (``kernforge.register_template_dir``) and built twice through kernforge's own
pipeline, with KERNFORGE_CFFI_MODE=abi and =api (the mode is part of the
cache key, so these are two artifacts). Both are loaded in this process and
called a million times each, in interleaved chunks; the figure is the median
per-call time over chunks. A pure-Python function with the same 15 arguments
gives the floor of the Python call itself. Then the real rmsnorm kernel
(bf16, [1, 4096]) is built in both modes and timed the same way.

    .venv/bin/python benchmarks/investigations/bench_cffi_mode.py [--quick] [--calls N] [--json out.json]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _harness and the routines
import _harness as H  # noqa: E402

NOOP_ARGS = (
    "int64_t out, int64_t out_s0, int64_t out_s1, int64_t input, int64_t in_s0, int64_t in_s1, "
    "int64_t residual, int64_t res_s0, int64_t res_s1, int64_t weight, int64_t n0, int64_t n1, "
    "int64_t hidden, double eps, int64_t num_threads"
)
NOOP_TEMPLATE = """\
// benchmark-only: the norm's signature, an empty body
#include <cstdint>
extern "C" __attribute__((visibility("default"))) {{ decl.run }} {
  (void)out; (void)out_s0; (void)out_s1; (void)input; (void)in_s0; (void)in_s1; (void)residual;
  (void)res_s0; (void)res_s1; (void)weight; (void)n0; (void)n1; (void)hidden; (void)eps; (void)num_threads;
}
"""
TEMPLATE_NAME = "kf_bench_noop15.cpp.jinja"


def build_in_mode(spec, mode):
    from kernforge.jit import core

    saved = os.environ.get("KERNFORGE_CFFI_MODE")
    os.environ["KERNFORGE_CFFI_MODE"] = mode
    try:
        result, kernel = core.build(spec)
    finally:
        if saved is None:
            os.environ.pop("KERNFORGE_CFFI_MODE", None)
        else:
            os.environ["KERNFORGE_CFFI_MODE"] = saved
    return result, kernel.run


def time_calls(fns: dict, args: tuple, total_calls: int, chunks: int) -> dict:
    """Median ns per call over ``chunks`` interleaved chunks of total_calls/chunks calls per function."""
    per = max(1, total_calls // chunks)
    samples = {k: [] for k in fns}
    a = args
    for f in fns.values():  # warm-up
        for _ in range(1000):
            f(*a)
    for _ in range(chunks):
        for name, f in fns.items():
            t0 = time.perf_counter_ns()
            for _ in range(per):
                f(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14])
            samples[name].append((time.perf_counter_ns() - t0) / per)
    return {k: (statistics.median(v), min(v), max(v), per * chunks) for k, v in samples.items()}


def main() -> int:
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, help="calls per function (default 1,000,000; quick 100,000)")
    args = p.parse_args()
    calls = args.calls or (100_000 if args.quick else 1_000_000)
    chunks = 10 if args.quick else 20

    if not os.environ.get("KERNFORGE_CACHE_DIR"):
        cache = tempfile.mkdtemp(prefix="kf-bench-cffi-")
        os.chmod(cache, 0o700)
        os.environ["KERNFORGE_CACHE_DIR"] = cache
    import torch

    import kernforge
    from kernforge.jit import Entry, Module, core

    H.setup_threads(args.threads)
    bg = H.wait_for_quiet(args.wait_quiet)
    info = H.print_header(
        "bench_cffi_mode: cffi ABI vs API mode, per-call overhead",
        args,
        {
            "kernforge default cffi mode": kernforge.jit.loader.cffi_mode(),
            "cffi": __import__("cffi").__version__,
            "background CPU load before start (other processes)": f"{100 * bg:.0f}% of all cores",
        },
    )

    tdir = Path(tempfile.mkdtemp(prefix="kf-bench-tpl-"))
    (tdir / TEMPLATE_NAME).write_text(NOOP_TEMPLATE)
    kernforge.register_template_dir(tdir)
    noop = Module("bench_noop15", TEMPLATE_NAME, params={}, entries=[Entry("run", NOOP_ARGS)], register=False)
    spec = core.KernelSpec.make(noop, {}, "generic")
    built = {mode: build_in_mode(spec, mode) for mode in ("abi", "api")}
    for mode, (res, _) in built.items():
        print(f"- built {res.key} ({mode}): {f'compiled in {res.seconds:.2f} s' if res.compiled else 'cached'}")

    def py15(out, out_s0, out_s1, input, in_s0, in_s1, residual, res_s0, res_s1, weight, n0, n1, hidden, eps, nt):
        return None

    noop_args = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 1e-6, 2)
    fns = {
        "abi (ffi.dlopen, libffi)": built["abi"][1],
        "api (compiled extension)": built["api"][1],
        "pure-Python def, same 15 args": py15,
    }
    with H.LoadMeter() as meter:
        t = time_calls(fns, noop_args, calls, chunks)
    print(f"\n## empty kernel, 15 arguments ({t[next(iter(t))][3]:,} calls each, {chunks} interleaved chunks)\n")
    print(
        H.table(
            ["call", "ns/call median", "min chunk", "max chunk"],
            [[k, f"{v[0]:.0f}", f"{v[1]:.0f}", f"{v[2]:.0f}"] for k, v in t.items()],
            "lrrr",
        )
    )
    abi, api = t[list(t)[0]][0], t[list(t)[1]][0]
    print(
        f"\nABI - API: {abi - api:.0f} ns per call; ABI / API: {abi / api:.1f}x "
        f"(other processes' CPU share meanwhile: {100 * meter.other:.0f}%)"
    )

    # the real kernel: rmsnorm bf16 [1, 4096], same pointers, both modes
    nspec = kernforge.ops.OPS["rmsnorm"].variant(torch.bfloat16).spec()
    nbuilt = {mode: build_in_mode(nspec, mode) for mode in ("abi", "api")}
    x = torch.randn(1, 4096).to(torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    o = torch.empty_like(x)
    nargs = (
        o.data_ptr(),
        4096,
        0,
        x.data_ptr(),
        4096,
        0,
        0,
        0,
        0,
        w.data_ptr(),
        1,
        1,
        4096,
        1e-6,
        torch.get_num_threads(),
    )
    kcalls = max(10_000, calls // 10)
    tk = time_calls({"abi": nbuilt["abi"][1], "api": nbuilt["api"][1]}, nargs, kcalls, chunks)
    print(f"\n## rmsnorm bf16 [1, 4096] kernel called directly ({kcalls:,} calls each)\n")
    print(
        H.table(
            ["mode", "ns/call median", "min chunk", "max chunk"],
            [[k, f"{v[0]:.0f}", f"{v[1]:.0f}", f"{v[2]:.0f}"] for k, v in tk.items()],
            "lrrr",
        )
    )
    print(f"\nABI - API on the real kernel: {tk['abi'][0] - tk['api'][0]:.0f} ns per call")
    verdict = "api" if api < abi else "abi"
    print(
        f"\nverdict: {verdict} mode has the lower per-call overhead; kernforge's default is "
        f"{kernforge.jit.loader.cffi_mode()}."
    )
    H.write_json(args.json, {"info": info, "noop": t, "rmsnorm_1x4096": tk, "abi_minus_api_ns": abi - api})
    return 0


if __name__ == "__main__":
    sys.exit(main())
