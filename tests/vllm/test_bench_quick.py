"""``benchmarks/bench_vllm.py --quick`` through the benchmark driver (issue 39: every routine's
``--quick`` runs in CI, so that none rots): vLLM's throughput benchmark on the tiny random Llama
(eager, 4 short requests), stock and with kernforge's plugin, exits 0 and appends valid records of
both engines.

The main environment has no vLLM: there the driver's own test skips this routine; this one runs in
vLLM's environment (``make test-vllm``)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernforge.bench.records import read_jsonl

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_bench_vllm_quick_emits_records_of_both_engines(tmp_path):
    jsonl = tmp_path / "vllm.jsonl"
    command = [sys.executable, str(REPO / "benchmarks" / "run.py"), "vllm", "--quick", "--jsonl", str(jsonl)]
    run = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    records = read_jsonl(jsonl)  # raises on a line that does not follow the record format
    assert records and {r["routine"] for r in records} == {"vllm"}
    assert all(r["quick"] for r in records)
    for impl in ("vllm", "vllm+kernforge"):
        mine = [r for r in records if r["impl"] == impl]
        assert {r["metric"] for r in mine} >= {"seconds", "tok_s"}, f"{impl}: {mine}"
        for r in mine:
            assert isinstance(r["value"], float) and math.isfinite(r["value"]) and r["value"] > 0, r
            assert r["bound"] and r["bound"]["value"] > 0, r
            assert r["params"]["model"] == "tiny" and r["params"]["layers"] == 2, r
    assert len(records) == 4 and len({r["case"] for r in records}) == 1, (
        records
    )  # the fixed batch: 2 engines x 2 metrics
