"""Four-bit weights: the checkpoint packings (AWQ, GPTQ, compressed-tensors), kernforge's layout and
quantizer, and the two ops, W4A8 (``int4_scaled_mm_cpu``) and W4A16 (``int4_w4a16_linear``).

References, from exact to approximate:
* packings against bit patterns written by hand (one nibble set per column / K / group);
* W4A8's int32 group sums (``int4_group_sums``) bit-exact against float64 sums of the int8 activations
  (``per_token_quant_int8``'s, as the op quantizes them) times ``code - zero``;
* W4A8's output against those sums scaled in float64; W4A16's against float64 ``x @ dequantized(W).T``:
  the only differences are fp32 accumulation and the output dtype's rounding.
"""

import io

import pytest
import torch

import kernforge
from kernforge.ops.gemm import int4
from kernforge.ops.gemm.int4 import (
    AWQ,
    GPTQ,
    PACK_QUANTIZED,
    PackedInt4Weight,
    convert_weight_packed_scale_zp,
    dequantize_int4,
    int4_group_sums,
    int4_scaled_mm_cpu,
    int4_w4a16_linear,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from kernforge.ops.gemm.int8 import per_token_quant_int8

from op_helpers import seeded

ROWS = [1, 2, 3, 4, 5, 33, 130]
# (N, K, group): N off the 32/64-column tiles, one group, groups longer than a K block (128), small ones
SHAPES = [(1, 32, 32), (17, 64, 32), (100, 256, 64), (130, 384, 128), (64, 512, 512), (33, 96, 96)]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}  # relative to max |ref|
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]


def _packed(n, k, group, symmetric=False):
    g = seeded("gemm-int4-w", n, k, group)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0, 0], codes[-1, -1] = 0, 15  # the extremes
    groups = k // group
    zeros = torch.full((groups, n), 8, dtype=torch.uint8)
    if not symmetric:
        zeros = torch.randint(0, 17, (groups, n), generator=g, dtype=torch.uint8)  # 16: GPTQ's z - 1 + 1
    scales = torch.rand(groups, n, generator=g) * 1e-2 + 1e-3
    return pack_int4(codes, zeros, scales)


def _x(m, k, dtype, key=()):
    return torch.randn(m, k, generator=seeded("gemm-int4-x", m, k, *key)).to(dtype)


def _values(packed):
    """(code - zero) [N, K] in float64."""
    codes, zeros, _ = unpack_int4(packed)
    return codes.double() - zeros.t().double().repeat_interleave(packed.group_size, dim=1)


def _group_sums_reference(x, packed):
    q, _ = per_token_quant_int8(x)
    m, groups, size = q.shape[0], packed.k // packed.group_size, packed.group_size
    a = (q.double() - 128).view(m, groups, size)
    return torch.einsum("mgk,ngk->mgn", a, _values(packed).view(packed.n, groups, size))


def _w4a8_reference(x, packed, bias=None):
    _, scale = per_token_quant_int8(x)
    ref = (_group_sums_reference(x, packed) * packed.scales.double()[None]).sum(1) * scale.double()[:, None]
    return ref if bias is None else ref + bias.double()


def _w4a16_reference(x, packed, bias=None):
    ref = x.double() @ dequantize_int4(packed, torch.float64).t()
    return ref if bias is None else ref + bias.double()


def _assert_close(actual, expected, dtype):
    assert actual.dtype is dtype
    tol = TOLERANCE[dtype] * max(expected.abs().max().item(), 1e-6)
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=tol)


# --------------------------------------------------------------------------- checkpoint packings


