"""Numerical tests for the int8 w8a8 GEMM (sgl-kernel semantics): ``per_token_quant_int8``,
``convert_weight_packed_int8``, ``int8_scaled_mm``, ``int8_scaled_mm_with_quant``.

Three references, from exact to approximate:
* quantization bit-exact against torch: ``round_half_even(x * (127 / amax)) + 128`` with ``127 / amax``
  a true fp32 division, as sgl-kernel's C++ (torch's ``127 / t`` is ``127 * (1 / t)``: not the same);
* the int32 accumulator (``int8_accumulate``) bit-exact against a float64 matmul of the int8 operands
  (every partial sum is an integer below 2^53, so float64 is exact);
* the scaled result against fp32 torch of the dequantized operands: the accumulation is exact, so the
  only differences are fp32 rounding of the scaling and the output dtype's rounding.
"""

import io

import pytest
import torch

import kernforge
from kernforge.ops.gemm.int8 import (
    LAYOUT_VERSION,
    PackedInt8Weight,
    convert_weight_packed_int8,
    int8_accumulate,
    int8_scaled_mm,
    int8_scaled_mm_with_quant,
    per_token_quant_int8,
)

from op_helpers import seeded
from references import int8_accumulate_reference, int8_linear_reference, per_token_quant_reference

ROWS = [1, 2, 7, 33, 256]
NK = [(1, 1), (15, 17), (17, 15), (1, 4095), (1000, 1030)]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}  # rtol; atol scales with |ref|


def _weight(n, k, key=()):
    g = seeded("gemm-int8-w", n, k, *key)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 1e-2 + 1e-3
    return w, scale


def _activation(m, k, dtype=torch.bfloat16, key=()):
    return torch.randn(m, k, generator=seeded("gemm-int8-x", m, k, *key)).to(dtype)


def _assert_matches(actual, expected, dtype):
    assert actual.dtype is dtype
    rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected, rtol=rtol, atol=rtol * expected.abs().max().item() + 1e-6)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("k", [1, 15, 17, 4095])
@pytest.mark.parametrize("m", ROWS)
def test_per_token_quant_is_bit_exact(tier, m, k):
    x = _activation(m, k)
    q, scale = per_token_quant_int8(x)
    ref_q, ref_scale = per_token_quant_reference(x)
    assert q.dtype is torch.uint8 and scale.dtype is torch.float32 and scale.shape == (m,)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_per_token_quant_takes_fp32_and_fp16(dtype):
    x = _activation(5, 100, dtype)
    x[1] = 0  # an all-zero row: scale 1e-7 / 127, every value at the zero point
    q, scale = per_token_quant_int8(x)
    ref_q, ref_scale = per_token_quant_reference(x)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale) and torch.all(q[1] == 128)


