"""Decode attention over a paged KV cache, with FlashInfer's API.

``BatchDecodeWithPagedKVCacheWrapper.plan()`` runs once per batch: it checks
the page table, copies it, and cuts the batch's work (KV tokens x KV heads)
into one near-equal list per thread, splitting long requests along the KV
(``attention/work_plan.h``). ``run()`` then serves every layer of that step
with the plan: it checks its tensors by attribute reads and makes one call;
partial states of split requests live in the workspace buffer and are merged
by LSE inside that call.

Semantics follow FlashInfer: ``sm_scale`` defaults to ``1/sqrt(head_dim)`` and
is multiplied by ``q_scale`` and ``k_scale``; ``logits_soft_cap`` applies
``cap * tanh(logit / cap)``; ``window_left = w >= 0`` keeps the last ``w + 1``
keys; ``v_scale`` multiplies the output; LSE is base 2 of the final logits
(``log2(e) * logsumexp``); an empty request gives zeros and LSE ``-inf``.
What FlashInfer offers and kernforge does not (on-the-fly RoPE, ALiBi, sinks,
CUDA graphs, several queries per request) raises ``NotImplementedError``.
"""

from __future__ import annotations

import functools
import math
import threading
from numbers import Real

import torch

from kernforge.jit.module import DType, Entry, Int, Module, Struct
from kernforge.ops._common import check_head_dim, index_vector, num_threads, writable_rows
from kernforge.ops._registry import DTYPE_NAMES, FP8_DTYPE_NAMES, export
from kernforge.ops.page import PagedKVCache, check_kv_layout, unpack_paged_kv_cache

_I64 = "int64_t"
# Fixed for the plan's lifetime: filled once in plan().
DECODE_PLAN = Struct("kf_decode_planned", (
    ("plan", _I64), ("indptr", _I64), ("indices", _I64), ("workspace", _I64), ("partials", _I64),
    ("units", _I64), ("group", _I64), ("page_size", _I64), ("soft_cap", "double"),
))
# One layer's tensors, filled per run() by fill_layer(); the same fields for decode (one query token
# per request) and prefill. Strides in elements; head_dim is contiguous everywhere.
LAYER_FIELDS = (
    ("q", _I64), ("q_stride_token", _I64), ("q_stride_head", _I64),
    ("k", _I64), ("k_stride_page", _I64), ("k_stride_token", _I64), ("k_stride_head", _I64),
    ("v", _I64), ("v_stride_page", _I64), ("v_stride_token", _I64), ("v_stride_head", _I64),
    ("out", _I64), ("out_stride_token", _I64), ("out_stride_head", _I64),
    ("lse", _I64), ("lse_stride_token", _I64), ("lse_stride_head", _I64),
    ("qk_scale", "double"), ("v_scale", "double"), ("num_threads", _I64),
)
DECODE_IO = Struct("kf_decode_layer", LAYER_FIELDS)
KV_DTYPE_NAMES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
MAX_GROUP = 8  # GQA groups up to this are compile-time constants; larger ones (MQA) use group 0

DECODE = Module(
    "decode", "decode.cpp.jinja",
    params={
        "q_dtype": DType(), "kv_dtype": DType(KV_DTYPE_NAMES), "out_dtype": DType(),
        "head_dim": Int(minimum=1, maximum=512), "group": Int(minimum=0, maximum=MAX_GROUP),
    },
    structs=[DECODE_PLAN, DECODE_IO],
    entries=[
        Entry("plan", "int64_t indptr, int64_t last_page_len, int64_t indices, int64_t batch, "
                      "int64_t num_indices, int64_t page_size, int64_t num_kv_heads, int64_t window_left, "
                      "int64_t num_lists, int64_t min_split, int64_t plan, int64_t capacity", returns=_I64),
        Entry("plan_capacity", "int64_t units, int64_t num_lists", returns=_I64),
        Entry("scratch_floats", "int64_t heads, int64_t group", returns=_I64),
        Entry("run", "const kf_decode_planned* plan, const kf_decode_layer* io"),
    ],
)

