"""What the child processes of test_fork.py run: importable by name, for the 'spawn' start method."""

from __future__ import annotations

import hashlib
import os
import warnings

import torch

import kernforge

from op_helpers import randn, seeded


def inputs() -> dict[str, torch.Tensor]:
    """The same seeded operands in every process."""
    g = seeded("concurrency-fork")
    return {
        "x": randn((256, 4096), g).to(torch.bfloat16),
        "w": randn((4096,), g).to(torch.bfloat16),
        "a": randn((2048, 2048), g),
        "weight": randn((384, 512), g).to(torch.bfloat16),
    }


def digest(t: torch.Tensor) -> str:
    """The tensor's bytes, hashed: results compared across processes bit for bit."""
    raw = t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().view(torch.int16)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def run_ops(kernel_threads: int = 2) -> dict[str, object]:
    """kernforge's parallel kernels and torch's parallel ops, each on ``kernel_threads`` threads
    (sizes well above the kernels' one-thread cut-offs), as digests and facts about this process."""
    kernforge.set_num_threads(kernel_threads)
    torch.set_num_threads(kernel_threads)
    t = inputs()
    packed = kernforge.convert_weight_packed(t["weight"])
    return {
        "pid": os.getpid(),
        "kernel_threads": kernforge.ops.num_threads(),
        "rmsnorm": digest(kernforge.rmsnorm(t["x"], t["w"])),
        "torch_softmax": digest(torch.softmax(t["a"], dim=-1)),
        "linear": digest(kernforge.weight_packed_linear(t["x"][:64, :512].contiguous(), packed)),
        "rmsnorm_again": digest(kernforge.rmsnorm(t["x"], t["w"])),
    }


def report(conn, kernel_threads: int = 2) -> None:
    """A child's body: run_ops, sent back through ``conn`` (an exception as its text)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run_ops(kernel_threads)
        result["warnings"] = [str(w.message) for w in caught]
        conn.send(result)
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()
