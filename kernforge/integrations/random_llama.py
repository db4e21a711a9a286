"""A Llama (or Qwen3-MoE, or DeepSeek-V2) model directory with random weights and a small tokenizer,
for trying and testing kernforge in a serving engine without a model hub: ``python -m
kernforge.integrations.random_llama DIR [--shape llama-3.2-1b|tiny|qwen3-30b-a3b|tiny-moe|
deepseek-v2-lite|tiny-deepseek] [--layers N]``; then ``vllm serve DIR``. Needs transformers. A shape
with ``num_experts`` is a ``Qwen3MoeForCausalLM``, one with ``kv_lora_rank`` a
``DeepseekV2ForCausalLM`` (multi-head latent attention; :func:`is_mla`), both mixtures of experts
(:func:`is_moe`); the others a ``LlamaForCausalLM``.

The tokenizer (built with the ``tokenizers`` library) has one word per token id, ``w0`` ... so
any text of such words round-trips, and every id the model can sample decodes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SHAPES = {
    # Llama-3.2-1B's shape (random weights): what the benchmarks run
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # small enough for tests: seconds to load, GQA, Llama 3 RoPE scaling
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked next-token distributions: few near-ties between two runs' greedy picks
    ),
    # Qwen3-30B-A3B's shape (random weights; 48 layers in the real model, the benchmarks take fewer):
    # 128 experts of 768, 8 per token, renormalized
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,  # the dense MLP of mlp_only_layers (none here)
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # the tiny Llama's size as a Qwen3-MoE: 8 experts of 96, 2 per token, q/k norms
    "tiny-moe": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.2,  # as the tiny Llama's
    ),
    # DeepSeek-V2-Lite's shape (random weights; 27 layers in the real model, the benchmarks take 4):
    # MLA with a 512-wide latent KV and 64 RoPE dims, no q LoRA; the first layer dense, the others 64
    # routed experts of 1408 (6 per token, softmax, not renormalized) and 2 shared ones. Plain RoPE
    # (the real model's YaRN scaling does not change what the kernels compute).
    "deepseek-v2-lite": dict(
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        head_dim=64,
        vocab_size=102400,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # the smallest DeepSeek-V2 vLLM's CPU MLA runs (its decode kernel takes only a 512 + 64 latent):
    # 4 heads of 32 + 64, a dense first layer, then 8 experts of 96 (2 per token) and a shared one
    "tiny-deepseek": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=96,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        head_dim=64,
        vocab_size=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.2,  # as the tiny Llama's
    ),
}


def is_moe(shape: str) -> bool:
    """Whether ``shape`` is a mixture of experts (a Qwen3-MoE or a DeepSeek-V2) rather than a Llama."""
    return "num_experts" in SHAPES[shape] or is_mla(shape)


def is_mla(shape: str) -> bool:
    """Whether ``shape`` is a DeepSeek-V2 (multi-head latent attention, a mixture of experts)."""
    return "kv_lora_rank" in SHAPES[shape]


def word(token_id: int) -> str:
    return f"w{token_id}"


def random_llama(shape: str = "tiny", seed: int = 0, layers: int | None = None, *, lazy_layers: bool = False, **config):
    """A bf16 ``LlamaForCausalLM`` of ``shape`` (a ``Qwen3MoeForCausalLM`` or ``DeepseekV2ForCausalLM``
    for those shapes; ``layers`` decoder layers if given; ``config`` overrides more) with weights
    drawn from N(0, initializer_range), norms at 1.

    ``lazy_layers``: the decoder layers stay on the meta device (no memory) until
    :func:`random_layer_weights`'s function draws them one at a time, as ``optimize(model,
    materialize_layer=...)`` reaches each: a model larger than memory in bf16 (Qwen3-30B-A3B's 48
    layers are 61 GB) is then quantized a layer at a time. Its layers' weights are not those of the
    eager model of the same seed."""
    import torch
    from transformers.initialization import no_init_weights

    if is_mla(shape):
        from transformers import DeepseekV2Config as config_class
        from transformers import DeepseekV2ForCausalLM as model_class
    elif is_moe(shape):
        from transformers import Qwen3MoeConfig as config_class
        from transformers import Qwen3MoeForCausalLM as model_class
    else:
        from transformers import LlamaConfig as config_class
        from transformers import LlamaForCausalLM as model_class

    fields = dict(SHAPES[shape], bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    fields.update({"num_hidden_layers": layers} if layers else {}, **config)
    model_config = config_class(**fields)
    with no_init_weights():  # transformers' per-module init is slow at 1B; the weights are drawn below
        if lazy_layers:
            with torch.device("meta"):
                model = model_class(model_config).to(torch.bfloat16)
            _materialize_all_but_layers(model)
        else:
            model = model_class(model_config).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    _draw(model.named_parameters(), generator, model_config.initializer_range, in_bf16=is_moe(shape))
    # no_init_weights also skips tying: without this, lm_head is a second copy of the embedding
    model.tie_weights()
    return model.eval()


def random_layer_weights(model, seed: int = 0):
    """``fill(index, layer)``: draws decoder layer ``index`` of a ``random_llama(...,
    lazy_layers=True)`` model in place (off the meta device, a generator of its own per layer):
    ``optimize``'s ``materialize_layer``."""
    import torch

    std, in_bf16 = model.config.initializer_range, _is_moe_config(model.config)

    def fill(index: int, layer) -> None:
        layer.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index + 1)
        _draw(layer.named_parameters(), generator, std, in_bf16)

    return fill


