"""A Hugging Face DeepSeek-V2/V3 model generating end to end on kernforge, side by side with stock transformers.

    python examples/deepseek_generate.py                     # DeepSeek-V2-Lite shape, 4 of 27 layers, random weights
    python examples/deepseek_generate.py /path/to/deepseek   # a local checkpoint directory (nothing is downloaded)
    python examples/deepseek_generate.py --layers 2 --batch  # 8 prompts of uneven lengths (128 to 2048) at once
    python examples/deepseek_generate.py --quant int8        # w8a8 linears and experts (the routers stay fp32)
    python examples/deepseek_generate.py --layers 2 --experts 16 --prompt-len 32 --new-tokens 4   # a quick look

DeepSeek-V2-Lite's shape: hidden 2048, 16 heads, multi-head latent attention (kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, no q_lora_rank), 64 routed experts of 1408
(top 6, softmax) and 2 shared ones, the first layer dense. Prints TTFT, TPOT and decode tokens/s for
stock transformers (``sdpa``, ``model.generate``) and for the kernforge-optimized copy of the same
weights (the latent cache, absorbed MLA decode, ``fused_experts``;
``kernforge.integrations.transformers.generate``), greedy, and the outputs' agreement, as
examples/moe_generate.py does (a difference away from a near-tie is reported, not an error: routing).
"""

from __future__ import annotations

import torch
from llama_generate import side_by_side
from moe_generate import load_checkpoint, parse_arguments

from kernforge.integrations.random_llama import random_llama


def random_deepseek_v2_lite(layers: int, experts: int | None = None, seed: int = 0) -> torch.nn.Module:
    """A bf16 ``DeepseekV2ForCausalLM`` of DeepSeek-V2-Lite's shape (random_llama's ``deepseek-v2-lite``)
    with ``layers`` decoder layers (and ``experts`` routed experts if given), sdpa attention."""
    overrides = {"n_routed_experts": experts} if experts else {}
    return random_llama("deepseek-v2-lite", seed, layers, attn_implementation="sdpa", **overrides)


def build_model(checkpoint: str | None, layers: int | None, experts: int | None) -> torch.nn.Module:
    """The stock bf16 model: from a local checkpoint directory, or random weights."""
    return load_checkpoint(checkpoint, layers) if checkpoint else random_deepseek_v2_lite(layers or 4, experts)


def main() -> int:
    args = parse_arguments(__doc__, 4, ("int8", "fp8_block"))

    torch.set_num_threads(args.threads)
    stock = build_model(args.checkpoint, args.layers, args.experts)
    config = stock.config
    side_by_side(
        stock,
        args,
        f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, MLA kv_lora_rank "
        f"{config.kv_lora_rank} + rope {config.qk_rope_head_dim}, {config.n_routed_experts} experts of "
        f"{config.moe_intermediate_size} (top {config.num_experts_per_tok}) + {config.n_shared_experts} shared",
    )
    return 0  # a difference away from a near-tie is reported, not an error (see above)


if __name__ == "__main__":
    raise SystemExit(main())
