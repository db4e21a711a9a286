"""Numerical tests for the prepacked bf16 linear: ``convert_weight_packed`` + ``weight_packed_linear``.

The reference is fp32 torch matmul of the same (bf16) operands. Accumulation is fp32 in both, so
the difference is the rounding of the output (rtol) plus summation order, which grows with sqrt(K)
(atol). Shapes cover every tail: M not a multiple of MR, N not a multiple of the panel width, odd K.
"""

import io
import json
import logging
import subprocess
import sys

import pytest
import torch

import kernforge
from conftest import clean_env
from kernforge.jit import tuning
from kernforge.ops import gemm
from kernforge.ops.gemm import (GEMM, LAYOUT_VERSION, TILE_CANDIDATES, PackedWeight, convert_weight_packed,
                                linear_with_tile, tile_shape, weight_packed_linear)
from op_helpers import seeded

ROWS = [1, 2, 7, 16, 33, 256]
NK = [(1, 1), (15, 17), (17, 15), (1, 17), (1000, 1030)]
# (rtol, atol per sqrt(K)) by output dtype
TOLERANCE = {torch.bfloat16: (1e-2, 1e-3), torch.float16: (1e-3, 1e-3), torch.float32: (1e-5, 1e-5)}


def _operands(m, n, k, dtype=torch.bfloat16, bias=False, key=()):
    g = seeded("gemm", m, n, k, *key)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _reference(x, w, b):
    ref = x.float() @ w.float().T
    return ref if b is None else ref + b.float()


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
    _assert_matches(out, _reference(x, w, b), torch.bfloat16, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_linear_takes_fp32_and_fp16_activations(dtype):
    x, w, b = _operands(33, 47, 129, dtype, bias=True)
    _assert_matches(weight_packed_linear(x, convert_weight_packed(w), b), _reference(x, w, b), dtype, 129)


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
    _assert_matches(out, _reference(x, w, b), torch.bfloat16, k)
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


# --------------------------------------------------------------------------- tile candidates

TILE_SHAPES = [(1, 17, 15), (33, 47, 129)]  # between them every candidate of every tier applies


def _tiles_for(dtype, m, n, k, tier):
    return [c.params["tile"] for c in TILE_CANDIDATES.applicable(tile_shape(dtype, m, n, k), tier)]


@pytest.mark.parametrize("m,n,k", TILE_SHAPES, ids=[f"m{m}_n{n}_k{k}" for m, n, k in TILE_SHAPES])
def test_every_tile_candidate_matches_fp32_matmul(tier, m, n, k):
    x, w, b = _operands(m, n, k, bias=True, key=("tiles",))
    packed, expected = convert_weight_packed(w), _reference(x, w, b)
    for tile in _tiles_for(torch.bfloat16, m, n, k, GEMM.built_tier(tier)):
        rtol, atol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(linear_with_tile(x, packed, tile, b).float(), expected, rtol=rtol,
                                   atol=atol * k ** 0.5, msg=lambda text: f"tile {tile}: {text}")


def test_every_fp32_tile_candidate_matches():
    m, n, k = 33, 47, 129
    x, w, b = _operands(m, n, k, torch.float32, bias=True, key=("tiles",))
    packed, expected = convert_weight_packed(w), _reference(x, w, b)
    for tile in _tiles_for(torch.float32, m, n, k, GEMM.built_tier(kernforge.jit.isa.selected_tier())):
        _assert_matches(linear_with_tile(x, packed, tile, b), expected, torch.float32, k)


def test_tile_candidates_cover_every_tile_and_default_to_the_default_tile():
    for tier in ("avx512", "avx2", "generic"):
        tested = {t for m, n, k in TILE_SHAPES for t in _tiles_for(torch.bfloat16, m, n, k, tier)}
        listed = {c.params["tile"] for c in [*TILE_CANDIDATES.candidates, TILE_CANDIDATES.reference]
                  if tier in c.tiers and c.when({"dtype": "bf16", "m": 1024, "n": 1, "k": 1})}
        assert tested == listed, tier
    # kf::gemm::DefaultTile: 8 x 32 for vdpbf16ps, 4 x 32 for the AVX-512 FMA path, 4 x 16 below
    for dtype, tier, tile in [(torch.bfloat16, "avx512", (8, 32)), (torch.float32, "avx512", (4, 32)),
                              (torch.float16, "avx512", (4, 32)), (torch.bfloat16, "avx2", (4, 16)),
                              (torch.float32, "generic", (4, 16))]:
        for m in (1, 7, 300):
            assert TILE_CANDIDATES.default(tile_shape(dtype, m, 64, 64), tier).params["tile"] == tile
    assert _tiles_for(torch.bfloat16, 1, 64, 64, "avx512") == [(8, 32), (1, 16)]  # M = 1: no row-only variants


def test_tile_must_be_a_candidate_tile():
    x, w, _ = _operands(2, 8, 16)
    with pytest.raises(ValueError, match="parameter tile must be one of"):
        linear_with_tile(x, convert_weight_packed(w), (3, 32))


# --------------------------------------------------------------------------- tuning


@pytest.fixture
def tuning_cache(cache):
    """A fresh cache (so a fresh tuning store) and no remembered dispatch choices."""
    gemm.reset_tile_choices()
    yield cache
    gemm.reset_tile_choices()


def _dispatched_tile(m, n, k, dtype=torch.bfloat16):
    return gemm._chosen_variant(dtype, m, n, k).params["tile"]


def test_tuned_tile_is_dispatched_for_its_bucket_only(tuning_cache):
    n, k = 40, 64
    tier = GEMM.built_tier(kernforge.jit.isa.selected_tier())
    default, forced = _tiles_for(torch.bfloat16, 16, n, k, tier)[:2]
    timed = []

    def fake_timer(tile, run):  # runs the candidate once, then says `forced` is the fastest
        run()
        timed.append(tile)
        return 0.5 if tile == forced else 1.0

    result, = kernforge.tune_gemm([16], [(n, k)], measure=fake_timer)
    assert result["tile"] == forced and result["default"] == default and result["m_bucket"] == 16
    assert timed == _tiles_for(torch.bfloat16, 16, n, k, tier)  # every applicable candidate, once
    for m in (9, 16):  # one bucket: 9..16 rows
        x, w, b = _operands(m, n, k, bias=True, key=("tuned",))
        _assert_matches(weight_packed_linear(x, convert_weight_packed(w), b), _reference(x, w, b), torch.bfloat16, k)
        assert _dispatched_tile(m, n, k) == forced
    assert _dispatched_tile(8, n, k) == default  # another bucket: nothing recorded
    assert _dispatched_tile(16, n, k + 2) == default  # another K


def test_recorded_tile_is_used_and_a_corrupt_record_is_ignored(tuning_cache, caplog):
    m, n, k = 33, 47, 129
    tier = GEMM.built_tier(kernforge.jit.isa.selected_tier())
    tiles = _tiles_for(torch.bfloat16, m, n, k, tier)
    bucket = TILE_CANDIDATES.bucket(tile_shape(torch.bfloat16, m, n, k))
    tuning.TuningStore().record("weight_packed_linear", bucket, tier, {"tile": list(tiles[-1])}, {})
    x, w, b = _operands(m, n, k, bias=True, key=("recorded",))
    packed, expected = convert_weight_packed(w), _reference(x, w, b)
    _assert_matches(weight_packed_linear(x, packed, b), expected, torch.bfloat16, k)
    assert _dispatched_tile(m, n, k) == tiles[-1]

    (tuning_cache / "tuning" / "weight_packed_linear.json").write_text("{not json")
    gemm.reset_tile_choices()
    logger = logging.getLogger("kernforge")
    logger.addHandler(caplog.handler)  # kernforge's logger does not propagate to the root
    try:
        _assert_matches(weight_packed_linear(x, packed, b), expected, torch.bfloat16, k)
    finally:
        logger.removeHandler(caplog.handler)
    assert "corrupt tuning file" in caplog.text
    assert _dispatched_tile(m, n, k) == tiles[0]


def test_tune_cli_records_winners(tuning_cache):
    out = subprocess.run([sys.executable, "-m", "kernforge", "tune", "gemm", "--m", "1", "3", "--nk", "17x15",
                          "--threads", "1"], env=clean_env(KERNFORGE_CACHE_DIR=tuning_cache),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "bf16 m=1 (bucket 1) n=17 k=15" in out.stdout and "bf16 m=3 (bucket 4) n=17 k=15" in out.stdout
    records = json.loads((tuning_cache / "tuning" / "weight_packed_linear.json").read_text())
    assert sorted(r["bucket"] for r in records.values()) == ["bf16_m1_n17_k15", "bf16_m4_n17_k15"]
    bad = subprocess.run([sys.executable, "-m", "kernforge", "tune", "gemm", "--m", "1", "--nk", "17by15"],
                         env=clean_env(KERNFORGE_CACHE_DIR=tuning_cache), capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--nk takes NxK" in bad.stderr


def test_tune_gemm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="positive M, N and K"):
        kernforge.tune_gemm([0], [(8, 8)])
    with pytest.raises(TypeError, match="dtype must be one of"):
        kernforge.tune_gemm([1], [(8, 8)], dtype=torch.int8)


# --------------------------------------------------------------------------- the packed weight


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
    assert kernforge.tune_gemm is gemm.tune_gemm
