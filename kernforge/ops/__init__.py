"""The ops, by family: each module or package here registers its ops where it defines them
(``_registry.kernel_op`` / ``export``) when it is imported, and every one is imported here, so a
new family is a new module or package, not an edit of a list. ``kernforge.ops`` and ``kernforge``
export exactly the registered names."""

from __future__ import annotations

import importlib
import pkgutil

from kernforge.ops import _openmp  # noqa: F401  (releases the OpenMP thread pool before os.fork(): see there)
from kernforge.ops._common import num_threads, set_num_threads
from kernforge.ops._registry import OPS, PUBLIC, OpKernels  # noqa: F401  (kernforge.ops.OPS: what pre-warm builds)

for _family in pkgutil.iter_modules(__path__):
    if not _family.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_family.name}")  # registers its ops

globals().update(PUBLIC)

__all__ = sorted(PUBLIC) + ["num_threads", "set_num_threads"]