_KV_TORCH_NAMES = {**DTYPE_NAMES, **FP8_DTYPE_NAMES}
# Splitting a request's KV across threads costs a merge; pieces under this many tokens are not worth it.
_MIN_SPLIT, _NO_SPLIT = 128, 1 << 30
_PLAN_HEADER = 8  # int32s before the list offsets (work_plan.h PlanLayout)
_POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
# Plan errors of work_plan.h: code -> (argument, what is wrong with element `index`).
_PLAN_ERRORS = {
    1: ("indptr", "must start at 0"),
    2: ("indptr", "must be non-decreasing (indptr[{i} + 1] < indptr[{i}])"),
    3: ("indptr", "ends beyond indices: indptr[-1] > len(indices)"),
    4: ("last_page_len", "must be in [1, page_size] for a request with pages (request {i})"),
    5: ("indices", "holds a negative page index at position {i}"),
}


class PlanStateError(ValueError, AttributeError):
    """``run()`` before ``plan()``. FlashInfer fails with an AttributeError there; kernforge
    says what happened, as a ValueError that is also an AttributeError."""


class PosEncodingModeError(ValueError, KeyError):
    """An unknown ``pos_encoding_mode`` (FlashInfer: KeyError with this message)."""

    __str__ = BaseException.__str__


def _canonical_dtype(value, name: str) -> torch.dtype:
    """FlashInfer's canonicalize_torch_dtype: a torch.dtype, or its name as a string."""
    if isinstance(value, str):
        found = getattr(torch, value, None)
        if not isinstance(found, torch.dtype):
            raise TypeError(f"{name}: unknown dtype name {value!r}")
        return found
    if isinstance(value, torch.dtype):
        return value
    raise TypeError(f"dtype must be a string or torch.dtype, got {type(value)}")


def _dtype_param(dtype: torch.dtype, name: str, allowed) -> str:
    param = _KV_TORCH_NAMES.get(dtype)
    if param not in allowed:
        raise TypeError(f"{name} {dtype} is not supported; use one of "
                        f"{', '.join(str(d) for d, n in _KV_TORCH_NAMES.items() if n in allowed)}")
    return param


def decode_variant_params(q_dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype, head_dim: int,
                          group: int) -> dict:
    """The DECODE variant serving these dtypes, head_dim and GQA group (plan() and pre-warm)."""
    check_head_dim("head_dim", head_dim)
    return {
        "q_dtype": _dtype_param(q_dtype, "q_data_type", DECODE.params["q_dtype"].choices),
        "kv_dtype": _dtype_param(kv_dtype, "kv_data_type", KV_DTYPE_NAMES),
        "out_dtype": _dtype_param(out_dtype, "o_data_type", DECODE.params["out_dtype"].choices),
        "head_dim": head_dim, "group": group if group <= MAX_GROUP else 0,
    }


def _index_copy(t, name: str) -> torch.Tensor:
    """A private int32 copy of a 1-D CPU index tensor: run() must not see later edits to it."""
    return index_vector(t, name).clone()


def _window(window_left) -> int:
    """window_left as an int; any negative value means no window (FlashInfer's -1)."""
    if isinstance(window_left, bool) or not isinstance(window_left, int):
        raise TypeError(f"window_left must be an int (-1: no window), got {window_left!r}")
    return max(window_left, -1)


def _check_pos_encoding_mode(mode) -> None:
    if mode not in _POS_ENCODING_MODES:
        raise PosEncodingModeError(f"Invalid pos_encoding_mode {mode}")
    if mode != "NONE":
        raise NotImplementedError(
            f"pos_encoding_mode={mode!r} (RoPE/ALiBi applied inside decode) is not implemented by kernforge; "
            "apply RoPE to q and k before appending them (kernforge.apply_rope_pos_ids_inplace) and use 'NONE'")


