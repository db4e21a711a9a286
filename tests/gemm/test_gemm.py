"""Numerical tests for the prepacked bf16 linear: ``convert_weight_packed`` + ``weight_packed_linear``.

The reference is fp32 torch matmul of the same (bf16) operands. Accumulation is fp32 in both, so
the difference is the rounding of the output (rtol) plus summation order, which grows with sqrt(K)
(atol). Shapes cover every tail: M not a multiple of MR, N not a multiple of the panel width, odd K.
"""

import dataclasses
import io
import json
import logging
import subprocess
import sys

import pytest
import torch

import kernforge
from kernforge.jit import tuning
from kernforge.ops.gemm import bf16
from kernforge.ops.gemm.bf16 import (
    DEFAULT_BLOCKING,
    GEMM,
    LAYOUT_VERSION,
    TILE_CANDIDATES,
    PackedWeight,
    config_name,
    convert_weight_packed,
    gemm_config,
    linear_with_config,
    linear_with_tile,
    tile_shape,
    weight_packed_linear,
)

from conftest import clean_env
from op_helpers import seeded
from references import linear_reference

ROWS = [1, 2, 7, 16, 33, 256]
NK = [(1, 1), (15, 17), (17, 15), (1, 17), (1000, 1030)]
LARGE_NK = [(4095, 4109), (4109, 4095)]  # one short of and past 4096: every panel, K block and pair tail
# (rtol, atol per sqrt(K)) by output dtype
TOLERANCE = {torch.bfloat16: (1e-2, 1e-3), torch.float16: (1e-3, 1e-3), torch.float32: (1e-5, 1e-5)}


def _operands(m, n, k, dtype=torch.bfloat16, bias=False, key=()):
    g = seeded("gemm", m, n, k, *key)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _assert_matches(actual, expected, dtype, k):
    rtol, atol = TOLERANCE[dtype]
    assert actual.dtype is dtype
    torch.testing.assert_close(actual.float(), expected, rtol=rtol, atol=atol * max(k, 1) ** 0.5)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n,k", NK, ids=[f"n{n}_k{k}" for n, k in NK])
@pytest.mark.parametrize("m", ROWS)
def test_linear_matches_fp32_matmul(tier, m, n, k, with_bias):
    x, w, b = _operands(m, n, k, bias=with_bias)
    out = weight_packed_linear(x, convert_weight_packed(w), b)
    assert out.shape == (m, n)
    _assert_matches(out, linear_reference(x, w, b), torch.bfloat16, k)


