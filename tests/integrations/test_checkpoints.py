"""``kernforge.integrations.transformers.from_pretrained``: four-bit checkpoints (AWQ gemm, GPTQ v1 / v2,
compressed-tensors pack-quantized) written here by hand from ``quantize_int4``'s codes, loaded without
a bf16 copy of their quantized weights, packed exactly as ``quantize_int4`` packs, and run against the
stock model holding the dequantized weights; unsupported configurations raise ValueError."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
from safetensors.torch import save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.ops.gemm.int4 import pack_int4, quantize_int4, unpack_int4  # noqa: E402

VOCAB = 512
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    initializer_range=0.05,
    tie_word_embeddings=False,
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@pytest.fixture(scope="module")
def stock():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16).eval()


def words(nibbles: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """uint8 ``[R, 8C]`` -> int32 ``[R, C]``: element ``8c + j`` goes to nibble ``order[j]`` of word ``c``."""
    rows, cols = nibbles.shape
    grouped = nibbles.to(torch.int64).reshape(rows, cols // 8, 8)
    shifts = torch.tensor([4 * i for i in order], dtype=torch.int64)
    packed = (grouped << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantized_linears(model, group: int, symmetric: bool):
    """``{module name: (codes [N, K], zeros [G, N], fp32 scales [G, N], quantize_int4's packed)}``."""
    out = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            packed = quantize_int4(module.weight.detach().float(), group, symmetric=symmetric)
            codes, zeros, scales = unpack_int4(packed)
            out[name] = (codes, zeros, scales, packed)
    return out


def checkpoint_tensors(layout: str, codes, zeros, scales, scale_dtype, k: int, group: int) -> dict:
    """One linear's tensors as the layout stores them (suffix -> tensor)."""
    if layout == "awq":
        return {
            "qweight": words(codes.t().contiguous(), AWQ_ORDER),
            "qzeros": words(zeros, AWQ_ORDER),
            "scales": scales.to(scale_dtype),
        }
    if layout in ("gptq", "gptq_v2"):
        stored = (zeros.to(torch.int16) - 1) & 0xF if layout == "gptq" else zeros  # v1 keeps z - 1
        return {
            "qweight": words(codes).t().contiguous(),  # [K/8, N]: packed along K
            "qzeros": words(stored.to(torch.uint8)),
            "scales": scales.to(scale_dtype),
            "g_idx": (torch.arange(k) // group).to(torch.int32),
        }
    return {
        "weight_packed": words(codes),
        "weight_scale": scales.t().contiguous().to(scale_dtype),
        "weight_shape": torch.tensor(list(codes.shape), dtype=torch.int64),
    }


def quantization_config(layout: str, group: int, activations: bool = False) -> dict:
    if layout == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    if layout in ("gptq", "gptq_v2"):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": True,  # taken: every g_idx is the trivial k // group_size
            "sym": False,
            "checkpoint_format": layout,
        }
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": int8 if activations else None}
        },
        "ignore": ["lm_head"],
    }


