"""What kernforge knows about a model, read once from its Hugging Face config: the attention shape,
the activation's gated op, and the linear layers as kernforge packs them. Pre-warm
(``prewarm --model-config``) derives the kernels to build from it, and the transformers integration
reads one per ``optimize()`` call and packs and runs every family's modules by it (heads, head_dim,
windows, which layers have experts, the routing; by transformers' own rules where a module's
attributes could say otherwise), so the two cannot disagree. MoE models add their experts' fields,
DeepSeek-V2/V3 their multi-head latent attention's (``kv_lora_rank`` ...) and routing's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Hugging Face ``hidden_act`` -> kernforge's gated op computing ``act(gate) * up``.
GATED_OP_BY_ACTIVATION = {
    "silu": "silu_and_mul",
    "swish": "silu_and_mul",
    "gelu": "gelu_and_mul",
    "gelu_pytorch_tanh": "gelu_tanh_and_mul",
    "gelu_new": "gelu_tanh_and_mul",
    "gelu_fast": "gelu_tanh_and_mul",
    "gelu_tanh": "gelu_tanh_and_mul",
}
# A decoder layer's linears that kernforge packs into one GEMM (their outputs side by side, in order).
PACKED_LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only LM as kernforge runs it."""

    model_type: str | None
    dtype: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    activation: str
    vocab_size: int | None = None
    # Mixture of experts (0: a dense model): routed experts, each token's k of them, an expert's
    # intermediate size, and the always-on shared expert's (Qwen2-MoE; 0: none).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # DeepSeek's always-on shared experts (run as one MLP of n_shared_experts * moe_intermediate_size),
    # its leading dense layers, and its routing rule: topk_method "greedy" (softmax top-k),
    # "group_limited_greedy" (softmax, the best topk_group of n_group groups) or "noaux_tc" (V3's
    # sigmoid scores with a correction bias, in groups); scoring_func the scores it chooses by.
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    topk_method: str | None = None
    scoring_func: str | None = None
    n_group: int = 0
    topk_group: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0: none): the latent KV's rank, the
    # query's LoRA rank (None: one q_proj, as DeepSeek-V2-Lite), and the per-head q/k dims without and
    # with RoPE, and v's.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # What the transformers integration runs by besides the shapes, read as transformers reads them:
    # the decoder layers, each layer's sliding window (None: full attention), the RoPE type, OLMoE's
    # q/k/v clamp, the decoder norms' epsilon, the router's renormalization of its top-k weights and
    # DeepSeek's scaling of the routed experts.
    num_hidden_layers: int = 0
    sliding_windows: tuple[int | None, ...] = ()
    rope_type: str = "default"
    clip_qkv: float | None = None
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = True  # DeepSeek-V3's RoPE on interleaved pairs (V2's always is)
    # The Qwen MoEs' dense layers: those listed, and those off the every-``decoder_sparse_step``th.
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    # Gemma 3's softmax scale is query_pre_attn_scalar**-0.5 (None: head_dim's, as the Llamas')
    query_pre_attn_scalar: float | None = None

    @classmethod
    def from_config(cls, config: dict | str | Path, any_activation: bool = False) -> ModelSpec:
        """From a ``config.json`` (path or dict; a multimodal config's ``text_config`` is read too).
        Raises ValueError naming the field that is missing or wrong (an activation without a gated
        op too, unless ``any_activation``: the integration runs such an MLP on transformers' path)."""
        if not isinstance(config, dict):
            config = json.loads(Path(config).read_text())
        config = {**config.get("text_config", {}), **config}
        sizes = {name: _positive_int(config, name) for name in ("hidden_size", "intermediate_size")}
        heads = _positive_int(config, "num_attention_heads")
        mla = _mla_fields(config)
        # MLA: every query head attends to the one latent (its config's num_key_value_heads says nothing)
        kv_heads = 1 if mla else config.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or heads % kv_heads:
            raise ValueError(f"config.json num_key_value_heads {kv_heads!r} must divide num_attention_heads {heads}")
        head_dim = config.get("head_dim")
        if head_dim is None:  # absent: the split of hidden_size; a given one is checked as it is (0 too)
            head_dim = sizes["hidden_size"] // heads
        activation = config.get("hidden_act") or config.get("hidden_activation") or "silu"
        if not any_activation:
            _gated_op(activation)
        vocab = config.get("vocab_size")
        experts = _moe_fields(config, sizes["intermediate_size"])
        if mla:
            head_dim = mla["qk_rope_head_dim"]  # transformers' DeepSeek configs say so (no attention runs on it)
        return cls(
            config.get("model_type"),
            str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            sizes["hidden_size"],
            sizes["intermediate_size"],
            heads,
            kv_heads,
            head_dim,
            activation,
            vocab if isinstance(vocab, int) and vocab > 0 else None,
            **experts,
            **mla,
            **_runtime_fields(config),
        )

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): a latent cache, no per-head K/V."""
        return self.kv_lora_rank > 0

    @property
    def router_dtype(self) -> str:
        """The dtype the router's GEMM and the routing kernel run in: DeepSeek's routers compute
        their logits in fp32 (the integration's DeepseekMoE), the others in the model's dtype."""
        return "float32" if self.is_mla and self.num_experts else self.dtype

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some layer runs a dense MLP (intermediate_size): every layer of a dense model,
        DeepSeek's first_k_dense_replace layers, the Qwen MoEs' mlp_only_layers and those off their
        decoder_sparse_step (without num_hidden_layers: whether any of those is set)."""
        if not self.num_experts:
            return True
        if not self.num_hidden_layers:
            return self.first_k_dense_replace > 0 or bool(self.mlp_only_layers) or self.decoder_sparse_step > 1
        return not all(self.is_sparse_layer(index) for index in range(self.num_hidden_layers))

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` runs the experts, by transformers' rule for the family."""
        if not self.num_experts:
            return False
        if self.topk_method is not None:  # DeepSeek
            return index >= self.first_k_dense_replace
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    @property
    def gated_op(self) -> str:
        """The MLP's gated kernel (ValueError for an activation without one)."""
        return _gated_op(self.activation)

    @property
    def runs_gated_mlp(self) -> bool:
        """Whether some layer runs the gated kernel: a dense MLP, or Qwen2-MoE's shared expert (an
        MoE's experts and DeepSeek's shared experts gate inside fused_experts / shared_expert)."""
        return self.has_dense_mlp or self.shared_expert_intermediate_size > 0

    @property
    def renormalize(self) -> bool:
        """Whether the router renormalizes its top-k weights: always for Mixtral, never for
        DeepSeek-V2 (its router has no such step), else as ``norm_topk_prob`` says."""
        return self.model_type == "mixtral" or (self.model_type != "deepseek_v2" and self.norm_topk_prob)

    @property
    def sm_scale(self) -> float:
        """The attention's softmax scale, as transformers' Llama-family attentions set it (Gemma 3's
        ``query_pre_attn_scalar**-0.5``; an MLA model's also has YaRN's mscale: the integration reads
        that one from the module)."""
        return float((self.query_pre_attn_scalar or self.head_dim) ** -0.5)

    def window_left(self, layer: int) -> int:
        """FlashInfer's window_left (keys kept besides the query's own) of ``layer``; -1: none."""
        window = self.sliding_windows[layer] if layer < len(self.sliding_windows) else None
        return window - 1 if window else -1

    @property
    def gemma_norms(self) -> bool:
        """Gemma's RMSNorm scales by ``1 + weight``."""
        return "gemma" in str(self.model_type or "").lower()

    def linear_shapes(self) -> dict[str, list[int]]:
        """[N, K] (``nn.Linear.weight``'s shape) of a decoder layer's linears as kernforge packs them
        (``PACKED_LINEARS``; the dense MLP's where some layer has one), and lm_head's when the
        vocabulary is known. The router runs in :attr:`router_dtype`, the others in the model's dtype."""
        if self.is_mla:
            return self._mla_linear_shapes()
        q_width = self.num_attention_heads * self.head_dim
        kv_width = self.num_key_value_heads * self.head_dim
        widths = {
            "q_proj": q_width,
            "k_proj": kv_width,
            "v_proj": kv_width,
            "gate_proj": self.intermediate_size,
            "up_proj": self.intermediate_size,
        }
        shapes = {
            packed: [sum(widths[part] for part in parts), self.hidden_size] for packed, parts in PACKED_LINEARS.items()
        }
        shapes = {"qkv_proj": shapes["qkv_proj"], "o_proj": [self.hidden_size, q_width]} | (
            {"gate_up_proj": shapes["gate_up_proj"], "down_proj": [self.hidden_size, self.intermediate_size]}
            if self.has_dense_mlp
            else {}
        )
        if self.num_experts:  # the router, and Qwen2-MoE's shared expert and its gate
            shapes["router"] = [self.num_experts, self.hidden_size]
            if self.shared_expert_intermediate_size:
                shapes["shared_expert.gate_up_proj"] = [2 * self.shared_expert_intermediate_size, self.hidden_size]
                shapes["shared_expert.down_proj"] = [self.hidden_size, self.shared_expert_intermediate_size]
                shapes["shared_expert_gate"] = [1, self.hidden_size]
        if self.vocab_size is not None:
            shapes["lm_head"] = [self.vocab_size, self.hidden_size]
        return shapes

    def _mla_linear_shapes(self) -> dict[str, list[int]]:
        """DeepSeek's, as the integration's MLAttention runs them: ``qkv_a_proj`` (q_a_proj, or q_proj
        without q_lora_rank, packed with kv_a_proj_with_mqa), ``q_b_proj``, ``kv_b_proj`` (the
        unabsorbed prompt path), its per-head absorbed pieces ``w_kc`` (W_UK, the query's) and ``w_vc``
        (W_UV, the output's), ``o_proj``; the dense layers' MLP, the router; lm_head. (The routed and
        shared experts run in fused_experts / shared_expert, not as linears.)"""
        heads, hidden, rank, rope = self.num_attention_heads, self.hidden_size, self.kv_lora_rank, self.qk_rope_head_dim
        q_width = heads * (self.qk_nope_head_dim + rope)
        shapes = {}
        if self.q_lora_rank is None:
            shapes["qkv_a_proj"] = [q_width + rank + rope, hidden]
        else:
            shapes["qkv_a_proj"] = [self.q_lora_rank + rank + rope, hidden]
            shapes["q_b_proj"] = [q_width, self.q_lora_rank]
        shapes["kv_b_proj"] = [heads * (self.qk_nope_head_dim + self.v_head_dim), rank]
        shapes["w_kc"] = [rank, self.qk_nope_head_dim]
        shapes["w_vc"] = [self.v_head_dim, rank]
        shapes["o_proj"] = [hidden, heads * self.v_head_dim]
        if self.has_dense_mlp:
            shapes["gate_up_proj"] = [2 * self.intermediate_size, hidden]
            shapes["down_proj"] = [hidden, self.intermediate_size]
        if self.num_experts:
            shapes["router"] = [self.num_experts, hidden]
        if self.vocab_size is not None:
            shapes["lm_head"] = [self.vocab_size, hidden]
        return shapes


def _gated_op(activation: str) -> str:
    if activation not in GATED_OP_BY_ACTIVATION:
        raise ValueError(
            f"config.json activation {activation!r} has no kernforge gated op; "
            f"known: {', '.join(GATED_OP_BY_ACTIVATION)}"
        )
    return GATED_OP_BY_ACTIVATION[activation]


def _runtime_fields(config: dict) -> dict:
    """The fields besides the shapes, each read by transformers' rule (the models' own ``__init__``)."""
    layers = config.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) and layers > 0 else 0
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    clip_qkv = config.get("clip_qkv")
    scalar = config.get("query_pre_attn_scalar")
    return {
        "num_hidden_layers": layers,
        "sliding_windows": _sliding_windows(config, layers),
        "rope_type": _rope_type(rope),
        "clip_qkv": None if clip_qkv is None else float(clip_qkv),
        "rms_norm_eps": float(config.get("rms_norm_eps") or 1e-6),
        "norm_topk_prob": bool(config.get("norm_topk_prob")),
        "routed_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
        "rope_interleave": bool(config.get("rope_interleave", True)),
        "mlp_only_layers": tuple(config.get("mlp_only_layers") or ()),
        "decoder_sparse_step": int(config.get("decoder_sparse_step") or 1),
        "query_pre_attn_scalar": None if scalar is None else float(scalar),
    }


def _rope_type(rope: dict) -> str:
    """The RoPE type; of RoPE parameters per layer type (Gemma 3's ``{"full_attention": {...},
    "sliding_attention": {...}}``), the first that is not "default" (the one a length-dependent
    type would show in)."""
    if rope and all(isinstance(value, dict) for value in rope.values()):
        kinds = [_rope_type(value) for value in rope.values()]
        return next((kind for kind in kinds if kind != "default"), "default")
    return str(rope.get("rope_type", rope.get("type", "default")))


def _sliding_windows(config: dict, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window: a config with ``layer_types`` (Qwen2/3, Qwen2-MoE) slides on its
    "sliding_attention" layers only, the others (Mistral, Mixtral, Qwen3-MoE) on every layer."""
    window = config.get("sliding_window") or None
    if config.get("use_sliding_window") is False:  # the Qwens' switch (transformers' configs apply it too)
        window = None
    types = config.get("layer_types")
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    return (window,) * layers


# DeepSeek's routing rules, and the scores each chooses by.
TOPK_METHODS = {"greedy": "softmax", "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}
_MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _mla_fields(config: dict) -> dict:
    """The multi-head latent attention fields of a DeepSeek-V2/V3 config (none without kv_lora_rank)."""
    if not config.get("kv_lora_rank"):
        return {}
    fields = {name: _positive_int(config, name) for name in _MLA_DIMS}
    q_lora_rank = config.get("q_lora_rank")
    fields["q_lora_rank"] = None if q_lora_rank is None else _positive_int(config, "q_lora_rank")
    return fields


# Where each family keeps its expert count: Qwen-MoE and OLMoE, Mixtral, DeepSeek.
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _moe_fields(config: dict, intermediate_size: int) -> dict:
    """The MoE fields of a config (none for a dense model). Mixtral and OLMoE size their experts
    with ``intermediate_size``; the Qwen MoEs and DeepSeek with ``moe_intermediate_size``."""
    count = next((name for name in _EXPERT_COUNT_FIELDS if config.get(name)), None)
    if count is None:
        return {}
    experts = _positive_int(config, count)
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": _positive_int(config, "num_experts_per_tok"),
        "moe_intermediate_size": _positive_int(config, "moe_intermediate_size")
        if "moe_intermediate_size" in config
        else intermediate_size,
        "shared_expert_intermediate_size": config.get("shared_expert_intermediate_size") or 0,
    }
    if count == "n_routed_experts":  # DeepSeek's: shared experts, dense first layers, the routing rule
        fields.update(_deepseek_routing(config))
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ValueError(
            f"config.json num_experts_per_tok {fields['num_experts_per_tok']} exceeds the {experts} experts"
        )
    return fields


def _deepseek_routing(config: dict) -> dict:
    """DeepSeek's MoE fields. V3's transformers config names no topk_method (its router always runs
    "noaux_tc"); V2's defaults to "greedy"."""
    default = "noaux_tc" if config.get("model_type") == "deepseek_v3" else "greedy"
    method = config.get("topk_method") or default
    if method not in TOPK_METHODS:
        raise ValueError(f"config.json topk_method {method!r} is not one of {', '.join(TOPK_METHODS)}")
    scoring = config.get("scoring_func") or TOPK_METHODS[method]
    if scoring != TOPK_METHODS[method]:
        raise ValueError(f"config.json scoring_func {scoring!r} does not go with topk_method {method!r}")
    fields = {
        "n_shared_experts": config.get("n_shared_experts") or 0,
        "first_k_dense_replace": config.get("first_k_dense_replace") or 0,
        "topk_method": method,
        "scoring_func": scoring,
        "n_group": config.get("n_group") or 0,
        "topk_group": config.get("topk_group") or 0,
    }
    if method != "greedy" and not (fields["n_group"] and fields["topk_group"]):
        raise ValueError(f"config.json topk_method {method!r} needs n_group and topk_group")
    return fields


def _positive_int(config: dict, name: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json needs a positive integer {name}, got {value!r}")
    return value
