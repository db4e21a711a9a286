"""Hugging Face transformers on kernforge: ``optimize(model)`` makes a Llama-family causal LM
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``Gemma3ForCausalLM``) or a sparse mixture of experts (``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM``,
``MixtralForCausalLM``, ``OlmoeForCausalLM``), or DeepSeek's multi-head latent attention models
(``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``) run its decoder on kernforge's kernels, without
forking transformers' model code::

    from kernforge.integrations import transformers as kft

    model = kft.optimize(model, kv_cache_pages=4096)              # or quant="int8" (w8a8 linears)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)   # transformers' generate
    out = kft.generate(model, input_ids, attention_mask=mask, do_sample=True, top_k=50, top_p=0.9)

What changes (in place; the model's and the decoder layers' ``forward`` stay transformers' code):

* attention: each layer's attention module becomes one packed q|k|v :class:`kernforge.nn.Linear`,
  RoPE in place (``apply_rope_with_cos_sin_cache_inplace``, the model's own frequencies), the
  append to kernforge's paged KV cache (``append_paged_kv_cache``) and attention through the
  ``"kernforge"`` function registered with transformers' ``AttentionInterface`` (plus a matching
  ``AttentionMaskInterface`` entry, which hands it the padding mask). The cache is a transformers
  ``Cache`` (:class:`PagedCache`) over pages of one pool per model (``kv_cache_pages`` pages of
  ``page_size`` tokens); prefill runs ``BatchPrefillWithPagedKVCacheWrapper`` and decode
  ``BatchDecodeWithPagedKVCacheWrapper``, planned once per forward by the first layer and run by
  every layer. ``model(...)`` and ``model.generate(...)`` get a fresh :class:`PagedCache` when
  they would have made a ``DynamicCache``; a ``use_cache=False`` forward gets one whose pages return
  to the pool when it ends, and returns none. Attention weights are not computed:
  ``output_attentions=True`` warns, and gets an empty ``attentions``;
* RMSNorms: kernforge's ``rmsnorm`` (Gemma 3's, which scale by ``1 + weight``: ``gemma_rmsnorm``, the
  four of each layer and the q/k norms; the decoder layers' residual adds are transformers');
* MLP: one packed gate|up linear, ``silu_and_mul`` (or the GELU gated kernel the config names)
  and the down linear;
* sparse MoE blocks (the layers that have one; Qwen2/3-MoE's ``mlp_only_layers`` and
  ``decoder_sparse_step`` leave dense MLPs, which take the MLP path): the router's logits through a
  :class:`kernforge.nn.Linear` in the model's dtype, ``topk_softmax`` with the model's own rule
  (renormalized top-k weights when ``norm_topk_prob``; always for Mixtral), and the experts in one
  ``fused_experts`` call on weights packed once (bf16, or quantized as ``quant`` says, as the
  linears are); Qwen2-MoE's shared expert runs as an MLP above, scaled by the sigmoid of its gate.
  Experts gated by another activation than SiLU keep the stock block;
* attention variants: biased q/k/v (Qwen2, Qwen2-MoE), sliding windows (per layer as the model
  sets them), Qwen3's and Gemma 3's per-head q/k RMSNorms, Gemma 3's softmax scale
  (``query_pre_attn_scalar``) and RoPE per layer type (a cos/sin cache for its global layers, one for
  its sliding ones; its scaled embedding and soft-capped final logits, if set, stay transformers'),
  OLMoE's q/k RMSNorms over the whole projection and its ``clip_qkv`` clamp;
* every ``nn.Linear``, ``lm_head`` included, becomes a :class:`kernforge.nn.Linear` (bf16 prepacked,
  or w8a8 with ``quant="int8"``; ``lm_head`` stays bf16 unless ``quant_lm_head=True``);
* DeepSeek-V2/V3 (:class:`~kernforge.integrations.transformers._modules.MLAttention`): q_a (or q)
  and ``kv_a_proj_with_mqa`` as one GEMM, the latent ``c`` RMSNorm'd, RoPE (interleaved, YaRN's
  frequencies and mscale as the model has them) on ``q_pe`` and the shared ``k_pe``, and ``[c | k_pe]``
  appended (``append_paged_mla_kv_cache``) to one paged latent buffer per layer (``[pages, page_size,
  kv_lora_rank + qk_rope_head_dim]``, :class:`MLAPagedCache`). A fresh prompt of at least
  ``RAGGED_PREFILL_MIN_TOKENS`` tokens attends unabsorbed (``kv_b_proj(c)`` to k_nope and v,
  ``BatchPrefillWithRaggedKVCacheWrapper``, head dims qk_nope + rope / v); decode and every other
  step absorbed (``q_nope`` through W_UK, ``BatchMLAPagedAttentionWrapper`` over the latent pages,
  the output through W_UV: ``absorb_kv_b_proj``, ``mla_output_proj``). MoE layers
  (:class:`~kernforge.integrations.transformers._modules.DeepseekMoE`): the router in fp32, V2's
  ``greedy`` (``topk_softmax``) or ``group_limited_greedy`` (``grouped_topk``), V3's sigmoid scores
  with ``e_score_correction_bias`` (``biased_grouped_topk``), ``fused_experts``, and the shared
  experts with ``routed_scaling_factor`` in one ``shared_expert`` call; the first
  ``first_k_dense_replace`` layers' dense MLPs take the MLP path. bf16 models only; eager only (the
  MLA wrapper's run() is not traceable yet);
* sampling: :func:`generate`, a small loop over the same cache with transformers' arguments, samples
  with ``top_k_top_p_sampling_from_logits``. (``model.generate`` samples with torch.)

``model.save_pretrained(dir)`` writes the checkpoint the stock model would have (``_saving``: the
packed bf16 weights unpacked, exactly), which transformers loads and ``optimize`` takes again; a model
whose weights were quantized, or rounded to bf16 from a wider dtype, or packed as MoE experts, refuses
with a ValueError saying how to save it (before ``optimize``).

A model of another kind, or a configuration kernforge cannot run (a head dim without attention
kernels, a RoPE type whose frequencies change with the length, a missing pre-warmed kernel with
``KERNFORGE_JIT=0``), raises :class:`UnsupportedModelError` or ``KernelNotCachedError`` naming
what is missing. A module left on transformers' path is named in a warning.
"""

