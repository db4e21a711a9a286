"""A Hugging Face mixture of experts generating end to end on kernforge, side by side with stock transformers.

    python examples/moe_generate.py                      # Qwen3-30B-A3B shape, 2 of its 48 layers, random weights
    python examples/moe_generate.py /path/to/qwen3-moe   # a local checkpoint directory (nothing is downloaded)
    python examples/moe_generate.py --layers 4 --batch   # 8 prompts of uneven lengths (128 to 2048) at once
    python examples/moe_generate.py --quant int8         # w8a8 linears and experts (the routers stay bf16)
    python examples/moe_generate.py --layers 1 --experts 16 --prompt-len 32 --new-tokens 4   # a quick look

Prints TTFT, TPOT and decode tokens/s for stock transformers (``sdpa`` attention, its default experts
implementation, ``model.generate``) and for the kernforge-optimized copy of the same weights (routing
with ``topk_softmax``, the experts with ``fused_experts``; ``kernforge.integrations.transformers.generate``),
greedy, and checks the outputs agree as examples/llama_generate.py does. A router compares bf16
logits, so a near-tie between two experts can route the two runs differently and move later tokens
apart: a difference that is not at a near-tie of the output logits is reported, not an error.
"""

from __future__ import annotations

import argparse
import copy

import torch
from llama_generate import agreement, kernforge_generate, random_prompts, stock_generate, timed_generate
from transformers import AutoModelForCausalLM

from kernforge.integrations import transformers as kft
from kernforge.integrations.random_llama import random_llama


def random_qwen3_moe(layers: int, experts: int | None = None, seed: int = 0) -> torch.nn.Module:
    """A bf16 ``Qwen3MoeForCausalLM`` of Qwen3-30B-A3B's shape (random_llama's ``qwen3-30b-a3b``) with
    ``layers`` decoder layers (and ``experts`` experts if given), sdpa attention."""
    overrides = {"num_experts": experts} if experts else {}
    return random_llama("qwen3-30b-a3b", seed, layers, attn_implementation="sdpa", **overrides)


def build_model(checkpoint: str | None, layers: int | None, experts: int | None) -> torch.nn.Module:
    """The stock bf16 model: from a local checkpoint directory, or random weights."""
    if checkpoint:
        overrides = {"num_hidden_layers": layers} if layers else {}
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, local_files_only=True, attn_implementation="sdpa", **overrides
        )
        return model.eval()
    return random_qwen3_moe(layers or 2, experts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="a local checkpoint directory (default: random weights)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", action="store_true", help="8 prompts of uneven lengths, 128 to 2048 tokens")
    parser.add_argument("--quant", choices=["int8"], default=None)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (random weights: default 2)")
    parser.add_argument("--experts", type=int, default=None, help="fewer experts (random weights), for a quick run")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    stock = build_model(args.checkpoint, args.layers, args.experts)
    lengths = [round(128 + i * (2048 - 128) / 7) for i in range(8)] if args.batch else [args.prompt_len]
    ids, mask = random_prompts(lengths, stock.config.vocab_size)
    total = sum(lengths) + len(lengths) * args.new_tokens
    pages = 2 * (total // 16 + len(lengths))
    ours = kft.optimize(copy.deepcopy(stock), kv_cache_pages=pages, quant=args.quant)
    stock.generation_config.eos_token_id = None  # random weights: generate every requested token

    kft.generate(ours, ids[:, -8:], max_new_tokens=2)  # compile (first run only) and warm the kernels
    stock.generate(ids[:, -8:], max_new_tokens=2, do_sample=False, pad_token_id=0)
    stock_out, stock_times = timed_generate(stock_generate(stock, output_logits=True), ids, mask, args.new_tokens)
    ours_out, ours_times = timed_generate(kernforge_generate(ours), ids, mask, args.new_tokens)

    config = stock.config
    expert_size = getattr(config, "moe_intermediate_size", config.intermediate_size)  # Mixtral's, OLMoE's: the latter
    print(
        f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_experts} experts of {expert_size} (top {config.num_experts_per_tok}), "
        f"prompts {lengths}, {args.new_tokens} new tokens, {args.threads} threads, stock experts "
        f"{config._experts_implementation!r}" + (f", kernforge quant={args.quant}" if args.quant else "")
    )
    print(f"{'':18}{'stock (sdpa)':>14}{'kernforge':>14}{'speedup':>10}")
    for name, key, scale in (("TTFT (ms)", "ttft", 1e3), ("TPOT (ms)", "tpot", 1e3)):
        s, k = stock_times[key] * scale, ours_times[key] * scale
        print(f"{name:18}{s:14.1f}{k:14.1f}{s / k:9.2f}x")
    batch = len(lengths)
    s_rate, k_rate = batch / stock_times["tpot"], batch / ours_times["tpot"]
    print(f"{'decode tokens/s':18}{s_rate:14.1f}{k_rate:14.1f}{k_rate / s_rate:9.2f}x")
    print("\n".join(agreement(stock_out, ours_out, ids.shape[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
