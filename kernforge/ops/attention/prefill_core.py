"""The batch prefill kernel's core, which FlashInfer's prefill wrappers (``prefill``) and MLA's
wrapper (``kernforge.ops.mla.attention``) build on: the ``prefill`` kernel module (its plan and
layer structs, plan codes, tiles and tuner candidates), the variant for a problem
(:func:`prefill_variant_params`), and :class:`PrefillCore`, plan() and run()'s core: plan() checks
and copies the batch's indices, packs a custom mask and lists the work items (request, KV head,
query tile; tiles split along the KV when threads would idle), run() fills the layer struct and
makes one kernel call (``attention/prefill.h``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kernforge.jit import isa
from kernforge.jit.module import ALL_TIERS, Codes, DType, Entry, Int, IntTuple, Kernel, Module, Struct
from kernforge.jit.tuning import Candidate, Candidates
from kernforge.ops._common import MAX_HEAD_DIM, check_head_dim, index_vector, num_threads
from kernforge.ops.attention._wrapper import (
    KV_DTYPE_NAMES,
    LAYER_FIELDS,
    AttentionPlan,
    PlanStateError,
    WorkspaceWrapper,
    attention_outputs,
    check_heads,
    check_pos_encoding_mode,
    check_positive,
    check_q,
    checked_soft_cap,
    checked_window,
    dtype_param,
    fill_layer,
    logit_scale,
    plan_dtypes,
    raise_plan_error,
)

__all__ = [
    "MAX_HEAD_DIM_QK",
    "PE_FIELDS",
    "PLAN_ERROR",
    "PLAN_INTS",
    "PREFILL",
    "PREFILL_IO",
    "PREFILL_PLAN",
    "PREFILL_PLAN_ARGS",
    "TILES",
    "TILE_CANDIDATES",
    "PlanStateError",
    "PrefillCore",
    "check_positive",
    "prefill_variant_params",
    "tile_shape",
]

_I64 = "int64_t"
# The planner's input (the batch's int32 indices, its shape and mask) and where it writes: kv_len per
# request, the work items, the merges of split tiles, and the counts [items, merges, slots].
PREFILL_PLAN_ARGS = Struct(
    "kf_prefill_plan_args",
    tuple(
        (name, _I64)
        for name in (
            "qo_indptr",
            "kv_indptr",
            "last_page_len",
            "indices",
            "batch",
            "num_indices",
            "page_size",
            "num_kv_heads",
            "queries_per_tile",
            "window_left",
            "ragged",
            "causal",
            "custom_mask",
            "num_threads",
            "min_split_blocks",
            "kv_lens",
            "items",
            "item_capacity",
            "merges",
            "merge_capacity",
            "counts",
        )
    ),
)
# What run() reads of the plan, filled once by plan().
PREFILL_PLAN = Struct(
    "kf_prefill_planned",
    (
        ("items", _I64),
        ("num_items", _I64),
        ("merges", _I64),
        ("num_merges", _I64),
        ("partials", _I64),
        ("qo_indptr", _I64),
        ("kv_indptr", _I64),
        ("indices", _I64),
        ("kv_lens", _I64),
        ("mask", _I64),
        ("mask_offsets", _I64),
        ("workspace", _I64),
        ("scratch_bytes", _I64),
        ("max_threads", _I64),
        ("rows", _I64),
        ("group", _I64),
        ("queries_per_tile", _I64),
        ("page_size", _I64),
        ("ragged", _I64),
        ("causal", _I64),
        ("window_left", _I64),
        ("soft_cap", "double"),
        ("stats", _I64),
    ),
)
# MLA's rope parts in tensors of their own: the last pe_dim elements of q rows (q_pe) and of K rows
# (k_pe, paged like K); pe_dim 0 (a new struct's zero) for every other caller.
PE_FIELDS = (
    ("q_pe", _I64),
    ("q_pe_stride_token", _I64),
    ("q_pe_stride_head", _I64),
    ("k_pe", _I64),
    ("k_pe_stride_page", _I64),
    ("k_pe_stride_token", _I64),
    ("pe_dim", _I64),
)
PREFILL_IO = Struct("kf_prefill_layer", LAYER_FIELDS + PE_FIELDS)
# Wider than any per-head dim: MLA's absorbed q and K rows (latent 512 + rope 64).
MAX_HEAD_DIM_QK = 576
# (query rows per work item, keys per block): the tuner's candidates, the default first (on this
# Zen 5, causal 4096 tokens, 32/8 heads, head_dim 128: 128x64 65% of the bf16 peak, 64x64 60%,
# 64x128 58%, 32x64 55%); rows are queries x GQA group.
TILES = ((128, 64), (64, 64), (32, 64), (64, 128), (32, 32))

# The contract with attention/prefill.h, declared here once and emitted into the template.
PLAN_ERROR = Codes(
    "kf::attention::PrefillPlanError",
    (
        ("kPrefillBadQoIndptr", 1),
        ("kPrefillBadKvIndptr", 2),
        ("kPrefillBadLastPage", 3),
        ("kPrefillNegativePage", 4),
        ("kPrefillTooManyItems", 6),  # 5 was "causal qo_len > kv_len", now rows that see no key
    ),
)
# int32s per PrefillItem (request, kv_head, query_begin, kv_begin, kv_end, slot) and per PrefillMerge
# (request, kv_head, query_begin, first_slot, parts).
PLAN_INTS = Codes("kf::attention::PrefillInts", (("kItemInts", 6), ("kMergeInts", 5)))

PREFILL = Module(
    "prefill",
    "prefill.cpp.jinja",
    params={
        "q_dtype": DType(),
        "kv_dtype": DType(KV_DTYPE_NAMES),
        "out_dtype": DType(),
        "head_dim_qk": Int(minimum=1, maximum=MAX_HEAD_DIM_QK),
        "head_dim_vo": Int(minimum=1, maximum=MAX_HEAD_DIM),
        "tile": IntTuple(2, choices=TILES),
    },
    tiers=ALL_TIERS,  # the amx build multiplies bf16 in AMX tiles (gemm/amx_kernel.h)
    structs=[PREFILL_PLAN_ARGS, PREFILL_PLAN, PREFILL_IO],
    codes=[PLAN_ERROR, PLAN_INTS],
    entries=[
        Entry("plan", "const kf_prefill_plan_args* args", returns=_I64),
        Entry("scratch_bytes", "int64_t rows", returns=_I64),
        Entry("run", "const kf_prefill_planned* plan, const kf_prefill_layer* io"),
    ],
)


def _tile_candidate(tile: tuple[int, int], rank: int) -> Candidate:
    return Candidate({"tile": tile}, tuple(ALL_TIERS), rank)


TILE_CANDIDATES = Candidates(
    "prefill",
    PREFILL,
    candidates=[_tile_candidate(tile, rank) for rank, tile in enumerate(TILES[:-1])],
    reference=_tile_candidate(TILES[-1], len(TILES)),
    bucket=lambda s: f"{s['dtype']}_kv{s['kv_dtype']}_qk{s['head_dim_qk']}_vo{s['head_dim_vo']}_g{s['group']}",
)

# PLAN_ERROR's user errors: (argument, what is wrong with request or position {i}).
_PLAN_MESSAGES = {
    "kPrefillBadQoIndptr": ("qo_indptr", "must start at 0 and be non-decreasing (request {i})"),
    "kPrefillBadKvIndptr": (
        "kv_indptr",
        "must start at 0, be non-decreasing and stay within the indices (request {i})",
    ),
    "kPrefillBadLastPage": (
        "paged_kv_last_page_len",
        "must be in [1, page_size] for a request with pages (request {i})",
    ),
    "kPrefillNegativePage": ("paged_kv_indices", "holds a negative page index at position {i}"),
}
# A tile is split along the KV (when tiles are fewer than threads) into pieces of at least this
# many key blocks: each piece then costs a partial state and a share of the merge.
_MIN_SPLIT_BLOCKS = 2
# Bytes: run()'s workspace starts on a cache line.
_ALIGNMENT = 64


def _check_head_dims(head_dim_qk, head_dim_vo) -> None:
    check_head_dim("head_dim_qk", head_dim_qk, MAX_HEAD_DIM_QK)
    check_head_dim("head_dim_vo", head_dim_vo)


def prefill_variant_params(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    out_dtype: torch.dtype,
    head_dim_qk: int,
    head_dim_vo: int,
    group: int,
    tile: tuple[int, int] | None = None,
) -> dict:
    """The PREFILL variant for these dtypes and head dims: the tuned tile, else the default."""
    _check_head_dims(head_dim_qk, head_dim_vo)
    params = {
        "q_dtype": dtype_param(q_dtype, "q_data_type", PREFILL.params["q_dtype"].choices),
        "kv_dtype": dtype_param(kv_dtype, "kv_data_type", KV_DTYPE_NAMES),
        "out_dtype": dtype_param(out_dtype, "o_data_type", PREFILL.params["out_dtype"].choices),
        "head_dim_qk": head_dim_qk,
        "head_dim_vo": head_dim_vo,
    }
    if tile is None:
        shape = tile_shape(params, group)
        tile = TILE_CANDIDATES.choose(shape, tier=isa.selected_tier()).params["tile"]
    return {**params, "tile": tile}


def tile_shape(params: dict, group: int) -> dict:
    """The problem as the tile candidates see it."""
    return {
        "dtype": params["q_dtype"],
        "kv_dtype": params["kv_dtype"],
        "head_dim_qk": params["head_dim_qk"],
        "head_dim_vo": params["head_dim_vo"],
        "group": group,
    }


def _paged_table(kv_indptr, last_page_len, batch: int, buffers: bool):
    """``paged_kv_indptr`` and ``paged_kv_last_page_len`` for a batch of ``batch`` requests, as int32
    copies the plan keeps.

    As in FlashInfer, with ``buffers`` both may be longer than the batch (buffers preallocated for a
    larger one): their first ``batch + 1`` and ``batch`` entries are read. Its get_seq_lens
    subtracts them entry by entry, so they pair up: indptr one entry longer. Without ``buffers`` (a
    custom mask: FlashInfer's mask_indptr wants qo_indptr's length) both are the batch's exactly."""
    indptr = index_vector(kv_indptr, "paged_kv_indptr", batch + 1, "len(qo_indptr)", prefix=buffers)
    last = index_vector(last_page_len, "paged_kv_last_page_len", batch, "len(qo_indptr) - 1", prefix=buffers)
    if kv_indptr.numel() != last_page_len.numel() + 1:  # both 1-D tensors by now
        raise ValueError(
            f"paged_kv_indptr has {kv_indptr.numel()} entries and paged_kv_last_page_len "
            f"{last_page_len.numel()}: buffers longer than the batch must pair up, paged_kv_indptr one "
            "entry longer (FlashInfer computes the sequence lengths from both)"
        )
    return indptr.clone(), last.clone()


