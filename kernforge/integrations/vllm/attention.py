"""kernforge as vLLM's CPU attention backend (what vLLM loads for ``CPU_ATTN``).

vLLM allocates each layer's CPU KV cache as ``[blocks, kv_heads, block_size, 2 * head_size]`` and
leaves its interior to the backend (vLLM's own kernels pack K per ISA). kernforge keeps FlashInfer's
HND layout there: per block and head, ``block_size`` K rows, then ``block_size`` V rows, two halves
that kernforge's attention reads in place with K and V at their own strides. The backend writes
and reads the cache itself (``forward_includes_kv_cache_update``), copies nothing per step, and
plans once per step:

* the metadata builder turns a scheduler step (vLLM's ``query_start_loc``, ``seq_lens`` and block
  table) into FlashInfer's page table once (``qo_indptr``, ``kv_indptr``/``kv_indices``/
  ``kv_last_page_len`` and where each new token's K/V goes);
* the first layer of a step plans kernforge's batch decode (a step of decodes only) or batch
  prefill with paged KV and ragged q (chunked-prefill pieces and decodes together, causal as
  vLLM's: a request's queries are its last tokens); every later layer with the same head shape,
  scale, window and soft cap runs that plan;
* ``forward`` writes the new K/V with ``append_paged_kv_cache``, then runs the plan;
* vLLM's KV-cache buffer starts in 2 MiB huge pages (:func:`patch_kv_cache_allocation`: handed
  back to Linux as huge pages of zeros right after vLLM allocates it, so nothing is copied):
  decode's reads of scattered blocks then miss the TLB less.

What kernforge does not run (ALiBi, attention sinks, encoder and cross attention, a per-request
causal mask) stays on vLLM's own kernels: the whole KV-cache group falls back, said once. So does a
group where the plugin's self-check measured vLLM's backend faster on this CPU
(:mod:`kernforge.integrations.vllm.selfcheck`; ``KERNFORGE_VLLM`` unset).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

import kernforge
from kernforge.integrations.vllm import selfcheck
from kernforge.ops.attention.decode import BatchDecodeWithPagedKVCacheWrapper
from kernforge.ops.attention.prefill import BatchPrefillWithPagedKVCacheWrapper

logger = init_logger(__name__)

WORKSPACE_BYTES = 128 << 20  # per planned wrapper; pages are touched only as far as a plan needs
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class KernforgeAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with kernforge's kernels; vLLM's cache layout, block sizes and
    head sizes as they are. The KV-cache write is part of ``forward`` (kernforge's append)."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls() -> type[KernforgeAttentionImpl]:
        return KernforgeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KernforgeMetadataBuilder]:
        return KernforgeMetadataBuilder


def _unsupported(impl: Any) -> str | None:
    """Why kernforge does not run a layer (vLLM's kernels do), or None."""
    if not isinstance(impl, KernforgeAttentionImpl):
        return f"attention implementation {type(impl).__name__}"
    if impl.attn_type != AttentionType.DECODER:
        return f"{impl.attn_type} attention"
    if impl.alibi_slopes is not None:
        return "ALiBi"
    if impl.sinks is not None:
        return "attention sinks"
    if impl.head_size > 512:
        return f"head size {impl.head_size}"
    return None


@dataclass
class KernforgeStep:
    """One scheduler step of a KV-cache group, in FlashInfer's terms; plans made by its first layer
    of each layer kind (``plans``), run by the others."""

    num_actual_tokens: int
    max_query_len: int
    qo_indptr: torch.Tensor  # int32 [requests + 1]
    kv_indptr: torch.Tensor  # int32 [requests + 1]
    kv_indices: torch.Tensor  # int32 [pages of the step]
    kv_last_page_len: torch.Tensor  # int32 [requests]
    batch_indices: torch.Tensor  # int32 [new tokens]: the request of each new token
    positions: torch.Tensor  # int32 [new tokens]: its position in the request
    planner: StepPlanner
    plans: dict = field(default_factory=dict)  # layer kind -> planned wrapper

    @property
    def decode_only(self) -> bool:
        return self.max_query_len <= 1

    def wrapper(self, impl: KernforgeAttentionImpl, kv_cache_dtype: torch.dtype):
        """The wrapper planned for ``impl``'s layer kind in this step (planned on first use)."""
        kind = (impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale, impl.window_left, impl.soft_cap)
        planned = self.plans.get(kind)
        if planned is None:
            planned = self.plans[kind] = self.planner.plan(self, kind, kv_cache_dtype)
        return planned


class StepPlanner:
    """Plans a step for one layer kind: batch decode for a step of decodes, else batch prefill. Keeps
    one wrapper (and its workspace) per wrapper class and layer kind, replanned every step."""

    def __init__(self, block_size: int, model_dtype: torch.dtype) -> None:
        self.block_size, self.model_dtype = block_size, model_dtype
        self._wrappers: dict[tuple, Any] = {}

    def plan(self, step: KernforgeStep, kind: tuple, kv_cache_dtype: torch.dtype):
        num_heads, num_kv_heads, head_size, scale, window_left, soft_cap = kind
        wrapper_class = BatchDecodeWithPagedKVCacheWrapper if step.decode_only else BatchPrefillWithPagedKVCacheWrapper
        wrapper = self._wrappers.get((wrapper_class, kind))
        if wrapper is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8)
            wrapper = self._wrappers[wrapper_class, kind] = wrapper_class(workspace, "HND")
        shape = dict(num_qo_heads=num_heads, num_kv_heads=num_kv_heads, page_size=self.block_size)
        options = dict(
            sm_scale=scale,
            window_left=window_left,
            logits_soft_cap=soft_cap,
            q_data_type=self.model_dtype,
            kv_data_type=kv_cache_dtype,
        )
        tables = (step.kv_indptr, step.kv_indices, step.kv_last_page_len)
        if step.decode_only:
            wrapper.plan(*tables, head_dim=head_size, **shape, **options)
        else:
            wrapper.plan(step.qo_indptr, *tables, head_dim_qk=head_size, causal=True, **shape, **options)
        return wrapper

    def step(self, m: CommonAttentionMetadata) -> KernforgeStep:
        """FlashInfer's page table of a scheduler step from vLLM's block table and lengths."""
        block_size, requests = self.block_size, m.num_reqs
        qo_indptr = m.query_start_loc[: requests + 1].to(torch.int32)
        seq_lens = m.seq_lens[:requests].to(torch.int32)
        pages = (seq_lens + block_size - 1) // block_size
        kv_indptr = torch.zeros(requests + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=kv_indptr[1:])
        table = m.block_table_tensor[:requests]
        in_use = torch.arange(table.shape[1], dtype=torch.int32) < pages[:, None]
        kv_indices = table[in_use].to(torch.int32)  # row by row: each request's pages in order
        kv_last_page_len = torch.where(pages > 0, seq_lens - (pages - 1) * block_size, 0).to(torch.int32)
        tokens = int(m.query_start_loc_cpu[requests])  # without padding rows, if the runner added any
        batch_indices, positions = kernforge.get_batch_indices_positions(qo_indptr, seq_lens, tokens)
        return KernforgeStep(
            tokens,
            m.max_query_len,
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            batch_indices,
            positions,
            self,
        )


