"""Chat with any GGUF file (llama.cpp's format: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K tensors) on kernforge,
the tokens streamed as they come:

    python examples/gguf_chat.py PATH [--max-new-tokens 256] [--system TEXT]

The file's own chat template and tokenizer (transformers' GGUF conversion); greedy decoding. Type a
message and Enter; an empty line or Ctrl-D ends. Needs `pip install 'kernforge[gguf]'`.
"""

import argparse
import sys
import time

import torch
from transformers import TextStreamer

import kernforge


def chat_ids(tokenizer, messages) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return ids["input_ids"] if hasattr(ids, "keys") else ids


class Timed(TextStreamer):
    """A TextStreamer that also records when the first and the last tokens came."""

    def put(self, value):
        now = time.perf_counter()
        if getattr(self, "prompt_seen", False):
            self.first = getattr(self, "first", now)
            self.last, self.count = now, getattr(self, "count", 0) + 1
        self.prompt_seen = True
        super().put(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--system", help="a system message")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    model = kernforge.from_gguf(args.path)
    tokenizer = kernforge.gguf_tokenizer(args.path)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"{args.path}: {model.config.model_type}, {model.config.num_hidden_layers} layers. Empty line ends.")
    while True:
        try:
            text = input("\n> ").strip()
        except EOFError:
            break
        if not text:
            break
        messages.append({"role": "user", "content": text})
        ids = chat_ids(tokenizer, messages)
        streamer = Timed(tokenizer, skip_prompt=True, skip_special_tokens=True)
        start = time.perf_counter()
        out = kernforge.generate(model, ids, max_new_tokens=args.max_new_tokens, streamer=streamer)
        reply = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        count = getattr(streamer, "count", 0)
        if count > 1:
            tpot = (streamer.last - streamer.first) / (count - 1)
            print(f"[TTFT {streamer.first - start:.2f} s, {1 / tpot:.1f} tokens/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
