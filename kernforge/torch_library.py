"""kernforge's ops as ``torch.ops.kernforge.<op>`` custom ops, so ``torch.compile`` traces them.

A kernforge op is opaque Python to Dynamo (cffi calls on raw pointers): a compiled model breaks its
graph at each one. Registered with ``torch.library``, each op is one node of the graph instead: a
schema that says which arguments it writes (``Tensor(a!)``), a fake implementation that gives the
output's shape, dtype and strides from the inputs' alone, and the real one, which calls the Python
op. AOTAutograd's functionalization turns the writing ops into ``auto_functionalized`` nodes, which
Inductor turns back into in-place calls; under ``backend="aot_eager"`` the written tensors are cloned
per call (correct, but a whole KV cache is copied per append: use Inductor or ``backend="eager"``
for anything large). The ops are defined from schema strings with ``torch.library.Library`` (about
0.1 ms each at import; 1.6 us of dispatch per call) rather than ``torch.library.custom_op``, whose
Python wrapper costs about 12 us per call.

Interface (what models and ``kernforge.integrations.transformers`` call)
------------------------------------------------------------------------
* This module's functions (``rmsnorm``, ``fused_add_rmsnorm``, ``silu_and_mul``,
  ``apply_rope_pos_ids_inplace``, ``append_paged_kv_cache``, ``weight_packed_linear``, ...) take the
  arguments of kernforge's op of the same name. Eagerly they call that op directly (no dispatcher
  cost); while Dynamo traces (``torch.compiler.is_compiling()``) they call
  ``torch.ops.kernforge.<op>``. A model written against them runs at full speed eagerly and compiles
  without graph breaks. Ops with ``out=`` have a second custom op ``<op>_out`` that writes ``out``.
* ``weight_packed_linear(x, packed)`` and ``int8_scaled_mm_with_quant(x, packed)`` take the packed
  dataclasses; their custom ops take the dataclass's tensors and ints (``packed.packed, n, k,
  panel_width``), since a schema holds no Python objects.
* ``top_k_top_p_sampling_from_logits``: the custom op takes ``top_k``/``top_p`` as ``[batch]``
  tensors and the Philox ``seed``/``offset`` as int64 tensors, so it is a pure function of its
  inputs. Traced, this module's function makes those tensors (a Python ``top_k``/``top_p`` is filled
  in; without ``seed``, one is drawn from torch's default generator by a traced ``randint``; Dynamo
  does not trace a ``torch.Generator`` argument: pass ``seed``/``offset`` tensors instead).
* Attention: a wrapper's plan (page table, work lists, compiled kernel) lives in Python objects that
  a graph cannot hold, and is replaced every step. So ``plan()`` stays outside the compiled region
  (once per step) and ``run()`` becomes ``kernforge::attention_run(tensors, wrapper, out_dtype,
  head_dim_vo, q_scale, k_scale, v_scale)``: ``tensors`` are the wrapper's run() tensors as its
  ``traced_tensors()`` lists them (q and the paged cache's K/V halves, or q, k and v; MLA's four),
  ``wrapper`` is the wrapper's number in a registry of live wrappers (weak references; numbers are
  never reused), and the real implementation runs that wrapper's *current* plan, so one graph serves
  every step's new plan. The fake implementation needs only ``q``'s shape and the two planned values
  it is given (``planned_output()``); Dynamo reads them from the plan while tracing and guards on
  them, so a plan with another output dtype or head dim recompiles rather than mis-describe the
  output (the real implementation checks them too). The KV cache is an input of the op, which orders
  the op after the ``append_paged_kv_cache`` that wrote the cache. ``attention_run_return_lse``
  returns ``(out, lse)``. Every attention wrapper kernforge exports has a class of the same name
  here (registered when built, with a traceable ``run()``); or ``register_wrapper(w)`` a wrapper of
  ``kernforge.ops`` and call ``attention_run(w, *its run() tensors)``.
* Inference only: no autograd formulas (run the model under ``torch.no_grad()`` or
  ``torch.inference_mode()``). Scales (``q_scale`` ...) are Python floats when traced.

``SCHEMAS`` maps each custom op to its schema.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from collections.abc import Callable

import torch

from kernforge.ops._registry import PUBLIC, TRACED
from kernforge.ops.attention import WorkspaceWrapper

NAMESPACE = "kernforge"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # FRAGMENT: other modules may add ops to the namespace
SCHEMAS: dict[str, str] = {}  # op name -> its schema


def _define(schema: str, impl: Callable, fake: Callable) -> None:
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CPU")
    _LIB.impl(name, fake, "Meta")  # what FakeTensorMode runs; register_fake costs 0.4 ms per op (a stack lookup)
    SCHEMAS[name] = schema


# Python annotation (as written, `from __future__ import annotations`) -> schema type.
_SCHEMA_TYPES = {
    "torch.Tensor": "Tensor",
    "torch.Tensor | None": "Tensor?",
    "int": "int",
    "int | None": "int?",
    "float": "float",
    "float | None": "float?",
    "bool": "bool",
    "str": "str",
}


def schema_of(
    python_op: Callable, returns: str, writes: tuple[str, ...] = (), name: str | None = None, out: bool = False
) -> str:
    """The schema of ``python_op`` taking its own arguments, read from its signature (names, types,
    defaults), so the two cannot drift: ``writes`` are the arguments it writes in place
    (``Tensor(a!)``); ``out=True`` makes the ``<op>_out`` variant, whose keyword ``out`` is written."""
    arguments = []
    for parameter in inspect.signature(python_op).parameters.values():
        if parameter.name == "out":
            continue
        kind = _SCHEMA_TYPES[parameter.annotation]
        if parameter.name in writes:
            kind = f"Tensor({chr(ord('a') + writes.index(parameter.name))}!)"
        arguments.append(f"{kind} {parameter.name}{_schema_default(parameter, kind)}")
    if out:
        arguments.append(f"*, Tensor({chr(ord('a') + len(writes))}!) out")
    return f"{name or python_op.__name__}({', '.join(arguments)}) -> {returns}"


def _schema_default(parameter: inspect.Parameter, kind: str) -> str:
    default = parameter.default
    if default is inspect.Parameter.empty:
        return ""
    if default is None or isinstance(default, bool):
        return f"={default}"
    if kind.startswith("float"):
        return f"={float(default)!r}"
    return f'="{default}"' if isinstance(default, str) else f"={default}"


def _writes_only(python_op: Callable) -> Callable:
    """The implementation of an op that writes its arguments: the dispatcher wants None back."""

    def impl(*args, **kwargs) -> None:
        python_op(*args, **kwargs)

    return impl


def _no_output(*args, **kwargs) -> None:
    """The fake of an op that writes its arguments and returns nothing."""


def _op(name: str):
    return getattr(torch.ops.kernforge, name)


def _traceable(python_op: Callable) -> Callable:
    """``python_op`` eagerly, ``torch.ops.kernforge.<its name>`` while Dynamo traces (for ops whose
    schema takes the Python op's arguments as they are)."""
    name = python_op.__name__

    @functools.wraps(python_op)
    def op(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _op(name)(*args, **kwargs)
        return python_op(*args, **kwargs)

    return op


# --------------------------------------------------------------------------- ops declared Traced


def _maybe_out(name: str, out, *args, **kwargs):
    """Traced: ``<name>(*args)``, or ``<name>_out(*args, out=out)`` and ``out``."""
    if out is None:
        return _op(name)(*args, **kwargs)
    _op(f"{name}_out")(*args, **kwargs, out=out)
    return out


def _traceable_with_out(python_op: Callable) -> Callable:
    """``python_op`` eagerly; traced, ``<op>`` or (given ``out``, its last parameter) ``<op>_out``."""
    name, positional = python_op.__name__, len(inspect.signature(python_op).parameters) - 1

    @functools.wraps(python_op)
    def op(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return python_op(*args, **kwargs)
        out = args[positional] if len(args) > positional else kwargs.pop("out", None)
        return _maybe_out(name, out, *args[:positional], **kwargs)

    return op


def _define_traced(python_op: Callable) -> Callable:
    """The custom op(s) of an op declared ``Traced`` where it is defined; returns its facade."""
    traced = python_op.traced
    if traced.arguments is not None:
        return _define_adapted(python_op, traced)
    _define(schema_of(python_op, traced.returns, traced.writes), python_op, traced.fake or _no_output)
    if not traced.with_out:
        return _traceable(python_op)
    out_schema = schema_of(python_op, "()", traced.writes, name=f"{python_op.__name__}_out", out=True)
    _define(out_schema, _writes_only(python_op), _no_output)
    return _traceable_with_out(python_op)


def _define_adapted(python_op: Callable, traced) -> Callable:
    """An op whose custom op takes other arguments (``traced.arguments``): the op eagerly; traced,
    its arguments converted by ``traced.to_schema``."""
    name, impl = python_op.__name__, traced.from_schema
    _define(
        f"{name}({traced.arguments}) -> {traced.returns}",
        impl if traced.returns != "()" else _writes_only(impl),
        traced.fake or _no_output,
    )
    if traced.with_out:
        _define(f"{name}_out({traced.arguments}, *, Tensor(a!) out) -> ()", _writes_only(impl), _no_output)

    @functools.wraps(python_op)
    def op(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return python_op(*args, **kwargs)
        arguments, out = traced.to_schema(*args, **kwargs)
        outputs = _maybe_out(name, out, *arguments)
        return outputs if traced.result is None else traced.result(outputs, *args, **kwargs)

    return op


# rmsnorm, fused_add_rmsnorm, silu_and_mul, the RoPE ops, the sampler...: this module's function of the same name
globals().update({name: _define_traced(python_op) for name, python_op in TRACED.items()})


# --------------------------------------------------------------------------- attention

_WRAPPERS: dict[int, weakref.ref] = {}  # handle -> the live wrapper
_HANDLES = itertools.count(1)
_HANDLE_ATTRIBUTE = "_torch_library_handle"


def register_wrapper(wrapper):
    """Give a kernforge attention wrapper its handle (once; idempotent) so ``attention_run`` can be
    traced with it; returns the wrapper. The registry holds it weakly."""
    if not isinstance(wrapper, WorkspaceWrapper):
        raise TypeError(f"wrapper must be one of kernforge's batch attention wrappers, got {type(wrapper).__name__}")
    if getattr(wrapper, _HANDLE_ATTRIBUTE, None) is None:
        handle = next(_HANDLES)
        _WRAPPERS[handle] = weakref.ref(wrapper, lambda _, handle=handle: _WRAPPERS.pop(handle, None))
        setattr(wrapper, _HANDLE_ATTRIBUTE, handle)
    return wrapper


def _wrapper(handle: int):
    ref = _WRAPPERS.get(handle)
    wrapper = None if ref is None else ref()
    if wrapper is None:
        raise ValueError(
            f"no live attention wrapper has handle {handle} (register_wrapper gives handles; a wrapper "
            "that was garbage-collected has none)"
        )
    return wrapper


def _eager_run(wrapper):
    """The wrapper's own (kernforge.ops) run(), under a traceable subclass's."""
    return super(_TraceableRun, wrapper).run if isinstance(wrapper, _TraceableRun) else wrapper.run


def _attention_impl(
    tensors, wrapper, out_dtype, head_dim_vo, q_scale=None, k_scale=None, v_scale=None, return_lse=False
):
    live = _wrapper(wrapper)
    planned = live.planned_output()
    if planned != (out_dtype, head_dim_vo):
        raise ValueError(
            f"attention_run was given out_dtype {out_dtype} and head_dim_vo {head_dim_vo}, but the "
            f"wrapper's plan gives {planned[0]} and {planned[1]}"
        )
    return _eager_run(live)(
        *live.run_arguments(tensors), q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse
    )


def _attention_fake(tensors, wrapper, out_dtype, head_dim_vo, *args, **kwargs):
    q = tensors[0]
    return q.new_empty((q.shape[0], q.shape[1], head_dim_vo), dtype=out_dtype)


def _attention_lse_fake(tensors, *args, **kwargs):
    q = tensors[0]
    return _attention_fake(tensors, *args, **kwargs), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


# tensors: the wrapper's traced_tensors() (the KV cache among them, which orders the op after the
# append that wrote it); wrapper: its handle; out_dtype, head_dim_vo: its planned_output().
_ATTENTION_ARGS = (
    "Tensor?[] tensors, int wrapper, ScalarType out_dtype, int head_dim_vo, float? q_scale=None, "
    "float? k_scale=None, float? v_scale=None"
)
_define(f"attention_run({_ATTENTION_ARGS}) -> Tensor", _attention_impl, _attention_fake)
_define(
    f"attention_run_return_lse({_ATTENTION_ARGS}) -> (Tensor out, Tensor lse)",
    functools.partial(_attention_impl, return_lse=True),
    _attention_lse_fake,
)


def attention_run(
    wrapper, *tensors, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, return_lse: bool = False
):
    """``wrapper.run(*tensors)`` of a kernforge wrapper (``q, paged_kv_cache`` for the paged ones,
    ``q, k, v`` for the ragged one); traced as one ``kernforge::attention_run`` (the wrapper
    registered), whatever tensors the wrapper's run() takes."""
    if not torch.compiler.is_compiling():
        return _eager_run(wrapper)(
            *tensors, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=return_lse
        )
    handle = getattr(wrapper, _HANDLE_ATTRIBUTE, None)
    if handle is None:
        raise ValueError(
            "torch.compile traced attention_run on an unregistered wrapper: call "
            "kernforge.torch_library.register_wrapper(wrapper) once, before compiling"
        )
    args = (wrapper.traced_tensors(*tensors), handle, *wrapper.planned_output(), q_scale, k_scale, v_scale)
    if not return_lse:
        result = _op("attention_run")(*args)
        return result if out is None else out.copy_(result)
    result, result_lse = _op("attention_run_return_lse")(*args)
    return (result if out is None else out.copy_(result)), (result_lse if lse is None else lse.copy_(result_lse))


class _TraceableRun:
    """run() through ``attention_run``: eagerly the wrapper's own, traced one ``kernforge::attention_run``.
    Any wrapper following the traceable-run protocol (``traced_tensors``, ``run_arguments``,
    ``planned_output``: kernforge.ops.attention.WorkspaceWrapper) fits, whatever its run() takes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        register_wrapper(self)

    def run(
        self,
        *tensors,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out=None,
        lse=None,
        return_lse: bool = False,
        **options,
    ):
        if options and not torch.compiler.is_compiling():
            return super().run(
                *tensors,
                q_scale=q_scale,
                k_scale=k_scale,
                v_scale=v_scale,
                out=out,
                lse=lse,
                return_lse=return_lse,
                **options,
            )
        if options:
            raise NotImplementedError(f"run() options {sorted(options)} are not traceable; pass them eagerly")
        return attention_run(
            self, *tensors, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=return_lse
        )

    run_return_lse = functools.partialmethod(run, return_lse=True)


def _traceable_wrapper(cls: type) -> type:
    """``cls`` (an exported attention wrapper), registered on construction, with a ``run()`` that
    torch.compile traces as ``kernforge::attention_run``."""
    doc = f"kernforge's ``{cls.__name__}``, registered, with a ``run()`` that torch.compile traces."
    return type(cls.__name__, (_TraceableRun, cls), {"__doc__": doc, "__module__": __name__})


# BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWith{Paged,Ragged}KVCacheWrapper, and any wrapper
# a new family exports: this module's class of the same name
globals().update(
    {
        name: _traceable_wrapper(exported)
        for name, exported in PUBLIC.items()
        if isinstance(exported, type) and issubclass(exported, WorkspaceWrapper)
    }
)
