"""The examples run as documented: they are the user's first contact with the
module interface (declare, template, call), and nothing else compiles them."""

import subprocess
import sys

import pytest

import kernforge

from conftest import EXAMPLES_DIR as EXAMPLES


@pytest.mark.slow  # a child process: imports torch, compiles the example on every tier
def test_custom_variant_example_runs_on_every_tier(kernforge_cache_dir):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "custom_variant.py")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for tier in kernforge.jit.runnable_tiers():
        assert f"relu2_and_mul on tier {tier}: matches torch" in result.stdout


@pytest.mark.slow  # a child process: imports torch, compiles RoPE, append and decode
def test_decode_step_example_matches_torch(kernforge_cache_dir):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "decode_step.py")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("max |error| vs torch") == 4


@pytest.mark.slow  # a child process building a DeepSeek-V2-Lite-wide model (2 layers, 16 experts)
def test_deepseek_example_runs(kernforge_cache_dir):
    flags = ["--layers", "2", "--experts", "16", "--prompt-len", "32", "--new-tokens", "4"]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "deepseek_generate.py"), *flags], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "decode tokens/s" in result.stdout and "sequence 0: " in result.stdout


@pytest.mark.slow  # two ranks under torchrun, each building a Llama-3.2-1B-wide model (one layer)
def test_tensor_parallel_example_runs_under_torchrun(kernforge_cache_dir):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    flags = ["--layers", "1", "--prompt-len", "16", "--new-tokens", "4"]
    result = subprocess.run(
        [*launcher, str(EXAMPLES / "tp_generate.py"), *flags], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "tensor parallel over 2 ranks, collectives through shared memory" in result.stdout
    assert "rank 1: " in result.stdout and "tokens: [" in result.stdout