class KernforgeMetadataBuilder(CPUAttentionMetadataBuilder):
    """A :class:`KernforgeStep` per step (vLLM's CPU metadata for a group kernforge does not run)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.planner = StepPlanner(self.block_size, vllm_config.model_config.dtype)
        self.fallback = self._fallback_reason(layer_names) or self._measured_slower(layer_names)
        if self.fallback is not None:
            logger.info_once("vLLM's CPU attention runs %s (%s)", ", ".join(layer_names[:3]), self.fallback)

    def _fallback_reason(self, layer_names: list[str]) -> str | None:
        if self.is_cross_attention or self.is_encoder_only_attention:
            return "encoder or cross attention"
        layers = get_layers_from_vllm_config(self.vllm_config, Attention, layer_names)
        reasons = {_unsupported(layer.impl) for layer in layers.values()} - {None}
        return ", ".join(sorted(reasons)) or None

    def _measured_slower(self, layer_names: list[str]) -> str | None:
        """The self-check's verdict for this group (:mod:`kernforge.integrations.vllm.selfcheck`)."""
        layers = get_layers_from_vllm_config(self.vllm_config, Attention, layer_names)
        impl = next(iter(layers.values())).impl
        shapes = (
            f"{self.dtype} cache {self.kv_cache_dtype} heads {impl.num_heads}/{impl.num_kv_heads} head "
            f"{impl.head_size} block {self.block_size} window {impl.sliding_window} layers {len(layers)}"
        )
        cases = functools.partial(_attention_cases, self, impl, len(layers))
        return None if selfcheck.kernforge_is_faster("attention", shapes, cases) else "measured faster on this CPU"

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        m = common_attn_metadata
        if self.fallback is not None or isinstance(m.causal, torch.Tensor) or not m.causal:
            return super().build(common_prefix_len, m, fast_build)
        return self.planner.step(m)


class KernforgeAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention layer implementation, running kernforge's append and attention on a
    :class:`KernforgeStep` (vLLM's own on vLLM's metadata)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # FlashInfer's window_left counts the keys before the query; vLLM's window includes it.
        self.window_left = self.sliding_window - 1 if self.sliding_window > 0 else -1
        self.soft_cap = self.logits_soft_cap or None

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(attn_metadata, KernforgeStep):
            if attn_metadata is not None and key is not None and self.kv_sharing_target_layer_name is None:
                super().do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by kernforge's attention backend")
        return self.run_step(layer, query, key, value, kv_cache, attn_metadata, output)

    def run_step(self, layer, query, key, value, kv_cache: torch.Tensor, step: KernforgeStep, output: torch.Tensor):
        """The new tokens' K/V written into ``kv_cache``, then attention over it into ``output``."""
        tokens = step.num_actual_tokens
        k_cache, v_cache, cache_dtype = self._cache_halves(kv_cache)
        k_scale, v_scale = layer._k_scale_float, layer._v_scale_float
        if key is not None and self.kv_sharing_target_layer_name is None:
            kernforge.append_paged_kv_cache(
                _stored(key[:tokens], k_scale, cache_dtype),
                _stored(value[:tokens], v_scale, cache_dtype),
                step.batch_indices,
                step.positions,
                (k_cache, v_cache),
                step.kv_indices,
                step.kv_indptr,
                step.kv_last_page_len,
                "HND",
            )
        wrapper = step.wrapper(self, cache_dtype)
        scales = dict(k_scale=k_scale, v_scale=v_scale) if cache_dtype in FP8_CACHE_DTYPES.values() else {}
        wrapper.run(query[:tokens], (k_cache, v_cache), out=output[:tokens], **scales)
        return output

    def _cache_halves(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
        """K and V of vLLM's ``[blocks, kv_heads, block_size, 2 * head_size]`` cache as HND views."""
        blocks, kv_heads, block_size, content = kv_cache.shape
        if kv_heads != self.num_kv_heads or content != 2 * self.head_size:
            raise ValueError(
                f"vLLM's KV cache has shape {tuple(kv_cache.shape)}; kernforge's backend expects [blocks, "
                f"{self.num_kv_heads} kv heads, block size, {2 * self.head_size}] (vLLM changed its CPU layout?)"
            )
        fp8 = FP8_CACHE_DTYPES.get(self.kv_cache_dtype)
        if fp8 is not None:
            kv_cache = kv_cache.view(fp8)
        halves = kv_cache.view(blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        return halves[0], halves[1], kv_cache.dtype


# The attention self-check's scheduler steps: (query tokens, sequence length) per request.
ATTENTION_CHECK_STEPS = {
    "decode 1 x 2048": [(1, 2048)],
    "decode 8 x 512": [(1, 512)] * 8,
    "prefill 256": [(256, 256)],
}


def _attention_cases(builder: KernforgeMetadataBuilder, impl: KernforgeAttentionImpl, layers: int) -> dict:
    """The attention self-check: a scheduler step of ``layers`` layers like ``impl``'s, each writing
    its K/V and attending, kernforge's (one plan, then its append and run per layer) against vLLM's
    (its metadata builder, then its cache write and kernel per layer), each on its own cache."""
    checks = {name: CheckStep(builder, impl, layers, requests) for name, requests in ATTENTION_CHECK_STEPS.items()}
    return {name: (check.kernforge, check.vllm) for name, check in checks.items()}


class CheckStep:
    """One scheduler step of the attention self-check, its inputs made once."""

    def __init__(self, builder, impl: KernforgeAttentionImpl, layers: int, requests: list[tuple[int, int]]) -> None:
        self.builder, self.impl, self.layers = builder, impl, layers
        self.metadata, blocks = _check_step(requests, builder.block_size)
        tokens, dtype = self.metadata.num_actual_tokens, builder.dtype
        self.q = torch.randn(tokens, impl.num_heads, impl.head_size, dtype=dtype)
        self.k, self.v = (torch.randn(tokens, impl.num_kv_heads, impl.head_size, dtype=dtype) for _ in "kv")
        self.out = torch.empty_like(self.q)
        self.layer = SimpleNamespace(isa=builder.isa, _k_scale_float=1.0, _v_scale_float=1.0)
        self.kernforge_cache, self.vllm_cache = (_check_cache(blocks, impl, builder) for _ in "kv")

    def kernforge(self) -> None:
        step = self.builder.planner.step(self.metadata)
        for _ in range(self.layers):
            self.impl.run_step(self.layer, self.q, self.k, self.v, self.kernforge_cache, step, self.out)

    def vllm(self) -> None:
        metadata = CPUAttentionMetadataBuilder.build(self.builder, 0, self.metadata)
        for _ in range(self.layers):
            self.impl.forward(self.layer, self.q, self.k, self.v, self.vllm_cache, metadata, self.out)


def _check_step(requests: list[tuple[int, int]], block_size: int) -> tuple[SimpleNamespace, int]:
    """vLLM's metadata of a scheduler step over consecutive blocks (the fields both builders
    read), and the number of blocks it uses."""
    q_lens = torch.tensor([q for q, _ in requests], dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in requests], dtype=torch.int32)
    width = (int(seq_lens.max()) + block_size - 1) // block_size
    table = torch.arange(len(requests) * width, dtype=torch.int32).view(len(requests), width)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    positions = torch.cat([torch.arange(s - q, s) for q, s in requests])
    request = torch.repeat_interleave(torch.arange(len(requests)), q_lens.long())
    slots = table[request, positions // block_size].long() * block_size + positions % block_size
    step = SimpleNamespace(
        num_reqs=len(requests),
        num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        block_table_tensor=table,
        slot_mapping=slots,
        causal=True,
    )
    return step, table.numel()


def _check_cache(blocks: int, impl: KernforgeAttentionImpl, builder: KernforgeMetadataBuilder) -> torch.Tensor:
    """A layer's cache as vLLM allocates it (fp8 caches as bytes), written with random values."""
    shape = (blocks, impl.num_kv_heads, builder.block_size, 2 * impl.head_size)
    if impl.kv_cache_dtype in FP8_CACHE_DTYPES:
        return torch.randn(shape).to(FP8_CACHE_DTYPES[impl.kv_cache_dtype]).view(torch.uint8)
    return torch.randn(shape, dtype=builder.dtype)


ALLOCATE_KV_CACHE_PARAMETERS = ["kv_cache_config", "device", "layout", "kernel_block_sizes"]  # vLLM 0.32's


def patch_kv_cache_allocation() -> bool:
    """Have vLLM's KV caches start in huge pages: wraps ``allocate_kv_cache`` as vLLM's model runner
    calls it (checked against the signature it was written for; False: nothing wrapped)."""
    from vllm.v1.worker import gpu_model_runner

    original = getattr(gpu_model_runner, "allocate_kv_cache", None)
    if original is None or list(inspect.signature(original).parameters) != ALLOCATE_KV_CACHE_PARAMETERS:
        return False
    if getattr(original, "kernforge_original", None) is None:
        gpu_model_runner.allocate_kv_cache = _in_huge_pages(original)
    return True


def _in_huge_pages(original):
    @functools.wraps(original)
    def allocate_kv_cache(*args, **kwargs) -> dict[str, torch.Tensor]:
        """vLLM's allocation (one buffer of zeros, viewed per layer), whose buffer is then handed back
        to Linux as huge pages of zeros (``kernforge.zero_in_huge_pages``): decode's reads of
        scattered blocks miss the TLB less. Not written yet, so nothing is copied."""
        caches = original(*args, **kwargs)
        storages = (cache.untyped_storage() for cache in caches.values() if cache.device.type == "cpu")
        for storage in {storage.data_ptr(): storage for storage in storages}.values():
            released = kernforge.zero_in_huge_pages(torch.empty(0, dtype=torch.uint8).set_(storage))
            if released:
                logger.info_once("kernforge: vLLM's KV cache (%.2f GiB) starts in huge pages", released / 2**30)
        return caches

    allocate_kv_cache.kernforge_original = original
    return allocate_kv_cache


def _stored(rows: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """New K or V rows as the cache holds them: an fp8 cache holds ``rows / scale`` (saturated, as
    vLLM's own write), which ``run()`` scales back."""
    if cache_dtype not in FP8_CACHE_DTYPES.values():
        return rows
    largest = torch.finfo(cache_dtype).max
    return (rows.float() / scale).clamp_(-largest, largest).to(cache_dtype)