from __future__ import annotations

import warnings

try:
    import transformers  # noqa: F401  (the dependency, checked first for a clear message)
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kernforge.integrations.transformers needs Hugging Face transformers >= 5: "
        "pip install 'kernforge[transformers]'"
    ) from exc

import copy
import os
import sys

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from kernforge.integrations.transformers import _compat, _decode, _kernels, _modules, _saving, _tensor_parallel
from kernforge.integrations.transformers._cache import (
    AttentionSpec,
    KVCacheFullError,
    MLASpec,
    PagedCache,
    PagePool,
    new_cache,
    paged_cache,
)
from kernforge.integrations.transformers._checkpoints import Int4CheckpointLinear, from_pretrained
from kernforge.integrations.transformers._generate import generate
from kernforge.integrations.transformers._gguf import from_gguf, gguf_manifest, gguf_tokenizer
from kernforge.jit import KernelNotCachedError
from kernforge.memory import trim_heap
from kernforge.model_spec import ModelSpec
from kernforge.nn import Linear
from kernforge.nn.gguf import GGUFExperts, GGUFLinear
from kernforge.nn.linear import Int4LinearWeights
from kernforge.ops._common import MAX_HEAD_DIM

_compat.warn_if_untested(transformers.__version__)

__all__ = [
    "Int4CheckpointLinear",
    "KVCacheFullError",
    "PagedCache",
    "UnsupportedModelError",
    "from_gguf",
    "from_pretrained",
    "generate",
    "gguf_manifest",
    "gguf_tokenizer",
    "new_cache",
    "optimize",
]

# model_type -> the causal LM class optimize() takes
SUPPORTED_MODELS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Multi-head latent attention models (MLAttention on a paged latent cache, DeepseekMoE blocks).
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED_MODELS)
# RoPE types whose frequencies are fixed at init (inv_freq), so one cos/sin cache serves every length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class UnsupportedModelError(NotImplementedError):
    """The model, or a part of its configuration, has no kernforge path."""


class _Runtime:
    """What an optimized model carries (as ``model._kernforge``): the model spec it was built by
    (pre-warm's manifest is ``kernforge.prewarm.manifest_from_spec`` of it), the attention spec, its
    page pool, the stock state dict's layout (what ``save_pretrained`` writes back) and, with tensor
    parallelism, the communicator; while a ``use_cache=False`` forward runs, its cache."""

    def __init__(
        self,
        model_spec: ModelSpec,
        spec: AttentionSpec | MLASpec,
        pool: PagePool,
        quant: str | None,
        stock: _saving._Stock,
        comm=None,
    ):
        self.model_spec, self.spec, self.pool, self.quant, self.comm = model_spec, spec, pool, quant, comm
        self.stock = stock
        self.uncached: PagedCache | None = None  # the pages of the use_cache=False forward running now
        self.warned: set[str] = set()  # what this model has warned about (once each)

    def release_uncached(self) -> PagedCache | None:
        """Return the pages of the ``use_cache=False`` forward (one that raised leaves them here); its cache."""
        cache, self.uncached = self.uncached, None
        if cache is not None:
            cache.reset()
        return cache


