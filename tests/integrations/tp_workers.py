"""What each rank runs in test_transformers_tp.py (spawned processes import this module by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def llama(shape: dict, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**shape, "num_hidden_layers": layers})).to(torch.bfloat16).eval()


def greedy_and_logits(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens after the prompt, and the prompt's last-position logits (fp32)."""
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[:, prompt.shape[1] :]
        logits = model(prompt).logits[:, -1].float()
    return tokens, logits


def tensor_parallel_run(rank: int, world: int, shape: dict, layers: int, prompt, new_tokens: int):
    from kernforge.integrations import transformers as kft

    model = kft.optimize(llama(shape, layers), kv_cache_pages=256, tp_group=dist.group.WORLD)
    assert model._kernforge.spec.num_kv_heads == shape["num_key_value_heads"] // world
    return greedy_and_logits(model, prompt, new_tokens)
