"""What the attention plan/run wrappers share (decode, prefill, and the MLA wrapper to come).

* :class:`WorkspaceWrapper`: FlashInfer's constructor arguments on the CPU (workspace buffer, KV
  layout, GPU-only options refused), the workspace a plan needs, and the single-request ops'
  private wrappers (:func:`single_request_wrapper`).
* :class:`AttentionPlan`: what ``plan()`` fixed for ``run()``; :func:`raise_plan_error` turns a
  planner's ``(code << 32) | index`` into the message naming the argument.
* ``run()``'s per-layer work: :func:`check_q`, :func:`check_paged_cache`,
  :func:`attention_outputs`, :func:`logit_scale` and :func:`fill_layer`, which fills the layer
  struct of ``LAYER_FIELDS`` every attention kernel reads.
* FlashInfer's argument conventions: dtype names (:func:`canonical_dtype`), ``window_left``,
  ``pos_encoding_mode``, scalar scales, and :func:`reject_gpu_options`.
"""

from __future__ import annotations

import math
import threading
from numbers import Real

import torch

from kernforge.jit.module import Codes
from kernforge.ops._common import check_no_overlap, num_threads, writable_rows
from kernforge.ops._registry import DTYPE_NAMES, FP8_DTYPE_NAMES
from kernforge.ops.attention.page import PagedKVCache, check_kv_layout, paged_kv_from_halves, paged_kv_halves

_I64 = "int64_t"
# One layer's tensors, filled per run() by fill_layer(); the same fields for every attention kernel.
# Strides in elements; head_dim is contiguous everywhere.
LAYER_FIELDS = (
    ("q", _I64),
    ("q_stride_token", _I64),
    ("q_stride_head", _I64),
    ("k", _I64),
    ("k_stride_page", _I64),
    ("k_stride_token", _I64),
    ("k_stride_head", _I64),
    ("v", _I64),
    ("v_stride_page", _I64),
    ("v_stride_token", _I64),
    ("v_stride_head", _I64),
    ("out", _I64),
    ("out_stride_token", _I64),
    ("out_stride_head", _I64),
    ("lse", _I64),
    ("lse_stride_token", _I64),
    ("lse_stride_head", _I64),
    ("qk_scale", "double"),
    ("v_scale", "double"),
    ("num_threads", _I64),
)
KV_DTYPE_NAMES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
_KV_TORCH_NAMES = {**DTYPE_NAMES, **FP8_DTYPE_NAMES}
_POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")


class PlanStateError(ValueError, AttributeError):
    """``run()`` before ``plan()``. FlashInfer fails with an AttributeError there; kernforge
    says what happened, as a ValueError that is also an AttributeError."""


class PosEncodingModeError(ValueError, KeyError):
    """An unknown ``pos_encoding_mode`` (FlashInfer: KeyError with this message)."""

    __str__ = BaseException.__str__


class AttentionPlan:
    """What plan() fixed for run(): the kernel, its plan arguments, and the tensors they point into."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class WorkspaceWrapper:
    """What FlashInfer's attention wrappers share on the CPU: the workspace buffer (a wrapper serves
    one caller at a time: its workspace holds the running call's scratch), the KV layout, and the
    GPU-only options refused."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        backend: str = "auto",
        jit_args=None,
    ):
        _check_workspace(float_workspace_buffer)
        check_kv_layout(kv_layout)
        if use_cuda_graph:
            raise NotImplementedError("use_cuda_graph: CUDA graphs do not exist on the CPU; plan() per batch instead")
        if backend not in ("auto", "fa2"):
            raise NotImplementedError(f"backend={backend!r}: kernforge has one CPU backend ('auto')")
        if jit_args is not None:
            raise NotImplementedError("jit_args: custom FlashInfer JIT kernels are not supported by kernforge")
        self._float_workspace_buffer = float_workspace_buffer
        self._kv_layout = kv_layout
        self._grows_workspace = False  # the single-request ops' own wrappers size their buffer themselves
        self._plan = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        _check_workspace(float_workspace_buffer)
        self._float_workspace_buffer = float_workspace_buffer
        self._plan = None  # the plan's partial states pointed into the old buffer

    def end_forward(self) -> None:
        """FlashInfer's no-op."""

    # The traceable-run protocol (kernforge.torch_library's attention_run, one custom op for every
    # wrapper): run()'s tensor arguments as one flat list, the same arguments back from it, and the
    # planned output. The default is run(q, paged_kv_cache); a wrapper with other tensors overrides
    # the first two.
    def traced_tensors(self, q: torch.Tensor, paged_kv_cache) -> list[torch.Tensor | None]:
        """run()'s tensors as the custom op takes them (a paged cache as its K and V halves)."""
        return [q, *paged_kv_halves(paged_kv_cache)]

    def run_arguments(self, tensors: list) -> tuple:
        """run()'s positional arguments from :meth:`traced_tensors`'s list."""
        q, kv, v = tensors
        return q, paged_kv_from_halves(kv, v)

    def planned_output(self) -> tuple[torch.dtype, int]:
        """(out dtype, head dim of out) of the current plan: the output is ``[q rows, q heads, that]``."""
        plan = self._plan
        if plan is None:
            raise PlanStateError("run() called before plan(): plan the batch first")
        return plan.out_dtype, plan.head_dim_vo

    def _workspace(self, needed: int) -> torch.Tensor:
        """The workspace buffer, checked to hold ``needed`` bytes (a single-request op's own wrapper
        grows it instead)."""
        workspace = self._float_workspace_buffer
        if workspace.numel() * workspace.element_size() < needed and self._grows_workspace:
            workspace = self._float_workspace_buffer = torch.empty(needed, dtype=torch.uint8)
        if workspace.numel() * workspace.element_size() < needed:
            raise ValueError(
                f"float_workspace_buffer is too small for this plan: it has "
                f"{workspace.numel() * workspace.element_size()} bytes, the plan needs {needed}"
            )
        return workspace


