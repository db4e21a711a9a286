"""kernforge.integrations.transformers on sparse mixtures of experts: tiny random Qwen3-MoE, Qwen2-MoE,
Mixtral and OLMoE models, optimized vs stock transformers (bf16, the same weights).

A router picks each token's experts by comparing bf16 logits, so two runs whose hidden states differ
by rounding can pick different experts where two are nearly tied, and then give visibly different
outputs (the other expert's, passed on to later tokens by attention). The last-position logits must
be within cosine 0.999 of stock's, except in a row whose tokens were first routed differently at
such near-ties (stock's logits of the two experts within four bf16 steps; reported). Greedy decoding
must give stock's first tokens, or diverge only where stock's top two logits are within two bf16
steps (as for Llama) or after such a routing difference. Quantized experts: int8 w8a8 near stock's
logits; fp8 block-scaled ones as stock on the dequantized weights.
"""

import copy
import math
import warnings
from contextlib import contextmanager

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
import test_transformers_integration as llama_tests  # noqa: E402
from transformers import (  # noqa: E402
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.integrations.transformers import _compat  # noqa: E402
from kernforge.model_spec import PACKED_LINEARS  # noqa: E402
from kernforge.nn import quantize_weight_fp8_block  # noqa: E402
from kernforge.nn.linear import FP8_BLOCK  # noqa: E402

from references import fp8_block_dequantize  # noqa: E402

VOCAB = 1000
SHAPE = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    initializer_range=0.1,  # peaked next-token distributions: few near-ties for greedy decoding to split on
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    dtype="bfloat16",
)
MODELS = {
    # 3 layers, the middle one dense (mlp_only_layers); I = 80 is not a multiple of 32 (the panel width)
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        dict(
            num_hidden_layers=3,
            head_dim=32,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=80,
            intermediate_size=192,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # a shared expert with its sigmoid gate; biased q/k/v; a sliding window on layer 0 only (layer_types)
    "qwen2_moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig,
        dict(
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=72,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            use_sliding_window=True,
            sliding_window=8,
        ),
    ),
    # top-k weights always renormalized; a sliding window on every layer
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig,
        dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=96, sliding_window=8),
    ),
    # q/k RMSNorms over the whole projection, then q, k and v clamped (clip_qkv bites: |q|, |k| ~ 1)
    "olmoe": (
        OlmoeForCausalLM,
        OlmoeConfig,
        dict(num_hidden_layers=2, num_experts=12, num_experts_per_tok=3, intermediate_size=64, clip_qkv=1.0),
    ),
}
LENGTHS = [13, 21]  # a left-padded batch of two prompts, both longer than the sliding windows
NEW_TOKENS = 8
AGREE_FIRST = 4  # greedy tokens that must be stock's (or part at a near-tie)
CACHE = _compat.cache_argument(MixtralForCausalLM.forward)  # the KV cache argument's name in this release


def build(kind: str, quant: str | None = None, **overrides):
    """(stock bf16 model, the kernforge-optimized copy)."""
    model_class, config_class, shape = MODELS[kind]
    torch.manual_seed(0)
    stock = model_class(config_class(**{**SHAPE, **shape, **overrides})).to(torch.bfloat16).eval()
    return stock, kft.optimize(copy.deepcopy(stock), kv_cache_pages=256, quant=quant)


@pytest.fixture(scope="module", params=list(MODELS))
def moe(request):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported MoE model leaves nothing on the stock path
        return request.param, *build(request.param)


def padded_batch(lengths, seed: int = 7):
    """Left-padded prompts of ``lengths`` with ids from 3 up (no special tokens): (input_ids, attention_mask)."""
    return llama_tests.padded_batch(lengths, seed, lowest_id=3)


