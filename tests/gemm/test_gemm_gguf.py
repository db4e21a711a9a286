"""llama.cpp's block types (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): repacking against llama.cpp's own
dequantization (``gguf.quants.dequantize``, bit for bit), and ``gguf_linear`` against float64
``x_q @ W.T``, with ``x_q`` the activations quantized per block of 32 as the op quantizes them
(``quantize_activations``): the only differences are fp32 accumulation and the output's rounding."""

import io

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

import kernforge
from kernforge.ops.gemm import gguf as G

from op_helpers import seeded

TYPES = list(G.TYPES)
# (N, K): N off the 32/64-column tiles, K not a multiple of 256 where the type's blocks allow it
SHAPES = {32: [(1, 32), (33, 96), (130, 160), (64, 512)], 256: [(1, 256), (33, 256), (130, 512), (65, 768)]}
ROWS = [1, 2, 3, 5, 33, 70]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}  # relative to max |ref|
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n: int, k: int, key=()) -> torch.Tensor:
    """Random bytes for every field of ``n`` rows of ``qtype`` blocks, the fp16 scales finite and small."""
    bt = G.BLOCK_TYPES[qtype]
    g = seeded("gguf-blocks", qtype, n, k, *key)
    raw = torch.randint(0, 256, (n, k // bt.block, bt.size), generator=g, dtype=torch.uint8)
    for start in _HALF_FIELDS[qtype]:
        half = (torch.rand(n, k // bt.block, generator=g) * 0.02 + 1e-3).to(torch.float16)
        raw[..., start : start + 2] = half.view(torch.uint8).view(n, k // bt.block, 2)
    return raw.reshape(n, -1)


def llama_cpp_values(raw: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype]).reshape(n, k).copy())


def _shapes(qtype):
    return SHAPES[G.BLOCK_TYPES[qtype].block]


@pytest.mark.parametrize("qtype", TYPES)
def test_repacked_values_are_llama_cpps_bit_for_bit(qtype):
    for n, k in _shapes(qtype):
        raw = random_blocks(qtype, n, k)
        expected = llama_cpp_values(raw, qtype, n, k)
        packed = G.pack_gguf(raw, qtype, n, k)
        assert torch.equal(G.dequantize(packed), expected)
        rows = torch.tensor([n - 1, 0, n // 2])
        assert torch.equal(G.dequantize_rows(raw, qtype, k, rows), expected[rows])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_llama_cpps_own_quantizer_round_trips(qtype):
    """Blocks written by gguf's quantizer (llama.cpp's reference rounding), not random bytes."""
    weight = torch.randn(48, 128, generator=seeded("gguf-quantize", qtype)).numpy()
    raw = torch.from_numpy(quants.quantize(weight, gguf.GGMLQuantizationType[qtype]))
    assert torch.equal(G.dequantize(G.pack_gguf(raw, qtype, 48, 128)), llama_cpp_values(raw, qtype, 48, 128))


def _reference(x, packed, bias=None):
    q, scale = G.quantize_activations(x.reshape(-1, packed.k))
    m = q.shape[0]
    x_q = (q.double().view(m, -1, G.ACTIVATION_BLOCK) * scale.double()[..., None]).view(m, packed.k)
    ref = x_q @ G.dequantize(packed).double().t()
    return ref if bias is None else ref + bias.double()


def _assert_close(out, ref, dtype):
    scale = max(ref.abs().max().item(), 1e-6)
    err = (out.double() - ref).abs().max().item() / scale
    assert err <= TOLERANCE[dtype], f"max error {err:.3g} x max|ref| > {TOLERANCE[dtype]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("qtype", TYPES)
def test_linear_matches_reference(tier, qtype, m, dtype):
    for n, k in _shapes(qtype):
        packed = G.pack_gguf(random_blocks(qtype, n, k), qtype, n, k)
        x = torch.randn(m, k, generator=seeded("gguf-x", m, n, k)).to(dtype)
        bias = torch.randn(n, generator=seeded("gguf-b", n)) if m % 2 else None
        out = G.gguf_linear(x, packed, bias)
        assert out.dtype is dtype and out.shape == (m, n)
        _assert_close(out, _reference(x, packed, bias), dtype)


def test_zero_rows_of_activations_and_extremes(tier):
    """A block of zeros (scale 0, no division by zero) and a block with one huge value."""
    packed = G.pack_gguf(random_blocks("Q4_K", 40, 256), "Q4_K", 40, 256)
    x = torch.randn(3, 256)
    x[0] = 0
    x[1, :32] = 0
    x[2, 5] = 1e4
    out = G.gguf_linear(x, packed)
    assert torch.all(out[0] == 0)
    _assert_close(out, _reference(x, packed), torch.float32)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_leading_dims_strided_rows_and_empty(tier, qtype):
    k = 256
    packed = G.pack_gguf(random_blocks(qtype, 40, k), qtype, 40, k)
    backing = torch.randn(6, 2 * k).to(torch.bfloat16)
    x = backing[:, :k].view(2, 3, k)  # rows 2k elements apart
    out = G.gguf_linear(x, packed)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out, G.gguf_linear(x.contiguous(), packed))
    assert G.gguf_linear(torch.empty(0, k, dtype=torch.bfloat16), packed).shape == (0, 40)


def test_packed_weight_survives_torch_save():
    packed = G.pack_gguf(random_blocks("Q5_K", 20, 256), "Q5_K", 20, 256)
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True by default
    x = torch.randn(3, 256)
    assert torch.equal(G.gguf_linear(x, loaded), G.gguf_linear(x, packed))
    assert kernforge.ops.gemm.gguf.gguf_linear is G.gguf_linear


def test_bad_input_raises_naming_the_argument():
    raw = random_blocks("Q4_0", 8, 64)
    packed = G.pack_gguf(raw, "Q4_0", 8, 64)
    with pytest.raises(ValueError, match="'Q2_K' is not taken; kernforge reads Q4_0"):
        G.pack_gguf(raw, "Q2_K", 8, 64)
    with pytest.raises(ValueError, match="data must be"):
        G.pack_gguf(raw[:, :-1], "Q4_0", 8, 64)  # a truncated row
    with pytest.raises(ValueError, match="whole blocks of 32"):
        G.pack_gguf(raw, "Q4_0", 8, 60)
    with pytest.raises(TypeError, match="data has dtype"):
        G.pack_gguf(raw.to(torch.int32), "Q4_0", 8, 64)
    with pytest.raises(ValueError, match="x must be"):
        G.gguf_linear(torch.randn(2, 63), packed)
    with pytest.raises(TypeError, match="x has dtype"):
        G.gguf_linear(torch.zeros(2, 64, dtype=torch.int32), packed)
    with pytest.raises(TypeError, match="w must be a PackedGGUFWeight"):
        G.gguf_linear(torch.randn(2, 64), packed.packed)
    with pytest.raises(ValueError, match="bias must have shape"):
        G.gguf_linear(torch.randn(2, 64), packed, torch.zeros(7))


def test_gguf_types_are_the_enum_names():
    for name in TYPES:
        assert G.block_type(gguf.GGMLQuantizationType[name]).name == name
        bt = G.BLOCK_TYPES[name]
        assert (bt.block, bt.size) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    assert np.dtype("uint8").itemsize == 1


@pytest.mark.parametrize("qtype", TYPES)
def test_embedding_rows_and_concatenation_keep_the_values(qtype):
    k = G.BLOCK_TYPES[qtype].block * 2
    raws = [random_blocks(qtype, n, k, (i,)) for i, n in enumerate((70, 9, 33))]
    values = torch.cat([llama_cpp_values(raw, qtype, raw.shape[0], k) for raw in raws])
    packed = [G.pack_gguf(raw, qtype, raw.shape[0], k) for raw in raws]
    fused = G.concatenated(packed)
    assert (fused.n, fused.k) == (112, k)
    assert torch.equal(G.dequantize(fused), values)
    ids = torch.tensor([[0, 111, 64], [63, 32, 16]])
    assert torch.equal(G.embedding_rows(fused, ids), values[ids])


def test_parts_of_different_types_run_side_by_side(tier):
    """A Q4_K_M file's q|k|v: Q4_K, Q4_K and Q6_K parts, each at its own type, into one output."""
    k = 256
    parts = [G.pack_gguf(random_blocks(t, n, k, (n,)), t, n, k) for t, n in (("Q4_K", 64), ("Q4_K", 33), ("Q6_K", 33))]
    x = torch.randn(3, k)
    bias = torch.randn(130)
    out = G.gguf_linear(x, parts, bias)
    expected = torch.cat([G.gguf_linear(x, part) for part in parts], dim=-1) + bias
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="parts must share K"):
        G.gguf_linear(x, [parts[0], G.pack_gguf(random_blocks("Q4_0", 8, 64), "Q4_0", 8, 64)])


def test_large_tensors_pack_in_runs_of_rows_to_the_same_weight(monkeypatch):
    """pack_gguf decodes a tensor PACK_ROWS rows at a time (bounded temporaries): the same weight."""
    raw = random_blocks("Q6_K", 300, 256)
    whole = G.pack_gguf(raw, "Q6_K", 300, 256)
    monkeypatch.setattr(G, "PACK_ROWS", 128)
    runs = G.pack_gguf(raw, "Q6_K", 300, 256)
    for a, b in zip(whole.tensors(), runs.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("qtype", TYPES)
def test_no_rows_and_no_ids(qtype):
    """An empty row selection (and a tensor of no rows) dequantizes to [0, K], and empty ids look up
    [*ids.shape, K]: not the RuntimeError of reshaping 0 elements with a -1 (found by the fuzzer)."""
    k = G.BLOCK_TYPES[qtype].block * 2
    raw = random_blocks(qtype, 5, k)
    assert G.dequantize_rows(raw, qtype, k, torch.zeros(0, dtype=torch.int64)).shape == (0, k)
    assert G.dequantize_rows(raw[:0], qtype, k).shape == (0, k)
    packed = G.pack_gguf(raw, qtype, 5, k)
    assert G.embedding_rows(packed, torch.zeros(0, dtype=torch.int64)).shape == (0, k)
    assert G.embedding_rows(packed, torch.zeros(2, 0, dtype=torch.int64)).shape == (2, 0, k)
