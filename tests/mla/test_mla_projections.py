"""The absorbed DeepSeek MLA projections (sgl-kernel's ``qkv_proj_with_rope`` and
``qkv_proj_with_rope_fused_weight``, ``mla_output_proj``, ``absorb_kv_b_proj``) against a float64
PyTorch reference written from DeepSeek's math: q_a -> RMSNorm -> q_b, q_nope absorbed by W_UK (SGLang's
w_kc), interleaved RoPE on q_pe and k_pe, kv_a -> RMSNorm of the latent. The reference rounds to the
working dtype where every bf16 implementation does (each GEMM and norm output), so the tolerance is
the kernels' accumulation order and the one rounding of each stage. bf16, fp32, int8 w8a8 (activations
quantized per token, as the op defines) and fp8 block-scaled weights (dequantized in the reference);
T 1, 3, 17; H 1 and 16; shuffled positions; strided rows; the fused weight; argument errors."""

import math

import pytest
import torch

import kernforge
from kernforge.ops.gemm.bf16 import convert_weight_packed
from kernforge.ops.gemm.fp8 import convert_weight_packed_fp8
from kernforge.ops.gemm.int8 import convert_weight_packed_int8
from kernforge.ops.mla.projections import (
    AbsorbedMLAWeights,
    absorb_kv_b_proj,
    mla_output_proj,
    qkv_proj_with_rope,
    qkv_proj_with_rope_fused_weight,
    split_kv_b_proj,
)

from op_helpers import seeded
from references import fp8_block_dequantize, per_token_quant_reference

# A small DeepSeek: every dimension distinct, so a mixed-up one shows.
HIDDEN, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 96, 48, 64, 32, 16, 40
MAX_POSITION = 64
EPS = 1e-6
BLOCK = (32, 32)  # fp8 blocks: q_a (48 rows), kv_a (80) and q_b (H * 48) end in partial blocks


# --------------------------------------------------------------------------- the layer


def _layer(heads, key=()):
    """Weights of one MLA layer: bf16 (values O(1) at every stage), plus the RoPE cache."""
    g = seeded("mla", heads, *key)

    def weight(n, k):
        return (torch.randn(n, k, generator=g) / math.sqrt(k)).bfloat16()

    return {
        "q_a": weight(Q_LORA, HIDDEN),
        "q_b": weight(heads * (NOPE + ROPE), Q_LORA),
        "kv_a": weight(KV_LORA + ROPE, HIDDEN),
        "kv_b": weight(heads * (NOPE + V_HEAD), KV_LORA),
        "q_norm": (1 + 0.3 * torch.randn(Q_LORA, generator=g)).bfloat16(),
        "kv_norm": (1 + 0.3 * torch.randn(KV_LORA, generator=g)).bfloat16(),
        "cos_sin": _cos_sin_cache(),
    }


def _cos_sin_cache(base=10000.0):
    """DeepSeek's (SGLang's) float32 [max_position, ROPE]: cos of each pair's angle, then sin."""
    inv_freq = 1.0 / base ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    angles = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], -1).float()


def _inputs(tokens, key=()):
    g = seeded("mla inputs", tokens, *key)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    positions = torch.randperm(MAX_POSITION, generator=g)[:tokens]  # shuffled, int64
    return x, positions


# --------------------------------------------------------------------------- the reference


def _rmsnorm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def _rope_interleaved(x, cos, sin):
    """GPT-J / DeepSeek RoPE: pairs (2i, 2i + 1) turn by the angle of pair i. x [T, ..., ROPE]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (ROPE // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


def _bf16_linear(w):
    return lambda x: x @ w.double().T


def _int8_linear(w_q, w_scale):
    """w8a8: x quantized per token (sgl-kernel's rule), the int8 weight dequantized per channel."""

    def linear(x):
        x_q, x_scale = per_token_quant_reference(x)
        return ((x_q.double() - 128) * x_scale.double()[:, None]) @ (w_q.double() * w_scale.double()[:, None]).T

    return linear


def _fp8_linear(w_q, w_scale):
    return lambda x: x @ fp8_block_dequantize(w_q, w_scale, BLOCK).double().T


def _reference(layer, x, positions, linears, dtype, w_kc=None):
    """float64 DeepSeek MLA (absorbed), rounded to ``dtype`` at each stage boundary. ``linears``: the
    q_a, q_b and kv_a products (x -> x @ W^T in float64); ``w_kc``: W_UK [H, NOPE, KV_LORA] (SGLang's
    layout; None: the layer's bf16 kv_b split)."""
    tokens, heads = x.shape[0], layer["q_b"].shape[0] // (NOPE + ROPE)

    def stage(t):
        return t.to(dtype).double()

    if w_kc is None:
        w_kc, _ = split_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)
    x = x.double()
    q_latent = stage(_rmsnorm(stage(linears["q_a"](x)), layer["q_norm"]))
    q = stage(linears["q_b"](q_latent)).view(tokens, heads, NOPE + ROPE)
    q_nope, q_pe = q.split([NOPE, ROPE], -1)
    q_absorbed = torch.einsum("thn,hnl->thl", q_nope, w_kc.double())  # SGLang: bmm(q_nope^T, w_kc)
    kv = stage(linears["kv_a"](x))
    latent, k_pe = kv.split([KV_LORA, ROPE], -1)
    cos, sin = layer["cos_sin"].double()[positions].chunk(2, -1)
    q_input = torch.cat([q_absorbed, _rope_interleaved(q_pe, cos, sin)], -1)
    k_input = torch.cat([_rmsnorm(latent, layer["kv_norm"]), _rope_interleaved(k_pe, cos, sin)], -1)[:, None]
    return q_input, k_input, k_input[..., :KV_LORA]


