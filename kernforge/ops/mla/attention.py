"""Multi-head latent attention over a paged latent cache, with FlashInfer's API
(``flashinfer.mla.BatchMLAPagedAttentionWrapper`` and ``append_paged_mla_kv_cache``).

DeepSeek's absorbed attention is one KV head shared by every query head: keys are the latent and
rope parts of a token, ``[ckv | kpe]`` (512 + 64), values are the latent alone (512), and each
query head's absorbed ``[q_nope | q_pe]`` attends to them. kernforge runs it on the batch prefill
kernel (``attention/prefill.h``; the wrapper is a ``kernforge.ops.attention.prefill_core.PrefillCore``)
as MQA with head_dim_qk 576 and head_dim_vo 512: the heads of a query token are rows of one tile,
so each latent row is read once for all heads and both products are GEMMs on the micro-kernels
(vdpbf16ps; AMX tiles on the amx tier), ``[rows x 576] . [576 x block]`` then ``P . ckv``. The
prefill planner splits the KV of a batch's requests across threads (merged by LSE) when there are
fewer tiles than threads or one request outweighs a thread's share.

Semantics follow FlashInfer's: ``q_nope [nnz, H, head_dim_ckv]`` and ``q_pe [nnz, H,
head_dim_kpe]``; ``ckv_cache [num_pages, page_size, head_dim_ckv]`` and ``kpe_cache [num_pages,
page_size, head_dim_kpe]``; request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and
its first ``kv_len_arr[b]`` tokens (the batch is ``kv_len_arr``'s: ``qo_indptr`` and ``kv_indptr``
may be buffers preallocated for a larger batch, of which the first ``batch + 1`` entries are read);
``head_dim_kpe`` may be 0 (MLA without a rope part: ``q_pe`` and ``kpe_cache`` are empty and the
keys are the latent alone); ``causal`` aligns the request's queries bottom-right (query ``i`` of
``qo_len`` sees keys ``j <= kv_len - qo_len + i``); ``sm_scale`` multiplies q.k; the output is in
q's dtype and LSE is base 2; a query that sees no key (an empty request) gets zeros and ``-inf``.
``ckv_cache`` and ``kpe_cache`` given as adjacent views of one ``[..., 576]`` buffer (as SGLang and
vLLM hold the latent cache) are read in place; separate tensors are assembled row by row. fp8
(e4m3/e5m2) caches are widened to bf16 exactly in the kernel; ``q_scale`` / ``k_scale`` /
``v_scale`` (kernforge's addition, as decode's run takes them) scale the logits and the output.
"""

from __future__ import annotations

import functools

import torch

from kernforge.ops._common import MAX_HEAD_DIM, TORCH_DTYPES, dtype_name, index_vector, kv_cache_dtype
from kernforge.ops._registry import DTYPE_NAMES, FP8_DTYPE_NAMES, export, model_kernels
from kernforge.ops.attention.page import KV_DTYPES, CacheShape, append_rows
from kernforge.ops.attention.prefill_core import (
    MAX_HEAD_DIM_QK,
    PlanStateError,
    PrefillCore,
    check_positive,
    prefill_variant_params,
)

# FlashInfer's MLA plan arguments as the prefill planner's messages name them.
_ARGUMENT_NAMES = {"paged_kv_indptr": "kv_indptr", "paged_kv_indices": "kv_indices"}


