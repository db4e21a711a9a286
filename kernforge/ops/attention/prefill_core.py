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

import torch

from kernforge.jit import isa
from kernforge.jit.module import ALL_TIERS, Codes, DType, Entry, Int, IntTuple, Module, Struct
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
        self._plan = None
        check_pos_encoding_mode(pos_encoding_mode)
        group = check_heads(num_qo_heads, num_kv_heads)
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
        _check_head_dims(head_dim_qk, head_dim_vo)
        q_dtype, kv_dtype, out_dtype = plan_dtypes(q_data_type, kv_data_type, o_data_type)
        soft_cap = checked_soft_cap(logits_soft_cap)
        window_left = checked_window(window_left)

        qo_indptr = index_vector(qo_indptr, "qo_indptr").clone()
        batch = qo_indptr.numel() - 1
        if batch < 0:
            raise ValueError("qo_indptr must have batch_size + 1 >= 1 entries, got an empty tensor")
        has_mask = custom_mask is not None or packed_custom_mask is not None
        kv_name = "kv_indptr" if self._ragged else "paged_kv_indptr"
        if self._ragged:  # FlashInfer's ragged plan wants kv_indptr exactly as long as qo_indptr
            kv_indptr = index_vector(kv_indptr, kv_name, batch + 1, "len(qo_indptr)").clone()
            last_page_len = indices = kv_indptr  # unused by the ragged kernel; any valid address
            num_indices = 0
        else:
            kv_indptr, last_page_len = _paged_table(kv_indptr, last_page_len, batch, buffers=not has_mask)
            indices = index_vector(indices, "paged_kv_indices").clone()
            num_indices = indices.numel()
            check_positive("page_size", page_size)

        params = prefill_variant_params(q_dtype, kv_dtype, out_dtype, head_dim_qk, head_dim_vo, group, tile)
        kernel = module.variant(**params).kernel()  # module: PREFILL, or a test build of its template
        rows_per_item = params["tile"][0]
        queries_per_tile = max(1, rows_per_item // group)
        total_q = int(qo_indptr[-1])
        threads = num_threads()
        tiles = (total_q // queries_per_tile + batch) * num_kv_heads  # at least the tiles the batch has
        item_capacity = 2 * (tiles + threads)  # plan_prefill's bound on the pieces of split tiles
        items = torch.empty(item_capacity * PLAN_INTS.kItemInts, dtype=torch.int32)
        merges = torch.empty(max(tiles, 1) * PLAN_INTS.kMergeInts, dtype=torch.int32)
        kv_lens = torch.empty(max(batch, 1), dtype=torch.int32)
        counts = torch.zeros(3, dtype=torch.int64)  # items, merges, slots
        error = kernel.plan(
            kernel.new(
                "kf_prefill_plan_args",
                {
                    "qo_indptr": qo_indptr.data_ptr(),
                    "kv_indptr": kv_indptr.data_ptr(),
                    "last_page_len": last_page_len.data_ptr(),
                    "indices": indices.data_ptr(),
                    "batch": batch,
                    "num_indices": num_indices,
                    "page_size": page_size if not self._ragged else 1,
                    "num_kv_heads": num_kv_heads,
                    "queries_per_tile": queries_per_tile,
                    "window_left": window_left,
                    "ragged": int(self._ragged),
                    "causal": int(bool(causal)),
                    "custom_mask": int(has_mask),
                    "num_threads": 1 if disable_split_kv else threads,
                    "min_split_blocks": _MIN_SPLIT_BLOCKS,
                    "kv_lens": kv_lens.data_ptr(),
                    "items": items.data_ptr(),
                    "item_capacity": item_capacity,
                    "merges": merges.data_ptr(),
                    "merge_capacity": max(tiles, 1),
                    "counts": counts.data_ptr(),
                },
            )
        )
        if error:
            raise_plan_error(error, PLAN_ERROR, _PLAN_MESSAGES, {"kv_indptr": kv_name, **(renamed or {})})
        num_items, num_merges, slots = counts.tolist()

        mask = mask_offsets = None
        if has_mask:
            mask, mask_offsets = _packed_mask(custom_mask, packed_custom_mask, qo_indptr, kv_lens[:batch])

        rows = queries_per_tile * group
        scratch = kernel.scratch_bytes(rows)
        partial_bytes = slots * rows * (head_dim_vo + 1) * 4
        workspace = self._workspace(threads * scratch + partial_bytes + 64)
        stats = torch.zeros(1, dtype=torch.int64)
        base = (workspace.data_ptr() + 63) // 64 * 64
        plan_args = kernel.new(
            "kf_prefill_planned",
            {
                "items": items.data_ptr(),
                "num_items": num_items,
                "merges": merges.data_ptr(),
                "num_merges": num_merges,
                "partials": base + threads * scratch,
                "qo_indptr": qo_indptr.data_ptr(),
                "kv_indptr": kv_indptr.data_ptr(),
                "indices": indices.data_ptr(),
                "kv_lens": kv_lens.data_ptr(),
                "mask": 0 if mask is None else mask.data_ptr(),
                "mask_offsets": 0 if mask_offsets is None else mask_offsets.data_ptr(),
                "workspace": base,
                "scratch_bytes": scratch,
                "max_threads": threads,
                "rows": rows,
                "group": group,
                "queries_per_tile": queries_per_tile,
                "page_size": page_size if not self._ragged else 1,
                "ragged": int(self._ragged),
                "causal": int(bool(causal)),
                "window_left": window_left,
                "soft_cap": soft_cap,
                "stats": stats.data_ptr(),
            },
        )
        self._plan = AttentionPlan(
            kernel=kernel,
            args=plan_args,
            io=kernel.new("kf_prefill_layer"),
            keep=(items, merges, qo_indptr, kv_indptr, indices, last_page_len, kv_lens, mask, mask_offsets, workspace),
            stats=stats,
            batch=batch,
            total_q=total_q,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo,
            page_size=page_size,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            out_dtype=out_dtype,
            window_left=window_left,
            soft_cap=soft_cap,
            max_kv_index=int(kv_indptr[-1]) if self._ragged else None,
            max_page=int(indices[: int(kv_indptr[-1])].max()) if not self._ragged and int(kv_indptr[-1]) > 0 else -1,
            sm_scale=1.0 / math.sqrt(head_dim_qk) if sm_scale is None else float(sm_scale),
        )

    def _launch(self, q, k_ptr, k_strides, v_ptr, v_strides, out, lse, return_lse, q_scale, k_scale, v_scale):
        plan = self._plan
        q_shape = torch.Size((plan.total_q, plan.num_qo_heads, plan.head_dim_qk))
        check_q(q, plan, q_shape, "[qo_indptr[-1], num_qo_heads, head_dim_qk]", rows_name="qo_indptr[-1]")
        if isinstance(out, torch.Tensor) and out.dtype != plan.out_dtype:
            raise ValueError(
                f"The dtype of out {out.dtype} does not match the o_data_type {plan.out_dtype} "
                "specified in plan function."
            )
        return self._launch_layer(
            q, k_ptr, k_strides, v_ptr, v_strides, out, lse, return_lse, q_scale, k_scale, v_scale
        )

    def _launch_layer(self, q, k_ptr, k_strides, v_ptr, v_strides, out, lse, return_lse, q_scale, k_scale, v_scale):
        """One layer on the plan, ``q`` checked by the caller: ``out`` (and ``lse``) checked or
        allocated, the layer struct filled (its PE_FIELDS as the caller left them), one kernel call."""
        plan = self._plan
        out, lse = attention_outputs(
            out, lse, torch.Size((plan.total_q, plan.num_qo_heads, plan.head_dim_vo)), plan.out_dtype, return_lse
        )
        qk_scale = logit_scale(plan.sm_scale, plan.soft_cap, q_scale, k_scale)
        fill_layer(plan.io, q, k_ptr, k_strides, v_ptr, v_strides, out, lse, qk_scale, v_scale)
        plan.kernel.run(plan.args, plan.io)
        return (out, lse) if return_lse else out


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
