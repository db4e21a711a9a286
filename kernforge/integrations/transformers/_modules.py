"""The modules that replace a Llama-family (or sparse mixture-of-experts) decoder's stock ones, and
the attention and mask functions registered with transformers' ``AttentionInterface`` /
``AttentionMaskInterface``.

The decoder layers' own ``forward`` (residual adds included) and the model's loop stay
transformers' code: only their submodules change. The rotary embedding module runs once per
forward (Gemma 3's once per attention layer type) and hands every layer the same :class:`RopeInputs`
(the cos/sin cache and the flat positions; its layer type's) in place of ``(cos, sin)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kernforge.integrations.transformers import _kernels as kf
from kernforge.integrations.transformers._cache import AttentionSpec, MLAPagedCache, MLASpec, PagedCache
from kernforge.model_spec import PACKED_LINEARS, ModelSpec
from kernforge.nn import Linear, quantize_weight_fp8_block, quantize_weight_int8
from kernforge.nn.gguf import GGUFExperts, GGUFLinear
from kernforge.nn.linear import FP8_BLOCK, Int4LinearWeights
from kernforge.ops.moe.experts import (
    CPUQuantMethod,
    pack_experts,
    pack_experts_fp8,
    pack_experts_int8,
    quantize_experts_int4,
)

ATTN_IMPLEMENTATION = "kernforge"


class RMSNorm(nn.Module):
    """RMSNorm on kernforge's ``rmsnorm`` (over the last dimension, any leading shape)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.detach().clone())
        self.eps = float(eps)

    @classmethod
    def from_module(cls, norm: nn.Module, dtype: torch.dtype, eps: float | None = None) -> RMSNorm:
        """``norm``'s weight, and ``eps`` (None: the module's own epsilon)."""
        if eps is None:
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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm on kernforge's ``gemma_rmsnorm``: scales by ``1 + weight`` (formed in fp32, as
    transformers' Gemma norms form it); the weight is the stock module's, not ``1 + weight``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() in (2, 3):
            return kf.gemma_rmsnorm(x, self.weight, self.eps)
        return kf.gemma_rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


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
    is added to the result. A GGUF file's experts (``from_gguf``: a :class:`GGUFExperts`, packed at
    the file's types) are routed the same way and run per expert on the GGUF GEMM, not fused."""

    def __init__(self, block: nn.Module, spec: ModelSpec, dtype: torch.dtype, quant: str | None):
        super().__init__()
        router, experts, activation = block.gate, block.experts, spec.activation
        self.top_k, self.renormalize, self.quant = spec.num_experts_per_tok, spec.renormalize, quant
        # The router and the shared expert's gate stay unquantized (quantized MoE checkpoints keep
        # them so too): their outputs choose and weigh the experts, for a sliver of the weights.
        self.gate = Linear.from_linear(_linear(router.weight), dtype=dtype)
        self.gguf_experts = experts if isinstance(experts, GGUFExperts) else None
        if self.gguf_experts is None:
            # Packed weights (dataclasses of tensors, as fused_experts takes them), not parameters.
            self.w1 = _packed_experts(experts.gate_up_proj, quant, gated=True)
            self.w2 = _packed_experts(experts.down_proj, quant)
        shared = getattr(block, "shared_expert", None)
        self.shared_expert = None if shared is None else GatedMLP(shared, activation, dtype, quant)
        self.shared_expert_gate = None if shared is None else Linear.from_linear(block.shared_expert_gate, dtype=dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.gguf_experts is not None:
            weights, ids = self.route(x)
            out = self.gguf_experts(x, ids, weights)
        else:
            out = kf.fused_experts(x, self.w1, self.w2, *self.route(x), **self._quant_flags())
        if self.shared_expert is not None:
            out.addcmul_(torch.sigmoid(self.shared_expert_gate(x)), self.shared_expert(x))
        return out.view(hidden_states.shape)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights: ``(weights fp32 [T, k], ids int32 [T, k])``."""
        return kf.topk_softmax(x, self.gate(x), self.top_k, self.renormalize)

    def _quant_flags(self) -> dict:
        if self.quant in _INT4_METHODS:  # four-bit experts: W4A8 or W4A16, as the linears
            return {"moe_comp_method": _INT4_METHODS[self.quant]}
        return {"use_int8_w8a8": self.quant == "int8", "use_fp8_w8a16": self.quant == "fp8_block"}

    def extra_repr(self) -> str:
        if self.gguf_experts is not None:  # its own repr says the sizes and types
            return f"top_k={self.top_k}, renormalize={self.renormalize}"
        return (
            f"experts={self.w2.experts}, top_k={self.top_k}, hidden={self.w2.n}, intermediate={self.w2.k}, "
            f"renormalize={self.renormalize}, quant={self.quant}"
        )


class DeepseekMoE(SparseMoE):
    """DeepSeek-V2/V3's MoE block on kernforge: the router's logits in fp32 (as stock computes them,
    on the weight rounded to the model's dtype), the model's routing rule (``rule``): V2's softmax
    top-k (``"greedy"``, ``topk_softmax``) or its group-limited top-k (``"group_limited_greedy"``,
    ``grouped_topk``), V3's sigmoid scores chosen with ``e_score_correction_bias`` in groups
    (``"noaux_tc"``, ``biased_grouped_topk``), renormalized where the config's ``norm_topk_prob``
    says (V2's stock router never renormalizes: :attr:`ModelSpec.renormalize`); the routed experts in
    one ``fused_experts`` call, and the always-on shared experts (``n_shared_experts`` of them, one
    MLP) in one ``shared_expert`` call that adds ``routed_scaling_factor`` times the routed output,
    rounded once."""

    RULES = ("greedy", "group_limited_greedy", "noaux_tc")

    def __init__(self, block: nn.Module, spec: ModelSpec, dtype: torch.dtype, quant: str | None):
        nn.Module.__init__(self)
        router, experts, shared = block.gate, block.experts, block.shared_experts
        self.top_k, self.quant, self.rule = spec.num_experts_per_tok, quant, str(spec.topk_method)
        self.renormalize = spec.renormalize
        self.num_groups, self.topk_group = spec.n_group, spec.topk_group
        self.routed_scaling_factor = spec.routed_scaling_factor
        self.gate = Linear.from_linear(_linear(router.weight.to(dtype)), dtype=torch.float32)
        bias = getattr(router, "e_score_correction_bias", None) if self.rule == "noaux_tc" else None
        self.register_buffer("correction_bias", None if bias is None else bias.detach().float().clone())
        self.w1 = _packed_experts(experts.gate_up_proj, quant, gated=True)
        self.w2 = _packed_experts(experts.down_proj, quant)
        self.shared_expert = None  # SparseMoE's (Qwen2-MoE's) gated shared expert: none here
        self.shared_w1 = _packed_experts(_packed(shared, "gate_up_proj").weight[None], quant, gated=True)
        self.shared_w2 = _packed_experts(shared.down_proj.weight[None], quant)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        flags = self._quant_flags()
        routed = kf.fused_experts(x, self.w1, self.w2, *self.route(x), **flags)
        out = kf.shared_expert(
            x, self.shared_w1, self.shared_w2, routed, routed_scaling_factor=self.routed_scaling_factor, **flags
        )
        return out.view(hidden_states.shape)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # No routed_scaling_factor here: shared_expert scales the routed output by it (once).
        logits = self.gate(x.float())
        if self.rule == "greedy":
            return kf.topk_softmax(x, logits, self.top_k, self.renormalize)
        if self.rule == "group_limited_greedy":
            return kf.grouped_topk(x, logits, self.top_k, self.renormalize, self.num_groups, self.topk_group)
        return kf.biased_grouped_topk(
            x, logits, self.correction_bias, self.top_k, self.renormalize, self.num_groups, self.topk_group
        )

    def extra_repr(self) -> str:
        return (
            f"experts={self.w2.experts}, top_k={self.top_k}, rule={self.rule}, groups={self.num_groups}, "
            f"topk_group={self.topk_group}, renormalize={self.renormalize}, "
            f"routed_scaling_factor={self.routed_scaling_factor}, hidden={self.w2.n}, intermediate={self.w2.k}, "
            f"shared_intermediate={self.shared_w2.k}, quant={self.quant}"
        )


# quant -> fused_experts' moe_comp_method for four-bit experts
_INT4_METHODS = {"int4": CPUQuantMethod.INT4_W4A8, "int4_w4a16": CPUQuantMethod.INT4_W4A16}


def _packed_experts(w: torch.Tensor, quant: str | None, gated: bool = False):
    """Stacked expert weights ``[E, N, K]`` packed for fused_experts, quantized as kernforge.nn.Linear
    quantizes a weight (``quant``), one expert at a time (no fp32 copy of the whole stack)."""
    w = w.detach()
    if quant is None:
        return pack_experts(w.to(torch.bfloat16).contiguous(), gated=gated)
    if quant in _INT4_METHODS:  # four-bit experts, grouped as kernforge.nn.Linear groups quant="int4"
        return quantize_experts_int4(w, gated=gated)
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

    def __init__(self, rotary: nn.Module, positions: int = 4096, layer_type: str | None = None):
        super().__init__()
        inv_freq = rope_frequencies(rotary)[layer_type]  # a layer type's: Gemma 3's ``{layer_type}_inv_freq``
        self.register_buffer("inv_freq", inv_freq.detach().float().clone(), persistent=False)
        scaling = "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling"
        self.attention_scaling = float(getattr(rotary, scaling, 1.0))
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


class LayerTypeRotaryEmbedding(nn.Module):
    """A :class:`RotaryEmbedding` per attention layer type, for a model whose rotary module takes the
    layer type (Gemma 3: RoPE parameters per type, the global layers' at ``rope_theta`` and maybe
    linearly scaled, the sliding layers' at the local base frequency). Called as the stock module is,
    ``(x, position_ids, layer_type)``, once per type and forward: that type's :class:`RopeInputs`."""

    def __init__(self, rotary: nn.Module, positions: int = 4096):
        super().__init__()
        kinds = rope_frequencies(rotary)
        self.by_type = nn.ModuleDict({kind: RotaryEmbedding(rotary, positions, kind) for kind in kinds})

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str) -> RopeInputs:
        return self.by_type[layer_type](x, position_ids)


def rope_frequencies(rotary: nn.Module) -> dict:
    """The stock rotary module's ``inv_freq``: ``{None: inv_freq}``, or one per attention layer type
    (``{layer_type: inv_freq}``) for a module that keeps them so (Gemma 3's ``{layer_type}_inv_freq``;
    a type without RoPE parameters has none)."""
    if isinstance(getattr(rotary, "inv_freq", None), torch.Tensor) or not hasattr(rotary, "layer_types"):
        return {None: rotary.get_buffer("inv_freq")}
    kinds = [kind for kind in rotary.layer_types if isinstance(getattr(rotary, f"{kind}_inv_freq", None), torch.Tensor)]
    return {kind: rotary.get_buffer(f"{kind}_inv_freq") for kind in kinds}


def rotary_embedding(rotary: nn.Module, positions: int) -> RotaryEmbedding | LayerTypeRotaryEmbedding:
    """What replaces the stock rotary module: one cos/sin cache, or one per layer type."""
    if None in rope_frequencies(rotary):
        return RotaryEmbedding(rotary, positions)
    return LayerTypeRotaryEmbedding(rotary, positions)


class Attention(nn.Module):
    """A Llama-family attention block on kernforge: one packed q|k|v linear, the optional q/k
    RMSNorms (per head as Qwen3's and Gemma 3's, or over the whole projection as OLMoE's: each norm's
    width says which; ``norm`` their kind), OLMoE's optional clamp of q, k and v to
    ``[-clip_qkv, clip_qkv]`` after them, RoPE in place on the packed output, the paged cache's
    append, attention through the registered ``"kernforge"`` attention function, and the output
    linear."""

    def __init__(
        self,
        attn: nn.Module,
        dtype: torch.dtype,
        quant: str | None,
        spec: AttentionSpec,
        clip_qkv: float | None = None,
        norm: type[RMSNorm] = RMSNorm,
    ):
        super().__init__()
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, spec.head_dim, spec.sm_scale
        self.num_qo_heads, self.num_kv_heads = spec.num_qo_heads, spec.num_kv_heads
        self.qkv_proj = Linear.from_linear(_packed(attn, "qkv_proj"), dtype=dtype, quant=quant)
        self.o_proj = Linear.from_linear(attn.o_proj, dtype=dtype, quant=quant)
        has_qk_norm = getattr(attn, "q_norm", None) is not None  # norm: the model's kind (GemmaRMSNorm for Gemma 3)
        self.q_norm = norm.from_module(attn.q_norm, dtype) if has_qk_norm else None
        self.k_norm = norm.from_module(attn.k_norm, dtype) if has_qk_norm else None
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
        position_embeddings = _checked_rope(position_embeddings)
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


class MLAttention(nn.Module):
    """DeepSeek-V2/V3's multi-head latent attention on kernforge.

    One GEMM projects ``x`` to ``[q_a | c | k_pe]`` (``q_a_proj`` and ``kv_a_proj_with_mqa`` packed;
    ``[q | c | k_pe]`` with ``q_proj`` when ``q_lora_rank`` is None, as DeepSeek-V2-Lite); ``q =
    q_b_proj(rmsnorm(q_a))``; the latent ``c`` is RMSNorm'd; RoPE runs in place on ``q_pe`` and on
    the one ``k_pe`` all heads share, interleaved (DeepSeek's pairs ``(x0, x1), (x2, x3), ...``;
    V3's ``rope_interleave``) or half-rotated, with the model's own (YaRN-scaled) frequencies. The
    latents ``[c | k_pe]`` go to the paged latent cache (:class:`MLAPagedCache`), then the step's
    path: absorbed, ``q_nope`` through ``W_UK`` per head (``kernforge.bmm`` on prepacked weights) to
    ``[T, H, kv_lora_rank]``, the MLA kernel over the latent pages, and the latent output through
    ``W_UV`` per head; or, for a fresh prompt, unabsorbed: ``k_nope``/``v`` from ``kv_b_proj(c)``,
    ``k = [k_nope | k_pe]`` and the ragged prefill kernel (head dims 192 / 128 for the real models).
    ``W_UK``/``W_UV`` are ``kv_b_proj.weight`` ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``
    split per head. Then ``o_proj``. The shapes are ``spec``'s (the model spec's, and its
    ``q_lora_rank``); ``sm_scale`` the model's (YaRN's mscale included)."""

    def __init__(
        self,
        attn: nn.Module,
        spec: MLASpec,
        q_lora_rank: int | None,
        dtype: torch.dtype,
        quant: str | None,
        interleaved: bool,
    ):
        super().__init__()
        self.layer_idx = attn.layer_idx
        self.num_heads = spec.num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, spec.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.v_head_dim, self.scaling, self.is_neox = spec.v_head_dim, spec.sm_scale, not interleaved
        first = attn.q_proj if self.q_lora_rank is None else attn.q_a_proj
        self.qkv_a_proj = Linear.from_linear(_concatenated(first, attn.kv_a_proj_with_mqa), dtype=dtype, quant=quant)
        if self.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm.from_module(attn.q_a_layernorm, dtype)
            self.q_b_proj = Linear.from_linear(attn.q_b_proj, dtype=dtype, quant=quant)
        self.kv_a_layernorm = RMSNorm.from_module(attn.kv_a_layernorm, dtype)
        self.kv_b_proj = Linear.from_linear(attn.kv_b_proj, dtype=dtype, quant=quant)  # the unabsorbed path
        # W_UK / W_UV per head, packed for bmm (bf16 whatever quant says, as SGLang keeps them)
        self.absorbed = kf.absorb_kv_b_proj(
            attn.kv_b_proj.weight.detach().to(dtype), self.qk_nope_head_dim, self.v_head_dim
        )
        self.o_proj = Linear.from_linear(attn.o_proj, dtype=dtype, quant=quant)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: RopeInputs | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: MLAPagedCache | None = None,
        past_key_values: MLAPagedCache | None = None,
        **kwargs,
    ):
        rope = _checked_rope(position_embeddings)
        cache = _checked_cache(cache if cache is not None else past_key_values)
        if not isinstance(cache, MLAPagedCache):
            raise TypeError(f"kernforge MLAttention keeps its latents in an MLAPagedCache, got {type(cache).__name__}")
        batch, q_len = hidden_states.shape[:2]
        tokens, heads, nope, rank = batch * q_len, self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        qk_dim, rope_dim = nope + self.qk_rope_head_dim, self.qk_rope_head_dim
        projected = self.qkv_a_proj(hidden_states).view(tokens, -1)
        q, latent = projected.split([projected.shape[1] - rank - rope_dim, rank + rope_dim], dim=1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(tokens, heads, qk_dim)
        ckv, k_pe = self.kv_a_layernorm(latent[:, :rank]), latent[:, rank:]
        q_pe = q[..., nope:]
        kf.apply_rope_with_cos_sin_cache_inplace(
            rope.positions, q_pe, k_pe, rope_dim, rope.cos_sin_cache, is_neox=self.is_neox
        )
        if self.layer_idx == 0:
            cache.start_forward(batch, q_len, attention_mask)
        cache.append_latents(self.layer_idx, ckv, k_pe)
        if cache.ragged:
            kv = self.kv_b_proj(ckv).view(tokens, heads, nope + self.v_head_dim)
            k = q.new_empty(tokens, heads, qk_dim)
            k[..., :nope] = kv[..., :nope]
            k[..., nope:] = k_pe[:, None]
            out = cache.attend_ragged(self.layer_idx, q, k, kv[..., nope:])
        else:  # absorbed: [q_nope W_UK | q_pe] as one row per head, the MLA kernel's query over [c | k_pe]
            q_input = q.new_empty(tokens, heads, rank + rope_dim)
            kf.bmm(q_input[..., :rank].transpose(0, 1), q[..., :nope].transpose(0, 1), self.absorbed.w_kc)
            q_input[..., rank:] = q_pe
            out = kf.mla_output_proj(cache.attend_latent(self.layer_idx, q_input), self.absorbed.w_vc)
        return self.o_proj(out.view(batch, q_len, heads * self.v_head_dim)), None

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"v_head_dim={self.v_head_dim}, interleaved_rope={not self.is_neox}"
        )


def _checked_rope(position_embeddings) -> RopeInputs:
    if not isinstance(position_embeddings, RopeInputs):
        raise TypeError(
            "kernforge attention needs the RopeInputs of kernforge's RotaryEmbedding as "
            f"position_embeddings, got {type(position_embeddings).__name__}: the model's rotary_emb "
            "was not replaced (use kernforge.integrations.transformers.optimize)"
        )
    return position_embeddings


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
    """One ``nn.Linear`` whose output is the layers' outputs side by side (four-bit weights that are
    so already, a checkpoint's, as one ``Int4LinearWeights``; a GGUF file's as one ``GGUFLinear``)."""
    if any(isinstance(layer, Int4LinearWeights) for layer in layers):
        return Int4LinearWeights.concatenated(layers)
    if any(isinstance(layer, GGUFLinear) for layer in layers):
        return GGUFLinear.concatenated(layers)
    weight = torch.cat([layer.weight.detach() for layer in layers], dim=0)
    bias = None
    if any(layer.bias is not None for layer in layers):  # zeros for a layer without one
        bias = torch.cat([_bias_of(layer) for layer in layers])
    return _linear(weight, bias)


def _bias_of(layer: nn.Linear) -> torch.Tensor:
    return layer.weight.new_zeros(layer.weight.shape[0]) if layer.bias is None else layer.bias.detach()