@pytest.mark.parametrize("n,k", NK, ids=[f"n{n}_k{k}" for n, k in NK])
@pytest.mark.parametrize("m", ROWS)
def test_int32_accumulation_is_exact(tier, m, n, k):
    """Activations over the whole uint8 range (0 and 255 included), weights over the whole int8 range."""
    w, w_scale = _weight(n, k)
    a_q = torch.randint(0, 256, (m, k), generator=seeded("gemm-int8-a", m, n, k), dtype=torch.uint8)
    a_q[0, 0], a_q[-1, -1] = 0, 255
    acc = int8_accumulate(a_q, convert_weight_packed_int8(w, w_scale))
    assert acc.dtype is torch.int32
    assert torch.equal(acc, int8_accumulate_reference(a_q, w).to(torch.int32))


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n,k", NK, ids=[f"n{n}_k{k}" for n, k in NK])
@pytest.mark.parametrize("m", ROWS)
def test_scaled_mm_matches_dequantized_fp32(tier, m, n, k, with_bias):
    x = _activation(m, k)
    w, w_scale = _weight(n, k)
    bias = torch.randn(n, generator=seeded("gemm-int8-b", n)) if with_bias else None
    packed = convert_weight_packed_int8(w, w_scale)
    a_q, a_scale = per_token_quant_int8(x)
    out = int8_scaled_mm(a_q, packed, a_scale, bias)
    assert out.shape == (m, n)
    _assert_matches(out, int8_linear_reference(a_q, a_scale, w, w_scale, bias), torch.bfloat16)
    # The fused op quantizes the same way inside the call: identical bits.
    assert torch.equal(int8_scaled_mm_with_quant(x, packed, bias), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp32_and_fp16_outputs(dtype):
    x = _activation(33, 129, dtype)
    w, w_scale = _weight(47, 129)
    bias = torch.randn(47, generator=seeded("gemm-int8-b", 47)).to(dtype)  # any float bias, added in fp32
    packed = convert_weight_packed_int8(w, w_scale.view(47, 1))  # [N, 1] scales, as sgl-kernel allows
    a_q, a_scale = per_token_quant_int8(x)
    out = int8_scaled_mm(a_q, packed, a_scale.view(33, 1), bias, out_dtype=dtype)
    _assert_matches(out, int8_linear_reference(a_q, a_scale, w, w_scale, bias), dtype)
    assert torch.equal(int8_scaled_mm_with_quant(x, packed, bias, out_dtype=dtype), out)


def test_leading_dims_and_strided_rows_never_read_outside(tier):
    """x [2, 3, K] read from rows padded with NaN: a K tail's missing group bytes must not be read."""
    n, k = 37, 21
    w, w_scale = _weight(n, k)
    packed = convert_weight_packed_int8(w, w_scale)
    backing = torch.full((2, 3, k + 3), float("nan"), dtype=torch.bfloat16)
    backing[..., :k] = _activation(6, k).view(2, 3, k)
    x = backing[..., :k]
    out = int8_scaled_mm_with_quant(x, packed)
    a_q, a_scale = per_token_quant_int8(x)
    assert a_q.shape == (2, 3, k) and a_scale.shape == (2, 3) and out.shape == (2, 3, n)
    expected = int8_linear_reference(a_q.view(6, k), a_scale, w, w_scale, None).view(2, 3, n)
    _assert_matches(out, expected, torch.bfloat16)
    q_backing = torch.full((2, 3, k + 5), 7, dtype=torch.uint8)
    q_backing[..., :k] = a_q
    assert torch.equal(int8_scaled_mm(q_backing[..., :k], packed, a_scale), out)


def test_thread_counts_agree():
    x = _activation(70, 300)
    w, w_scale = _weight(200, 300)
    packed = convert_weight_packed_int8(w, w_scale)
    try:
        kernforge.ops.set_num_threads(1)
        one = int8_scaled_mm_with_quant(x, packed)
        kernforge.ops.set_num_threads(2)
        two = int8_scaled_mm_with_quant(x, packed)
    finally:
        kernforge.ops.set_num_threads(None)
    assert torch.equal(one, two)


def test_empty_m_and_k():
    w, w_scale = _weight(9, 0)
    bias = torch.randn(9)
    packed = convert_weight_packed_int8(w, w_scale)
    out = int8_scaled_mm_with_quant(torch.empty(4, 0, dtype=torch.bfloat16), packed, bias)
    assert torch.equal(out, bias.bfloat16().expand(4, 9))
    assert int8_scaled_mm_with_quant(torch.empty(0, 0, dtype=torch.bfloat16), packed).shape == (0, 9)
    q, scale = per_token_quant_int8(torch.empty(0, 5, dtype=torch.bfloat16))
    assert q.shape == (0, 5) and scale.shape == (0,)


# --------------------------------------------------------------------------- the packed weight


def test_packed_weight_round_trips_through_torch_save():
    x = _activation(3, 33)
    w, w_scale = _weight(50, 33)
    packed = convert_weight_packed_int8(w, w_scale)
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # torch's default weights_only=True: PackedInt8Weight is an allowed global
    assert isinstance(loaded, PackedInt8Weight) and loaded.shape == (50, 33)
    assert loaded.layout_version == LAYOUT_VERSION and torch.equal(loaded.packed, packed.packed)
    assert torch.equal(int8_scaled_mm_with_quant(x, loaded), int8_scaled_mm_with_quant(x, packed))


def test_packed_layout_is_vnni4_panels_with_compensation():
    w = (torch.arange(70 * 6) % 251 - 125).to(torch.int8).view(70, 6)
    packed = convert_weight_packed_int8(w, torch.ones(70))
    p = packed.packed
    assert p.shape == (2, 2, 64, 4)  # 70 columns -> 2 panels of 64; K 6 -> 2 groups of 4
    assert torch.equal(p[1, 0, 3], w[67, 0:4])  # panel 1, group 0, column 3 holds W[67][0..3]
    assert torch.equal(p[1, 1, 3], torch.cat([w[67, 4:6], torch.zeros(2, dtype=torch.int8)]))
    assert torch.all(p[1, :, 6:] == 0)  # columns 70.. of the last panel are zero padding
    assert torch.equal(packed.compensation, 128 * w.sum(1, dtype=torch.int32))


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    w, w_scale = _weight(8, 16)
    packed = convert_weight_packed_int8(w, w_scale)
    x = _activation(2, 16)
    a_q, a_scale = per_token_quant_int8(x)
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        per_token_quant_int8(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="x is on device meta"):
        per_token_quant_int8(torch.empty(2, 16, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(TypeError, match="a_q has dtype torch.int8"):
        int8_scaled_mm(a_q.to(torch.int8), packed, a_scale)
    with pytest.raises(ValueError, match=r"a_q must be \[\.\.\., 16\] to match packed's K"):
        int8_scaled_mm(a_q[:, :15], packed, a_scale)
    with pytest.raises(TypeError, match="a_scale has dtype torch.bfloat16"):
        int8_scaled_mm(a_q, packed, a_scale.bfloat16())
    with pytest.raises(ValueError, match=r"a_scale must hold one scale per row of a_q \(2\)"):
        int8_scaled_mm(a_q, packed, a_scale[:1])
    with pytest.raises(TypeError, match="out_dtype must be"):
        int8_scaled_mm(a_q, packed, a_scale, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="packed must be a PackedInt8Weight"):
        int8_scaled_mm(a_q, w, a_scale)
    with pytest.raises(ValueError, match="packed has layout version 99"):
        int8_scaled_mm(
            a_q, PackedInt8Weight(packed.packed, packed.compensation, packed.scale, 8, 16, layout_version=99), a_scale
        )
    with pytest.raises(ValueError, match="packed.compensation must be"):
        int8_scaled_mm(a_q, PackedInt8Weight(packed.packed, packed.compensation[:7], packed.scale, 8, 16), a_scale)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        int8_scaled_mm(a_q, packed, a_scale, torch.zeros(7))
    with pytest.raises(TypeError, match="bias has dtype torch.int64"):
        int8_scaled_mm_with_quant(x, packed, torch.zeros(8, dtype=torch.int64))
    with pytest.raises(TypeError, match="out_dtype is torch.float16 but x has dtype torch.bfloat16"):
        int8_scaled_mm_with_quant(x, packed, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 16\]"):
        int8_scaled_mm_with_quant(x[:, :3], packed)
    with pytest.raises(TypeError, match="weight has dtype torch.float32"):
        convert_weight_packed_int8(w.float(), w_scale)
    with pytest.raises(ValueError, match=r"weight must be 2-D \[N, K\]"):
        convert_weight_packed_int8(w[0], w_scale)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(8,\) or \(8, 1\)"):
        convert_weight_packed_int8(w, w_scale[:4])
    with pytest.raises(TypeError, match="weight_scale has dtype torch.int32"):
        convert_weight_packed_int8(w, torch.ones(8, dtype=torch.int32))
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        convert_weight_packed_int8([[1]], w_scale)


def test_ops_are_exported():
    assert kernforge.per_token_quant_int8 is per_token_quant_int8
    assert kernforge.convert_weight_packed_int8 is convert_weight_packed_int8
    assert kernforge.int8_scaled_mm is int8_scaled_mm
    assert kernforge.int8_scaled_mm_with_quant is int8_scaled_mm_with_quant
