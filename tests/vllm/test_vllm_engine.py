"""The plugin inside vLLM's engine: a tiny Llama through ``vllm.LLM`` with and without kernforge
gives the same greedy tokens and close logprobs, through chunked-prefill steps that mix prefill
pieces with decodes, many concurrent requests of uneven lengths, preemption and recompute, and
vLLM's torch.compile mode. Each engine runs in a process of its own (``vllm_generate.py``).

Two bf16 implementations round differently, and the tiny model's bf16 logits (magnitude ~10-16)
are spaced 0.0625 apart, so two tokens often tie within an ulp or two: a prompt's comparison stops
at its first such near-tie (reported); any other difference fails, and most tokens must be
compared before their prompts' near-ties.
"""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from greedy import BF16_LOGIT_ULP, LOGPROB_ATOL, MIN_COMPARED, compare_greedy

from kernforge.integrations.random_llama import quantize_w8a8

GENERATE = Path(__file__).with_name("vllm_generate.py")
NEW_TOKENS = 24
# Uneven lengths; with 256 tokens per step the long prompts are prefilled in pieces beside decodes.
# No prompt under 5 tokens: stock vLLM 0.32's CPU worker dies on those (seen on an AMX Xeon); see
# test_short_prompts_against_transformers.
PROMPT_LENGTHS = [5, 7, 64, 200, 513, 1000, 33, 130, 6, 300, 77, 9]
CHUNKED = {"max_num_batched_tokens": 256, "max_num_seqs": 8}

pytestmark = pytest.mark.slow


