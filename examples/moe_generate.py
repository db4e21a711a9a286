"""A Hugging Face mixture of experts generating end to end on kernforge, side by side with stock transformers.

    python examples/moe_generate.py                      # Qwen3-30B-A3B shape, 2 of its 48 layers, random weights
    python examples/moe_generate.py /path/to/qwen3-moe   # a local checkpoint directory (nothing is downloaded)
    python examples/moe_generate.py --layers 4 --batch   # 8 prompts of uneven lengths (128 to 2048) at once
    python examples/moe_generate.py --quant int8         # w8a8 linears and experts (the routers stay bf16)
    python examples/moe_generate.py --layers 1 --experts 16 --prompt-len 32 --new-tokens 4   # a quick look
    python examples/moe_generate.py --no-stock --layers 48 --quant int4   # all of Qwen3-30B-A3B, four-bit, in 24 GB

Prints TTFT, TPOT and decode tokens/s for stock transformers (``sdpa`` attention, its default experts
implementation, ``model.generate``) and for the kernforge-optimized copy of the same weights (routing
with ``topk_softmax``, the experts with ``fused_experts``; ``kernforge.integrations.transformers.generate``),
greedy, and checks the outputs agree as examples/llama_generate.py does. A router compares bf16
logits, so a near-tie between two experts can route the two runs differently and move later tokens
apart: a difference that is not at a near-tie of the output logits is reported, not an error.

``--no-stock``: kernforge alone, on random weights drawn a layer at a time as ``optimize`` packs
them (``random_llama(..., lazy_layers=True)``, ``optimize(..., materialize_layer=...)``), so that
only the packed model is ever in memory: Qwen3-30B-A3B's 48 layers are 61 GB in bf16 (no stock
model to compare with on a 24 GB machine), about 18 GB with four-bit experts and an int8 lm_head
(19.9 GB at the peak of the build).
Prints the time to build it, its peak memory, TTFT and TPOT.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from llama_generate import kernforge_generate, random_prompts, side_by_side, timed_generate
from transformers import AutoModelForCausalLM

from kernforge.integrations import transformers as kft
from kernforge.integrations.random_llama import random_layer_weights, random_llama


def random_qwen3_moe(layers: int, experts: int | None = None, seed: int = 0, lazy: bool = False) -> torch.nn.Module:
    """A bf16 ``Qwen3MoeForCausalLM`` of Qwen3-30B-A3B's shape (random_llama's ``qwen3-30b-a3b``) with
    ``layers`` decoder layers (and ``experts`` experts if given), sdpa attention; ``lazy``: its
    decoder layers on the meta device, for ``optimize(..., materialize_layer=random_layer_weights(model))``."""
    overrides = {"num_experts": experts} if experts else {}
    return random_llama("qwen3-30b-a3b", seed, layers, lazy_layers=lazy, attn_implementation="sdpa", **overrides)


def optimized_lazily(layers: int, experts: int | None, quant: str | None, pages: int) -> torch.nn.Module:
    """The kernforge model of random_qwen3_moe's shape, each layer drawn as optimize packs it; a
    four-bit model gets an int8 lm_head (its head is 0.3 GB of a token's 1.8 GB)."""
    model = random_qwen3_moe(layers, experts, lazy=True)
    model.generation_config.eos_token_id = None  # random weights: generate every requested token
    head = "int8" if quant and quant.startswith("int4") else False
    return kft.optimize(
        model, kv_cache_pages=pages, quant=quant, quant_lm_head=head, materialize_layer=random_layer_weights(model)
    )


def kernforge_alone(args) -> None:
    """--no-stock: build the model a layer at a time, then time one generate call."""
    lengths = [round(128 + i * (2048 - 128) / 7) for i in range(8)] if args.batch else [args.prompt_len]
    pages = 2 * (sum(lengths) + len(lengths) * args.new_tokens) // 16 + 2 * len(lengths)
    start = time.perf_counter()
    model = optimized_lazily(args.layers or 48, args.experts, args.quant, pages)
    built = time.perf_counter() - start
    config = model.config
    ids, mask = random_prompts(lengths, config.vocab_size)
    generate = kernforge_generate(model)
    generate(ids[:, -8:], None, 2, None)  # first calls: compiles (first run only), allocations
    _, times = timed_generate(generate, ids, mask, args.new_tokens)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB
    print(
        f"{config.model_type}, {config.num_hidden_layers} layers, {config.num_experts} experts, random weights, "
        f"kernforge quant={args.quant}: built in {built:.0f} s, peak memory {peak_gb:.1f} GB; prompts {lengths}, "
        f"{args.new_tokens} new tokens, {args.threads} threads"
    )
    print(
        f"TTFT {1e3 * times['ttft']:.1f} ms, TPOT {1e3 * times['tpot']:.1f} ms, "
        f"{len(lengths) / times['tpot']:.1f} decode tokens/s"
    )


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


def parse_arguments(
    description: str, default_layers: int, quants: tuple[str, ...], no_stock: bool = False
) -> argparse.Namespace:
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
    if no_stock:
        parser.add_argument(
            "--no-stock", action="store_true", help="kernforge alone, built a layer at a time (random weights)"
        )
    return parser.parse_args()


def main() -> int:
    args = parse_arguments(__doc__, 2, ("int8", "int4", "int4_w4a16"), no_stock=True)

    torch.set_num_threads(args.threads)
    if args.no_stock:
        if args.checkpoint:
            raise SystemExit("--no-stock builds random weights; a checkpoint loads with kft.from_pretrained")
        kernforge_alone(args)
        return 0
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
