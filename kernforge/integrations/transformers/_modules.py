"""The modules that replace a Llama-family (or sparse mixture-of-experts) decoder's stock ones, and
the attention and mask functions registered with transformers' ``AttentionInterface`` /
``AttentionMaskInterface``.

The decoder layers' own ``forward`` (residual adds included) and the model's loop stay
transformers' code: only their submodules change. The rotary embedding module runs once per
forward and hands every layer the same :class:`RopeInputs` (the cos/sin cache and the flat
positions) in place of ``(cos, sin)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kernforge.integrations.transformers import _kernels as kf
from kernforge.integrations.transformers._cache import PagedCache
from kernforge.model_spec import PACKED_LINEARS
from kernforge.nn import Linear, quantize_weight_fp8_block, quantize_weight_int8
from kernforge.nn.linear import FP8_BLOCK
from kernforge.ops.moe.experts import pack_experts, pack_experts_fp8, pack_experts_int8

ATTN_IMPLEMENTATION = "kernforge"


class RMSNorm(nn.Module):
    """RMSNorm on kernforge's ``rmsnorm`` (over the last dimension, any leading shape)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.detach().clone())
        self.eps = float(eps)

    @classmethod
    def from_module(cls, norm: nn.Module, dtype: torch.dtype) -> RMSNorm:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None or getattr(norm, "weight", None) is None:
            raise TypeError(f"{type(norm).__name__} is not an RMSNorm with a weight and an epsilon")
        return cls(norm.weight.to(dtype), eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() in (2, 3):
            return kf.rmsnorm(x, self.weight, self.eps)
        return kf.rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` as one packed gate+up linear, the gated kernel, and down."""

    def __init__(self, mlp: nn.Module, activation: str, dtype: torch.dtype, quant: str | None):
        super().__init__()
        self.gate_up_proj = Linear.from_linear(_packed(mlp, "gate_up_proj"), dtype=dtype, quant=quant)
        self.down_proj = Linear.from_linear(mlp.down_proj, dtype=dtype, quant=quant)
        self.act_and_mul = kf.GATED_ACTIVATIONS[activation]
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class SparseMoE(nn.Module):
    """A sparse mixture-of-experts block on kernforge: the router's logits through a kernforge
    Linear, softmax top-k routing (``topk_softmax``), and every token's experts in one
    ``fused_experts`` call on weights packed once here: bf16, or quantized as ``quant`` quantizes
    the linears (int8 w8a8 per channel, fp8 per 128 x 128 block), each expert apart. Qwen2-MoE's
    shared expert, a :class:`GatedMLP` scaled per token by the sigmoid of its own one-output gate,
    is added to the result."""

    def __init__(self, block: nn.Module, renormalize: bool, activation: str, dtype: torch.dtype, quant: str | None):
        super().__init__()
        router, experts = block.gate, block.experts
        self.top_k, self.renormalize, self.quant = int(router.top_k), bool(renormalize), quant
        # The router and the shared expert's gate stay unquantized (quantized MoE checkpoints keep
        # them so too): their outputs choose and weigh the experts, for a sliver of the weights.
        self.gate = Linear.from_linear(_linear(router.weight), dtype=dtype)
        # Packed weights (dataclasses of tensors, as fused_experts takes them), not parameters.
        self.w1 = _packed_experts(experts.gate_up_proj, quant, gated=True)
        self.w2 = _packed_experts(experts.down_proj, quant)
        shared = getattr(block, "shared_expert", None)
        self.shared_expert = None if shared is None else GatedMLP(shared, activation, dtype, quant)
        self.shared_expert_gate = None if shared is None else Linear.from_linear(block.shared_expert_gate, dtype=dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, ids = kf.topk_softmax(x, self.gate(x), self.top_k, self.renormalize)
        out = kf.fused_experts(
            x,
            self.w1,
            self.w2,
            weights,
            ids,
            use_int8_w8a8=self.quant == "int8",
            use_fp8_w8a16=self.quant == "fp8_block",
        )
        if self.shared_expert is not None:
            out.addcmul_(torch.sigmoid(self.shared_expert_gate(x)), self.shared_expert(x))
        return out.view(hidden_states.shape)

    def extra_repr(self) -> str:
        return (
            f"experts={self.w2.experts}, top_k={self.top_k}, hidden={self.w2.n}, intermediate={self.w2.k}, "
            f"renormalize={self.renormalize}, quant={self.quant}"
        )


def _packed_experts(w: torch.Tensor, quant: str | None, gated: bool = False):
    """Stacked expert weights ``[E, N, K]`` packed for fused_experts, quantized as kernforge.nn.Linear
    quantizes a weight (``quant``), one expert at a time (no fp32 copy of the whole stack)."""
    w = w.detach()
    if quant is None:
        return pack_experts(w.to(torch.bfloat16).contiguous(), gated=gated)
    quantize = quantize_weight_int8 if quant == "int8" else quantize_weight_fp8_block
    weights, scales = zip(*(quantize(expert) for expert in w))
    if quant == "int8":
        return pack_experts_int8(torch.stack(weights), torch.stack(scales), gated=gated)
    return pack_experts_fp8(torch.stack(weights), torch.stack(scales), FP8_BLOCK, gated=gated)


@dataclass(frozen=True)
class RopeInputs:
    """What :class:`RotaryEmbedding` gives the attention layers of one forward (instead of
    ``(cos, sin)``): the fp32 ``[rows, rotary_dim]`` cos|sin cache and each token's position,
    flattened over ``batch x q_len``."""

    cos_sin_cache: torch.Tensor
    positions: torch.Tensor


class RotaryEmbedding(nn.Module):
    """The model's rotary embedding as a cos/sin cache for kernforge's RoPE op.

    The frequencies are the stock module's (``inv_freq``, which every static RoPE type, scaled or
    not, precomputes) and the angles are formed as it forms them (``position * inv_freq`` in
    fp32); cos and sin stay fp32 instead of being rounded to the model's dtype. The cache covers
    ``positions`` rows from the start (the page pool's capacity: no sequence is longer), so a
    compiled forward never resizes it; eagerly it still grows, by doubling, past a larger position.
    """

    def __init__(self, rotary: nn.Module, positions: int = 4096):
        super().__init__()
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.cos_sin_cache = self._build(positions)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def _build(self, rows: int) -> torch.Tensor:
        angles = torch.arange(rows, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        return torch.cat([angles.cos(), angles.sin()], dim=1).mul_(self.attention_scaling).contiguous()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> RopeInputs:
        batch, q_len = x.shape[:2]
        positions = position_ids.expand(batch, q_len).reshape(-1)
        if positions.dtype != torch.int64:
            positions = positions.long()
        if not torch.compiler.is_compiling():  # a compiled forward relies on the pool-sized cache
            needed = int(positions.max()) + 1 if positions.numel() else 0
            if needed > self.cos_sin_cache.shape[0]:
                self.cos_sin_cache = self._build(1 << (needed - 1).bit_length())
        return RopeInputs(self.cos_sin_cache, positions)


class Attention(nn.Module):
    """A Llama-family attention block on kernforge: one packed q|k|v linear, the optional q/k
    RMSNorms (per head as Qwen3's, or over the whole projection as OLMoE's: each norm's width says
    which), OLMoE's optional clamp of q, k and v to ``[-clip_qkv, clip_qkv]`` after them, RoPE in
    place on the packed output, the paged cache's append, attention through the registered
    ``"kernforge"`` attention function, and the output linear."""

    def __init__(
        self,
        attn: nn.Module,
        dtype: torch.dtype,
        quant: str | None,
        num_qo_heads: int,
        num_kv_heads: int,
        clip_qkv: float | None = None,
    ):
        super().__init__()
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.qkv_proj = Linear.from_linear(_packed(attn, "qkv_proj"), dtype=dtype, quant=quant)
        self.o_proj = Linear.from_linear(attn.o_proj, dtype=dtype, quant=quant)
        has_qk_norm = getattr(attn, "q_norm", None) is not None
        self.q_norm = RMSNorm.from_module(attn.q_norm, dtype) if has_qk_norm else None
        self.k_norm = RMSNorm.from_module(attn.k_norm, dtype) if has_qk_norm else None
        self.clip_qkv = None if clip_qkv is None else float(clip_qkv)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: RopeInputs | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: PagedCache | None = None,
        past_key_values: PagedCache | None = None,
        **kwargs,
    ):
        if not isinstance(position_embeddings, RopeInputs):
            raise TypeError(
                "kernforge Attention needs the RopeInputs of kernforge's RotaryEmbedding as "
                f"position_embeddings, got {type(position_embeddings).__name__}: the model's rotary_emb "
                "was not replaced (use kernforge.integrations.transformers.optimize)"
            )
        cache = _checked_cache(cache if cache is not None else past_key_values)  # the name per release
        batch, q_len = hidden_states.shape[:2]
        tokens, heads, kv_heads, head_dim = batch * q_len, self.num_qo_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states).view(tokens, (heads + 2 * kv_heads) * head_dim)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
        if self.q_norm is not None:
            q, k = _normed(self.q_norm, q), _normed(self.k_norm, k)
        if self.clip_qkv is not None:
            for t in (q, k, v):
                t.clamp_(-self.clip_qkv, self.clip_qkv)
        kf.apply_rope_with_cos_sin_cache_inplace(
            position_embeddings.positions, q, k, head_dim, position_embeddings.cos_sin_cache, is_neox=True
        )
        if self.layer_idx == 0:
            cache.start_forward(batch, q_len, attention_mask)
        # transformers' shapes, [batch, heads, q_len, head_dim]: views of the token-major rows
        query, key, value = (t.view(batch, q_len, -1, head_dim).transpose(1, 2) for t in (q, k, v))
        key, value = cache.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]  # the registered function (users may override it)
        out, weights = attention(self, query, key, value, attention_mask, scaling=self.scaling, past_key_values=cache)
        return self.o_proj(out.reshape(batch, q_len, heads * head_dim)), weights


def kernforge_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    past_key_values: PagedCache | None = None,
    **kwargs,
):
    """transformers' attention-function contract on the paged cache: ``query [batch, heads, q_len,
    head_dim]`` (after RoPE) over everything layer ``module.layer_idx`` has in ``past_key_values``,
    whose ``update()`` already wrote this step's ``key``/``value``. Returns ``(out [batch, q_len,
    heads, head_dim], None)``; padding positions give zeros."""
    cache = _checked_cache(past_key_values)
    if dropout:
        raise NotImplementedError("kernforge attention is for inference: dropout must be 0")
    if scaling is not None and scaling != cache.spec.sm_scale:
        raise ValueError(f"scaling {scaling} differs from the planned sm_scale {cache.spec.sm_scale}")
    batch, heads, q_len, head_dim = query.shape
    rows = query.transpose(1, 2).reshape(batch * q_len, heads, head_dim)
    out = cache.attend(module.layer_idx, rows)
    return out.view(batch, q_len, heads, head_dim), None


def kernforge_mask(batch_size: int, *args, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask for kernforge attention: the 2-D padding mask (its last ``kv_length`` columns), or
    None. Causality and sliding windows are part of the plan, which reads the padding from it
    (no data-dependent test here: a compiled forward would break its graph on one)."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def register() -> None:
    """Register ``"kernforge"`` with transformers' attention and attention-mask interfaces. A mask
    function is needed too: without one, transformers hands a custom attention function
    ``attention_mask=None`` and padding would be ignored."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kernforge_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kernforge_mask)


def _checked_cache(cache) -> PagedCache:
    if not isinstance(cache, PagedCache):
        raise TypeError(
            f"kernforge attention keeps keys and values in kernforge's paged cache; got past_key_values="
            f"{type(cache).__name__}. Leave past_key_values None (a PagedCache is made per forward or "
            "generate call) or pass kernforge.integrations.transformers.new_cache(model)"
        )
    return cache


def _normed(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``x [tokens, width]`` through ``norm`` in groups of the norm's width: per head (Qwen3's q/k
    norms) or the whole row (OLMoE's)."""
    tokens, width = x.shape
    return norm(x.view(tokens, -1, norm.weight.numel())).view(tokens, width)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An ``nn.Linear`` over ``weight [out, in]`` and ``bias`` (no copies), for Linear.from_linear."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer


def _packed(module: nn.Module, name: str) -> nn.Linear:
    """``module``'s linears that the model spec packs as ``name`` (PACKED_LINEARS), as one."""
    return _concatenated(*(getattr(module, part) for part in PACKED_LINEARS[name]))


def _concatenated(*layers: nn.Linear) -> nn.Linear:
    """One ``nn.Linear`` whose output is the layers' outputs side by side."""
    weight = torch.cat([layer.weight.detach() for layer in layers], dim=0)
    bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
    return _linear(weight, bias)