def _prompts(lengths, vocab=1024, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def generate(model_dir, tmp_path, plugin: bool | str, prompts=None, new=NEW_TOKENS, **engine) -> dict:
    spec = {
        "model": str(model_dir),
        "prompts": prompts or _prompts(PROMPT_LENGTHS),
        "new": new,
        "plugin": plugin,
        "engine": engine,
    }
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    name = f"{'kf' if plugin not in (False, '0') else 'stock'}-{digest}"
    spec_path, out_path = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    run = subprocess.run(
        [sys.executable, str(GENERATE), str(spec_path), str(out_path)], capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, f"vLLM run failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    log = run.stdout + run.stderr
    result = json.loads(out_path.read_text())
    result["log"] = log
    return result


@pytest.fixture(scope="module")
def stock_run(model_dir, tmp_path_factory):
    return generate(model_dir, tmp_path_factory.mktemp("stock"), plugin=False, **CHUNKED)


def _check_against_stock(stock_run, run, **tolerances):
    near_ties, compared = compare_greedy(stock_run, run, **tolerances)
    print(f"compared {compared:.0%} of the tokens; near-ties:", near_ties or "none")
    assert compared >= MIN_COMPARED, near_ties


def test_plugin_replaces_what_it_says_in_every_process(model_dir, tmp_path, stock_run):
    run = generate(model_dir, tmp_path, plugin=True, **CHUNKED)
    assert "runs vLLM's attention (CPU_ATTN), RMSNorm, SiluAndMul" in run["log"]
    assert "Llama3RotaryEmbedding" in run["log"] and "bf16 linear layers" in run["log"]
    assert "runs vLLM's" not in stock_run["log"]  # KERNFORGE_VLLM=0: nothing replaced
    _check_against_stock(stock_run, run)


def test_default_self_checks_the_parts_and_serves_what_it_chose(model_dir, tmp_path, stock_run):
    """KERNFORGE_VLLM unset: the engine measures attention and each linear shape against vLLM's
    kernels, logs each verdict, and gives stock's tokens whichever side each part got."""
    run = generate(model_dir, tmp_path, plugin="", **CHUNKED)
    assert re.search(r"kernforge attention \(.* layers \d+\): (kernforge's|vLLM's) kernels", run["log"])
    assert re.search(r"kernforge linear \(bf16 N=\d+ K=\d+\): (kernforge's|vLLM's) kernels", run["log"])
    _check_against_stock(stock_run, run)


def test_preemption_and_recompute(model_dir, tmp_path):
    """8 requests of 110-token prompts run at once in a KV cache of 9 usable 128-token blocks: each
    needs a second block 18 tokens into its generation, when 1 is free, so the scheduler preempts
    requests and recomputes them later. Tokens as stock's without preemption."""
    prompts = _prompts([110] * 8, seed=2)
    stock = generate(model_dir, tmp_path, plugin=False, prompts=prompts, **CHUNKED)
    small_cache = dict(num_gpu_blocks_override=10, max_model_len=1152, disable_log_stats=False)
    run = generate(model_dir, tmp_path, plugin=True, prompts=prompts, **small_cache, **CHUNKED)
    assert run["preemptions"], "the engine preempted nothing: the test did not test preemption"
    _check_against_stock(stock, run)


def test_compiled_model(model_dir, tmp_path, stock_run):
    """vLLM's default on CPU: the model under torch.compile (Inductor), kernforge's layers as
    custom ops in its graph."""
    run = generate(model_dir, tmp_path, plugin=True, enforce_eager=False, **CHUNKED)
    _check_against_stock(stock_run, run)


def test_int8_w8a8_checkpoint(model_dir, tmp_path, stock_run):
    """A compressed-tensors int8 w8a8 checkpoint (per-channel weights, activations quantized per token
    at run time): its linear layers on kernforge's int8 GEMM, every process. Against the bf16 model,
    kernforge's int8 layers are as close as vLLM's own. Greedy tokens are not compared: quantizing
    activations turns the two engines' last-bit differences (vLLM's oneDNN GEMMs here; on an AMX
    CPU sgl-kernel's, which kernforge's int8 GEMM matches bit for bit) into steps of 1/254 of a
    row's largest value, which move this tiny model's near-ties by several logit ulps."""
    w8a8 = quantize_w8a8(model_dir, tmp_path / "w8a8")
    stock = generate(w8a8, tmp_path, plugin=False, **CHUNKED)
    run = generate(w8a8, tmp_path, plugin="linear", **CHUNKED)
    assert "int8 w8a8 linear layers" in run["log"]
    assert "Selected KernforgeInt8ScaledMMLinearKernel" in run["log"]
    assert "KernforgeInt8ScaledMMLinearKernel" not in stock["log"]
    ours, theirs = _first_token_error(run, stock_run), _first_token_error(stock, stock_run)
    between = _first_token_error(run, stock)
    print(
        f"first-token logprob error against bf16: kernforge int8 {ours:.4f}, vLLM int8 {theirs:.4f}; "
        f"between them {between:.4f}"
    )
    assert ours <= theirs * 1.1 + 0.01
    assert between <= theirs + 0.01  # the two int8 GEMMs agree at least as well as either with bf16


def _first_token_error(run: dict, reference: dict) -> float:
    """Mean |difference| of the first generated token's top logprob (after the prefill, where both
    runs saw the same tokens) from a reference run's."""
    errors = [
        abs(max(ours["logprobs"][0].values()) - max(theirs["logprobs"][0].values()))
        for ours, theirs in zip(run["outputs"], reference["outputs"])
    ]
    return sum(errors) / len(errors)


def test_fp8_kv_cache(model_dir, tmp_path, stock_run):
    """``kv_cache_dtype="fp8"`` (e4m3): kernforge's cache is at least as close to the bf16 model as
    vLLM's own fp8 cache. They differ: vLLM 0.32's CPU write truncates to e4m3 (0.30078 -> 0.28125,
    where round-to-nearest gives 0.3125), kernforge's rounds to nearest, as torch and FlashInfer do."""
    stock_fp8 = generate(model_dir, tmp_path, plugin=False, kv_cache_dtype="fp8", **CHUNKED)
    ours_fp8 = generate(model_dir, tmp_path, plugin=True, kv_cache_dtype="fp8", **CHUNKED)
    ours, theirs = _first_token_error(ours_fp8, stock_run), _first_token_error(stock_fp8, stock_run)
    print(f"first-token logprob error against bf16 KV: kernforge fp8 {ours:.4f}, vLLM fp8 {theirs:.4f}")
    assert ours <= theirs * 1.1 + 0.01
    assert ours <= 0.4  # e4m3's 3 mantissa bits on this model's large K/V: ~0.2 nats (a wrong scale: > 1)


def _transformers_greedy(model_dir, prompts, new) -> dict:
    """Greedy generation by transformers' own model (bf16, eager), in vllm_generate's format."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            result = model.generate(
                torch.tensor([ids]),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            steps = []
            for scores in result.scores:
                top = scores[0].float().log_softmax(-1).topk(3)
                steps.append({str(i): lp for i, lp in zip(top.indices.tolist(), top.values.tolist())})
            outputs.append({"ids": result.sequences[0, len(ids) :].tolist(), "logprobs": steps})
    return {"outputs": outputs}


def test_short_prompts_against_transformers(model_dir, tmp_path):
    """Prompts of 1 to 4 tokens, which stock vLLM 0.32's CPU worker does not survive here: with the
    plugin they are served, and give transformers' own greedy tokens (near-ties aside; transformers
    rounds differently from vLLM in more places, hence 4 logit ulps rather than 2.5)."""
    prompts = _prompts([1, 2, 3, 4], seed=3)
    run = generate(model_dir, tmp_path, plugin=True, prompts=prompts, **CHUNKED)
    reference = _transformers_greedy(model_dir, prompts, NEW_TOKENS)
    _check_against_stock(reference, run, atol=4 * BF16_LOGIT_ULP, near_tie=4 * BF16_LOGIT_ULP)


# Uneven lengths again, 24 prompts (the first-token comparison below averages over them); 256
# tokens per step, so the long ones are prefilled in pieces beside decodes.
MOE_PROMPT_LENGTHS = [5, 7, 64, 200, 513, 33, 130, 6, 300, 77, 9, 41, 5, 260, 18, 97, 11, 150, 8, 64, 400, 23, 6, 120]


def test_moe_model(moe_model_dir, tmp_path):
    """A Qwen3-MoE (8 experts, 2 per token) with every part of the plugin, under vLLM's
    torch.compile: its MoE layers on kernforge's experts and routing, in every process, and as
    close to a float32 run of the model as vLLM's own bf16 run is.

    Greedy tokens are not compared with stock's as for the dense model: top-k routing is a step
    function of the router's bf16 logits, so two engines whose last bits differ anywhere before a
    router (kernforge's GEMMs or attention, vLLM's routing weights rounded to bf16 where kernforge
    keeps fp32) send a token whose k-th and (k+1)-th experts nearly tie to different experts, which
    moves its hidden state by O(1) and the tokens after it apart. On the dense test's 12 prompts
    that happens within the first 10 generated tokens of one to three of them, whether kernforge
    runs only the MoE layers or only the dense ones (vLLM's own MoE), while every other step stays
    within a few hundredths of a nat. So the first generated token (after the prefill, where both
    runs saw the same tokens) is compared, against a float32 run, as for the int8 checkpoint."""
    prompts = _prompts(MOE_PROMPT_LENGTHS, seed=4)
    stock = generate(moe_model_dir, tmp_path, plugin=False, prompts=prompts, **CHUNKED)
    reference = generate(moe_model_dir, tmp_path, plugin=False, prompts=prompts, dtype="float32", **CHUNKED)
    run = generate(moe_model_dir, tmp_path, plugin=True, prompts=prompts, enforce_eager=False, **CHUNKED)
    assert "unquantized MoE experts (bf16, SiLU), MoE routing (softmax top-k" in run["log"]
    assert "Using KernforgeCPUUnquantizedExperts MoE backend" in run["log"]  # vLLM's oracle chose it, per layer
    assert "KernforgeCPUUnquantizedExperts" not in stock["log"] and "runs vLLM's" not in stock["log"]
    ours, theirs = _first_token_error(run, reference), _first_token_error(stock, reference)
    between = _first_token_error(run, stock)
    same = sum(a == b for o, s in zip(run["outputs"], stock["outputs"]) for a, b in zip(o["ids"], s["ids"]))
    print(
        f"first-token logprob error against float32: kernforge {ours:.4f}, vLLM bf16 {theirs:.4f}; between "
        f"them {between:.4f}; {same} of {len(prompts) * NEW_TOKENS} generated tokens as stock's"
    )
    assert ours <= theirs * 1.1 + 0.01
    assert between <= theirs + 0.01


MLA_PROMPT_LENGTHS = [5, 7, 64, 200, 513, 33, 300, 9, 130, 41]


def _same_context_errors(run: dict, reference: dict) -> tuple[list[float], float]:
    """|logprob difference| of the reference's token at every step where the run saw the reference's
    tokens so far (the prefill's first token, then decode steps up to the first different pick),
    and the share of generated tokens that covers."""
    errors, total = [], 0
    for ours, theirs in zip(run["outputs"], reference["outputs"]):
        total += len(theirs["ids"])
        for step, (mine, expected) in enumerate(zip(ours["ids"], theirs["ids"])):
            logprobs = ours["logprobs"][step]
            if str(expected) in logprobs:
                errors.append(abs(logprobs[str(expected)] - theirs["logprobs"][step][str(expected)]))
            if mine != expected:
                break
    return errors, len(errors) / total


def test_mla_model(mla_model_dir, tmp_path):
    """A DeepSeek-V2 (multi-head latent attention): vLLM's CPU platform picks CPU_MLA, which the
    plugin's ``mla`` part makes kernforge's (the absorbed decode on kernforge's MLA kernel, the
    prefill on its ragged prefill), in every process; against vLLM's own MLA, the logprob of the
    reference's token at the first generated token and at every later step that saw its tokens so
    far is within bf16 rounding. Both runs have the ``layers`` part and only the second ``mla``:
    the comparison measures the attention. The reference is not stock vLLM: run eagerly, its CPU
    RoPE kernel mis-rotates this model's q_pe / k_pe (test_vllm_plugin's
    test_vllms_cpu_rope_kernel_mis_rotates_the_mla_layout): ~0.5 nats from transformers, and two
    identical stock runs were seen 0.03 nats apart, so no run compares well with it. Greedy
    tokens are not required to match to the end, as for the MoE model: a near-tie in the router's
    top-k moves two bf16 runs apart, so a prompt's comparison stops at its first different pick."""
    prompts = _prompts(MLA_PROMPT_LENGTHS, seed=5)
    stock = generate(mla_model_dir, tmp_path, plugin="layers", prompts=prompts, **CHUNKED)
    run = generate(mla_model_dir, tmp_path, plugin="layers,mla", prompts=prompts, **CHUNKED)
    assert "MLA attention (CPU_MLA decode, CPU MLA prefill)" in run["log"]
    assert "Using CPU_MLA backend" in run["log"] and "Using CPU_MLA backend" in stock["log"]
    assert "Using KERNFORGE_CPU_MLA MLA prefill backend" in run["log"]
    assert "Using CPU_SDPA_MLA MLA prefill backend" in stock["log"] and "MLA attention (" not in stock["log"]
    errors, covered = _same_context_errors(run, stock)
    first = _first_token_error(run, stock)
    print(
        f"logprob error against vLLM's MLA: first token {first:.4f}; every step with its context "
        f"({len(errors)} steps, {covered:.0%} of the tokens) mean {sum(errors) / len(errors):.4f}, "
        f"max {max(errors):.4f}"
    )
    assert first <= BF16_LOGIT_ULP
    assert sum(errors) / len(errors) <= BF16_LOGIT_ULP and max(errors) <= 4 * LOGPROB_ATOL
    assert len(errors) >= 2 * len(prompts)  # decode steps compared, not only first tokens


def _transformers_first_tokens(model_dir, prompts) -> dict:
    """transformers' float32 model's first generated token per prompt (its top logprobs), in
    vllm_generate's format: a reference that runs none of vLLM's kernels."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            top = model(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1).topk(3)
            steps = [{str(i): lp for i, lp in zip(top.indices.tolist(), top.values.tolist())}]
            outputs.append({"ids": top.indices[:1].tolist(), "logprobs": steps})
    return {"outputs": outputs}


def test_mla_model_layers_and_moe_against_transformers(mla_model_dir, tmp_path):
    """The ``layers`` and ``moe`` parts on the DeepSeek-V2 (RMSNorm on the strided latent, RoPE on
    the strided, interleaved q_pe / k_pe, the dense MLP and shared expert's SiluAndMul, the routed
    experts and DeepSeek's grouped routing) give transformers' float32 first tokens, within bf16
    rounding. The reference is transformers, not stock vLLM: run eagerly (``vllm_generate``'s
    default), stock vLLM 0.32 rotates DeepSeek's q_pe / k_pe with its CPU ``rotary_embedding``
    kernel, which mis-rotates that layout (test_vllm_plugin's
    test_vllms_cpu_rope_kernel_mis_rotates_the_mla_layout): its first tokens are ~0.5 nats from
    transformers' and none of 8 the same, so any correct implementation looks wrong next to it."""
    prompts = _prompts(MLA_PROMPT_LENGTHS, seed=5)
    run = generate(mla_model_dir, tmp_path, plugin="layers,moe", prompts=prompts, new=2, **CHUNKED)
    assert "unquantized MoE experts (bf16, SiLU)" in run["log"] and "RotaryEmbedding" in run["log"]
    reference = _transformers_first_tokens(mla_model_dir, prompts)
    first = _first_token_error(run, reference)
    same = sum(ours["ids"][0] == theirs["ids"][0] for ours, theirs in zip(run["outputs"], reference["outputs"]))
    print(f"first-token logprob error against transformers (fp32): {first:.4f}; {same}/{len(prompts)} same tokens")
    assert first <= BF16_LOGIT_ULP  # 0.04 here; stock vLLM, eager: 0.55
    assert same >= len(prompts) - 1  # a near-tie may still go the other way