def _scalar(value, name: str) -> float:
    """A float from a Python number or a one-element tensor (k_scale/v_scale as engines pass them)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, Real):
        return float(value)
    raise TypeError(f"{name} must be a float or a one-element tensor, got {type(value).__name__}")


def _check_out(t, shape, dtype, name: str) -> None:
    """FlashInfer's check_shape_dtype_device, plus the layout a kernel writes through."""
    try:  # warm path: attribute reads
        if t.dtype is dtype and t.shape == shape and t.is_cpu and t.stride(-1) == 1:
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


class WorkspaceWrapper:
    """What FlashInfer's attention wrappers share on the CPU: the workspace buffer (a wrapper serves
    one caller at a time: its workspace holds the running call's scratch), the KV layout, and the
    GPU-only options refused."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", jit_args=None):
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
        self._grows_workspace = False  # the single_* ops' own wrappers size their buffer themselves
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


class BatchDecodeWithPagedKVCacheWrapper(WorkspaceWrapper):
    """FlashInfer's batch decode wrapper: ``plan()`` once per batch, ``run()`` per layer.

    ``float_workspace_buffer`` is a CPU tensor (any dtype) that holds the split
    requests' partial states and each thread's scratch; ``plan()`` says how many
    bytes it needs when it is too small. ``use_tensor_cores`` chooses among GPU
    kernels in FlashInfer and changes nothing here. Like FlashInfer's, a wrapper
    serves one caller at a time: its workspace holds the running call's scratch.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)
        self._use_tensor_cores = bool(use_tensor_cores)

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None, non_blocking: bool = True,
             block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv: bool = False,
             q_len_per_req: int = 1, window_right: int = 0) -> None:
        """Check and copy the page table, pick the kernel, and partition the batch across threads."""
        self._plan = None
        _check_pos_encoding_mode(pos_encoding_mode)
        _reject_unsupported(block_tables=block_tables, seq_lens=seq_lens, fixed_split_size=fixed_split_size,
                            q_len_per_req=q_len_per_req, window_right=window_right)
        if data_type is not None:  # FlashInfer's deprecated spelling fills what is None
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q_dtype = _canonical_dtype(q_data_type, "q_data_type")
        kv_dtype = _canonical_dtype(kv_data_type if kv_data_type is not None else q_dtype, "kv_data_type")
        out_dtype = _canonical_dtype(o_data_type if o_data_type is not None else q_dtype, "o_data_type")
        _check_heads(num_qo_heads, num_kv_heads, head_dim, page_size)
        soft_cap = float(logits_soft_cap or 0.0)
        if not math.isfinite(soft_cap) or soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be finite and >= 0 (0 or None disables it), got {logits_soft_cap}")
        window_left = _window(window_left)

        indptr, indices, last_page_len = (_index_copy(indptr, "indptr"), _index_copy(indices, "indices"),
                                          _index_copy(last_page_len, "last_page_len"))
        batch = last_page_len.numel()
        if indptr.numel() != batch + 1:
            raise ValueError(f"indptr must have len(last_page_len) + 1 = {batch + 1} entries, got {indptr.numel()}")

        group = num_qo_heads // num_kv_heads
        kernel = DECODE.variant(**decode_variant_params(q_dtype, kv_dtype, out_dtype, head_dim, group)).kernel()
        lists = num_threads()
        units = batch * num_kv_heads  # the plan buffer's layout; a unit may hold several KV heads
        plan_buffer = torch.empty(kernel.plan_capacity(units, lists), dtype=torch.int32)
        error = kernel.plan(indptr.data_ptr(), last_page_len.data_ptr(), indices.data_ptr(), batch, indices.numel(),
                            page_size, num_kv_heads, window_left,
                            lists, _NO_SPLIT if disable_split_kv else _MIN_SPLIT, plan_buffer.data_ptr(),
                            plan_buffer.numel())
        if error:
            name, what = _PLAN_ERRORS[error >> 32]
            raise ValueError(f"{name} {what.format(i=error & 0xFFFFFFFF)}")
        _, _, _, num_slots, max_page, unit_heads = plan_buffer[:6].tolist()
        partial_floats = num_slots * unit_heads * group * (head_dim + 1)
        workspace = self._float_workspace_buffer
        needed = 4 * (partial_floats + lists * kernel.scratch_floats(unit_heads, group))
        if workspace.numel() * workspace.element_size() < needed and self._grows_workspace:
            workspace = self._float_workspace_buffer = torch.empty(needed, dtype=torch.uint8)
        if workspace.numel() * workspace.element_size() < needed:
            raise ValueError(f"float_workspace_buffer is too small for this plan: it has "
                             f"{workspace.numel() * workspace.element_size()} bytes, the plan needs {needed}")
        base = workspace.data_ptr()
        plan_args = kernel.new("kf_decode_planned", {
            "plan": plan_buffer.data_ptr(), "indptr": indptr.data_ptr(), "indices": indices.data_ptr(),
            "workspace": base + 4 * partial_floats, "partials": base, "units": units,
            "group": group, "page_size": page_size, "soft_cap": soft_cap,
        })
        self._plan = _Plan(
            kernel=kernel, args=plan_args, io=kernel.new("kf_decode_layer"),
            keep=(plan_buffer, indptr, indices, last_page_len, workspace),
            batch=batch, q_shape=torch.Size((batch, num_qo_heads, head_dim)), num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size, max_page=max_page, q_dtype=q_dtype, kv_dtype=kv_dtype,
            out_dtype=out_dtype, window_left=window_left, soft_cap=soft_cap,
            sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale),
        )

    begin_forward = plan

    def work_lists(self) -> list[list[tuple[int, int, int, int, int, int]]]:
        """The plan's partition, one list per thread, each of ``(request, kv_head, num_heads,
        kv_begin, kv_end, slot)`` items (``slot >= 0``: a piece of a request split across
        threads, merged by LSE). For tests and for looking at how a batch was balanced."""
        if self._plan is None:
            raise PlanStateError("work_lists() called before plan()")
        buffer = self._plan.keep[0].tolist()
        num_lists = buffer[0]
        offsets = buffer[_PLAN_HEADER:_PLAN_HEADER + num_lists + 1]
        items = buffer[_PLAN_HEADER + num_lists + 1:]
        return [[tuple(items[6 * i:6 * i + 6]) for i in range(offsets[n], offsets[n + 1])] for n in range(num_lists)]

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            enable_pdl=None, window_left: int | None = None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        """Attention of ``q [batch, num_qo_heads, head_dim]`` over the planned pages of
        ``paged_kv_cache``: ``out``, or ``(out, lse)`` with ``return_lse``."""
        plan = self._plan
        if plan is None:
            raise PlanStateError("run() called before plan(): plan the batch first")
        if args:
            raise TypeError(f"run() takes q and paged_kv_cache positionally, got {len(args)} more positional arguments")
        if sinks is not None:
            raise NotImplementedError("sinks (attention sinks) are not implemented by kernforge's decode")
        if skip_softmax_threshold_scale_factor is not None or kv_cache_sf is not None:
            raise NotImplementedError("skip_softmax_threshold_scale_factor and kv_cache_sf (block-scaled KV) are "
                                      "not implemented by kernforge's decode")
        if window_left is not None and _window(window_left) != plan.window_left:
            raise ValueError(f"window_left={window_left} differs from the planned {plan.window_left}; plan() again")
        if q_len_per_req not in (None, 1):
            raise NotImplementedError("q_len_per_req > 1 (several queries per request) is not implemented")
        cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        _check_q(q, plan)
        check_paged_cache(cache, plan, plan.head_dim, "indices")
        out, lse = attention_outputs(out, lse, plan.q_shape, plan.out_dtype, return_lse)
        qk_scale = logit_scale(plan.sm_scale, plan.soft_cap, q_scale, k_scale)
        fill_layer(plan.io, q, cache.k_ptr, cache.k_strides, cache.v_ptr, cache.v_strides, out, lse, qk_scale,
                   v_scale)
        plan.kernel.run(plan.args, plan.io)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q: torch.Tensor, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None, k_scale=None,
                v_scale=None, window_left: int = -1, logits_soft_cap: float | None = None,
                sm_scale: float | None = None, rope_scale=None, rope_theta=None, return_lse: bool = False):
        """FlashInfer's deprecated spelling: these arguments replace the planned ones, then run()."""
        _check_pos_encoding_mode(pos_encoding_mode)
        plan = self._plan
        if plan is None:
            raise PlanStateError("forward() called before plan(): plan the batch first")
        if _window(window_left) != plan.window_left or float(logits_soft_cap or 0.0) != plan.soft_cap:
            raise ValueError("forward(): window_left and logits_soft_cap are part of the plan on the CPU; "
                             "pass them to plan()")
        plan.sm_scale = 1.0 / math.sqrt(plan.head_dim) if sm_scale is None else float(sm_scale)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    forward_return_lse = functools.partialmethod(forward, return_lse=True)


