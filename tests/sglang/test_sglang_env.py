"""The SGLang environment (.venv-sglang, `make sglang`): the pinned SGLang on torch's CPU build imports,
and SGLang's own CPU path runs a batch (the baseline issue 42 compares kernforge against)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BASELINE_STUBS = Path(__file__).resolve().parent / "stubs" / "baseline"


def _pin(name: str) -> str:
    for line in (REPO / "constraints-sglang.txt").read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==", 1)[1]
    raise AssertionError(f"{name} is not pinned in constraints-sglang.txt")


def _python(
    code: str, *, cpu_engine: bool, baseline: bool = False, timeout: float = 300, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "PYTHONPATH")}
    if cpu_engine:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    if baseline:
        env["PYTHONPATH"] = str(BASELINE_STUBS)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def test_versions_are_the_pinned_cpu_builds():
    import sglang

    assert sglang.__version__ == _pin("sglang")
    assert torch.__version__.split("+")[0] == _pin("torch")
    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"


def test_no_cuda_packages_installed():
    from importlib.metadata import distributions

    names = sorted({d.metadata["Name"].lower() for d in distributions()})
    unwanted = [n for n in names if n.startswith(("nvidia-", "cuda-", "flashinfer", "sglang-kernel", "sgl-kernel"))]
    assert not unwanted, f"CUDA packages in the SGLang environment: {unwanted}"


def test_engine_imports_with_the_torchvision_stand_in():
    result = _python(
        "import torchvision; from sglang.srt.entrypoints.engine import Engine; print(torchvision.__version__)",
        cpu_engine=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-1] == "0.0.0+standin", "torchvision is not the stand-in (tests/sglang/README.md)"


def test_sgl_kernel_is_kernforges_shim():
    # SGLang's CPU path imports sgl_kernel at module level (sglang/srt/mem_cache/allocation.py:
    # assign_req_to_token_pool_cpu); in this environment that name is kernforge's (integrations/sgl_kernel_shim)
    code = "import sglang.srt.mem_cache.allocation, sgl_kernel; print(sgl_kernel.__version__)"
    result = _python(code, cpu_engine=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-1] == "0.0.0+kernforge"


@pytest.mark.slow
def test_one_batch_baseline_runs_on_cpu(sglang_model_dir, tmp_path):
    # SGLang's own CPU path as issue 42 measures it: torch_native attention, dummy weights, the
    # baseline sgl_kernel stand-in (torch only, no torch.ops.sgl_kernel op, so no AMX path).
    args = [
        "--model-path", str(sglang_model_dir), "--device", "cpu", "--attention-backend", "torch_native",
        "--load-format", "dummy", "--max-total-tokens", "4096",
        "--batch-size", "1", "--input-len", "64", "--output-len", "8",
    ]  # fmt: skip
    code = (
        f"import runpy, sys; sys.argv = ['one_batch', *{args!r}]; "
        "runpy.run_module('sglang.benchmark.one_batch', run_name='__main__')"
    )
    result = _python(code, cpu_engine=True, baseline=True, timeout=600, cwd=tmp_path)  # it writes result.jsonl
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    benchmark = output.split("Benchmark ...", 1)[-1]
    assert "Benchmark ..." in output and "Decode.  median latency" in benchmark, output[-6000:]
    assert "Total. latency" in benchmark, output[-6000:]
