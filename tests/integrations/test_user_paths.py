"""What a new user does with an optimized transformers model besides generating: ``kernforge.optimize``
at the top level, ``save_pretrained``, scoring forwards with ``use_cache=False``, ``output_attentions``,
and generating past the model's context. Tiny random Llamas (``random_llama``), so each test takes
seconds."""

import copy
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.integrations.random_llama import random_llama  # noqa: E402
from kernforge.integrations.transformers import _compat  # noqa: E402

# The name this transformers release gives the KV cache argument (``cache`` from 5.24 on).
CACHE = _compat.cache_argument(LlamaForCausalLM.forward)


@pytest.fixture(scope="module")
def stock():
    return random_llama("tiny")


def prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 1024, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- kernforge.optimize


def test_top_level_entry_points_are_the_integrations_and_import_no_transformers():
    script = textwrap.dedent(
        """
        import sys
        import kernforge
        assert "transformers" not in sys.modules, "import kernforge imported transformers"
        from kernforge.integrations import transformers as kft
        for name in ("optimize", "generate", "from_pretrained"):
            assert getattr(kernforge, name) is getattr(kft, name), name
            assert name in dir(kernforge), name
        try:
            kernforge.no_such_name
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        else:
            raise AssertionError("kernforge.no_such_name did not raise AttributeError")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- save_pretrained


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_writes_the_stock_checkpoint(tmp_path, tied):
    """An unquantized bf16 model saves what the model before optimize() saves, exactly: the same
    tensors and config, which stock transformers loads and optimize() takes again."""
    stock = random_llama("tiny", tie_word_embeddings=tied)
    ours = kft.optimize(copy.deepcopy(stock), kv_cache_pages=16)
    stock.save_pretrained(tmp_path / "stock")
    ours.save_pretrained(tmp_path / "ours")
    saved = {name: load_file(tmp_path / name / "model.safetensors") for name in ("stock", "ours")}
    assert saved["ours"].keys() == saved["stock"].keys()
    for key, tensor in saved["ours"].items():
        assert torch.equal(tensor, saved["stock"][key]), key
    configs = {name: json.loads((tmp_path / name / "config.json").read_text()) for name in ("stock", "ours")}
    assert configs["ours"] == configs["stock"]
    loaded = {name: LlamaForCausalLM.from_pretrained(tmp_path / name).eval() for name in ("stock", "ours")}
    assert loaded["ours"].config._attn_implementation != "kernforge"
    if tied:
        assert loaded["ours"].lm_head.weight.data_ptr() == loaded["ours"].model.embed_tokens.weight.data_ptr()
    ids = prompt(9)
    with torch.no_grad():
        assert torch.equal(loaded["ours"](ids).logits, loaded["stock"](ids).logits)
        again = {name: kft.optimize(model, kv_cache_pages=16)(ids).logits for name, model in loaded.items()}
    assert torch.equal(again["ours"], again["stock"])


def test_save_pretrained_refuses_quantized_weights_before_writing(stock, tmp_path):
    ours = kft.optimize(copy.deepcopy(stock), kv_cache_pages=16, quant="int8")
    target = tmp_path / "saved"
    with pytest.raises(
        ValueError, match=r"qkv_proj.*: quantized \(quant='int8'\)\. Save the model before .*optimize\(\)"
    ):
        ours.save_pretrained(target)
    assert not target.exists()


def test_save_pretrained_refuses_weights_rounded_to_bf16(stock, tmp_path):
    ours = kft.optimize(copy.deepcopy(stock).float(), kv_cache_pages=16)
    with pytest.raises(ValueError, match=r"rounded to bf16 from torch.float32"):
        ours.save_pretrained(tmp_path)


def test_save_pretrained_refuses_packed_experts(tmp_path):
    ours = kft.optimize(random_llama("tiny-moe"), kv_cache_pages=16)
    with pytest.raises(ValueError, match=r"mlp\.experts\..*: no counterpart .*MoE experts"):
        ours.save_pretrained(tmp_path)


# --------------------------------------------------------------------------- use_cache=False


def test_forwards_without_cache_return_none_and_keep_no_pages(stock):
    ours = kft.optimize(copy.deepcopy(stock), kv_cache_pages=4, page_size=16)  # 64 tokens
    ids = prompt(40, batch=1)
    with torch.no_grad():
        cached = ours(ids, use_cache=True).logits
        kept = [ours(ids, use_cache=False) for _ in range(200)]  # a scoring loop that keeps its outputs
    assert ours._kernforge.pool.free_pages == 4
    assert all(out.past_key_values is None for out in kept)
    assert torch.equal(kept[0].logits, cached) and torch.equal(kept[-1].logits, cached)


def test_forward_without_cache_longer_than_the_pool_names_the_pages_needed(stock):
    ours = kft.optimize(copy.deepcopy(stock), kv_cache_pages=2, page_size=16)
    with torch.no_grad():
        with pytest.raises(kft.KVCacheFullError, match=r"needs 3 more pages.*pass kv_cache_pages=3 or more"):
            ours(prompt(40), use_cache=False)
        assert ours._kernforge.pool.free_pages == 2
        held = kft.new_cache(ours)
        ours(prompt(20), **{CACHE: held})  # 2 pages held by a live cache
        with pytest.raises(kft.KVCacheFullError, match=r"kv_cache_pages=5 or more .*2 of them .*live caches"):
            ours(prompt(40), use_cache=False)
        del held
        assert torch.isfinite(ours(prompt(20), use_cache=False).logits).all()
    assert ours._kernforge.pool.free_pages == 2


# --------------------------------------------------------------------------- warnings stock gives


def test_output_attentions_warns_once(stock):
    ours = kft.optimize(copy.deepcopy(stock), kv_cache_pages=16)
    with torch.no_grad(), pytest.warns(UserWarning, match="output_attentions=True.*attention weights") as record:
        first = ours(prompt(5), output_attentions=True)
        ours(prompt(5), output_attentions=True)
    ours_warned = [w for w in record if "output_attentions" in str(w.message)]
    assert len(ours_warned) == 1
    assert ours_warned[0].filename == __file__  # the caller's line, not one inside torch or transformers
    assert not first.attentions


def test_generate_past_max_position_embeddings_warns(stock):
    ours = kft.optimize(copy.deepcopy(stock), kv_cache_pages=16)
    ours.config.max_position_embeddings = 24
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kft.generate(ours, prompt(20), max_new_tokens=5, eos_token_id=[])  # the last forward feeds position 23
    with pytest.warns(UserWarning, match=r"exceeded the model's predefined maximum length .*=24") as record:
        out = kft.generate(ours, prompt(20), max_new_tokens=8, eos_token_id=[])
    assert out.shape == (1, 28)
    assert len(record) == 1 and record[0].filename == __file__
