"""Prepacked bf16 linear layers (sgl-kernel's CPU op names): pack a weight once with
``convert_weight_packed``, then ``weight_packed_linear(x, packed)`` computes ``x @ weight.T``.

The packed layout (``PackedWeight.layout_version`` 1) is the one every tier's micro-kernel reads
(``kernforge/gemm/micro_kernel.h``): the weight's N rows in panels of ``panel_width`` columns of
the product, each panel K pair by K pair, each pair one 32-bit word per column (VNNI-2: the even
K element in the low half). N is padded with zero rows to whole panels, an odd K with a zero
column; a panel is contiguous, so a thread's slice of N is one contiguous slice of the weight.

The layout is the same on every tier and for every tile: each tile's NR divides ``PANEL_WIDTH``, so
a weight packed once (under any forced tier, on any machine) runs under every tier and tuned choice.
A packed weight of another layout version, or whose panel width is not a multiple of
``PANEL_WIDTH``, is refused with a ValueError naming ``packed``.

The micro-kernel's register tile (MR, NR) and the blocking around it (``row_block`` rows per task,
``depth_block`` K per block, and ``split``: whether threads split N or M first) are module
parameters. ``TILE_CANDIDATES`` lists the combinations each tier may run; dispatch takes the winner
that ``tune_gemm`` recorded for the problem's (dtype, M bucket, N, K) on this tier and CPU model,
else the tier's default (the best-ranked candidate: ``kf::gemm::DefaultTile`` with ``DEFAULT_BLOCKING``,
except bf16 on avx512 with K over one block, which takes the 512-deep K block).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kernforge.jit import isa
from kernforge.jit.core import Variant
from kernforge.jit.module import ALL_TIERS, DType, Entry, Enum, Int, IntTuple, Module
from kernforge.jit.tuning import Candidate, Candidates
from kernforge.ops._common import (
    TORCH_DTYPES,
    BoundCall,
    check_no_overlap,
    checked_out,
    dtype_name,
    no_op,
    num_threads,
    same_dtype,
    variant_for_input,
)
from kernforge.ops._registry import DTYPE_NAMES, Traced, export, kernel_op, model_kernels
from kernforge.ops.gemm._common import (
    check_layout_version,
    check_packed,
    checked_weight,
    matrix_rows,
    packed_weight,
    raise_for_status,
)

LAYOUT_VERSION = 1
PANEL_WIDTH = 32  # columns of the product per packed panel: a multiple of every tier's NR

# Every (MR, NR) some tier may run; NR divides PANEL_WIDTH, MR is at most the smallest row block.
TILES = ((8, 32), (4, 32), (6, 32), (16, 16), (4, 16), (6, 16), (2, 32), (1, 16))
# linear.h's blocking: rows per task (rounded down to whole tiles), K per block, which dimension the
# threads split first. The defaults are what every tier runs untuned.
DEFAULT_BLOCKING = {"row_block": 64, "depth_block": 256, "split": "n"}

GEMM = Module(
    "gemm",
    "gemm.cpp.jinja",
    params={
        "dtype": DType(),
        "tile": IntTuple(2, choices=TILES),
        "row_block": Int(choices=(64, 128)),
        "depth_block": Int(choices=(256, 512)),
        "split": Enum(("n", "m")),
    },
    entries=[
        Entry(
            "linear",
            "int64_t out, int64_t ldo, int64_t x, int64_t ldx, int64_t packed, "
            "int64_t panel_width, int64_t bias, int64_t m, int64_t n, int64_t k, "
            "int64_t num_threads",
            returns="int64_t",
        )
    ],
    tiers=ALL_TIERS,  # the amx build multiplies bf16 x in AMX tiles (gemm/amx_kernel.h)
)


def gemm_config(tile: tuple[int, int], row_block: int = 64, depth_block: int = 256, split: str = "n") -> dict:
    """The GEMM module's parameters besides the dtype: a candidate's ``params``."""
    return {"tile": tile, "row_block": row_block, "depth_block": depth_block, "split": split}


def config_name(config: Mapping) -> str:
    """``8x32``, plus whatever blocking differs from the default (``8x32 depth_block=512``)."""
    blocking = [f"{k}={config[k]}" for k, v in DEFAULT_BLOCKING.items() if config.get(k, v) != v]
    return " ".join(["x".join(map(str, config["tile"])), *blocking])


def _tile(
    mr: int, nr: int, tiers: tuple[str, ...], rank: int, dtypes=("bf16", "fp16", "fp32"), default_for=()
) -> Candidate:
    """A tile for ``dtypes`` of x on ``tiers``. Besides the dtypes it is the default for, it applies
    only from M = MR on: below that it runs the same (M, NR) micro-kernel as the default does."""

    def applies(shape) -> bool:
        return shape["dtype"] in dtypes and (shape["dtype"] in default_for or shape["m"] >= mr)

    return Candidate(gemm_config((mr, nr)), tiers, rank, when=applies)


def _blocking(
    tile: tuple[int, int], tiers: tuple[str, ...], rank: int, matters: Callable[[dict], bool], **blocking
) -> Candidate:
    """The bf16 default ``tile`` with one blocking changed, for the shapes where it ``matters``."""
    return Candidate(
        gemm_config(tile, **blocking), tiers, rank, when=lambda shape: shape["dtype"] == "bf16" and matters(shape)
    )


def _rows_span_blocks(shape) -> bool:  # more than one default row block: rows per task and the split matter
    return shape["m"] > DEFAULT_BLOCKING["row_block"]


def _depth_spans_blocks(shape) -> bool:  # more than one default K block
    return shape["k"] > DEFAULT_BLOCKING["depth_block"]


def m_bucket(m: int) -> int:
    """Rows are tuned in power-of-two buckets (1, 2, 4, ... 1024 and more)."""
    return 1 << min(max(m - 1, 0).bit_length(), 10)


def tile_shape(dtype: torch.dtype, m: int, n: int, k: int) -> dict:
    """The problem as the candidates see it: x's dtype name, M's bucket, N and K."""
    return {"dtype": DTYPE_NAMES[dtype], "m": m_bucket(m), "n": n, "k": k}


# On amx these register tiles serve fp16/fp32 x, and bf16 x below amx::kMinRows rows (AMX tiles above).
_WIDE, _NARROW = ("avx512", "amx"), ("avx2", "generic")
# Register budgets: vdpbf16ps (32 zmm) holds 8 x 32 (16 accumulators) or 16 x 16; the FMA path on
# AVX-512 also broadcasts A, 4 x 32 by default; 16 ymm on AVX2 hold 4 x 16 (6 x 16 at the limit).
# Blocking, around the bf16 default tile on avx512 and avx2 (the scalar generic tier gains nothing):
# a 512-deep K block (a 32 KB B block: still in Zen 4/5's and Sapphire Rapids' 48 KB L1, half the
# scratch-tile traffic), 128 rows per task (a task's B block comes into L1 once per row block: half
# as often), and threads splitting M first (each reads the whole weight; its rows of x stay in L2).
TILE_CANDIDATES = Candidates(
    "weight_packed_linear",
    GEMM,
    candidates=[
        _tile(8, 32, _WIDE, 0, dtypes=("bf16",), default_for=("bf16",)),
        _tile(4, 32, _WIDE, 1, default_for=("fp16", "fp32")),
        _tile(6, 32, _WIDE, 2),
        _tile(16, 16, _WIDE, 3, dtypes=("bf16",)),
        # bf16's untuned default where K spans blocks: 1.20-1.23x the 256-deep block at M = 16 and
        # 0.98-1.10x elsewhere on Zen 5 (docs/notes/2026-11-23-issue-9-gemm.md, tuned column)
        _blocking((8, 32), ("avx512",), -1, _depth_spans_blocks, depth_block=512),
        _blocking((8, 32), ("amx",), 4, _depth_spans_blocks, depth_block=512),
        _blocking((8, 32), _WIDE, 5, _rows_span_blocks, row_block=128),
        _blocking((8, 32), _WIDE, 6, _rows_span_blocks, split="m"),
        _tile(4, 16, _NARROW, 0, default_for=("bf16", "fp16", "fp32")),
        _tile(6, 16, _NARROW, 1),
        _tile(2, 32, _NARROW, 2),
        _blocking((4, 16), ("avx2",), 3, _depth_spans_blocks, depth_block=512),
        _blocking((4, 16), ("avx2",), 4, _rows_span_blocks, row_block=128),
        _blocking((4, 16), ("avx2",), 5, _rows_span_blocks, split="m"),
    ],
    # One row at a time: valid on every tier and shape.
    reference=Candidate(gemm_config((1, 16)), ("avx512", "avx2", "generic")),
    bucket=lambda s: f"{s['dtype']}_m{s['m']}_n{s['n']}_k{s['k']}",
)

# (x dtype, M bucket, N, K, selected tier) -> the variant dispatch runs; reset_tile_choices() empties it.
_CHOSEN: dict[tuple, Variant] = {}


def reset_tile_choices() -> None:
    """Forget the tiles dispatch chose, so the next calls read the tuning records again."""
    _CHOSEN.clear()


def _chosen_variant(dtype: torch.dtype, m: int, n: int, k: int) -> Variant:
    key = (dtype, m_bucket(m), n, k, isa.selected_tier())
    found = _CHOSEN.get(key)
    if found is None:
        config = TILE_CANDIDATES.choose(tile_shape(dtype, m, n, k), tier=key[-1]).params
        found = _CHOSEN[key] = GEMM.variant(dtype=DTYPE_NAMES[dtype], **config)
    return found


@packed_weight(saved_as="kernforge.ops.gemm")
class PackedWeight:
    """A weight ``[n, k]`` packed for ``weight_packed_linear``; survives ``torch.save``/``torch.load``."""

    packed: torch.Tensor  # [n_panels, ceil(k / 2), panel_width, 2] bf16
    n: int
    k: int
    dtype: torch.dtype = torch.bfloat16
    panel_width: int = PANEL_WIDTH
    layout_version: int = LAYOUT_VERSION


def convert_weight_packed(weight: torch.Tensor) -> PackedWeight:
    """Pack a bf16 ``weight [N, K]`` (``nn.Linear.weight``) for :func:`weight_packed_linear`."""
    n, k = checked_weight(weight, torch.bfloat16, "convert_weight_packed")
    panels, pairs, _, _ = packed_shape(n, k)
    padded = weight.new_zeros(panels * PANEL_WIDTH, pairs * 2)
    padded[:n, :k] = weight
    packed = padded.view(panels, PANEL_WIDTH, pairs, 2).permute(0, 2, 1, 3).contiguous()
    return PackedWeight(packed, n, k)


export("convert_weight_packed", convert_weight_packed)


# Pre-warm builds the best tier's bf16 default; other tiers, dtypes and tuned choices compile on first use.
def _to_schema(x, packed, bias=None, out=None):
    check_layout_version(packed, LAYOUT_VERSION)  # the custom op rebuilds the dataclass at this version
    return (x, packed.packed, packed.n, packed.k, packed.panel_width, bias), out


def _from_schema(x, packed, n, k, panel_width, bias=None, out=None):
    return weight_packed_linear(x, PackedWeight(packed, n, k, panel_width=panel_width), bias, out)


# The custom op takes the PackedWeight as its tensor and ints (a schema holds no Python objects).
_TRACED = Traced(
    "Tensor",
    fake=lambda x, packed, n, *args, **kwargs: x.new_empty((*x.shape[:-1], n)),
    with_out=True,
    arguments="Tensor x, Tensor packed, int n, int k, int panel_width, Tensor? bias=None",
    from_schema=_from_schema,
    to_schema=_to_schema,
)


@kernel_op(GEMM, traced=_TRACED, **gemm_config((8, 32), depth_block=512))  # pre-warm: avx512's bf16 default for K > 256
def weight_packed_linear(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] @ weight.T (+ bias)`` -> ``[..., N]`` in ``x``'s dtype (fp32 accumulation);
    ``packed`` from :func:`convert_weight_packed`, ``bias [N]`` in ``x``'s dtype. The tile is the
    one tuned for this shape bucket on this machine, else the tier's default."""
    return _linear(x, packed, bias, out, None)