class PrefillCore(WorkspaceWrapper):
    """plan() and run()'s core of the wrappers on the prefill kernel: FlashInfer's paged and ragged
    prefill wrappers (``kernforge.ops.attention.prefill``) and MLA's (``kernforge.ops.mla.attention``).

    A subclass's plan() checks its own arguments and calls :meth:`_make_plan` (which leaves the
    :class:`~kernforge.ops.attention._wrapper.AttentionPlan` in ``self._plan``: None before plan()),
    and its run() calls :meth:`_launch` with the K and V rows, or checks q itself and calls
    :meth:`_launch_layer`."""

    _ragged = False

    def computed_blocks(self) -> int:
        """Key blocks (of a work item's query rows) the last run() computed: fully masked ones are
        skipped, so causal attention visits about half of them."""
        if self._plan is None:
            raise PlanStateError("computed_blocks() called before plan()")
        return int(self._plan.stats[0])

    def _make_plan(
        self,
        qo_indptr,
        kv_indptr,
        last_page_len,
        indices,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        head_dim_vo,
        page_size,
        custom_mask,
        packed_custom_mask,
        causal,
        pos_encoding_mode,
        window_left,
        logits_soft_cap,
        sm_scale,
        q_data_type,
        kv_data_type,
        o_data_type,
        tile=None,
        module: Module = PREFILL,
        disable_split_kv: bool = False,
        renamed: dict | None = None,
    ) -> None:
        """plan()'s shared path, paged (``last_page_len``, ``indices``, ``page_size``) or ragged
        (``self._ragged``: those unused): check the arguments, list the work items, lay out the
        workspace, and leave the plan in ``self._plan``. ``renamed`` maps a planner argument to the
        name the caller's API gives it; ``module``: PREFILL, or a test build of its template."""
        self._plan = None
        problem = _checked_problem(
            num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, pos_encoding_mode, causal, window_left,
            logits_soft_cap, sm_scale, (q_data_type, kv_data_type, o_data_type),
        )  # fmt: skip
        has_mask = custom_mask is not None or packed_custom_mask is not None
        table = _checked_table(qo_indptr, kv_indptr, last_page_len, indices, page_size, self._ragged, has_mask)
        params = prefill_variant_params(
            problem.q_dtype, problem.kv_dtype, problem.out_dtype, problem.head_dim_qk, problem.head_dim_vo,
            problem.group, tile,
        )  # fmt: skip
        kernel = module.variant(**params).kernel()
        work = _work_items(kernel, table, problem, params["tile"][0], has_mask, disable_split_kv, renamed)
        mask = None
        if has_mask:
            mask = _packed_mask(custom_mask, packed_custom_mask, table.qo_indptr, work.kv_lens[: table.batch])
        layout = _workspace_layout(kernel, work, problem.head_dim_vo)
        workspace = self._workspace(layout.total_bytes)
        self._plan = _attention_plan(kernel, problem, table, work, mask, layout, workspace)

    def _launch(self, q, k_ptr, k_strides, v_ptr, v_strides, out, lse, return_lse, q_scale, k_scale, v_scale, reads=()):
        """``reads``: ``(name, tensor)`` of what the run reads besides q (the K and V tensors), which a
        given out or lse must not overlap."""
        plan = self._plan
        q_shape = torch.Size((plan.total_q, plan.num_qo_heads, plan.head_dim_qk))
        check_q(q, plan, q_shape, "[qo_indptr[-1], num_qo_heads, head_dim_qk]", rows_name="qo_indptr[-1]")
        if isinstance(out, torch.Tensor) and out.dtype != plan.out_dtype:
            raise ValueError(
                f"The dtype of out {out.dtype} does not match the o_data_type {plan.out_dtype} "
                "specified in plan function."
            )
        return self._launch_layer(
            q, k_ptr, k_strides, v_ptr, v_strides, out, lse, return_lse, q_scale, k_scale, v_scale, (("q", q), *reads)
        )

    def _launch_layer(
        self, q, k_ptr, k_strides, v_ptr, v_strides, out, lse, return_lse, q_scale, k_scale, v_scale, reads=()
    ):
        """One layer on the plan, ``q`` checked by the caller: ``out`` (and ``lse``) checked or
        allocated (apart from ``reads``, ``(name, tensor)`` of what the run reads), the layer struct
        filled (its PE_FIELDS as the caller left them), one kernel call."""
        plan = self._plan
        shape = torch.Size((plan.total_q, plan.num_qo_heads, plan.head_dim_vo))
        out, lse = attention_outputs(out, lse, shape, plan.out_dtype, return_lse, reads)
        qk_scale = logit_scale(plan.sm_scale, plan.soft_cap, q_scale, k_scale)
        fill_layer(plan.io, q, k_ptr, k_strides, v_ptr, v_strides, out, lse, qk_scale, v_scale)
        plan.kernel.run(plan.args, plan.io)
        return (out, lse) if return_lse else out


