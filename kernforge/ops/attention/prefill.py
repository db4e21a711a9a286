"""Prefill attention with FlashInfer's API: batch prefill over a paged or a ragged KV cache, and
single prefill.

``plan()`` runs once per batch: it checks and copies the index tensors, computes each request's
kv_len, packs a custom mask, and lists the work items (request, KV head, query tile), largest
first, which run()'s threads take dynamically (``attention/prefill.h``). ``run()`` then serves
every layer of the step with one call.

Semantics follow FlashInfer: causal is aligned bottom-right (query ``i`` of a request with
``qo_len`` queries and ``kv_len`` keys sees keys ``j <= kv_len - qo_len + i``, so with qo_len >
kv_len the first qo_len - kv_len queries see none); a custom mask (bool, each request's
``[qo_len, kv_len]`` row-major, requests concatenated; or ``packed_custom_mask``, the same packed
little-endian per request, each request starting on a byte, as ``segment_packbits`` makes it)
replaces the causal mask; ``window_left = w >= 0`` keeps keys ``j >= kv_len - qo_len + i - w``
under any mask; ``logits_soft_cap`` applies ``cap * tanh(sm_scale * q.k / cap)``; LSE is base 2;
a query that sees no key gets zeros and LSE ``-inf``; ``k_scale`` multiplies the logits and
``v_scale`` the output. What FlashInfer offers and kernforge does not (RoPE or ALiBi inside the
kernel, CUDA graphs, multi-item scoring) raises ``NotImplementedError``.
"""

from __future__ import annotations

import functools
import math

import torch