def linear_with_config(
    x: torch.Tensor,
    packed: PackedWeight,
    config: Mapping,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`weight_packed_linear` with the GEMM's parameters forced (what the tuner times):
    ``config`` holds the ``tile`` and any of ``row_block``, ``depth_block``, ``split`` (the others
    default to ``DEFAULT_BLOCKING``); a candidate's ``params`` is one."""
    return _linear(x, packed, bias, out, {**DEFAULT_BLOCKING, **config})


def linear_with_tile(
    x: torch.Tensor,
    packed: PackedWeight,
    tile: tuple[int, int],
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`weight_packed_linear` with the register tile forced and the default blocking."""
    return linear_with_config(x, packed, {"tile": tile}, bias, out)


def bound_weight_packed_linear(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor
) -> BoundCall:
    """``weight_packed_linear(x, packed, bias, out=out)`` checked once, as a call of no arguments that
    multiplies whatever ``x`` holds when it runs (a prepared decode step's). ``x`` must be rows the
    kernel reads in place (``[M, K]`` with a unit last stride)."""
    out, call = _linear_call(x, packed, bias, out, None)
    if call is not None and (x.dim() != 2 or x.stride(-1) != 1):
        raise ValueError(f"x must be [M, K] rows with a unit last stride, got shape {tuple(x.shape)}")
    return call or BoundCall(no_op)


def _linear(x, packed, bias, out, config):
    out, call = _linear_call(x, packed, bias, out, config)
    if call is not None:
        call()
    return out


def _linear_call(x, packed, bias, out, config):
    """The output and the checked kernel call that fills it (None: nothing to compute)."""
    variant_for_input(weight_packed_linear.kernels, x, "x")  # the dtype and device checks
    n, k = _checked_packed(packed)
    shape = x.shape
    m, _, x2, ldx = matrix_rows(x, "x", k, "packed's K")
    if bias is not None:
        same_dtype(bias, "bias", x, "x")
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},) to match packed's N, got {tuple(bias.shape)}")
        bias = bias.contiguous()
    out_shape = (*shape[:-1], n)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype)
        out2 = out.view(m, n)
    else:
        checked_out(out, out_shape, x)
        check_no_overlap(out, "out", x, "x")  # rows of x are read across K while out's are written
        check_no_overlap(out, "out", packed.packed, "packed")
        out2 = _rows_of_out(out, m, n)
    if m == 0 or n == 0:
        return out, None
    variant = (
        _chosen_variant(x.dtype, m, n, k) if config is None else GEMM.variant(dtype=DTYPE_NAMES[x.dtype], **config)
    )
    weight, bias_address = packed.packed.data_ptr(), 0 if bias is None else bias.data_ptr()
    out_rows, panel_width, threads = out2.stride(0), packed.panel_width, num_threads()
    kernel_args = (out2.data_ptr(), out_rows, x2.data_ptr(), ldx, weight, panel_width, bias_address, m, n, k, threads)
    linear = variant.kernel().linear

    def call() -> None:
        raise_for_status(linear(*kernel_args), "weight_packed_linear")

    return out, BoundCall(call, x2, out2, packed.packed, bias)  # x2 and bias may be copies: held with the call


def packed_shape(n: int, k: int, panel_width: int = PANEL_WIDTH) -> tuple[int, int, int, int]:
    """Shape of the packed tensor of a weight ``[n, k]``: panels, K pairs, columns, 2."""
    return (-(-n // panel_width), -(-k // 2), panel_width, 2)


def _checked_packed(packed: object) -> tuple[int, int]:
    return check_packed(
        packed,
        PackedWeight,
        "convert_weight_packed",
        LAYOUT_VERSION,
        lambda p: [
            ("packed", torch.bfloat16, packed_shape(p.n, p.k, _panel_width(p))),
        ],
    )


def checked_packed_weight(packed: object) -> tuple[int, int]:
    """(N, K) of a :class:`PackedWeight`, checked as :func:`weight_packed_linear` checks it: for ops
    that check their weights once and run :func:`linear_variant`'s kernel on them many times."""
    return _checked_packed(packed)


def linear_variant(dtype: torch.dtype, m: int, n: int, k: int) -> Variant:
    """The GEMM variant :func:`weight_packed_linear` runs for ``x [m, k]`` of ``dtype`` times a packed
    ``[n, k]`` weight: the tile tuned for the shape's bucket on this tier, else the tier's default."""
    return _chosen_variant(dtype, m, n, k)


def _panel_width(packed: PackedWeight) -> int:
    """A multiple of PANEL_WIDTH, which every tile's NR divides: then the weight runs under every tier
    and tuned choice alike, rather than under some and not others."""
    width = packed.panel_width
    if isinstance(width, bool) or not isinstance(width, int) or width < PANEL_WIDTH or width % PANEL_WIDTH:
        raise ValueError(
            f"packed.panel_width must be a multiple of {PANEL_WIDTH} (convert_weight_packed's layout), got {width!r}"
        )
    return width


def _rows_of_out(out: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``out [..., N]`` as ``[M, N]`` rows over the same memory (the kernel writes through it)."""
    try:
        return out.view(m, n)
    except RuntimeError:
        raise ValueError(
            f"out of shape {tuple(out.shape)} and strides {tuple(out.stride())}: its leading "
            "dimensions cannot be merged into one row index without a copy"
        ) from None


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    return linear_kernels(spec.linear_shapes(), spec.dtype, spec.router_dtype)


def linear_kernels(linear_shapes: Mapping, dtype, router_dtype) -> list[dict]:
    """The GEMM variants dispatch picks for ``linear_shapes`` (name -> ``(n, k)``) at every row bucket
    (tuned or default), as pre-warm manifest entries: in ``dtype``, the ``"router"`` in ``router_dtype``
    (fp32 for DeepSeek's)."""
    tier, configs = isa.selected_tier(), {}
    for name, (n, k) in linear_shapes.items():
        x_dtype = TORCH_DTYPES[dtype_name(router_dtype if name == "router" else dtype)]
        for m in sorted({m_bucket(1 << i) for i in range(11)}):
            params = dict(TILE_CANDIDATES.choose(tile_shape(x_dtype, m, n, k), tier=tier).params)
            params = {
                "dtype": DTYPE_NAMES[x_dtype],
                **{key: list(v) if isinstance(v, tuple) else v for key, v in params.items()},
            }
            configs[tuple(sorted((key, str(v)) for key, v in params.items()))] = params
    return [{"module": "gemm", "params": params} for params in configs.values()]
