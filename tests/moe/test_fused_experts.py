"""fused_experts (sgl-kernel's fused_experts_cpu) against a per-expert float32 torch loop.

The reference multiplies the same bf16 weights in float32 and rounds the intermediate
silu(gate) * up to the activations' dtype, as the kernel does, so bf16 results agree within
bf16 tolerance of the output's scale. Routing is drawn per case: uniform, skewed (every token
on one expert, most experts idle), duplicated rows; shapes are odd (H and I not multiples of the
tile), from one token to 4096, E from 8 to 256, k from 1 to 8, on every tier.
"""

import pytest
import torch
import torch.nn.functional as F

import kernforge
from kernforge.ops.moe.experts import (
    PANEL_WIDTH,
    PackedExperts,
    PackedFp8Experts,
    PackedInt8Experts,
    pack_experts,
    pack_experts_fp8,
    pack_experts_int8,
)

from op_helpers import seeded
from references import fp8_block_dequantize, int8_linear_reference, per_token_quant_reference

TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}  # x the output's max


def reference(x, w1, w2, topk_weights, topk_ids):
    """Per expert, in float32: silu(x W1g^T) * (x W1u^T), rounded to x's dtype, times W2^T, weighted."""
    tokens, hidden = x.shape
    inter = w2.shape[2]
    out = torch.zeros(tokens, hidden, dtype=torch.float32)
    xf = x.float()
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate_up = xf[token] @ w1[e].float().T
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype).float()
        out.index_add_(0, token, (act @ w2[e].float().T) * topk_weights[token, slot, None].float())
    return out


def int8_reference(x, w1, s1, w2, s2, topk_weights, topk_ids):
    """The w8a8 experts as the kernel quantizes them: x per token, the intermediate (rounded to x's
    dtype) per row, int8 weights with per-channel scales, products dequantized in float32."""
    tokens, hidden = x.shape
    inter = w2.shape[2]
    out = torch.zeros(tokens, hidden, dtype=torch.float32)
    xq, xs = per_token_quant_reference(x)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate_up = int8_linear_reference(xq[token], xs[token], w1[e], s1[e])
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        aq, as_ = per_token_quant_reference(act)
        y = int8_linear_reference(aq, as_, w2[e], s2[e])
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out


def make_int8_weights(experts, hidden, inter, g):
    """Symmetric int8 weights with per-channel scales sized so that activations keep their scale."""
    w1 = torch.randint(-127, 128, (experts, 2 * inter, hidden), generator=g, dtype=torch.int8)
    w2 = torch.randint(-127, 128, (experts, hidden, inter), generator=g, dtype=torch.int8)
    s1 = (torch.rand(experts, 2 * inter, generator=g) + 0.5) / (73 * hidden**0.5)
    s2 = (torch.rand(experts, hidden, generator=g) + 0.5) / (73 * inter**0.5)
    return w1, s1, w2, s2


def make_weights(experts, hidden, inter, g):
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).bfloat16()
    return w1, w2


def route(tokens, experts, k, g, skew=None):
    """topk_weights (softmax over the chosen, fp32) and topk_ids (int32) for ``tokens`` tokens:
    ``skew="one"``: every token's first expert is expert 3 (the rest idle but k - 1); ``"few"``: ids
    drawn from the first 2k experts only."""
    if skew == "few":
        scores = torch.rand(tokens, min(experts, 2 * k), generator=g)
    else:
        scores = torch.rand(tokens, experts, generator=g)
    if skew == "one":
        scores[:, 3 % experts] = 2.0
    weights, ids = torch.topk(scores, k, dim=-1)
    return weights.softmax(-1), ids.to(torch.int32)


def check(out, x, w1, w2, topk_weights, topk_ids):
    expected = reference(x, w1, w2, topk_weights, topk_ids)
    scale = max(expected.abs().max().item(), 1e-3)
    error = (out.float() - expected).abs().max().item()
    assert error <= TOLERANCES[x.dtype] * scale, f"max error {error:.3g} vs output scale {scale:.3g}"


CASES = [  # tokens, hidden, inter, experts, k, skew
    (1, 64, 32, 8, 2, None),
    (1, 200, 70, 60, 4, None),
    (3, 33, 17, 8, 1, None),
    (7, 130, 96, 16, 8, None),
    (16, 256, 64, 128, 8, None),
    (37, 96, 40, 256, 8, None),
    (64, 128, 48, 8, 2, "one"),
    (130, 72, 160, 64, 6, "few"),
    (300, 100, 52, 8, 2, "one"),
]


