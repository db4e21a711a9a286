"""kernforge.integrations.transformers: tiny random Llama-family models, optimized vs stock transformers.

Accuracy is judged against a float32 copy of the same (bf16-rounded) weights: the optimized model's
logits must be as close to it as stock bf16 transformers' are (within 1.5x of stock's own error),
and within cosine 0.999 of stock's. Greedy decoding must give stock's tokens, or diverge only where
stock's top two logits are within two bf16 steps of each other (reported).
"""

import copy
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import (  # noqa: E402
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kernforge  # noqa: E402
from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.integrations.transformers import _compat  # noqa: E402

VOCAB = 1000
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    initializer_range=0.05,
    dtype="bfloat16",
)
DECODE_STEPS = 32
# The name this transformers release gives the KV cache argument (``cache`` from 5.24 on); the
# optimized model takes either (test_both_cache_argument_names).
CACHE = _compat.cache_argument(LlamaForCausalLM.forward)


def build(model_class, config_class, **overrides):
    """(stock bf16 model, its float32 copy, the kernforge-optimized copy)."""
    torch.manual_seed(0)
    stock = model_class(config_class(**{**SHAPE, **overrides})).to(torch.bfloat16).eval()
    reference = copy.deepcopy(stock).float()
    return stock, reference, kft.optimize(copy.deepcopy(stock), kv_cache_pages=512)


@pytest.fixture(scope="module")
def llama():
    return build(LlamaForCausalLM, LlamaConfig)


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min().item()


def assert_logits_close(ours: torch.Tensor, stock: torch.Tensor, reference: torch.Tensor) -> None:
    ours, stock, reference = ours.float(), stock.float(), reference.float()
    assert cosine(ours, stock) > 0.999
    stock_error = (stock - reference).abs().max().item()
    our_error = (ours - reference).abs().max().item()
    assert our_error <= 1.5 * stock_error, f"max |error| vs fp32: kernforge {our_error}, stock bf16 {stock_error}"


def bf16_step(x: float) -> float:
    """The spacing of bf16 values around |x|."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


@torch.no_grad()
def teacher_forced_decode(model, sequence: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The model's next-token logits for a prefill of ``prompt_len`` tokens, then one decode step per
    further token of ``sequence``: ``[len - prompt_len, vocab]``."""
    cache = kft.new_cache(model)
    steps = [model(sequence[:, :prompt_len], **{CACHE: cache}).logits[0, -1]]
    for position in range(prompt_len, sequence.shape[1] - 1):
        steps.append(model(sequence[:, position : position + 1], **{CACHE: cache}).logits[0, -1])
    return torch.stack(steps)


# --------------------------------------------------------------------------- logits


@pytest.mark.parametrize("length", [1, 17, 1024])
def test_prefill_logits_match_stock(llama, length):
    stock, reference, ours = llama
    ids = prompt(length)
    with torch.no_grad():
        assert_logits_close(ours(ids).logits[0, -1], stock(ids).logits[0, -1], reference(ids).logits[0, -1])


