"""What kernforge knows about a model, read once from its Hugging Face config: the attention shape,
the activation's gated op, and the linear layers as kernforge packs them. Pre-warm
(``prewarm --model-config``) derives the kernels to build from it, and the transformers integration
packs and runs the model by it, so the two cannot disagree. (MoE and MLA models add their fields
here.)"""

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

    @classmethod
    def from_config(cls, config: dict | str | Path) -> ModelSpec:
        """From a ``config.json`` (path or dict; a multimodal config's ``text_config`` is read too).
        Raises ValueError naming the field that is missing or wrong."""
        if not isinstance(config, dict):
            config = json.loads(Path(config).read_text())
        config = {**config.get("text_config", {}), **config}
        sizes = {name: _positive_int(config, name) for name in ("hidden_size", "intermediate_size")}
        heads = _positive_int(config, "num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or heads % kv_heads:
            raise ValueError(f"config.json num_key_value_heads {kv_heads!r} must divide num_attention_heads {heads}")
        head_dim = config.get("head_dim")
        if head_dim is None:  # absent: the split of hidden_size; a given one is checked as it is (0 too)
            head_dim = sizes["hidden_size"] // heads
        activation = config.get("hidden_act") or config.get("hidden_activation") or "silu"
        if activation not in GATED_OP_BY_ACTIVATION:
            raise ValueError(
                f"config.json activation {activation!r} has no kernforge gated op; "
                f"known: {', '.join(GATED_OP_BY_ACTIVATION)}"
            )
        vocab = config.get("vocab_size")
        experts = _moe_fields(config, sizes["intermediate_size"])
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
        )

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def gated_op(self) -> str:
        return GATED_OP_BY_ACTIVATION[self.activation]

    @property
    def gemma_norms(self) -> bool:
        """Gemma's RMSNorm scales by ``1 + weight``."""
        return "gemma" in str(self.model_type or "").lower()

    def linear_shapes(self) -> dict[str, list[int]]:
        """[N, K] (``nn.Linear.weight``'s shape) of a decoder layer's linears as kernforge packs them
        (``PACKED_LINEARS``), and lm_head's when the vocabulary is known."""
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
        shapes = {
            "qkv_proj": shapes["qkv_proj"],
            "o_proj": [self.hidden_size, q_width],
            "gate_up_proj": shapes["gate_up_proj"],
            "down_proj": [self.hidden_size, self.intermediate_size],
        }
        if self.num_experts:  # the router, and Qwen2-MoE's shared expert and its gate
            shapes["router"] = [self.num_experts, self.hidden_size]
            if self.shared_expert_intermediate_size:
                shapes["shared_expert.gate_up_proj"] = [2 * self.shared_expert_intermediate_size, self.hidden_size]
                shapes["shared_expert.down_proj"] = [self.hidden_size, self.shared_expert_intermediate_size]
                shapes["shared_expert_gate"] = [1, self.hidden_size]
        if self.vocab_size is not None:
            shapes["lm_head"] = [self.vocab_size, self.hidden_size]
        return shapes


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
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ValueError(
            f"config.json num_experts_per_tok {fields['num_experts_per_tok']} exceeds the {experts} experts"
        )
    return fields


def _positive_int(config: dict, name: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json needs a positive integer {name}, got {value!r}")
    return value