class LatentCache:
    """One layer's latent cache, checked: addresses and (page, token) strides in elements of the
    ``ckv`` and ``kpe`` planes, and whether ``kpe`` directly follows ``ckv`` in every row."""

    __slots__ = ("ckv", "kpe", "num_pages", "page_size", "dtype", "ckv_strides", "kpe_strides", "adjacent")

    def __init__(self, ckv_cache, kpe_cache, head_dim_ckv: int | None = None, head_dim_kpe: int | None = None):
        for name, t, dim in (("ckv_cache", ckv_cache, head_dim_ckv), ("kpe_cache", kpe_cache, head_dim_kpe)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise ValueError(f"{name} must be 3-D [num_pages, page_size, head_dim], got shape {tuple(t.shape)}")
            if dim is not None and t.shape[2] != dim:
                raise ValueError(f"{name} has head_dim {t.shape[2]} but plan() was given {dim}")
            if t.device.type != "cpu":
                raise ValueError(f"{name} must be on the CPU, got device {t.device}")
            if t.stride(2) != 1 and t.shape[2] > 1:
                raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
        if ckv_cache.dtype != kpe_cache.dtype:
            raise TypeError(
                f"ckv_cache has dtype {ckv_cache.dtype} but kpe_cache has {kpe_cache.dtype}; they must match"
            )
        if ckv_cache.dtype not in KV_DTYPES:
            raise TypeError(f"the latent cache's dtype {ckv_cache.dtype} is not supported; use one of {KV_DTYPES}")
        if ckv_cache.shape[:2] != kpe_cache.shape[:2]:
            raise ValueError(
                f"ckv_cache {tuple(ckv_cache.shape)} and kpe_cache {tuple(kpe_cache.shape)} must have the same "
                "[num_pages, page_size]"
            )
        self.ckv, self.kpe = ckv_cache.data_ptr(), kpe_cache.data_ptr()
        self.num_pages, self.page_size = ckv_cache.shape[:2]
        self.dtype = ckv_cache.dtype
        self.ckv_strides, self.kpe_strides = ckv_cache.stride()[:2], kpe_cache.stride()[:2]
        self.adjacent = (
            self.kpe == self.ckv + ckv_cache.shape[2] * ckv_cache.element_size()
            and self.kpe_strides == self.ckv_strides
        )


class BatchMLAPagedAttentionWrapper(PrefillCore):
    """FlashInfer's MLA wrapper: ``plan()`` once per batch, ``run()`` per layer.

    ``float_workspace_buffer`` is a CPU tensor holding each thread's scratch and split requests'
    partial states; ``plan()`` says how many bytes it needs when it is too small. CUDA graphs and
    other backends are GPU options and raise ``NotImplementedError``.

    A wrapper serves one caller at a time, as FlashInfer's does: ``run()`` fills the plan's
    argument struct and its threads' scratch in the workspace, so Python threads that run at once
    need a wrapper (and workspace buffer) each; a wrapper planned on one thread may run on others,
    one ``run()`` at a time.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        kv_len_arr: torch.Tensor | None = None,
        backend: str = "auto",
    ):
        super().__init__(float_workspace_buffer, "NHD", use_cuda_graph, backend)
        self._q_buffer = None  # [nnz, H, 576] when q_nope and q_pe must be joined for an adjacent cache

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_heads: int,
        head_dim_ckv: int,
        head_dim_kpe: int,
        page_size: int,
        causal: bool,
        sm_scale: float,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
        use_profiler: bool = False,
    ) -> None:
        """Check and copy the page table, pick the kernel, and list the batch's work. The batch is
        ``kv_len_arr``'s; ``qo_indptr`` and ``kv_indptr`` may be longer (only their first
        ``len(kv_len_arr) + 1`` entries are read), ``kv_indices`` too."""
        self._plan = None
        if use_profiler:
            raise NotImplementedError("use_profiler: FlashInfer's intra-kernel GPU profiler has no CPU counterpart")
        for name, value in (("num_heads", num_heads), ("head_dim_ckv", head_dim_ckv), ("page_size", page_size)):
            check_positive(name, value)
        if isinstance(head_dim_kpe, bool) or not isinstance(head_dim_kpe, int) or head_dim_kpe < 0:
            raise ValueError(f"head_dim_kpe must be an int >= 0 (0: MLA without a rope part), got {head_dim_kpe!r}")
        if head_dim_ckv > MAX_HEAD_DIM or head_dim_ckv + head_dim_kpe > MAX_HEAD_DIM_QK:
            raise ValueError(
                f"head_dim_ckv {head_dim_ckv} + head_dim_kpe {head_dim_kpe}: kernforge's MLA variants take "
                f"head_dim_ckv <= {MAX_HEAD_DIM} and head_dim_ckv + head_dim_kpe <= {MAX_HEAD_DIM_QK} "
                "(DeepSeek's 512 + 64)"
            )
        if sm_scale is None or isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
            raise TypeError(f"sm_scale must be a float (FlashInfer's MLA has no default), got {sm_scale!r}")
        # As FlashInfer's planner: the batch is kv_len_arr's, of which the indptrs' first batch + 1
        # entries are read (they may be buffers preallocated for a larger batch).
        kv_len = index_vector(kv_len_arr, "kv_len_arr")
        batch = kv_len.numel()
        qo_indptr = index_vector(qo_indptr, "qo_indptr", batch + 1, "len(kv_len_arr) + 1", prefix=True)
        kv_indptr = index_vector(kv_indptr, "kv_indptr", batch + 1, "len(kv_len_arr) + 1", prefix=True)
        kv_indices = index_vector(kv_indices, "kv_indices")
        kv_indptr, kv_indices, last_page_len = _page_table(kv_indptr, kv_indices, kv_len, page_size)
        self._make_plan(
            qo_indptr,
            kv_indptr,
            last_page_len,
            kv_indices,
            num_qo_heads=num_heads,
            num_kv_heads=1,
            head_dim_qk=head_dim_ckv + head_dim_kpe,
            head_dim_vo=head_dim_ckv,
            page_size=page_size,
            custom_mask=None,
            packed_custom_mask=None,
            causal=causal,
            pos_encoding_mode="NONE",
            window_left=-1,
            logits_soft_cap=None,
            sm_scale=float(sm_scale),
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            o_data_type=None,
            renamed=_ARGUMENT_NAMES,
        )
        self._plan.head_dim_kpe = head_dim_kpe

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        profiler_buffer=None,
        kv_len=None,
        page_table=None,
        return_lse_base_on_e: bool = False,
        *,
        q_scale=None,
        k_scale=None,
        v_scale=None,
    ):
        """Attention of the absorbed queries over the planned pages: ``out [nnz, H, head_dim_ckv]``
        in q's dtype, or ``(out, lse [nnz, H])`` with ``return_lse`` (base 2)."""
        plan = self._plan
        if plan is None:
            raise PlanStateError("run() called before plan(): plan the batch first")
        if profiler_buffer is not None or kv_len is not None or page_table is not None or return_lse_base_on_e:
            raise NotImplementedError(
                "profiler_buffer, kv_len, page_table and return_lse_base_on_e belong to FlashInfer's GPU backends; "
                "kernforge takes the page table in plan() and returns base-2 LSE"
            )
        head_dim_ckv, head_dim_kpe = plan.head_dim_vo, plan.head_dim_kpe
        rows = (plan.total_q, plan.num_qo_heads)
        _check_query(q_nope, "q_nope", torch.Size((*rows, head_dim_ckv)), plan.q_dtype)
        _check_query(q_pe, "q_pe", torch.Size((*rows, head_dim_kpe)), plan.q_dtype)
        cache = LatentCache(ckv_cache, kpe_cache, head_dim_ckv, head_dim_kpe)
        if cache.dtype != plan.kv_dtype:
            raise ValueError(
                f"The dtype of ckv_cache {cache.dtype} does not match the kv_data_type {plan.kv_dtype} "
                "specified in plan function."
            )
        if cache.page_size != plan.page_size:
            raise ValueError(f"ckv_cache has page_size {cache.page_size} but plan() was given {plan.page_size}")
        if plan.max_page >= cache.num_pages:
            raise ValueError(f"kv_indices holds page {plan.max_page}, beyond ckv_cache's {cache.num_pages} pages")
        ckv_strides = (*cache.ckv_strides, 0)  # (page, token, head): one KV head
        io = plan.io
        if head_dim_kpe == 0:  # no rope part: K rows are the latent, q rows q_nope (q_pe, kpe never read)
            q = q_nope
            io.pe_dim = 0
        elif cache.adjacent:  # K rows are [ckv | kpe] in place: q must be one row of 576 too
            q = self._joined_queries(q_nope, q_pe)
            io.pe_dim = 0
        else:
            q = q_nope
            io.q_pe, (io.q_pe_stride_token, io.q_pe_stride_head, _) = q_pe.data_ptr(), q_pe.stride()
            io.k_pe, (io.k_pe_stride_page, io.k_pe_stride_token) = cache.kpe, cache.kpe_strides
            io.pe_dim = head_dim_kpe
        reads = (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache))
        return self._launch_layer(
            q, cache.ckv, ckv_strides, cache.ckv, ckv_strides, out, lse, return_lse, q_scale, k_scale, v_scale, reads
        )

    run_return_lse = functools.partialmethod(run, return_lse=True)

    # The traceable-run protocol (kernforge.torch_library): run()'s four tensors as they are.
    def traced_tensors(self, q_nope, q_pe, ckv_cache, kpe_cache) -> list[torch.Tensor]:
        return [q_nope, q_pe, ckv_cache, kpe_cache]

    def run_arguments(self, tensors: list) -> tuple:
        return tuple(tensors)

    def _joined_queries(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """``[q_nope | q_pe]`` as rows of one tensor: a view where q_pe follows q_nope in memory
        (both sliced from one buffer), else a copy into a buffer kept between calls."""
        width = q_nope.shape[2] + q_pe.shape[2]
        if q_pe.data_ptr() == q_nope.data_ptr() + q_nope.shape[2] * q_nope.element_size() and (
            q_pe.stride()[:2] == q_nope.stride()[:2]
        ):
            return q_nope.as_strided((*q_nope.shape[:2], width), q_nope.stride())
        shape = (*q_nope.shape[:2], width)
        buffer = self._q_buffer
        if buffer is None or buffer.shape != shape or buffer.dtype != q_nope.dtype:
            buffer = self._q_buffer = torch.empty(shape, dtype=q_nope.dtype)
        buffer[..., : q_nope.shape[2]].copy_(q_nope)
        buffer[..., q_nope.shape[2] :].copy_(q_pe)
        return buffer


def _check_query(t, name: str, shape: torch.Size, dtype: torch.dtype) -> None:
    try:  # warm path: attribute reads
        if t.dtype is dtype and t.shape == shape and t.is_cpu and (t.stride(-1) == 1 or shape[-1] <= 1):
            return
    except AttributeError:
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}") from None
    if t.dtype != dtype:
        raise ValueError(
            f"The dtype of {name} {t.dtype} does not match the q_data_type {dtype} specified in plan function."
        )
    if t.shape != shape:
        raise ValueError(
            f"{name} must have shape [qo_indptr[-1], num_heads, head_dim] = {tuple(shape)}, got {tuple(t.shape)}"
        )
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def _page_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor, page_size: int):
    """FlashInfer's MLA page table (pages per request, KV lengths) as the paged kernels take it
    (pages per request, last page's length): each request keeps the pages its length needs."""
    if int(kv_indptr[0]) != 0:
        raise ValueError(f"kv_indptr must start at 0, got {int(kv_indptr[0])}")
    pages = kv_indptr[1:] - kv_indptr[:-1]
    for bad, what in ((pages < 0, "kv_indptr must be non-decreasing"), (kv_len < 0, "kv_len_arr must be >= 0")):
        if bool(bad.any()):
            raise ValueError(f"{what} (request {int(bad.nonzero()[0])})")
    if int(kv_indptr[-1]) > kv_indices.numel():
        raise ValueError(f"kv_indptr[-1] = {int(kv_indptr[-1])} is beyond kv_indices' {kv_indices.numel()} entries")
    needed = (kv_len + page_size - 1) // page_size
    short = needed > pages
    if bool(short.any()):
        b = int(short.nonzero()[0])
        raise ValueError(
            f"kv_len_arr[{b}] = {int(kv_len[b])} needs {int(needed[b])} pages of {page_size} tokens, "
            f"but kv_indptr gives request {b} {int(pages[b])}"
        )
    last_page_len = torch.where(needed > 0, kv_len - (needed - 1) * page_size, 1).to(torch.int32)
    if bool((needed == pages).all()):
        return kv_indptr.clone(), kv_indices.clone(), last_page_len
    # Requests with spare pages keep the first ones their length needs.
    first = torch.repeat_interleave(kv_indptr[:-1].long(), needed.long())
    within = torch.arange(first.numel()) - torch.repeat_interleave(
        torch.cumsum(needed.long(), 0) - needed.long(), needed.long()
    )
    compact_indptr = torch.zeros_like(kv_indptr)
    torch.cumsum(needed, 0, out=compact_indptr[1:])
    return compact_indptr, kv_indices[first + within].clone(), last_page_len


