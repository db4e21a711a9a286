"""The modules that replace a Llama-family decoder's stock ones, and the attention and mask
functions registered with transformers' ``AttentionInterface`` / ``AttentionMaskInterface``.

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
from kernforge.nn import Linear

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
    """A Llama-family attention block on kernforge: one packed q|k|v linear, the optional per-head
    q/k RMSNorm (Qwen3), RoPE in place on the packed output, the paged cache's append, attention
    through the registered ``"kernforge"`` attention function, and the output linear."""

    def __init__(self, attn: nn.Module, dtype: torch.dtype, quant: str | None, num_qo_heads: int, num_kv_heads: int):
        super().__init__()
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.qkv_proj = Linear.from_linear(_packed(attn, "qkv_proj"), dtype=dtype, quant=quant)
        self.o_proj = Linear.from_linear(attn.o_proj, dtype=dtype, quant=quant)
        has_qk_norm = getattr(attn, "q_norm", None) is not None
        self.q_norm = RMSNorm.from_module(attn.q_norm, dtype) if has_qk_norm else None
        self.k_norm = RMSNorm.from_module(attn.k_norm, dtype) if has_qk_norm else None

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
            q = self.q_norm(q.view(tokens, heads, head_dim)).view(tokens, heads * head_dim)
            k = self.k_norm(k.view(tokens, kv_heads, head_dim)).view(tokens, kv_heads * head_dim)
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


def _packed(module: nn.Module, name: str) -> nn.Linear:
    """``module``'s linears that the model spec packs as ``name`` (PACKED_LINEARS), as one."""
    return _concatenated(*(getattr(module, part) for part in PACKED_LINEARS[name]))


def _concatenated(*layers: nn.Linear) -> nn.Linear:
    """One ``nn.Linear`` whose output is the layers' outputs side by side."""
    weight = torch.cat([layer.weight.detach() for layer in layers], dim=0)
    biases = [layer.bias for layer in layers]
    merged = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if biases[0] is not None:
        merged.bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
    return merged
