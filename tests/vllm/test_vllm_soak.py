"""benchmarks/soak_vllm.py's smoke: a minute of concurrent streaming clients against vLLM's server
with kernforge's plugin, with disconnects, prompts past the context and bad sampling parameters;
every request answered or refused with HTTP 400, greedy texts equal to the same requests sent alone
(or leaving them at a near tie),
a clean log. (RSS flatness needs the long run: `benchmarks/RESULTS.md`.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_vllm.py"


def test_a_minute_of_load_and_faults(tmp_path):
    report_path = tmp_path / "soak.json"
    command = [sys.executable, str(SOAK), "--minutes", "1", "--clients", "4"]
    result = subprocess.run(
        [*command, "--replay", "10", "--json", str(report_path)], capture_output=True, text=True, timeout=1500
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    kinds = {outcome.split(":")[0] for outcome in report["outcomes"]}
    assert kinds == {"greedy", "sampled", "disconnect", "too long", "bad params"}, report["outcomes"]
    assert report["failures"] == [] and report["log_problems"] == []
    assert all(d["gap"] is not None and d["gap"] <= 0.1 for d in report["differing_alone"]), report["differing_alone"]
    assert report["replayed_alone"] == 10 and report["generated_tokens"] > 0
