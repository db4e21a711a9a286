"""Hugging Face transformers on kernforge: ``optimize(model)`` makes a Llama-family causal LM
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) run its
decoder on kernforge's kernels, without forking transformers' model code::

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
  they would have made a ``DynamicCache``;
* RMSNorms: kernforge's ``rmsnorm`` (the decoder layers' residual adds are transformers');
* MLP: one packed gate|up linear, ``silu_and_mul`` (or the GELU gated kernel the config names)
  and the down linear;
* every ``nn.Linear``, ``lm_head`` included, becomes a :class:`kernforge.nn.Linear` (bf16 prepacked,
  or w8a8 with ``quant="int8"``; ``lm_head`` stays bf16 unless ``quant_lm_head=True``);
* sampling: :func:`generate`, a small loop over the same cache with transformers' arguments, samples
  with ``top_k_top_p_sampling_from_logits``. (``model.generate`` samples with torch.)

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

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from kernforge.integrations.transformers import _compat, _kernels, _modules
from kernforge.integrations.transformers._cache import AttentionSpec, KVCacheFullError, PagedCache, PagePool, new_cache
from kernforge.integrations.transformers._generate import generate
from kernforge.jit import KernelNotCachedError
from kernforge.nn import Linear
from kernforge.ops._common import MAX_HEAD_DIM

_compat.warn_if_untested(transformers.__version__)

__all__ = ["KVCacheFullError", "PagedCache", "UnsupportedModelError", "generate", "new_cache", "optimize"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE types whose frequencies are fixed at init (inv_freq), so one cos/sin cache serves every length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class UnsupportedModelError(NotImplementedError):
    """The model, or a part of its configuration, has no kernforge path."""


class _Runtime:
    """What an optimized model carries (as ``model._kernforge``): the attention spec and its page pool."""

    def __init__(self, spec: AttentionSpec, pool: PagePool, quant: str | None):
        self.spec, self.pool, self.quant = spec, pool, quant


def optimize(
    model: nn.Module,
    kv_cache_pages: int = 2048,
    quant: str | None = None,
    *,
    page_size: int = 16,
    quant_lm_head: bool = False,
) -> nn.Module:
    """Make ``model`` (a Llama-family ``*ForCausalLM``) run on kernforge, in place; returns it.

    ``kv_cache_pages`` pages of ``page_size`` tokens are the model's KV memory, shared by every
    live :class:`PagedCache` (each batch of a ``generate`` call holds its sequences' pages until
    it ends). ``quant="int8"`` makes the decoder's linears w8a8 (per-channel int8 weights,
    per-token int8 activations); ``lm_head`` follows only with ``quant_lm_head=True``.
    """
    if getattr(model, "_kernforge", None) is not None:
        raise ValueError("this model is already optimized by kernforge")
    config, decoder = _checked_model(model)
    dtype = model.dtype
    if dtype not in _MODEL_DTYPES:
        raise UnsupportedModelError(f"model dtype {dtype} is not supported; kernforge runs bf16, fp16 and fp32 models")
    spec = _attention_spec(config, decoder, dtype)
    _check_kernels(config, spec, quant)
    pool = PagePool(spec, kv_cache_pages, page_size)  # checks kv_cache_pages and page_size before any change
    _modules.register()
    model.eval()
    stock = []
    with torch.no_grad():
        # RoPE for every position the pool can hold (capped by the model's context length)
        positions = min(pool.num_pages * pool.page_size, getattr(config, "max_position_embeddings", None) or 1 << 30)
        decoder.rotary_emb = _modules.RotaryEmbedding(decoder.rotary_emb, positions)
        for layer in decoder.layers:
            _replace_layer(layer, config, spec, dtype, quant, stock)
        decoder.norm = _modules.RMSNorm.from_module(decoder.norm, dtype)
        if type(model.lm_head) is nn.Linear:
            model.lm_head = Linear.from_linear(model.lm_head, dtype=dtype, quant=quant if quant_lm_head else None)
    runtime = model._kernforge = _Runtime(spec, pool, quant)
    _own_config(model)._attn_implementation = _modules.ATTN_IMPLEMENTATION
    decoder.register_forward_pre_hook(
        _paged_cache_hook(runtime, _compat.cache_argument(decoder.forward)), with_kwargs=True
    )
    _warn_stock_modules(model, stock)
    return model


# --------------------------------------------------------------------------- checks


def _checked_model(model):
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not hasattr(model, "lm_head") or not hasattr(model, "model"):
        raise UnsupportedModelError(
            f"kernforge.integrations.transformers.optimize supports Llama-family causal LMs (model_type "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
            f"Qwen3ForCausalLM); got {type(model).__name__} (model_type {model_type!r})"
        )
    decoder = model.model
    for name in ("layers", "rotary_emb", "norm", "embed_tokens"):
        if not hasattr(decoder, name):
            raise UnsupportedModelError(f"{type(model).__name__}.model has no {name}: not a Llama-family decoder")
    for parameter in model.parameters():
        if parameter.device.type != "cpu":
            raise UnsupportedModelError(f"the model is on {parameter.device}; kernforge runs on the CPU")
        break
    return config, decoder


def _attention_spec(config, decoder, dtype) -> AttentionSpec:
    rotary = decoder.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} recomputes its frequencies with the sequence length; "
            f"kernforge's cos/sin cache supports {', '.join(STATIC_ROPE_TYPES)}"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    first = decoder.layers[0].self_attn
    head_dim = first.head_dim
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise UnsupportedModelError(
            f"head_dim {head_dim} has no kernforge attention kernel: decode and prefill take "
            f"head dims from 1 to {MAX_HEAD_DIM}"
        )
    if 2 * rotary.inv_freq.numel() != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embedding (rotary dim {2 * rotary.inv_freq.numel()} of head_dim "
            f"{head_dim}) is not supported"
        )
    windows = tuple(_window_left(layer.self_attn, config) for layer in decoder.layers)
    return AttentionSpec(len(decoder.layers), heads, kv_heads, head_dim, dtype, float(first.scaling), windows)


def _window_left(attn, config) -> int:
    """FlashInfer's window_left (keys kept besides the query's own) of a layer; -1: none."""
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    return window - 1 if window else -1


def _check_kernels(config, spec: AttentionSpec, quant: str | None) -> None:
    """With KERNFORGE_JIT=0, every kernel the model's manifest lists must be cached already."""
    from kernforge.jit import core
    from kernforge.prewarm import manifest_from_model_config, specs_from_manifest

    if core.jit_enabled():
        return
    manifest = manifest_from_model_config(
        {**config.to_dict(), "dtype": str(spec.dtype).removeprefix("torch."), "head_dim": spec.head_dim}, quant=quant
    )
    missing = []
    for kernel in specs_from_manifest(manifest):
        try:
            core.build(kernel, load=False, allow_compile=False)
        except KernelNotCachedError:
            missing.append(f"{kernel.module.name}({', '.join(f'{k}={v}' for k, v in kernel.params)})")
    if missing:
        raise KernelNotCachedError(
            f"KERNFORGE_JIT=0 and {len(missing)} kernels this model needs are not cached: {'; '.join(missing)}. "
            "Build them first with: python -m kernforge prewarm --model-config <the model's config.json>"
            + (" --quant int8" if quant else "")
        )


