"""``kernforge.nn.Linear`` and ``replace_linears`` against the original ``nn.Linear`` in fp32:
bf16, int8 w8a8 and fp8 block-scaled weights, bias and no bias, 3-D input, a swapped MLP, state_dict
and torch.save round trips; the fp8 layer also against its own dequantized weight (tight)."""

import io

import pytest
import torch
from torch import nn

import kernforge.nn as knn

from op_helpers import seeded
from references import fp8_block_dequantize

# bf16 rounds x and W (and the output); int8 quantizes both per row/channel: ~1/254 relative per operand;
# e4m3 keeps 3 mantissa bits: up to 1/16 relative per weight (x stays bf16)
TOLERANCE = {None: 1e-2, "int8": 3e-2, "fp8_block": 6e-2}
QUANTS = [None, "int8", "fp8_block"]


def _layer(k, n, bias=True, key=()):
    torch.manual_seed(hash((k, n, bias, key)) % 2**31)
    return nn.Linear(k, n, bias=bias)


def _x(shape, key=()):
    return torch.randn(shape, generator=seeded("nn-linear", shape, *key))


def _assert_close(actual, expected, quant):
    rtol = TOLERANCE[quant]
    torch.testing.assert_close(actual.float(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 17), (33, 17), (2, 5, 17)])
def test_from_linear_matches_nn_linear(quant, bias, shape):
    layer = _layer(17, 45, bias)
    x = _x(shape)
    module = knn.Linear.from_linear(layer, quant=quant)
    y = module(x.bfloat16())
    assert y.shape == (*shape[:-1], 45) and y.dtype is torch.bfloat16
    with torch.no_grad():
        _assert_close(y, layer(x.bfloat16().float()), quant)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_block_matches_its_dequantized_weight(dtype):
    """Blocks of 128 x 128 with partial edge blocks (N = 200, K = 300): the layer computes exactly
    x @ (w_q * scale).T + bias up to fp32 summation and the output's rounding."""
    layer = _layer(300, 200, key=(8,))
    module = knn.Linear.from_linear(layer, dtype=dtype, quant="fp8_block")
    w_q, scale = knn.quantize_weight_fp8_block(layer.weight.detach())
    assert module.weight_scale.shape == scale.shape == (2, 3) and torch.equal(module.weight_scale, scale)
    dequantized = fp8_block_dequantize(w_q, scale, (128, 128))
    x = _x((9, 300), key=("fp8",)).to(dtype)
    with torch.no_grad():
        expected = x.float() @ dequantized.T + layer.bias
    rtol = 1e-2 if dtype is torch.bfloat16 else 1e-5
    torch.testing.assert_close(module(x).float(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


@pytest.mark.parametrize("quant", ["int4", "int4_w4a16"])
@pytest.mark.parametrize("k,group", [(256, 128), (96, 96), (576, 96)])
def test_int4_matches_its_dequantized_weight(quant, k, group):
    """The layer quantizes with quantize_int4 (group 128, else the largest multiple of 4 up to it that
    divides K) and computes x @ dequantized.T + bias up to W4A8's activation rounding and bf16."""
    from kernforge.ops.gemm import int4

    layer = _layer(k, 70, key=(quant,))
    module = knn.Linear.from_linear(layer, quant=quant)
    assert module.group_size == group and module.weight_scale.shape == (k // group, 70)
    packed = int4.quantize_int4(layer.weight.detach(), group)
    assert torch.equal(module.weight_packed, packed.packed) and torch.equal(module.weight_zeros, packed.zeros)
    x = _x((5, k), key=("int4",)).bfloat16()
    with torch.no_grad():
        expected = x.float() @ int4.dequantize_int4(packed).T + layer.bias
    rtol = 2e-2 if quant == "int4" else 1e-2  # int8 activations: ~1/254 per element on top of bf16
    torch.testing.assert_close(module(x).float(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())
    fresh = knn.Linear(k, 70, quant=quant)
    fresh.load_state_dict(module.state_dict())
    assert torch.equal(fresh(x), module(x))
    with pytest.raises(ValueError, match="state dict is for"):
        knn.Linear(k, 70, quant=quant, group_size=group // 2 if group % 8 == 0 else 4).load_state_dict(
            module.state_dict()
        )
    assert repr(module).endswith(f"quant={quant}, group_size={group})")


def test_int4_from_int4_and_group_size_errors():
    from kernforge.ops.gemm import int4

    packed = int4.quantize_int4(torch.randn(40, 64), 32, symmetric=True)
    module = knn.Linear.from_int4(packed, torch.zeros(40), quant="int4_w4a16")
    x = _x((3, 64)).bfloat16()
    assert torch.equal(module(x), int4.int4_w4a16_linear(x, packed, bias=torch.zeros(40)))
    with pytest.raises(ValueError, match="group_size must be a multiple of 4"):
        knn.Linear(64, 8, quant="int4", group_size=48)
    with pytest.raises(ValueError, match="group_size is for quant="):
        knn.Linear(64, 8, quant="int8", group_size=32)
    with pytest.raises(ValueError, match="multiple of 4"):
        knn.Linear.from_linear(_layer(17, 4), quant="int4")
    with pytest.raises(ValueError, match="quant must be one of"):
        knn.Linear.from_int4(packed, quant="int8")


def test_attributes_and_repr():
    module = knn.Linear.from_linear(_layer(17, 45, bias=False), quant="int8")
    assert (module.in_features, module.out_features) == (17, 45)
    assert repr(module) == "Linear(in_features=17, out_features=45, bias=False, dtype=bfloat16, quant=int8)"


def test_config_errors():
    layer = _layer(8, 4)
    with pytest.raises(ValueError, match="quant must be one of"):
        knn.Linear.from_linear(layer, quant="int3")
    with pytest.raises(TypeError, match="dtype must be"):
        knn.Linear.from_linear(layer, dtype=torch.int8)
    with pytest.raises(TypeError, match="layer must be a torch.nn.Linear"):
        knn.Linear.from_linear(nn.Conv1d(1, 1, 1))
    with pytest.raises(TypeError, match="x has dtype torch.float32 but this Linear was built for torch.bfloat16"):
        knn.Linear.from_linear(layer)(torch.zeros(2, 8))
    with torch.no_grad():
        layer.weight[1, 2] = float("nan")
    with pytest.raises(ValueError, match="weight holds NaN"):  # its whole block would read as NaN
        knn.Linear.from_linear(layer, quant="fp8_block")


def test_fp8_weight_quantization_is_per_block_amax_over_448():
    w = torch.zeros(3, 5)
    w[:2, :2] = torch.tensor([[1.0, -2.0], [0.5, 0.25]])  # block (0, 0): amax 2
    w[2, 4] = -7.0  # block (1, 2), a partial one: amax 7
    w_q, scale = knn.quantize_weight_fp8_block(w, block_size=(2, 2))
    assert w_q.dtype is torch.float8_e4m3fn and scale.shape == (2, 3)
    torch.testing.assert_close(scale, torch.tensor([[2.0, 1e-10, 1e-10], [1e-10, 1e-10, 7.0]]) / 448)
    assert w_q.float()[:2, :2].tolist() == [[224.0, -448.0], [112.0, 56.0]]
    assert w_q.float()[2, 4] == -448 and not w_q.float()[2, :4].any()  # zero blocks stay zero


def test_int8_weight_quantization_is_per_channel_symmetric():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.75]])
    w_q, scale = knn.quantize_weight_int8(w)
    torch.testing.assert_close(scale, torch.tensor([1.0 / 127, 1e-10 / 127, 3.0 / 127]))
    assert w_q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -32]]


