"""Greedy generation through ``vllm.LLM`` in a process of its own (vLLM's engine state and plugins
are per process): ``python vllm_generate.py SPEC.json OUT.json``.

SPEC: ``model`` (a model directory), ``prompts`` (lists of token ids), ``new`` (tokens per
prompt), ``plugin`` (bool: kernforge's vLLM plugin on, every part; or a list of parts as
``KERNFORGE_VLLM`` takes it), ``engine`` (extra ``LLM`` arguments). OUT:
per prompt, the generated ids and, per step, the top logprobs as {id: logprob}; the scheduler's
preemptions.
"""

import json
import os
import sys


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    plugin = spec["plugin"]  # a bool (every part or none) or KERNFORGE_VLLM's list of parts
    os.environ["KERNFORGE_VLLM"] = plugin if isinstance(plugin, str) else "1" if plugin else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a share of RAM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = dict(
        model=spec["model"],
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=2048,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
    )
    engine.update(spec.get("engine", {}))
    llm = LLM(**engine)
    params = SamplingParams(
        temperature=0,
        max_tokens=spec["new"],
        min_tokens=spec["new"],
        ignore_eos=True,
        detokenize=False,
        logprobs=spec.get("logprobs", 3),
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]], params, use_tqdm=False)
    result = []
    for output in outputs:
        completion = output.outputs[0]
        steps = [{str(i): lp.logprob for i, lp in step.items()} for step in completion.logprobs]
        result.append({"ids": list(completion.token_ids), "logprobs": steps})
    with open(out_path, "w") as f:
        stats = not engine.get("disable_log_stats", True)  # LLM's default: no stats, no metrics
        json.dump({"outputs": result, "preemptions": _preemptions(llm) if stats else None}, f)


def _preemptions(llm) -> int:
    """Requests the scheduler preempted, from the engine's metrics (an engine with stats on)."""
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


if __name__ == "__main__":
    main(*sys.argv[1:])