def optimize(
    model: nn.Module,
    kv_cache_pages: int = 2048,
    quant: str | None = None,
    *,
    page_size: int = 16,
    quant_lm_head: bool | str = False,
    tp_group=None,
    materialize_layer=None,
) -> nn.Module:
    """Make ``model`` (a Llama-family or MoE ``*ForCausalLM``, :data:`SUPPORTED_MODELS`) run on
    kernforge, in place; returns it.

    ``kv_cache_pages`` pages of ``page_size`` tokens are the model's KV memory, shared by every
    live :class:`PagedCache` (each batch of a ``generate`` call holds its sequences' pages until
    it ends). ``quant="int8"`` makes the decoder's linears and MoE experts w8a8 (per-channel int8
    weights, per-token int8 activations; MoE routers stay bf16), ``quant="int4"`` four-bit weights
    (groups of 128 K, asymmetric) with int8 activations (W4A8), ``quant="int4_w4a16"`` with bf16 ones;
    ``lm_head`` follows only with ``quant_lm_head=True``, or takes a quant of its own
    (``quant_lm_head="int8"``: an int8 head for a four-bit model, the head and tied embedding being a
    fifth of a 1B model's bytes).

    ``tp_group`` (a ``torch.distributed`` process group, or a
    :class:`kernforge.distributed.Communicator`): tensor parallelism over its ranks, each of which
    calls ``optimize`` on its own copy of the model: attention heads and the MLP's intermediate
    rows split among the ranks, kernforge's all-reduce after o_proj and down_proj, the vocabulary of
    lm_head split and its logits all-gathered (``_tensor_parallel``); dense Llama-family models.

    ``materialize_layer``: called as ``materialize_layer(index, layer)`` just before decoder layer
    ``index`` is replaced, for a model whose decoder layers wait on the meta device (built with
    ``torch.device("meta")``; :func:`~kernforge.integrations.random_llama.random_layer_weights` fills
    random ones): each layer's weights exist only until it is packed, so a model larger than memory
    in its own dtype (Qwen3-30B-A3B, 61 GB in bf16) loads quantized in its packed size.
    """
    if getattr(model, "_kernforge", None) is not None:
        raise ValueError("this model is already optimized by kernforge")
    config, decoder = _checked_model(model, materialize_layer is not None)
    _check_attention_variant(config)
    dtype = model.dtype
    if dtype not in _MODEL_DTYPES:
        raise UnsupportedModelError(f"model dtype {dtype} is not supported; kernforge runs bf16, fp16 and fp32 models")
    # One spec, read from the config, for everything below: what pre-warm derives its kernels from
    # (manifest_from_spec) is what the replaced modules run by, whatever their attributes say.
    model_spec = _model_spec(config, dtype)
    mla = config.model_type in MLA_MODEL_TYPES
    comm = _tp_communicator(tp_group, config, decoder, mla)
    if mla:
        spec = _mla_spec(model_spec, decoder, dtype)
    else:
        spec = _attention_spec(model_spec, decoder, dtype, comm.world_size if comm is not None else 1)
    _check_kernels(model_spec, quant, getattr(model, "gguf_file", None))
    pool = PagePool(spec, kv_cache_pages, page_size)  # checks kv_cache_pages and page_size before any change
    stock_layout = _saving.stock_layout(model)  # what save_pretrained writes back, recorded before any change
    if comm is not None:
        _tensor_parallel.shard_stock_modules(model, comm)
    _modules.register()
    model.eval()
    stock = []
    with torch.no_grad():
        # RoPE for every position the pool can hold (capped by the model's context length)
        positions = min(pool.num_pages * pool.page_size, getattr(config, "max_position_embeddings", None) or 1 << 30)
        decoder.rotary_emb = _modules.rotary_embedding(decoder.rotary_emb, positions)
        for index, layer in enumerate(decoder.layers):
            _materialized(layer, index, materialize_layer)
            _check_mlp_kind(layer, index, model_spec)
            if mla:
                _replace_deepseek_layer(layer, model_spec, spec, dtype, quant, stock)
            else:
                _replace_layer(layer, model_spec, spec, dtype, quant, stock)
            if materialize_layer is not None:
                trim_heap()  # this layer's freed temporaries, back to the OS before the next is drawn
        decoder.norm = _norm(decoder.norm, model_spec, dtype)
        if _linear_like(model.lm_head):
            head_quant = quant_lm_head if isinstance(quant_lm_head, str) else quant if quant_lm_head else None
            if comm is None:
                model.lm_head = Linear.from_linear(model.lm_head, dtype=dtype, quant=head_quant)
            else:
                part, vocab = _tensor_parallel.vocab_parallel_head(model.lm_head, comm)
                head = Linear.from_linear(part, dtype=dtype, quant=head_quant)
                model.lm_head = _tensor_parallel.VocabParallel(head, comm, vocab)
        if comm is not None:
            _tensor_parallel.parallelize_outputs(model, comm)
    runtime = model._kernforge = _Runtime(model_spec, spec, pool, quant, stock_layout, comm)
    _own_config(model)._attn_implementation = _modules.ATTN_IMPLEMENTATION
    decoder.register_forward_pre_hook(
        _paged_cache_hook(runtime, _compat.cache_argument(decoder.forward)), with_kwargs=True
    )
    decoder.register_forward_hook(_uncached_forward_hook(runtime))
    if not mla:  # decode steps as prepared kernel calls (_decode); anything else runs transformers' forward
        decoder.forward = _decode.DecodeSteps(decoder, decoder.forward, _compat.cache_argument(decoder.forward))
    _saving.install(model)
    _warn_stock_modules(model, stock)
    return model


