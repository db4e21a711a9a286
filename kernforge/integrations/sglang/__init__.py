"""kernforge under SGLang's CPU path (issue 42): ``torch.ops.sgl_kernel.*`` served by kernforge's ops.

SGLang (0.5.23; the tested range is the ``sglang`` requirement this module checks, see
:data:`TESTED_SGLANG`) runs its CPU layers through ``torch.ops.sgl_kernel.<op>`` and imports the
``sgl_kernel`` package at module level whenever ``SGLANG_USE_CPU_ENGINE=1``, before any SGLang plugin
could load. There is no CPU build of sgl-kernel on PyPI. So the hook is the import name itself:

* :mod:`kernforge.integrations.sglang.ops` defines the ``sgl_kernel`` op namespace with
  ``torch.library`` (SGLang 0.5.23's schemas, a CPU implementation calling kernforge's public op of the
  same math, a Meta implementation for SGLang's ``torch.compile`` path) and the Python-level names SGLang
  imports from ``sgl_kernel``. Adapters only: shapes and calling conventions are converted, the math is
  kernforge's kernels. An op kernforge lacks is not registered (SGLang then keeps its own torch path
  where it probes with ``hasattr``) or, for the Python-level names SGLang imports at module level, raises
  ``NotImplementedError`` naming it when called.
* ``integrations/sgl_kernel_shim`` in the repository is a separate tiny distribution,
  ``kernforge-sgl-kernel``, whose package ``sgl_kernel`` imports this one (``pip install
  ./integrations/sgl_kernel_shim``; ``pip uninstall kernforge-sgl-kernel`` takes it out again). It cannot be
  a dependency of ``kernforge[sglang]``: a path dependency is refused on PyPI.
* The AMX gate: SGLang takes its ``sgl_kernel`` layers only where ``cpu_has_amx_support()`` is True, which
  is ``torch.cpu._is_amx_tile_supported()`` (read once, into ``sglang.srt.utils.common.is_amx_tile_supported``)
  and ``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``. kernforge's kernels run on every tier
  (AMX, AVX-512, AVX2), so :func:`open_amx_gate` sets SGLang's own flag (never torch's detection), clears
  the ``lru_cache`` of the second probe, and sets the flag in the SGLang modules already imported that froze
  ``cpu_has_amx_support()`` at import (``_is_cpu_amx_available`` and its three other spellings). With the
  gate True, ``--attention-backend intel_amx`` also stays selected (SGLang's fallback to ``torch_native``
  reads the same probe).
* ``KERNFORGE_SGLANG=0``: the shim registers nothing and opens no gate; SGLang then sees an ``sgl_kernel``
  with only the Python-level names (as ``tests/sglang/stubs/baseline``), and runs its torch-native layers.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence

ENABLE_VARIABLE = "KERNFORGE_SGLANG"
# The SGLang releases the schemas and the gate were checked against (`make sglang`). Not a requirement of
# the `sglang` extra: SGLang is installed beside it with --no-deps (pyproject.toml says why).
TESTED_SGLANG = "sglang>=0.5.23,<0.5.24"
# The SGLang module-level names that freeze cpu_has_amx_support() at import (0.5.23).
FROZEN_GATE_NAMES = ("_is_cpu_amx_available", "_is_amx_available", "_cpu_has_amx_support")
COMMON = "sglang.srt.utils.common"
_warned: list[str] = []
OPENED: list[str] = []  # what open_amx_gate set (SGLang's flag, then each module's frozen copy)


def enabled() -> bool:
    """False where ``KERNFORGE_SGLANG=0`` (or ``false``/``off``): the shim registers nothing."""
    return os.environ.get(ENABLE_VARIABLE, "1").strip().lower() not in ("0", "false", "off", "no")


def check_sglang_version() -> str | None:
    """Warn once (a UserWarning) for an SGLang release outside the tested range; the message or None."""
    import importlib.metadata
    import warnings

    from packaging.requirements import Requirement

    from kernforge.integrations import _versions

    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None
    if _warned:
        return _warned[0]
    message = _versions.check_version("sglang", version, Requirement(TESTED_SGLANG))
    if message is not None:
        # the extra cannot name the range pip would install (SGLang's wheel pins a CUDA torch)
        message = message.replace(
            "install a tested release: pip install 'kernforge[sglang]'",
            (f"install a tested release: pip install --no-deps '{TESTED_SGLANG}'"),
        )
        warnings.warn(message, UserWarning, stacklevel=3)
        _warned.append(message)
    return message


def open_amx_gate() -> list[str]:
    """Make SGLang's ``cpu_has_amx_support()`` True where kernforge serves the ops: now, if
    ``sglang.srt.utils.common`` is imported, else right after it is. Returns the modules whose frozen
    flag was set (``sglang.srt.utils.common`` first, when set now)."""
    common = sys.modules.get(COMMON)
    if common is None:
        _install_import_hook()
        return []
    return _open(common)


def _open(common: types.ModuleType) -> list[str]:
    is_cpu = getattr(common, "is_cpu", None)
    if is_cpu is not None and not is_cpu():  # SGLang on a GPU: its sgl_kernel is not this one
        return []
    # SGLang's own copy of torch.cpu._is_amx_tile_supported(), read by cpu_has_amx_support() at each call
    common.is_amx_tile_supported = True  # type: ignore[attr-defined]
    probe = getattr(common, "_is_intel_amx_backend_available", None)
    if probe is not None and hasattr(probe, "cache_clear"):
        probe.cache_clear()
    # BaseFusedOp's platform key (sglang.kernels.fused_op._platform_key) is cpu_has_amx_support() cached
    fused_op = sys.modules.get("sglang.kernels.fused_op")
    platform_key = getattr(fused_op, "_platform_key", None)
    if platform_key is not None and hasattr(platform_key, "cache_clear"):
        platform_key.cache_clear()
    opened = [COMMON]
    for name, module in list(sys.modules.items()):
        if not name.startswith("sglang.") or module is None or name == COMMON:
            continue
        namespace = getattr(module, "__dict__", {})
        for flag in FROZEN_GATE_NAMES:
            if namespace.get(flag) is False:
                namespace[flag] = True
                opened.append(f"{name}.{flag}")
        # fla's norm kernels: `_use_cpu = is_cpu() and cpu_has_amx_support()`
        if namespace.get("_use_cpu") is False and "cpu_has_amx_support" in namespace:
            namespace["_use_cpu"] = True
            opened.append(f"{name}._use_cpu")
    OPENED.extend(opened)
    return opened


class _OpenGateAfterImport(importlib.abc.MetaPathFinder):
    """Opens the gate right after ``sglang.srt.utils.common`` executes (the shim imported first)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != COMMON:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_open(module: types.ModuleType) -> None:
            exec_module(module)
            _open(module)

        loader.exec_module = exec_then_open  # type: ignore[method-assign]
        return spec


def _install_import_hook() -> None:
    if not any(isinstance(finder, _OpenGateAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OpenGateAfterImport())
