"""Find the C++ compiler and run it."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
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


# Build modes (docs/cache-and-prewarm.md#build-modes). Each adds its flags to the compile command,
# so it is part of every key; the key's readable prefix ends with the mode's tag as well. Debug and
# sanitized builds compile at -O0 -g in place of -O3: the sanitizers then check every load and
# store as written, and the instrumented compile is several times faster than at -O3 or -O1 (a
# generic-tier decode variant: 1.6 s, 13 s at -O1, 55 s at -O3), which outweighs the slower runs
# in a test slice (KERNFORGE_EXTRA_CFLAGS=-O1 for long runs: it comes last and wins).
DEBUG_FLAGS = ("-D_GLIBCXX_ASSERTIONS", "-DKF_DEBUG=1")
SANITIZERS = ("address", "undefined")
# Frame pointers for whole stacks in reports; a UBSan report aborts like an ASan one (no silent
# recovery), so a run with reports can never pass.
SANITIZE_FLAGS = ("-fno-omit-frame-pointer", "-fno-sanitize-recover=all")
_SANITIZER_TAGS = {"address": "asan", "undefined": "ubsan"}


class BuildModeError(ValueError):
    """A build-mode variable (KERNFORGE_JIT_DEBUG, KERNFORGE_SANITIZE, KERNFORGE_EXTRA_CFLAGS) is
    invalid, or a sanitized kernel cannot be loaded into this process."""


@dataclass(frozen=True)
class BuildMode:
    """How kernels are compiled: ``KERNFORGE_JIT_DEBUG``, ``KERNFORGE_SANITIZE``, ``KERNFORGE_EXTRA_CFLAGS``."""

    debug: bool = False
    sanitize: tuple[str, ...] = ()  # a subset of SANITIZERS, in that order
    extra: tuple[str, ...] = ()

    def flags(self) -> tuple[str, ...]:
        """The compile flags in place of BASE_FLAGS; the extra flags are not among them: they go
        after the tier's, last, so they can override any (``KERNFORGE_EXTRA_CFLAGS=-O1``)."""
        if not (self.debug or self.sanitize):
            return BASE_FLAGS
        flags = tuple(f for f in BASE_FLAGS if not f.startswith("-O")) + ("-O0", "-g")
        if self.debug:
            flags += DEBUG_FLAGS
        if self.sanitize:
            flags += (f"-fsanitize={','.join(self.sanitize)}",) + SANITIZE_FLAGS
        return flags

    @property
    def tag(self) -> str:
        """Appended to the key's readable prefix: '' for the default build, else e.g.
        ``_debug``, ``_asan-ubsan``, ``_cflags-1a2b3c4d``."""
        parts = ["debug"] if self.debug else []
        if self.sanitize:
            parts.append("-".join(_SANITIZER_TAGS[s] for s in self.sanitize))
        if self.extra:
            parts.append("cflags-" + hashlib.sha256(shlex.join(self.extra).encode()).hexdigest()[:8])
        return "".join(f"_{p}" for p in parts)

    def describe(self) -> str:
        return self.tag.lstrip("_").replace("_", "+") or "release"


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def build_mode(env: Mapping[str, str] | None = None) -> BuildMode:
    """The build mode the environment (default: this process's) asks for; read on every plan."""
    env = os.environ if env is None else env
    debug_value = env.get("KERNFORGE_JIT_DEBUG", "").strip().lower()
    if debug_value not in _TRUE + _FALSE:
        raise BuildModeError(
            f"KERNFORGE_JIT_DEBUG must be one of {', '.join(_TRUE + _FALSE[1:])} (or unset), not {debug_value!r}"
        )
    sanitize_value = env.get("KERNFORGE_SANITIZE", "").strip()
    names = {n.strip().lower() for n in sanitize_value.split(",") if n.strip()}
    unknown = sorted(names - set(SANITIZERS))
    if unknown:
        raise BuildModeError(
            f"KERNFORGE_SANITIZE={sanitize_value!r}: unknown sanitizer {unknown[0]!r}; "
            f"allowed: a comma-separated subset of {', '.join(SANITIZERS)} (e.g. address,undefined)"
        )
    try:
        extra = tuple(shlex.split(env.get("KERNFORGE_EXTRA_CFLAGS", "")))
    except ValueError as exc:
        raise BuildModeError(f"KERNFORGE_EXTRA_CFLAGS cannot be split like a shell would: {exc}") from exc
    return BuildMode(debug_value in _TRUE, tuple(s for s in SANITIZERS if s in names), extra)


def asan_runtime_loaded() -> bool:
    """Whether AddressSanitizer's runtime is in this process's global scope (preloaded): an
    ASan-instrumented library loaded without it makes the runtime end the process."""
    return hasattr(ctypes.CDLL(None), "__asan_init")


def can_load(mode: BuildMode) -> bool:
    """Whether this process can load kernels built in ``mode``."""
    return "address" not in mode.sanitize or asan_runtime_loaded()


def check_runtime(mode: BuildMode) -> None:
    """Raise BuildModeError unless this process can load kernels built in ``mode``."""
    if not can_load(mode):
        raise BuildModeError(
            "KERNFORGE_SANITIZE includes 'address' but this process was not started with the ASan runtime "
            "preloaded, so loading a sanitized kernel would abort it ('ASan runtime does not come first in "
            "initial library list'). Run it through the launcher, e.g. `python -m kernforge.sanitize -m pytest "
            "...`, or set LD_PRELOAD=$(g++ -print-file-name=libasan.so) and ASAN_OPTIONS=detect_leaks=0 "
            "yourself (docs/cache-and-prewarm.md#build-modes)."
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
        result = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60, env=compiler_env())
    except OSError as exc:
        raise CompilerNotFoundError(f"cannot run the C++ compiler {shlex.join(argv)}: {exc}") from exc
    if result.returncode != 0:
        raise CompilerNotFoundError(
            f"`{shlex.join([*argv, '--version'])}` failed with exit code {result.returncode}: {result.stderr.strip()}"
        )
    return result.stdout.strip()


def build_command(
    argv: list[str],
    tier_flags: tuple[str, ...],
    include_dirs: list[Path],
    source: str,
    output: str,
    mode: BuildMode | None = None,
) -> list[str]:
    includes = [f"-I{d}" for d in include_dirs]
    mode = mode or BuildMode()
    return [*argv, *mode.flags(), *tier_flags, *mode.extra, *includes, source, "-o", output]


def compiler_env() -> dict[str, str]:
    """The compiler's environment: this one without a preloaded sanitizer runtime (a process
    started by ``python -m kernforge.sanitize`` would otherwise run the compiler under ASan)."""
    env = dict(os.environ)
    preload = env.pop("LD_PRELOAD", "")
    kept = [lib for lib in preload.replace(":", " ").split() if "libasan" not in lib and "libubsan" not in lib]
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    return env


def run(command: list[str], key: str, source: Path, log: Path) -> float:
    """Run one compile; returns seconds taken, raises KernelCompileError."""
    import time

    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=compiler_env())
    except OSError as exc:
        raise CompilerNotFoundError(f"cannot run the C++ compiler {command[0]}: {exc}") from exc
    seconds = time.perf_counter() - start
    output = result.stdout + result.stderr
    log.write_text(f"$ {shlex.join(command)}\n{output}exit code {result.returncode}, {seconds:.2f} s\n")
    if result.returncode != 0:
        raise KernelCompileError(key, command, output, source)
    return seconds
