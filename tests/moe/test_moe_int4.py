"""fused_experts and shared_expert on four-bit experts: W4A8 (``moe_comp_method=INT4_W4A8``, sgl-kernel's
int4 MoE) and W4A16 (kernforge's ``INT4_W4A16``), from ``pack_experts_int4``'s bf16 quantization or from a
checkpoint's tensors through ``convert_weight_packed_scale_zp``.

The reference is float64 over the experts' dequantized weights (``(code - zero) * scale``, exact in
float64), rounding the intermediate silu(gate) * up to the activations' dtype as the kernel stores it.
For W4A8 it quantizes the activations and the intermediate per token as the kernel does (then the
only differences are fp32 accumulation and roundings) and, separately, the plain reference must hold
within the int8 activations' quantization error. Routing: the k slots of each token shuffled, experts
left without tokens, every token on one expert (more than a row block of 64), odd token counts, one
token; H and I not multiples of 64 (nor I of 32: the gate and up halves then start mid-chunk), group
sizes from 16 to 256 (longer than the kernels' 128-deep K blocks), on every tier.
"""

import types

import pytest
import torch
import torch.nn.functional as F

import kernforge
from kernforge.ops.gemm.int4 import GPTQ, convert_weight_packed_scale_zp, pack_int4
from kernforge.ops.moe import experts as moe_experts
from kernforge.ops.moe.experts import (
    CPUQuantMethod,
    PackedInt4Experts,
    pack_experts_int4,
    pack_experts_int8,
    quantize_experts_int4,
)

from conftest import TESTS_DIR
from op_helpers import seeded
from references import per_token_quant_reference

W4A8, W4A16 = CPUQuantMethod.INT4_W4A8, CPUQuantMethod.INT4_W4A16
MODES = pytest.mark.parametrize("mode", [W4A8, W4A16], ids=["w4a8", "w4a16"])
# x the output's max: against the reference that computes what the kernel computes (W4A8: the same
# int8 activations), and W4A8 against the float reference (the activations' int8 rounding).
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
W4A8_TOLERANCE = 3e-2


def reference(x, d1, d2, topk_weights, topk_ids, quantized):
    """float64 MoE over dequantized experts ``d1 [E, 2I, H]``, ``d2 [E, H, I]``: silu(gate) * up
    rounded to x's dtype; ``quantized``: x and the intermediate per token to int8 first (W4A8)."""
    tokens, hidden = x.shape
    inter = d2.shape[2]

    def rows(a):  # the activations as the kernel multiplies them
        if not quantized:
            return a.double()
        q, scale = per_token_quant_reference(a)
        return (q.double() - 128) * scale.double()[:, None]

    out = torch.zeros(tokens, hidden, dtype=torch.float64)
    xs = rows(x)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate_up = xs[token] @ d1[e].T
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        out.index_add_(0, token, (rows(act) @ d2[e].T) * topk_weights[token, slot, None].double())
    return out


def check(out, expected, tolerance):
    scale = max(expected.abs().max().item(), 1e-3)
    error = (out.double() - expected).abs().max().item()
    assert error <= tolerance * scale, f"max error {error:.3g} vs output scale {scale:.3g} (tolerance {tolerance})"


def check_both(out, x, d1, d2, topk_weights, topk_ids, mode):
    quantized = mode == W4A8
    check(out, reference(x, d1, d2, topk_weights, topk_ids, quantized), TOLERANCES[x.dtype])
    if quantized:
        check(out, reference(x, d1, d2, topk_weights, topk_ids, False), W4A8_TOLERANCE)


def make_weights(experts, hidden, inter, g):
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).bfloat16()
    return w1, w2


def route(tokens, experts, k, g, skew=None):
    """(topk_weights fp32, topk_ids int32), each token's k slots in a random order. skew "few": ids
    among the first 2k experts only; "one": every token on expert 3 (and k - 1 others)."""
    scores = torch.rand(tokens, experts, generator=g)
    if skew == "few":
        scores[:, 2 * k :] = -1.0
    if skew == "one":
        scores[:, 3 % experts] = 2.0
    weights, ids = torch.topk(scores, k, dim=-1)
    order = torch.argsort(torch.rand(tokens, k, generator=g), dim=-1)
    return weights.gather(1, order).softmax(-1), ids.gather(1, order).to(torch.int32)


