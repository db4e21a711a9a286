"""The op registry: each public op is declared once, where it is defined.

``@kernel_op(MODULE, dtypes, traced=Traced(...), **fixed)`` on an op's function records which
module variant the op runs for each input dtype (what pre-warm builds), how it becomes a
``torch.ops.kernforge`` custom op (``Traced``: kernforge.torch_library reads it; the arguments come
from the function's signature) and exports the function under its name; ``export(name, fn)`` adds
an alias. ``kernforge.ops`` and ``kernforge`` export exactly what is registered here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernforge.jit.core import Variant
from kernforge.jit.module import Module

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
ALL_DTYPES = tuple(DTYPE_NAMES)
# Storage-only dtypes (fp8 KV caches): kernels read them (kf::fp8_e4m3, kf::fp8_e5m2) and compute in
# fp32; ops never take them as their float inputs, so they stay out of DTYPE_NAMES.
FP8_DTYPE_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


class OpKernels:
    """The kernels one op runs: a module, its fixed parameters, and the input dtypes
    the op takes (each picks the module's ``dtype`` parameter)."""

    __slots__ = ("op", "module", "fixed", "dtypes", "by_dtype")

    def __init__(self, op: str, module: Module, dtypes: tuple[torch.dtype, ...], fixed: dict):
        self.op, self.module, self.dtypes, self.fixed = op, module, dtypes, fixed
        self.by_dtype: dict[torch.dtype, Variant] = {}  # filled on first use of each dtype

    def variant(self, dtype: torch.dtype) -> Variant:
        """The variant for inputs of ``dtype`` (a torch dtype)."""
        found = self.by_dtype.get(dtype)
        if found is None:
            if dtype not in self.dtypes:
                takes = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
                raise ValueError(f"{self.op} does not take {dtype} inputs (it takes {takes})")
            found = self.by_dtype[dtype] = self.module.variant(dtype=DTYPE_NAMES[dtype], **self.fixed)
        return found


@dataclass(frozen=True)
class Traced:
    """How an op becomes ``torch.ops.kernforge.<op>``: what its schema returns, the arguments it
    writes in place, its fake (the outputs from the inputs' shapes, dtypes and strides alone; none
    for an op that only writes), and whether it takes ``out=`` (then an ``<op>_out`` custom op
    writes ``out``). The arguments are the op's own, read from its signature, unless ``arguments``
    says otherwise."""

    returns: str = "()"
    writes: tuple[str, ...] = ()
    fake: Callable | None = None
    with_out: bool = False
    # An op whose arguments a schema cannot hold (a packed-weight dataclass, a (k, v) pair) states
    # the custom op's own ones (schema syntax), the op's call from them (the implementation), and
    # the conversion of the op's arguments into them while tracing: -> (arguments, out).
    arguments: str | None = None
    from_schema: Callable | None = None
    to_schema: Callable | None = None
    # The op's result from the custom op's outputs and the op's arguments, where the two differ (the
    # sampler returns ``valid`` only when asked): result(outputs, *args, **kwargs).
    result: Callable | None = None


# op name -> its kernels (pre-warm's view); public name -> function (the exports); op name ->
# function, for the ops declared Traced (torch_library's view)
OPS: dict[str, OpKernels] = {}
PUBLIC: dict[str, Callable] = {}
TRACED: dict[str, Callable] = {}


def kernel_op(
    module: Module, dtypes: tuple[torch.dtype, ...] = ALL_DTYPES, traced: Traced | None = None, **fixed
) -> Callable:
    """Register the decorated function as a public op running ``module`` with ``fixed`` params;
    ``traced``: how it becomes a custom op."""

    def register(fn: Callable) -> Callable:
        OPS[fn.__name__] = OpKernels(fn.__name__, module, dtypes, fixed)
        PUBLIC[fn.__name__] = fn
        fn.kernels = OPS[fn.__name__]
        if traced is not None:
            fn.traced = traced
            TRACED[fn.__name__] = fn
        return fn

    return register


# What each family builds for a model: hooks (spec, kv_cache_dtypes, quant) -> manifest entries, next
# to the ops (``spec``: a kernforge.model_spec.ModelSpec); pre-warm's manifest is their union.
MODEL_KERNELS: list[Callable] = []


def model_kernels(hook: Callable) -> Callable:
    """Register ``hook(spec, kv_cache_dtypes, quant) -> [manifest entry, ...]``: the kernels of this
    family that a model described by ``spec`` runs (KV caches in its dtype and ``kv_cache_dtypes``;
    ``quant`` None or "int8")."""
    MODEL_KERNELS.append(hook)
    return hook


def export(name: str, fn: Callable) -> Callable:
    """Export ``fn`` under another public name as well (FlashInfer's older spellings)."""
    PUBLIC[name] = fn
    return fn
