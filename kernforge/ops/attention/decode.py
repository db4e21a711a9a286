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
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernforge.jit.module import Codes, DType, Entry, Int, Kernel, Module, Struct
from kernforge.ops._common import (
    TORCH_DTYPES,
    BoundCall,
    check_head_dim,
    dtype_name,
    index_vector,
    kv_cache_dtype,
    num_threads,
)
from kernforge.ops._registry import export, model_kernels
from kernforge.ops.attention._wrapper import (
    KV_DTYPE_NAMES,
    LAYER_FIELDS,
    AttentionPlan,
    PlanStateError,
    WorkspaceWrapper,
    attention_outputs,
    check_heads,
    check_paged_cache,
    check_pos_encoding_mode,
    check_positive,
    check_q,
    check_request_tensor,
    checked_soft_cap,
    checked_window,
    dtype_param,
    fill_layer,
    keep_workspace,
    logit_scale,
    plan_dtypes,
    raise_plan_error,
    reject_gpu_options,
    single_request_wrapper,
)
from kernforge.ops.attention.page import check_kv_layout, layer_caches, unpack_paged_kv_cache

_I64 = "int64_t"
# The planner's input (the batch's int32 page table, its shape, the window) and where it writes the
# partition (``plan``, ``capacity`` int32s; attention/work_plan.h's PlanLayout).
DECODE_PLAN_ARGS = Struct(
    "kf_decode_plan_args",
    tuple(
        (name, _I64)
        for name in (
            "indptr",
            "last_page_len",
            "indices",
            "batch",
            "num_indices",
            "page_size",
            "num_kv_heads",
            "window_left",
            "num_lists",
            "min_split",
            "plan",
            "capacity",
        )
    ),
)
# Fixed for the plan's lifetime: filled once in plan().
DECODE_PLAN = Struct(
    "kf_decode_planned",
    (
        ("plan", _I64),
        ("indptr", _I64),
        ("indices", _I64),
        ("workspace", _I64),
        ("partials", _I64),
        ("units", _I64),
        ("group", _I64),
        ("page_size", _I64),
        ("soft_cap", "double"),
    ),
)
DECODE_IO = Struct("kf_decode_layer", LAYER_FIELDS)
MAX_GROUP = 8  # GQA groups up to this are compile-time constants; larger ones (MQA) use group 0

# The contract with attention/work_plan.h, declared here once and emitted into the template.
PLAN_ERROR = Codes(
    "kf::attention::PlanError",
    (
        ("kPlanOk", 0),
        ("kIndptrStart", 1),
        ("kIndptrDecreasing", 2),
        ("kIndptrBeyond", 3),
        ("kLastPageLen", 4),
        ("kNegativePage", 5),
        ("kCapacity", 6),
    ),
)
PLAN_HEADER = Codes(
    "kf::attention::PlanHeader",
    (  # int32 slots of the plan buffer's header
        ("kNumLists", 0),
        ("kNumItems", 1),
        ("kNumMerges", 2),
        ("kNumSlots", 3),
        ("kMaxPage", 4),
        ("kHeadsPerUnit", 5),
        ("kHeaderSize", 8),
    ),
)
PLAN_INTS = Codes("kf::attention::PlanInts", (("kItemInts", 6), ("kMergeInts", 5)))  # WorkItem, MergeItem

DECODE = Module(
    "decode",
    "decode.cpp.jinja",
    params={
        "q_dtype": DType(),
        "kv_dtype": DType(KV_DTYPE_NAMES),
        "out_dtype": DType(),
        "head_dim": Int(minimum=1, maximum=512),
        "group": Int(minimum=0, maximum=MAX_GROUP),
    },
    structs=[DECODE_PLAN_ARGS, DECODE_PLAN, DECODE_IO],
    codes=[PLAN_ERROR, PLAN_HEADER, PLAN_INTS],
    entries=[
        Entry("plan", "const kf_decode_plan_args* args", returns=_I64),
        Entry("plan_capacity", "int64_t units, int64_t num_lists", returns=_I64),
        Entry("scratch_floats", "int64_t heads, int64_t group", returns=_I64),
        Entry("run", "const kf_decode_planned* plan, const kf_decode_layer* io"),
    ],
)