def test_int8_weight_quantization_by_row_blocks_matches_the_whole_and_leaves_the_weight(monkeypatch):
    """Rows are quantized a block at a time (no fp32 copy of a 150k-row lm_head): 3-row blocks over 10
    rows give what one fp32 pass gives, and an fp32 weight (whose .float() is itself) is not written."""
    import kernforge.nn.linear as linear_module

    monkeypatch.setattr(linear_module, "_QUANTIZE_ROWS", 3)
    w = torch.randn(10, 7, generator=torch.Generator().manual_seed(0))
    before = w.clone()
    w_q, scale = knn.quantize_weight_int8(w)
    expected_scale = w.abs().amax(1) / 127
    torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
    assert torch.equal(w_q, torch.round(w / expected_scale[:, None]).to(torch.int8))
    assert torch.equal(w, before)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(24, 40)
        self.act = nn.SiLU()
        self.down = nn.Sequential(nn.Linear(40, 9, bias=False), nn.Linear(9, 3))
        self.attn = nn.MultiheadAttention(8, 2)  # its out_proj is an nn.Linear subclass: left alone

    def forward(self, x):
        return self.down(self.act(self.up(x)))


@pytest.mark.parametrize("quant", QUANTS)
def test_replace_linears_swaps_in_place(quant):
    torch.manual_seed(1)
    model = MLP().bfloat16()
    x = _x((6, 24), key=("mlp",)).bfloat16()
    with torch.no_grad():
        reference = MLP().bfloat16()
        reference.load_state_dict(model.state_dict())
        expected = reference.float()(x.float())
    assert knn.replace_linears(model, quant=quant) == 3
    assert [type(m) for m in (model.up, model.down[0], model.down[1])] == [knn.Linear] * 3
    assert type(model.attn.out_proj) is not knn.Linear
    _assert_close(model(x), expected, quant)
    assert knn.replace_linears(model, quant=quant) == 0  # nothing left to swap


@pytest.mark.parametrize("quant", QUANTS)
def test_state_dict_and_torch_save_round_trip(quant):
    module = knn.Linear.from_linear(_layer(33, 70), quant=quant)
    x = _x((5, 33), key=("save",)).bfloat16()
    expected = module(x)
    fresh = knn.Linear(33, 70, bias=True, quant=quant)
    fresh.load_state_dict(module.state_dict())
    assert torch.equal(fresh(x), expected)
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    fresh = knn.Linear(33, 70, quant=quant)
    fresh.load_state_dict(torch.load(buffer))  # weights_only: plain tensors
    assert torch.equal(fresh(x), expected)
    with pytest.raises(ValueError, match="'out_features': 70"):
        knn.Linear(33, 170, quant=quant).load_state_dict(module.state_dict())
    with pytest.raises(ValueError, match="'in_features': 33"):  # same padded buffer shapes, another K
        knn.Linear(34, 70, quant=quant).load_state_dict(module.state_dict())
    whole = io.BytesIO()
    torch.save(module, whole)
    whole.seek(0)
    assert torch.equal(torch.load(whole, weights_only=False)(x), expected)


def test_linear_compiles_without_graph_breaks():
    """kernforge.nn.Linear calls its GEMM through torch.ops.kernforge, one node of a compiled graph."""
    layer = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    model = torch.nn.Sequential(
        knn.Linear.from_linear(layer),
        torch.nn.ReLU(),
        knn.Linear.from_linear(torch.nn.Linear(48, 32).to(torch.bfloat16), quant="int8"),
    )
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1
        compiled = torch.compile(model, backend="eager")
        torch.testing.assert_close(compiled(x), model(x))
