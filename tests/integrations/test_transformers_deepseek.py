"""kernforge.integrations.transformers on DeepSeek-V2/V3: tiny random models with the real structure
(multi-head latent attention with and without q_lora_rank, interleaved and YaRN-scaled RoPE, a dense
first layer, MoE layers with shared experts and each routing rule), optimized vs stock transformers
(bf16, the same weights).

The criteria are the MoE tests' (test_transformers_moe): last-position logits within cosine 0.999 of
stock's, greedy tokens stock's or a first difference at a near-tie. The attention block is checked
alone too: both of its paths (absorbed, over the latent pages; unabsorbed, the ragged prefill kernel)
against transformers' own attention module, as close to its float32 copy as stock bf16 is.
"""

import copy
import warnings
from contextlib import contextmanager

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
import test_transformers_integration as llama_tests  # noqa: E402
import test_transformers_moe as moe_tests  # noqa: E402
from transformers import (  # noqa: E402
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.integrations.transformers import _cache  # noqa: E402

VOCAB = moe_tests.VOCAB
SHAPE = dict(
    hidden_size=128,
    num_attention_heads=4,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    initializer_range=0.1,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    intermediate_size=192,
    moe_intermediate_size=64,
    n_shared_experts=1,
    first_k_dense_replace=1,  # layer 0 a dense MLP, the others MoE
    num_hidden_layers=3,
    num_experts_per_tok=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    dtype="bfloat16",
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=1024,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,  # sm_scale gets mscale^2
)
MODELS = {
    # DeepSeek-V2-Lite's structure: q_proj (no q_lora_rank), softmax top-k routing
    "v2_lite": (
        DeepseekV2ForCausalLM,
        DeepseekV2Config,
        dict(q_lora_rank=None, n_routed_experts=8, topk_method="greedy"),
    ),
    # DeepSeek-V2's: q_a/q_b with q_lora_rank, group-limited routing, scaled routed experts
    "v2": (
        DeepseekV2ForCausalLM,
        DeepseekV2Config,
        dict(
            q_lora_rank=48,
            n_routed_experts=8,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.0,
        ),
    ),
    # DeepSeek-V3's: YaRN, interleaved RoPE, sigmoid routing with the correction bias in groups, renormalized
    "v3": (
        DeepseekV3ForCausalLM,
        DeepseekV3Config,
        dict(
            q_lora_rank=48,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
        ),
    ),
}
LENGTHS = [13, 70]  # a left-padded batch; 70 >= RAGGED_PREFILL_MIN_TOKENS: its prefill runs unabsorbed
NEW_TOKENS = 8
CACHE = moe_tests.CACHE


def build(kind: str, quant: str | None = None, **overrides):
    """(stock bf16 model, the kernforge-optimized copy)."""
    model_class, config_class, shape = MODELS[kind]
    torch.manual_seed(0)
    stock = model_class(config_class(**{**SHAPE, **shape, **overrides})).to(torch.bfloat16).eval()
    with torch.no_grad():
        for layer in stock.model.layers:  # a correction bias that changes choices (stock's init is zeros)
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.1)
    return stock, kft.optimize(copy.deepcopy(stock), kv_cache_pages=256, quant=quant)


@pytest.fixture(scope="module", params=list(MODELS))
def deepseek(request):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported DeepSeek model leaves nothing on the stock path
        return request.param, *build(request.param)


padded_batch = moe_tests.padded_batch  # left-padded prompts with ids from 3 up (no special tokens)


@torch.no_grad()
def last_logits(model, lengths=LENGTHS) -> torch.Tensor:
    ids, mask = padded_batch(lengths)
    return model(ids, attention_mask=mask if len(lengths) > 1 else None).logits[:, -1].float()


# --------------------------------------------------------------------------- structure