# The single-request ops' workspaces, one per calling thread (a workspace holds the running call's
# scratch) and per wrapper class, grown by plan() to what each call needs.
_SINGLE_WORKSPACES = threading.local()


def single_request_wrapper(cls: type, kv_layout: str):
    """A ``cls`` wrapper over this thread's growing workspace, for a ``single_*`` op; call
    :func:`keep_workspace` after its plan() so the next call starts from the grown buffer."""
    buffers = _SINGLE_WORKSPACES.__dict__
    wrapper = cls(buffers.setdefault(cls, torch.empty(1 << 20, dtype=torch.uint8)), kv_layout)
    wrapper._grows_workspace = True
    return wrapper


def keep_workspace(wrapper: WorkspaceWrapper) -> None:
    _SINGLE_WORKSPACES.__dict__[type(wrapper)] = wrapper._float_workspace_buffer


def raise_plan_error(error: int, codes: Codes, messages: dict, renamed: dict | None = None) -> None:
    """A planner's ``(code << 32) | index`` as the ValueError ``messages`` gives for the code's
    enumerator in ``codes``: (argument, what is wrong with element ``{i}``); ``renamed`` maps an
    argument to the name this API gives it."""
    name, what = messages[codes.name_of(error >> 32)]
    name = (renamed or {}).get(name, name)
    raise ValueError(f"{name} {what.format(i=error & 0xFFFFFFFF)}")


# --------------------------------------------------------------------------- FlashInfer's conventions


def canonical_dtype(value, name: str) -> torch.dtype:
    """FlashInfer's canonicalize_torch_dtype: a torch.dtype, or its name as a string."""
    if isinstance(value, str):
        found = getattr(torch, value, None)
        if not isinstance(found, torch.dtype):
            raise TypeError(f"{name}: unknown dtype name {value!r}")
        return found
    if isinstance(value, torch.dtype):
        return value
    raise TypeError(f"dtype must be a string or torch.dtype, got {type(value)}")


def plan_dtypes(q_data_type, kv_data_type, o_data_type) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(q, KV, out) dtypes of a plan: KV and out default to q's."""
    q_dtype = canonical_dtype(q_data_type, "q_data_type")
    kv_dtype = canonical_dtype(kv_data_type if kv_data_type is not None else q_dtype, "kv_data_type")
    out_dtype = canonical_dtype(o_data_type if o_data_type is not None else q_dtype, "o_data_type")
    return q_dtype, kv_dtype, out_dtype


def dtype_param(dtype: torch.dtype, name: str, allowed) -> str:
    """A kernel's dtype parameter for ``dtype`` (``name``: the plan argument it came from)."""
    param = _KV_TORCH_NAMES.get(dtype)
    if param not in allowed:
        raise TypeError(
            f"{name} {dtype} is not supported; use one of "
            f"{', '.join(str(d) for d, n in _KV_TORCH_NAMES.items() if n in allowed)}"
        )
    return param


def checked_window(window_left) -> int:
    """window_left as an int; any negative value means no window (FlashInfer's -1)."""
    if isinstance(window_left, bool) or not isinstance(window_left, int):
        raise TypeError(f"window_left must be an int (-1: no window), got {window_left!r}")
    return max(window_left, -1)


