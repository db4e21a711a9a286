"""optimize(model, tp_group=...): a Llama-family model split over 2 and 4 ranks (processes spawned
on this machine) gives the greedy tokens and the last-position logits of the same model on one rank."""

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
import tp_workers  # noqa: E402
from ranks import run_ranks  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.integrations.random_llama import SHAPES  # noqa: E402
from kernforge.integrations.transformers import _tensor_parallel  # noqa: E402

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
# Llama-3.2-1B's layer shape (two layers); a small one with 8 heads and a vocabulary 4 ranks do not divide
LLAMA_1B = {**SHAPES["llama-3.2-1b"], "max_position_embeddings": 131072}
SMALL = {**SHAPES["tiny"], "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 1001}


def prompt(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 37), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("shape", "world"), [(LLAMA_1B, 2), (SMALL, 4)], ids=["llama-1b-shape-tp2", "small-tp4"])
def test_tensor_parallel_matches_one_rank(shape, world):
    ids = prompt(shape["vocab_size"])
    one_rank = kft.optimize(tp_workers.llama(shape, 2), kv_cache_pages=256)
    tokens, logits = tp_workers.greedy_and_logits(one_rank, ids, NEW_TOKENS)
    del one_rank
    results = run_ranks(tp_workers.tensor_parallel_run, world, shape=shape, layers=2, prompt=ids, new_tokens=NEW_TOKENS)
    for rank, (rank_tokens, rank_logits) in results.items():
        assert torch.equal(rank_tokens, tokens), (rank, rank_tokens, tokens)
        assert rank_logits.shape == logits.shape
        assert torch.nn.functional.cosine_similarity(rank_logits, logits).item() >= 0.999, rank
    assert all(torch.equal(r[1], results[0][1]) for r in results.values())  # every rank: the same bits


def test_models_that_do_not_split_are_refused():
    model = tp_workers.llama(SMALL, 1)
    with pytest.raises(ValueError, match=r"attention heads \(8\) and KV heads \(4\) to divide among them"):
        _tensor_parallel.check_shardable(model.config, model.model, 3)
    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    moe = Qwen3MoeForCausalLM(config)
    with pytest.raises(kft.UnsupportedModelError, match="dense gated MLPs"):
        _tensor_parallel.check_shardable(moe.config, moe.model, 2)
