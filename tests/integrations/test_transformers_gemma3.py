"""Gemma 3 (``Gemma3ForCausalLM``) on kernforge: a tiny random one, optimized vs stock transformers.

The model has what sets Gemma 3 apart from the Llamas: sliding-window layers (a window smaller than
the prompts) between global ones, a rotary embedding per layer type (the global layers' at another
base and linearly scaled), Gemma's ``1 + weight`` RMSNorms (four per layer, and per-head q/k norms;
drawn away from zero here, so that a norm scaling by ``weight`` alone shows), ``query_pre_attn_scalar``
as the softmax scale, the GELU-tanh gated MLP, head_dim twice hidden_size / heads, one KV head (Gemma 3
1B's), and the scaled, tied embedding. Accuracy is judged as for the other families
(test_transformers_integration): against a float32 copy of the same weights, within 1.5x of stock
bf16's own error.
"""

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
import test_transformers_integration as llama_tests  # noqa: E402
from test_transformers_integration import (  # noqa: E402
    assert_logits_close,
    bf16_step,
    padded_batch,
    prompt,
    teacher_forced_decode,
)
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.integrations.transformers import _modules  # noqa: E402

WINDOW = 16
# Gemma 3's own fields, over the shared tiny shape (test_transformers_integration.SHAPE)
OVERRIDES = dict(
    num_hidden_layers=3,
    num_key_value_heads=1,
    head_dim=128,  # hidden_size 256 / 4 heads is 64: Gemma's head_dim is its own
    query_pre_attn_scalar=96,  # not head_dim: the softmax scale is 96**-0.5
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
)


def build(**overrides):
    """(stock bf16 Gemma 3, its float32 copy, the kernforge-optimized copy); every norm weight drawn
    from N(0, 0.3) (transformers initializes them to 0, where ``1 + weight`` is 1)."""
    torch.manual_seed(0)
    stock = Gemma3ForCausalLM(Gemma3TextConfig(**{**llama_tests.SHAPE, **OVERRIDES, **overrides}))
    with torch.no_grad():
        for name, parameter in stock.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.3)
    stock = stock.to(torch.bfloat16).eval()
    reference = copy.deepcopy(stock).float()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every module runs on kernforge
        ours = kft.optimize(copy.deepcopy(stock), kv_cache_pages=512)
    return stock, reference, ours


@pytest.fixture(scope="module")
def gemma3():
    return build()


def test_modules_are_gemmas(gemma3):
    """The spec and modules optimize() made: Gemma norms everywhere, the windows per layer type, the
    scale from query_pre_attn_scalar, one cos/sin cache per layer type with its own frequencies."""
    stock, _, ours = gemma3
    runtime = ours._kernforge
    assert runtime.spec.window_lefts == (WINDOW - 1, -1, WINDOW - 1)  # transformers keeps the last WINDOW keys
    assert runtime.spec.sm_scale == 96**-0.5 and runtime.model_spec.rope_type == "linear"
    for layer in ours.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
            assert type(getattr(layer, name)) is _modules.GemmaRMSNorm
        assert type(layer.post_feedforward_layernorm) is _modules.GemmaRMSNorm
        assert type(layer.self_attn.q_norm) is type(layer.self_attn.k_norm) is _modules.GemmaRMSNorm
        assert layer.mlp.activation == "gelu_pytorch_tanh"
    rotary = ours.model.rotary_emb.by_type
    for kind in ("full_attention", "sliding_attention"):
        assert torch.equal(rotary[kind].inv_freq, getattr(stock.model.rotary_emb, f"{kind}_inv_freq"))


@pytest.mark.parametrize("length", [1, 40])
def test_prefill_logits_match_stock(gemma3, length):
    stock, reference, ours = gemma3
    ids = prompt(length)
    with torch.no_grad():
        assert_logits_close(ours(ids).logits[0], stock(ids).logits[0], reference(ids).logits[0])


def test_decode_logits_match_stock(gemma3, record_property):
    """A 40-token prefill (past the window), then decode steps on the paged cache."""
    stock, reference, ours = gemma3
    ids = prompt(40)
    out = stock.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ours_steps = teacher_forced_decode(ours, out.sequences, 40)
    with torch.no_grad():
        reference_steps = reference(out.sequences[:, :-1]).logits[0, 39:]
    for step, stock_logits in enumerate(out.logits):
        assert_logits_close(ours_steps[step], stock_logits[0], reference_steps[step])
    error = (ours_steps.float() - reference_steps).abs().max().item()
    record_property("max_abs_error_vs_fp32", error)
    print(f"decode: max |logit error| vs fp32 {error:.4f}")


def test_padded_prefill_logits_match_stock(gemma3):
    stock, reference, ours = gemma3
    lengths = [5, 30, 1]
    ids, mask = padded_batch(lengths)
    with torch.no_grad():
        batch = ours(ids, attention_mask=mask).logits[:, -1]
        stock_batch = stock(ids, attention_mask=mask).logits[:, -1]
        for row, length in enumerate(lengths):
            alone = ids[row : row + 1, ids.shape[1] - length :]
            assert_logits_close(batch[row], stock_batch[row], reference(alone).logits[0, -1])


def test_greedy_tokens_match_stock_or_diverge_at_a_near_tie(gemma3, record_property):
    stock, _, ours = gemma3
    ids = prompt(24, seed=3)
    steps = 24  # the sequence runs to 48 tokens: three windows
    out = stock.generate(ids, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = out.sequences[0, 24:]
    got = kft.generate(ours, ids, max_new_tokens=steps)[0, 24:]
    assert got.shape == expected.shape == (steps,)
    different = (got != expected).nonzero()
    if len(different):
        step = int(different[0])
        logits = out.logits[step][0].float()
        top = logits.max().item()
        margin = top - logits[got[step]].item()
        report = f"greedy diverges from stock at step {step}, {margin} below stock's top logit {top}"
        record_property("divergence", report)
        assert margin <= 2 * bf16_step(top), report


def test_final_logit_softcapping_is_the_models_own():
    """Soft-capped final logits (Gemma 2's, None in Gemma 3's configs): the causal LM's forward caps
    them after lm_head, and that forward stays transformers'."""
    cap = 3.0
    stock, reference, ours = build(num_hidden_layers=1, layer_types=["sliding_attention"], final_logit_softcapping=cap)
    ids = prompt(20)
    with torch.no_grad():
        assert stock.lm_head(stock.model(ids).last_hidden_state).abs().max() > cap  # the cap is felt
        logits = ours(ids).logits[0]
        assert logits.abs().max() <= cap
        assert_logits_close(logits, stock(ids).logits[0], reference(ids).logits[0])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping 50.0: kernforge's attention does not soft-cap"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention=True: kernforge's attention is causal"),
    ],
)
def test_attention_kernforge_does_not_compute_is_refused(field, value, message):
    config = Gemma3TextConfig(**{**llama_tests.SHAPE, **OVERRIDES, field: value})
    with pytest.raises(kft.UnsupportedModelError, match=message):
        kft.optimize(Gemma3ForCausalLM(config).to(torch.bfloat16))