def _assert_close(actual, expected, dtype, what):
    """bf16: each stage rounds once to bf16 (2^-9 relative) and the reference rounds at the same places,
    so a rounding that falls the other way carries through at most a few ulps."""
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}[dtype]
    assert actual.dtype is dtype and actual.shape == expected.shape, what
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _assert_outputs(outputs, expected, dtype):
    for name, actual, ref in zip(("q_input", "k_input", "v_input"), outputs, expected):
        _assert_close(actual, ref, dtype, name)
    q_input, k_input, v_input = outputs
    assert v_input.data_ptr() == k_input.data_ptr() and v_input.stride() == k_input.stride()  # one storage


# --------------------------------------------------------------------------- weights in kernforge form


def _bf16_args(layer, absorbed):
    return dict(
        q_a_proj_weight=convert_weight_packed(layer["q_a"]),
        q_b_proj_weight=convert_weight_packed(layer["q_b"]),
        kv_a_proj_weight=convert_weight_packed(layer["kv_a"]),
        w_kc=absorbed.w_kc,
    )


def _common_args(layer, positions):
    return dict(
        q_a_layernorm_weight=layer["q_norm"],
        kv_a_layernorm_weight=layer["kv_norm"],
        positions=positions,
        cos_sin_cache=layer["cos_sin"],
        eps=EPS,
    )


def _run_bf16(layer, x, positions, **overrides):
    absorbed = absorb_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)
    args = {**_bf16_args(layer, absorbed), **_common_args(layer, positions), **overrides}
    return qkv_proj_with_rope(x, **args)


def _bf16_reference(layer, x, positions, dtype=torch.bfloat16):
    linears = {name: _bf16_linear(layer[name]) for name in ("q_a", "q_b", "kv_a")}
    return _reference(layer, x, positions, linears, dtype)


# --------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("heads", [1, 16])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_bf16_matches_deepseek_reference(tokens, heads):
    layer = _layer(heads)
    x, positions = _inputs(tokens)
    outputs = _run_bf16(layer, x, positions)
    q_input, k_input, v_input = outputs
    assert q_input.shape == (tokens, heads, KV_LORA + ROPE)
    assert k_input.shape == (tokens, 1, KV_LORA + ROPE) and k_input.is_contiguous()
    assert v_input.shape == (tokens, 1, KV_LORA)
    _assert_outputs(outputs, _bf16_reference(layer, x, positions), torch.bfloat16)


def test_every_tier(tier):
    layer = _layer(16, key=("tier",))
    x, positions = _inputs(5, key=("tier",))
    _assert_outputs(_run_bf16(layer, x, positions), _bf16_reference(layer, x, positions), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp32_and_fp16_hidden_states(dtype):
    """Other activation dtypes with the bf16 weights: every stage in that dtype (fp32: fp32's tolerance)."""
    layer = _layer(16, key=("other dtype",))
    x, positions = _inputs(17, key=("other dtype",))
    x = x.to(dtype) + 1e-3  # not bf16-representable values
    layer = {**layer, "q_norm": layer["q_norm"].to(dtype), "kv_norm": layer["kv_norm"].to(dtype)}
    outputs = _run_bf16(layer, x, positions)
    _assert_outputs(outputs, _bf16_reference(layer, x, positions, dtype), dtype)


def test_raw_tensors_packed_per_call_match_prepacked():
    layer = _layer(16, key=("raw",))
    x, positions = _inputs(3, key=("raw",))
    w_kc, _ = split_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)
    raw = qkv_proj_with_rope(
        x, layer["q_a"], layer["q_b"], layer["kv_a"], w_kc.transpose(1, 2), **_common_args(layer, positions),
        is_vnni=False,
    )  # fmt: skip
    for actual, expected in zip(raw, _run_bf16(layer, x, positions)):
        assert torch.equal(actual, expected)