def _is_moe_config(config) -> bool:
    return any(hasattr(config, name) for name in ("num_experts", "n_routed_experts", "num_local_experts"))


def _materialize_all_but_layers(model) -> None:
    """A model built on the meta device: everything but its decoder layers moved to (uninitialized)
    CPU memory, the rotary embedding rebuilt (its frequencies are computed, not drawn)."""
    for name, child in model.model.named_children():
        if name != "layers":
            child.to_empty(device="cpu")
    model.lm_head.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)


def _draw(named_parameters, generator, std: float, in_bf16: bool) -> None:
    """N(0, std) into every parameter not on the meta device, norms at 1. MoE weights are drawn in
    bf16 (a layer's experts are 1.2 GB at 30B-A3B: an fp32 draw would double that)."""
    import torch

    with torch.no_grad():
        for name, parameter in named_parameters:
            if parameter.is_meta:
                continue
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            elif in_bf16:
                parameter.normal_(0.0, std, generator=generator)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def make_model_dir(
    path: str | Path, shape: str = "tiny", max_position: int = 4096, seed: int = 0, layers: int | None = None
) -> Path:
    """Write :func:`random_llama` and a tokenizer for its vocabulary to ``path`` (kept if it already
    holds the same)."""
    path = Path(path)
    marker = path / "kernforge-random-model.txt"
    recipe = f"{shape} {max_position} {seed} {layers}\n"
    if marker.exists() and marker.read_text() == recipe:
        return path
    model = random_llama(shape, seed, layers, max_position_embeddings=max_position)
    model.save_pretrained(path)
    _tokenizer(model.config.vocab_size).save_pretrained(path)
    marker.write_text(recipe)
    return path