@pytest.mark.parametrize("tokens,hidden,inter,experts,k,skew", CASES)
def test_bf16_matches_float32_loop(tier, tokens, hidden, inter, experts, k, skew):
    g = seeded("fused_experts", tokens, hidden, inter, experts, k, skew)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w1, w2 = make_weights(experts, hidden, inter, g)
    topk_weights, topk_ids = route(tokens, experts, k, g, skew)
    out = kernforge.fused_experts(x, pack_experts(w1, gated=True), pack_experts(w2), topk_weights, topk_ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    check(out, x, w1, w2, topk_weights, topk_ids)


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1024, 4096])
def test_many_tokens(tokens):
    g = seeded("fused_experts_many", tokens)
    x = torch.randn(tokens, 192, generator=g).bfloat16()
    w1, w2 = make_weights(16, 192, 96, g)
    topk_weights, topk_ids = route(tokens, 16, 4, g)
    out = kernforge.fused_experts(x, pack_experts(w1, gated=True), pack_experts(w2), topk_weights, topk_ids)
    check(out, x, w1, w2, topk_weights, topk_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp32_and_fp16_activations(tier, dtype):
    g = seeded("fused_experts_dtype", dtype)
    x = torch.randn(9, 80, generator=g).to(dtype)
    w1, w2 = make_weights(12, 80, 36, g)
    topk_weights, topk_ids = route(9, 12, 3, g)
    out = kernforge.fused_experts(x, w1, w2, topk_weights, topk_ids)
    assert out.dtype == dtype
    check(out, x, w1, w2, topk_weights, topk_ids)


INT8_CASES = [  # tokens, hidden, inter, experts, k, skew: K and I tails of the 4-byte groups and 64-wide panels
    (1, 64, 64, 8, 2, None),
    (5, 130, 70, 16, 4, None),
    (33, 67, 33, 8, 8, None),
    (100, 96, 128, 32, 2, "one"),
]


@pytest.mark.parametrize("tokens,hidden,inter,experts,k,skew", INT8_CASES)
def test_int8_w8a8_matches_the_reference_that_quantizes_alike(tier, tokens, hidden, inter, experts, k, skew):
    g = seeded("fused_experts_int8", tokens, hidden, inter, experts, k, skew)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w1, s1, w2, s2 = make_int8_weights(experts, hidden, inter, g)
    topk_weights, topk_ids = route(tokens, experts, k, g, skew)
    p1, p2 = pack_experts_int8(w1, s1, gated=True), pack_experts_int8(w2, s2)
    out = kernforge.fused_experts(x, p1, p2, topk_weights, topk_ids, use_int8_w8a8=True)
    expected = int8_reference(x, w1, s1, w2, s2, topk_weights, topk_ids)
    scale = expected.abs().max().item()
    assert (out.float() - expected).abs().max().item() <= 1.6e-2 * scale
    raw = kernforge.fused_experts(x, w1, w2, topk_weights, topk_ids, False, True, False, s1, s2)  # sgl-kernel's order
    assert torch.equal(raw, out)


def test_int8_packing_is_saved_and_checked(tmp_path):
    g = seeded("fused_experts_int8_io")
    w1, s1, w2, s2 = make_int8_weights(4, 64, 64, g)
    packed = pack_experts_int8(w1, s1[..., None], gated=True)
    torch.save(packed, tmp_path / "w1.pt")
    loaded = torch.load(tmp_path / "w1.pt")
    assert isinstance(loaded, PackedInt8Experts) and torch.equal(loaded.compensation, packed.compensation)
    x = torch.randn(3, 64, generator=g).bfloat16()
    weights, ids = route(3, 4, 2, g)
    with pytest.raises(TypeError, match="bf16 weights \\(no quantization flag\\) takes PackedExperts"):
        kernforge.fused_experts(x, loaded, pack_experts_int8(w2, s2), weights, ids)
    with pytest.raises(ValueError, match="needs w1_scale"):
        kernforge.fused_experts(x, w1, w2, weights, ids, use_int8_w8a8=True, w2_scale=s2)
    with pytest.raises(ValueError, match="a1_scale must be None"):
        kernforge.fused_experts(x, loaded, w2, weights, ids, use_int8_w8a8=True, w2_scale=s2, a1_scale=s2)
    with pytest.raises(ValueError, match="w_scale must be \\[4, 128\\]"):
        pack_experts_int8(w1, s1[:, :64])
    bad = PackedInt8Experts(packed.packed, packed.compensation[:, :, :8], packed.scale, 4, 128, 64, 2)
    with pytest.raises(ValueError, match="w1.compensation must be"):
        kernforge.fused_experts(x, bad, w2, weights, ids, use_int8_w8a8=True, w2_scale=s2)


def make_fp8_weights(experts, hidden, inter, block, g):
    """e4m3fn weights (no NaN codes) and fp32 block scales sized so that activations keep their scale."""

    def stack(n, k):
        w = (torch.randn(experts, n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = (torch.rand(experts, -(-n // block[0]), -(-k // block[1]), generator=g) + 0.5) / (64 * k**0.5)
        return w, scale

    return (*stack(2 * inter, hidden), *stack(hidden, inter))


FP8_CASES = [  # tokens, hidden, inter, experts, k, block: blocks straddling gate and up, partial blocks
    (1, 256, 128, 8, 2, (128, 128)),
    (7, 200, 96, 16, 4, (64, 64)),
    (40, 130, 70, 8, 2, (32, 48)),
    (100, 64, 64, 4, 1, (128, 128)),
    (300, 96, 80, 4, 2, (64, 48)),  # 150 rows per expert: K blocks converted to bf16 pairs once per task
]


@pytest.mark.parametrize("tokens,hidden,inter,experts,k,block", FP8_CASES)
def test_fp8_block_weights_match_the_dequantized_loop(tier, tokens, hidden, inter, experts, k, block):
    g = seeded("fused_experts_fp8", tokens, hidden, inter, experts, k, block)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w1, s1, w2, s2 = make_fp8_weights(experts, hidden, inter, block, g)
    topk_weights, topk_ids = route(tokens, experts, k, g)
    p1, p2 = pack_experts_fp8(w1, s1, block, gated=True), pack_experts_fp8(w2, s2, block)
    out = kernforge.fused_experts(x, p1, p2, topk_weights, topk_ids, use_fp8_w8a16=True)
    dequantized = [
        torch.stack([fp8_block_dequantize(w[e], s[e], block) for e in range(experts)]) for w, s in ((w1, s1), (w2, s2))
    ]
    check(out, x, *dequantized, topk_weights, topk_ids)
    raw = kernforge.fused_experts(x, w1, w2, topk_weights, topk_ids, False, False, True, s1, s2, list(block))
    assert torch.equal(raw, out)


def test_fp8_packing_is_saved_and_checked(tmp_path):
    g = seeded("fused_experts_fp8_io")
    w1, s1, w2, s2 = make_fp8_weights(4, 64, 64, (32, 32), g)
    packed = pack_experts_fp8(w1, s1, (32, 32), gated=True)
    torch.save(packed, tmp_path / "w1.pt")
    loaded = torch.load(tmp_path / "w1.pt")
    assert isinstance(loaded, PackedFp8Experts) and loaded.block_size == (32, 32)
    x = torch.randn(3, 64, generator=g).bfloat16()
    weights, ids = route(3, 4, 2, g)
    w2p = pack_experts_fp8(w2, s2, (32, 32))
    expected = kernforge.fused_experts(x, packed, w2p, weights, ids, use_fp8_w8a16=True)
    assert torch.equal(kernforge.fused_experts(x, loaded, w2p, weights, ids, use_fp8_w8a16=True), expected)
    with pytest.raises(ValueError, match="differs from the \\[32, 32\\] w1 was packed with"):
        kernforge.fused_experts(x, loaded, w2p, weights, ids, use_fp8_w8a16=True, block_size=[128, 128])
    with pytest.raises(ValueError, match="w1 and w2 were packed with different block sizes"):
        kernforge.fused_experts(
            x, loaded, pack_experts_fp8(w2, s2[:, :1, :1], (64, 64)), weights, ids, use_fp8_w8a16=True
        )
    with pytest.raises(ValueError, match="exclude each other"):
        kernforge.fused_experts(x, loaded, w2p, weights, ids, use_int8_w8a8=True, use_fp8_w8a16=True)
    with pytest.raises(ValueError, match="w_scale must be \\[4, 4, 2\\]"):
        pack_experts_fp8(w1, s1[:, :, :1].expand(4, 4, 2)[:, :, :1], (32, 32))
    nan = w1.clone()
    nan.view(torch.uint8)[0, 0, 0] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        pack_experts_fp8(nan, s1, (32, 32))


def test_raw_and_packed_weights_agree_bit_for_bit_and_one_part_packing_serves_aligned_inter():
    g = seeded("fused_experts_raw")
    x = torch.randn(11, 64, generator=g).bfloat16()
    w1, w2 = make_weights(8, 64, PANEL_WIDTH * 2, g)
    topk_weights, topk_ids = route(11, 8, 2, g)
    packed = kernforge.fused_experts(x, pack_experts(w1, gated=True), pack_experts(w2), topk_weights, topk_ids)
    raw = kernforge.fused_experts(x, w1, w2, topk_weights, topk_ids)
    one_part = kernforge.fused_experts(x, pack_experts(w1), pack_experts(w2), topk_weights, topk_ids)
    assert torch.equal(packed, raw) and torch.equal(packed, one_part)


def test_inplace_out_strided_rows_int64_ids_and_thread_counts_agree():
    g = seeded("fused_experts_layouts")
    backing = torch.randn(21, 2, 96, generator=g).bfloat16()
    x = backing[:, 0]  # rows 192 elements apart
    w1, w2 = make_weights(10, 96, 50, g)
    topk_weights, topk_ids = route(21, 10, 3, g)
    w1p, w2p = pack_experts(w1, gated=True), pack_experts(w2)
    expected = kernforge.fused_experts(x.contiguous(), w1p, w2p, topk_weights, topk_ids)
    assert torch.equal(kernforge.fused_experts(x, w1p, w2p, topk_weights.double(), topk_ids.long()), expected)
    buffer = torch.full((21, 96), float("nan"), dtype=torch.bfloat16)
    assert kernforge.fused_experts(x, w1p, w2p, topk_weights, topk_ids, out=buffer) is buffer
    assert torch.equal(buffer, expected)
    other = backing[:, 1].clone()
    assert kernforge.fused_experts(x, w1p, w2p, topk_weights, topk_ids, inplace=True) is x
    assert torch.equal(x, expected) and torch.equal(backing[:, 1], other)  # the other rows untouched
    kernforge.ops.set_num_threads(1)
    try:
        single = kernforge.fused_experts(backing[:, 1], w1p, w2p, topk_weights, topk_ids)
    finally:
        kernforge.ops.set_num_threads(None)
    assert torch.equal(single, kernforge.fused_experts(backing[:, 1], w1p, w2p, topk_weights, topk_ids))


def test_no_tokens_and_a_saved_packing(tmp_path):
    g = seeded("fused_experts_empty")
    w1, w2 = make_weights(8, 32, 16, g)
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    ids = torch.empty(0, 2, dtype=torch.int32)
    assert kernforge.fused_experts(x, w1, w2, torch.empty(0, 2), ids).shape == (0, 32)
    packed = pack_experts(w1, gated=True)
    torch.save(packed, tmp_path / "w1.pt")
    loaded = torch.load(tmp_path / "w1.pt")  # weights_only: PackedExperts is a safe global
    assert isinstance(loaded, PackedExperts) and loaded.shape == (32, 32) and loaded.parts == 2
    assert torch.equal(loaded.packed, packed.packed)


def _bad_calls():
    g = seeded("fused_experts_errors")
    x = torch.randn(4, 32, generator=g).bfloat16()
    w1, w2 = make_weights(8, 32, 16, g)
    weights, ids = route(4, 8, 2, g)
    bad_id = ids.clone()
    bad_id[2, 1] = 8
    negative = ids.clone()
    negative[0, 0] = -1
    return [
        ((x, w1, w2, weights, bad_id), ValueError, r"topk_ids\[2, 1\] = 8 is not an expert id"),
        ((x, w1, w2, weights, negative), ValueError, r"topk_ids\[0, 0\] = -1"),
        ((x, w1, w2[:, :16], weights, ids), ValueError, "must be \\[E, 2I, H\\] and \\[E, H, I\\]"),
        ((x, w1[:4], w2, weights, ids), ValueError, "must be \\[E, 2I, H\\]"),
        ((x, w1.float(), w2, weights, ids), TypeError, "w1 has dtype torch.float32"),
        ((x, w1, w2, weights, ids.float()), TypeError, "topk_ids has dtype"),
        ((x, w1, w2, weights[:, :1], ids), ValueError, "topk_weights must have topk_ids' shape"),
        ((x, w1, w2, weights[:3], ids[:3]), ValueError, r"topk_ids must be \[4, k\]"),
        ((x[None], w1, w2, weights, ids), ValueError, "hidden_states must be 2-D"),
        ((x.int(), w1, w2, weights, ids), TypeError, "hidden_states"),
        ((x, pack_experts(w1), pack_experts(w2), weights, ids), ValueError, "pack it with gated=True"),
        ((x, w1, w2, torch.ones(4, 9), torch.zeros(4, 9, dtype=torch.int32)), ValueError, "only 8 experts"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_bad_input_raises_naming_the_argument_and_writes_nothing(index):
    args, error, message = _bad_calls()[index]
    x = args[0]
    before = x.clone()
    with pytest.raises(error, match=message):
        kernforge.fused_experts(*args, inplace=x.dim() == 2 and x.dtype == torch.bfloat16)
    assert torch.equal(x, before)


def test_pack_experts_checks_its_weight():
    with pytest.raises(TypeError, match="pack_experts takes torch.bfloat16"):
        pack_experts(torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="3-D"):
        pack_experts(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even N"):
        pack_experts(torch.zeros(2, 5, 4, dtype=torch.bfloat16), gated=True)


# --------------------------------------------------------------------------- shared_expert


@pytest.mark.parametrize("kind", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("tokens", [1, 7, 70])
def test_shared_expert_adds_the_scaled_routed_output_in_one_pass(tier, kind, tokens):
    g = seeded("shared_expert", kind, tokens)
    hidden, inter, scale = 96, 80, 2.5
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    routed = torch.randn(tokens, hidden, generator=g).bfloat16()
    every_token = (torch.ones(tokens, 1), torch.zeros(tokens, 1, dtype=torch.int32))
    if kind == "bf16":
        w1, w2 = make_weights(1, hidden, inter, g)
        mlp = reference(x, w1, w2, *every_token)
        packed = (pack_experts(w1, gated=True), pack_experts(w2))
        raw, flags = (w1[0], w2[0]), {}
    elif kind == "int8":
        w1, s1, w2, s2 = make_int8_weights(1, hidden, inter, g)
        mlp = int8_reference(x, w1, s1, w2, s2, *every_token)
        packed = (pack_experts_int8(w1, s1, gated=True), pack_experts_int8(w2, s2))
        raw, flags = (w1[0], w2[0]), {"use_int8_w8a8": True, "w1_scale": s1[0], "w2_scale": s2[0]}
    else:
        w1, s1, w2, s2 = make_fp8_weights(1, hidden, inter, (32, 32), g)
        dequantized = [fp8_block_dequantize(w[0], s[0], (32, 32))[None] for w, s in ((w1, s1), (w2, s2))]
        mlp = reference(x, *dequantized, *every_token)
        packed = (pack_experts_fp8(w1, s1, (32, 32), gated=True), pack_experts_fp8(w2, s2, (32, 32)))
        raw, flags = (
            (w1[0], w2[0]),
            {"use_fp8_w8a16": True, "w1_scale": s1[0], "w2_scale": s2[0], "block_size": [32, 32]},
        )
    quantized = {k: v for k, v in flags.items() if k.startswith("use_")}
    out = kernforge.shared_expert(x, *packed, routed, scale, **quantized)
    expected = mlp + scale * routed.float()
    assert (out.float() - expected).abs().max().item() <= 1.6e-2 * expected.abs().max().item()
    assert torch.equal(kernforge.shared_expert(x, *raw, routed, scale, **flags), out)
    alone = kernforge.shared_expert(x, *packed, **quantized)  # no routed output: the expert alone
    assert (alone.float() - mlp).abs().max().item() <= 1.6e-2 * mlp.abs().max().item()
    inplace = routed.clone()
    assert kernforge.shared_expert(x, *packed, inplace, scale, inplace=False, out=inplace, **quantized) is inplace
    assert torch.equal(inplace, out)  # out may be fused_experts_out itself


def test_shared_expert_checks_its_arguments():
    g = seeded("shared_expert_errors")
    x = torch.randn(4, 32, generator=g).bfloat16()
    w1, w2 = make_weights(1, 32, 16, g)
    with pytest.raises(ValueError, match="together"):
        kernforge.shared_expert(x, w1[0], w2[0], x)
    with pytest.raises(ValueError, match="fused_experts_out must match hidden_states"):
        kernforge.shared_expert(x, w1[0], w2[0], x[:2], 1.0)
    with pytest.raises(ValueError, match="holds 2 experts; a shared expert is one"):
        kernforge.shared_expert(x, pack_experts(torch.cat([w1, w1]), gated=True), w2[0])
    with pytest.raises(ValueError, match="w2 must be 2-D"):
        kernforge.shared_expert(x, w1[0], w2[0, 0])
