"""Tuners: time a kernel's tile candidates on this machine and record the winners where its
dispatch finds them (``jit.tuning``'s store). Tools, above the ops: ``python -m kernforge tune
<kernel>`` offers every tuner registered here, each with its own arguments, and
``prewarm --model-config --tune`` calls them for a model's shapes.

A kernel with tile candidates (``jit.tuning.Candidates``) registers one :class:`Tuner` here with
:func:`register`; a test checks that every candidates list has one.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kernforge.cache import disk
from kernforge.jit import isa, tuning
from kernforge.jit.tuning import Candidate, Candidates
from kernforge.ops._common import TORCH_DTYPES, dtype_name, set_num_threads
from kernforge.ops.attention import prefill
from kernforge.ops.gemm import bf16, int4


@dataclass(frozen=True)
class Tuner:
    """How to tune one kernel: its candidates, the CLI arguments that give the shapes, and the run."""

    name: str
    candidates: Candidates
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run_cli: Callable[[argparse.Namespace], list[dict]]  # tunes; returns lines to print


TUNERS: dict[str, Tuner] = {}


def register(tuner: Tuner) -> Tuner:
    TUNERS[tuner.name] = tuner
    return tuner


def main(args: argparse.Namespace) -> int:
    """``python -m kernforge tune <kernel> ...``."""
    if args.threads:
        set_num_threads(args.threads)
    for line in TUNERS[args.kernel].run_cli(args):
        print(line)
    print(f"recorded in {disk.cache_root() / 'tuning'}")
    return 0


def add_parser(sub) -> None:
    """The ``tune`` command, one sub-command per registered tuner."""
    parser = sub.add_parser("tune", help="time the tile candidates of a kernel on this machine and record the winners")
    kernels = parser.add_subparsers(dest="kernel", required=True)
    for tuner in TUNERS.values():
        p = kernels.add_parser(tuner.name, help=tuner.help)
        tuner.add_arguments(p)
        p.add_argument("--dtype", default="bf16", help="dtype of the activations (default bf16)")
        p.add_argument("--threads", type=int, help="threads to tune with (default: kernforge's setting)")
    parser.set_defaults(run=main)


# --------------------------------------------------------------------------- GEMM


def tune_gemm(
    m_list: Iterable[int],
    nk_list: Iterable[tuple[int, int]],
    dtype: torch.dtype = torch.bfloat16,
    measure: Callable[[dict, Callable[[], object]], float] | None = None,
    min_gain: float = 0.03,
) -> list[dict]:
    """Time every applicable candidate of ``weight_packed_linear`` (register tile, rows per task, K
    block, thread split: ``TILE_CANDIDATES``) for each M of ``m_list`` and each ``(N, K)`` of
    ``nk_list`` (x in ``dtype``, at the current :func:`kernforge.ops.num_threads`), and record the
    winner per (dtype, M bucket, N, K) for this tier and CPU model in the cache's tuning store, where
    dispatch finds it.

    The candidates always include the tier's default, and another candidate wins only when it is
    more than ``min_gain`` (a fraction) faster than the default in the same run: the recorded
    choice is never slower than the default as measured. ``measure(config, run)`` returns seconds
    (default: the median wall time of ``run()``), ``config`` being the candidate's parameters.
    Returns one dict per shape: the winner's and the default's ``config`` and every timing by
    :func:`config_name`."""
    if dtype not in bf16.DTYPE_NAMES:
        raise TypeError(f"dtype must be one of {', '.join(map(str, bf16.DTYPE_NAMES))}, got {dtype}")
    m_list, nk_list = [int(m) for m in m_list], [(int(n), int(k)) for n, k in nk_list]
    if not m_list or min(m_list) < 1 or not nk_list or min(min(nk) for nk in nk_list) < 1:
        raise ValueError(f"tune_gemm needs positive M, N and K, got m_list={m_list}, nk_list={nk_list}")
    measure = measure or (lambda config, run: tuning.time_call(run))
    tier = bf16.GEMM.built_tier(isa.selected_tier())
    results = []
    generator = torch.Generator().manual_seed(0)
    for n, k in nk_list:
        packed = bf16.convert_weight_packed(torch.randn(n, k, generator=generator).bfloat16())
        for m in m_list:
            x = torch.randn(m, k, generator=generator).to(dtype)
            out = torch.empty(m, n, dtype=dtype)
            timings = {}

            def seconds(candidate: Candidate) -> float:
                config = dict(candidate.params)
                timings[bf16.config_name(config)] = measure(
                    config, lambda: bf16.linear_with_config(x, packed, config, out=out)
                )
                return timings[bf16.config_name(config)]

            shape = bf16.tile_shape(dtype, m, n, k)
            winner = bf16.TILE_CANDIDATES.tune(shape, seconds, tier=tier, min_gain=min_gain)
            results.append(
                {
                    "m": m,
                    "n": n,
                    "k": k,
                    "dtype": shape["dtype"],
                    "m_bucket": shape["m"],
                    "tier": tier,
                    "config": dict(winner.params),
                    "default": dict(bf16.TILE_CANDIDATES.default(shape, tier).params),
                    "seconds": timings,
                }
            )
    bf16.reset_tile_choices()
    return results


def _shape_nk(text: str) -> tuple[int, int]:
    n, _, k = text.lower().partition("x")
    try:
        return int(n), int(k)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nk takes NxK (the weight's shape, e.g. 4096x4096), got {text!r}") from None


def _gemm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--m", type=int, nargs="+", required=True, help="rows of x to tune for (each picks an M bucket)")
    p.add_argument("--nk", type=_shape_nk, nargs="+", required=True, help="weight shapes NxK")


def _gemm_cli(args) -> list[str]:
    return gemm_report(tune_gemm(args.m, args.nk, TORCH_DTYPES[dtype_name(args.dtype)]))


def gemm_report(results: list[dict]) -> list[str]:
    """One line per tuned shape: the winner, the default and every candidate's time."""
    lines = []
    for r in results:
        timings = "  ".join(f"{name} {s * 1e6:.1f}us" for name, s in r["seconds"].items())
        lines.append(
            f"{r['dtype']} m={r['m']} (bucket {r['m_bucket']}) n={r['n']} k={r['k']} {r['tier']}: "
            f"{bf16.config_name(r['config'])} (default {bf16.config_name(r['default'])})  [{timings}]"
        )
    return lines


