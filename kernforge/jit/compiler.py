"""Find the C++ compiler and run it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

# Explicit per-tier -m flags come from isa.Tier; never -march=native, so an
# artifact's instructions are exactly what its key says.
BASE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fopenmp",  # binds to the libgomp torch already loaded: one thread pool
    "-fvisibility=hidden",
    "-fno-semantic-interposition",
    "-Wall",
    "-Wno-unused-function",
)


class CompilerNotFoundError(RuntimeError):
    """No usable C++ compiler."""


class KernelCompileError(RuntimeError):
    """The compiler rejected a rendered kernel."""

    def __init__(self, key: str, command: list[str], output: str, source: Path):
        self.key, self.command, self.output, self.source = key, command, output, source
        tail = "\n".join(output.strip().splitlines()[-40:])
        super().__init__(
            f"kernforge: compiling {key} failed\n"
            f"command: {shlex.join(command)}\n"
            f"rendered source: {source}\n"
            f"compiler output:\n{tail}"
        )


def compiler_argv() -> list[str]:
    """``KERNFORGE_CXX``, else ``CXX``, else ``g++``; a value with arguments
    (``CXX="ccache g++"``) is split like a shell would."""
    for var in ("KERNFORGE_CXX", "CXX"):
        value = os.environ.get(var, "").strip()
        if value:
            return _resolve(shlex.split(value), f"{var}={value!r}")
    return _resolve(["g++"], "g++ on PATH (set KERNFORGE_CXX or CXX to choose another)")


def _resolve(argv: list[str], looked_for: str) -> list[str]:
    found = shutil.which(argv[0])
    if found is None:
        raise CompilerNotFoundError(
            f"kernforge needs a C++ compiler to build kernels and found none: looked for {looked_for}. "
            "Install g++ (e.g. `apt-get install g++`), or pre-build the kernels with "
            "`python -m kernforge prewarm` on a machine that has one."
        )
    return [found, *argv[1:]]


@lru_cache(maxsize=8)
def compiler_version(argv: tuple[str, ...]) -> str:
    """The compiler's ``--version`` banner: part of every key, so a toolchain
    upgrade rebuilds instead of loading objects from the old one."""
    try:
        result = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise CompilerNotFoundError(f"cannot run the C++ compiler {shlex.join(argv)}: {exc}") from exc
    if result.returncode != 0:
        raise CompilerNotFoundError(
            f"`{shlex.join([*argv, '--version'])}` failed with exit code {result.returncode}: {result.stderr.strip()}"
        )
    return result.stdout.strip()


def build_command(
    argv: list[str], tier_flags: tuple[str, ...], include_dirs: list[Path], source: str, output: str
) -> list[str]:
    includes = [f"-I{d}" for d in include_dirs]
    return [*argv, *BASE_FLAGS, *tier_flags, *includes, source, "-o", output]


def run(command: list[str], key: str, source: Path, log: Path) -> float:
    """Run one compile; returns seconds taken, raises KernelCompileError."""
    import time

    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        raise CompilerNotFoundError(f"cannot run the C++ compiler {command[0]}: {exc}") from exc
    seconds = time.perf_counter() - start
    output = result.stdout + result.stderr
    log.write_text(f"$ {shlex.join(command)}\n{output}exit code {result.returncode}, {seconds:.2f} s\n")
    if result.returncode != 0:
        raise KernelCompileError(key, command, output, source)
    return seconds