# compressed-tensors' int8 w8a8 scheme: per-channel symmetric weights, activations quantized per
# token at run time (symmetric), as llm-compressor writes it; lm_head stays bf16.
W8A8_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}
# The decoder layers' linear weights a quantized checkpoint rewrites (embeddings, norms, lm_head stay bf16).
_QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_w8a8(source: str | Path, path: str | Path) -> Path:
    """Write a copy of the model directory ``source`` with its decoder layers' linear weights in
    compressed-tensors' int8 w8a8 format (:data:`W8A8_QUANTIZATION`): what vLLM loads as an int8
    checkpoint. Kept if ``path`` already holds it."""
    import torch

    def int8_rows(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        codes = (weight.float() / scale).round().clamp(-128, 127).to(torch.int8)
        return {name: codes, name.removesuffix("weight") + "weight_scale": scale}

    return _rewrite_checkpoint(source, path, "w8a8", W8A8_QUANTIZATION, int8_rows)


_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j of an AWQ word sits in its nibble _AWQ_ORDER[j]


def quantize_awq(source: str | Path, path: str | Path, group_size: int = 128) -> Path:
    """Write a copy of the model directory ``source`` as an AWQ GEMM checkpoint (what AutoAWQ
    writes, what vLLM loads as ``quant_method: awq``): its decoder layers' linear weights rounded by
    kernforge's ``quantize_int4`` (asymmetric, ``group_size`` K per group), so an int4 benchmark needs
    no calibration; lm_head and the embeddings stay bf16. Kept if ``path`` already holds it."""
    import torch

    from kernforge.ops.gemm.int4 import quantize_int4, unpack_int4

    shifts = torch.tensor(_AWQ_ORDER, dtype=torch.int32) * 4

    def awq_words(values: torch.Tensor) -> torch.Tensor:  # [R, N] (0..15) -> int32 [R, N/8], AWQ's order
        words = values.to(torch.int32).view(values.shape[0], -1, 8) << shifts
        return words.sum(-1, dtype=torch.int32)  # the nibbles do not overlap: the sum is their OR

    def awq_gemm(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, zeros, scales = unpack_int4(quantize_int4(weight, group_size, symmetric=False))
        prefix = name.removesuffix("weight")
        return {
            prefix + "qweight": awq_words(codes.t().contiguous()),  # [K, N/8]
            prefix + "qzeros": awq_words(zeros),  # [G, N/8]
            prefix + "scales": scales.to(torch.float16),  # [G, N]
        }

    quantization = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return _rewrite_checkpoint(source, path, f"awq g{group_size}", quantization, awq_gemm)


def _rewrite_checkpoint(
    source: str | Path,
    path: str | Path,
    recipe_name: str,
    quantization: dict[str, Any],
    rewrite: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
) -> Path:
    """Copy the model directory ``source`` to ``path`` with each decoder-layer linear weight
    replaced by ``rewrite(name, weight)``'s tensors and ``quantization`` as the config's
    ``quantization_config``; everything else (embeddings, norms, lm_head, tokenizer files) as is.
    Kept if ``path`` already holds the same recipe of the same source."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source, path = Path(source), Path(path)
    marker = path / "kernforge-random-model.txt"
    recipe = f"{recipe_name} of {(source / 'kernforge-random-model.txt').read_text()}"
    if marker.exists() and marker.read_text() == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in _QUANTIZED_LINEARS:
            tensors.update(rewrite(name, tensor))
        else:
            tensors[name] = tensor
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for other in source.iterdir():
        if other.name not in ("model.safetensors", "config.json", marker.name) and other.is_file():
            shutil.copy(other, path / other.name)
    marker.write_text(recipe)  # last: a directory without it is rebuilt
    return path


_GGUF_FLOATS = {"F32": "float32", "F16": "float16"}
_GGUF_ARCHITECTURES = {"qwen3_moe": "qwen3moe"}  # general.architecture by model_type (Llama and Mixtral: llama)


def _add_expert_metadata(writer, config) -> None:
    """A mixture of experts' keys, as convert_hf_to_gguf writes them (Mixtral's experts are
    ``feed_forward_length`` wide, Qwen3-MoE's ``expert_feed_forward_length``)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _llama_cpp_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotate-half q/k rows -> llama.cpp's interleaved RoPE rows (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str | Path, tensor_type: str = "F16", encode: Callable[..., Any] | None = None) -> Path:
    """Write a ``LlamaForCausalLM`` as llama.cpp's ``convert_hf_to_gguf.py`` writes one (the ``gguf``
    package's writer; tensor names ``token_embd``, ``blk.N.attn_q`` ...; q/k rows permuted to llama.cpp's
    RoPE layout; norms F32; no tokenizer: ``tokenizer.ggml.model = "none"``). A ``MixtralForCausalLM``
    is written the same way (architecture ``llama``, ``llama.expert_count``), a ``Qwen3MoeForCausalLM``
    as architecture ``qwen3moe`` (q/k rows as they are, the q/k norms, ``expert_feed_forward_length``):
    each layer's router ``ffn_gate_inp`` F32 and its experts stacked, ``ffn_gate_exps`` /
    ``ffn_up_exps`` / ``ffn_down_exps`` ``[experts, out, in]`` (``encode`` gets them 3-D). The 2-D weights are
    ``tensor_type``: F16, F32, or a type ``gguf.quants`` quantizes (Q4_0, Q4_1, Q8_0; llama.cpp's
    ``llama-quantize`` writes the others from an F16 file). ``encode(name, weight fp32 ndarray)`` may
    return ``(block bytes uint8 [rows, row bytes], type name)`` for a tensor instead (tests write K-quant
    blocks that way), or None. Tied embeddings write no ``output.weight``."""
    import gguf

    config, path = model.config, Path(path)
    arch = _GGUF_ARCHITECTURES.get(config.model_type, "llama")
    writer = _gguf_writer(path, arch, config, "kernforge-random-llama")
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("none")
    _add_expert_metadata(writer, config)
    if arch == "qwen3moe":  # convert_hf_to_gguf writes the config's head_dim
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)

    add = _gguf_tensor_writer(writer, tensor_type, encode)

    add("token_embd.weight", model.model.embed_tokens.weight)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, norm=True)
        q, k = attn.q_proj.weight, attn.k_proj.weight
        if arch == "llama":  # convert_hf_to_gguf permutes a Llama's (and Mixtral's) q/k rows, not Qwen's
            q, k = (
                _llama_cpp_rope_rows(q, config.num_attention_heads),
                _llama_cpp_rope_rows(k, config.num_key_value_heads),
            )
        add(f"blk.{i}.attn_q.weight", q)
        add(f"blk.{i}.attn_k.weight", k)
        add(f"blk.{i}.attn_v.weight", attn.v_proj.weight)
        add(f"blk.{i}.attn_output.weight", attn.o_proj.weight)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3's per-head q/k norms
            add(f"blk.{i}.attn_q_norm.weight", attn.q_norm.weight, norm=True)
            add(f"blk.{i}.attn_k_norm.weight", attn.k_norm.weight, norm=True)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, norm=True)
        if hasattr(mlp, "experts"):
            add(f"blk.{i}.ffn_gate_inp.weight", mlp.gate.weight, norm=True)  # the converter keeps routers F32
            gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj  # [E, 2I, H], [E, H, I]
            add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, : gate_up.shape[1] // 2])
            add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, gate_up.shape[1] // 2 :])
            add(f"blk.{i}.ffn_down_exps.weight", down)
        else:
            add(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
            add(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
            add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    add("output_norm.weight", model.model.norm.weight, norm=True)
    if not config.tie_word_embeddings:
        add("output.weight", model.lm_head.weight)
    return _written(writer, path)


def write_gemma3_gguf(
    model, path: str | Path, tensor_type: str = "F16", encode: Callable[..., Any] | None = None
) -> Path:
    """Write a ``Gemma3ForCausalLM`` as llama.cpp's ``convert_hf_to_gguf.py`` (its ``Gemma3Model``)
    writes one: architecture ``gemma3``; ``key_length`` / ``value_length`` (head_dim),
    ``sliding_window``, the global layers' ``rope.freq_base`` and linear ``rope.scaling`` (the
    local layers' base and the every-6th-layer-global pattern are llama.cpp's constants, so the file
    holds neither); every norm weight plus 1 (llama.cpp's Gemma norms scale by the stored weight, the
    four of each layer, the per-head q/k norms and the final one); q/k rows as they are (no
    permutation); the embedding tied (no ``output.weight``). Tensor names, types, ``encode`` and the
    tokenizer ("none") as :func:`write_gguf`'s."""
    import gguf

    config, path = model.config, Path(path)
    full, local = config.rope_parameters["full_attention"], config.rope_parameters["sliding_attention"]
    if local.get("rope_theta") != 10_000.0 or local.get("rope_type", "default") != "default":
        raise ValueError(f"llama.cpp runs Gemma 3's sliding layers at RoPE base 10000 unscaled, not {local}")
    pattern = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(config.num_hidden_layers)]
    if list(config.layer_types) != pattern:  # llama.cpp's (and transformers' default): every 6th layer global
        raise ValueError(f"a Gemma 3 file cannot hold layer_types {config.layer_types}; llama.cpp runs {pattern}")
    writer = _gguf_writer(path, "gemma3", config, "kernforge-random-gemma3")
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(full["rope_theta"]))
    if full.get("rope_type", "default") == "linear":  # the global layers' only, as the converter writes it
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("none")
    add = _gguf_tensor_writer(writer, tensor_type, encode)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    for hf_name, weight in model.named_parameters():  # a tied lm_head is the embedding: not listed again
        module_name, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(module_name)}.{suffix}"
        if hf_name.endswith("norm.weight"):
            add(name, weight.detach().float() + 1, norm=True)
        else:
            add(name, weight)
    return _written(writer, path)