# --------------------------------------------------------------------------- checks


def _checked_model(model, layers_materialized: bool = False):
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not hasattr(model, "lm_head") or not hasattr(model, "model"):
        supported = ", ".join(f"{name} ({kind})" for kind, name in SUPPORTED_MODELS.items())
        raise UnsupportedModelError(
            f"kernforge.integrations.transformers.optimize supports Llama-family and MoE causal LMs: "
            f"{supported}; got {type(model).__name__} (model_type {model_type!r})"
        )
    decoder = model.model
    for name in ("layers", "rotary_emb", "norm", "embed_tokens"):
        if not hasattr(decoder, name):
            raise UnsupportedModelError(f"{type(model).__name__}.model has no {name}: not a Llama-family decoder")
    in_layers = {id(parameter) for parameter in decoder.layers.parameters()} if layers_materialized else set()
    for name, parameter in model.named_parameters():
        if parameter.is_meta and id(parameter) not in in_layers:
            raise ValueError(
                f"{name} is on the meta device: only decoder layers may wait there, filled by materialize_layer"
            )
        if parameter.device.type not in ("cpu", "meta"):
            raise UnsupportedModelError(f"the model is on {parameter.device}; kernforge runs on the CPU")
    return config, decoder


def _materialized(layer: nn.Module, index: int, materialize_layer) -> None:
    """Decoder layer ``index`` with its weights in memory (``materialize_layer`` fills a meta layer)."""
    if materialize_layer is not None:
        materialize_layer(index, layer)
        if any(parameter.is_meta for parameter in layer.parameters()):
            raise ValueError(f"materialize_layer left decoder layer {index} with weights on the meta device")


def _check_rope(model_spec: ModelSpec, rotary: nn.Module, rotary_dim: int) -> None:
    """The config's RoPE type has fixed frequencies, and the rotary module (whose ``inv_freq`` the
    cos/sin cache is made of) covers the ``rotary_dim`` the spec says."""
    if model_spec.rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {model_spec.rope_type!r} recomputes its frequencies with the sequence length; "
            f"kernforge's cos/sin cache supports {', '.join(STATIC_ROPE_TYPES)}"
        )
    for inv_freq in _modules.rope_frequencies(rotary).values():  # one, or one per layer type (Gemma 3)
        covered = 2 * inv_freq.numel()
        if covered != rotary_dim:
            what = "qk_rope_head_dim" if model_spec.is_mla else "head_dim"
            raise UnsupportedModelError(
                f"partial rotary embedding (rotary dim {covered} of {what} {rotary_dim}) is not supported"
            )


def _check_attention_variant(config) -> None:
    """What kernforge's attention plan does not compute: Gemma's tanh soft-capping of the attention
    logits (Gemma 2's; Gemma 3 has none) and bidirectional attention (EmbeddingGemma's). The final
    logits' soft-capping is the causal LM's own forward, which stays transformers'."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            f"attn_logit_softcapping {config.attn_logit_softcapping}: kernforge's attention does not soft-cap "
            "the attention logits"
        )
    if getattr(config, "use_bidirectional_attention", None):
        raise UnsupportedModelError("use_bidirectional_attention=True: kernforge's attention is causal")


def _tp_communicator(tp_group, config, decoder, mla: bool):
    """The communicator of ``tp_group`` (None without one, or with one rank), after checking the
    model shards among its ranks."""
    if tp_group is None:
        return None
    from kernforge.distributed import Communicator

    comm = tp_group if isinstance(tp_group, Communicator) else Communicator(tp_group)
    if comm.world_size == 1:
        return None
    if mla:
        raise UnsupportedModelError("tensor parallelism covers Llama-family attention, not latent attention (MLA)")
    _tensor_parallel.check_shardable(config, decoder, comm.world_size)
    return comm


def _attention_spec(model_spec: ModelSpec, decoder, dtype, tp: int = 1) -> AttentionSpec:
    """The attention's shape on this rank (``tp`` ranks share the heads), from the model spec."""
    head_dim, layers = model_spec.head_dim, len(decoder.layers)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise UnsupportedModelError(
            f"head_dim {head_dim} has no kernforge attention kernel: decode and prefill take "
            f"head dims from 1 to {MAX_HEAD_DIM}"
        )
    _check_rope(model_spec, decoder.rotary_emb, head_dim)
    _check_layer_count(model_spec, layers)
    heads, kv_heads = model_spec.num_attention_heads // tp, model_spec.num_key_value_heads // tp
    windows = tuple(model_spec.window_left(index) for index in range(layers))
    return AttentionSpec(layers, heads, kv_heads, head_dim, dtype, model_spec.sm_scale, windows)


