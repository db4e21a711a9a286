"""SGLang's CPU attention ops on kernforge's paged wrappers: ``torch.ops.sgl_kernel.decode_attention_cpu``,
``extend_attention_cpu`` and ``store_cache_cpu``, with the schemas SGLang 0.5.23's ``intel_amx`` backend
calls them with (``sglang/srt/layers/attention/intel_amx_backend.py``, ``mem_cache/memory_pool.py``).

SGLang's KV pool holds one row per token slot and layer (``k_buffer [slots, H_kv, D]``); request ``i``'s
tokens are the slots ``req_to_token[req_pool_indices[i], :seq_lens[i]]``. That is FlashInfer's page table
at page size 1: the buffers are the pages (viewed ``[slots, 1, H_kv, D]``, NHD, no copy) and the rows'
slots, request after request, are ``kv_indices``. The backend calls an op once per layer with the same
batch tables, so the table and the wrapper's plan are made by the first call of a batch and reused by
the next layers (``_Planner``): a plan costs about 30 us, a layer's decode attention at 1k tokens 70 us.

Where SGLang asks for what kernforge does not serve here (cross-attention, attention sinks, a
speculative tree mask), the ops raise ``NotImplementedError`` naming it; SGLang's attn_logits scratch
is not used (kernforge's split-KV state lives in the wrapper's workspace).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from kernforge.ops.attention.decode import BatchDecodeWithPagedKVCacheWrapper
from kernforge.ops.attention.page import append_paged_kv_cache
from kernforge.ops.attention.prefill import BatchPrefillWithPagedKVCacheWrapper

Wrapper = BatchDecodeWithPagedKVCacheWrapper | BatchPrefillWithPagedKVCacheWrapper
W = TypeVar("W", BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper)
# heads, kv heads, head_dim qk, head_dim vo, sm_scale, soft cap, window_left, q dtype, kv dtype[, causal]
LayerKind = tuple[Any, ...]

WORKSPACE_BYTES = 128 << 20  # a wrapper's workspace (split-KV partial states), as the vLLM backend's

SCHEMAS = {
    "decode_attention_cpu": (
        "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, float v_scale, "
        "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
        "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
    ),
    "extend_attention_cpu": (
        "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
        "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
        "int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, "
        "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
    ),
    "store_cache_cpu": (
        "store_cache_cpu(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor indices, "
        "int? row_dim=None) -> ()"
    ),
}


def register(lib: torch.library.Library) -> None:
    """Define and implement the three ops in ``lib`` (the ``sgl_kernel`` namespace)."""
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, globals()[name], "CPU")


# --------------------------------------------------------------------------- the ops


def decode_attention_cpu(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: float, v_scale: float, output: Tensor,
    key: Tensor | None, value: Tensor | None, loc: Tensor, attn_logits: Tensor, req_to_token: Tensor,
    req_pool_indices: Tensor, seq_lens: Tensor, sm_scale: float, logit_cap: float, is_cross_attn: bool,
    sliding_window_size: int, encoder_lens: Tensor | None, sinks: Tensor | None,
) -> None:  # fmt: skip
    """One query token per request: ``key``/``value`` (when given) stored at ``loc`` first, then each
    request's attention over its ``seq_lens[i]`` slots into ``output [bs, H, Dv]``."""
    del attn_logits, encoder_lens
    _refuse_unserved(is_cross_attn=is_cross_attn, sinks=sinks)
    batch = _PLANNER.batch(req_to_token, req_pool_indices, seq_lens, None)  # checked before anything is stored
    wrapper = _PLANNER.decode(batch, _kind(query, k_cache, v_cache, sm_scale, logit_cap, sliding_window_size))
    if key is not None and value is not None:
        _store_rows(key, value, k_cache, v_cache, loc)
    wrapper.run(query, _pages(k_cache, v_cache), out=output, k_scale=float(k_scale), v_scale=float(v_scale))


def extend_attention_cpu(
    q_extend: Tensor, k_extend: Tensor | None, v_extend: Tensor | None, o_extend: Tensor, k_buffer: Tensor,
    v_buffer: Tensor, k_scale: float, v_scale: float, req_to_token: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, extend_seq_lens: Tensor, extend_start_loc: Tensor, max_len_extend: int, sm_scale: float,
    logit_cap: float, is_cross_attn: bool, sliding_window_size: int, encoder_lens: Tensor | None,
    sinks: Tensor | None, tree_mask: Tensor | None, is_causal: bool,
) -> None:  # fmt: skip
    """Request ``i``'s last ``extend_seq_lens[i]`` tokens (rows ``extend_start_loc[i]...`` of ``q_extend``)
    attend to its ``seq_lens[i]`` slots, causally aligned at the end. The extend tokens' K/V are read
    from the buffers, where SGLang's backend stored them before the call (``set_kv_buffer``)."""
    del k_extend, v_extend, max_len_extend, encoder_lens
    _refuse_unserved(is_cross_attn=is_cross_attn, sinks=sinks, tree_mask=tree_mask)
    batch = _PLANNER.batch(req_to_token, req_pool_indices, seq_lens, (extend_seq_lens, extend_start_loc))
    kind = _kind(q_extend, k_buffer, v_buffer, sm_scale, logit_cap, sliding_window_size)
    wrapper = _PLANNER.extend(batch, kind, causal=bool(is_causal))
    wrapper.run(q_extend, _pages(k_buffer, v_buffer), out=o_extend, k_scale=float(k_scale), v_scale=float(v_scale))