def _gguf_writer(path: Path, arch: str, config, name: str):
    """A GGUFWriter for ``arch`` with the metadata every architecture's file has from ``config``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(config.name_or_path or name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    return writer


def _written(writer, path: Path) -> Path:
    """``writer``'s header, metadata and tensors, to ``path``."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensor_writer(writer, tensor_type: str, encode: Callable[..., Any] | None) -> Callable[..., None]:
    """``add(name, tensor, norm=False)``: the tensor into ``writer`` as :func:`write_gguf` writes it (norms
    F32; weights ``tensor_type``, or the blocks ``encode`` returns)."""
    import gguf
    import numpy as np

    def add(name: str, t: torch.Tensor, norm: bool = False) -> None:
        values = t.detach().float().contiguous().numpy()
        encoded = None if norm or encode is None else encode(name, values)
        if encoded is not None:
            blocks, kind = encoded
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
        elif norm or tensor_type in _GGUF_FLOATS:
            writer.add_tensor(name, values.astype(np.float32 if norm else _GGUF_FLOATS[tensor_type]))
        else:
            raw_type = gguf.GGMLQuantizationType[tensor_type]
            blocks = gguf.quants.quantize(values, raw_type)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=raw_type)

    return add


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word(i): i for i in range(vocab_size)}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    del vocab[word(0)], vocab[word(1)], vocab[word(2)]
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--max-position", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--w8a8", metavar="PATH", help="also write an int8 w8a8 copy (compressed-tensors) to PATH")
    args = parser.parse_args(argv)
    print(make_model_dir(args.path, args.shape, args.max_position, layers=args.layers))
    if args.w8a8:
        print(quantize_w8a8(args.path, args.w8a8))


if __name__ == "__main__":
    main()