CASES = [  # tokens, hidden, inter, experts, k, skew, group_size (None: 128 or the largest divisor below)
    (1, 64, 64, 8, 2, None, 32),
    (1, 200, 72, 60, 4, None, None),  # groups of 100 and 72
    (3, 96, 40, 8, 1, None, None),  # I = 40: gate and up packed apart
    (7, 136, 96, 16, 8, None, None),  # H = 136 (groups of 68)
    (33, 128, 48, 32, 4, "few", 16),  # 24 of 32 experts idle
    (70, 192, 80, 8, 2, "one", None),  # 70 rows on expert 3: two row blocks
    (20, 512, 256, 4, 2, None, 256),  # groups of 256, split into the kernels' K blocks
    (130, 256, 160, 8, 2, None, 32),
]


@MODES
@pytest.mark.parametrize("tokens,hidden,inter,experts,k,skew,group", CASES)
def test_matches_the_dequantized_float64_reference(tier, mode, tokens, hidden, inter, experts, k, skew, group):
    g = seeded("moe_int4", tokens, hidden, inter, experts, k, skew, group)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w1, w2 = make_weights(experts, hidden, inter, g)
    topk_weights, topk_ids = route(tokens, experts, k, g, skew)
    p1, p2 = pack_experts_int4(w1, w2, group_size=group)
    assert isinstance(p1, PackedInt4Experts) and p1.parts == 2 and p2.parts == 1
    out = kernforge.fused_experts(x, p1, p2, topk_weights, topk_ids, moe_comp_method=mode)
    assert out.shape == x.shape and out.dtype == x.dtype
    check_both(out, x, p1.dequantize(torch.float64), p2.dequantize(torch.float64), topk_weights, topk_ids, mode)


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp32_and_fp16_activations(tier, mode, dtype):
    g = seeded("moe_int4_dtype", dtype)
    x = torch.randn(9, 80, generator=g).to(dtype)
    w1, w2 = make_weights(12, 80, 36, g)
    topk_weights, topk_ids = route(9, 12, 3, g)
    p1, p2 = pack_experts_int4(w1, w2, group_size=None, symmetric=True)
    assert torch.all(p1.zeros == 8) and torch.all(p2.zeros == 8)
    out = kernforge.fused_experts(x, p1, p2, topk_weights, topk_ids, moe_comp_method=mode)
    assert out.dtype == dtype
    check_both(out, x, p1.dequantize(torch.float64), p2.dequantize(torch.float64), topk_weights, topk_ids, mode)


# --------------------------------------------------------------------------- checkpoint tensors