def test_awq_nibble_order():
    """AWQ: column 8c + j of word c sits in nibble (0, 4, 1, 5, 2, 6, 3, 7)[j]."""
    k, n, order = 32, 8, (0, 4, 1, 5, 2, 6, 3, 7)
    codes = torch.tensor([[(kk + 3 * j) % 16 for j in range(n)] for kk in range(k)])  # [K, N]
    words = torch.zeros(k, 1, dtype=torch.int64)
    for j in range(n):
        words[:, 0] |= codes[:, j] << (4 * order[j])
    zero_codes = torch.tensor([[j + 1 for j in range(n)]])
    zero_word = sum(int(zero_codes[0, j]) << (4 * order[j]) for j in range(n))
    qweight, qzeros = _int32(words), _int32(torch.tensor([[zero_word]]))
    scales = torch.full((1, n), 0.5, dtype=torch.float16)
    packed = PackedInt4Weight.from_tensors(*convert_weight_packed_scale_zp(qweight, qzeros, scales, AWQ))
    got_codes, got_zeros, got_scales = unpack_int4(packed)
    assert torch.equal(got_codes, codes.t().to(torch.uint8))
    assert torch.equal(got_zeros, zero_codes.to(torch.uint8))
    assert got_scales.dtype is torch.float32 and torch.all(got_scales == 0.5)