def store_cache_cpu(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, indices: Tensor, row_dim: int | None = None
) -> None:
    """``k``/``v`` rows into the slots ``indices`` of ``k_cache``/``v_cache`` (``[slots, H, D]``)."""
    del row_dim  # the rows' width is the caches'
    _store_rows(k, v, k_cache, v_cache, indices)


# --------------------------------------------------------------------------- tables and plans


@dataclass
class _Batch:
    """A batch's page table at page size 1, and what it was made from (compared by value)."""

    source: tuple[Tensor, ...]  # req_pool_indices, seq_lens, last slots[, extend lens, starts]
    kv_indptr: Tensor
    kv_indices: Tensor
    last_page_len: Tensor
    qo_indptr: Tensor | None
    plans: dict[tuple[type, LayerKind], Wrapper]  # (wrapper class, layer kind) -> planned wrapper


class _Planner:
    """The page table of the batch in flight and its plans, one per layer kind; a wrapper (and its
    workspace) per layer kind, planned again when the batch changes.

    A call's batch is the one in flight when its tables have the same values: the requests' pool
    rows, lengths and newest slots (``req_to_token`` at ``seq_lens - 1``, which a request that took
    over a pool row changes), and the extend lengths. SGLang's CPU graphs reuse their buffers, so
    tensor identity says nothing."""

    def __init__(self) -> None:
        self._batch: _Batch | None = None
        self._wrappers: dict[tuple[type, LayerKind], Wrapper] = {}

    def batch(
        self, req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, extend: tuple[Tensor, Tensor] | None
    ) -> _Batch:
        _check_tables(req_to_token, req_pool_indices, seq_lens)
        rows = req_pool_indices.long()
        lengths = seq_lens.long()
        newest = req_to_token[rows, (lengths - 1).clamp(min=0)]
        source = (rows, lengths, newest, *(t.long() for t in extend or ()))
        current = self._batch
        if current is not None and _same_values(current.source, source):
            return current
        self._batch = _new_batch(req_to_token, rows, lengths, extend, tuple(t.clone() for t in source))
        return self._batch

    def decode(self, batch: _Batch, kind: LayerKind) -> BatchDecodeWithPagedKVCacheWrapper:
        def plan(wrapper: BatchDecodeWithPagedKVCacheWrapper) -> None:
            wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.last_page_len, **_plan_options(kind))

        return self._planned(batch, BatchDecodeWithPagedKVCacheWrapper, kind, plan)

    def extend(self, batch: _Batch, kind: LayerKind, causal: bool) -> BatchPrefillWithPagedKVCacheWrapper:
        assert batch.qo_indptr is not None, "an extend batch has its qo_indptr"
        qo_indptr = batch.qo_indptr

        def plan(wrapper: BatchPrefillWithPagedKVCacheWrapper) -> None:
            options = _plan_options(kind)
            options["head_dim_qk"] = options.pop("head_dim")
            tables = (batch.kv_indptr, batch.kv_indices, batch.last_page_len)
            wrapper.plan(qo_indptr, *tables, causal=causal, head_dim_vo=kind[3], **options)

        return self._planned(batch, BatchPrefillWithPagedKVCacheWrapper, (*kind, causal), plan)

    def _planned(self, batch: _Batch, wrapper_class: type[W], kind: LayerKind, plan: Callable[[W], None]) -> W:
        planned = batch.plans.get((wrapper_class, kind))
        if planned is not None:
            return cast(W, planned)
        wrapper = cast(W, self._wrappers.get((wrapper_class, kind)))
        if wrapper is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8)
            wrapper = self._wrappers[wrapper_class, kind] = wrapper_class(workspace, "NHD")
        plan(wrapper)
        batch.plans[wrapper_class, kind] = wrapper
        return wrapper


_PLANNER = _Planner()