def checked_soft_cap(logits_soft_cap) -> float:
    """logits_soft_cap as a float; 0 (or None) disables it."""
    cap = float(logits_soft_cap or 0.0)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"logits_soft_cap must be finite and >= 0 (0 or None disables it), got {logits_soft_cap}")
    return cap


def check_pos_encoding_mode(mode) -> None:
    if mode not in _POS_ENCODING_MODES:
        raise PosEncodingModeError(f"Invalid pos_encoding_mode {mode}")
    if mode != "NONE":
        raise NotImplementedError(
            f"pos_encoding_mode={mode!r} (RoPE/ALiBi applied inside the attention kernel) is not implemented by "
            "kernforge; apply RoPE to q and k before appending them (kernforge.apply_rope_pos_ids_inplace) and use "
            "'NONE'"
        )


def reject_gpu_options(op: str, defaults: dict | None = None, **values) -> None:
    """NotImplementedError for a GPU-backend option given a value: anything but None, the option's
    default in ``defaults``, or (for the others) False or 0."""
    defaults = defaults or {}
    for name, value in values.items():
        if name in defaults:
            inert = value is None or value == defaults[name]
        else:
            inert = value is None or value is False or (type(value) is int and value == 0)
        if not inert:
            raise NotImplementedError(f"{name}={value!r} is not supported by kernforge's {op} (a GPU-backend option)")


def scalar(value, name: str) -> float:
    """A float from a Python number or a one-element tensor (k_scale/v_scale as engines pass them)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, Real):
        return float(value)
    raise TypeError(f"{name} must be a float or a one-element tensor, got {type(value).__name__}")


def check_request_tensor(t, name: str, query: bool) -> None:
    """A single-request op's ``q`` (``query``), ``k`` or ``v``: on the CPU, q in a float dtype, k and v
    in a KV-cache dtype; TypeError or ValueError naming it (checked before plan(), whose messages
    would name its own arguments, q_data_type or paged_kv_cache)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = DTYPE_NAMES if query else _KV_TORCH_NAMES
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {', '.join(str(d) for d in allowed)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")


def check_heads(num_qo_heads, num_kv_heads) -> int:
    """The GQA group size, after checking both head counts."""
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
        check_positive(name, value)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads({num_qo_heads}) must be divisible by num_kv_heads({num_kv_heads})")
    return num_qo_heads // num_kv_heads


def check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


# --------------------------------------------------------------------------- run()


def check_q(q, plan: AttentionPlan, shape: torch.Size, layout: str, rows_name: str | None = None) -> None:
    """``q`` against the plan: dtype, device, ``shape`` (``layout`` names its dimensions in the
    message; ``rows_name``, if given, what its first one must equal), head_dim contiguous.
    Attribute reads only on the warm path."""
    try:
        if q.dtype is plan.q_dtype and q.shape == shape and q.is_cpu and q.stride(-1) == 1:
            return
    except AttributeError:
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}") from None
    if q.dtype != plan.q_dtype:
        raise ValueError(
            f"The dtype of q {q.dtype} does not match the q_data_type {plan.q_dtype} specified in plan function."
        )
    if q.device.type != "cpu":
        raise ValueError(f"q must be on the CPU, got device {q.device}")
    if rows_name is not None and q.dim() == 3 and q.shape[0] != shape[0]:  # FlashInfer's message
        raise ValueError(
            f"q.shape[0] ({q.shape[0]}) does not match {rows_name} ({shape[0]}). q must have shape "
            f"[total_tokens, num_heads, head_dim] where total_tokens = {rows_name}."
        )
    if q.shape != shape:
        raise ValueError(f"q must have shape {layout} = {tuple(shape)} as planned, got {tuple(q.shape)}")
    if shape[-1] == 1:  # a head_dim of one element is contiguous whatever its stride (torch gives [0, 1, 1] (1, 0, 0))
        return
    raise ValueError(f"q must be contiguous in head_dim, got strides {q.stride()}")


def check_paged_cache(cache: PagedKVCache, plan: AttentionPlan, head_dim: int, indices_name: str) -> None:
    """The paged cache run() got against what plan() was given: KV dtype, heads, head_dim, page size,
    and the largest page the plan's ``indices_name`` names (the kernels read it unchecked)."""
    if cache.dtype != plan.kv_dtype:
        raise ValueError(
            f"The dtype of k {cache.dtype} does not match the kv_data_type {plan.kv_dtype} specified in plan function."
        )
    for name, got, planned in (
        ("num_kv_heads", cache.num_kv_heads, plan.num_kv_heads),
        ("head_dim", cache.head_dim, head_dim),
        ("page_size", cache.page_size, plan.page_size),
    ):
        if got != planned:
            raise ValueError(f"paged_kv_cache has {name} {got} but plan() was given {planned}")
    if plan.max_page >= cache.num_pages:
        raise ValueError(f"{indices_name} holds page {plan.max_page}, beyond paged_kv_cache's {cache.num_pages} pages")