# Splitting a request's KV across threads costs a merge; pieces under this many tokens are not worth it.
_MIN_SPLIT, _NO_SPLIT = 128, 1 << 30
# Plan errors of work_plan.h: code -> (argument, what is wrong with element `index`).
# PLAN_ERROR's user errors: (argument, what is wrong with element {i}).
_PLAN_MESSAGES = {
    "kIndptrStart": ("indptr", "must start at 0"),
    "kIndptrDecreasing": ("indptr", "must be non-decreasing (indptr[{i} + 1] < indptr[{i}])"),
    "kIndptrBeyond": ("indptr", "ends beyond indices: indptr[-1] > len(indices)"),
    "kLastPageLen": ("last_page_len", "must be in [1, page_size] for a request with pages (request {i})"),
    "kNegativePage": ("indices", "holds a negative page index at position {i}"),
}


def decode_variant_params(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype, head_dim: int, group: int
) -> dict:
    """The DECODE variant serving these dtypes, head_dim and GQA group (plan() and pre-warm)."""
    check_head_dim("head_dim", head_dim)
    return {
        "q_dtype": dtype_param(q_dtype, "q_data_type", DECODE.params["q_dtype"].choices),
        "kv_dtype": dtype_param(kv_dtype, "kv_data_type", KV_DTYPE_NAMES),
        "out_dtype": dtype_param(out_dtype, "o_data_type", DECODE.params["out_dtype"].choices),
        "head_dim": head_dim,
        "group": group if group <= MAX_GROUP else 0,
    }


def _index_copy(t, name: str) -> torch.Tensor:
    """A private int32 copy of a 1-D CPU index tensor: run() must not see later edits to it."""
    return index_vector(t, name).clone()


class _DecodeProblem(NamedTuple):
    """plan()'s scalar arguments, checked: what the kernel variant, the partition and run() depend on."""

    num_qo_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    out_dtype: torch.dtype
    window_left: int
    soft_cap: float
    sm_scale: float | None  # as given: None is 1 / sqrt(head_dim), once the variant has checked head_dim