def test_strided_rows_int32_positions_and_bf16_cache():
    """hidden_states rows with gaps; int32 positions; sgl-kernel's cache in hidden_states' dtype (the same
    values as the fp32 cache of its rounded entries)."""
    layer = _layer(16, key=("strided",))
    x, positions = _inputs(17, key=("strided",))
    backing = torch.randn(17, HIDDEN + 7).bfloat16()
    strided = backing[:, 3 : 3 + HIDDEN]
    strided.copy_(x)
    bf16_cache = layer["cos_sin"].bfloat16()
    outputs = _run_bf16(layer, strided, positions.int(), cos_sin_cache=bf16_cache)
    expected = _bf16_reference({**layer, "cos_sin": bf16_cache.float()}, x, positions)
    _assert_outputs(outputs, expected, torch.bfloat16)


def test_no_tokens():
    layer = _layer(16)
    x, positions = _inputs(0)
    q_input, k_input, v_input = _run_bf16(layer, x, positions)
    assert q_input.shape == (0, 16, KV_LORA + ROPE) and k_input.shape == (0, 1, KV_LORA + ROPE)
    assert v_input.shape == (0, 1, KV_LORA)


# --------------------------------------------------------------------------- fused weight


def _fused_args(layer, absorbed, mode):
    """(qkv_a weight, qkv_a scale, q_b weight, q_b scale) in ``mode``'s packed form, and the reference's
    linears over the same (quantized) weights."""
    qkv_a = torch.cat([layer["q_a"], layer["kv_a"]])
    if mode == "bf16":
        linears = {"qkv_a": _bf16_linear(qkv_a), "q_b": _bf16_linear(layer["q_b"])}
        return (convert_weight_packed(qkv_a), None, convert_weight_packed(layer["q_b"]), None), linears
    if mode == "int8":
        (qkv_q, qkv_s), (q_b_q, q_b_s) = _int8_weight(qkv_a), _int8_weight(layer["q_b"])
        packed = (convert_weight_packed_int8(qkv_q, qkv_s), qkv_s, convert_weight_packed_int8(q_b_q, q_b_s), q_b_s)
        return packed, {"qkv_a": _int8_linear(qkv_q, qkv_s), "q_b": _int8_linear(q_b_q, q_b_s)}
    (qkv_q, qkv_s), (q_b_q, q_b_s) = _fp8_weight(qkv_a), _fp8_weight(layer["q_b"])
    packed = (
        convert_weight_packed_fp8(qkv_q, qkv_s, BLOCK),
        qkv_s,
        convert_weight_packed_fp8(q_b_q, q_b_s, BLOCK),
        q_b_s,
    )
    return packed, {"qkv_a": _fp8_linear(qkv_q, qkv_s), "q_b": _fp8_linear(q_b_q, q_b_s)}


@pytest.mark.parametrize("w_kc_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("tokens", [1, 17])
def test_fused_weight_matches_reference(tokens, mode, w_kc_dtype):
    """Every argument positional, in sgl-kernel's order; W_UK bf16, or fp8 with its w_scale (SGLang's fp8
    checkpoints on CPU)."""
    layer = _layer(16, key=("fused", mode))
    x, positions = _inputs(tokens, key=("fused", mode))
    absorbed = absorb_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)
    w_kc, w_scale, exact_kc = absorbed.w_kc, None, None
    if w_kc_dtype == "fp8":
        fp8_kc, _, w_scale, exact_kc, _ = _fp8_kv_b(layer)
        w_kc = _packed_heads(fp8_kc)
    (qkv_a, qkv_a_scale, q_b, q_b_scale), linears = _fused_args(layer, absorbed, mode)
    common = _common_args(layer, positions)
    outputs = qkv_proj_with_rope_fused_weight(
        x, qkv_a, q_b, w_kc, common["q_a_layernorm_weight"], common["kv_a_layernorm_weight"],
        positions, layer["cos_sin"], EPS, mode == "int8", mode == "fp8", qkv_a_scale, q_b_scale, w_scale, True,
        list(BLOCK) if mode == "fp8" else None, Q_LORA, KV_LORA, ROPE,
    )  # fmt: skip

    def q_a(t):
        return linears["qkv_a"](t)[:, :Q_LORA]

    def kv_a(t):
        return linears["qkv_a"](t)[:, Q_LORA:]

    split = {"q_a": q_a, "kv_a": kv_a, "q_b": linears["q_b"]}
    _assert_outputs(outputs, _reference(layer, x, positions, split, torch.bfloat16, exact_kc), torch.bfloat16)
    assert outputs[1].stride(-1) == 1  # a view of the fused product's rows: the last dimension contiguous