@torch.no_grad()
def last_logits(model) -> torch.Tensor:
    """The last position's logits for the padded batch of LENGTHS: [rows, vocab] fp32."""
    ids, mask = padded_batch(LENGTHS)
    return model(ids, attention_mask=mask).logits[:, -1].float()


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def bf16_step(x: float) -> float:
    """The spacing of bf16 values around |x|."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


@contextmanager
def router_logits(model):
    """Each sparse layer's router logits ``[tokens, experts]`` in the order computed (layer by layer,
    forward by forward) while inside."""
    captured = []

    def hook(module, args, out):
        captured.append((out[0] if isinstance(out, tuple) else out).detach().float())

    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    handles = [router.register_forward_hook(hook) for router in routers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def first_routing_flips(sites, top_k: int) -> list[tuple[int, int, float, float]]:
    """``sites``: (stock's router logits, ours, the tokens to compare) in the order computed. Where
    the first site that has any gave a token other experts than stock gave it (the later ones may
    follow from those, through attention): (site, token, stock's margin for its choice, four bf16
    steps there). Empty if the routing is stock's everywhere."""
    for site, (theirs, ours, tokens) in enumerate(sites):
        flips = []
        for token in tokens:
            chosen = set(theirs[token].topk(top_k).indices.tolist())
            our_chosen = set(ours[token].topk(top_k).indices.tolist())
            if chosen != our_chosen:
                kept = theirs[token, sorted(chosen - our_chosen)].min().item()
                taken = theirs[token, sorted(our_chosen - chosen)].max().item()
                flips.append((site, token, kept - taken, 4 * bf16_step(kept)))
        if flips:
            return flips
    return []


def prompt_tokens(row: int) -> list[int]:
    """Row ``row``'s prompt tokens (not the padding) among the padded batch's flattened tokens."""
    width = max(LENGTHS)
    return [row * width + column for column in range(width - LENGTHS[row], width)]


def assert_routed_apart_at_near_ties(sites, top_k: int, report: str) -> None:
    """A difference from stock is allowed only where the routing first differs at near-ties."""
    flips = first_routing_flips(sites, top_k)
    assert flips and all(margin <= near for *_, margin, near in flips), (
        f"{report}; first routing flips (site, token, margin, near): {flips}"
    )


def assert_last_logits_match(stock, ours, record_property, label: str) -> None:
    """cosine >= 0.999 per row of the padded batch, or a row first routed differently at near-ties."""
    with router_logits(stock) as theirs, router_logits(ours) as our:
        similarity = cosine(last_logits(ours), last_logits(stock))
    for row, value in enumerate(similarity.tolist()):
        if value < 0.999:
            report = f"{label} row {row}: last logits' cosine {value:.5f}"
            record_property(f"routing flip, row {row}", report)
            print(report)
            sites = [(t, o, prompt_tokens(row)) for t, o in zip(theirs, our)]
            assert_routed_apart_at_near_ties(sites, stock.config.num_experts_per_tok, report)


# --------------------------------------------------------------------------- logits and tokens


def test_moe_blocks_are_replaced(moe):
    kind, stock, ours = moe
    layers = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert layers == (["SparseMoE", "GatedMLP", "SparseMoE"] if kind == "qwen3_moe" else ["SparseMoE"] * 2)
    block = ours.model.layers[0].mlp
    assert block.renormalize is {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True, "olmoe": False}[kind]
    assert block.top_k == stock.config.num_experts_per_tok
    assert (block.shared_expert is not None) == (kind == "qwen2_moe")


def test_padded_batch_last_logits_match_stock(moe, record_property):
    kind, stock, ours = moe
    assert_last_logits_match(stock, ours, record_property, kind)


def test_greedy_tokens_match_stock(moe, record_property):
    """Stock's first AGREE_FIRST tokens, or a first difference at a near-tie of stock's logits or
    after the routing first differed at near-ties."""
    kind, stock, ours = moe
    ids, mask = padded_batch(LENGTHS)
    width = ids.shape[1]
    with router_logits(stock) as theirs, router_logits(ours) as our:
        out = stock.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        got = kft.generate(ours, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=[])[:, width:]
    expected = out.sequences[:, width:]
    assert got.shape == expected.shape == (len(LENGTHS), NEW_TOKENS)
    layers = sum(hasattr(layer.mlp, "gate") for layer in stock.model.layers)  # router calls per forward
    for row in range(len(LENGTHS)):
        different = (got[row] != expected[row]).nonzero()
        if not len(different):
            continue
        step = int(different[0])
        logits = out.logits[step][row].float()
        top = logits.max().item()
        margin = top - logits[got[row, step]].item()
        report = (
            f"{kind} row {row}: greedy diverges from stock at step {step}: stock picks {int(expected[row, step])}, "
            f"kernforge {int(got[row, step])}, {margin} below stock's top logit {top} (bf16 step {bf16_step(top)})"
        )
        record_property(f"divergence, row {row}", report)
        print(report)
        if step < AGREE_FIRST and margin > 2 * bf16_step(top):
            # the forwards up to this step saw the same tokens: prefill (the row's prompt), then decode (one token)
            sites = [
                (theirs[call], our[call], prompt_tokens(row) if call < layers else [row])
                for call in range((step + 1) * layers)
            ]
            assert_routed_apart_at_near_ties(sites, stock.config.num_experts_per_tok, report)


# --------------------------------------------------------------------------- quantization, stock paths


def quantized(stock, quant: str):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = kft.optimize(copy.deepcopy(stock), quant=quant)
    layer = model.model.layers[0]
    assert layer.mlp.quant == layer.self_attn.qkv_proj.quant == layer.mlp.shared_expert.down_proj.quant == quant
    assert layer.mlp.gate.quant is None and layer.mlp.shared_expert_gate.quant is None  # the gates stay bf16
    return model


def test_int8_experts_track_stock():
    """int8 w8a8 experts (activations quantized per token: no exact reference) stay near stock."""
    stock, _ = build("qwen2_moe")
    model = quantized(stock, "int8")
    assert type(model.model.layers[0].mlp.w1).__name__ == "PackedInt8Experts"
    assert cosine(last_logits(model), last_logits(stock)).min() > 0.99


def fp8_dequantized(stock):
    """An fp32 copy of ``stock`` holding the values of the weights optimize(quant="fp8_block")
    quantizes, blocked as it packs them (q|k|v and gate|up as one; each expert apart; not lm_head
    or the gates): what the fp8 model computes (weights only: w8a16), in stock's code."""
    model = copy.deepcopy(stock).float()

    def dequantize(*weights):
        values = fp8_block_dequantize(*quantize_weight_fp8_block(torch.cat(weights)), FP8_BLOCK)
        for weight, value in zip(weights, values.split([len(w) for w in weights])):
            weight.copy_(value)

    with torch.no_grad():
        for module in model.modules():
            names = [n for n, c in module.named_children() if type(c) is torch.nn.Linear]
            names = [n for n in names if n not in ("lm_head", "shared_expert_gate")]
            for parts in PACKED_LINEARS.values():
                if set(parts) <= set(names):
                    dequantize(*(getattr(module, part).weight for part in parts))
                    names = [n for n in names if n not in parts]
            for name in names:
                dequantize(getattr(module, name).weight)
            if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):  # the stacked experts
                for expert in (*module.gate_up_proj, *module.down_proj):
                    dequantize(expert)
    return model


