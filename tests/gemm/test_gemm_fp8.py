"""Numerical tests for the fp8 block-scaled GEMM (DeepSeek-V3 style, sgl-kernel's fp8_scaled_mm
semantics): ``convert_weight_packed_fp8`` and ``fp8_scaled_mm``.

Reference: fp32 torch of the dequantized weight, ``x.float() @ (w.float() * S).T`` with ``S`` the
block scales expanded to ``[N, K]``. The kernel converts e4m3 exactly and accumulates in fp32, so the
differences are fp32 summation order (relative ~K * 2^-24) and the output dtype's rounding.

The kernel has two paths, by the rows M of x: weights converted in registers where they are used
(small M) and weights converted to bf16 pairs once per task and K block for the bf16 micro-kernel
(large M). The ``path`` fixture forces each, on every tier, whatever M is.
"""

import io

import pytest
import torch

import kernforge
from kernforge.ops.gemm import fp8
from kernforge.ops.gemm.fp8 import LAYOUT_VERSION, PackedFp8Weight, convert_weight_packed_fp8, fp8_scaled_mm

from op_helpers import seeded
from references import fp8_block_linear_reference

ROWS = [1, 2, 7, 33]
NK = [(1, 1), (17, 129), (129, 17), (300, 300), (1, 300)]
BLOCK = (128, 128)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}


PATHS = {"in_registers": fp8.NEVER, "converting": 1}  # a convert_from_rows that sends every M down it


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    """Run the test on one of the kernel's two paths, whatever M is."""
    monkeypatch.setattr(fp8, "convert_from_rows", lambda dtype: PATHS[request.param])
    return request.param


def _weight(n, k, block=BLOCK, key=()):
    g = seeded("gemm-fp8-w", n, k, *block, *key)
    # clamped: a checkpoint's weights are finite, and torch 2.11 casts overflow to NaN (2.13 saturates)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 1e-2 + 1e-3
    return w, scale


def _activation(m, k, dtype=torch.bfloat16, key=()):
    return torch.randn(m, k, generator=seeded("gemm-fp8-x", m, k, *key)).to(dtype)