# --------------------------------------------------------------------------- int8 and fp8


def _int8_weight(w):
    """Symmetric per-channel int8 of a bf16 weight: (int8 [N, K], fp32 scales [N])."""
    scale = w.float().abs().amax(1).clamp_min(1e-8) / 127
    return torch.round(w.float() / scale[:, None]).to(torch.int8), scale


def _fp8_weight(w):
    """e4m3fn block quantization of a bf16 weight: (e4m3fn [N, K], fp32 scales [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    rows, cols = -(-n // BLOCK[0]), -(-k // BLOCK[1])
    padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
    padded[:n, :k] = w.float()
    amax = padded.view(rows, BLOCK[0], cols, BLOCK[1]).abs().amax((1, 3)).clamp_min(1e-8)
    scale = amax / 448
    expanded = scale.repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)[:, :k]
    return (w.float() / expanded).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("is_vnni", [True, False])
@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("tokens, heads", [(1, 16), (17, 1), (3, 16)])
def test_quantized_weights_match_dequantized_reference(tokens, heads, mode, is_vnni):
    layer = _layer(heads, key=(mode,))
    x, positions = _inputs(tokens, key=(mode,))
    absorbed = absorb_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)
    quantize, linear = (_int8_weight, _int8_linear) if mode == "int8" else (_fp8_weight, _fp8_linear)
    quantized = {name: quantize(layer[name]) for name in ("q_a", "q_b", "kv_a")}
    weights = {}
    for name, (w_q, w_scale) in quantized.items():
        if not is_vnni:
            weights[name] = w_q
        elif mode == "int8":
            weights[name] = convert_weight_packed_int8(w_q, w_scale)
        else:
            weights[name] = convert_weight_packed_fp8(w_q, w_scale, BLOCK)
    w_kc = absorbed.w_kc if is_vnni else split_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)[0].transpose(1, 2)
    outputs = qkv_proj_with_rope(
        x, weights["q_a"], weights["q_b"], weights["kv_a"], w_kc, **_common_args(layer, positions),
        use_int8_w8a8=mode == "int8", use_fp8_w8a16=mode == "fp8",
        q_a_proj_scale=quantized["q_a"][1], q_b_proj_scale=quantized["q_b"][1], kv_a_proj_scale=quantized["kv_a"][1],
        is_vnni=is_vnni, block_size=BLOCK if mode == "fp8" else None,
    )  # fmt: skip
    linears = {name: linear(*quantized[name]) for name in quantized}
    _assert_outputs(outputs, _reference(layer, x, positions, linears, torch.bfloat16), torch.bfloat16)


def test_packed_weights_carry_their_scales():
    """With packed int8/fp8 weights the *_scale arguments may be None (and block_size, for fp8)."""
    layer = _layer(16, key=("carry",))
    x, positions = _inputs(3, key=("carry",))
    absorbed = absorb_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)
    for mode, quantize, convert in (
        ("int8", _int8_weight, convert_weight_packed_int8),
        ("fp8", _fp8_weight, lambda w, s: convert_weight_packed_fp8(w, s, BLOCK)),
    ):
        packed = {name: convert(*quantize(layer[name])) for name in ("q_a", "q_b", "kv_a")}
        args = (x, packed["q_a"], packed["q_b"], packed["kv_a"], absorbed.w_kc)
        flags = {"use_int8_w8a8": mode == "int8", "use_fp8_w8a16": mode == "fp8"}
        without = qkv_proj_with_rope(*args, **_common_args(layer, positions), **flags)
        scales = {f"{name}_proj_scale": quantize(layer[name])[1] for name in ("q_a", "q_b", "kv_a")}
        block = {"block_size": BLOCK} if mode == "fp8" else {}
        given = qkv_proj_with_rope(*args, **_common_args(layer, positions), **flags, **scales, **block)
        for a, b in zip(without, given):
            assert torch.equal(a, b), mode


# --------------------------------------------------------------------------- fp8 W_UK and W_UV


def _fp8_kv_b(layer):
    """SGLang's CPU fp8 ``kv_b_proj``: requantized per tensor (``block_quant_to_tensor_quant``), one
    ``w_scale`` for W_UK and W_UV. Returns (w_kc [H, KV_LORA, NOPE], w_vc [H, V_HEAD, KV_LORA]) e4m3fn
    as the ops take them, the 0-dim scale (not a power of two), and the float64 W_UK [H, NOPE, KV_LORA]
    and W_UV [H, KV_LORA, V_HEAD] they stand for: the e4m3fn values widened exactly, times the scale."""
    kv_b = layer["kv_b"].float()
    scale = kv_b.abs().max() / 448
    w_kc, w_vc = split_kv_b_proj((kv_b / scale).to(torch.float8_e4m3fn), NOPE, V_HEAD)
    exact_kc, exact_vc = (w.double() * scale.double() for w in (w_kc, w_vc))
    return w_kc.transpose(1, 2), w_vc.transpose(1, 2), scale, exact_kc, exact_vc


def _packed_heads(w):
    """fp8 weights [H, N, K] prepacked: their exact bf16 values, one PackedWeight a head."""
    return [convert_weight_packed(w_h.to(torch.bfloat16).contiguous()) for w_h in w]


def _in_dtype(layer, x, dtype):
    """The layer's norm weights and ``x`` in ``dtype`` (the projections' weights stay bf16)."""
    return {**layer, "q_norm": layer["q_norm"].to(dtype), "kv_norm": layer["kv_norm"].to(dtype)}, x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("is_vnni", [True, False])
@pytest.mark.parametrize("tokens", [0, 1, 3, 17])
def test_fp8_w_kc_matches_widened_reference(tokens, is_vnni, dtype):
    """fp8 W_UK with its per-tensor w_scale (raw, packed per call; or prepacked), positional in sgl-kernel's
    order. fp32 holds every stage to fp32's tolerance: folding the scale into bf16 weights (each rounded,
    2^-9 relative) would show there."""
    x, positions = _inputs(tokens, key=("fp8 w_kc",))
    layer, x = _in_dtype(_layer(16, key=("fp8 w_kc",)), x, dtype)
    w_kc, _, w_scale, exact_kc, _ = _fp8_kv_b(layer)
    names = ("q_a", "q_b", "kv_a")
    weights = [convert_weight_packed(layer[n]) if is_vnni else layer[n] for n in names]
    outputs = qkv_proj_with_rope(
        x, *weights, _packed_heads(w_kc) if is_vnni else w_kc, layer["q_norm"], layer["kv_norm"], positions,
        layer["cos_sin"], EPS, False, False, None, None, None, w_scale, is_vnni,
    )  # fmt: skip
    linears = {name: _bf16_linear(layer[name]) for name in names}
    _assert_outputs(outputs, _reference(layer, x, positions, linears, dtype, exact_kc), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("prepacked", [True, False])
@pytest.mark.parametrize("tokens", [0, 1, 3, 17])
def test_fp8_w_vc_matches_widened_reference(tokens, prepacked, dtype):
    _, w_vc, w_scale, _, exact_vc = _fp8_kv_b(_layer(16, key=("fp8 w_vc",)))
    g = seeded("fp8 latent", tokens)
    latent = torch.randn(16, tokens, KV_LORA, generator=g).to(dtype).transpose(0, 1)  # [T, H, KV_LORA], strided
    out = mla_output_proj(latent, _packed_heads(w_vc) if prepacked else w_vc, w_scale=w_scale)
    expected = torch.einsum("thl,hlv->thv", latent.double(), exact_vc).reshape(tokens, 16 * V_HEAD)
    _assert_close(out, expected, dtype, "out")


def test_fp8_w_kc_and_w_vc_every_tier(tier):
    """The scaled per-head products (fp32 sums of the prepacked heads) on every tier, at fp32's tolerance."""
    x, positions = _inputs(5, key=("fp8 tier",))
    layer, x = _in_dtype(_layer(16, key=("fp8 tier",)), x, torch.float32)
    w_kc, w_vc, w_scale, exact_kc, exact_vc = _fp8_kv_b(layer)
    args = {name: convert_weight_packed(layer[name]) for name in ("q_a", "q_b", "kv_a")}
    outputs = qkv_proj_with_rope(
        x, args["q_a"], args["q_b"], args["kv_a"], _packed_heads(w_kc), **_common_args(layer, positions),
        w_scale=w_scale,
    )  # fmt: skip
    linears = {name: _bf16_linear(layer[name]) for name in args}
    _assert_outputs(outputs, _reference(layer, x, positions, linears, torch.float32, exact_kc), torch.float32)
    latent = outputs[0][..., :KV_LORA]  # [T, H, KV_LORA], strided
    out = mla_output_proj(latent, _packed_heads(w_vc), w_scale=w_scale)
    expected = torch.einsum("thl,hlv->thv", latent.double(), exact_vc).reshape(5, 16 * V_HEAD)
    _assert_close(out, expected, torch.float32, "out")


