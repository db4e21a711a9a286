"""``python -m kernforge {info,list,clear,modules,prewarm,tune,bench}``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import subprocess
import sys
from pathlib import Path

from kernforge import tune
from kernforge.cache import disk
from kernforge.distributed import threads
from kernforge.jit import compiler, core, isa, loader, module, render
from kernforge.ops._common import set_num_threads

# The module: ``kernforge.prewarm`` (the package attribute) is the prewarm() function.
prewarm = importlib.import_module("kernforge.prewarm")


def _info(args) -> int:
    info = isa.cpu_info()
    root = disk.cache_root()
    found = disk.entries(root)
    features = " ".join(f for f, present in info["features"].items() if present) or "(none)"
    print(f"features:        {features}")
    print(f"runnable tiers:  {', '.join(info['runnable_tiers'])}")
    print(f"selected tier:   {info['selected_tier']}")
    print(f"compiler:        {' '.join(compiler.compiler_argv())}")
    print(f"cffi mode:       {loader.cffi_mode()}")
    print(f"jit enabled:     {core.jit_enabled()}")
    print(f"cache dir:       {root}")
    print(
        f"cache entries:   {sum(meta is not None for _, meta in found)} ready, "
        f"{sum(meta is None for _, meta in found)} incomplete"
    )
    print(f"cache size:      {disk.size_bytes(root) / 2**20:.1f} MiB")
    print(f"threads:         {threads.describe(threads.binding())}")
    return 0


def _list(args) -> int:
    for entry, meta in disk.entries():
        if meta is None:
            print(f"{entry.key}  (incomplete: will be rebuilt)")
        else:
            print(f"{entry.key}  {meta['so_size'] / 1024:7.1f} KiB  compiled in {meta['compile_seconds']:.2f} s")
    return 0


def _clear(args) -> int:
    print(f"removed {disk.clear()} entries from {disk.cache_root()}")
    return 0


def _modules(args) -> int:
    for declared in dict(sorted(module.registered_modules().items())).values():
        print(json.dumps(declared.schema()))
    return 0


def _parse_param(text: str):
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--param takes NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _prewarm(args) -> int:
    for directory in args.template_dir:
        render.register_template_dir(directory)
    if args.gguf:
        from kernforge.integrations.transformers import gguf_manifest

        manifest = gguf_manifest(args.gguf, tuple(args.kv_cache_dtype or ()))
    elif args.model_config:
        manifest = prewarm.manifest_from_model_config(args.model_config, tuple(args.kv_cache_dtype or ()), args.quant)
    elif args.manifest:
        manifest = json.loads(open(args.manifest).read())
    elif args.op:
        manifest = {"kernels": [{"op": op, "dtype": args.dtype or list(prewarm.ALL_DTYPES)} for op in args.op]}
    elif args.module:
        manifest = {"kernels": [{"module": args.module, "params": dict(args.param or [])}]}
    else:
        manifest = prewarm.all_ops_manifest(args.dtype or prewarm.ALL_DTYPES)
    if args.tune and not args.model_config:
        raise ValueError(
            "--tune times a model's linear and attention shapes: it needs --model-config "
            "(python -m kernforge tune gemm takes shapes directly)"
        )
    if args.print_manifest:
        print(json.dumps(manifest, indent=2))
        return 0
    prewarm.prewarm(manifest, isa_tier=args.isa, jobs=args.jobs)
    if args.tune:
        if args.threads:
            set_num_threads(args.threads)
        with isa.use_isa(args.isa) if args.isa else contextlib.nullcontext():  # timed on the tier just built
            lines = [
                *tune.gemm_report(prewarm.tune_model_linears(args.model_config, args.tune_m)),
                *tune.prefill_report(prewarm.tune_model_attention(args.model_config)),
            ]
        print("\n".join(lines))
        print(f"recorded in {disk.cache_root() / 'tuning'}")
    return 0


# The benchmark driver of a source checkout (the routines are scripts there, not in the package).
BENCH_DRIVER = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def _bench(argv: list[str]) -> int:
    """``bench ...``: benchmarks/run.py with the same arguments, in this interpreter."""
    if not BENCH_DRIVER.is_file():
        print(
            "kernforge: error: the benchmark routines live in the source checkout's benchmarks/ "
            f"(run.py), not in the installed package; no {BENCH_DRIVER} here. Run `python -m kernforge "
            "bench` from an editable install of a checkout (pip install -e .), or "
            "`python benchmarks/run.py` in the checkout.",
            file=sys.stderr,
        )
        return 2
    return subprocess.run([sys.executable, str(BENCH_DRIVER), *argv]).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the driver parses the rest (its routines, --quick, --jsonl, -- ...)
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m kernforge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="CPU features, tier, compiler and cache").set_defaults(run=_info)
    sub.add_parser("list", help="cached variants").set_defaults(run=_list)
    sub.add_parser("clear", help="delete every cached variant").set_defaults(run=_clear)
    sub.add_parser("modules", help="every kernel module's parameters (the manifest schema)").set_defaults(run=_modules)
    p = sub.add_parser("prewarm", help="compile variants ahead of time (default: every op and dtype)")
    p.add_argument("manifest", nargs="?", help="JSON manifest of kernels to build")
    p.add_argument("--model-config", help="derive the manifest from a model's config.json")
    p.add_argument("--gguf", help="derive the manifest from a GGUF file (kernforge.from_gguf's model)")
    p.add_argument(
        "--kv-cache-dtype",
        action="append",
        help="with --model-config: also build decode for this KV cache dtype, e.g. float8_e4m3fn",
    )
    p.add_argument(
        "--quant",
        choices=["int8", "fp8_block", "int4", "int4_w4a16"],
        help="with --model-config: also build the quantized (int8 w8a8, fp8 block, int4) GEMM and MoE experts",
    )
    p.add_argument("--op", action="append", help="an op to build (repeatable)")
    p.add_argument("--dtype", action="append", help="dtype(s) for --op or the default set (repeatable)")
    p.add_argument("--module", help="a kernel module to build (name or package.module:ATTR), with --param NAME=VALUE")
    p.add_argument("--param", action="append", type=_parse_param, help="template parameter NAME=VALUE")
    p.add_argument("--template-dir", action="append", default=[], help="extra template directory (repeatable)")
    p.add_argument("--isa", help="tier to build (and with --tune, to tune) for (default: the tier in use)")
    p.add_argument("--jobs", type=int, help="parallel compiles (default: all cores)")
    p.add_argument("--print-manifest", action="store_true", help="print the manifest instead of building")
    p.add_argument(
        "--tune",
        action="store_true",
        help="with --model-config: then tune the GEMM for the model's linear shapes (q, k/v, o, "
        "gate+up as one, down) and the prefill tile for its head_dim and GQA group, recording "
        "the winners where dispatch finds them",
    )
    p.add_argument(
        "--tune-m",
        type=int,
        nargs="+",
        default=list(prewarm.TUNE_ROWS),
        help=f"with --tune: rows of x to tune for (default {' '.join(map(str, prewarm.TUNE_ROWS))})",
    )
    p.add_argument("--threads", type=int, help="with --tune: threads to tune with (default: kernforge's setting)")
    p.set_defaults(run=_prewarm)
    tune.add_parser(sub)
    sub.add_parser(
        "bench",
        add_help=False,  # `bench --help` is the driver's
        help="run benchmark routines (source checkout): bench list | "
        "bench ROUTINE... [--quick] [--jsonl PATH] [-- ARGS]",
    )
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, OSError, RuntimeError) as exc:
        print(f"kernforge: error: {exc}", file=sys.stderr)
        return 1
