"""The benchmark driver: one command for every routine (also ``python -m kernforge bench``).

    python benchmarks/run.py list                                   # the routines
    python benchmarks/run.py gemm decode --jsonl results.jsonl      # two routines, figures appended
    python benchmarks/run.py all --quick                            # every routine, smoke run (CI)
    python benchmarks/run.py e2e -- --layers 4 --new 32             # after --: the routine's own flags

Each routine is a script here (``bench_<name>.py``; quality is ``eval_quality.py``) run as a
subprocess of this interpreter (its threads, memory and JIT state do not leak into the next one),
with ``--quick`` and ``--jsonl PATH`` passed on and its output streamed. Each routine appends its
figures to the ``--jsonl`` file as JSON lines (kernforge.bench.records). At the end a summary gives
each routine's exit status and time; the exit status is non-zero if any routine failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent

# name -> (script, what it measures)
ROUTINES: dict[str, tuple[str, str]] = {
    "gemm": ("bench_gemm.py", "bf16 prepacked linear vs torch F.linear and torch.compile"),
    "decode": ("bench_decode.py", "batch decode attention over a paged KV cache vs torch and vLLM"),
    "prefill": ("bench_prefill.py", "prefill attention (ragged and paged KV) vs torch SDPA"),
    "mla": ("bench_mla.py", "MLA decode attention (DeepSeek's absorbed form) vs torch"),
    "moe": ("bench_moe.py", "fused MoE experts vs transformers' expert loop and vLLM's fused MoE"),
    "page": ("bench_page.py", "paged KV cache append vs the torch scatter it replaces"),
    "ops": ("bench_ops.py", "norms and gated activations vs torch eager and torch.compile"),
    "sampling": ("bench_sampling.py", "sampling ops vs the torch paths LLM engines use"),
    "jit": ("bench_jit.py", "JIT costs: compile per variant, cache hit in a cold process, dispatch"),
    "comm": ("bench_comm.py", "kernforge.distributed all_reduce / all_gather vs gloo"),
    "e2e": ("bench_e2e.py", "a Hugging Face model generating through kernforge vs stock transformers"),
    "vllm": ("bench_vllm.py", "vLLM's CPU engine with and without kernforge's plugin (needs .venv-vllm)"),
    "llamacpp": ("bench_llamacpp.py", "four-bit weights vs llama.cpp on the same weights (needs its binary)"),
    "gguf": ("bench_gguf.py", "GGUF files (from_gguf) vs llama.cpp and transformers reading the same files"),
    "gguf_quality": (
        "eval_gguf_quality.py",
        "GGUF files: perplexity vs stock transformers and llama.cpp on the same file",
    ),
    "quality": ("eval_quality.py", "quality on a real model (SmolLM2-135M): perplexity, KL, greedy agreement vs stock"),
}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The driver's arguments, and those after ``--`` (for every routine run)."""
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(
        prog="benchmarks/run.py",
        description="Run kernforge's benchmark routines.",
        epilog="routines: " + ", ".join(ROUTINES) + "; 'all' runs every one, 'list' describes them",
    )
    p.add_argument("routines", nargs="+", metavar="ROUTINE", help="routine names, 'all' or 'list'")
    p.add_argument("--quick", action="store_true", help="smoke run of each routine: fewer cases, short budgets")
    p.add_argument("--jsonl", metavar="PATH", help="append every routine's figures to PATH as JSON lines")
    args = p.parse_args(argv)
    unknown = [r for r in args.routines if r not in ROUTINES and r not in ("all", "list")]
    if unknown:
        p.error(f"unknown routine {', '.join(map(repr, unknown))} (routines: {', '.join(ROUTINES)}; or all, list)")
    return args, extra


def selected(names: list[str]) -> list[str]:
    """The routines named, 'all' expanded, in the order given, each once."""
    found: list[str] = []
    for name in names:
        for routine in ROUTINES if name == "all" else [name]:
            if routine not in found:
                found.append(routine)
    return found


def command(routine: str, quick: bool, jsonl: str | None, extra: list[str]) -> list[str]:
    argv = [sys.executable, str(BENCH_DIR / ROUTINES[routine][0])]
    if quick:
        argv.append("--quick")
    if jsonl:
        argv += ["--jsonl", str(Path(jsonl).resolve())]  # resolved: the routine may change directory
    return argv + extra


def run(routine: str, argv: list[str]) -> tuple[int, float]:
    """Run one routine, its output streamed to ours; (exit status, seconds)."""
    print(f"\n=== {routine}: {' '.join(argv[1:])}", flush=True)
    t0 = time.monotonic()
    try:
        status = subprocess.run(argv).returncode
    except KeyboardInterrupt:
        status = 130
    return status, time.monotonic() - t0


def summary(results: dict[str, tuple[int, float]]) -> str:
    rows = [
        f"  {name:<10} {'ok' if rc == 0 else f'FAILED (exit {rc})':<18} {sec:8.1f} s"
        for name, (rc, sec) in results.items()
    ]
    failed = [name for name, (rc, _) in results.items() if rc != 0]
    total = sum(sec for _, sec in results.values())
    last = f"{len(results) - len(failed)} of {len(results)} routines passed in {total:.0f} s"
    return "\n".join(["", "=== summary", *rows, last + (f"; failed: {', '.join(failed)}" if failed else "")])


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    if "list" in args.routines:
        width = max(map(len, ROUTINES))
        for name, (script, what) in ROUTINES.items():
            print(f"{name:<{width}}  {what} ({script})")
        return 0
    results = {}
    for routine in selected(args.routines):
        results[routine] = run(routine, command(routine, args.quick, args.jsonl, extra))
        if results[routine][0] == 130:  # interrupted: do not start the next routine
            break
    print(summary(results), flush=True)
    return 0 if all(rc == 0 for rc, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
