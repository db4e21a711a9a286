"""Greedy generation through SGLang's offline Engine, written as JSON: run by test_sglang_engine.py in a
process of its own (the engine spawns its scheduler; the environment decides whether kernforge serves it).

    python sglang_generate.py MODEL_DIR ATTENTION_BACKEND OUT.json

Requests of uneven lengths at once (a 1-token prompt, prompts longer than the prefill chunk), then one
that shares a 48-token prefix with the first: SGLang's radix cache serves that prefix (its
``cached_tokens`` are recorded)."""

import json
import random
import sys

PREFILL_CHUNK = 32
NEW_TOKENS = 12
TOP = 5


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    ids = [[rng.randrange(3, 10000) for _ in range(n)] for n in (70, 1, 9, 45)]
    return [*ids, ids[0][:48] + [rng.randrange(3, 10000) for _ in range(5)]]


def main(model_dir: str, attention_backend: str, out_path: str) -> None:
    import sglang

    engine = sglang.Engine(
        model_path=model_dir,
        device="cpu",
        attention_backend=attention_backend,
        chunked_prefill_size=PREFILL_CHUNK,
        max_total_tokens=4096,
        skip_tokenizer_init=True,
        random_seed=0,
        log_level="error",
    )
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    options = {"sampling_params": greedy, "return_logprob": True, "top_logprobs_num": TOP}
    requests = prompts()
    try:
        outputs = engine.generate(input_ids=requests[:-1], **options)  # at once, uneven
        outputs += engine.generate(input_ids=requests[-1:], **options)  # the radix cache's prefix hit
    finally:
        engine.shutdown()
    results = {
        "outputs": [
            {
                "ids": out["output_ids"],
                # per generated token: {token id: logprob} of its top candidates (tests/greedy.py's format)
                "logprobs": [{str(t[1]): t[0] for t in step} for step in out["meta_info"]["output_top_logprobs"]],
                "cached_tokens": out["meta_info"].get("cached_tokens", 0),
            }
            for out in outputs
        ]
    }
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