def test_fp8_scale_errors():
    """Checked before any work: an fp8 weight needs its scale; the scale is one 0-dim float (sgl-kernel's
    ``bmm_cpu`` rule)."""
    layer = _layer(16, key=("errors",))
    x, positions = _inputs(3)
    w_kc, w_vc, w_scale, _, _ = _fp8_kv_b(layer)
    raw = (x, layer["q_a"], layer["q_b"], layer["kv_a"])
    common = _common_args(layer, positions)
    cases = [
        (w_kc, None, ValueError, "w_scale is required when w_kc is float8_e4m3fn"),
        (w_kc, w_scale.reshape(1), ValueError, "w_scale must be a 0-dim tensor"),
        (w_kc, torch.tensor(2), TypeError, "w_scale has dtype torch.int64"),
        (w_kc, True, TypeError, "w_scale must be a 0-dim tensor or a float, got bool"),
        (w_kc.to(torch.float8_e5m2), w_scale, TypeError, "w_kc has dtype torch.float8_e5m2"),
    ]
    for w, scale, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            qkv_proj_with_rope(*raw, w, **common, w_scale=scale, is_vnni=False)
    with pytest.raises(ValueError, match="w_scale is required when w_kc is float8_e4m3fn"):
        qkv_proj_with_rope_fused_weight(
            x, torch.cat([layer["q_a"], layer["kv_a"]]), layer["q_b"], w_kc, layer["q_norm"], layer["kv_norm"],
            positions, layer["cos_sin"], EPS, False, False, None, None, None, False, None, Q_LORA, KV_LORA, ROPE,
        )  # fmt: skip
    latent = torch.zeros(3, 16, KV_LORA, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w_scale is required when w_vc is float8_e4m3fn"):
        mla_output_proj(latent, w_vc)
    with pytest.raises(ValueError, match="w_scale must be a 0-dim tensor"):
        mla_output_proj(latent, _packed_heads(w_vc), w_scale=torch.ones(1, 1))


# --------------------------------------------------------------------------- weights and the output side


def test_absorbed_weights_are_sglangs_split_packed_per_head():
    heads = 3
    g = seeded("absorb")
    kv_b = torch.randn(heads * (NOPE + V_HEAD), KV_LORA, generator=g).bfloat16()
    w_kc, w_vc = split_kv_b_proj(kv_b, NOPE, V_HEAD)
    # SGLang's post_load_weights, literally
    sglang_kc, sglang_vc = kv_b.unflatten(0, (-1, NOPE + V_HEAD)).split([NOPE, V_HEAD], dim=1)
    assert torch.equal(w_kc, sglang_kc) and torch.equal(w_vc, sglang_vc.transpose(1, 2))
    assert w_kc.shape == (heads, NOPE, KV_LORA) and w_vc.shape == (heads, KV_LORA, V_HEAD)
    absorbed = absorb_kv_b_proj(kv_b, NOPE, V_HEAD)
    assert (absorbed.num_heads, absorbed.kv_lora_rank, absorbed.qk_nope_head_dim, absorbed.v_head_dim) == (
        heads, KV_LORA, NOPE, V_HEAD,
    )  # fmt: skip
    for h in range(heads):
        assert torch.equal(absorbed.w_kc[h].packed, convert_weight_packed(w_kc[h].T.contiguous()).packed)
        assert torch.equal(absorbed.w_vc[h].packed, convert_weight_packed(w_vc[h].T.contiguous()).packed)


def test_absorbed_weights_round_trip_through_torch_save(tmp_path):
    absorbed = absorb_kv_b_proj(_layer(2)["kv_b"], NOPE, V_HEAD)
    torch.save(absorbed, tmp_path / "absorbed.pt")
    loaded = torch.load(tmp_path / "absorbed.pt")
    assert isinstance(loaded, AbsorbedMLAWeights) and loaded.num_heads == 2
    assert all(torch.equal(a.packed, b.packed) for a, b in zip(loaded.w_vc, absorbed.w_vc))


def test_quantized_kv_b_is_dequantized_as_sglang_does():
    kv_b = _layer(2)["kv_b"]
    w_q, scale = _int8_weight(kv_b)
    expected = w_q.to(torch.bfloat16) * scale.to(torch.bfloat16)[:, None]  # SGLang's channel-wise int8
    assert torch.equal(absorb_kv_b_proj(w_q, NOPE, V_HEAD, scale).w_kc[1].packed, _packed_kc(expected, 1))
    w_q, scale = _fp8_weight(kv_b)
    expected = fp8_block_dequantize(w_q, scale, BLOCK).bfloat16()
    assert torch.equal(absorb_kv_b_proj(w_q, NOPE, V_HEAD, scale, BLOCK).w_kc[1].packed, _packed_kc(expected, 1))


def _packed_kc(kv_b, h):
    return convert_weight_packed(split_kv_b_proj(kv_b, NOPE, V_HEAD)[0][h].T.contiguous()).packed


@pytest.mark.parametrize("tokens, heads", [(1, 16), (17, 1), (3, 16)])
def test_mla_output_proj_matches_reference(tokens, heads):
    layer = _layer(heads, key=("out",))
    absorbed = absorb_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)
    g = seeded("latent", tokens, heads)
    backing = torch.randn(heads, tokens, KV_LORA + 3, generator=g).bfloat16()
    latent = backing[..., :KV_LORA].transpose(0, 1)  # [T, H, KV_LORA], strided as an attention output may be
    _, w_vc = split_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)  # SGLang's [H, KV_LORA, V_HEAD]
    expected = torch.einsum("thl,hlv->thv", latent.double(), w_vc.double()).reshape(tokens, heads * V_HEAD)
    out = mla_output_proj(latent, absorbed.w_vc)
    _assert_close(out, expected, torch.bfloat16, "out")
    raw = mla_output_proj(latent, w_vc.transpose(1, 2))  # bf16 [H, V_HEAD, KV_LORA], packed per call
    assert torch.equal(raw, out)
    every_other = torch.zeros(tokens, heads, 2 * KV_LORA, dtype=torch.bfloat16)[..., ::2]  # a strided last dim
    every_other.copy_(latent)
    assert torch.equal(mla_output_proj(every_other, absorbed.w_vc), out)
    given = torch.full((tokens, heads * V_HEAD + 5), float("nan"), dtype=torch.bfloat16)
    assert mla_output_proj(latent, absorbed.w_vc, out=given[:, :-5]).data_ptr() == given.data_ptr()
    assert torch.equal(given[:, :-5], out) and given[:, -5:].isnan().all()