# --------------------------------------------------------------------------- replacement


def _replace_layer(layer, config, spec: AttentionSpec, dtype, quant, stock: list) -> None:
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if type(getattr(attn, name, None)) is not nn.Linear:
            raise UnsupportedModelError(f"{type(attn).__name__} has no nn.Linear {name}: not a Llama-family attention")
    layer.self_attn = _modules.Attention(attn, dtype, quant, spec.num_qo_heads, spec.num_kv_heads)
    activation = getattr(config, "hidden_act", "silu")
    mlp = layer.mlp
    if activation in _kernels.GATED_ACTIVATIONS and all(
        type(getattr(mlp, n, None)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj")
    ):
        layer.mlp = _modules.GatedMLP(mlp, activation, dtype, quant)
    else:
        stock.append(
            f"mlp ({type(mlp).__name__}, hidden_act {activation!r}: no kernforge gated kernel; its linears "
            "run on kernforge.nn.Linear)"
        )
        for name, child in mlp.named_children():
            if type(child) is nn.Linear:
                setattr(mlp, name, Linear.from_linear(child, dtype=dtype, quant=quant))
    for name in ("input_layernorm", "post_attention_layernorm"):
        setattr(layer, name, _modules.RMSNorm.from_module(getattr(layer, name), dtype))


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
    (or has just made, in ``generate``) an empty DynamicCache. The cache comes under either of
    transformers' names for it and goes on under ``argument``, the one the decoder takes."""

    def hook(module, args, kwargs):
        cache = _compat.take_cache(kwargs)
        if cache is None or (isinstance(cache, DynamicCache) and cache.get_seq_length() == 0):
            cache = PagedCache(runtime.spec, runtime.pool)
        elif not isinstance(cache, PagedCache):
            raise TypeError(
                f"a kernforge-optimized model keeps its KV cache in a PagedCache; got {argument}="
                f"{type(cache).__name__} holding {cache.get_seq_length()} tokens. Continue with the "
                f"PagedCache the previous call returned, or start from {argument}=None"
            )
        kwargs[argument] = cache
        return args, kwargs

    return hook