class _PrefillProblem(NamedTuple):
    """plan()'s scalar arguments, checked: what the kernel variant, the work items and run() depend on."""

    num_qo_heads: int
    num_kv_heads: int
    group: int
    head_dim_qk: int
    head_dim_vo: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    out_dtype: torch.dtype
    causal: bool
    window_left: int
    soft_cap: float
    sm_scale: float | None  # as given: None is 1 / sqrt(head_dim_qk)


class _BatchTable(NamedTuple):
    """The batch's index tensors as the int32 copies the plan keeps (run() must not see later edits
    to the caller's). A ragged batch has no pages: its ``last_page_len`` and ``indices`` are
    ``kv_indptr`` (any valid address; the kernel does not read them) and its page size 1."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor
    indices: torch.Tensor
    num_indices: int
    page_size: int
    ragged: bool
    total_q: int  # qo_indptr[-1]: the batch's query rows
    kv_end: int  # kv_indptr[-1]: the batch's K/V rows (ragged) or pages (paged)

    @property
    def batch(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def kv_indptr_name(self) -> str:
        return "kv_indptr" if self.ragged else "paged_kv_indptr"

    def max_kv_index(self) -> int | None:
        """A ragged batch's K/V rows (what run()'s ``k`` and ``v`` must hold); None for pages."""
        return self.kv_end if self.ragged else None

    def max_page(self) -> int:
        """The largest page the batch reads (-1: none; run() checks the cache holds it)."""
        return int(self.indices[: self.kv_end].max()) if not self.ragged and self.kv_end > 0 else -1


class _WorkItems(NamedTuple):
    """The plan: the planner's work items (request, KV head, query tile; tiles split along the KV
    when threads would idle), the merges of split tiles, and each request's kv_len."""

    items: torch.Tensor  # int32, PLAN_INTS.kItemInts per item
    merges: torch.Tensor  # int32, PLAN_INTS.kMergeInts per merge
    kv_lens: torch.Tensor  # int32 [max(batch, 1)]: the planner writes the first batch
    num_items: int
    num_merges: int
    slots: int  # partial states of split tiles
    queries_per_tile: int
    rows: int  # query rows per item: queries_per_tile * group
    threads: int


