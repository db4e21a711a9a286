"""SGLang's offline engine on kernforge (``--attention-backend intel_amx`` through kernforge's sgl_kernel) gives
the greedy tokens of SGLang's own torch-native path (``KERNFORGE_SGLANG=0``, ``torch_native`` attention) on a
tiny random Llama: uneven requests at once, prompts prefilled in chunks of 32 tokens, and a request whose
48-token prefix SGLang's radix cache serves. Near-ties are reported, not failed (tests/greedy.py). Each engine
runs in a process of its own (``sglang_generate.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from greedy import MIN_COMPARED, compare_greedy

GENERATE = Path(__file__).with_name("sglang_generate.py")
PREFIX_HIT = 48  # the last request's prefix, cached by the first request

pytestmark = pytest.mark.slow


def generate(model_dir: Path, tmp_path: Path, kernforge: bool) -> dict:
    out_path = tmp_path / f"{'kernforge' if kernforge else 'native'}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KERNFORGE_SGLANG")}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if not kernforge:
        env["KERNFORGE_SGLANG"] = "0"  # the shim registers nothing: SGLang's torch-native layers
    backend = "intel_amx" if kernforge else "torch_native"
    run = subprocess.run(
        [sys.executable, str(GENERATE), str(model_dir), backend, str(out_path)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"SGLang run failed:\n{log[-6000:]}"
    assert "fallback to torch_native" not in log, log[-6000:]
    return json.loads(out_path.read_text())


def test_greedy_tokens_match_sglang_native(sglang_model_dir, tmp_path):
    native = generate(sglang_model_dir, tmp_path, kernforge=False)
    ours = generate(sglang_model_dir, tmp_path, kernforge=True)
    for run in (native, ours):
        assert run["outputs"][-1]["cached_tokens"] >= PREFIX_HIT, "the radix cache did not serve the shared prefix"
    near_ties, compared = compare_greedy(native, ours)
    print(f"compared {compared:.0%} of the tokens; near-ties:", near_ties or "none")
    assert compared >= MIN_COMPARED, near_ties
