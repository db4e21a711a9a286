"""kernforge as vLLM's CPU MLA backend (what vLLM loads for ``CPU_MLA``, the CPU platform's choice for
DeepSeek-style multi-head latent attention where the CPU has no AMX) and as its CPU MLA prefill
backend.

vLLM's MLA layer (``MLAAttention.forward_impl``) splits a step: decode tokens (query length 1; the
metadata builder orders them first) take the weight-absorbed path, an MQA of ``[q_nope W_UK |
q_pe]`` (512 + 64) over the latent cache with one shared KV head, ``forward_mqa``; prefill tokens
take the non-absorbed path, ``kv_b_proj`` up-projects the new tokens' latents to per-head K (128 +
64) and V (128) and the prefill backend runs causal attention over them, plus, for a chunked
prefill's later pieces, attention over the earlier tokens gathered from the cache, merged by LSE.
vLLM's latent cache per layer is ``[blocks, block_size (16 on CPU), 576]``, ``[ckv | kpe]`` per
token, written by vLLM (``CPUMLAImpl.do_kv_cache_update``) before attention runs.

* decode: the metadata builder turns the step's decode requests into FlashInfer's MLA page table
  once (``qo_indptr``, ``kv_indptr``/``kv_indices`` from vLLM's block table, ``kv_len_arr``); the
  first layer plans kernforge's ``BatchMLAPagedAttentionWrapper``, every layer runs the plan on its
  own cache, read in place as the adjacent views ``cache[..., :512]`` / ``cache[..., 512:]``;
* prefill: kernforge's ``BatchPrefillWithRaggedKVCacheWrapper`` (head_dim_qk 192, head_dim_vo 128),
  planned once per step for the new tokens (causal) and once per context chunk (not causal, with
  the LSE vLLM merges by), in place of vLLM's float32 per-request matmuls.

What kernforge does not run stays on vLLM's code: a model dtype other than bf16/fp16, a quantized
latent cache (vLLM's CPU MLA takes none), a latent other than the one planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadataBuilder,
)
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

import kernforge

logger = init_logger(__name__)

WORKSPACE_BYTES = 128 << 20  # per planned wrapper; pages are touched only as far as a plan needs
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
LN2 = math.log(2.0)


class KernforgeMLABackend(CPUMLABackend):
    """vLLM's CPU MLA backend (its name, cache layout and block size) with kernforge's decode."""

    @staticmethod
    def get_impl_cls() -> type[KernforgeMLAImpl]:
        return KernforgeMLAImpl

    @staticmethod
    def get_builder_cls() -> type[KernforgeMLAMetadataBuilder]:
        return KernforgeMLAMetadataBuilder


@dataclass
class MLADecodeStep:
    """The decode requests of one scheduler step in FlashInfer's MLA terms; the wrapper planned by
    the step's first layer of each kind (``plans``), run by the others."""

    qo_indptr: torch.Tensor  # int32 [requests + 1]
    kv_indptr: torch.Tensor  # int32 [requests + 1]
    kv_indices: torch.Tensor  # int32 [pages of the step]
    kv_len: torch.Tensor  # int32 [requests]
    planner: MLADecodePlanner
    plans: dict = field(default_factory=dict)  # layer kind -> planned wrapper

    def wrapper(self, kind: tuple):
        planned = self.plans.get(kind)
        if planned is None:
            planned = self.plans[kind] = self.planner.plan(self, kind)
        return planned


class MLADecodePlanner:
    """Plans a step's decodes for one layer kind (heads, latent and rope widths, scale, dtypes), one
    wrapper (and its workspace) per kind, replanned every step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._wrappers: dict[tuple, kernforge.BatchMLAPagedAttentionWrapper] = {}

    def plan(self, step: MLADecodeStep, kind: tuple):
        num_heads, head_dim_ckv, head_dim_kpe, scale, q_dtype, kv_dtype = kind
        wrapper = self._wrappers.get(kind)
        if wrapper is None:
            wrapper = self._wrappers[kind] = kernforge.BatchMLAPagedAttentionWrapper(
                torch.empty(WORKSPACE_BYTES, dtype=torch.uint8)
            )
        wrapper.plan(
            step.qo_indptr,
            step.kv_indptr,
            step.kv_indices,
            step.kv_len,
            num_heads,
            head_dim_ckv,
            head_dim_kpe,
            self.block_size,
            True,  # one query per request here; several would see the keys up to their own position
            scale,
            q_dtype,
            kv_dtype,
        )
        return wrapper

    def step(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> MLADecodeStep:
        """FlashInfer's MLA page table of a step's decode requests from vLLM's block table."""
        requests = seq_lens.shape[0]
        qo_indptr = query_start_loc[: requests + 1].to(torch.int32)
        kv_len = seq_lens.to(torch.int32)
        pages = (kv_len + self.block_size - 1) // self.block_size
        kv_indptr = torch.zeros(requests + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=kv_indptr[1:])
        table = block_table[:requests]
        in_use = torch.arange(table.shape[1], dtype=torch.int32) < pages[:, None]
        kv_indices = table[in_use].to(torch.int32)  # row by row: each request's pages in order
        return MLADecodeStep(qo_indptr, kv_indptr, kv_indices, kv_len, self)