@pytest.mark.parametrize("n,k", LARGE_NK, ids=[f"n{n}_k{k}" for n, k in LARGE_NK])
def test_large_n_and_k_match_fp32_matmul(tier, n, k):
    x, w, b = _operands(33, n, k, bias=True, key=("large",))
    packed = convert_weight_packed(w)
    for rows in (x[:1], x):  # the one-row path and a row block with a tail of every tile
        _assert_matches(weight_packed_linear(rows, packed, b), linear_reference(rows, w, b), torch.bfloat16, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_linear_takes_fp32_and_fp16_activations(dtype):
    x, w, b = _operands(33, 47, 129, dtype, bias=True)
    _assert_matches(weight_packed_linear(x, convert_weight_packed(w), b), linear_reference(x, w, b), dtype, 129)


def test_leading_dims_and_strided_rows_never_touch_outside(tier):
    """x [2, 3, K] read from rows padded with NaN (an odd K's missing pair element must not be
    read); out written into rows of a wider buffer whose padding must stay untouched."""
    n, k = 37, 21
    _, w, b = _operands(6, n, k, bias=True)
    backing = torch.full((2, 3, k + 3), float("nan"), dtype=torch.bfloat16)
    backing[..., :k] = torch.randn(2, 3, k, generator=seeded("gemm-x")).bfloat16()
    x = backing[..., :k]
    out_backing = torch.full((2, 3, n + 5), -7.0, dtype=torch.bfloat16)
    out = out_backing[..., :n]
    result = weight_packed_linear(x, convert_weight_packed(w), b, out=out)
    assert result is out
    _assert_matches(out, linear_reference(x, w, b), torch.bfloat16, k)
    assert torch.all(out_backing[..., n:] == -7.0)


def test_strided_last_dim_and_thread_counts_agree():
    x, w, _ = _operands(40, 70, 300)
    packed = convert_weight_packed(w)
    x_strided = torch.empty(40, 600, dtype=torch.bfloat16)[:, ::2]
    x_strided.copy_(x)
    try:
        kernforge.ops.set_num_threads(1)
        one = weight_packed_linear(x_strided, packed)
        kernforge.ops.set_num_threads(2)
        two = weight_packed_linear(x, packed)
    finally:
        kernforge.ops.set_num_threads(None)
    assert torch.equal(one, two)  # each output element is summed in the same order however it is split


def test_empty_m_and_k():
    _, w, b = _operands(1, 9, 0, bias=True)
    packed = convert_weight_packed(w)
    assert torch.equal(weight_packed_linear(torch.empty(4, 0, dtype=torch.bfloat16), packed, b), b.expand(4, 9))
    assert weight_packed_linear(torch.empty(0, 0, dtype=torch.bfloat16), packed).shape == (0, 9)


# --------------------------------------------------------------------------- candidates

# Every candidate of every tier applies to CANDIDATE_SHAPE: M past one row block of 64 (and 128) with a
# tail for every MR, K past two K blocks of 256 and one of 512 and odd, N two panels of 32 with a tail;
# (1, 17, 15) takes the one-row path.
CANDIDATE_SHAPE = (263, 47, 517)
TILE_SHAPES = [(1, 17, 15), CANDIDATE_SHAPE]
WIDEST_SHAPE = {"m": 1024, "n": 4096, "k": 4096}  # a shape every candidate applies to


def _configs_for(dtype, m, n, k, tier):
    return [dict(c.params) for c in TILE_CANDIDATES.applicable(tile_shape(dtype, m, n, k), tier)]


def _assert_every_candidate_matches(dtype, m, n, k, key):
    """Each applicable candidate on the current tier against fp32 matmul, on 2 threads (both splits of
    the tasks between threads)."""
    x, w, b = _operands(m, n, k, dtype, bias=True, key=key)
    packed, expected = convert_weight_packed(w), linear_reference(x, w, b)
    rtol, atol = TOLERANCE[dtype]
    try:
        kernforge.ops.set_num_threads(2)
        for config in _configs_for(dtype, m, n, k, GEMM.built_tier(kernforge.jit.isa.selected_tier())):
            torch.testing.assert_close(
                linear_with_config(x, packed, config, b).float(),
                expected,
                rtol=rtol,
                atol=atol * k**0.5,
                msg=lambda text: f"{config_name(config)}: {text}",
            )
    finally:
        kernforge.ops.set_num_threads(None)


@pytest.mark.parametrize("m,n,k", TILE_SHAPES, ids=[f"m{m}_n{n}_k{k}" for m, n, k in TILE_SHAPES])
def test_every_bf16_candidate_matches_fp32_matmul(tier, m, n, k):
    _assert_every_candidate_matches(torch.bfloat16, m, n, k, ("tiles",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_every_fp32_and_fp16_candidate_matches(tier, dtype):
    _assert_every_candidate_matches(dtype, *CANDIDATE_SHAPE, ("tiles",))


def test_the_tests_cover_every_candidate_and_rank_the_default_first():
    for tier in ("avx512", "avx2", "generic"):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            name = kernforge.ops._registry.DTYPE_NAMES[dtype]
            listed = [
                c.params
                for c in [*TILE_CANDIDATES.candidates, TILE_CANDIDATES.reference]
                if tier in c.tiers and c.when({**WIDEST_SHAPE, "dtype": name})
            ]
            assert _configs_for(dtype, *CANDIDATE_SHAPE, tier) == listed, (tier, name)
    # kf::gemm::DefaultTile with the default blocking: 8 x 32 for vdpbf16ps, 4 x 32 for the AVX-512 FMA
    # path, 4 x 16 below, whatever M and K; except bf16 on avx512 with K over one block, where the
    # 512-deep K block is the default (measured faster on Zen 5)
    for dtype, tier, tile in [
        (torch.bfloat16, "avx512", (8, 32)),
        (torch.float32, "avx512", (4, 32)),
        (torch.float16, "avx512", (4, 32)),
        (torch.bfloat16, "avx2", (4, 16)),
        (torch.float32, "generic", (4, 16)),
    ]:
        for m in (1, 7, 300, 2048):
            for k in (1, 4096):
                deep = dtype == torch.bfloat16 and tier == "avx512" and k > DEFAULT_BLOCKING["depth_block"]
                expected = gemm_config(tile, depth_block=512) if deep else gemm_config(tile)
                assert TILE_CANDIDATES.default(tile_shape(dtype, m, 64, k), tier).params == expected
    assert _configs_for(torch.bfloat16, 1, 64, 64, "avx512") == [gemm_config((8, 32)), gemm_config((1, 16))]

    # blocking is tuned where it changes something: K over one K block, M over one row block
    def blocked(m, k):
        configs = _configs_for(torch.bfloat16, m, 64, k, "avx512")
        return [c for c in configs if {name: c[name] for name in DEFAULT_BLOCKING} != DEFAULT_BLOCKING]

    assert blocked(64, 256) == []
    assert blocked(64, 257) == [gemm_config((8, 32), depth_block=512)]
    assert blocked(65, 256) == [gemm_config((8, 32), row_block=128), gemm_config((8, 32), split="m")]


def test_config_must_be_a_module_config():
    x, w, _ = _operands(2, 8, 16)
    packed = convert_weight_packed(w)
    with pytest.raises(ValueError, match="parameter tile must be one of"):
        linear_with_tile(x, packed, (3, 32))
    with pytest.raises(ValueError, match="parameter depth_block must be one of 256, 512"):
        linear_with_config(x, packed, {"tile": (8, 32), "depth_block": 100})
    with pytest.raises(ValueError, match="unknown parameter 'threads'"):
        linear_with_config(x, packed, {"tile": (8, 32), "threads": 2})


# --------------------------------------------------------------------------- tuning


@pytest.fixture
def tuning_cache(cache):
    """A fresh cache (so a fresh tuning store) and no remembered dispatch choices."""
    bf16.reset_tile_choices()
    yield cache
    bf16.reset_tile_choices()


def _dispatched(m, n, k, dtype=torch.bfloat16):
    """The config weight_packed_linear runs for this shape (the variant's parameters but the dtype)."""
    return {name: value for name, value in bf16._chosen_variant(dtype, m, n, k).params.items() if name != "dtype"}


def test_tuned_config_is_dispatched_for_its_bucket_only(tuning_cache):
    n, k = 40, 600
    tier = GEMM.built_tier(kernforge.jit.isa.selected_tier())
    configs = _configs_for(torch.bfloat16, 200, n, k, tier)
    default, forced = configs[0], configs[-2]  # the last before the reference: a blocking where there is one
    timed = []

    def fake_timer(config, run):  # says `forced` is the fastest; each candidate's numerics are tested above
        timed.append(config)
        return 0.5 if config == forced else 1.0

    (result,) = kernforge.tune_gemm([200], [(n, k)], measure=fake_timer)
    assert result["config"] == forced and result["default"] == default and result["m_bucket"] == 256
    assert timed == configs  # every applicable candidate, the default first, once each
    assert set(result["seconds"]) == {config_name(c) for c in configs}
    for m in (129, 256):  # one bucket: 129..256 rows
        x, w, b = _operands(m, n, k, bias=True, key=("tuned",))
        _assert_matches(
            weight_packed_linear(x, convert_weight_packed(w), b), linear_reference(x, w, b), torch.bfloat16, k
        )
        assert _dispatched(m, n, k) == forced
    assert _dispatched(128, n, k) == default  # another bucket
    assert _dispatched(200, n, k + 2) == default  # another K


@pytest.mark.parametrize("gain, wins", [(0.02, False), (0.05, True)], ids=["within-noise", "faster"])
def test_the_default_is_kept_unless_another_is_clearly_faster(tuning_cache, gain, wins):
    """The tuned choice is never slower than the default as measured: the default is always timed,
    and another candidate must beat it by more than min_gain (3%)."""
    tier = GEMM.built_tier(kernforge.jit.isa.selected_tier())
    configs = _configs_for(torch.bfloat16, 16, 40, 64, tier)
    fastest = configs[1]
    (result,) = kernforge.tune_gemm([16], [(40, 64)], measure=lambda c, run: 1.0 - gain if c == fastest else 1.0)
    assert result["config"] == (fastest if wins else configs[0])
    assert _dispatched(16, 40, 64) == result["config"]


def test_recorded_config_is_used_and_a_corrupt_record_is_ignored(tuning_cache, caplog):
    m, n, k = 33, 47, 129
    tier = GEMM.built_tier(kernforge.jit.isa.selected_tier())
    configs = _configs_for(torch.bfloat16, m, n, k, tier)
    bucket = TILE_CANDIDATES.bucket(tile_shape(torch.bfloat16, m, n, k))
    recorded = {**configs[-1], "tile": list(configs[-1]["tile"])}  # as JSON has it
    tuning.TuningStore().record("weight_packed_linear", bucket, tier, recorded, {})
    x, w, b = _operands(m, n, k, bias=True, key=("recorded",))
    packed, expected = convert_weight_packed(w), linear_reference(x, w, b)
    _assert_matches(weight_packed_linear(x, packed, b), expected, torch.bfloat16, k)
    assert _dispatched(m, n, k) == configs[-1]

    (tuning_cache / "tuning" / "weight_packed_linear.json").write_text("{not json")
    bf16.reset_tile_choices()
    logger = logging.getLogger("kernforge")
    logger.addHandler(caplog.handler)  # kernforge's logger does not propagate to the root
    try:
        _assert_matches(weight_packed_linear(x, packed, b), expected, torch.bfloat16, k)
    finally:
        logger.removeHandler(caplog.handler)
    assert "corrupt tuning file" in caplog.text
    assert _dispatched(m, n, k) == configs[0]


def test_tune_cli_records_winners(tuning_cache):
    out = subprocess.run(
        [sys.executable, "-m", "kernforge", "tune", "gemm", "--m", "1", "3", "--nk", "17x15", "--threads", "1"],
        env=clean_env(KERNFORGE_CACHE_DIR=tuning_cache),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "bf16 m=1 (bucket 1) n=17 k=15" in out.stdout and "bf16 m=3 (bucket 4) n=17 k=15" in out.stdout
    records = json.loads((tuning_cache / "tuning" / "weight_packed_linear.json").read_text())
    assert sorted(r["bucket"] for r in records.values()) == ["bf16_m1_n17_k15", "bf16_m4_n17_k15"]
    bad = subprocess.run(
        [sys.executable, "-m", "kernforge", "tune", "gemm", "--m", "1", "--nk", "17by15"],
        env=clean_env(KERNFORGE_CACHE_DIR=tuning_cache),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--nk takes NxK" in bad.stderr


def test_tune_gemm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="positive M, N and K"):
        kernforge.tune_gemm([0], [(8, 8)])
    with pytest.raises(TypeError, match="dtype must be one of"):
        kernforge.tune_gemm([1], [(8, 8)], dtype=torch.int8)


# --------------------------------------------------------------------------- the packed weight


@pytest.mark.parametrize(
    "module, cls",
    [
        ("kernforge.ops.gemm", "PackedWeight"),
        ("kernforge.ops.gemm_int8", "PackedInt8Weight"),
        ("kernforge.ops.gemm_fp8", "PackedFp8Weight"),
    ],
)
def test_weights_saved_under_the_flat_module_names_still_load(module, cls, monkeypatch):
    """Files saved before the GEMM ops became a package name their classes kernforge.ops.gemm_int8...
    (pickle writes a class's module and name): torch.load's default weights_only=True takes them."""
    import sys
    import types

    import kernforge.ops.gemm as family

    found = next(getattr(m, cls) for m in (family.bf16, family.int8, family.fp8) if hasattr(m, cls))
    fields = {f: torch.zeros(1) if f in ("packed", "compensation", "scale") else 1 for f in found.__dataclass_fields__}
    saved = found(**fields)
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{cls: found}))
    monkeypatch.setattr(found, "__module__", module)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    monkeypatch.undo()
    assert module.encode() in buffer.getvalue()
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert type(loaded) is found and loaded.n == saved.n


def test_packed_weight_round_trips_through_torch_save():
    x, w, b = _operands(3, 50, 33, bias=True)
    packed = convert_weight_packed(w)
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # torch's default weights_only=True: PackedWeight is an allowed global
    assert isinstance(loaded, PackedWeight) and loaded.shape == (50, 33) and loaded.dtype is torch.bfloat16
    assert loaded.layout_version == LAYOUT_VERSION and torch.equal(loaded.packed, packed.packed)
    assert torch.equal(weight_packed_linear(x, loaded, b), weight_packed_linear(x, packed, b))


def test_packed_layout_is_the_same_on_every_tier():
    """No tier has a layout of its own: a weight packed while one tier is forced runs under another."""
    m, n, k = 33, 47, 129
    x, w, b = _operands(m, n, k, bias=True, key=("tiers",))
    tiers = kernforge.jit.isa.runnable_tiers()
    packed = {}
    for t in tiers:
        with kernforge.use_isa(t):
            packed[t] = convert_weight_packed(w)
    assert all(torch.equal(packed[t].packed, packed[tiers[0]].packed) for t in tiers)
    for packed_under, run_under in zip(tiers, [*tiers[1:], tiers[0]]):
        with kernforge.use_isa(run_under):
            _assert_matches(
                weight_packed_linear(x, packed[packed_under], b), linear_reference(x, w, b), torch.bfloat16, k
            )


def test_packed_weight_of_another_layout_is_refused():
    x, w, _ = _operands(2, 8, 16)
    older = dataclasses.replace(convert_weight_packed(w), layout_version=LAYOUT_VERSION - 1)
    buffer = io.BytesIO()
    torch.save(older, buffer)  # as an older kernforge would have saved it
    buffer.seek(0)
    with pytest.raises(
        ValueError,
        match=f"packed has layout version {LAYOUT_VERSION - 1}; this kernforge reads "
        f"version {LAYOUT_VERSION}: pack the weight again",
    ):
        weight_packed_linear(x, torch.load(buffer))
    # NR 16 tiles could read 16-column panels, NR 32 ones could not: refused whatever the tier and tile
    narrow = PackedWeight(torch.zeros(bf16.packed_shape(8, 16, 16), dtype=torch.bfloat16), 8, 16, panel_width=16)
    with pytest.raises(ValueError, match="packed.panel_width must be a multiple of 32"):
        weight_packed_linear(x, narrow)


def test_packed_layout_is_vnni2_panels():
    w = torch.arange(40 * 5, dtype=torch.float32).view(40, 5).bfloat16()
    p = convert_weight_packed(w).packed
    assert p.shape == (2, 3, 32, 2)  # 40 columns -> 2 panels of 32; K 5 -> 3 pairs
    assert torch.equal(p[1, 1, 3], w[35, 2:4])  # panel 1, pair 1, column 3 holds W[35][2], W[35][3]
    assert torch.equal(p[1, 2, 3], torch.stack([w[35, 4], torch.zeros((), dtype=torch.bfloat16)]))
    assert torch.all(p[1, :, 8:] == 0)  # columns 40.. of the last panel are zero padding


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    x, w, b = _operands(2, 8, 16, bias=True)
    packed = convert_weight_packed(w)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 16\]"):
        weight_packed_linear(torch.randn(2, 15).bfloat16(), packed)
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        weight_packed_linear(torch.ones(2, 16, dtype=torch.int32), packed)
    with pytest.raises(ValueError, match="x is on device meta"):
        weight_packed_linear(torch.empty(2, 16, dtype=torch.bfloat16, device="meta"), packed)
    with pytest.raises(TypeError, match="packed must be a PackedWeight"):
        weight_packed_linear(x, w)
    with pytest.raises(ValueError, match="packed has layout version 99"):
        weight_packed_linear(x, PackedWeight(packed.packed, 8, 16, layout_version=99))
    with pytest.raises(ValueError, match="packed.packed must be"):
        weight_packed_linear(x, PackedWeight(packed.packed, 8, 18))
    with pytest.raises(TypeError, match="bias has dtype torch.float32 but x has torch.bfloat16"):
        weight_packed_linear(x, packed, b.float())
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        weight_packed_linear(x, packed, b[:7])
    with pytest.raises(ValueError, match=r"out must have shape \(2, 8\)"):
        weight_packed_linear(x, packed, out=torch.empty(2, 9, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out has dtype torch.float32"):
        weight_packed_linear(x, packed, out=torch.empty(2, 8))
    with pytest.raises(TypeError, match="weight has dtype torch.float32"):
        convert_weight_packed(w.float())
    with pytest.raises(ValueError, match="weight is on device meta"):
        convert_weight_packed(torch.empty(8, 16, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match=r"weight must be 2-D \[N, K\]"):
        convert_weight_packed(w[0])
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        convert_weight_packed([[1.0]])


def test_ops_are_exported():
    assert kernforge.weight_packed_linear is weight_packed_linear
    assert kernforge.convert_weight_packed is convert_weight_packed
    assert kernforge.tune_gemm is kernforge.tune.tune_gemm