from kernforge.jit import isa
from kernforge.jit.module import ALL_TIERS, Codes, DType, Entry, Int, IntTuple, Module, Struct
from kernforge.jit.tuning import Candidate, Candidates
from kernforge.ops._common import (
    MAX_HEAD_DIM,
    TORCH_DTYPES,
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
from kernforge.ops.attention.page import check_kv_layout, unpack_paged_kv_cache

_I64 = "int64_t"
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
    structs=[PREFILL_PLAN, PREFILL_IO],
    codes=[PLAN_ERROR, PLAN_INTS],
    entries=[
        Entry(
            "plan",
            "int64_t qo_indptr, int64_t kv_indptr, int64_t last_page_len, int64_t indices, "
            "int64_t batch, int64_t num_indices, int64_t page_size, int64_t num_kv_heads, "
            "int64_t queries_per_tile, int64_t window_left, int64_t ragged, int64_t causal, "
            "int64_t custom_mask, int64_t num_threads, int64_t min_split_blocks, int64_t kv_lens, "
            "int64_t items, int64_t item_capacity, int64_t merges, int64_t merge_capacity, int64_t counts",
            returns=_I64,
        ),
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


class _PrefillWrapper(WorkspaceWrapper):
    """What the paged and the ragged wrappers share: plan() and run()'s core."""

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
            qo_indptr.data_ptr(),
            kv_indptr.data_ptr(),
            last_page_len.data_ptr(),
            indices.data_ptr(),
            batch,
            num_indices,
            page_size if not self._ragged else 1,
            num_kv_heads,
            queries_per_tile,
            window_left,
            int(self._ragged),
            int(bool(causal)),
            int(has_mask),
            1 if disable_split_kv else threads,
            _MIN_SPLIT_BLOCKS,
            kv_lens.data_ptr(),
            items.data_ptr(),
            item_capacity,
            merges.data_ptr(),
            max(tiles, 1),
            counts.data_ptr(),
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


class BatchPrefillWithPagedKVCacheWrapper(_PrefillWrapper):
    """FlashInfer's batch prefill over a paged KV cache: ``plan()`` once per batch, ``run()`` per layer."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        fixed_split_size=None,
        disable_split_kv: bool = False,
    ) -> None:
        """Check and copy the batch's indices, pick the kernel and list the work items. The batch is
        qo_indptr's; as in FlashInfer, paged_kv_indptr and paged_kv_last_page_len may be buffers
        longer than it (paired: indptr one entry longer), except with a custom mask."""
        reject_gpu_options(
            "prefill",
            prefix_len_ptr=prefix_len_ptr,
            token_pos_in_items_ptr=token_pos_in_items_ptr,
            max_item_len_ptr=max_item_len_ptr,
            seq_lens=seq_lens,
            seq_lens_q=seq_lens_q,
            block_tables=block_tables,
            fixed_split_size=fixed_split_size,
        )
        if head_dim_vo is not None and head_dim_vo != head_dim_qk:
            raise ValueError(
                f"head_dim_vo ({head_dim_vo}) != head_dim_qk ({head_dim_qk}): a paged cache holds K and "
                "V rows of one head_dim; use BatchPrefillWithRaggedKVCacheWrapper for MLA-shaped heads"
            )
        self._make_plan(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_last_page_len,
            paged_kv_indices,
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
            disable_split_kv=disable_split_kv,
        )

    begin_forward = plan

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
        kv_cache_sf=None,
        skip_softmax_threshold_scale_factor=None,
    ):
        """Attention of ``q [qo_indptr[-1], num_qo_heads, head_dim]`` over the planned pages:
        ``out``, or ``(out, lse)`` with ``return_lse``."""
        plan = self._plan
        if plan is None:
            raise PlanStateError("run() called before plan(): plan the batch first")
        if args:
            raise TypeError(f"run() takes q and paged_kv_cache positionally, got {len(args)} more positional arguments")
        reject_gpu_options(
            "prefill",
            sinks=sinks,
            kv_cache_sf=kv_cache_sf,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
        )
        if window_left is not None and checked_window(window_left) != plan.window_left:
            raise ValueError(f"window_left={window_left} differs from the planned {plan.window_left}; plan() again")
        cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        check_paged_cache(cache, plan, plan.head_dim_qk, "paged_kv_indices")
        return self._launch(
            q,
            cache.k_ptr,
            cache.k_strides,
            cache.v_ptr,
            cache.v_strides,
            out,
            lse,
            return_lse,
            q_scale,
            k_scale,
            v_scale,
        )

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(
        self,
        q,
        paged_kv_cache,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale=None,
        v_scale=None,
        window_left: int = -1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        return_lse: bool = False,
    ):
        """FlashInfer's deprecated spelling: run() with the planned mask and scales."""
        _check_forward(self._plan, causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    forward_return_lse = functools.partialmethod(forward, return_lse=True)


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapper):
    """FlashInfer's batch prefill over ragged K/V tensors: ``plan()`` once per batch, ``run()`` per layer."""

    _ragged = True

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf=None,
        kv_indptr_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr=None,
        fixed_split_size=None,
        disable_split_kv: bool = False,
        seq_lens=None,
        seq_lens_q=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        v_indptr=None,
        o_indptr=None,
    ) -> None:
        """Check and copy the batch's indices, pick the kernel and list the work items."""
        reject_gpu_options(
            "prefill",
            prefix_len_ptr=prefix_len_ptr,
            token_pos_in_items_ptr=token_pos_in_items_ptr,
            max_item_len_ptr=max_item_len_ptr,
            fixed_split_size=fixed_split_size,
            seq_lens=seq_lens,
            seq_lens_q=seq_lens_q,
            v_indptr=v_indptr,
            o_indptr=o_indptr,
        )
        self._make_plan(
            qo_indptr,
            kv_indptr,
            None,
            None,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            head_dim_vo,
            1,
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
            disable_split_kv=disable_split_kv,
        )

    begin_forward = plan

    def plan_with_tile(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        tile: tuple[int, int],
        head_dim_vo: int | None = None,
        causal: bool = True,
        window_left: int = -1,
        q_data_type=torch.bfloat16,
        kv_data_type=None,
        module: Module = PREFILL,
    ) -> None:
        """plan() with the tile forced (kernforge's, not FlashInfer's: what the tuner, the
        benchmarks and the tests time or check); ``module``: PREFILL or a test build of its template."""
        self._make_plan(
            qo_indptr, kv_indptr, None, None, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, 1, None, None,
            causal, "NONE", window_left, None, None, q_data_type, kv_data_type, None, tile, module=module,
        )  # fmt: skip

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        o_scale=None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl=None,
        kv_cache_sf=None,
    ):
        """Attention of ``q [qo_indptr[-1], num_qo_heads, head_dim_qk]`` over ``k``/``v``
        ``[kv_indptr[-1], num_kv_heads, head_dim]`` (NHD; HND: heads first)."""
        plan = self._plan
        if plan is None:
            raise PlanStateError("run() called before plan(): plan the batch first")
        if args:
            raise TypeError(f"run() takes q, k and v positionally, got {len(args)} more positional arguments")
        reject_gpu_options("prefill", o_scale=o_scale, kv_cache_sf=kv_cache_sf)
        k_strides = _ragged_strides(k, "k", plan, plan.head_dim_qk, self._kv_layout)
        v_strides = _ragged_strides(v, "v", plan, plan.head_dim_vo, self._kv_layout)
        return self._launch(
            q, k.data_ptr(), k_strides, v.data_ptr(), v_strides, out, lse, return_lse, q_scale, k_scale, v_scale
        )

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def traced_tensors(self, q, k, v) -> list[torch.Tensor]:
        return [q, k, v]

    def run_arguments(self, tensors: list) -> tuple:
        return tuple(tensors)

    def forward(
        self,
        q,
        k,
        v,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        return_lse: bool = False,
    ):
        """FlashInfer's deprecated spelling: run() with the planned mask and scales."""
        _check_forward(self._plan, causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale)
        return self.run(q, k, v, return_lse=return_lse)

    forward_return_lse = functools.partialmethod(forward, return_lse=True)