def _new_batch(
    req_to_token: Tensor,
    rows: Tensor,
    lengths: Tensor,
    extend: tuple[Tensor, Tensor] | None,
    source: tuple[Tensor, ...],
) -> _Batch:
    kv_indptr = _indptr(lengths)
    width = int(lengths.max()) if len(lengths) else 0
    table = req_to_token[rows, :width]
    kv_indices = table[torch.arange(width) < lengths[:, None]].to(torch.int32)  # row by row, in order
    last_page_len = (lengths > 0).to(torch.int32)  # page size 1: a request's last page holds 1 token
    qo_indptr = None
    if extend is not None:
        extend_lens, starts = (t.long() for t in extend)
        qo_indptr = _indptr(extend_lens)
        if not torch.equal(qo_indptr[:-1], starts.int()):
            raise ValueError("extend_start_loc must be the running sums of extend_seq_lens, starting at 0")
    return _Batch(source, kv_indptr, kv_indices, last_page_len, qo_indptr, {})


def _indptr(counts: Tensor) -> Tensor:
    """int32 [len(counts) + 1]: 0, then the running sums of ``counts``."""
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=indptr[1:])
    return indptr


def _plan_options(kind: LayerKind) -> dict[str, Any]:
    num_heads, num_kv_heads, head_dim, _, sm_scale, soft_cap, window_left, q_dtype, kv_dtype = kind[:9]
    return dict(
        num_qo_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=1,
        sm_scale=sm_scale,
        logits_soft_cap=soft_cap,
        window_left=window_left,
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
    )


def _kind(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, sm_scale: float, logit_cap: float, sliding_window_size: int
) -> LayerKind:
    """A layer's plan-relevant shape: heads, head dims, scale, cap, window (SGLang passes its layer's
    ``sliding_window_size + 1``: 0 for none; FlashInfer's ``window_left`` is the layer's own) and dtypes."""
    if query.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(
            f"query, k_cache and v_cache must be [tokens, heads, head_dim] and [slots, kv_heads, head_dim], got "
            f"{tuple(query.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    soft_cap = float(logit_cap) if logit_cap > 0 else None
    window_left = int(sliding_window_size) - 1 if sliding_window_size > 0 else -1
    return (
        query.shape[1], k_cache.shape[1], query.shape[2], v_cache.shape[2],
        float(sm_scale), soft_cap, window_left, query.dtype, k_cache.dtype,
    )  # fmt: skip


def _pages(k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
    return k_cache.unsqueeze(1), v_cache.unsqueeze(1)  # [slots, 1, H_kv, D]: pages of one token


def _store_rows(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """Token rows into their slots, through kernforge's append kernel: the rows as one request whose
    pages (of one token) are ``slots``; every slot is checked before anything is written."""
    if slots.dim() != 1:
        raise ValueError(f"the slots (loc / indices) must be 1-D, got {tuple(slots.shape)}")
    n = slots.shape[0]
    key = k.view(n, *k_cache.shape[1:])
    value = v.view(n, *v_cache.shape[1:])
    positions, requests = _ROWS.ranges(n)
    one_request = torch.tensor([0, n], dtype=torch.int32)
    append_paged_kv_cache(
        key, value, requests, positions, _pages(k_cache, v_cache), slots, one_request, _ONE, kv_layout="NHD"
    )


class _RowRanges:
    """``arange(n)`` and ``zeros(n)`` int32 views of buffers grown as needed (the append's positions and
    request of each stored row)."""

    def __init__(self) -> None:
        self._arange = torch.arange(0, dtype=torch.int32)
        self._zeros = torch.zeros(0, dtype=torch.int32)

    def ranges(self, n: int) -> tuple[Tensor, Tensor]:
        if n > len(self._arange):
            size = max(n, 2 * len(self._arange))
            self._arange = torch.arange(size, dtype=torch.int32)
            self._zeros = torch.zeros(size, dtype=torch.int32)
        return self._arange[:n], self._zeros[:n]


_ROWS = _RowRanges()
_ONE = torch.ones(1, dtype=torch.int32)


def _check_tables(req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor) -> None:
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be [pool rows, context], got {tuple(req_to_token.shape)}")
    if req_pool_indices.dim() != 1 or seq_lens.shape != req_pool_indices.shape:
        raise ValueError(
            f"req_pool_indices and seq_lens must be [bs] each, got {tuple(req_pool_indices.shape)} and "
            f"{tuple(seq_lens.shape)}"
        )
    if len(seq_lens) and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > req_to_token.shape[1]):
        raise ValueError(f"seq_lens must lie in [0, {req_to_token.shape[1]}] (req_to_token's width)")
    if len(req_pool_indices) and (
        int(req_pool_indices.min()) < 0 or int(req_pool_indices.max()) >= req_to_token.shape[0]
    ):
        raise ValueError(f"req_pool_indices must lie in [0, {req_to_token.shape[0]})")


def _same_values(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _refuse_unserved(**options: object) -> None:
    for name, value in options.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"{name}: not served by kernforge's SGLang attention yet")
