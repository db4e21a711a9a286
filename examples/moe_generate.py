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

import torch
from llama_generate import side_by_side
from transformers import AutoModelForCausalLM

from kernforge.integrations.random_llama import random_llama


def random_qwen3_moe(layers: int, experts: int | None = None, seed: int = 0) -> torch.nn.Module:
    """A bf16 ``Qwen3MoeForCausalLM`` of Qwen3-30B-A3B's shape (random_llama's ``qwen3-30b-a3b``) with
    ``layers`` decoder layers (and ``experts`` experts if given), sdpa attention."""
    overrides = {"num_experts": experts} if experts else {}
    return random_llama("qwen3-30b-a3b", seed, layers, attn_implementation="sdpa", **overrides)


def load_checkpoint(checkpoint: str, layers: int | None) -> torch.nn.Module:
    """A local checkpoint directory as a stock bf16 model (sdpa attention; ``layers`` decoder layers if given)."""
    overrides = {"num_hidden_layers": layers} if layers else {}
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.bfloat16, local_files_only=True, attn_implementation="sdpa", **overrides
    )
    return model.eval()


def build_model(checkpoint: str | None, layers: int | None, experts: int | None) -> torch.nn.Module:
    """The stock bf16 model: from a local checkpoint directory, or random weights."""
    return load_checkpoint(checkpoint, layers) if checkpoint else random_qwen3_moe(layers or 2, experts)


def parse_arguments(description: str, default_layers: int, quants: tuple[str, ...]) -> argparse.Namespace:
    """The MoE examples' command line: a checkpoint or random weights, the prompt, the quantization."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="a local checkpoint directory (default: random weights)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", action="store_true", help="8 prompts of uneven lengths, 128 to 2048 tokens")
    parser.add_argument("--quant", choices=list(quants), default=None)
    parser.add_argument(
        "--layers", type=int, default=None, help=f"decoder layers (random weights: default {default_layers})"
    )
    parser.add_argument("--experts", type=int, default=None, help="fewer experts (random weights), for a quick run")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def main() -> int:
    args = parse_arguments(__doc__, 2, ("int8",))

    torch.set_num_threads(args.threads)
    stock = build_model(args.checkpoint, args.layers, args.experts)
    config = stock.config
    expert_size = getattr(config, "moe_intermediate_size", config.intermediate_size)  # Mixtral's, OLMoE's: the latter
    side_by_side(
        stock,
        args,
        f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_experts} experts of {expert_size} (top {config.num_experts_per_tok}), stock experts "
        f"{config._experts_implementation!r}",
    )
    return 0  # a difference away from a near-tie is reported, not an error (see above)


if __name__ == "__main__":
    raise SystemExit(main())