def test_decode_logits_match_stock_for_32_steps(llama):
    stock, reference, ours = llama
    ids = prompt(17)
    out = stock.generate(
        ids, max_new_tokens=DECODE_STEPS, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    sequence = out.sequences
    ours_steps = teacher_forced_decode(ours, sequence, 17)
    stock_steps = torch.cat(out.logits)
    with torch.no_grad():
        reference_steps = reference(sequence[:, :-1]).logits[0, 16:]
    assert ours_steps.shape == stock_steps.shape == (DECODE_STEPS, VOCAB)
    assert cosine(ours_steps.float(), stock_steps.float()) > 0.999
    # One step's max error is a noisy sample of bf16 rounding (stock's own ranges 0.016-0.034 over
    # these steps): compare the steps' mean, and bound every step by stock's worst.
    ours_error = (ours_steps.float() - reference_steps).abs().amax(dim=-1)
    stock_error = (stock_steps.float() - reference_steps).abs().amax(dim=-1)
    assert ours_error.mean() <= 1.25 * stock_error.mean(), (
        f"mean max |error|: {ours_error.mean()} vs {stock_error.mean()}"
    )
    assert ours_error.max() <= 1.5 * stock_error.max(), f"worst step: {ours_error.max()} vs {stock_error.max()}"


def test_int8_logits_track_stock(llama):
    stock, _, _ = llama
    quantized = kft.optimize(copy.deepcopy(stock), quant="int8")
    assert type(quantized.model.layers[0].mlp.down_proj).__name__ == "Linear"
    assert quantized.model.layers[0].mlp.down_proj.quant == "int8"
    assert quantized.lm_head.quant is None  # lm_head stays bf16 unless quant_lm_head=True
    ids = prompt(17)
    with torch.no_grad():
        assert cosine(quantized(ids).logits[0, -1], stock(ids).logits[0, -1]) > 0.99


@pytest.mark.parametrize("quant", ["int4", "int4_w4a16"])
def test_int4_logits_track_the_dequantized_model(llama, quant):
    """Four-bit linears compute the model whose weights are their dequantized four-bit values: W4A16
    to bf16's precision, W4A8 within its int8 activations' rounding; an int8 head on request."""
    from kernforge.ops.gemm.int4 import dequantize_int4, quantize_int4

    stock, _, _ = llama
    dequantized = copy.deepcopy(stock)
    with torch.no_grad():
        for module in dequantized.model.layers.modules():
            if type(module) is torch.nn.Linear:
                weight = module.weight.float()
                packed = quantize_int4(weight, group_size=None)
                module.weight.copy_(dequantize_int4(packed))
    quantized = kft.optimize(copy.deepcopy(stock), quant=quant, quant_lm_head="int8")
    assert quantized.model.layers[0].mlp.down_proj.quant == quant and quantized.lm_head.quant == "int8"
    ids = prompt(17)
    with torch.no_grad():
        ours, expected = quantized(ids).logits[0], dequantized(ids).logits[0]
    assert cosine(ours, expected) > (0.999 if quant == "int4_w4a16" else 0.995)


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize("length", [1, 17])
def test_greedy_tokens_match_stock_or_diverge_at_a_near_tie(llama, length, record_property):
    stock, _, ours = llama
    ids = prompt(length, seed=length)
    out = stock.generate(
        ids, max_new_tokens=DECODE_STEPS, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    expected = out.sequences[0, length:]
    got = kft.generate(ours, ids, max_new_tokens=DECODE_STEPS)[0, length:]
    assert got.shape == expected.shape == (DECODE_STEPS,)
    different = (got != expected).nonzero()
    if len(different):
        step = int(different[0])
        logits = out.logits[step][0].float()
        top = logits.max().item()
        margin = top - logits[got[step]].item()
        report = (
            f"greedy diverges from stock at step {step}: stock picks {int(expected[step])}, kernforge "
            f"{int(got[step])}, {margin} below stock's top logit {top} (bf16 step {bf16_step(top)})"
        )
        record_property("divergence", report)
        print(report)
        assert margin <= 2 * bf16_step(top), report


def test_transformers_generate_runs_on_the_paged_cache(llama):
    """model.generate() (transformers' loop) gets a PagedCache and gives kernforge's own loop's tokens."""
    _, _, ours = llama
    ids, mask = padded_batch([3, 12])
    calls = []
    hook = ours.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(type(kwargs.get("cache", kwargs.get("past_key_values"))).__name__),
        with_kwargs=True,
    )
    try:
        theirs = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    finally:
        hook.remove()
    assert set(calls) == {"PagedCache"} and len(calls) == 8
    assert torch.equal(theirs, kft.generate(ours, ids, attention_mask=mask, max_new_tokens=8))


def test_pages_hold_each_heads_keys_in_the_hnd_layout(llama):
    """The pool's pages are FlashInfer's HND layout (a KV head's 16 rows of a page in one run, what
    decode reads fastest) and hold the keys, after RoPE, that transformers' own cache holds."""
    stock, _, ours = llama
    ids = prompt(20)  # two pages, the second partly filled
    with torch.no_grad():
        theirs = DynamicCache(config=stock.config)
        stock(ids, **{CACHE: theirs})
        paged = kft.new_cache(ours)
        ours(ids, **{CACHE: paged})
    kv = ours._kernforge.pool.kv
    heads, page_size, head_dim = kv.shape[3:]
    assert (heads, page_size, head_dim) == (SHAPE["num_key_value_heads"], 16, SHAPE["head_dim"])
    pages = kv[0, paged._sequence_pages[0], 0]  # layer 0's K planes: [pages, heads, 16, head_dim]
    keys = pages.transpose(0, 1).reshape(heads, -1, head_dim)[:, : ids.shape[1]]
    assert cosine(keys, theirs.layers[0].keys[0]) > 0.999


def padded_batch(lengths, seed: int = 7, lowest_id: int = 0):
    """Left-padded prompts of ``lengths`` (token ids from ``lowest_id`` up): (input_ids, attention_mask)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(lowest_id, VOCAB, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def test_batch_of_uneven_prompts_equals_each_alone(llama):
    _, _, ours = llama
    lengths = [1, 17, 40, 9]
    ids, mask = padded_batch(lengths)
    width = ids.shape[1]
    batch = kft.generate(ours, ids, attention_mask=mask, max_new_tokens=12)
    assert batch.shape == (len(lengths), width + 12)
    for row, length in enumerate(lengths):
        alone = kft.generate(ours, ids[row : row + 1, width - length :], max_new_tokens=12)
        assert torch.equal(batch[row, width:], alone[0, length:]), f"prompt {row} ({length} tokens)"


def test_padded_prefill_logits_match_stock(llama):
    """Each row of a left-padded batch is as accurate as stock's (not bitwise the row alone: the
    GEMM blocking depends on the number of rows, which changes the rounding)."""
    stock, reference, ours = llama
    lengths = [5, 30, 1]
    ids, mask = padded_batch(lengths)
    with torch.no_grad():
        batch = ours(ids, attention_mask=mask).logits[:, -1]
        stock_batch = stock(ids, attention_mask=mask).logits[:, -1]
        for row, length in enumerate(lengths):
            alone = ids[row : row + 1, ids.shape[1] - length :]
            assert_logits_close(batch[row], stock_batch[row], reference(alone).logits[0, -1])


def test_sampling_uses_kernforge_and_is_reproducible(llama, monkeypatch):
    _, _, ours = llama
    ids, mask = padded_batch([4, 9])
    calls = []  # (logits after temperature, top_k, tokens) of each sampling call
    sampler = kft._kernels.top_k_top_p_sampling_from_logits

    def recording(logits, top_k, top_p, **kwargs):
        tokens = sampler(logits, top_k, top_p, **kwargs)
        calls.append((logits.clone(), top_k, tokens))
        return tokens

    monkeypatch.setattr(kft._kernels, "top_k_top_p_sampling_from_logits", recording)

    def sampled(seed, **kwargs):
        return kft.generate(
            ours,
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=True,
            generator=torch.Generator().manual_seed(seed),
            **kwargs,
        )

    first = sampled(3, temperature=0.8, top_k=5, top_p=0.9)
    assert len(calls) == 10
    for logits, top_k, tokens in calls:  # every sample is among the top 5 (ties included)
        kth = logits.topk(top_k).values[:, -1:]
        assert bool((logits.gather(1, tokens.long()[:, None]) >= kth).all())
    assert torch.equal(first, sampled(3, temperature=0.8, top_k=5, top_p=0.9))
    assert not torch.equal(first, sampled(4, temperature=2.0, top_k=0, top_p=1.0))
    calls.clear()
    sampled(5, top_k=1)  # the maximum and its ties only: greedy up to ties
    for logits, _, tokens in calls:
        assert bool((logits.gather(1, tokens.long()[:, None])[:, 0] == logits.max(1).values).all())


def test_eos_finishes_a_sequence_with_padding(llama):
    _, _, ours = llama
    ids = prompt(6)
    greedy = kft.generate(ours, ids, max_new_tokens=6)[0, 6:]
    eos = int(greedy[2])
    out = kft.generate(ours, ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=999)[0, 6:]
    first_eos = int((greedy == eos).nonzero()[0])
    assert out.tolist()[: first_eos + 1] == greedy.tolist()[: first_eos + 1]
    assert len(out) == first_eos + 1  # one sequence: the loop stops at its end


# --------------------------------------------------------------------------- other Llama-family models


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_llama_family_models_match_stock(kind):
    model_class, config_class, overrides = {
        "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),  # biased q/k/v
        "qwen3": (Qwen3ForCausalLM, Qwen3Config, {}),  # per-head q/k RMSNorm
        "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": 16}),  # window < prompt
    }[kind]
    stock, reference, ours = build(model_class, config_class, **overrides)
    ids = prompt(40)
    out = stock.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ours_steps = teacher_forced_decode(ours, out.sequences, 40)
    with torch.no_grad():
        reference_steps = reference(out.sequences[:, :-1]).logits[0, 39:]
    for step, stock_logits in enumerate(out.logits):
        assert_logits_close(ours_steps[step], stock_logits[0], reference_steps[step])


# --------------------------------------------------------------------------- bad configurations


def test_unsupported_model_kind_raises():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100))
    with pytest.raises(kft.UnsupportedModelError, match=r"GPT2LMHeadModel \(model_type 'gpt2'\)"):
        kft.optimize(model)


@pytest.mark.parametrize("head_dim", [72, 36])  # not a multiple of 32 (16): the kernels' vector tails
def test_head_dims_off_the_vector_width_match_stock(head_dim):
    stock, reference, ours = build(LlamaForCausalLM, LlamaConfig, hidden_size=4 * head_dim, head_dim=head_dim)
    ids = prompt(19)
    with torch.no_grad():
        assert_logits_close(ours(ids).logits[0, -1], stock(ids).logits[0, -1], reference(ids).logits[0, -1])
        sequence = torch.cat([ids, prompt(4, seed=2)], dim=1)
        ours_steps = teacher_forced_decode(ours, sequence, 19)
        stock_steps = stock(sequence[:, :-1]).logits[0, 18:]
    assert cosine(ours_steps.float(), stock_steps.float()) > 0.999


def test_head_dim_without_kernels_raises():
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_size": 4 * 520, "head_dim": 520}))
    with pytest.raises(kft.UnsupportedModelError, match="head_dim 520 has no kernforge attention kernel"):
        kft.optimize(model)


def test_length_dependent_rope_raises():
    config = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(kft.UnsupportedModelError, match="RoPE type 'dynamic'"):
        kft.optimize(LlamaForCausalLM(config))


def test_missing_kernel_with_jit_off_names_it(monkeypatch):
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_size": 320, "head_dim": 80})).to(torch.bfloat16)
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    with pytest.raises(kernforge.KernelNotCachedError, match=r"decode\(.*head_dim=80.*prewarm --model-config"):
        kft.optimize(model)


def test_misuse_raises_clear_errors(llama):
    stock, _, ours = llama
    with pytest.raises(ValueError, match="already optimized"):
        kft.optimize(ours)
    with pytest.raises(ValueError, match="kv_cache_pages must be a positive int"):
        kft.optimize(copy.deepcopy(stock), kv_cache_pages=0)
    with pytest.raises(ValueError, match="needs a model prepared by"):
        kft.new_cache(stock)
    cache = DynamicCache(config=stock.config)
    with torch.no_grad():
        stock(prompt(3), **{CACHE: cache})
        with pytest.raises(TypeError, match="PagedCache"):
            ours(prompt(1), **{CACHE: cache})
        paged = kft.new_cache(ours)
        ours(prompt(3), **{CACHE: paged})
        with pytest.raises(ValueError, match="holds a batch of 1 sequences but the input has 2"):
            ours(torch.zeros(2, 1, dtype=torch.long), **{CACHE: paged})
        with pytest.raises(NotImplementedError, match="beam search"):
            paged.reorder_cache(torch.tensor([0]))


def test_both_cache_argument_names(llama):
    """transformers 5.24 renamed past_key_values to cache: the optimized model takes either name on any
    release (the other is forwarded to the decoder as a keyword it does not know, or as the alias)."""
    _, _, ours = llama
    ids = prompt(5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias on releases that renamed it
        logits = {name: [] for name in _compat.CACHE_ARGUMENTS}
        for name in _compat.CACHE_ARGUMENTS:
            cache = kft.new_cache(ours)
            logits[name].append(ours(ids, **{name: cache}).logits)
            logits[name].append(ours(ids[:, :1], **{name: cache}).logits)  # a decode step on the same cache
            assert cache.get_seq_length() == 6
        for step in range(2):
            assert torch.equal(logits["cache"][step], logits["past_key_values"][step])


def test_cache_taken_under_either_name_but_not_both():
    first, second = object(), object()
    for name in _compat.CACHE_ARGUMENTS:
        kwargs = {name: first, "use_cache": True}
        assert _compat.take_cache(kwargs) is first and kwargs == {"use_cache": True}
    assert _compat.take_cache({"cache": None, "past_key_values": None}) is None
    with pytest.raises(TypeError, match="not both"):
        _compat.take_cache({"cache": first, "past_key_values": second})


def test_optimize_leaves_models_sharing_its_config_alone():
    """transformers gives every model built from one config the same config object: optimizing one
    must not turn the other's attention to kernforge."""
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE)
    stock = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    twin = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    twin.load_state_dict(stock.state_dict())
    assert twin.config is stock.config
    ids = prompt(9)
    with torch.no_grad():
        before = stock(ids).logits
        kft.optimize(twin, kv_cache_pages=64)
        assert twin.config is not config and stock.config is config
        assert all(getattr(m, "config", None) is not config for m in twin.modules())
        assert torch.equal(stock(ids).logits, before)  # still stock attention, same logits
        assert cosine(twin(ids).logits[0, -1], before[0, -1]) > 0.999
    assert config._attn_implementation != "kernforge"