def _int32(words):
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_gptq_packs_along_k_and_stores_zero_minus_one():
    """GPTQ: word r of column n holds K 8r .. 8r + 7, lowest nibble first; qzeros along N hold z - 1."""
    k, n, group = 64, 8, 32
    codes = torch.tensor([[(3 * kk + j) % 16 for j in range(n)] for kk in range(k)])  # [K, N]
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for i in range(8):
        words |= codes[i::8] << (4 * i)
    stored = torch.tensor([[(g + j) % 16 for j in range(n)] for g in range(k // group)])  # z - 1 (mod 16)
    zero_words = torch.zeros(k // group, 1, dtype=torch.int64)
    for j in range(n):
        zero_words[:, 0] |= stored[:, j] << (4 * j)
    scales = torch.rand(k // group, n).half()
    packed = PackedInt4Weight.from_tensors(
        *convert_weight_packed_scale_zp(_int32(words), _int32(zero_words), scales, GPTQ)
    )
    got_codes, got_zeros, got_scales = unpack_int4(packed)
    assert torch.equal(got_codes, codes.t().to(torch.uint8))
    assert torch.equal(got_zeros, (stored + 1).to(torch.uint8))  # 15 + 1 = 16: GPTQ's own dequantization
    assert torch.equal(got_scales, scales.float())
    assert packed.group_size == group


def test_pack_quantized_is_symmetric_offset_8():
    """compressed-tensors pack-quantized: weight_packed [N, K/8] along K, scales [N, G], zero 8."""
    n, k, group = 3, 64, 32
    codes = torch.tensor([[(kk * 5 + j) % 16 for kk in range(k)] for j in range(n)])  # [N, K]
    words = torch.zeros(n, k // 8, dtype=torch.int64)
    for i in range(8):
        words |= codes[:, i::8] << (4 * i)
    scales = torch.rand(n, k // group).bfloat16()
    packed = PackedInt4Weight.from_tensors(*convert_weight_packed_scale_zp(_int32(words), None, scales, PACK_QUANTIZED))
    got_codes, got_zeros, got_scales = unpack_int4(packed)
    assert torch.equal(got_codes, codes.to(torch.uint8))
    assert torch.all(got_zeros == 8) and torch.equal(got_scales, scales.float().t())


def test_layout_bit_pattern():
    """kernforge's layout by hand: byte b of chunk h of quad q: column 32h + b//4 (low nibble), column
    32h + 16 + b//4 (high nibble), K 4q + b%4; panels of 64 columns; padding columns hold 0."""
    n, k = 70, 8
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[0, 0] = 1  # panel 0, quad 0, chunk 0, byte 0, low
    codes[16, 1] = 2  # byte 1, high
    codes[33, 6] = 3  # quad 1, chunk 1, byte 4 + 2, low
    codes[69, 7] = 4  # panel 1, chunk 0, byte 4 * 5 + 3, low
    packed = pack_int4(codes, torch.zeros(1, n, dtype=torch.uint8), torch.ones(1, n))
    expected = torch.zeros(2, 2, 128, dtype=torch.uint8)
    expected[0, 0, 0] = 1
    expected[0, 0, 1] = 2 << 4
    expected[0, 1, 64 + 6] = 3
    expected[1, 1, 23] = 4
    assert torch.equal(packed.packed, expected)
    assert torch.equal(unpack_int4(packed)[0], codes)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_quantize_int4_rounds_to_nearest(symmetric):
    w = torch.randn(37, 256, generator=seeded("gemm-int4-q", symmetric))
    w[3] = 0  # constant groups: GPTQ's [-1, 1] range, exact zeros
    w[4, :128] = 2.5
    packed = quantize_int4(w, group_size=64, symmetric=symmetric)
    codes, zeros, scales = unpack_int4(packed)
    if symmetric:
        assert torch.all(zeros == 8)
    else:
        assert int(zeros.max()) <= 15
    step = scales.t().repeat_interleave(64, dim=1)
    err = (dequantize_int4(packed) - w).abs()
    assert torch.all(err <= step / 2 + 1e-6)  # round to nearest on the grid (the range holds every w)
    assert torch.all(dequantize_int4(packed)[3] == 0)


# --------------------------------------------------------------------------- the ops


@pytest.mark.parametrize("n,k,group", SHAPES, ids=[f"n{n}_k{k}_g{g}" for n, k, g in SHAPES])
@pytest.mark.parametrize("m", ROWS)
def test_w4a8_group_sums_are_exact(tier, m, n, k, group):
    packed = _packed(n, k, group)
    x = _x(m, k, torch.bfloat16, (n, group))
    sums = int4_group_sums(x, packed)
    assert sums.dtype is torch.int32 and sums.shape == (m, k // group, n)
    assert torch.equal(sums.double(), _group_sums_reference(x, packed))


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,k,group", SHAPES, ids=[f"n{n}_k{k}_g{g}" for n, k, g in SHAPES])
@pytest.mark.parametrize("m", ROWS)
def test_w4a8_and_w4a16_match_references(tier, m, n, k, group, dtype, with_bias):
    packed = _packed(n, k, group, symmetric=(m % 2 == 0))
    x = _x(m, k, dtype, (n, group))
    bias = torch.randn(n, generator=seeded("gemm-int4-b", n)) if with_bias else None
    w, w_zeros, w_scales = packed
    _assert_close(int4_scaled_mm_cpu(x, w, w_zeros, w_scales, bias), _w4a8_reference(x, packed, bias), dtype)
    _assert_close(int4_w4a16_linear(x, w, w_zeros, w_scales, bias), _w4a16_reference(x, packed, bias), dtype)


@pytest.mark.parametrize("op", [int4_scaled_mm_cpu, int4_w4a16_linear], ids=["w4a8", "w4a16"])
def test_leading_dims_strided_rows_and_empty(tier, op):
    packed = _packed(40, 128, 64)
    backing = _x(6, 256, torch.bfloat16)
    x = backing[:, :128].view(2, 3, 128)  # rows 256 elements apart
    out = op(x, packed)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out, op(x.contiguous(), packed))
    assert op(torch.empty(0, 128, dtype=torch.bfloat16), packed).shape == (0, 40)


def test_packed_weight_survives_torch_save_and_one_object_forms():
    packed = _packed(20, 64, 32)
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True by default
    x = _x(3, 64, torch.bfloat16)
    expected = int4_scaled_mm_cpu(x, *packed)
    assert torch.equal(int4_scaled_mm_cpu(x, loaded), expected)
    assert torch.equal(int4_scaled_mm_cpu(x, packed, packed.zeros, packed.scales), expected)


def test_custom_ops_trace(tier):
    packed = _packed(33, 64, 32)
    x = _x(2, 64, torch.bfloat16)
    for name, op in (("int4_scaled_mm_cpu", int4_scaled_mm_cpu), ("int4_w4a16_linear", int4_w4a16_linear)):
        traced = getattr(torch.ops.kernforge, name)(x, *packed)
        assert torch.equal(traced, op(x, packed))
    compiled = torch.compile(lambda t: kernforge.torch_library.int4_scaled_mm_cpu(t, *packed), backend="eager")
    assert torch.equal(compiled(x), int4_scaled_mm_cpu(x, packed))


# --------------------------------------------------------------------------- bad input


def test_bad_input_raises_naming_the_argument():
    packed = _packed(20, 64, 32)
    w, zeros, scales = packed
    x = _x(2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        int4_scaled_mm_cpu(_x(2, 63, torch.bfloat16), w, zeros, scales)
    with pytest.raises(TypeError, match="x has dtype"):
        int4_scaled_mm_cpu(x.to(torch.int32), w, zeros, scales)
    with pytest.raises(TypeError, match="w has dtype"):
        int4_scaled_mm_cpu(x, w.to(torch.int8), zeros, scales)
    with pytest.raises(TypeError, match="w_scales has dtype"):
        int4_w4a16_linear(x, w, zeros, scales.half())
    with pytest.raises(ValueError, match="does not match w_scales"):
        int4_scaled_mm_cpu(x, _packed(70, 64, 32).packed, zeros, scales)  # 2 panels for N = 20
    with pytest.raises(ValueError, match="w_zeros must be None"):
        int4_scaled_mm_cpu(x, packed, zeros.clone(), None)
    with pytest.raises(TypeError, match="w_zeros and w_scales are required"):
        int4_scaled_mm_cpu(x, w)
    with pytest.raises(ValueError, match="bias must have shape"):
        int4_scaled_mm_cpu(x, w, zeros, scales, torch.zeros(19))
    with pytest.raises(ValueError, match="zeros must lie in"):
        pack_int4(torch.zeros(4, 64, dtype=torch.uint8), torch.full((2, 4), 17, dtype=torch.uint8), torch.ones(2, 4))
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_int4(torch.full((4, 64), 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), torch.ones(2, 4))
    with pytest.raises(ValueError, match="groups of a multiple of 4"):
        pack_int4(torch.zeros(4, 60, dtype=torch.uint8), torch.zeros(7, 4, dtype=torch.uint8), torch.ones(7, 4))
    with pytest.raises(ValueError, match="group_size must be a multiple of 4 that divides K"):
        quantize_int4(torch.randn(4, 100), group_size=64)
    with pytest.raises(ValueError, match="quant_method_4bit must be one of"):
        convert_weight_packed_scale_zp(torch.zeros(8, 1, dtype=torch.int32), None, torch.ones(1, 8), 7)
    with pytest.raises(TypeError, match="qweight must be a 2-D torch.int32"):
        convert_weight_packed_scale_zp(torch.zeros(8, 1, dtype=torch.int64), None, torch.ones(1, 8), AWQ)
    with pytest.raises(ValueError, match="qzeros unpacks to"):
        convert_weight_packed_scale_zp(
            torch.zeros(32, 1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), torch.ones(1, 8), AWQ
        )


def test_nothing_is_written_on_bad_input():
    """A refused call returns before any kernel runs: the weight's tensors are untouched."""
    packed = _packed(20, 64, 32)
    before = [t.clone() for t in packed]
    with pytest.raises(ValueError):
        int4_scaled_mm_cpu(_x(2, 32, torch.bfloat16), packed)
    assert all(torch.equal(a, b) for a, b in zip(packed, before))


def test_layout_version_is_checked():
    packed = _packed(20, 64, 32)
    stale = PackedInt4Weight(packed.packed, packed.zeros, packed.scales, 20, 64, 32, layout_version=0)
    with pytest.raises(ValueError, match="layout version"):
        int4_scaled_mm_cpu(_x(1, 64, torch.bfloat16), stale)
    assert int4.LAYOUT_VERSION == 1


# --------------------------------------------------------------------------- AMX tiles, emulated


def _amx_emulated():
    from kernforge.jit import core, isa
    from kernforge.jit.module import Entry, Module

    if not isa.runnable("avx512"):
        pytest.skip("the emulated AMX kernels are built on the avx512 tier, which this CPU cannot run")
    module = Module(
        "gemm_int4_amx_emulated",
        "gemm_int4_amx_emulated.cpp.jinja",
        params=int4.GEMM_INT4.params,
        structs=[int4.INT4_GEMM_ARGS],
        entries=[*int4.GEMM_INT4.entries.values(), Entry("take_counters", "int64_t counters")],
        tiers={"avx512": "avx512"},
        register=False,
    )
    return core.load_kernel(module, {"dtype": "bf16", **int4.DEFAULT_BLOCKING}, "avx512")


def _counters(kernel) -> list[int]:
    counters = torch.zeros(3, dtype=torch.int64)
    kernel.take_counters(counters.data_ptr())
    return counters.tolist()


@pytest.mark.usefixtures("test_templates")
@pytest.mark.parametrize("m,n,k,group", [(5, 64, 128, 128), (40, 70, 256, 32), (130, 33, 192, 96)])
def test_amx_tiles_match_references(m, n, k, group):
    """From 5 rows on, both ops multiply the unpacked blocks on (emulated) tiles: int8 tiles for W4A8,
    bf16 tiles for W4A16 (K tails of a 64-byte step included: groups of 32 and 96)."""
    kernel = _amx_emulated()
    _counters(kernel)
    packed = _packed(n, k, group, symmetric=(m % 2 == 0))
    x = _x(m, k, torch.bfloat16, ("amx", n))
    bias = torch.randn(n, generator=seeded("gemm-int4-b", n))
    for entry, quantizes, reference in (("w4a8", True, _w4a8_reference), ("w4a16", False, _w4a16_reference)):
        out = torch.empty(m, n, dtype=torch.bfloat16)
        int4._call(getattr(kernel, entry), quantizes, kernel, packed, x, k, bias.float(), out, n, m)
        faults, _, dot_products = _counters(kernel)
        assert faults == 0 and dot_products > 0, f"{entry}: the tiles were not used, or misused"
        _assert_close(out, reference(x, packed, bias), torch.bfloat16)


# --------------------------------------------------------------------------- blocking candidates, tuner


@pytest.mark.parametrize("candidate", int4.INT4_CANDIDATES.candidates + [int4.INT4_CANDIDATES.reference], ids=str)
def test_every_blocking_candidate_matches(tier, candidate):
    """Each blocking the tuner may pick computes the same product (rows around every row block and
    few-rows threshold)."""
    packed = _packed(70, 256, 64)
    for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 65, 129, 257):
        x = _x(m, 256, torch.bfloat16, ("blocking",))
        for w4a8, reference in ((True, _w4a8_reference), (False, _w4a16_reference)):
            _assert_close(int4.linear_with_config(x, packed, candidate.params, w4a8), reference(x, packed), x.dtype)


def test_tune_int4_records_the_winner_where_dispatch_finds_it(kernforge_cache_dir):
    fastest = {"row_block": 256, "few_rows": 4}
    (result,) = kernforge.tune_int4([200], [(96, 128)], measure=lambda c, run: 0.5 if c == fastest else 1.0)
    assert result["config"] == fastest and result["default"] == int4.DEFAULT_BLOCKING
    shape = int4.tile_shape(torch.bfloat16, 200, 96, 128, 128)
    assert int4.INT4_CANDIDATES.choose(shape).params == fastest
    packed = _packed(96, 128, 128)
    x = _x(200, 128, torch.bfloat16)
    _assert_close(int4_scaled_mm_cpu(x, packed), _w4a8_reference(x, packed), torch.bfloat16)  # runs the winner
    with pytest.raises(ValueError, match="positive M, N and K"):
        kernforge.tune_int4([0], [(8, 8)])
