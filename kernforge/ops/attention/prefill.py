"""Prefill attention with FlashInfer's API: batch prefill over a paged or a ragged KV cache, and
single prefill.

``plan()`` runs once per batch: it checks and copies the index tensors, computes each request's
kv_len, packs a custom mask, and lists the work items (request, KV head, query tile), largest
first, which run()'s threads take dynamically (``attention/prefill.h``). ``run()`` then serves
every layer of the step with one call. The kernel module and that plan()/run() core are
``prefill_core``'s (:class:`~kernforge.ops.attention.prefill_core.PrefillCore`, which MLA's wrapper
builds on too); the wrappers here add FlashInfer's arguments.

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

from kernforge.jit.module import Module
from kernforge.ops._common import TORCH_DTYPES, dtype_name, kv_cache_dtype
from kernforge.ops._registry import export, model_kernels
from kernforge.ops.attention._wrapper import (
    AttentionPlan,
    PlanStateError,
    check_paged_cache,
    check_pos_encoding_mode,
    check_request_tensor,
    checked_window,
    keep_workspace,
    reject_gpu_options,
    single_request_wrapper,
)
from kernforge.ops.attention.page import check_kv_layout, unpack_paged_kv_cache
from kernforge.ops.attention.prefill_core import (
    _PLAN_MESSAGES,  # noqa: F401  (tests pair it with PLAN_ERROR)
    MAX_HEAD_DIM_QK,
    PLAN_ERROR,
    PREFILL,
    TILE_CANDIDATES,
    TILES,
    PrefillCore,
    prefill_variant_params,
    tile_shape,
)

# FlashInfer's prefill API, and the kernel's names from prefill_core (its module, variants and tiles),
# which the tuner, the benchmarks and the tests reach here.
__all__ = [
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "MAX_HEAD_DIM_QK",
    "PLAN_ERROR",
    "PREFILL",
    "TILES",
    "TILE_CANDIDATES",
    "prefill_variant_params",
    "tile_shape",
]


class BatchPrefillWithPagedKVCacheWrapper(PrefillCore):
    """FlashInfer's batch prefill over a paged KV cache: ``plan()`` once per batch, ``run()`` per layer.

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
            (("paged_kv_cache", cache.source),),
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


class BatchPrefillWithRaggedKVCacheWrapper(PrefillCore):
    """FlashInfer's batch prefill over ragged K/V tensors: ``plan()`` once per batch, ``run()`` per layer.

    A wrapper serves one caller at a time, as FlashInfer's does: ``run()`` fills the plan's
    argument struct and its threads' scratch in the workspace, so Python threads that run at once
    need a wrapper (and workspace buffer) each; a wrapper planned on one thread may run on others,
    one ``run()`` at a time.
    """

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
            None,  # no pages: no last_page_len, indices or page size (1)
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
            q,
            k.data_ptr(),
            k_strides,
            v.data_ptr(),
            v_strides,
            out,
            lse,
            return_lse,
            q_scale,
            k_scale,
            v_scale,
            (("k", k), ("v", v)),
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
        check_request_tensor(t, name, query=name == "q")
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