def test_ops_are_exported():
    for name in ("qkv_proj_with_rope", "qkv_proj_with_rope_fused_weight", "mla_output_proj", "absorb_kv_b_proj"):
        assert getattr(kernforge, name) is getattr(kernforge.ops.mla.projections, name)


# --------------------------------------------------------------------------- errors


def _error_cases():
    """(name, overrides of the bf16 call's arguments, exception, message pattern)."""
    layer = _layer(16, key=("errors",))
    other = _layer(8, key=("errors",))
    wide = convert_weight_packed(torch.zeros(Q_LORA, HIDDEN + 2, dtype=torch.bfloat16))
    return [
        ("hidden size", {"x": torch.zeros(3, HIDDEN + 1, dtype=torch.bfloat16)}, ValueError, "q_a_proj_weight has K"),
        ("hidden 3-D", {"x": torch.zeros(3, 1, HIDDEN, dtype=torch.bfloat16)}, ValueError, "hidden_states must be 2-D"),
        ("hidden dtype", {"x": torch.zeros(3, HIDDEN, dtype=torch.int32)}, TypeError, "hidden_states has dtype"),
        ("kv_a K", {"kv_a_proj_weight": wide}, ValueError, "kv_a_proj_weight has K = 98"),
        ("heads", {"w_kc": other_absorbed(other).w_kc}, ValueError, "q_b_proj_weight has"),
        ("raw weight, is_vnni", {"q_a_proj_weight": layer["q_a"]}, TypeError, "q_a_proj_weight must be a PackedWeight"),
        ("w_kc tensor, is_vnni", {"w_kc": torch.zeros(16, KV_LORA, NOPE).bfloat16()}, TypeError, "w_kc is a tensor"),
        ("norm shape", {"q_a_layernorm_weight": torch.ones(Q_LORA + 1).bfloat16()}, ValueError, "q_a_layernorm_weight"),
        ("norm dtype", {"kv_a_layernorm_weight": torch.ones(KV_LORA)}, TypeError, "kv_a_layernorm_weight has dtype"),
        ("positions", {"positions": torch.tensor([0, 1, MAX_POSITION])}, ValueError, r"positions\[2\] = 64"),
        ("positions negative", {"positions": torch.tensor([0, -1, 2])}, ValueError, r"positions\[1\] = -1"),
        ("positions length", {"positions": torch.tensor([0, 1])}, ValueError, "positions must have shape"),
        ("positions dtype", {"positions": torch.tensor([0.0, 1.0, 2.0])}, TypeError, "positions must have dtype"),
        ("cache dim", {"cos_sin_cache": torch.zeros(MAX_POSITION, ROPE + 2)}, ValueError, "cos_sin_cache must be"),
        ("cache dtype", {"cos_sin_cache": torch.zeros(MAX_POSITION, ROPE).half()}, TypeError, "cos_sin_cache has"),
        ("bf16 scale", {"q_a_proj_scale": torch.ones(Q_LORA)}, ValueError, "q_a_proj_scale must be None"),
        ("both modes", {"use_int8_w8a8": True, "use_fp8_w8a16": True}, ValueError, "cannot both be set"),
        ("int8 wants int8", {"use_int8_w8a8": True}, TypeError, "PackedInt8Weight"),
        ("eps", {"eps": -1.0}, ValueError, "eps must be"),
    ]