class _Plan:
    """What plan() fixed for run(): the kernel, its plan arguments, and the tensors they point into."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def attention_outputs(out, lse, shape: torch.Size, dtype: torch.dtype, return_lse: bool):
    """``out`` of ``shape`` (checked, or allocated) and ``lse`` of its first two dimensions in fp32:
    the tensors an attention run() writes. A given ``lse`` is written whether or not ``return_lse``
    is set, as FlashInfer does; one is allocated only for ``return_lse``."""
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    else:
        _check_out(out, shape, dtype, "out")
        writable_rows(out.shape, out.stride(), "out")
    if lse is not None:
        _check_out(lse, shape[:2], torch.float32, "lse")
        writable_rows(lse.shape, lse.stride(), "lse")
    elif return_lse:
        lse = torch.empty(shape[:2], dtype=torch.float32)
    return out, lse


def fill_layer(io, q: torch.Tensor, k_ptr: int, k_strides, v_ptr: int, v_strides, out: torch.Tensor,
               lse: torch.Tensor | None, qk_scale: float, v_scale) -> None:
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
    io.v_scale = 1.0 if v_scale is None else _scalar(v_scale, "v_scale")
    io.num_threads = num_threads()


def logit_scale(sm_scale: float, soft_cap: float, q_scale, k_scale) -> float:
    """What q.k is multiplied by: sm_scale * q_scale * k_scale, over the soft cap when there is one
    (the kernels then take cap * tanh of it)."""
    scale = sm_scale
    if q_scale is not None:
        scale *= _scalar(q_scale, "q_scale")
    if k_scale is not None:
        scale *= _scalar(k_scale, "k_scale")
    return scale / soft_cap if soft_cap > 0 else scale


def _check_workspace(buffer) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"float_workspace_buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.device.type != "cpu":
        raise ValueError(f"float_workspace_buffer must be on the CPU, got device {buffer.device}")
    if not buffer.is_contiguous():
        raise ValueError("float_workspace_buffer must be contiguous")
    if buffer.data_ptr() % 16:
        raise ValueError("float_workspace_buffer must be 16-byte aligned")


def _check_heads(num_qo_heads, num_kv_heads, head_dim, page_size) -> None:
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("page_size", page_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads({num_qo_heads}) must be divisible by num_kv_heads({num_kv_heads})")


def _reject_unsupported(**values) -> None:
    defaults = {"block_tables": None, "seq_lens": None, "fixed_split_size": None, "q_len_per_req": 1,
                "window_right": 0}
    for name, value in values.items():
        if value is not None and value != defaults[name]:
            raise NotImplementedError(f"{name}={value!r} is not supported by kernforge's decode (GPU-backend option)")


def _check_q(q, plan: _Plan) -> None:
    try:  # warm path: attribute reads
        if q.dtype is plan.q_dtype and q.shape == plan.q_shape and q.is_cpu and q.stride(-1) == 1:
            return
    except AttributeError:
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}") from None
    if q.dtype != plan.q_dtype:
        raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {plan.q_dtype} specified in "
                         "plan function.")
    if q.device.type != "cpu":
        raise ValueError(f"q must be on the CPU, got device {q.device}")
    if q.shape != plan.q_shape:
        raise ValueError(f"q must have shape [batch, num_qo_heads, head_dim] = {tuple(plan.q_shape)} as planned, "
                         f"got {tuple(q.shape)}")
    raise ValueError(f"q must be contiguous in head_dim, got strides {q.stride()}")


def check_paged_cache(cache: PagedKVCache, plan: _Plan, head_dim: int, indices_name: str) -> None:
    """The paged cache run() got against what plan() was given: KV dtype, heads, head_dim, page size,
    and the largest page the plan's ``indices_name`` names (the kernels read it unchecked)."""
    if cache.dtype != plan.kv_dtype:
        raise ValueError(f"The dtype of k {cache.dtype} does not match the kv_data_type {plan.kv_dtype} specified "
                         "in plan function.")
    for name, got, planned in (("num_kv_heads", cache.num_kv_heads, plan.num_kv_heads),
                               ("head_dim", cache.head_dim, head_dim),
                               ("page_size", cache.page_size, plan.page_size)):
        if got != planned:
            raise ValueError(f"paged_kv_cache has {name} {got} but plan() was given {planned}")
    if plan.max_page >= cache.num_pages:
        raise ValueError(f"{indices_name} holds page {plan.max_page}, beyond paged_kv_cache's {cache.num_pages} pages")