@pytest.mark.parametrize("version, warns", [("5.0.0", False), ("4.57.6", True), ("99.0", True), ("dev", True)])
def test_untested_transformers_version_warns_once_naming_the_range(version, warns):
    requirement = _compat.tested_requirement()
    assert requirement is not None and requirement.specifier.contains(transformers.__version__), (
        "the installed transformers is outside the range pyproject.toml declares as tested"
    )
    message = _compat.check_version(version, requirement)
    assert (message is not None) == warns
    if warns:
        assert str(requirement.specifier) in message and version in message
        with pytest.warns(UserWarning, match="was tested with transformers") as record:
            _compat.warn_if_untested(version)
        assert len(record) == 1


def test_running_out_of_pages_raises_and_pages_return(llama):
    stock, _, _ = llama
    small = kft.optimize(copy.deepcopy(stock), kv_cache_pages=2, page_size=16)
    with torch.no_grad():
        with pytest.raises(kft.KVCacheFullError, match="needs 3 more pages.*kv_cache_pages=2"):
            small(prompt(40))
        assert small._kernforge.pool.free_pages == 2  # a failed step takes nothing
        cache = kft.new_cache(small)
        small(prompt(20), **{CACHE: cache})
        assert small._kernforge.pool.free_pages == 0
        del cache
        assert small._kernforge.pool.free_pages == 2


