"""The prepared decode step (``_decode.DecodeSteps``): an optimized decoder runs a decode forward as
bound kernel calls on static buffers. It runs the eager forward's kernels in its order, so every
decode step's logits must equal the eager forward's bit for bit, on each kind of layer it takes (q/k
norms, biases, sliding windows, quantized and GGUF linears, MoE blocks run by their own forward), for
a left-padded batch and a single sequence; what it does not take must run the eager forward."""

import copy
import threading

import pytest
import torch

pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import kernforge  # noqa: E402
from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.integrations.random_llama import random_llama, write_gguf  # noqa: E402
from kernforge.integrations.transformers import _compat  # noqa: E402

VOCAB = 512
SHAPE = dict(
    hidden_size=128,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    initializer_range=0.05,
    dtype="bfloat16",
)
MODELS = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),  # biased q|k|v
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {}),  # per-head q/k norms
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": 8}),  # a window shorter than the prompts
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1]),
    ),
}
CACHE = _compat.cache_argument(LlamaForCausalLM.forward)
STEPS = 6


def build(kind: str, quant: str | None = None):
    model_class, config_class, overrides = MODELS[kind]
    torch.manual_seed(0)
    stock = model_class(config_class(**{**SHAPE, **overrides})).to(torch.bfloat16).eval()
    return kft.optimize(copy.deepcopy(stock), kv_cache_pages=64, page_size=4, quant=quant)


def padded_prompts():
    """Two left-padded prompts (13 and 21 tokens, past a page of 4 and the window of 8)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 21), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :8] = 0
    return ids.masked_fill(mask == 0, 0), mask


def decode_logits(model, prepared: bool, batch: int = 2) -> torch.Tensor:
    """Logits of a prefill, then STEPS teacher-forced decode steps (the same tokens either way):
    ``[STEPS + 1, batch, vocab]``. ``prepared=False`` runs the decoder's eager forward."""
    decoder, steps = model.model, model.model.forward
    if not prepared:
        decoder.forward = steps.stock
    try:
        ids, mask = padded_prompts()
        ids, mask = ids[-batch:], mask[-batch:]
        tokens = torch.randint(3, VOCAB, (batch, STEPS), generator=torch.Generator().manual_seed(5))
        positions = (mask.cumsum(-1) - 1).clamp(min=0) if batch > 1 else None
        cache = kft.new_cache(model)
        with torch.no_grad():
            out = model(ids, attention_mask=mask if batch > 1 else None, position_ids=positions, **{CACHE: cache})
            logits = [out.logits[:, -1]]
            for step in range(STEPS):
                if batch > 1:
                    mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
                    positions = positions[:, -1:] + 1
                out = model(
                    tokens[:, step : step + 1],
                    attention_mask=mask if batch > 1 else None,
                    position_ids=positions,
                    **{CACHE: cache},
                )
                logits.append(out.logits[:, -1])
        return torch.stack(logits)
    finally:
        decoder.forward = steps


def prepared_steps_run(model, monkeypatch) -> list:
    """A list that gets one entry per prepared step run on ``model`` from now on."""
    from kernforge.integrations.transformers import _decode

    runs, run = [], _decode._Program.run

    def counted(program, *args):
        runs.append(program.batch)
        return run(program, *args)

    monkeypatch.setattr(_decode._Program, "run", counted)
    return runs


@pytest.mark.parametrize("batch", [2, 1])
@pytest.mark.parametrize("kind, quant", [(kind, None) for kind in MODELS] + [("llama", "int8")])
def test_prepared_steps_equal_the_eager_forward(kind, quant, batch, monkeypatch):
    model = build(kind, quant)
    eager = decode_logits(model, prepared=False, batch=batch)
    runs = prepared_steps_run(model, monkeypatch)
    prepared = decode_logits(model, prepared=True, batch=batch)
    assert runs == [batch] * STEPS, "every decode step ran prepared, the prefill eagerly"
    assert torch.equal(prepared, eager)


def test_gguf_model_steps_equal_the_eager_forward(tmp_path, monkeypatch):
    path = write_gguf(
        random_llama("tiny", seed=2, rope_parameters={"rope_type": "default"}), tmp_path / "m.gguf", "Q4_0"
    )
    model = kernforge.from_gguf(path, kv_cache_pages=64, page_size=4)
    eager = decode_logits(model, prepared=False)
    runs = prepared_steps_run(model, monkeypatch)
    assert torch.equal(decode_logits(model, prepared=True), eager)
    assert len(runs) == STEPS


def test_layers_it_does_not_take_run_the_eager_forward(monkeypatch):
    torch.manual_seed(0)
    config = OlmoeConfig(**{**SHAPE, "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 1.0})
    model = kft.optimize(OlmoeForCausalLM(config).to(torch.bfloat16).eval(), kv_cache_pages=64, page_size=4)
    runs = prepared_steps_run(model, monkeypatch)
    eager = decode_logits(model, prepared=False)
    assert torch.equal(decode_logits(model, prepared=True), eager)
    assert runs == [], "OLMoE's clamped q|k|v is not a layer the prepared step takes"


def test_hooks_and_hidden_states_get_the_eager_forward(monkeypatch):
    model = build("llama")
    runs = prepared_steps_run(model, monkeypatch)
    cache, ids = kft.new_cache(model), torch.randint(3, VOCAB, (1, 9))
    with torch.no_grad():
        model(ids, **{CACHE: cache})
        seen = []
        handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: seen.append(1))
        model(ids[:, :1], **{CACHE: cache})
        handle.remove()
        assert seen == [1] and runs == [], "a hooked module runs in the eager forward"
        out = model(ids[:, 1:2], output_hidden_states=True, **{CACHE: cache})
        assert len(out.hidden_states) == SHAPE["num_hidden_layers"] + 1 and runs == []
        model(ids[:, 2:3], **{CACHE: cache})
    assert runs == [1]


def test_greedy_generation_is_the_eager_forwards(monkeypatch):
    model = build("qwen3")
    ids = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(9))
    steps = model.model.forward
    model.model.forward = steps.stock
    eager = kft.generate(model, ids, max_new_tokens=10)
    model.model.forward = steps
    runs = prepared_steps_run(model, monkeypatch)
    assert torch.equal(kft.generate(model, ids, max_new_tokens=10), eager)
    assert len(runs) == 9


def test_threads_and_copies_get_programs_of_their_own(monkeypatch):
    model = build("llama")
    eager = decode_logits(model, prepared=False, batch=1)
    copied = copy.deepcopy(model)
    results = {}

    def decode(name, which):
        results[name] = decode_logits(which, prepared=True, batch=1)

    threads = [threading.Thread(target=decode, args=(name, which)) for name, which in (("a", model), ("b", model))]
    for thread in threads:
        thread.start()
    decode("copy", copied)
    for thread in threads:
        thread.join()
    assert all(torch.equal(results[name], eager) for name in ("a", "b", "copy"))