register(
    Tuner(
        "gemm",
        bf16.TILE_CANDIDATES,
        "weight_packed_linear's register tile, rows per task, K block and thread split",
        _gemm_arguments,
        _gemm_cli,
    )
)


# --------------------------------------------------------------------------- int4 GEMM


def tune_int4(
    m_list: Iterable[int],
    nk_list: Iterable[tuple[int, int]],
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = int4.DEFAULT_GROUP,
    w4a8: bool = True,
    measure: Callable[[dict, Callable[[], object]], float] | None = None,
    min_gain: float = 0.03,
) -> list[dict]:
    """Time every applicable blocking of the int4 GEMM (``int4.INT4_CANDIDATES``: rows per task, rows
    that go straight from the nibbles) on W4A8 (or W4A16, ``w4a8=False``) for each M of ``m_list`` and
    ``(N, K)`` of ``nk_list``, and record the winner per (dtype, M bucket, N, K, group) for this tier
    and CPU, as :func:`tune_gemm` does (the default wins unless another is ``min_gain`` faster)."""
    if dtype not in bf16.DTYPE_NAMES:
        raise TypeError(f"dtype must be one of {', '.join(map(str, bf16.DTYPE_NAMES))}, got {dtype}")
    m_list, nk_list = [int(m) for m in m_list], [(int(n), int(k)) for n, k in nk_list]
    if not m_list or min(m_list) < 1 or not nk_list or min(min(nk) for nk in nk_list) < 1:
        raise ValueError(f"tune_int4 needs positive M, N and K, got m_list={m_list}, nk_list={nk_list}")
    measure = measure or (lambda config, run: tuning.time_call(run))
    tier = int4.GEMM_INT4.built_tier(isa.selected_tier())
    results, generator = [], torch.Generator().manual_seed(0)
    for n, k in nk_list:
        packed = int4.quantize_int4(torch.randn(n, k, generator=generator), group_size)
        for m in m_list:
            x = torch.randn(m, k, generator=generator).to(dtype)
            timings = {}

            def seconds(candidate: Candidate) -> float:
                config = dict(candidate.params)
                run = lambda: int4.linear_with_config(x, packed, config, w4a8)  # noqa: E731
                timings[_int4_name(config)] = measure(config, run)
                return timings[_int4_name(config)]

            shape = int4.tile_shape(dtype, m, n, k, group_size)
            winner = int4.INT4_CANDIDATES.tune(shape, seconds, tier=tier, min_gain=min_gain)
            default = int4.INT4_CANDIDATES.default(shape, tier).params
            results.append(
                {
                    "shape": shape,
                    "tier": tier,
                    "config": dict(winner.params),
                    "default": dict(default),
                    "seconds": timings,
                }
            )
    int4.reset_choices()
    return results


def _int4_name(config: dict) -> str:
    return f"row_block={config['row_block']} few_rows={config['few_rows']}"


def _int4_arguments(p: argparse.ArgumentParser) -> None:
    _gemm_arguments(p)
    p.add_argument("--group-size", type=int, default=int4.DEFAULT_GROUP, help="K values per scale (default 128)")
    p.add_argument("--w4a16", action="store_true", help="tune the W4A16 op (default: W4A8)")


def _int4_cli(args) -> list[str]:
    results = tune_int4(args.m, args.nk, TORCH_DTYPES[dtype_name(args.dtype)], args.group_size, not args.w4a16)
    return [
        f"{r['shape']} {r['tier']}: {_int4_name(r['config'])} (default {_int4_name(r['default'])})  "
        + "  ".join(f"{name} {s * 1e6:.1f}us" for name, s in r["seconds"].items())
        for r in results
    ]


