"""Every benchmark routine's quick run, through the driver, so none of them rots: each must exit 0
and append at least one valid JSON line record (kernforge.bench.records) for its routine.

The vllm routine needs vLLM, which is only in .venv-vllm (`make vllm`): its quick run is checked in
tests/vllm, which runs there (`make test-vllm`)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kernforge.bench import records

from conftest import REPO_ROOT

DRIVER = REPO_ROOT / "benchmarks" / "run.py"
# benchmarks/run.py's routines (test_the_list_here_is_the_drivers keeps the two equal), vllm aside.
ROUTINES = (
    *("gemm", "decode", "prefill", "mla", "moe", "page", "ops", "sampling"),
    *("jit", "comm", "e2e", "llamacpp", "gguf", "quality", "gguf_quality"),
)
IN_TESTS_VLLM = pytest.mark.skip(
    reason="needs vLLM (only in .venv-vllm): the vllm routine's quick run is checked in tests/vllm (make test-vllm)"
)
# One routine's quick run on 2 busy cores takes seconds to a minute; past this it is hung.
TIMEOUT_S = 600


def test_the_list_here_is_the_drivers():
    listed = subprocess.run([sys.executable, str(DRIVER), "list"], capture_output=True, text=True, check=True).stdout
    assert {line.split()[0] for line in listed.splitlines()} == {*ROUTINES, "vllm"}


@pytest.mark.slow
@pytest.mark.parametrize("routine", [*ROUTINES, pytest.param("vllm", marks=IN_TESTS_VLLM)])
def test_quick_run_records(routine, tmp_path):
    out = tmp_path / "records.jsonl"
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(DRIVER), routine, "--quick", "--jsonl", str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,  # a routine must not depend on the directory it is started from
    )
    took = time.monotonic() - t0
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"{routine} --quick failed (exit {done.returncode}, {took:.0f} s):\n{tail}"
    assert out.is_file(), f"{routine} --quick wrote no records ({took:.0f} s):\n{tail}"
    found = records.read_jsonl(out)  # every line valid JSON with the schema
    assert found, f"{routine} --quick wrote no records ({took:.0f} s)"
    assert {r["routine"] for r in found} == {routine}
    assert all(r["quick"] is True for r in found)