def attention_outputs(out, lse, shape: torch.Size, dtype: torch.dtype, return_lse: bool, reads: tuple = ()):
    """``out`` of ``shape`` (checked, or allocated) and ``lse`` of its first two dimensions in fp32:
    the tensors an attention run() writes. A given ``lse`` is written whether or not ``return_lse``
    is set, as FlashInfer does; one is allocated only for ``return_lse``. A given ``out`` or ``lse``
    must not share memory with each other or with what the run reads: ``reads``, ``(name, tensor)``
    pairs, a tensor possibly a (K, V) pair (kernforge's check: FlashInfer makes none)."""
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    else:
        _check_out(out, shape, dtype, "out")
        _check_apart(out, "out", reads)
    if lse is not None:
        _check_out(lse, shape[:2], torch.float32, "lse")
        _check_apart(lse, "lse", reads)
        check_no_overlap(lse, "lse", out, "out")
    elif return_lse:
        lse = torch.empty(shape[:2], dtype=torch.float32)
    return out, lse


def _check_apart(written: torch.Tensor, name: str, reads: tuple) -> None:
    for read_name, value in reads:
        for t in value if isinstance(value, (tuple, list)) else (value,):
            check_no_overlap(written, name, t, read_name)


def logit_scale(sm_scale: float, soft_cap: float, q_scale, k_scale) -> float:
    """What q.k is multiplied by: sm_scale * q_scale * k_scale, over the soft cap when there is one
    (the kernels then take cap * tanh of it)."""
    scale = sm_scale
    if q_scale is not None:
        scale *= scalar(q_scale, "q_scale")
    if k_scale is not None:
        scale *= scalar(k_scale, "k_scale")
    return scale / soft_cap if soft_cap > 0 else scale


def fill_layer(
    io,
    q: torch.Tensor,
    k_ptr: int,
    k_strides,
    v_ptr: int,
    v_strides,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    qk_scale: float,
    v_scale,
) -> None:
    """One layer's LAYER_FIELDS struct, field by field (half the cost of a new struct from a dict):
    q, out and lse as [tokens, heads, ...] views; K and V as addresses with (page, token, head) strides."""
    io.q, (io.q_stride_token, io.q_stride_head, _) = q.data_ptr(), q.stride()
    io.k, (io.k_stride_page, io.k_stride_token, io.k_stride_head) = k_ptr, k_strides
    io.v, (io.v_stride_page, io.v_stride_token, io.v_stride_head) = v_ptr, v_strides
    io.out, (io.out_stride_token, io.out_stride_head, _) = out.data_ptr(), out.stride()
    if lse is not None:
        io.lse, (io.lse_stride_token, io.lse_stride_head) = lse.data_ptr(), lse.stride()
    else:
        io.lse = 0
    io.qk_scale = qk_scale
    io.v_scale = 1.0 if v_scale is None else scalar(v_scale, "v_scale")
    io.num_threads = num_threads()


def _check_out(t, shape, dtype, name: str) -> None:
    """FlashInfer's check_shape_dtype_device, plus the layout a kernel writes through: a contiguous
    last dimension and rows that do not overlap."""
    try:  # warm path: attribute reads and one C call (a contiguous tensor's rows cannot overlap)
        if t.dtype is dtype and t.shape == shape and t.is_cpu and t.is_contiguous():
            return
    except AttributeError:
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}") from None
    if t.shape != shape:
        raise ValueError(f"Invalid shape of {name}: expected {shape}, got {t.shape}")
    if t.dtype != dtype:
        raise ValueError(f"Invalid dtype of {name}: expected {dtype}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"Invalid device of {name}: expected cpu, got {t.device}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    writable_rows(t.shape, t.stride(), name)


def _check_workspace(buffer) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"float_workspace_buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.device.type != "cpu":
        raise ValueError(f"float_workspace_buffer must be on the CPU, got device {buffer.device}")
    if not buffer.is_contiguous():
        raise ValueError("float_workspace_buffer must be contiguous")
    if buffer.data_ptr() % 16:
        raise ValueError("float_workspace_buffer must be 16-byte aligned")