def _int32(words):
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_experts(experts, n, k, group, g):
    """A GPTQ checkpoint's stacked experts: (qweight int32 [E, K/8, N] packed along K, qzeros int32
    [E, G, N/8] holding z - 1 along N, scales fp16 [E, G, N]) and their codes [E, N, K] and zero
    points [E, G, N] (1..16)."""
    codes = torch.randint(0, 16, (experts, n, k), generator=g)
    zeros = torch.randint(1, 17, (experts, k // group, n), generator=g)
    scales = (torch.rand(experts, k // group, n, generator=g) + 0.5) * (2 / (15 * k**0.5))
    along_k = codes.transpose(1, 2)  # [E, K, N]
    qweight = sum(along_k[:, i::8] << (4 * i) for i in range(8))
    qzeros = sum((zeros[..., i::8] - 1) << (4 * i) for i in range(8))
    return (_int32(qweight), _int32(qzeros), scales.half()), codes, zeros


@MODES
@pytest.mark.parametrize("inter", [64, 40], ids=["I64", "I40"])
def test_checkpoint_tensors_as_sgl_kernel_takes_them(tier, mode, inter):
    """convert_weight_packed_scale_zp of [E, ...] tensors packs each expert; fused_experts takes its
    w, w_zeros, w_scales as w1/w2, w1_zero/w2_zero, w1_scale/w2_scale: the same as packed once. I = 64
    keeps one part (the up half starts a chunk), I = 40 is split into two."""
    g = seeded("moe_int4_checkpoint", inter)
    experts, hidden, tokens, group = 6, 128, 11, 32
    checkpoint1, codes1, zeros1 = gptq_experts(experts, 2 * inter, hidden, group, g)
    checkpoint2, codes2, zeros2 = gptq_experts(experts, hidden, inter, 8, g)
    (w1, z1, s1), (w2, z2, s2) = (convert_weight_packed_scale_zp(*c, GPTQ) for c in (checkpoint1, checkpoint2))
    assert w1.shape == (experts, -(-2 * inter // 64), hidden // 4, 128) and z1.shape == s1.shape
    assert s1.shape == (experts, hidden // group, 2 * inter) and z1.dtype == torch.uint8
    one = convert_weight_packed_scale_zp(*(t[2] for t in checkpoint1), GPTQ)
    assert all(torch.equal(a[2], b) for a, b in zip((w1, z1, s1), one))
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    topk_weights, topk_ids = route(tokens, experts, 2, g)
    raw = kernforge.fused_experts(x, w1, w2, topk_weights, topk_ids, False, moe_comp_method=mode, w1_scale=s1,
                                  w2_scale=s2, w1_zero=z1, w2_zero=z2)  # fmt: skip
    p1 = PackedInt4Experts.from_tensors(w1, z1, s1, gated=True)
    p2 = PackedInt4Experts.from_tensors(w2, z2, s2)
    assert p1.parts == (1 if inter % 32 == 0 else 2) and (p1.n, p1.k, p1.group_size) == (2 * inter, hidden, group)
    assert torch.equal(kernforge.fused_experts(x, p1, p2, topk_weights, topk_ids, moe_comp_method=mode), raw)

    # the same codes packed gate and up apart (as pack_experts_int4 packs them) compute the same bits
    def halves(e):
        columns = (slice(0, inter), slice(inter, 2 * inter))
        return [pack_int4(codes1[e, c], zeros1[e, :, c], s1[e, :, c]) for c in columns]

    parts = [half for e in range(experts) for half in halves(e)]
    split = moe_experts._stacked_int4(parts, experts, 2, 2 * inter, hidden, group)
    assert torch.equal(kernforge.fused_experts(x, split, p2, topk_weights, topk_ids, moe_comp_method=mode), raw)

    def dequantized(codes, zeros, scales, size):
        expand = lambda t: t.double().repeat_interleave(size, dim=1).transpose(1, 2)  # noqa: E731  [E, N, K]
        return (codes.double() - expand(zeros)) * expand(scales)

    d1, d2 = dequantized(codes1, zeros1, s1, group), dequantized(codes2, zeros2, s2, 8)
    assert torch.equal(d1, p1.dequantize(torch.float64))
    check_both(raw, x, d1, d2, topk_weights, topk_ids, mode)


# --------------------------------------------------------------------------- shared_expert


@MODES
@pytest.mark.parametrize("tokens", [1, 7, 70])
def test_shared_expert_adds_the_scaled_routed_output(tier, mode, tokens):
    g = seeded("moe_int4_shared", int(mode), tokens)
    hidden, inter, scale = 96, 80, 2.5
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    routed = torch.randn(tokens, hidden, generator=g).bfloat16()
    w1, w2 = make_weights(1, hidden, inter, g)
    p1, p2 = pack_experts_int4(w1, w2, group_size=16)
    every_token = (torch.ones(tokens, 1), torch.zeros(tokens, 1, dtype=torch.int32))
    d1, d2 = p1.dequantize(torch.float64), p2.dequantize(torch.float64)
    out = kernforge.shared_expert(x, p1, p2, routed, scale, moe_comp_method=mode)
    mlp = reference(x, d1, d2, *every_token, mode == W4A8)
    check(out, mlp + scale * routed.double(), TOLERANCES[x.dtype])
    alone = kernforge.shared_expert(x, p1, p2, moe_comp_method=mode)
    check(alone, mlp, TOLERANCES[x.dtype])
    # raw: one expert's convert_weight_packed_scale_zp tensors (no expert dimension; w1 [2I, H] in one
    # part, which I = 80 makes the call split in two): the same bits
    whole = quantize_experts_int4(w1, gated=False, group_size=16)
    assert whole.parts == 1 and torch.equal(whole.dequantize(), p1.dequantize())
    flags = {"moe_comp_method": mode, "w1_zero": whole.zeros[0, 0], "w1_scale": whole.scales[0, 0]}
    flags.update(w2_zero=p2.zeros[0, 0], w2_scale=p2.scales[0, 0])
    raw = kernforge.shared_expert(x, whole.packed[0, 0], p2.packed[0, 0], routed, scale, **flags)
    assert torch.equal(raw, out)


def test_shared_expert_raw_weights_need_their_zero_points():
    g = seeded("moe_int4_shared_errors")
    w1, w2 = make_weights(1, 64, 32, g)
    p1, p2 = pack_experts_int4(w1, w2, group_size=32)
    x = torch.randn(3, 64, generator=g).bfloat16()
    with pytest.raises(ValueError, match="needs w2_zero and w2_scale"):
        kernforge.shared_expert(x, p1, p2.packed[0, 0], moe_comp_method=W4A8, w2_scale=p2.scales[0, 0])
    with pytest.raises(ValueError, match="w2 must be 3-D"):
        kernforge.shared_expert(x, p1, p2.packed[0, 0, 0], moe_comp_method=W4A8)


# --------------------------------------------------------------------------- packing, custom op, model


def test_packing_is_saved_and_runs_as_the_custom_op(tmp_path):
    import kernforge.torch_library  # noqa: F401  (defines torch.ops.kernforge.*)

    g = seeded("moe_int4_io")
    w1, w2 = make_weights(4, 64, 48, g)
    p1, p2 = pack_experts_int4(w1, w2, group_size=None)
    assert (p1.group_size, p2.group_size) == (64, 48)  # groups of 128 do not divide H = 64 nor I = 48
    torch.save((p1, p2), tmp_path / "experts.pt")
    l1, l2 = torch.load(tmp_path / "experts.pt")  # weights_only: PackedInt4Experts is a safe global
    assert isinstance(l1, PackedInt4Experts) and l1.shape == (96, 64) and torch.equal(l1.packed, p1.packed)
    x = torch.randn(5, 64, generator=g).bfloat16()
    topk_weights, topk_ids = route(5, 4, 2, g)
    routed = torch.randn(5, 64, generator=g).bfloat16()
    shared = tuple(quantize_experts_int4(w[:1], gated=gated) for w, gated in ((w1, True), (w2, False)))
    for mode in (W4A8, W4A16):
        eager = kernforge.fused_experts(x, p1, p2, topk_weights, topk_ids, moe_comp_method=mode)
        assert torch.equal(kernforge.fused_experts(x, l1, l2, topk_weights, topk_ids, moe_comp_method=mode), eager)
        arguments, out = moe_experts._to_schema(x, l1, l2, topk_weights, topk_ids, moe_comp_method=mode)
        assert out is None and arguments[-3:] == (64, 48, mode == W4A16)
        assert torch.equal(torch.ops.kernforge.fused_experts(*arguments), eager)
        eager = kernforge.shared_expert(x, *shared, routed, 0.5, moe_comp_method=mode)
        arguments, _ = moe_experts._shared_to_schema(x, *shared, routed, 0.5, moe_comp_method=mode)
        assert torch.equal(torch.ops.kernforge.shared_expert(*arguments), eager)


@pytest.mark.parametrize("weights", ["int4", "int4_w4a16"])
def test_amx_build_compiles(weights):
    """The amx tier's build (AMX machines run it; the int4 products are its AVX-512 code) compiles here."""
    from kernforge.jit import core

    spec = core.KernelSpec.make(moe_experts.EXPERTS, {"dtype": "bf16", "weights": weights}, "amx")
    result, _ = core.build(spec, load=False)
    assert result.key


def test_model_kernels_name_the_int4_variants():
    spec = types.SimpleNamespace(num_experts=8, dtype=torch.bfloat16)
    for quant in ("int4", "int4_w4a16"):
        kernels = moe_experts._for_model(spec, (), quant)
        assert kernels == [{"module": "moe_experts", "params": {"dtype": "bf16", "weights": quant}}]


def _bad_calls():
    g = seeded("moe_int4_errors")
    x = torch.randn(4, 64, generator=g).bfloat16()
    w1, w2 = make_weights(8, 64, 32, g)
    p1, p2 = pack_experts_int4(w1, w2, group_size=32)
    weights, ids = route(4, 8, 2, g)
    raw1 = (p1.packed[:, 0], p1.zeros[:, 0], p1.scales[:, 0])  # gate halves only: [E, I, H] as w1
    i8 = pack_experts_int8(torch.ones(8, 64, 64, dtype=torch.int8), torch.ones(8, 64), gated=True)
    bad_zeros = PackedInt4Experts(p1.packed, p1.zeros[:, :, :1], p1.scales, 8, 64, 64, 32, 2)
    bad_group = PackedInt4Experts(p1.packed, p1.zeros, p1.scales, 8, 64, 64, 24, 2)
    common = (x, p1, p2, weights, ids)
    return [
        (common, {"moe_comp_method": 4}, ValueError, r"moe_comp_method must be one of .*3 \(INT4_W4A8\)"),
        (common, {"moe_comp_method": "3"}, TypeError, "moe_comp_method must be an int"),
        (common, {"moe_comp_method": True}, TypeError, "moe_comp_method must be an int"),
        (common, {"moe_comp_method": 1, "use_fp8_w8a16": True}, ValueError, "INT8_W8A8 contradicts use_fp8_w8a16"),
        (common, {}, TypeError, "w1 is a PackedInt4Experts; bf16 weights .* takes PackedExperts"),
        (common, {"use_int8_w8a8": True}, TypeError, "w1 is a PackedInt4Experts; use_int8_w8a8"),
        ((x, i8, p2, weights, ids), {"moe_comp_method": W4A8}, TypeError, "w1 is a PackedInt8Experts; moe_comp"),
        (common, {"moe_comp_method": W4A8, "w1_scale": p1.scales}, ValueError, "w1_zero and w1_scale must be None"),
        (common, {"moe_comp_method": W4A8, "block_size": [32, 32]}, ValueError, "block_size is for fp8"),
        (common, {"moe_comp_method": W4A8, "a2_scale": x}, ValueError, "a2_scale must be None"),
        (common, {"use_int8_w8a8": True, "w2_zero": p2.zeros}, ValueError, "w1_zero and w2_zero are for int4"),
        ((x, raw1[0], p2, weights, ids), {"moe_comp_method": W4A8}, ValueError, "needs w1_zero and w1_scale"),
        (
            (x, raw1[0], p2, weights, ids),
            {"moe_comp_method": W4A8, "w1_zero": raw1[1].int(), "w1_scale": raw1[2]},
            TypeError,
            "w1_zero has dtype torch.int32",
        ),  # fmt: skip
        (
            (x, raw1[0], p2, weights, ids),
            {"moe_comp_method": W4A8, "w1_zero": raw1[1], "w1_scale": raw1[2][:, :1]},
            ValueError,
            "w1, w1_zero, w1_scale must be",
        ),  # fmt: skip
        (
            (x, raw1[0], p2, weights, ids),  # N = 96 columns need 2 panels
            {"moe_comp_method": W4A8, "w1_zero": raw1[1].repeat(1, 1, 3), "w1_scale": raw1[2].repeat(1, 1, 3)},
            ValueError,
            "w1 .* does not match w1_scale",
        ),  # fmt: skip
        (
            (x, raw1[0], p2, weights, ids),  # past a 4-bit zero point: the kernels' code - zero byte would wrap
            {"moe_comp_method": W4A8, "w1_zero": raw1[1] + 17, "w1_scale": raw1[2]},
            ValueError,
            r"w1_zero must lie in \[0, 16\]",
        ),  # fmt: skip
        (
            (x, raw1[0], p2, weights, ids),
            {"moe_comp_method": W4A8, "w1_zero": raw1[1], "w1_scale": raw1[2]},
            ValueError,
            "must be \\[E, 2I, H\\] and \\[E, H, I\\]",
        ),  # fmt: skip
        ((x, bad_zeros, p2, weights, ids), {"moe_comp_method": W4A16}, ValueError, "w1.zeros must be"),
        ((x, bad_group, p2, weights, ids), {"moe_comp_method": W4A16}, ValueError, "w1.group_size must be"),
        ((x, p1, p2, weights, ids.float()), {"moe_comp_method": W4A8}, TypeError, "topk_ids has dtype"),
        ((x[:, :32], p1, p2, weights, ids), {"moe_comp_method": W4A8}, ValueError, "H = 32"),
    ]


@pytest.mark.parametrize("index", range(21))
def test_bad_input_raises_naming_the_argument_and_writes_nothing(index):
    args, kwargs, error, message = _bad_calls()[index]
    x = args[0]
    before = x.clone()
    with pytest.raises(error, match=message):
        kernforge.fused_experts(*args, inplace=x.is_contiguous(), **kwargs)
    assert torch.equal(x, before)


def test_pack_experts_int4_checks_its_arguments():
    w1, w2 = make_weights(2, 64, 48, seeded("moe_int4_pack_errors"))
    with pytest.raises(ValueError, match="group_size must be a multiple of 4 that divides K = 48"):
        pack_experts_int4(w1, w2, group_size=32)
    with pytest.raises(TypeError, match="group_size must be an int or None"):
        pack_experts_int4(w1, w2, group_size=32.0)
    with pytest.raises(TypeError, match="w13 has dtype torch.int8"):
        pack_experts_int4(w1.to(torch.int8), w2)
    with pytest.raises(ValueError, match="w13 and w2 must be \\[E, 2I, H\\] and \\[E, H, I\\]"):
        pack_experts_int4(w1, w2[:, :, :40])
    with pytest.raises(ValueError, match="w2 must be 3-D"):
        pack_experts_int4(w1, w2[0])
    with pytest.raises(ValueError, match="even N"):
        quantize_experts_int4(w1[:, :95], gated=True)
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        pack_experts_int4(w1, w2, group_size=16, symmetric="yes")
    with pytest.raises(ValueError, match="scales and qzeros must be 3-D too"):
        convert_weight_packed_scale_zp(torch.zeros(2, 8, 8, dtype=torch.int32), None, torch.ones(4, 8), GPTQ)


def test_transformers_moe_with_int4_experts_tracks_its_dequantized_weights(monkeypatch):
    """optimize(quant="int4" | "int4_w4a16") on a Qwen2-MoE (experts, shared expert, attention all four
    bit): the experts are PackedInt4Experts, and the logits track stock's on the dequantized weights."""
    monkeypatch.syspath_prepend(str(TESTS_DIR / "integrations"))  # its MoE models, by their module's name
    moe_tests = pytest.importorskip("test_transformers_moe", reason="needs transformers >= 5")
    from kernforge.ops.gemm.int4 import dequantize_int4, quantize_int4

    stock, _ = moe_tests.build("qwen2_moe")

    def dequantize(weight):  # as kernforge.nn.Linear and quantize_experts_int4 group K
        return dequantize_int4(quantize_int4(weight.float(), group_size=None))

    dequantized = moe_tests.copy.deepcopy(stock).float()
    with torch.no_grad():
        for module in dequantized.model.layers.modules():
            for name, child in module.named_children():  # the linears but the gates, which stay bf16
                if type(child) is torch.nn.Linear and name not in ("gate", "shared_expert_gate"):
                    child.weight.copy_(dequantize(child.weight))
            if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):  # the stacked experts
                for expert in (*module.gate_up_proj, *module.down_proj):
                    expert.copy_(dequantize(expert))
    expected = moe_tests.last_logits(dequantized)
    for quant in ("int4_w4a16", "int4"):
        model = moe_tests.quantized(stock, quant)
        assert type(model.model.layers[0].mlp.w1).__name__ == "PackedInt4Experts"
        # (stock's own logits are at cosine 0.90 of these: four bits move them that far)
        assert moe_tests.cosine(moe_tests.last_logits(model), expected).min() > (
            0.999 if quant == "int4_w4a16" else 0.995
        )
