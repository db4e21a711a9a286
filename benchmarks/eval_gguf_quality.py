"""Accuracy on GGUF files: kernforge.from_gguf against stock transformers on the dequantized file and
against llama.cpp on the same file.

For each file: the perplexity of --chunks chunks of --ctx tokens of English prose (the license texts
of /usr/share/common-licenses), scored as llama.cpp's `llama-perplexity -c CTX` scores them (each chunk
evaluated alone, its first token the BOS where the file's tokenizer adds one, the second half of the
chunk's positions scored), by
    kernforge      kernforge.from_gguf(file), bf16
    transformers   stock transformers on the same file, every tensor dequantized, fp32 (the reference)
    llama.cpp      `llama-perplexity -m FILE -f TEXT -c CTX --chunks N -t THREADS` (its own tokenizer
                   on the same text; needs llama.cpp's binary)
with kernforge's mean KL divergence from the reference's next-token distributions and the share of
positions where both pick the same top-1 token.

    .venv/bin/python benchmarks/eval_gguf_quality.py [FILE ...] [--ctx 512 --chunks 16] [--llama-cpp DIR]
    .venv/bin/python benchmarks/eval_gguf_quality.py --quick   # SmolLM2, one chunk of 128, no llama.cpp
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_llamacpp as llamacpp
import torch

import kernforge
from kernforge.integrations import real_model
from kernforge.integrations.transformers._gguf import GGUFFile

import _harness as H


def parse_args():
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="GGUF files (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--ctx", type=int, help="tokens per chunk (default 512; --quick 128)")
    p.add_argument("--chunks", type=int, help="chunks (default 16; --quick 1)")
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp's build/bin (llama-perplexity)")
    args = p.parse_args()
    args.ctx = args.ctx or (128 if args.quick else 512)
    args.chunks = args.chunks or (1 if args.quick else 16)
    args.files = args.files or [real_model.smollm2_gguf()]
    return args


def chunks(tokenizer, path: Path, ctx: int, count: int) -> list[torch.Tensor]:
    """llama-perplexity's chunks of the text's tokens: [count] x [ctx], the first token the BOS where the
    file's tokenizer adds one."""
    ids = real_model.english_tokens(tokenizer, ctx * count)
    add_bos = bool(GGUFFile(path).field("tokenizer.ggml.add_bos_token", True))
    out = []
    for c in range(count):
        chunk = ids[c * ctx : (c + 1) * ctx].clone()
        if add_bos and tokenizer.bos_token_id is not None:
            chunk[0] = tokenizer.bos_token_id
        out.append(chunk)
    return out


@torch.no_grad()
def scored_logprobs(model, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [ctx / 2 - 1, vocab] fp32 of the scored positions, the tokens they predict)."""
    logits = model(chunk[None]).logits[0].float()
    first = chunk.numel() // 2
    return torch.log_softmax(logits[first:-1], dim=-1), chunk[first + 1 :]


def llama_cpp_perplexity(bin_dir: Path, path: Path, text: Path, args) -> float | None:
    tool = bin_dir / "llama-perplexity"
    command = [str(tool), "-m", str(path), "-f", str(text), "-c", str(args.ctx), "--chunks", str(args.chunks)]
    command += ["-t", str(args.threads), "-b", str(args.ctx)]
    result = subprocess.run(command, capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    return float(found.group(1)) if found else None


def evaluate(path: Path, args, bin_dir: Path | None, text: Path) -> dict:
    tokenizer = kernforge.gguf_tokenizer(path)
    pieces = chunks(tokenizer, path, args.ctx, args.chunks)
    reference = real_model.stock_from_gguf(path, torch.float32)
    ours = kernforge.from_gguf(path, kv_cache_pages=2 * args.ctx // 16 + 8)
    nll = {"kernforge": [], "transformers": []}
    kl, top1 = [], []
    for chunk in pieces:
        ref, targets = scored_logprobs(reference, chunk)
        mine, _ = scored_logprobs(ours, chunk)
        nll["transformers"].append(-ref.gather(1, targets[:, None]).mean())
        nll["kernforge"].append(-mine.gather(1, targets[:, None]).mean())
        kl.append((ref.exp() * (ref - mine)).sum(-1).mean())
        top1.append((ref.argmax(-1) == mine.argmax(-1)).float().mean())
    result = {name: math.exp(float(torch.stack(v).mean())) for name, v in nll.items()}
    result["kl"], result["top1"] = float(torch.stack(kl).mean()), float(torch.stack(top1).mean())
    result["llama.cpp"] = llama_cpp_perplexity(bin_dir, path, text, args) if bin_dir else None
    return result


def main() -> int:
    args = parse_args()
    H.setup_threads(args.threads)
    bin_dir = None if args.quick else llamacpp.find_llama_cpp(args.llama_cpp, ("llama-perplexity",))
    H.print_header(
        "eval_gguf: perplexity of kernforge.from_gguf, stock transformers (fp32, dequantized) and llama.cpp",
        args,
        {"llama.cpp": str(bin_dir) if bin_dir else "not found (kernforge and transformers only)"},
    )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "english.txt"
        text.write_text(real_model.english_text())
        for path in args.files:
            r = evaluate(path, args, bin_dir, text)
            case = f"{path.name} ctx{args.ctx} x{args.chunks}"
            params = {"file": path.name, "ctx": args.ctx, "chunks": args.chunks}
            for impl in ("kernforge", "transformers", "llama.cpp"):
                if r[impl] is not None:
                    H.emit(case, impl, "perplexity", r[impl], "", params=params)
            H.emit(case, "kernforge", "kl_from_transformers", r["kl"], "", params=params)
            H.emit(case, "kernforge", "top1_agreement_pct", 100 * r["top1"], "%", params=params)
            vs_llama = "" if r["llama.cpp"] is None else H.fmt(r["kernforge"] / r["llama.cpp"], 4)
            rows.append(
                [
                    path.name,
                    H.fmt(r["kernforge"], 3),
                    H.fmt(r["transformers"], 3),
                    H.fmt(r["llama.cpp"], 3) if r["llama.cpp"] else "",
                    vs_llama,
                    H.fmt(r["kl"], 4),
                    H.fmt(r["top1"], 3),
                ]  # fmt: skip
            )
    headers = ["file", "kernforge ppl", "transformers ppl (fp32)", "llama.cpp ppl", "kernforge / llama.cpp"]
    print(H.table(headers + ["KL vs transformers", "top-1 agreement"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