def append_paged_mla_kv_cache(
    append_ckv: torch.Tensor,
    append_kpe: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
) -> None:
    """Write ``append_ckv[i]`` (``[nnz, head_dim_ckv]``) and ``append_kpe[i]`` (``[nnz,
    head_dim_kpe]``) into the slot of token ``positions[i]`` of request ``batch_indices[i]``, as
    FlashInfer does; the same checks as ``append_paged_kv_cache`` (every index before anything is
    written)."""
    cache = LatentCache(ckv_cache, kpe_cache)
    ckv_dim, kpe_dim = ckv_cache.shape[2], kpe_cache.shape[2]
    rows = (
        _latent_rows(append_ckv, "append_ckv", ckv_dim, cache.dtype),
        _latent_rows(append_kpe, "append_kpe", kpe_dim, cache.dtype),
    )
    planes = (cache.ckv, *cache.ckv_strides, 0), (cache.kpe, *cache.kpe_strides, 0)
    shape = CacheShape(cache.num_pages, cache.page_size, 1, ckv_dim, kpe_dim)
    append_rows(
        *rows,
        ("append_ckv", "append_kpe"),
        batch_indices,
        positions,
        cache.dtype,
        planes,
        shape,
        kv_indices,
        kv_indptr,
        kv_last_page_len,
    )