def write_checkpoint(directory, model, layout, group, scale_dtype=torch.float16, sharded=False, activations=False):
    """The checkpoint on disk, and ``{linear name: expected PackedInt4Weight}`` (scales as stored)."""
    symmetric = layout == "pack_quantized"
    linears = quantized_linears(model, group, symmetric)
    tensors, expected = {}, {}
    for name, value in model.state_dict().items():
        if name.rpartition(".")[0] not in linears:
            tensors[name] = value.contiguous()
    for name, (codes, zeros, scales, packed) in linears.items():
        k = codes.shape[1]
        for suffix, t in checkpoint_tensors(layout, codes, zeros, scales, scale_dtype, k, group).items():
            tensors[f"{name}.{suffix}"] = t.contiguous()
        expected[name] = pack_int4(codes, zeros, scales.to(scale_dtype).float())
        assert torch.equal(expected[name].packed, packed.packed) and torch.equal(expected[name].zeros, packed.zeros)
        if scale_dtype is torch.float32:
            assert torch.equal(expected[name].scales, packed.scales)
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(layout, group, activations)
    (directory / "config.json").write_text(json.dumps(config))
    if sharded:
        names = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, part in halves.items():
            save_file({n: tensors[n] for n in part}, directory / file, metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return expected


def dequantized_model(stock, expected):
    model = copy.deepcopy(stock)
    with torch.no_grad():
        for name, packed in expected.items():
            codes, zeros, scales = unpack_int4(packed)
            group = packed.group_size
            weight = (codes.float() - zeros.t().repeat_interleave(group, 1).float()) * scales.t().repeat_interleave(
                group, 1
            )
            model.get_submodule(name).weight.copy_(weight)
    return model


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min().item()


CASES = [
    ("awq", 64, torch.float16, False, False),
    ("gptq", 32, torch.float16, True, False),
    ("gptq_v2", 64, torch.float32, False, False),
    ("pack_quantized", 32, torch.bfloat16, False, False),
    ("pack_quantized", 64, torch.float32, False, True),
]


@pytest.mark.parametrize("quant", ["int4", "int4_w4a16"])
@pytest.mark.parametrize(("layout", "group", "scale_dtype", "sharded", "activations"), CASES)
def test_four_bit_checkpoint_loads_exactly(stock, tmp_path, layout, group, scale_dtype, sharded, activations, quant):
    expected = write_checkpoint(tmp_path, stock, layout, group, scale_dtype, sharded, activations)
    model = kft.from_pretrained(tmp_path, quant=quant, kv_cache_pages=64)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        fused = {
            layer.self_attn.qkv_proj: [prefix + f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
            layer.self_attn.o_proj: [prefix + "self_attn.o_proj"],
            layer.mlp.gate_up_proj: [prefix + f"mlp.{p}" for p in ("gate_proj", "up_proj")],
            layer.mlp.down_proj: [prefix + "mlp.down_proj"],
        }
        for linear, names in fused.items():
            parts = [unpack_int4(expected[name]) for name in names]
            want = pack_int4(*(torch.cat([p[i] for p in parts], dim=0 if i == 0 else 1) for i in range(3)))
            assert linear.quant == quant and linear.group_size == group
            assert torch.equal(linear.weight_packed, want.packed)
            assert torch.equal(linear.weight_zeros, want.zeros)
            assert torch.equal(linear.weight_scale, want.scales)
    assert model.lm_head.quant is None  # the head stays as the checkpoint has it
    reference = dequantized_model(stock, expected)
    ids = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, want = model(ids).logits[0], reference(ids).logits[0]
    assert cosine(ours, want) > (0.999 if quant == "int4_w4a16" else 0.995)


def test_plain_checkpoint_loads_and_optimizes(stock, tmp_path):
    stock.save_pretrained(tmp_path)
    model = kft.from_pretrained(tmp_path, kv_cache_pages=64)
    assert model.model.layers[0].mlp.down_proj.quant is None
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert cosine(model(ids).logits[0], stock(ids).logits[0]) > 0.999


def _with(layout, **changes):
    config = quantization_config(layout, 64)
    for key, value in changes.items():
        if key == "weights" or key == "input_activations":
            group = config["config_groups"]["group_0"]
            group[key] = value if key == "input_activations" else {**group["weights"], **value}
        else:
            config[key] = value
    return config


BAD_CONFIGS = [
    (_with("awq", bits=8), r"bits\W*8"),
    (_with("awq", version="gemv"), "gemv"),
    (_with("awq", version="marlin"), "marlin"),
    (_with("gptq", bits=3), r"bits\W*3"),
    (_with("gptq", checkpoint_format="marlin"), "marlin"),
    (_with("pack_quantized", format="float-quantized"), "float-quantized"),
    (_with("pack_quantized", weights={"num_bits": 8}), "8 bits"),
    (_with("pack_quantized", weights={"actorder": "group"}), "actorder"),
    (_with("pack_quantized", input_activations={"num_bits": 8, "type": "float", "strategy": "token"}), "input_act"),
    ({"quant_method": "fp8"}, "fp8"),
    ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
]


@pytest.fixture(scope="module")
def awq_dir(stock, tmp_path_factory):
    directory = tmp_path_factory.mktemp("awq")
    write_checkpoint(directory, stock, "awq", 64)
    return directory


@pytest.mark.parametrize(("quantization", "named"), BAD_CONFIGS)
def test_unsupported_configs_raise(awq_dir, tmp_path, quantization, named):
    """The config is refused, naming what is not taken, before any weight is read."""
    config = json.loads((awq_dir / "config.json").read_text())
    config["quantization_config"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(awq_dir / "model.safetensors")
    with pytest.raises(ValueError, match=named):
        kft.from_pretrained(tmp_path, kv_cache_pages=64)


def test_other_compute_quants_are_refused_for_four_bit_checkpoints(awq_dir):
    with pytest.raises(ValueError, match="int8"):
        kft.from_pretrained(awq_dir, quant="int8")


def test_gptq_act_order_is_refused(stock, tmp_path):
    write_checkpoint(tmp_path, stock, "gptq", 64)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # K permuted across groups
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="desc_act"):
        kft.from_pretrained(tmp_path, kv_cache_pages=64)