def _check_layer_count(model_spec: ModelSpec, layers: int) -> None:
    if model_spec.num_hidden_layers != layers:
        raise UnsupportedModelError(
            f"the config says num_hidden_layers {model_spec.num_hidden_layers}, the model has {layers} decoder layers"
        )


def _model_spec(config, dtype: torch.dtype) -> ModelSpec:
    """The model as pre-warm sees it, from its config (in the dtype it is loaded in). An activation
    without a gated kernel is taken (its MLP stays on transformers' path)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return ModelSpec.from_config({**config.to_dict(), "torch_dtype": name, "dtype": name}, any_activation=True)
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from None


def _mla_spec(model_spec: ModelSpec, decoder, dtype) -> MLASpec:
    """The latent attention's shape (DeepSeek-V2/V3, from the model spec), checked against the
    modules and what kernforge runs."""
    if dtype is not torch.bfloat16:
        raise UnsupportedModelError(
            f"kernforge runs DeepSeek's latent attention in bf16 (its absorbed projections are bf16 GEMMs); "
            f"the model is {dtype}: load it with dtype=torch.bfloat16"
        )
    first = decoder.layers[0].self_attn
    if not model_spec.is_mla or getattr(first, "kv_a_proj_with_mqa", None) is None:
        raise UnsupportedModelError(
            f"{type(first).__name__} (config kv_lora_rank {model_spec.kv_lora_rank}): not DeepSeek's latent attention"
        )
    rope_dim = model_spec.qk_rope_head_dim
    _check_rope(model_spec, decoder.rotary_emb, rope_dim)
    _check_layer_count(model_spec, len(decoder.layers))
    qk_dim, v_dim = model_spec.qk_nope_head_dim + rope_dim, model_spec.v_head_dim
    if max(qk_dim, v_dim) > MAX_HEAD_DIM:
        raise UnsupportedModelError(
            f"qk head dim {qk_dim} / v head dim {v_dim}: kernforge's prefill kernels take head dims "
            f"up to {MAX_HEAD_DIM}"
        )
    return MLASpec(
        len(decoder.layers),
        model_spec.num_attention_heads,
        model_spec.kv_lora_rank,
        rope_dim,
        model_spec.qk_nope_head_dim,
        v_dim,
        dtype,
        float(first.scaling),  # the module's: YaRN's mscale included
    )


def _check_kernels(model_spec: ModelSpec, quant: str | None, gguf_file: str | None = None) -> None:
    """With KERNFORGE_JIT=0, every kernel the model's manifest lists must be cached already: the
    manifest pre-warm derives from ``model_spec``, the spec the model runs by (and, for a model read
    from a GGUF file, from the file's tensor types)."""
    from kernforge.jit import core
    from kernforge.prewarm import manifest_from_spec, specs_from_manifest

    if core.jit_enabled():
        return
    try:
        if gguf_file is not None:
            manifest = gguf_manifest(gguf_file, dtype=model_spec.dtype)
        else:
            manifest = manifest_from_spec(model_spec, quant=quant)
    except ValueError as exc:  # what pre-warm refuses (an activation without a gated kernel)
        raise UnsupportedModelError(f"KERNFORGE_JIT=0 and pre-warm cannot build this model's kernels: {exc}") from None
    missing = []
    for kernel in specs_from_manifest(manifest):
        try:
            core.build(kernel, load=False, allow_compile=False)
        except KernelNotCachedError:
            missing.append(f"{kernel.module.name}({', '.join(f'{k}={v}' for k, v in kernel.params)})")
    if missing:
        raise KernelNotCachedError(
            f"KERNFORGE_JIT=0 and {len(missing)} kernels this model needs are not cached: {'; '.join(missing)}. "
            + (
                f"Build them first with: python -m kernforge prewarm --gguf {gguf_file}"
                if gguf_file is not None
                else "Build them first with: python -m kernforge prewarm --model-config <the model's config.json>"
                + (f" --quant {quant}" if quant else "")
            )
        )


# --------------------------------------------------------------------------- replacement


def _replace_layer(layer, model_spec: ModelSpec, spec: AttentionSpec, dtype, quant, stock: list) -> None:
    """A Llama-family (or sparse MoE) decoder layer: Attention, the MLP or SparseMoE, the RMSNorms,
    each shaped by the model spec (``spec``: its attention on this rank)."""
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not _linear_like(getattr(attn, name, None)):
            raise UnsupportedModelError(f"{type(attn).__name__} has no nn.Linear {name}: not a Llama-family attention")
    _check_attention_widths(attn, spec)
    _check_qk_norms(attn, spec)
    norm = _modules.GemmaRMSNorm if model_spec.gemma_norms else _modules.RMSNorm
    layer.self_attn = _modules.Attention(attn, dtype, quant, spec, model_spec.clip_qkv, norm)
    if _is_sparse_moe(layer.mlp):
        layer.mlp = _replaced_moe(layer.mlp, model_spec, dtype, quant, stock)
    else:
        layer.mlp = _replaced_mlp(layer.mlp, model_spec.activation, dtype, quant, stock)
    _replace_norms(layer, model_spec, dtype)


def _check_mlp_kind(layer: nn.Module, index: int, model_spec: ModelSpec) -> None:
    """Layer ``index`` has experts where the spec says (pre-warm builds the dense MLP's GEMMs by it)."""
    sparse = _is_sparse_moe(layer.mlp)
    if sparse != model_spec.is_sparse_layer(index):
        raise UnsupportedModelError(
            f"decoder layer {index} has {type(layer.mlp).__name__}; its config makes it "
            + ("a sparse MoE layer" if model_spec.is_sparse_layer(index) else "a dense MLP layer")
        )


# A decoder layer's norms: the Llamas' two, and Gemma 3's around the attention's and the MLP's outputs too.
_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def _replace_norms(layer: nn.Module, model_spec: ModelSpec, dtype: torch.dtype) -> None:
    for name in _LAYER_NORMS:
        if getattr(layer, name, None) is not None:
            setattr(layer, name, _norm(getattr(layer, name), model_spec, dtype))


def _norm(norm: nn.Module, model_spec: ModelSpec, dtype: torch.dtype) -> _modules.RMSNorm:
    """A decoder norm (the layers' two or four, the final one): hidden_size wide, the config's epsilon,
    Gemma's ``1 + weight`` scaling for a Gemma model."""
    width = getattr(getattr(norm, "weight", None), "shape", None)
    if width is not None and tuple(width) != (model_spec.hidden_size,):
        raise UnsupportedModelError(
            f"{type(norm).__name__} normalizes {tuple(width)}, not the config's hidden_size {model_spec.hidden_size}"
        )
    kind = _modules.GemmaRMSNorm if model_spec.gemma_norms else _modules.RMSNorm
    return kind.from_module(norm, dtype, eps=model_spec.rms_norm_eps)


def _check_attention_widths(attn, spec: AttentionSpec) -> None:
    """The q/k/v projections are as wide as the spec's heads (on this rank) times its head_dim."""
    widths = {"q_proj": spec.num_qo_heads, "k_proj": spec.num_kv_heads, "v_proj": spec.num_kv_heads}
    for name, heads in widths.items():
        out = getattr(getattr(attn, name), "out_features", None)
        if out is not None and out != heads * spec.head_dim:
            raise UnsupportedModelError(
                f"{type(attn).__name__}.{name} has {out} outputs; the config says {heads} heads of head_dim "
                f"{spec.head_dim} ({heads * spec.head_dim})"
            )


def _replace_deepseek_layer(layer, model_spec: ModelSpec, spec: MLASpec, dtype, quant, stock: list) -> None:
    """A DeepSeek-V2/V3 decoder layer: MLAttention, DeepseekMoE (or the first_k_dense_replace
    layers' dense MLP), the RMSNorms, each shaped by the model spec (``spec``: its latent attention)."""
    attn = layer.self_attn
    names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    names += ["q_proj"] if model_spec.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    for name in names:
        if type(getattr(attn, name, None)) is not nn.Linear:
            raise UnsupportedModelError(
                f"{type(attn).__name__} has no nn.Linear {name}: not DeepSeek's latent attention"
            )
    # DeepSeek-V2 rotates interleaved pairs (complex products); V3 too unless rope_interleave is False
    interleaved = model_spec.model_type == "deepseek_v2" or model_spec.rope_interleave
    layer.self_attn = _modules.MLAttention(attn, spec, model_spec.q_lora_rank, dtype, quant, interleaved)
    if _is_sparse_moe(layer.mlp):
        layer.mlp = _replaced_deepseek_moe(layer.mlp, model_spec, dtype, quant, stock)
    else:
        layer.mlp = _replaced_mlp(layer.mlp, model_spec.activation, dtype, quant, stock)
    _replace_norms(layer, model_spec, dtype)


def _replaced_deepseek_moe(block, model_spec: ModelSpec, dtype, quant, stock: list) -> nn.Module:
    """A DeepSeek MoE block on kernforge (DeepseekMoE), or left stock when its experts' activation is not SiLU."""
    router, experts, shared = block.gate, block.experts, getattr(block, "shared_experts", None)
    rule = "noaux_tc" if hasattr(router, "e_score_correction_bias") else getattr(router, "topk_method", None)
    laid_out = (
        all(_stacked(getattr(experts, name, None)) for name in ("gate_up_proj", "down_proj"))
        and isinstance(getattr(router, "weight", None), torch.Tensor)
        and all(type(getattr(shared, name, None)) is nn.Linear for name in ("gate_proj", "up_proj", "down_proj"))
    )
    if not laid_out:
        raise UnsupportedModelError(
            f"{type(block).__name__} is not laid out as transformers 5.x's DeepSeek MoE blocks (a router "
            "gate.weight [E, H], experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I], nn.Linear "
            "shared_experts.gate_proj/up_proj/down_proj)"
        )
    if rule not in _modules.DeepseekMoE.RULES:
        raise UnsupportedModelError(
            f"DeepSeek routing topk_method {rule!r} has no kernforge kernel; kernforge runs "
            f"{', '.join(_modules.DeepseekMoE.RULES)}"
        )
    if rule != model_spec.topk_method:
        raise UnsupportedModelError(f"the router runs {rule!r}, the config says topk_method {model_spec.topk_method!r}")
    activation = model_spec.activation
    if activation not in _kernels.EXPERT_ACTIVATIONS:
        stock.append(f"mlp ({type(block).__name__}, hidden_act {activation!r}: fused_experts gates with SiLU only)")
        return block
    return _modules.DeepseekMoE(block, model_spec, dtype, quant)


def _check_qk_norms(attn, spec: AttentionSpec) -> None:
    """q/k RMSNorms run per head (Qwen3) or over the whole projection (OLMoE): nothing else."""
    for name, heads in (("q_norm", spec.num_qo_heads), ("k_norm", spec.num_kv_heads)):
        norm = getattr(attn, name, None)
        width = getattr(norm, "weight", None)
        if norm is not None and (width is None or width.numel() not in (spec.head_dim, heads * spec.head_dim)):
            raise UnsupportedModelError(
                f"{type(attn).__name__}.{name} normalizes groups of {None if width is None else width.numel()}; "
                f"kernforge runs q/k norms per head ({spec.head_dim}) or over the projection ({heads * spec.head_dim})"
            )


def _replaced_mlp(mlp, activation: str, dtype, quant, stock: list) -> nn.Module:
    """A dense MLP on kernforge: GatedMLP, or its own forward over kernforge linears."""
    if activation in _kernels.GATED_ACTIVATIONS and all(
        _linear_like(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")
    ):
        return _modules.GatedMLP(mlp, activation, dtype, quant)
    stock.append(
        f"mlp ({type(mlp).__name__}, hidden_act {activation!r}: no kernforge gated kernel; its linears "
        "run on kernforge.nn.Linear)"
    )
    for name, child in mlp.named_children():
        if _linear_like(child):
            setattr(mlp, name, Linear.from_linear(child, dtype=dtype, quant=quant))
    return mlp


def _linear_like(module) -> bool:
    """An ``nn.Linear``, or what stands for one whose weight is quantized already (``from_pretrained``'s
    four-bit checkpoints, ``from_gguf``'s blocks)."""
    return type(module) is nn.Linear or isinstance(module, (Int4LinearWeights, GGUFLinear))


def _is_sparse_moe(mlp) -> bool:
    """A sparse MoE block: transformers 5's have a router ``gate`` and the ``experts``."""
    return hasattr(mlp, "gate") and hasattr(mlp, "experts")


def _replaced_moe(block, model_spec: ModelSpec, dtype, quant, stock: list) -> nn.Module:
    """A sparse MoE block on kernforge (SparseMoE), or left stock when its experts' activation is not SiLU."""
    _check_moe_block(block)
    activation = model_spec.activation
    if activation not in _kernels.EXPERT_ACTIVATIONS:
        stock.append(f"mlp ({type(block).__name__}, hidden_act {activation!r}: fused_experts gates with SiLU only)")
        return block
    return _modules.SparseMoE(block, model_spec, dtype, quant)


def _check_moe_block(block) -> None:
    """The layout SparseMoE reads: a top-k router with a bare weight and stacked expert weights."""
    router, experts = block.gate, block.experts
    laid_out = (
        (
            isinstance(experts, GGUFExperts)  # from_gguf's, packed per expert
            or all(_stacked(getattr(experts, name, None)) for name in ("gate_up_proj", "down_proj"))
        )
        and isinstance(getattr(router, "weight", None), torch.Tensor)
        and hasattr(router, "top_k")
        and getattr(router, "bias", None) is None
        and (not hasattr(block, "shared_expert") or type(getattr(block, "shared_expert_gate", None)) is nn.Linear)
    )
    if not laid_out:
        raise UnsupportedModelError(
            f"{type(block).__name__} is not laid out as transformers 5.x's sparse MoE blocks (a bias-free "
            "top-k router gate.weight [E, H] with gate.top_k, experts.gate_up_proj [E, 2I, H] and "
            "experts.down_proj [E, H, I], an nn.Linear shared_expert_gate with any shared_expert)"
        )


def _stacked(weight) -> bool:
    return isinstance(weight, torch.Tensor) and weight.dim() == 3


def _warn_stock_modules(model, stock: list) -> None:
    """One warning naming what runs on transformers' path (beyond the embedding lookup)."""
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        or (type(module).__name__.endswith("RMSNorm") and not isinstance(module, _modules.RMSNorm))
    ]
    kinds = sorted(set(stock))
    if names or kinds:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        warnings.warn(
            "kernforge.integrations.transformers.optimize left modules on the stock transformers path: "
            + "; ".join(filter(None, [shown, *kinds])),
            stacklevel=3,
        )


def _own_config(model: nn.Module):
    """Give ``model`` a config of its own, so that what optimize() sets on it (the attention
    implementation) changes no other model: transformers hands one config object to every model
    built from it, and every submodule that keeps it."""
    shared = model.config
    own = copy.deepcopy(shared)
    for module in model.modules():
        if module.__dict__.get("config") is shared:
            module.config = own
    return own


def _paged_cache_hook(runtime: _Runtime, argument: str):
    """A forward pre-hook of the decoder that gives it a PagedCache where transformers would make
    (or has just made, in ``generate``) an empty DynamicCache, and where it would make none
    (``use_cache=False``) one for this forward only. The cache comes under either of transformers'
    names for it and goes on under ``argument``, the one the decoder takes."""

    def hook(module, args, kwargs):
        if kwargs.get("output_router_logits"):  # transformers records them from the routers optimize() replaced
            raise NotImplementedError(
                "a kernforge-optimized model does not record router logits (output_router_logits, for training's "
                "auxiliary loss): pass output_router_logits=False"
            )
        _warn_attentions_not_computed(runtime, module, kwargs)
        runtime.release_uncached()  # a use_cache=False forward that raised left its pages there
        cache = _compat.take_cache(kwargs)
        if cache is None and not _uses_cache(module, kwargs):
            # no cache wanted (stock makes none), but kernforge attention reads the pages: this forward
            # gets a cache of its own, whose pages return when it ends (_uncached_forward_hook)
            cache = runtime.uncached = paged_cache(runtime.spec, runtime.pool)
        elif cache is None or (isinstance(cache, DynamicCache) and cache.get_seq_length() == 0):
            cache = paged_cache(runtime.spec, runtime.pool)
        elif not isinstance(cache, PagedCache):
            raise TypeError(
                f"a kernforge-optimized model keeps its KV cache in a PagedCache; got {argument}="
                f"{type(cache).__name__} holding {cache.get_seq_length()} tokens. Continue with the "
                f"PagedCache the previous call returned, or start from {argument}=None"
            )
        kwargs[argument] = cache
        return args, kwargs

    return hook


def _uses_cache(decoder: nn.Module, kwargs: dict) -> bool:
    """Whether the forward keeps a cache: its ``use_cache``, else the config's (as transformers reads it)."""
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(decoder.config, "use_cache", None)
    return bool(use_cache)


def _uncached_forward_hook(runtime: _Runtime):
    """A forward hook of the decoder: after a ``use_cache=False`` forward, its pages go back to the pool
    and its output has no cache, as stock's has none (a scoring loop keeping outputs keeps no pages)."""

    def hook(module, args, output):
        cache = runtime.release_uncached()
        if cache is None:
            return None
        if isinstance(output, tuple):  # return_dict=False
            return tuple(value for value in output if value is not cache)
        return type(output)(**{name: value for name, value in output.items() if value is not cache})

    return hook


def _warn_attentions_not_computed(runtime: _Runtime, decoder: nn.Module, kwargs: dict) -> None:
    """Once per model: ``output_attentions=True`` gets no attention weights from kernforge's kernels."""
    asked = kwargs.get("output_attentions", getattr(decoder.config, "output_attentions", False))
    if asked and "output_attentions" not in runtime.warned:
        runtime.warned.add("output_attentions")
        warnings.warn(
            "output_attentions=True: a kernforge-optimized model's attention kernels do not compute attention "
            "weights, so outputs.attentions is empty. For them, run the model before optimize() with "
            "attn_implementation='eager'",
            UserWarning,
            stacklevel=_caller_stacklevel(),
        )


def _caller_stacklevel() -> int:
    """For a warning raised inside a forward: the stacklevel of the first frame outside torch,
    transformers and kernforge, so that it names the caller's line (transformers' decorators make
    the depth vary between releases)."""
    import kernforge

    internal = tuple(os.path.dirname(str(module.__file__)) + os.sep for module in (torch, transformers, kernforge))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level
