"""Run Python with kernforge's kernels built under AddressSanitizer and UBSan.

    python -m kernforge.sanitize -m pytest -q tests/ops/test_norm.py
    python -m kernforge.sanitize --sanitize undefined my_script.py
    eval "$(python -m kernforge.sanitize --print-env)"   # the same settings in this shell

Everything after the options is passed to this interpreter (``sys.executable``). It sets
``KERNFORGE_SANITIZE`` (default ``address,undefined``; kernels then compile with
``-fsanitize=...`` into keys of their own), and for ``address`` preloads the compiler's ASan
runtime (``LD_PRELOAD``), which must come before every other library: CPython is not built with
ASan, so without it loading a sanitized kernel ends the process. ``ASAN_OPTIONS`` /
``UBSAN_OPTIONS`` get defaults (values already set win): no leak check (CPython and torch keep
memory until exit by design), and every report aborts the process, so pytest's fault handler
prints which test was running and a run with a report cannot pass.
See docs/cache-and-prewarm.md#build-modes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from kernforge.jit import compiler

ASAN_DEFAULTS = "detect_leaks=0:abort_on_error=1:print_summary=1"
UBSAN_DEFAULTS = "print_stacktrace=1:halt_on_error=1:abort_on_error=1"
USAGE = "usage: python -m kernforge.sanitize [--sanitize address,undefined] [--print-env] PYTHON_ARGS..."


def asan_runtime(argv: list[str] | None = None) -> Path:
    """The ASan runtime of the compiler that builds the kernels (``g++ -print-file-name=libasan.so``)."""
    argv = argv or compiler.compiler_argv()
    result = subprocess.run(
        [*argv, "-print-file-name=libasan.so"], capture_output=True, text=True, env=compiler.compiler_env()
    )
    path = Path(result.stdout.strip())
    if result.returncode != 0 or not path.is_absolute() or not path.exists():
        raise compiler.BuildModeError(
            f"KERNFORGE_SANITIZE=address needs the compiler's ASan runtime and `{shlex.join(argv)} "
            f"-print-file-name=libasan.so` found none (got {result.stdout.strip()!r}); install it "
            "(Debian/Ubuntu: the compiler's libasan package, e.g. libasan8) or leave out 'address'"
        )
    return path.resolve()


def cxx_runtime(argv: list[str] | None = None) -> Path | None:
    """The compiler's C++ runtime (``libstdc++.so.6``), preloaded after ASan's: ASan resolves the
    ``__cxa_throw`` it intercepts when it starts, and Python does not link a C++ runtime, so without it
    the first C++ exception (torch's, caught in Python) aborts the process. None where there is none."""
    argv = argv or compiler.compiler_argv()
    result = subprocess.run(
        [*argv, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, env=compiler.compiler_env()
    )
    path = Path(result.stdout.strip())
    return path.resolve() if result.returncode == 0 and path.is_absolute() and path.exists() else None


def _merge(defaults: str, current: str | None) -> str:
    return f"{defaults}:{current}" if current else defaults  # later entries win


def sanitizer_env(sanitize: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the variables a sanitized run needs."""
    env = dict(os.environ if env is None else env)
    env["KERNFORGE_SANITIZE"] = sanitize
    mode = _mode_for(sanitize, env)
    if "address" in mode.sanitize:
        runtimes = [str(path) for path in (asan_runtime(), cxx_runtime()) if path is not None]
        preload = env.get("LD_PRELOAD", "").replace(":", " ").split()
        env["LD_PRELOAD"] = " ".join([*runtimes, *(p for p in preload if p not in runtimes)])
        env["ASAN_OPTIONS"] = _merge(ASAN_DEFAULTS, env.get("ASAN_OPTIONS"))
    if "undefined" in mode.sanitize:
        env["UBSAN_OPTIONS"] = _merge(UBSAN_DEFAULTS, env.get("UBSAN_OPTIONS"))
    return env


def _mode_for(sanitize: str, env: dict[str, str]) -> compiler.BuildMode:
    mode = compiler.build_mode(env)  # validates the value
    if not mode.sanitize:
        raise compiler.BuildModeError(
            f"KERNFORGE_SANITIZE={sanitize!r} names no sanitizer; allowed: a comma-separated subset of "
            f"{', '.join(compiler.SANITIZERS)}"
        )
    return mode


def main(args: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if args is None else args)
    sanitize = os.environ.get("KERNFORGE_SANITIZE", "").strip() or "address,undefined"
    print_env = False
    while args and args[0].startswith("--"):
        option = args.pop(0)
        if option == "--":
            break
        if option == "--print-env":
            print_env = True
        elif option.startswith("--sanitize="):
            sanitize = option.split("=", 1)[1]
        elif option == "--sanitize" and args:
            sanitize = args.pop(0)
        elif option in ("--help", "-h"):
            print(USAGE + "\n\n" + (__doc__ or ""))
            return 0
        else:
            print(f"kernforge.sanitize: unknown option {option!r}\n{USAGE}", file=sys.stderr)
            return 2
    try:
        env = sanitizer_env(sanitize)
    except (ValueError, compiler.CompilerNotFoundError) as exc:
        print(f"kernforge.sanitize: {exc}", file=sys.stderr)
        return 2
    if print_env:
        for name in ("KERNFORGE_SANITIZE", "LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS"):
            if name in env:
                print(f"export {name}={shlex.quote(env[name])}")
        return 0
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    os.execve(sys.executable, [sys.executable, *args], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