register(
    Tuner(
        "gemm_int4",
        int4.INT4_CANDIDATES,
        "the int4 GEMM's rows per task and the rows that go straight from the nibbles",
        _int4_arguments,
        _int4_cli,
    )
)


# --------------------------------------------------------------------------- prefill attention


def tune_prefill(
    head_dims=((128, 128),),
    groups=(4,),
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    length: int = 1024,
    measure=None,
) -> list[dict]:
    """Time every tile candidate of the prefill kernel on a causal request of ``length`` tokens
    (two KV heads, so every thread has work) for each ``(head_dim_qk, head_dim_vo)`` and GQA group,
    and record the fastest per (dtypes, head dims, group) for this tier and CPU model, where
    plan() finds it. The default is always timed and is displaced only by a candidate more than
    3% faster, so the record is never slower than the default as measured. ``measure(tile, run)``
    returns seconds (default: the median wall time of ``run()``). Returns one dict per shape."""
    kv_dtype = kv_dtype or dtype
    measure = measure or (lambda tile, run: tuning.time_call(run))
    tier, results = isa.selected_tier(), []
    generator = torch.Generator().manual_seed(0)
    workspace = torch.empty(64 << 20, dtype=torch.uint8)
    indptr = torch.tensor([0, int(length)], dtype=torch.int32)
    for head_dim_qk, head_dim_vo in head_dims:
        for group in groups:
            num_kv_heads = 2
            q = torch.randn(length, num_kv_heads * group, head_dim_qk, generator=generator).to(dtype)
            k = torch.randn(length, num_kv_heads, head_dim_qk, generator=generator).to(kv_dtype)
            v = torch.randn(length, num_kv_heads, head_dim_vo, generator=generator).to(kv_dtype)
            out = torch.empty(length, num_kv_heads * group, head_dim_vo, dtype=dtype)
            timings = {}

            def seconds(candidate: Candidate) -> float:
                tile = candidate.params["tile"]
                wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper(workspace)
                wrapper.plan_with_tile(
                    indptr,
                    indptr,
                    num_kv_heads * group,
                    num_kv_heads,
                    head_dim_qk,
                    tile,
                    head_dim_vo,
                    q_data_type=dtype,
                    kv_data_type=kv_dtype,
                )
                timings[tile] = measure(tile, lambda: wrapper.run(q, k, v, out=out))
                return timings[tile]

            params = prefill.prefill_variant_params(
                dtype, kv_dtype, dtype, head_dim_qk, head_dim_vo, group, prefill.TILES[0]
            )
            shape = prefill.tile_shape(params, group)
            winner = prefill.TILE_CANDIDATES.tune(shape, seconds, tier=tier, min_gain=0.03)
            results.append(
                {
                    "head_dim_qk": head_dim_qk,
                    "head_dim_vo": head_dim_vo,
                    "group": group,
                    "dtype": params["q_dtype"],
                    "kv_dtype": params["kv_dtype"],
                    "tier": prefill.PREFILL.built_tier(tier),
                    "tile": winner.params["tile"],
                    "default": prefill.TILE_CANDIDATES.default(shape, prefill.PREFILL.built_tier(tier)).params["tile"],
                    "seconds": timings,
                }
            )
    return results


def _prefill_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head-dim", type=int, nargs="+", default=[128], help="head_dim_qk values (default 128)")
    p.add_argument("--head-dim-vo", type=int, help="head_dim_vo (default: head_dim_qk)")
    p.add_argument("--group", type=int, nargs="+", default=[4], help="GQA group sizes (default 4)")
    p.add_argument("--length", type=int, default=1024, help="causal request length timed (default 1024)")


def _prefill_cli(args) -> list[str]:
    head_dims = [(d, args.head_dim_vo or d) for d in args.head_dim]
    return prefill_report(tune_prefill(head_dims, args.group, TORCH_DTYPES[dtype_name(args.dtype)], length=args.length))


def prefill_report(results: list[dict]) -> list[str]:
    """One line per tuned shape: the winning tile, the default and every tile's time."""
    lines = []
    for r in results:
        timings = "  ".join(f"{'x'.join(map(str, tile))} {s * 1e3:.2f}ms" for tile, s in r["seconds"].items())
        lines.append(
            f"prefill {r['dtype']}/{r['kv_dtype']} head_dim {r['head_dim_qk']}/{r['head_dim_vo']} group "
            f"{r['group']} {r['tier']}: tile {'x'.join(map(str, r['tile']))} (default "
            f"{'x'.join(map(str, r['default']))})  [{timings}]"
        )
    return lines


register(
    Tuner(
        "prefill",
        prefill.TILE_CANDIDATES,
        "the prefill kernel's tile (query rows per item, keys per block)",
        _prefill_arguments,
        _prefill_cli,
    )
)