class _WorkspaceLayout(NamedTuple):
    """Where run()'s buffers lie in the workspace, in bytes from its first 64-byte boundary: each
    thread's scratch, then the split tiles' partial states."""

    scratch_bytes: int  # per thread
    partials: int
    total_bytes: int  # with the slack for the alignment


def _checked_problem(
    num_qo_heads,
    num_kv_heads,
    head_dim_qk,
    head_dim_vo,
    pos_encoding_mode,
    causal,
    window_left,
    logits_soft_cap,
    sm_scale,
    data_types: tuple,
) -> _PrefillProblem:
    """plan()'s scalars checked, each error a ValueError or TypeError naming the argument (FlashInfer's
    type where it has one); head_dim_vo defaults to head_dim_qk, the dtypes to q's."""
    check_pos_encoding_mode(pos_encoding_mode)
    group = check_heads(num_qo_heads, num_kv_heads)
    head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
    _check_head_dims(head_dim_qk, head_dim_vo)
    q_dtype, kv_dtype, out_dtype = plan_dtypes(*data_types)
    return _PrefillProblem(
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        out_dtype=out_dtype,
        causal=bool(causal),
        soft_cap=checked_soft_cap(logits_soft_cap),
        window_left=checked_window(window_left),
        sm_scale=sm_scale,
    )