def other_absorbed(layer):
    return absorb_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)


@pytest.mark.parametrize("case", _error_cases(), ids=lambda case: case[0])
def test_errors_name_the_argument(case):
    _, overrides, exc, pattern = case
    layer = _layer(16, key=("errors",))
    x, positions = _inputs(3)
    x, positions = overrides.pop("x", x), overrides.pop("positions", positions)
    with pytest.raises(exc, match=pattern):
        _run_bf16(layer, x, positions, **overrides)


def test_quantized_errors():
    layer = _layer(16, key=("errors",))
    x, positions = _inputs(3)
    w_kc = split_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)[0].transpose(1, 2)
    q_a, q_a_scale = _int8_weight(layer["q_a"])
    args = (x, q_a, _int8_weight(layer["q_b"])[0], _int8_weight(layer["kv_a"])[0], w_kc)
    common = _common_args(layer, positions)
    with pytest.raises(ValueError, match="q_b_proj_scale is required"):
        qkv_proj_with_rope(
            *args, **common, use_int8_w8a8=True, q_a_proj_scale=q_a_scale,
            kv_a_proj_scale=_int8_weight(layer["kv_a"])[1], is_vnni=False,
        )  # fmt: skip
    with pytest.raises(ValueError, match="q_a_proj_scale must have shape"):
        qkv_proj_with_rope(*args, **common, use_int8_w8a8=True, q_a_proj_scale=q_a_scale[:-1], is_vnni=False)
    packed = convert_weight_packed_int8(q_a, q_a_scale)
    with pytest.raises(ValueError, match="q_a_proj_scale differs"):
        qkv_proj_with_rope(
            x, packed, *[convert_weight_packed_int8(*_int8_weight(layer[n])) for n in ("q_b", "kv_a")],
            other_absorbed(layer).w_kc, **common, use_int8_w8a8=True, q_a_proj_scale=q_a_scale * 2,
        )  # fmt: skip
    fp8 = {n: convert_weight_packed_fp8(*_fp8_weight(layer[n]), BLOCK) for n in ("q_a", "q_b", "kv_a")}
    with pytest.raises(ValueError, match="kv_a_proj_scale must have shape"):
        qkv_proj_with_rope(
            x, fp8["q_a"], fp8["q_b"], fp8["kv_a"], other_absorbed(layer).w_kc, **common, use_fp8_w8a16=True,
            kv_a_proj_scale=torch.ones(1, 1),
        )  # fmt: skip
    with pytest.raises(ValueError, match="block_size is required"):
        qkv_proj_with_rope(
            x, *_fp8_weight(layer["q_a"])[:1], layer["q_b"], layer["kv_a"], w_kc, **common, use_fp8_w8a16=True,
            q_a_proj_scale=_fp8_weight(layer["q_a"])[1], is_vnni=False,
        )  # fmt: skip