def test_fp8_block_experts_match_their_dequantized_weights(record_property):
    """fp8 block-scaled weights (DeepSeek-V3's format), experts included, compute what stock
    transformers computes on the weights' dequantized values."""
    stock, _ = build("qwen2_moe")
    model = quantized(stock, "fp8_block")
    assert type(model.model.layers[0].mlp.w1).__name__ == "PackedFp8Experts"
    assert_last_logits_match(fp8_dequantized(stock), model, record_property, "qwen2_moe fp8_block")


def test_experts_without_silu_stay_stock_and_are_named(record_property):
    with pytest.warns(UserWarning, match=r"stock transformers path: .*MixtralSparseMoeBlock, hidden_act 'gelu'"):
        stock, ours = build("mixtral", hidden_act="gelu")
    assert type(ours.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"
    assert_last_logits_match(stock, ours, record_property, "mixtral with GELU experts")


def test_router_logits_are_refused_clearly():
    _, ours = build("mixtral")
    with pytest.raises(NotImplementedError, match="output_router_logits=False"), torch.no_grad():
        ours(padded_batch(LENGTHS)[0], output_router_logits=True)


@torch.no_grad()
def test_compiled_moe_model_has_no_graph_breaks():
    """Routing, fused_experts and the shared expert are torch.ops.kernforge nodes: one graph per step."""
    _, ours = build("qwen2_moe")
    ids = padded_batch([9])[0]
    cache = kft.new_cache(ours)
    for q_len in (9, 1):
        cache.plan_step(1, q_len)
        explanation = torch._dynamo.explain(ours)(ids[:, :q_len], **{CACHE: cache})
        assert (explanation.graph_break_count, explanation.graph_count) == (0, 1), explanation.break_reasons
    torch._dynamo.reset()


@pytest.mark.slow  # a child process building a Qwen3-30B-A3B-wide model (one layer, 16 experts)
def test_moe_example_runs(kernforge_cache_dir):
    import subprocess
    import sys

    from conftest import EXAMPLES_DIR

    example = EXAMPLES_DIR / "moe_generate.py"
    flags = ["--layers", "1", "--experts", "16", "--prompt-len", "32", "--new-tokens", "4"]
    result = subprocess.run([sys.executable, str(example), *flags], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "decode tokens/s" in result.stdout and "sequence 0: " in result.stdout


# --------------------------------------------------------------------------- layers materialized one at a time


def lazy_tiny_moe():
    from kernforge.integrations.random_llama import random_layer_weights, random_llama

    model = random_llama("tiny-moe", 5, lazy_layers=True)
    return model, random_layer_weights(model, 5)


def test_lazy_layers_optimize_as_the_same_weights_loaded_eagerly():
    """optimize(materialize_layer=...) packs each meta layer as it fills it: the model computes what
    optimize gives for the same weights in memory from the start, and no layer stays on meta."""
    lazy, fill = lazy_tiny_moe()
    assert all(p.is_meta for p in lazy.model.layers.parameters()) and not lazy.lm_head.weight.is_meta
    eager = copy.deepcopy(lazy)
    for index, layer in enumerate(eager.model.layers):
        fill(index, layer)
    eager = kft.optimize(eager, kv_cache_pages=64, quant="int4")
    filled = []
    lazy = kft.optimize(
        lazy, kv_cache_pages=64, quant="int4", materialize_layer=lambda i, layer: (filled.append(i), fill(i, layer))
    )
    assert filled == [0, 1] and not any(p.is_meta for p in lazy.parameters())
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(lazy(ids).logits, eager(ids).logits)
    assert lazy.generation_config.pad_token_id is None  # and no stop token: nothing to pad with but 0
    assert kft.generate(lazy, ids, max_new_tokens=3, eos_token_id=[]).shape == (1, 12)


def test_meta_layers_without_materialize_layer_are_refused_before_any_change():
    lazy, _ = lazy_tiny_moe()
    attention = lazy.model.layers[0].self_attn
    with pytest.raises(ValueError, match="meta device: only decoder layers may wait there"):
        kft.optimize(lazy, kv_cache_pages=64)
    assert lazy.model.layers[0].self_attn is attention  # nothing replaced
    with pytest.raises(ValueError, match="materialize_layer left decoder layer 0 with weights on the meta device"):
        kft.optimize(lazy, kv_cache_pages=64, materialize_layer=lambda index, layer: None)


_FRESH_PROCESS = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from kernforge.integrations import transformers as kft
config = AutoConfig.for_model(**json.loads(sys.argv[1]))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
model = kft.optimize(model, kv_cache_pages=64, quant=sys.argv[2] or None)
ids = torch.randint(0, config.vocab_size, (2, 9))
out = kft.generate(model, ids, max_new_tokens=3, do_sample=True, top_k=5, top_p=0.9)
print("generated", tuple(out.shape))
"""


@pytest.mark.slow  # pre-warms a MoE model's kernels, then two child processes
@pytest.mark.parametrize("quant", [None, "int8"])
def test_prewarm_from_a_moe_config_leaves_nothing_to_compile(kernforge_cache_dir, tmp_path, quant):
    """`python -m kernforge prewarm --model-config config.json` builds every kernel the optimized MoE
    model runs (routing, the experts of its quant, the router's and the shared expert's GEMMs): a
    fresh process with the JIT off then optimizes it and generates."""
    _, config_class, shape = MODELS["qwen2_moe"]
    config = config_class(**{**SHAPE, **shape}).to_dict()
    llama_tests.assert_prewarm_leaves_nothing_to_compile(
        config, config, _FRESH_PROCESS, quant, tmp_path, kernforge_cache_dir
    )