def single_decode_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str = "NHD",
                                pos_encoding_mode: str = "NONE", use_tensor_cores: bool = False, q_scale=None,
                                k_scale=None, v_scale=None, window_left: int = -1, logits_soft_cap=None,
                                sm_scale=None, rope_scale=None, rope_theta=None, return_lse: bool = False):
    """Decode attention of one request: ``q [num_qo_heads, head_dim]`` over ``k``/``v``
    ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND).
    Returns ``out [num_qo_heads, head_dim]`` in q's dtype, or ``(out, lse [num_qo_heads])``."""
    _check_pos_encoding_mode(pos_encoding_mode)
    check_kv_layout(kv_layout)
    for name, t, dims in (("q", q, 2), ("k", k, 3), ("v", v, 3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if v.dtype != k.dtype:
        raise TypeError(f"v has dtype {v.dtype} but k has {k.dtype}; they must match")
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if kv_layout == "NHD" else (k.shape[1], k.shape[0])
    num_qo_heads, head_dim = q.shape
    if k.shape[2] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but k has {k.shape[2]}")
    # One request of one page holding all kv_len tokens: the paged kernel serves it as is.
    page_size = max(kv_len, 1)
    cache = (k.unsqueeze(0), v.unsqueeze(0))
    if kv_len == 0:  # an empty page would be an empty cache: give the request no page instead
        cache = tuple(torch.zeros((1, 1, num_kv_heads, head_dim) if kv_layout == "NHD" else
                                  (1, num_kv_heads, 1, head_dim), dtype=k.dtype) for _ in range(2))
    if not hasattr(_SINGLE_WORKSPACE, "buffer"):
        _SINGLE_WORKSPACE.buffer = torch.empty(1 << 20, dtype=torch.uint8)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(_SINGLE_WORKSPACE.buffer, kv_layout)
    wrapper._grows_workspace = True
    wrapper.plan(torch.tensor([0, 1 if kv_len else 0], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                 torch.tensor([kv_len if kv_len else 1], dtype=torch.int32), num_qo_heads, num_kv_heads, head_dim,
                 page_size, window_left=window_left, logits_soft_cap=logits_soft_cap, q_data_type=q.dtype,
                 kv_data_type=k.dtype, sm_scale=sm_scale)
    _SINGLE_WORKSPACE.buffer = wrapper._float_workspace_buffer
    result = wrapper.run(q.unsqueeze(0), cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                         return_lse=return_lse)
    return (result[0][0], result[1][0]) if return_lse else result[0]


# single_decode_with_kv_cache's workspace, one per calling thread (it holds the kernel's scratch),
# grown by plan() to what each call needs.
_SINGLE_WORKSPACE = threading.local()


export("BatchDecodeWithPagedKVCacheWrapper", BatchDecodeWithPagedKVCacheWrapper)
export("single_decode_with_kv_cache", single_decode_with_kv_cache)