def test_fused_and_output_errors():
    layer = _layer(16, key=("errors",))
    x, positions = _inputs(3)
    absorbed = other_absorbed(layer)
    qkv_a = convert_weight_packed(torch.cat([layer["q_a"], layer["kv_a"]]))
    args = [x, qkv_a, convert_weight_packed(layer["q_b"]), absorbed.w_kc, layer["q_norm"], layer["kv_norm"]]
    args += [positions, layer["cos_sin"], EPS, False, False, None, None, None, True, None]
    with pytest.raises(ValueError, match="qkv_a_proj_weight has 128 rows"):
        qkv_proj_with_rope_fused_weight(*args, Q_LORA, KV_LORA, ROPE + 2)
    with pytest.raises(ValueError, match="q_lora_rank must be a positive int"):
        qkv_proj_with_rope_fused_weight(*args, 0, KV_LORA, ROPE)
    with pytest.raises(ValueError, match="kv_lora_rank is 60 but w_kc's weights are"):
        qkv_proj_with_rope_fused_weight(*args, Q_LORA, KV_LORA - 4, ROPE + 4)
    latent = torch.zeros(3, 16, KV_LORA, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w_vc holds 16 heads' weights; attn_latent's heads are 8"):
        mla_output_proj(latent[:, :8], absorbed.w_vc)
    with pytest.raises(ValueError, match="w_vc's weights have K"):
        mla_output_proj(latent[..., 1:], absorbed.w_vc)
    with pytest.raises(ValueError, match="out must be"):
        mla_output_proj(latent, absorbed.w_vc, out=torch.empty(3, 16 * V_HEAD + 1, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="w_vc must be"):
        mla_output_proj(latent, [1, 2])
    with pytest.raises(ValueError, match="kv_b_proj_weight must be"):
        split_kv_b_proj(layer["kv_b"][1:], NOPE, V_HEAD)