def _assert_matches(actual, expected, dtype, k):
    assert actual.dtype is dtype
    rtol = TOLERANCE[dtype]
    # fp32 accumulation over k terms adds ~k * 2^-24 of the largest partial sum on top of out's rounding.
    atol = (rtol + k * 2.0**-24) * expected.abs().max().item() + 1e-6
    torch.testing.assert_close(actual.float(), expected, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", NK)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_dequantized_fp32(tier, path, m, n, k, with_bias):
    w, scale = _weight(n, k)
    x = _activation(m, k)
    bias = torch.randn(n, generator=seeded("gemm-fp8-b", n)) if with_bias else None
    out = fp8_scaled_mm(x, convert_weight_packed_fp8(w, scale, BLOCK), scale, BLOCK, bias)
    _assert_matches(out, fp8_block_linear_reference(x, w, scale, BLOCK, bias), torch.bfloat16, k)


@pytest.mark.parametrize("block", [(1, 1), (16, 48), (64, 300), (200, 7)])
def test_other_block_sizes(tier, path, block):
    """Blocks of N that are not a multiple of the tile width, K blocks of any depth (1, odd, or all of K)."""
    n, k = 150, 300
    w, scale = _weight(n, k, block)
    x = _activation(9, k)
    out = fp8_scaled_mm(x, convert_weight_packed_fp8(w, scale, block), scale, block)
    _assert_matches(out, fp8_block_linear_reference(x, w, scale, block), torch.bfloat16, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_activations(path, dtype):
    w, scale = _weight(70, 260)
    x = _activation(5, 260, dtype)
    out = fp8_scaled_mm(x, convert_weight_packed_fp8(w, scale), scale, out_dtype=dtype)
    _assert_matches(out, fp8_block_linear_reference(x, w, scale, BLOCK), dtype, 260)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_e4m3_value_converts_exactly_in_every_position(tier, path, dtype):
    """Every finite code (subnormals, -0) at every column of a 64-wide panel and in both halves of a
    K pair (the byte interleave and table lookups of the VBMI conversions), read back through
    x = identity against torch's own widening. Exact: e4m3 * 2 is a bf16."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    k = codes.numel()
    shift = torch.arange(64)[:, None] + torch.arange(k)[None, :]  # column n, row k: code (n + k) mod 254
    w = codes[shift % k].view(torch.float8_e4m3fn)
    scale = torch.full((1, 2), 2.0)
    out = fp8_scaled_mm(torch.eye(k, dtype=dtype), convert_weight_packed_fp8(w, scale), scale, out_dtype=dtype)
    assert torch.equal(out.float(), (w.float() * 2).T)


def test_dispatch_by_rows(tier):
    """AVX-512 converts per K block from a measured M on; AVX2 and generic always convert in registers."""
    expected = 96 if tier in ("avx512", "amx") else fp8.NEVER
    assert fp8.convert_from_rows(torch.bfloat16) == expected


def test_large_m_tasks_and_deep_k_blocks(tier, path):
    """Over 256 rows (several row tasks, a partial last one), a tail of columns, and K blocks that the
    converting path's 512-deep conversion chunks hold several of (128), one of (300), or only part
    of (600, in two pieces)."""
    for block in [(128, 128), (64, 300), (100, 600)]:
        w, scale = _weight(100, 600, block, key=("large",))
        x = _activation(300, 600, key=("large",))
        out = fp8_scaled_mm(x, convert_weight_packed_fp8(w, scale, block), scale, block)
        _assert_matches(out, fp8_block_linear_reference(x, w, scale, block), torch.bfloat16, 600)


def test_nan_weights_are_refused():
    w = torch.zeros(3, 4, dtype=torch.uint8)
    w[1, 2] = 0xFF
    with pytest.raises(ValueError, match="weight holds NaN"):
        convert_weight_packed_fp8(w.view(torch.float8_e4m3fn), torch.ones(1, 1))


def test_leading_dims_and_strided_rows(tier, path):
    w, scale = _weight(40, 130)
    packed = convert_weight_packed_fp8(w, scale)
    wide = _activation(6, 2 * 130)
    x = wide[:, ::2]  # rows 2 * 130 apart, elements 2 apart: read through a copy, never past the end
    out = fp8_scaled_mm(x.reshape(2, 3, 130), packed, scale)
    assert out.shape == (2, 3, 40)
    _assert_matches(out.reshape(6, 40), fp8_block_linear_reference(x, w, scale, BLOCK), torch.bfloat16, 130)


def test_thread_counts_agree(path):
    w, scale = _weight(300, 260)
    packed, x = convert_weight_packed_fp8(w, scale), _activation(300, 260)
    previous = kernforge.num_threads()
    try:
        kernforge.set_num_threads(1)
        single = fp8_scaled_mm(x, packed, scale)
        kernforge.set_num_threads(2)
        assert torch.equal(fp8_scaled_mm(x, packed, scale), single)
    finally:
        kernforge.set_num_threads(previous)


def test_empty_m_and_k(path):
    w, scale = _weight(5, 0)
    bias = torch.arange(5, dtype=torch.float32)
    out = fp8_scaled_mm(torch.zeros(3, 0, dtype=torch.bfloat16), convert_weight_packed_fp8(w, scale), scale, bias=bias)
    assert torch.equal(out.float(), bias.expand(3, 5))
    w, scale = _weight(5, 7)
    assert fp8_scaled_mm(torch.zeros(0, 7, dtype=torch.bfloat16), convert_weight_packed_fp8(w, scale), scale).shape == (
        0,
        5,
    )


# --------------------------------------------------------------------------- packing


def test_packed_weight_stays_fp8_and_round_trips_through_torch_save():
    w, scale = _weight(70, 33)
    packed = convert_weight_packed_fp8(w, scale)
    assert packed.packed.dtype is torch.float8_e4m3fn and packed.packed.numel() == 128 * 33
    assert packed.shape == (70, 33) and packed.block_size == BLOCK and packed.layout_version == LAYOUT_VERSION
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True: PackedFp8Weight is an allowed global
    assert isinstance(loaded, PackedFp8Weight)
    x = _activation(3, 33)
    assert torch.equal(fp8_scaled_mm(x, loaded, scale), fp8_scaled_mm(x, packed, scale))


def test_packed_layout_is_k_rows_of_panel_columns():
    w, scale = _weight(70, 5)
    packed = convert_weight_packed_fp8(w, scale).packed.view(torch.uint8)
    assert packed.shape == (2, 5, 64)
    assert torch.equal(packed[0, 3, :], w.view(torch.uint8)[:64, 3])
    assert torch.equal(packed[1, 2, :6], w.view(torch.uint8)[64:, 2])
    assert not packed[1, :, 6:].any()  # N padding is zero weights


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    w, scale = _weight(20, 40)
    packed = convert_weight_packed_fp8(w, scale)
    x = _activation(2, 40)
    with pytest.raises(TypeError, match="weight has dtype"):
        convert_weight_packed_fp8(w.float(), scale)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        convert_weight_packed_fp8(w.reshape(20, 40, 1), scale)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(1, 1\)"):
        convert_weight_packed_fp8(w, torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(2, 3\)"):
        fp8_scaled_mm(x, packed, scale, (16, 16))
    with pytest.raises(TypeError, match="weight_scale has dtype"):
        fp8_scaled_mm(x, packed, scale.double())
    with pytest.raises(ValueError, match="block_size must be two sizes"):
        fp8_scaled_mm(x, packed, scale, (128,))
    with pytest.raises(ValueError, match="block_size must hold two positive sizes"):
        fp8_scaled_mm(x, packed, scale, (0, 128))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 40\] to match packed's K"):
        fp8_scaled_mm(_activation(2, 41), packed, scale)
    with pytest.raises(TypeError, match="x has dtype"):
        fp8_scaled_mm(x.to(torch.int32), packed, scale)
    with pytest.raises(TypeError, match="out_dtype is torch.float32 but x has dtype"):
        fp8_scaled_mm(x, packed, scale, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"bias must have shape \(20,\)"):
        fp8_scaled_mm(x, packed, scale, bias=torch.zeros(21))
    with pytest.raises(TypeError, match="packed must be a PackedFp8Weight"):
        fp8_scaled_mm(x, w, scale)
    stale = PackedFp8Weight(packed.packed, scale, BLOCK, 20, 40, layout_version=0)
    with pytest.raises(ValueError, match="packed has layout version 0"):
        fp8_scaled_mm(x, stale, scale)
    with pytest.raises(ValueError, match="packed.packed must be"):
        fp8_scaled_mm(x, PackedFp8Weight(packed.packed[:, :10], scale, BLOCK, 20, 40), scale)
    with pytest.raises(ValueError, match="packed.panel_width must be a multiple of 64"):
        fp8_scaled_mm(x, PackedFp8Weight(packed.packed, scale, BLOCK, 20, 40, panel_width=0), scale)


def test_ops_are_exported():
    assert kernforge.fp8_scaled_mm is fp8_scaled_mm
    assert kernforge.convert_weight_packed_fp8 is convert_weight_packed_fp8
