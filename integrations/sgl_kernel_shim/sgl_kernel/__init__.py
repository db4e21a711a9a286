"""``sgl_kernel`` for SGLang's CPU path, served by kernforge (distribution ``kernforge-sgl-kernel``).

SGLang imports ``sgl_kernel`` at module level on CPU (``SGLANG_USE_CPU_ENGINE=1``) and calls
``torch.ops.sgl_kernel.<op>``. Importing this package registers those ops on kernforge's kernels and makes
SGLang's AMX gate (``cpu_has_amx_support()``) read True on every x86 tier kernforge runs on
(:mod:`kernforge.integrations.sglang` says how, without touching torch's own AMX detection).

Off: ``KERNFORGE_SGLANG=0`` (nothing registered; SGLang keeps its torch-native layers), or
``pip uninstall kernforge-sgl-kernel``.
"""

from __future__ import annotations

try:
    from kernforge.integrations.sglang import ops as _ops
except ImportError as error:  # pragma: no cover - an environment without kernforge
    raise ImportError("sgl_kernel (kernforge-sgl-kernel) needs kernforge: pip install 'kernforge[sglang]'") from error

__version__ = "0.0.0+kernforge"

globals().update(_ops.PYTHON_NAMES)
__all__ = sorted(_ops.PYTHON_NAMES)
