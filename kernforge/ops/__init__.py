"""The ops. Each is registered where it is defined (``_registry.kernel_op``), and
exported here and from ``kernforge`` under exactly the registered names."""

from __future__ import annotations

from kernforge.ops import activation, attention, gemm, norm, rope, sampling, torch_library  # noqa: F401  (registers their ops)
from kernforge.ops._common import num_threads, set_num_threads
from kernforge.ops._registry import OPS, PUBLIC, OpKernels  # noqa: F401  (kernforge.ops.OPS: what pre-warm builds)

globals().update(PUBLIC)

__all__ = sorted(PUBLIC) + ["num_threads", "set_num_threads"]