class _PageTable(NamedTuple):
    """The batch's page table as private int32 copies: run() must not see later edits to the caller's."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor

    @property
    def batch(self) -> int:
        return self.last_page_len.numel()


class _Partition(NamedTuple):
    """The plan: the batch's work (units of KV heads x KV tokens) cut into one list per thread, in the
    plan buffer (attention/work_plan.h's layout), and what its header says."""

    buffer: torch.Tensor  # int32: header, list offsets, work items, merges
    lists: int  # threads the work was cut for
    units: int  # batch * num_kv_heads: the buffer's layout; a unit may hold several KV heads
    num_slots: int  # partial states of split requests
    unit_heads: int  # KV heads per unit
    max_page: int  # the largest page the table names (-1: none)


class _WorkspaceLayout(NamedTuple):
    """Where run()'s buffers lie in the workspace, in bytes from its start: the split requests'
    partial states first, then each thread's scratch."""

    partials: int
    scratch: int
    total_bytes: int


def _checked_problem(
    num_qo_heads,
    num_kv_heads,
    head_dim: int,
    page_size,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    window_left,
    logits_soft_cap,
    sm_scale,
) -> _DecodeProblem:
    """plan()'s scalars checked (ValueError or TypeError naming the argument)."""
    group = check_heads(num_qo_heads, num_kv_heads)
    check_positive("page_size", page_size)
    soft_cap = checked_soft_cap(logits_soft_cap)
    window_left = checked_window(window_left)
    return _DecodeProblem(
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        q_dtype=dtypes[0],
        kv_dtype=dtypes[1],
        out_dtype=dtypes[2],
        window_left=window_left,
        soft_cap=soft_cap,
        sm_scale=sm_scale,
    )


def _checked_page_table(indptr, indices, last_page_len) -> _PageTable:
    """The page table's tensors checked (1-D CPU integers) and copied to int32."""
    last_page_len = _index_copy(last_page_len, "last_page_len")
    batch = last_page_len.numel()
    # FlashInfer's decode takes the batch from last_page_len and subtracts indptr from it entry by
    # entry (get_seq_lens), so unlike prefill's and MLA's plans it takes no longer indptr buffer.
    indptr = index_vector(indptr, "indptr", batch + 1, "len(last_page_len) + 1").clone()
    return _PageTable(indptr, _index_copy(indices, "indices"), last_page_len)


def _partition(kernel: Kernel, table: _PageTable, problem: _DecodeProblem, disable_split_kv: bool) -> _Partition:
    """The planner's partition of the batch across this process's threads; the page table's values
    (indptr order, last page lengths, page indices) are checked there, naming the argument."""
    lists = num_threads()
    units = table.batch * problem.num_kv_heads
    buffer = torch.empty(kernel.plan_capacity(units, lists), dtype=torch.int32)
    args = {
        "indptr": table.indptr.data_ptr(),
        "last_page_len": table.last_page_len.data_ptr(),
        "indices": table.indices.data_ptr(),
        "batch": table.batch,
        "num_indices": table.indices.numel(),
        "page_size": problem.page_size,
        "num_kv_heads": problem.num_kv_heads,
        "window_left": problem.window_left,
        "num_lists": lists,
        "min_split": _NO_SPLIT if disable_split_kv else _MIN_SPLIT,
        "plan": buffer.data_ptr(),
        "capacity": buffer.numel(),
    }
    error = kernel.plan(kernel.new("kf_decode_plan_args", args))
    if error:
        raise_plan_error(error, PLAN_ERROR, _PLAN_MESSAGES)
    header = buffer[: PLAN_HEADER.kHeaderSize].tolist()
    return _Partition(
        buffer=buffer,
        lists=lists,
        units=units,
        num_slots=header[PLAN_HEADER.kNumSlots],
        unit_heads=header[PLAN_HEADER.kHeadsPerUnit],
        max_page=header[PLAN_HEADER.kMaxPage],
    )


def _workspace_layout(kernel: Kernel, partition: _Partition, problem: _DecodeProblem) -> _WorkspaceLayout:
    """The workspace run() needs for this partition: a partial state (head_dim floats and an LSE) per
    query head of each split slot, then each thread's scratch, all fp32."""
    partial_floats = partition.num_slots * partition.unit_heads * problem.group * (problem.head_dim + 1)
    scratch_floats = partition.lists * kernel.scratch_floats(partition.unit_heads, problem.group)
    return _WorkspaceLayout(partials=0, scratch=4 * partial_floats, total_bytes=4 * (partial_floats + scratch_floats))


def _attention_plan(
    kernel: Kernel,
    problem: _DecodeProblem,
    table: _PageTable,
    partition: _Partition,
    layout: _WorkspaceLayout,
    workspace: torch.Tensor,
) -> AttentionPlan:
    """What run() reads: the kernel's plan struct (addresses into the kept tensors and the
    workspace) and the planned values it checks its arguments against."""
    base = workspace.data_ptr()
    plan_args = {
        "plan": partition.buffer.data_ptr(),
        "indptr": table.indptr.data_ptr(),
        "indices": table.indices.data_ptr(),
        "workspace": base + layout.scratch,
        "partials": base + layout.partials,
        "units": partition.units,
        "group": problem.group,
        "page_size": problem.page_size,
        "soft_cap": problem.soft_cap,
    }
    return AttentionPlan(
        kernel=kernel,
        args=kernel.new("kf_decode_planned", plan_args),
        io=kernel.new("kf_decode_layer"),
        keep=(partition.buffer, table.indptr, table.indices, table.last_page_len, workspace),
        batch=table.batch,
        q_shape=torch.Size((table.batch, problem.num_qo_heads, problem.head_dim)),
        num_kv_heads=problem.num_kv_heads,
        head_dim=problem.head_dim,
        head_dim_vo=problem.head_dim,
        page_size=problem.page_size,
        max_page=partition.max_page,
        q_dtype=problem.q_dtype,
        kv_dtype=problem.kv_dtype,
        out_dtype=problem.out_dtype,
        window_left=problem.window_left,
        soft_cap=problem.soft_cap,
        sm_scale=1.0 / math.sqrt(problem.head_dim) if problem.sm_scale is None else float(problem.sm_scale),
    )


class BatchDecodeWithPagedKVCacheWrapper(WorkspaceWrapper):
    """FlashInfer's batch decode wrapper: ``plan()`` once per batch, ``run()`` per layer.

    ``float_workspace_buffer`` is a CPU tensor (any dtype) that holds the split
    requests' partial states and each thread's scratch; ``plan()`` says how many
    bytes it needs when it is too small. ``use_tensor_cores`` chooses among GPU
    kernels in FlashInfer and changes nothing here.

    A wrapper serves one caller at a time, as FlashInfer's does: ``run()`` fills the plan's
    argument struct and its threads' scratch in the workspace, so Python threads that run at once
    need a wrapper (and workspace buffer) each; a wrapper planned on one thread may run on others,
    one ``run()`` at a time.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend: str = "auto",
        jit_args=None,
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)
        self._use_tensor_cores = bool(use_tensor_cores)

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables=None,
        seq_lens=None,
        fixed_split_size=None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        window_right: int = 0,
    ) -> None:
        """Check and copy the page table, pick the kernel, and partition the batch across threads."""
        self._plan = None
        check_pos_encoding_mode(pos_encoding_mode)
        reject_gpu_options(
            "decode",
            {"q_len_per_req": 1},
            block_tables=block_tables,
            seq_lens=seq_lens,
            fixed_split_size=fixed_split_size,
            q_len_per_req=q_len_per_req,
            window_right=window_right,
        )
        if data_type is not None:  # FlashInfer's deprecated spelling fills what is None
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        dtypes = plan_dtypes(q_data_type, kv_data_type, o_data_type)
        problem = _checked_problem(
            num_qo_heads, num_kv_heads, head_dim, page_size, dtypes, window_left, logits_soft_cap, sm_scale
        )
        table = _checked_page_table(indptr, indices, last_page_len)
        kernel = DECODE.variant(**decode_variant_params(*dtypes, head_dim, problem.group)).kernel()
        partition = _partition(kernel, table, problem, disable_split_kv)
        layout = _workspace_layout(kernel, partition, problem)
        workspace = self._workspace(layout.total_bytes)
        self._plan = _attention_plan(kernel, problem, table, partition, layout, workspace)

    begin_forward = plan

    def work_lists(self) -> list[list[tuple[int, int, int, int, int, int]]]:
        """The plan's partition, one list per thread, each of ``(request, kv_head, num_heads,
        kv_begin, kv_end, slot)`` items (``slot >= 0``: a piece of a request split across
        threads, merged by LSE). For tests and for looking at how a batch was balanced."""
        if self._plan is None:
            raise PlanStateError("work_lists() called before plan()")
        buffer = self._plan.keep[0].tolist()
        num_lists = buffer[PLAN_HEADER.kNumLists]
        start, size = PLAN_HEADER.kHeaderSize, PLAN_INTS.kItemInts
        offsets = buffer[start : start + num_lists + 1]
        items = buffer[start + num_lists + 1 :]
        return [
            [tuple(items[size * i : size * (i + 1)]) for i in range(offsets[n], offsets[n + 1])]
            for n in range(num_lists)
        ]

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl=None,
        window_left: int | None = None,
        sinks=None,
        q_len_per_req=None,
        skip_softmax_threshold_scale_factor=None,
        kv_cache_sf=None,
    ):
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
            raise NotImplementedError(
                "skip_softmax_threshold_scale_factor and kv_cache_sf (block-scaled KV) are "
                "not implemented by kernforge's decode"
            )
        if window_left is not None and checked_window(window_left) != plan.window_left:
            raise ValueError(f"window_left={window_left} differs from the planned {plan.window_left}; plan() again")
        if q_len_per_req not in (None, 1):
            raise NotImplementedError("q_len_per_req > 1 (several queries per request) is not implemented")
        cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        check_q(q, plan, plan.q_shape, "[batch, num_qo_heads, head_dim]")
        check_paged_cache(cache, plan, plan.head_dim, "indices")
        reads = (("q", q), ("paged_kv_cache", cache.source))
        out, lse = attention_outputs(out, lse, plan.q_shape, plan.out_dtype, return_lse, reads)
        qk_scale = logit_scale(plan.sm_scale, plan.soft_cap, q_scale, k_scale)
        fill_layer(plan.io, q, cache.k_ptr, cache.k_strides, cache.v_ptr, cache.v_strides, out, lse, qk_scale, v_scale)
        plan.kernel.run(plan.args, plan.io)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def bound_run(self, q: torch.Tensor, paged_kv_caches: Sequence[torch.Tensor], out: torch.Tensor) -> BoundCall:
        """``run(q, paged_kv_caches[i], out=out)`` with this plan, checked once for every cache of the
        list (a model's layers: tensors of one shape, strides and dtype), as a call of the cache's index:
        a prepared decode step's attention, bound once per step after ``plan()``."""
        plan = self._plan
        if plan is None:
            raise PlanStateError("bound_run() called before plan(): plan the batch first")
        caches = layer_caches(paged_kv_caches)
        first = caches[0]
        cache = unpack_paged_kv_cache(first, self._kv_layout)
        check_q(q, plan, plan.q_shape, "[batch, num_qo_heads, head_dim]")
        check_paged_cache(cache, plan, plan.head_dim, "indices")
        reads = (("q", q), ("paged_kv_caches", caches))
        out, _ = attention_outputs(out, None, plan.q_shape, plan.out_dtype, False, reads)
        qk_scale = logit_scale(plan.sm_scale, plan.soft_cap, None, None)
        k_offset, v_offset = cache.k_ptr - first.data_ptr(), cache.v_ptr - first.data_ptr()
        layers = []
        for t in caches:  # one struct per layer: its K and V planes
            io = plan.kernel.new("kf_decode_layer")
            k, v = t.data_ptr() + k_offset, t.data_ptr() + v_offset
            fill_layer(io, q, k, cache.k_strides, v, cache.v_strides, out, None, qk_scale, None)
            layers.append(io)
        run, args = plan.kernel.run, plan.args

        def attend(layer: int) -> None:
            run(args, layers[layer])

        return BoundCall(attend, q, out, caches, plan.keep)

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        pos_encoding_mode: str = "NONE",
        q_scale=None,
        k_scale=None,
        v_scale=None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale=None,
        rope_theta=None,
        return_lse: bool = False,
    ):
        """FlashInfer's deprecated spelling: these arguments replace the planned ones, then run()."""
        check_pos_encoding_mode(pos_encoding_mode)
        plan = self._plan
        if plan is None:
            raise PlanStateError("forward() called before plan(): plan the batch first")
        if checked_window(window_left) != plan.window_left or float(logits_soft_cap or 0.0) != plan.soft_cap:
            raise ValueError(
                "forward(): window_left and logits_soft_cap are part of the plan on the CPU; pass them to plan()"
            )
        plan.sm_scale = 1.0 / math.sqrt(plan.head_dim) if sm_scale is None else float(sm_scale)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    forward_return_lse = functools.partialmethod(forward, return_lse=True)