@dataclass
class KernforgeMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata and the step's kernforge page table."""

    kernforge_step: MLADecodeStep | None = None


class KernforgeMLAMetadataBuilder(MLACommonMetadataBuilder):
    """vLLM's MLA metadata, its decode part with a :class:`MLADecodeStep` (built once per step)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.planner = MLADecodePlanner(self.page_size)

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        max_query_len: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> KernforgeMLADecodeMetadata:
        step = None
        if dcp_tot_seq_lens_device is None:  # no decode context parallelism (none on CPU)
            step = self.planner.step(query_start_loc_cpu, seq_lens_device, block_table_tensor)
        return KernforgeMLADecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            kernforge_step=step,
        )


class KernforgeMLAImpl(CPUMLAImpl):
    """vLLM's CPU MLA layer implementation with the absorbed decode on kernforge's MLA kernel (vLLM's
    own cache write and prefill scaffolding; the prefill attention is kernforge's through
    :class:`KernforgeMLAPrefillBackend`)."""

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata, layer):
        decode = attn_metadata.decode
        step = getattr(decode, "kernforge_step", None)
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:
            q_nope, q_pe = q.split([self.kv_lora_rank, q.shape[-1] - self.kv_lora_rank], dim=-1)
        cache = kv_c_and_k_pe_cache
        if (
            step is None
            or q_nope.dtype not in KERNEL_DTYPES
            or cache.dtype != q_nope.dtype
            or cache.dim() != 3
            or cache.shape[-1] != self.kv_lora_rank + q_pe.shape[-1]
        ):
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        kind = (self.num_heads, self.kv_lora_rank, q_pe.shape[-1], self.scale, q_nope.dtype, cache.dtype)
        wrapper = step.wrapper(kind)
        out = wrapper.run(q_nope, q_pe, cache[..., : self.kv_lora_rank], cache[..., self.kv_lora_rank :])
        return out, None


class KernforgeMLAPrefillBackend(CPUSDPAMLAPrefillBackend):
    """vLLM's CPU MLA prefill (the non-absorbed attention of a step's prefill tokens) on kernforge's
    ragged batch prefill: planned once per step for the new tokens and once per context chunk."""

    @staticmethod
    def get_name() -> str:
        return "KERNFORGE_CPU_MLA"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._wrappers: list = []  # [0]: the new tokens; [1 + i]: context chunk i
        self._planned = False

    def _wrapper(self, i: int):
        while len(self._wrappers) <= i:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8)
            self._wrappers.append(kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD"))
        return self._wrappers[i]

    def prepare_metadata(self, prefill_metadata) -> None:
        super().prepare_metadata(prefill_metadata)
        dtype = prefill_metadata.q_data_type or self.vllm_config.model_config.dtype
        self._planned = dtype in KERNEL_DTYPES
        if not self._planned:
            return
        shape = dict(
            num_qo_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            head_dim_qk=self.qk_nope_head_dim + self.qk_rope_head_dim,
            head_dim_vo=self.v_head_dim,
            sm_scale=self.scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        new = prefill_metadata.query_start_loc.to(torch.int32)
        self._wrapper(0).plan(new, new, causal=True, **shape)
        chunked = prefill_metadata.chunked_context
        for i, chunk in enumerate(chunked.chunks if chunked is not None else ()):
            self._wrapper(1 + i).plan(
                chunk.query_start_loc.to(torch.int32), chunk.cu_seq_lens.to(torch.int32), causal=False, **shape
            )

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None, output_scale=None):
        if not self._planned or output_scale is not None or q.dtype != k.dtype:
            return super().run_prefill_new_tokens(q, k, v, return_softmax_lse, out, output_scale)
        result = self._wrapper(0).run(q, k, v, out=out, return_lse=return_softmax_lse)
        return (result[0], _natural_lse(result[1])) if return_softmax_lse else result

    def run_prefill_context_chunk(self, chunk, q, k, v, out=None):
        if not self._planned or q.dtype != k.dtype:
            return super().run_prefill_context_chunk(chunk, q, k, v, out)
        attended, lse = self._wrapper(1 + chunk.index).run(q, k, v, out=out, return_lse=True)
        return attended, _natural_lse(lse)


def _natural_lse(lse: torch.Tensor) -> torch.Tensor:
    """kernforge's (FlashInfer's) base-2 ``[tokens, heads]`` LSE as vLLM merges it: natural, ``[heads, tokens]``."""
    return lse.t().mul(LN2).contiguous()
