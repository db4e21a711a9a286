"""A Hugging Face Llama generating end to end on kernforge, side by side with stock transformers.

    python examples/llama_generate.py                    # Llama-3.2-1B shape, random weights, 1024-token prompt
    python examples/llama_generate.py /path/to/llama     # a local checkpoint directory (nothing is downloaded)
    python examples/llama_generate.py --batch            # 8 prompts of uneven lengths (128 to 2048) at once
    python examples/llama_generate.py --quant int8       # w8a8 linears
    python examples/llama_generate.py --layers 2 --prompt-len 128 --new-tokens 8   # a quick look

Prints TTFT (prompt in, first token out), TPOT (time per further token) and tokens/s for stock
transformers (``sdpa`` attention, ``model.generate``) and for the kernforge-optimized copy of the
same weights (``kernforge.integrations.transformers.generate``), greedy, and checks the outputs
agree: the same tokens, or a first difference where stock's two best logits are within two bf16
steps (a near-tie that rounding decides; reported).
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch
from transformers import AutoModelForCausalLM

from kernforge.integrations import transformers as kft
from kernforge.integrations.random_llama import random_llama

# Llama-3.2-1B's token ids and context beyond the shape random_llama draws (hidden 2048, 16 layers...)
LLAMA_3_2_1B_IDS = dict(max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001)


def build_model(checkpoint: str | None = None, layers: int | None = None, seed: int = 0) -> torch.nn.Module:
    """The stock bf16 model: from a local checkpoint directory, or Llama-3.2-1B-shaped with random
    weights (``layers`` overrides the depth)."""
    if checkpoint:
        overrides = {"num_hidden_layers": layers} if layers else {}
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, local_files_only=True, attn_implementation="sdpa", **overrides
        )
        return model.eval()
    return random_llama("llama-3.2-1b", seed, layers, attn_implementation="sdpa", **LLAMA_3_2_1B_IDS)


def random_prompts(lengths: list[int], vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Left-padded random prompts (input_ids, attention_mask; the mask is None for one prompt)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(0, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, (mask if len(lengths) > 1 else None)


class TimingStreamer:
    """A transformers streamer that only records when each step's tokens arrive."""

    def __init__(self):
        self.start, self.times = time.perf_counter(), []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def figures(self) -> dict:
        """TTFT (call to first token), TPOT (mean time per later token), in seconds."""
        tokens = self.times[1:]  # times[0]: the prompt, put before the prefill
        ttft = tokens[0] - self.start
        tpot = (tokens[-1] - tokens[0]) / (len(tokens) - 1) if len(tokens) > 1 else float("nan")
        return {"ttft": ttft, "tpot": tpot, "new_tokens": len(tokens)}


def timed_generate(generate, ids, mask, new_tokens: int) -> tuple[torch.Tensor, dict]:
    streamer = TimingStreamer()
    out = generate(ids, mask, new_tokens, streamer)
    return out, streamer.figures()


def stock_generate(model, output_logits: bool = False):
    def run(ids, mask, new_tokens, streamer):
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
            output_logits=output_logits,
            return_dict_in_generate=output_logits,
        )

    return run


def kernforge_generate(model):
    def run(ids, mask, new_tokens, streamer):
        return kft.generate(
            model,
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            eos_token_id=[],
            pad_token_id=0,
            streamer=streamer,
        )

    return run


def agreement(stock_out, ours: torch.Tensor, prompt_width: int) -> list[str]:
    """Per sequence: 'same' or where and how close to a tie the first difference is."""
    lines = []
    for row in range(ours.shape[0]):
        expected, got = stock_out.sequences[row, prompt_width:], ours[row, prompt_width:]
        different = (expected != got).nonzero()
        if not len(different):
            lines.append(f"sequence {row}: same {len(got)} tokens")
            continue
        step = int(different[0])
        logits = stock_out.logits[step][row].float()
        top, margin = logits.max().item(), logits.max().item() - logits[got[step]].item()
        bf16_step = 2.0 ** (math.floor(math.log2(max(abs(top), 1e-30))) - 7)
        verdict = "a near-tie" if margin <= 2 * bf16_step else "NOT a near-tie"
        lines.append(
            f"sequence {row}: first difference at token {step} ({int(expected[step])} vs {int(got[step])}): "
            f"{margin:.4g} below stock's best logit {top:.4g}, bf16 step {bf16_step:.3g}: {verdict}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="a local checkpoint directory (default: random weights)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", action="store_true", help="8 prompts of uneven lengths, 128 to 2048 tokens")
    parser.add_argument("--quant", choices=["int8"], default=None)
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers, for a quick run")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    stock = build_model(args.checkpoint, args.layers)
    config = stock.config
    lines = side_by_side(
        stock, args, f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}"
    )
    return 1 if any("NOT a near-tie" in line for line in lines) else 0


def side_by_side(stock, args, description: str) -> list[str]:
    """Generate with ``stock`` and a kernforge-optimized copy of it on the same random prompts (as
    ``args`` say: --batch, --prompt-len, --new-tokens, --quant, --threads), print the model's
    ``description``, TTFT, TPOT and decode tokens/s of both, and the outputs' agreement (its lines)."""
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

    print(
        f"{description}, prompts {lengths}, {args.new_tokens} new tokens, {args.threads} threads"
        + (f", kernforge quant={args.quant}" if args.quant else "")
    )
    print(f"{'':18}{'stock (sdpa)':>14}{'kernforge':>14}{'speedup':>10}")
    for name, key, scale in (("TTFT (ms)", "ttft", 1e3), ("TPOT (ms)", "tpot", 1e3)):
        s, k = stock_times[key] * scale, ours_times[key] * scale
        print(f"{name:18}{s:14.1f}{k:14.1f}{s / k:9.2f}x")
    batch = len(lengths)
    s_rate, k_rate = batch / stock_times["tpot"], batch / ours_times["tpot"]
    print(f"{'decode tokens/s':18}{s_rate:14.1f}{k_rate:14.1f}{k_rate / s_rate:9.2f}x")
    lines = agreement(stock_out, ours_out, ids.shape[1])
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