def single_decode_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False,
    q_scale=None,
    k_scale=None,
    v_scale=None,
    window_left: int = -1,
    logits_soft_cap=None,
    sm_scale=None,
    rope_scale=None,
    rope_theta=None,
    return_lse: bool = False,
):
    """Decode attention of one request: ``q [num_qo_heads, head_dim]`` over ``k``/``v``
    ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND).
    Returns ``out [num_qo_heads, head_dim]`` in q's dtype, or ``(out, lse [num_qo_heads])``."""
    check_pos_encoding_mode(pos_encoding_mode)
    check_kv_layout(kv_layout)
    for name, t, dims in (("q", q, 2), ("k", k, 3), ("v", v, 3)):
        check_request_tensor(t, name, query=name == "q")
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
        cache = tuple(
            torch.zeros(
                (1, 1, num_kv_heads, head_dim) if kv_layout == "NHD" else (1, num_kv_heads, 1, head_dim), dtype=k.dtype
            )
            for _ in range(2)
        )
    wrapper = single_request_wrapper(BatchDecodeWithPagedKVCacheWrapper, kv_layout)
    wrapper.plan(
        torch.tensor([0, 1 if kv_len else 0], dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.tensor([kv_len if kv_len else 1], dtype=torch.int32),
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        q_data_type=q.dtype,
        kv_data_type=k.dtype,
        sm_scale=sm_scale,
    )
    keep_workspace(wrapper)
    result = wrapper.run(
        q.unsqueeze(0), cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse
    )
    return (result[0][0], result[1][0]) if return_lse else result[0]


export("BatchDecodeWithPagedKVCacheWrapper", BatchDecodeWithPagedKVCacheWrapper)
export("single_decode_with_kv_cache", single_decode_with_kv_cache)


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    """The decode variant for a KV cache in the model's dtype and in each of ``kv_cache_dtypes`` (none
    for an MLA model: its decode runs the MLA wrapper, ``kernforge.ops.mla.attention``'s hook)."""
    if spec.is_mla:
        return []
    q = TORCH_DTYPES[dtype_name(spec.dtype)]
    return [
        {"module": "decode", "params": decode_variant_params(q, kv_cache_dtype(kv), q, spec.head_dim, spec.group)}
        for kv in [spec.dtype, *kv_cache_dtypes]
    ]