def _checked_table(
    qo_indptr, kv_indptr, last_page_len, indices, page_size, ragged: bool, has_mask: bool
) -> _BatchTable:
    """The batch's index tensors checked (1-D CPU integers of the batch's lengths) and copied; the
    batch is qo_indptr's. Their values are the planner's to check."""
    qo_indptr = index_vector(qo_indptr, "qo_indptr").clone()
    batch = qo_indptr.numel() - 1
    if batch < 0:
        raise ValueError("qo_indptr must have batch_size + 1 >= 1 entries, got an empty tensor")
    total_q = int(qo_indptr[-1])
    if ragged:  # FlashInfer's ragged plan wants kv_indptr exactly as long as qo_indptr
        kv_indptr = index_vector(kv_indptr, "kv_indptr", batch + 1, "len(qo_indptr)").clone()
        return _BatchTable(qo_indptr, kv_indptr, kv_indptr, kv_indptr, 0, 1, True, total_q, int(kv_indptr[-1]))
    kv_indptr, last_page_len = _paged_table(kv_indptr, last_page_len, batch, buffers=not has_mask)
    indices = index_vector(indices, "paged_kv_indices").clone()
    check_positive("page_size", page_size)
    pages = int(kv_indptr[-1])
    return _BatchTable(qo_indptr, kv_indptr, last_page_len, indices, indices.numel(), page_size, False, total_q, pages)