def test_modules_are_replaced(deepseek):
    kind, stock, ours = deepseek
    layers = ours.model.layers
    assert [type(layer.self_attn).__name__ for layer in layers] == ["MLAttention"] * 3
    assert [type(layer.mlp).__name__ for layer in layers] == ["GatedMLP", "DeepseekMoE", "DeepseekMoE"]
    block = layers[1].mlp
    assert block.rule == {"v2_lite": "greedy", "v2": "group_limited_greedy", "v3": "noaux_tc"}[kind]
    assert block.renormalize is (kind == "v3")
    assert block.routed_scaling_factor == stock.config.routed_scaling_factor
    attn = layers[0].self_attn
    assert attn.is_neox is False  # DeepSeek's interleaved pairs
    assert attn.scaling == stock.model.layers[0].self_attn.scaling
    assert (attn.q_lora_rank is None) == (kind == "v2_lite")
    runtime = ours._kernforge
    assert runtime.pool.kv.shape == (3, 256, 16, SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"])
    assert type(kft.new_cache(ours)).__name__ == "MLAPagedCache"


# --------------------------------------------------------------------------- logits and tokens


@pytest.mark.parametrize(
    "lengths, ragged_from",
    [([9], 1 << 30), (LENGTHS, _cache.RAGGED_PREFILL_MIN_TOKENS)],
    ids=["absorbed_prefill", "padded_ragged_prefill"],
)
def test_last_logits_match_stock(deepseek, lengths, ragged_from, monkeypatch):
    """Each row of a (left-padded) batch vs stock on that prompt alone (stock's own padded forward,
    positions counted from the padding, is further off: cosine 0.9935 for v2_lite's short row); the
    prompt attends absorbed (over the latent pages) or unabsorbed (the ragged prefill)."""
    monkeypatch.setattr(_cache, "RAGGED_PREFILL_MIN_TOKENS", ragged_from)
    kind, stock, ours = deepseek
    ids, _ = padded_batch(lengths)
    ours_logits = last_logits(ours, lengths)
    for row, length in enumerate(lengths):
        with torch.no_grad():
            alone = stock(ids[row : row + 1, ids.shape[1] - length :]).logits[0, -1].float()
        similarity = moe_tests.cosine(ours_logits[row], alone).item()
        assert similarity >= 0.999, f"{kind} row {row}: last logits' cosine {similarity}"


@contextmanager
def routing(stock, ours):
    """Each MoE layer's choices while inside, in the order computed: (stock's router logits [T, E]
    fp32, stock's expert ids [T, k], ours [T, k])."""
    theirs, mine = [], []
    handles = [
        layer.mlp.gate.register_forward_hook(lambda module, args, out: theirs.append((out[0].float(), out[2])))
        for layer in stock.model.layers
        if hasattr(layer.mlp, "experts")
    ]
    routed = [layer.mlp for layer in ours.model.layers if hasattr(layer.mlp, "route")]
    for block in routed:
        block.route = lambda x, route=block.route: mine.append(route(x)[1]) or route(x)
    sites = []
    try:
        yield sites
    finally:
        for handle in handles:
            handle.remove()
        for block in routed:
            del block.route
        routers = [layer.mlp.gate for layer in stock.model.layers if hasattr(layer.mlp, "experts")]
        sites += [
            (logits, ids, our, routers[i % len(routers)]) for i, ((logits, ids), our) in enumerate(zip(theirs, mine))
        ]


def first_flip_is_near_tie(sites, row_tokens) -> tuple[bool, str]:
    """Where a token was first routed to other experts than stock's (its tokens ``row_tokens(site)``),
    whether stock's choice there was a near-tie (four bf16 steps) of the scores the rule compares:
    the experts' (softmax, or sigmoid plus the correction bias) or their groups' (best expert, or the
    sum of the best two)."""
    for index, (logits, ids, ours, router) in enumerate(sites):
        for token in row_tokens(index):
            kept, taken = (
                set(ids[token].tolist()) - set(ours[token].tolist()),
                set(ours[token].tolist()) - set(ids[token].tolist()),
            )
            if not kept:
                continue
            bias = getattr(router, "e_score_correction_bias", None)
            scores = logits[token].softmax(-1) if bias is None else logits[token].sigmoid() + bias.float()
            near = []
            a, b = scores[sorted(kept)].min().item(), scores[sorted(taken)].max().item()
            near.append(abs(a - b) <= 4 * moe_tests.bf16_step(a))
            if router.num_group:
                per_group = scores.view(router.num_group, -1)
                group_scores = per_group.max(-1).values if bias is None else per_group.topk(2, -1)[0].sum(-1)
                size = per_group.shape[1]
                a = min(group_scores[e // size].item() for e in kept)
                b = max(group_scores[e // size].item() for e in taken)
                near.append(abs(a - b) <= 4 * moe_tests.bf16_step(a))
            return any(near), f"site {index} token {token}: stock {sorted(kept)}, kernforge {sorted(taken)}"
    return False, "no routing difference"


def test_greedy_tokens_and_decode_logits_match_stock(deepseek, record_property):
    """Teacher-forced on stock's greedy sequence (a padded batch: the prefill, then absorbed decode
    steps over the latent pages), every step's logits are within cosine 0.999 of stock's, or the
    row was first routed differently at a near-tie of stock's scores; our own greedy tokens are
    stock's, or first differ at a near-tie of stock's logits or after such a routing difference."""
    kind, stock, ours = deepseek
    ids, mask = padded_batch(LENGTHS)
    width = ids.shape[1]
    with routing(stock, ours) as sites:
        out = stock.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        sequence, cache = out.sequences, kft.new_cache(ours)
        full_mask = torch.cat([mask, mask.new_ones(len(LENGTHS), NEW_TOKENS)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp_(min=0)
        with torch.no_grad():
            steps = [ours(ids, attention_mask=mask, position_ids=positions[:, :width], **{CACHE: cache}).logits[:, -1]]
            for column in range(width, sequence.shape[1] - 1):
                step = ours(
                    sequence[:, column : column + 1],
                    attention_mask=full_mask[:, : column + 1],
                    position_ids=positions[:, column : column + 1],
                    **{CACHE: cache},
                )
                steps.append(step.logits[:, -1])
    moe_layers = sum(hasattr(layer.mlp, "experts") for layer in stock.model.layers)
    flipped = {}
    for row in range(len(LENGTHS)):

        def tokens(index, row=row):  # the row's prompt tokens (prefill), then its one token per step
            return moe_tests.prompt_tokens(row) if index < moe_layers else [row]

        flipped[row] = first_flip_is_near_tie(sites, tokens)
    for step, (got, expected) in enumerate(zip(steps, out.logits)):
        for row, similarity in enumerate(moe_tests.cosine(got.float(), expected.float()).tolist()):
            if similarity < 0.999:
                near, where = flipped[row]
                report = f"{kind} step {step} row {row}: cosine {similarity:.5f}; first routing flip: {where}"
                record_property(f"routing flip, row {row}", report)
                assert near, report

    got = kft.generate(ours, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=[])[:, width:]
    expected = sequence[:, width:]
    for row in range(len(LENGTHS)):
        different = (got[row] != expected[row]).nonzero()
        if len(different):
            step = int(different[0])
            logits = out.logits[step][row].float()
            top = logits.max().item()
            margin = top - logits[got[row, step]].item()
            report = f"{kind} row {row}: greedy diverges at step {step}, {margin} below stock's top logit {top}"
            record_property(f"divergence, row {row}", report)
            assert margin <= 2 * moe_tests.bf16_step(top) or flipped[row][0], report


def test_transformers_generate_runs_on_the_latent_cache(deepseek):
    _, _, ours = deepseek
    ids, mask = padded_batch([3, 12])
    theirs = ours.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(theirs, kft.generate(ours, ids, attention_mask=mask, max_new_tokens=4))


# --------------------------------------------------------------------------- the attention block


@pytest.mark.parametrize("kind, interleave", [("v2_lite", True), ("v3", True), ("v3", False)])
@torch.no_grad()
def test_absorbed_and_unabsorbed_attention_match_transformers(kind, interleave, monkeypatch):
    """One attention block on one prompt, both paths forced, vs transformers' DeepseekV2Attention /
    DeepseekV3Attention: each within bf16 rounding of the module's float32 copy (as close as stock bf16
    is, with slack), and the two paths within bf16 tolerance of each other."""
    overrides = {} if kind == "v2_lite" else {"rope_interleave": interleave}
    stock, ours = build(kind, num_hidden_layers=1, first_k_dense_replace=1, **overrides)
    attn, reference = stock.model.layers[0].self_attn, copy.deepcopy(stock.model.layers[0].self_attn).float()
    hidden = torch.randn(1, 40, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(3)).bfloat16()
    position_ids = torch.arange(40)[None]
    theirs = attn(hidden, position_embeddings=stock.model.rotary_emb(hidden, position_ids), attention_mask=None)[0]
    expected = reference(
        hidden.float(),
        position_embeddings=copy.deepcopy(stock.model.rotary_emb).float()(hidden.float(), position_ids),
        attention_mask=None,
    )[0]
    module = ours.model.layers[0].self_attn
    paths = {}
    for path, threshold in (("absorbed", 1 << 30), ("ragged", 1)):
        monkeypatch.setattr(_cache, "RAGGED_PREFILL_MIN_TOKENS", threshold)
        cache = kft.new_cache(ours)
        out = module(hidden, position_embeddings=ours.model.rotary_emb(hidden, position_ids), cache=cache)[0]
        assert cache.ragged is (path == "ragged")
        paths[path] = out.float()
    stock_error = (theirs.float() - expected).abs().max().item()
    for path, out in paths.items():
        error = (out - expected).abs().max().item()
        assert llama_tests.cosine(out, expected) > 0.9999, path
        assert error <= 2 * stock_error, f"{path}: max |error| vs fp32 {error}, stock bf16's {stock_error}"
    scale = expected.abs().max().item()
    assert (paths["absorbed"] - paths["ragged"]).abs().max().item() <= 4 * moe_tests.bf16_step(scale)


# --------------------------------------------------------------------------- quantization, bad configurations


@pytest.mark.parametrize("quant", ["int8", "fp8_block"])
def test_quantized_linears_and_experts_track_stock(quant):
    """w8a8 / fp8 block-scaled linears and experts (the absorbed W_UK/W_UV stay bf16, as SGLang keeps
    them; the routers unquantized) stay near stock's logits: cosine 0.95, looser than the Llama tests'
    0.99, since quantization noise flips the tiny random routers' near-ties (int8, v2: 0.9585 at 70 tokens)."""
    stock, _ = build("v2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = kft.optimize(copy.deepcopy(stock), quant=quant, kv_cache_pages=64)
    layer = model.model.layers[1]
    assert layer.self_attn.qkv_a_proj.quant == layer.self_attn.o_proj.quant == layer.mlp.quant == quant
    assert layer.mlp.gate.quant is None  # the router stays unquantized, in fp32
    for lengths in ([9], [70]):
        assert moe_tests.cosine(last_logits(model, lengths), last_logits(stock, lengths)).min() > 0.95


# the MoE tests' fresh process (optimize, prefill, decode, sampling), then a prompt long enough for the
# unabsorbed path (the ragged prefill kernel), also with the JIT off
_FRESH_PROCESS = moe_tests._FRESH_PROCESS + "model(torch.randint(3, config.vocab_size, (1, 40)))\n"


@pytest.mark.slow  # pre-warms a DeepSeek model's kernels, then two child processes
def test_prewarm_from_a_deepseek_config_leaves_nothing_to_compile(kernforge_cache_dir, tmp_path):
    """`python -m kernforge prewarm --model-config config.json` builds every kernel the optimized
    DeepSeek-V3 model runs (the latent attention and its append, the ragged prefill of the prompt
    path, the MLA linears and absorbed per-head GEMMs, the fp32 router and its routing, the experts):
    a fresh process with the JIT off then optimizes it, generates, and prefills a long prompt."""
    _, config_class, shape = MODELS["v3"]
    config = config_class(**{**SHAPE, **shape}).to_dict()
    llama_tests.assert_prewarm_leaves_nothing_to_compile(
        config, config, _FRESH_PROCESS, None, tmp_path, kernforge_cache_dir
    )


def test_model_spec_describes_what_optimize_runs(deepseek):
    """ModelSpec reads the MLA and MoE fields optimize() runs by: the linears it packs have the
    shapes pre-warm builds GEMMs for."""
    from kernforge.model_spec import ModelSpec

    kind, stock, ours = deepseek
    spec = ModelSpec.from_config(stock.config.to_dict())
    attn, moe = ours.model.layers[0].self_attn, ours.model.layers[1].mlp
    assert (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim) == (64, 16, 32, 32)
    assert spec.q_lora_rank == attn.q_lora_rank and spec.topk_method == moe.rule
    assert (spec.n_group, spec.topk_group) == ((moe.num_groups, moe.topk_group) if kind != "v2_lite" else (0, 0))
    shapes = spec.linear_shapes()
    packed = {"qkv_a_proj": attn.qkv_a_proj, "kv_b_proj": attn.kv_b_proj, "o_proj": attn.o_proj}
    packed |= {"q_b_proj": attn.q_b_proj} if spec.q_lora_rank else {}
    packed |= {"router": moe.gate, "lm_head": ours.lm_head}
    packed |= {name: getattr(ours.model.layers[0].mlp, name) for name in ("gate_up_proj", "down_proj")}
    assert {name: [m.out_features, m.in_features] for name, m in packed.items()} == {
        name: shape for name, shape in shapes.items() if name not in ("w_kc", "w_vc")
    }
    w_kc, w_vc = attn.absorbed.w_kc[0], attn.absorbed.w_vc[0]
    assert (shapes["w_kc"], shapes["w_vc"]) == ([w_kc.n, w_kc.k], [w_vc.n, w_vc.k])
    assert moe.gate.dtype == torch.float32 and spec.router_dtype == "float32"


def test_unsupported_configurations_raise():
    stock, _ = build("v2_lite", num_hidden_layers=1)
    with pytest.raises(kft.UnsupportedModelError, match="bf16"):
        kft.optimize(copy.deepcopy(stock).float())
    _, config_class, shape = MODELS["v2_lite"]
    dynamic = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    model = DeepseekV2ForCausalLM(
        config_class(**{**SHAPE, **shape, "num_hidden_layers": 1, "rope_parameters": dynamic})
    )
    with pytest.raises(kft.UnsupportedModelError, match="'dynamic'"):
        kft.optimize(model.to(torch.bfloat16))
    model = DeepseekV2ForCausalLM(
        config_class(**{**SHAPE, **shape, "first_k_dense_replace": 0, "num_hidden_layers": 1})
    )
    model.model.layers[0].mlp.gate.topk_method = "random"
    with pytest.raises(kft.UnsupportedModelError, match="topk_method 'random'"):
        kft.optimize(model.to(torch.bfloat16))