def _latent_rows(t, name: str, dim: int, dtype: torch.dtype):
    """``t`` as [nnz, dim] rows of the cache's dtype: (tensor, token stride, 0, nnz)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the latent cache has {dtype}; they must match")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")
    if t.dim() != 2 or t.shape[1] != dim:
        raise ValueError(f"{name} must be [nnz, {dim}] to match the cache, got shape {tuple(t.shape)}")
    if t.stride(1) != 1:
        t = t.contiguous()  # only read
    return t, t.stride(0), 0, t.shape[0]


export("BatchMLAPagedAttentionWrapper", BatchMLAPagedAttentionWrapper)
export("append_paged_mla_kv_cache", append_paged_mla_kv_cache)


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    """What a multi-head latent attention model (DeepSeek-V2/V3, ``spec.is_mla``) runs of attention,
    for a latent cache in its dtype and in each of ``kv_cache_dtypes``: the absorbed attention
    (``BatchMLAPagedAttentionWrapper``: the prefill kernel with head dims kv_lora_rank + rope /
    kv_lora_rank, every head on one KV head) and the latent append into the cache; and the
    unabsorbed prompt path's ragged prefill (head dims qk_nope + rope / v, one head per KV head, K and V
    in the model's dtype)."""
    if not spec.is_mla:
        return []
    q = TORCH_DTYPES[dtype_name(spec.dtype)]
    latent, rank, heads = spec.kv_lora_rank + spec.qk_rope_head_dim, spec.kv_lora_rank, spec.num_attention_heads
    ragged = prefill_variant_params(q, q, q, spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim, 1)
    prefill, append = [ragged], []
    for kv in dict.fromkeys(kv_cache_dtype(d) for d in [spec.dtype, *kv_cache_dtypes]):
        prefill.append(prefill_variant_params(q, kv, q, latent, rank, heads))
        append.append({"module": "page", "params": {"dtype": {**DTYPE_NAMES, **FP8_DTYPE_NAMES}[kv]}})
    # JSON's spelling of the tile
    return [{"module": "prefill", "params": {**params, "tile": list(params["tile"])}} for params in prefill] + append
