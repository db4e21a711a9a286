"""A server in a child process, yielded once its ``/health`` answers (the vLLM and SGLang tests,
benchmarks and soak runs)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def served(command: list[str], port: int, env: dict[str, str], log: Path, timeout_s: float, name: str) -> Iterator[str]:
    """Run ``command`` (a server listening on ``port``), output to ``log``; yields its base URL once
    ``/health`` answers (RuntimeError naming ``name`` if it exits or is not ready in ``timeout_s``),
    and stops it after."""
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, process, log, timeout_s, name)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_healthy(port: int, process: subprocess.Popen[bytes], log: Path, timeout_s: float, name: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{name} was not ready after {timeout_s} s:\n{log.read_text()[-5000:]}")
