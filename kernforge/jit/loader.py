"""Load a compiled variant through cffi.

Two modes, both fed by the module declaration's ``cdef``:

* ``api`` (default): cffi generates a CPython extension around the kernel,
  compiled together with it. Calls convert arguments in C: the lowest
  per-call overhead (see docs/notes/2026-11-21-zen5-ops-sampling-jit.md#cffi-mode).
* ``abi``: the kernel is a plain shared library opened with ``ffi.dlopen``;
  no Python headers needed, but each call goes through libffi.

``KERNFORGE_CFFI_MODE`` picks one; ``api`` falls back to ``abi`` when the
Python headers are missing.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

import cffi
import cffi.recompiler

MODES = ("api", "abi")


@lru_cache(maxsize=1)
def python_include() -> Path | None:
    include = Path(sysconfig.get_paths()["include"])
    return include if (include / "Python.h").is_file() else None


def python_abi(mode: str) -> str:
    """The interpreter ABI an API-mode extension is built for ('' in ABI mode)."""
    return (sysconfig.get_config_var("SOABI") or sys.version) if mode == "api" else ""


def cffi_mode() -> str:
    mode = os.environ.get("KERNFORGE_CFFI_MODE", "").strip().lower() or "api"
    if mode not in MODES:
        raise ValueError(f"KERNFORGE_CFFI_MODE must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "api" and python_include() is None:
        return "abi"
    return mode


def write_api_wrapper(module_name: str, cdef: str, kernel_source: str, path: Path) -> None:
    """Emit the extension source: the kernel followed by cffi's wrapper."""
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    cffi.recompiler.make_c_source(ffi, module_name, kernel_source, str(path), verbose=False)


def load(mode: str, so_path: Path, module_name: str, cdef: str, symbols: dict[str, str]):
    """Open the artifact: (its ffi, {entry name: function}). Raises
    OSError/ImportError/AttributeError if it is unusable."""
    if mode == "abi":
        ffi = cffi.FFI()
        ffi.cdef(cdef)
        lib = ffi.dlopen(str(so_path))
        _keepalive.append((ffi, lib))
    else:
        loader = importlib.machinery.ExtensionFileLoader(module_name, str(so_path))
        spec = importlib.util.spec_from_file_location(module_name, so_path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        _keepalive.append(module)
        ffi, lib = module.ffi, module.lib
    return ffi, {entry: getattr(lib, symbol) for entry, symbol in symbols.items()}


# Loaded libraries must outlive every function pointer taken from them.
_keepalive: list = []


def new_buffer(ctype: str):
    """A small C buffer (e.g. for out-parameters) and its address as an int."""
    buf = _ffi.new(ctype)
    return buf, int(_ffi.cast("intptr_t", buf))


_ffi = cffi.FFI()