def _check_forward(plan, causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale) -> None:
    check_pos_encoding_mode(pos_encoding_mode)
    if plan is None:
        raise PlanStateError("forward() called before plan(): plan the batch first")
    if (
        bool(causal) != bool(plan.args.causal)
        or checked_window(window_left) != plan.window_left
        or float(logits_soft_cap or 0.0) != plan.soft_cap
    ):
        raise ValueError(
            "forward(): causal, window_left and logits_soft_cap are part of the plan on the CPU; pass them to plan()"
        )
    plan.sm_scale = 1.0 / math.sqrt(plan.head_dim_qk) if sm_scale is None else float(sm_scale)


def _ragged_strides(t, name: str, plan: AttentionPlan, head_dim: int, kv_layout: str) -> tuple[int, int, int]:
    """(unused page stride, token stride, head stride) of ragged ``k``/``v``, after checking them."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    expected = (
        (plan.max_kv_index, plan.num_kv_heads, head_dim)
        if kv_layout == "NHD"
        else (plan.num_kv_heads, plan.max_kv_index, head_dim)
    )
    if t.dtype != plan.kv_dtype:
        raise ValueError(
            f"The dtype of {name} {t.dtype} does not match the kv_data_type {plan.kv_dtype} specified in plan function."
        )
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if (
        t.dim() != 3
        or t.shape[2] != head_dim
        or t.shape[kv_layout == "HND"] < plan.max_kv_index
        or t.shape[kv_layout == "NHD"] != plan.num_kv_heads
    ):
        raise ValueError(
            f"{name} must have shape {list(expected)} (kv_layout {kv_layout}, kv_indptr[-1] tokens), got "
            f"{tuple(t.shape)}"
        )
    if t.stride(2) != 1 and head_dim > 1:
        raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    token, head = (t.stride(0), t.stride(1)) if kv_layout == "NHD" else (t.stride(1), t.stride(0))
    return (0, token, head)


def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_q=None,
    scale_k=None,
    scale_v=None,
    o_dtype=None,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    kv_cache_sf=None,
    k_scale=None,
    v_scale=None,
):
    """Prefill attention of one request: ``q [qo_len, num_qo_heads, head_dim_qk]`` over ``k``/``v``
    ``[kv_len, num_kv_heads, head_dim]`` (NHD; HND: ``[num_kv_heads, kv_len, head_dim]``).
    Returns ``out [qo_len, num_qo_heads, head_dim_vo]``, or ``(out, lse [qo_len, num_qo_heads])``."""
    reject_gpu_options("prefill", scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, kv_cache_sf=kv_cache_sf)
    check_kv_layout(kv_layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
    if v.dtype != k.dtype:
        raise TypeError(f"v has dtype {v.dtype} but k has {k.dtype}; they must match")
    token_dim = 0 if kv_layout == "NHD" else 1
    kv_len, num_kv_heads = k.shape[token_dim], k.shape[1 - token_dim]
    if v.shape[token_dim] != kv_len or v.shape[1 - token_dim] != num_kv_heads:
        raise ValueError(f"k and v must hold the same tokens and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    qo_len, num_qo_heads, head_dim_qk = q.shape
    if k.shape[2] != head_dim_qk:
        raise ValueError(f"q has head_dim {head_dim_qk} but k has {k.shape[2]}")
    if packed_custom_mask is None and custom_mask is not None:
        if custom_mask.shape != (qo_len, kv_len) and custom_mask.numel() != qo_len * kv_len:
            raise ValueError(
                f"custom_mask must be [qo_len, kv_len] = [{qo_len}, {kv_len}], got {tuple(custom_mask.shape)}"
            )
    wrapper = single_request_wrapper(BatchPrefillWithRaggedKVCacheWrapper, kv_layout)
    wrapper.plan(
        torch.tensor([0, qo_len], dtype=torch.int32),
        torch.tensor([0, kv_len], dtype=torch.int32),
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        v.shape[2],
        custom_mask=custom_mask,
        packed_custom_mask=packed_custom_mask,
        causal=causal,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        q_data_type=q.dtype,
        kv_data_type=k.dtype,
        o_data_type=o_dtype if o_dtype is not None else q.dtype,
    )
    keep_workspace(wrapper)
    return wrapper.run(q, k, v, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    """The prefill variant (tuned tile, else the default) for each KV cache dtype. (An MLA model's
    prefill variants are ``kernforge.ops.mla.attention``'s hook's.)"""
    if spec.is_mla:
        return []
    q = TORCH_DTYPES[dtype_name(spec.dtype)]
    entries = []
    for kv in [spec.dtype, *kv_cache_dtypes]:
        params = prefill_variant_params(q, kv_cache_dtype(kv), q, spec.head_dim, spec.head_dim, spec.group)
        entries.append({"module": "prefill", "params": {**params, "tile": list(params["tile"])}})  # JSON's spelling
    return entries


export("BatchPrefillWithPagedKVCacheWrapper", BatchPrefillWithPagedKVCacheWrapper)
export("BatchPrefillWithRaggedKVCacheWrapper", BatchPrefillWithRaggedKVCacheWrapper)
export("single_prefill_with_kv_cache", single_prefill_with_kv_cache)
export("single_prefill_with_kv_cache_return_lse", single_prefill_with_kv_cache_return_lse)