def _work_items(
    kernel: Kernel,
    table: _BatchTable,
    problem: _PrefillProblem,
    rows_per_tile: int,
    has_mask: bool,
    disable_split_kv: bool,
    renamed: dict | None,
) -> _WorkItems:
    """The planner's work items for the batch, largest first; it checks the index tensors' values
    (ValueError naming the argument, as ``renamed`` renames it)."""
    queries_per_tile = max(1, rows_per_tile // problem.group)
    threads = num_threads()
    # At least the tiles the batch has; split tiles make at most twice as many pieces, plus threads.
    tiles = (table.total_q // queries_per_tile + table.batch) * problem.num_kv_heads
    item_capacity, merge_capacity = 2 * (tiles + threads), max(tiles, 1)
    items = torch.empty(item_capacity * PLAN_INTS.kItemInts, dtype=torch.int32)
    merges = torch.empty(merge_capacity * PLAN_INTS.kMergeInts, dtype=torch.int32)
    kv_lens = torch.empty(max(table.batch, 1), dtype=torch.int32)
    counts = torch.zeros(3, dtype=torch.int64)  # items, merges, slots
    args = {
        "qo_indptr": table.qo_indptr.data_ptr(),
        "kv_indptr": table.kv_indptr.data_ptr(),
        "last_page_len": table.last_page_len.data_ptr(),
        "indices": table.indices.data_ptr(),
        "batch": table.batch,
        "num_indices": table.num_indices,
        "page_size": table.page_size,
        "num_kv_heads": problem.num_kv_heads,
        "queries_per_tile": queries_per_tile,
        "window_left": problem.window_left,
        "ragged": int(table.ragged),
        "causal": int(problem.causal),
        "custom_mask": int(has_mask),
        "num_threads": 1 if disable_split_kv else threads,
        "min_split_blocks": _MIN_SPLIT_BLOCKS,
        "kv_lens": kv_lens.data_ptr(),
        "items": items.data_ptr(),
        "item_capacity": item_capacity,
        "merges": merges.data_ptr(),
        "merge_capacity": merge_capacity,
        "counts": counts.data_ptr(),
    }
    error = kernel.plan(kernel.new("kf_prefill_plan_args", args))
    if error:
        names = {"kv_indptr": table.kv_indptr_name, **(renamed or {})}
        raise_plan_error(error, PLAN_ERROR, _PLAN_MESSAGES, names)
    num_items, num_merges, slots = counts.tolist()
    rows = queries_per_tile * problem.group
    return _WorkItems(items, merges, kv_lens, num_items, num_merges, slots, queries_per_tile, rows, threads)


def _workspace_layout(kernel: Kernel, work: _WorkItems, head_dim_vo: int) -> _WorkspaceLayout:
    """The workspace run() needs: each thread's scratch for a tile of ``work.rows`` query rows, then a
    partial state (head_dim_vo floats and an LSE per row) per split slot."""
    scratch_bytes = kernel.scratch_bytes(work.rows)
    partials = work.threads * scratch_bytes
    partial_bytes = work.slots * work.rows * (head_dim_vo + 1) * 4
    return _WorkspaceLayout(scratch_bytes, partials, partials + partial_bytes + _ALIGNMENT)


def _attention_plan(
    kernel: Kernel,
    problem: _PrefillProblem,
    table: _BatchTable,
    work: _WorkItems,
    mask: tuple[torch.Tensor, torch.Tensor] | None,
    layout: _WorkspaceLayout,
    workspace: torch.Tensor,
) -> AttentionPlan:
    """What run() reads: the kernel's plan struct (addresses into the kept tensors and the workspace)
    and the planned values it checks its arguments against."""
    base = -(-workspace.data_ptr() // _ALIGNMENT) * _ALIGNMENT
    stats = torch.zeros(1, dtype=torch.int64)
    mask_bits, mask_offsets = mask if mask is not None else (None, None)
    plan_args = {
        "items": work.items.data_ptr(),
        "num_items": work.num_items,
        "merges": work.merges.data_ptr(),
        "num_merges": work.num_merges,
        "partials": base + layout.partials,
        "qo_indptr": table.qo_indptr.data_ptr(),
        "kv_indptr": table.kv_indptr.data_ptr(),
        "indices": table.indices.data_ptr(),
        "kv_lens": work.kv_lens.data_ptr(),
        "mask": 0 if mask_bits is None else mask_bits.data_ptr(),
        "mask_offsets": 0 if mask_offsets is None else mask_offsets.data_ptr(),
        "workspace": base,
        "scratch_bytes": layout.scratch_bytes,
        "max_threads": work.threads,
        "rows": work.rows,
        "group": problem.group,
        "queries_per_tile": work.queries_per_tile,
        "page_size": table.page_size,
        "ragged": int(table.ragged),
        "causal": int(problem.causal),
        "window_left": problem.window_left,
        "soft_cap": problem.soft_cap,
        "stats": stats.data_ptr(),
    }
    keep = (work.items, work.merges, table, work.kv_lens, mask_bits, mask_offsets, workspace)
    return AttentionPlan(
        kernel=kernel,
        args=kernel.new("kf_prefill_planned", plan_args),
        io=kernel.new("kf_prefill_layer"),
        keep=keep,
        stats=stats,
        batch=table.batch,
        total_q=table.total_q,
        num_qo_heads=problem.num_qo_heads,
        num_kv_heads=problem.num_kv_heads,
        head_dim_qk=problem.head_dim_qk,
        head_dim_vo=problem.head_dim_vo,
        page_size=table.page_size,
        q_dtype=problem.q_dtype,
        kv_dtype=problem.kv_dtype,
        out_dtype=problem.out_dtype,
        window_left=problem.window_left,
        soft_cap=problem.soft_cap,
        max_kv_index=table.max_kv_index(),
        max_page=table.max_page(),
        sm_scale=1.0 / math.sqrt(problem.head_dim_qk) if problem.sm_scale is None else float(problem.sm_scale),
    )


def _packed_mask(custom_mask, packed_custom_mask, qo_indptr, kv_lens):
    """The custom mask as little-endian bits, each request from a byte boundary (FlashInfer's
    segment_packbits), and each request's first bit; checks its length against the batch."""
    lengths = (qo_indptr[1:] - qo_indptr[:-1]).long() * kv_lens.long()
    byte_lengths = (lengths + 7) // 8
    byte_offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(byte_lengths, 0, out=byte_offsets[1:])
    if packed_custom_mask is not None:
        if not isinstance(packed_custom_mask, torch.Tensor):
            raise TypeError(f"packed_custom_mask must be a torch.Tensor, got {type(packed_custom_mask).__name__}")
        if packed_custom_mask.device.type != "cpu":
            raise ValueError(f"packed_custom_mask is on device {packed_custom_mask.device}; kernforge runs on the CPU")
        if packed_custom_mask.dtype != torch.uint8 or packed_custom_mask.dim() != 1:
            raise ValueError(
                f"packed_custom_mask must be a 1-D uint8 tensor, got {packed_custom_mask.dtype} "
                f"of shape {tuple(packed_custom_mask.shape)}"
            )
        if packed_custom_mask.numel() < int(byte_offsets[-1]):
            raise ValueError(
                f"packed_custom_mask holds {packed_custom_mask.numel()} bytes; the batch needs "
                f"{int(byte_offsets[-1])} (each request's qo_len * kv_len bits, from a byte boundary)"
            )
        return packed_custom_mask.cpu().contiguous().clone(), byte_offsets * 8
    if not isinstance(custom_mask, torch.Tensor):
        raise TypeError(f"custom_mask must be a torch.Tensor, got {type(custom_mask).__name__}")
    if custom_mask.device.type != "cpu":
        raise ValueError(f"custom_mask is on device {custom_mask.device}; kernforge runs on the CPU")
    flat = custom_mask.reshape(-1)
    if flat.numel() != int(lengths.sum()):
        raise ValueError(
            f"custom_mask must hold sum(qo_len * kv_len) = {int(lengths.sum())} entries (each "
            f"request's [qo_len, kv_len] mask, flattened), got {flat.numel()}"
        )
    packed = torch.zeros(max(int(byte_offsets[-1]), 1), dtype=torch.uint8)
    bit_weights = 1 << torch.arange(8, dtype=torch.int32)
    start = 0
    for b, length in enumerate(lengths.tolist()):
        bits = flat[start : start + length].to(torch.int32)
        start += length
        padded = torch.zeros(-(-length // 8) * 8, dtype=torch.int32)
        padded[:length] = bits != 0
        packed[int(byte_offsets[b]) : int(byte_offsets[b + 1])] = (
            (padded.view(-1, 8) * bit_weights).sum(1).to(torch.uint8)
        )
    return packed, byte_offsets * 8