def test_stock_modules_left_are_named_in_a_warning():
    stock = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_act": "relu"})).to(torch.bfloat16).eval()
    with pytest.warns(UserWarning, match=r"stock transformers path: .*mlp \(LlamaMLP, hidden_act 'relu'"):
        ours = kft.optimize(copy.deepcopy(stock))
    ids = prompt(9)
    with torch.no_grad():
        assert cosine(ours(ids).logits[0, -1], stock(ids).logits[0, -1]) > 0.999


def test_a_supported_model_optimizes_without_warnings(llama):
    stock, _, _ = llama
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kft.optimize(copy.deepcopy(stock))


@pytest.mark.slow  # a child process building a Llama-3.2-1B-wide model (one layer): ~20 s
def test_example_runs_and_agrees(kernforge_cache_dir):
    import subprocess
    import sys

    from conftest import EXAMPLES_DIR

    example = EXAMPLES_DIR / "llama_generate.py"
    result = subprocess.run(
        [sys.executable, str(example), "--layers", "1", "--prompt-len", "48", "--new-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "TTFT (ms)" in result.stdout and "TPOT (ms)" in result.stdout
    assert "sequence 0: " in result.stdout


# --------------------------------------------------------------------------- torch.compile


@torch.no_grad()
def test_compiled_model_has_no_graph_breaks(llama):
    """With each step planned ahead (PagedCache.plan_step), the optimized model's forward is one
    graph under torch.compile: every kernforge call is a torch.ops.kernforge node. Prefill and
    decode compile once each (decode steps with new plans reuse the graph), and the compiled model's
    logits match eager's."""
    _, _, model = llama
    ids = prompt(17)
    cache = kft.new_cache(model)
    cache.plan_step(1, 17)
    explanation = torch._dynamo.explain(model)(ids, **{CACHE: cache})
    assert (explanation.graph_break_count, explanation.graph_count) == (0, 1), explanation.break_reasons
    cache.plan_step(1, 1)
    explanation = torch._dynamo.explain(model)(ids[:, :1], **{CACHE: cache})
    assert (explanation.graph_break_count, explanation.graph_count) == (0, 1), explanation.break_reasons

    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting_backend)
    compiled_cache, eager_cache = kft.new_cache(model), kft.new_cache(model)
    compiled_cache.plan_step(1, 17)
    ours, eager = compiled(ids, **{CACHE: compiled_cache}).logits, model(ids, **{CACHE: eager_cache}).logits
    for _ in range(4):
        assert cosine(ours[0, -1], eager[0, -1]) > 0.9999
        torch.testing.assert_close(ours.float(), eager.float(), atol=2e-2, rtol=2e-2)
        token = eager[:, -1:].argmax(-1)
        compiled_cache.plan_step(1, 1)
        ours = compiled(token, **{CACHE: compiled_cache}).logits
        eager = model(token, **{CACHE: eager_cache}).logits
    assert len(graphs) == 2, f"compiled {len(graphs)} graphs for one prefill and 4 decode steps (expected 2)"


# --------------------------------------------------------------------------- pre-warm


_FRESH_PROCESS = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from kernforge.integrations import transformers as kft
config = LlamaConfig(**json.loads(sys.argv[1]))
torch.manual_seed(0)
model = kft.optimize(LlamaForCausalLM(config).to(torch.bfloat16).eval(), kv_cache_pages=64, quant=sys.argv[2] or None)
ids = torch.randint(0, config.vocab_size, (2, 9))
out = kft.generate(model, ids, max_new_tokens=3, do_sample=True, top_k=5, top_p=0.9)
print("generated", tuple(out.shape))
"""


@pytest.mark.slow  # pre-warms a model's kernels, then two child processes (~20 s)
@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_prewarm_from_the_model_config_leaves_nothing_to_compile(kernforge_cache_dir, tmp_path, quant):
    """`python -m kernforge prewarm --model-config config.json` builds every kernel the optimized model
    runs: a fresh process with the JIT off (KERNFORGE_JIT=0: a missing kernel is an error) then
    optimizes the model and generates, prefill and decode, sampling included."""
    config = {**SHAPE, "model_type": "llama", "hidden_act": "silu"}
    assert_prewarm_leaves_nothing_to_compile(config, SHAPE, _FRESH_PROCESS, quant, tmp_path, kernforge_cache_dir)


def assert_prewarm_leaves_nothing_to_compile(config, model_fields, fresh_process, quant, tmp_path, cache_dir):
    """Pre-warm `cache_dir` from `config` (config.json's fields) with `quant`, then run the script
    `fresh_process` (argv: json of `model_fields`, quant) in a fresh process with the JIT off: it must
    print "generated (2, 12)" and compile nothing."""
    import json
    import os
    import subprocess
    import sys

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "kernforge", "prewarm", "--model-config", str(path)]
    built = subprocess.run(command + (["--quant", quant] if quant else []), capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    env = {**os.environ, "KERNFORGE_JIT": "0", "KERNFORGE_CACHE_DIR": str(cache_dir)}
    run = subprocess.run(
        [sys.executable, "-c", fresh_process, json.dumps(model_fields), quant or ""],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "generated (2, 12)" in run.stdout
    assert "compiling" not in run.stderr


def test_model_spec_describes_the_linears_optimize_packs(llama):
    """Pre-warm builds GEMMs for ModelSpec.linear_shapes(); the optimized model packs exactly those."""
    from kernforge.model_spec import ModelSpec

    stock, _, ours = llama
    shapes = ModelSpec.from_config(stock.config.to_dict()).linear_shapes()
    layer = ours.model.layers[0]
    packed = {
        "qkv_proj": layer.self_attn.qkv_proj,
        "o_proj": layer.self_attn.o_proj,
        "gate_up_proj": layer.mlp.gate_up_proj,
        "down_proj": layer.mlp.down_proj,
        "lm_head": ours.lm_head,
    }
    assert {name: [m.out_features, m.in_features] for name, m in packed.items()} == shapes
