"""``kernforge.integrations.transformers.from_pretrained``: four-bit checkpoints (AWQ gemm, GPTQ v1 / v2,
compressed-tensors pack-quantized) written here by hand from ``quantize_int4``'s codes, loaded without
a bf16 copy of their quantized weights, packed exactly as ``quantize_int4`` packs, and run against the
stock model holding the dequantized weights; unsupported configurations raise ValueError."""

from __future__ import annotations

import copy
import json
import sys

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


# --------------------------------------------------------------------------- bit patterns, more layouts, memory


def test_word_packing_follows_the_formats_bit_patterns():
    """The packer above and the loader's unpacking against words written out by hand: AWQ keeps
    column ``8c + j`` in nibble ``(0, 4, 1, 5, 2, 6, 3, 7)[j]`` of word ``c``; GPTQ and
    compressed-tensors element ``j`` in nibble ``j``, low nibble first."""
    from kernforge.integrations.transformers._checkpoints import _nibbles

    ramp = torch.arange(8, dtype=torch.uint8)[None]
    for values, order, word in (
        (ramp, AWQ_ORDER, 0x75316420),
        (ramp, tuple(range(8)), 0x76543210),
        (15 - ramp, tuple(range(8)), 0x89ABCDEF),  # a negative int32
        (15 - ramp, AWQ_ORDER, 0x8ACE9BDF),
    ):
        packed = words(values, order)
        assert packed.item() & 0xFFFFFFFF == word
        assert torch.equal(_nibbles(packed, order), values)


@pytest.fixture(scope="module")
def biased():
    """The tiny Llama with biases on every linear and lm_head tied to the embedding."""
    torch.manual_seed(3)
    config = LlamaConfig(**{**SHAPE, "tie_word_embeddings": True}, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.05)
    return model.to(torch.bfloat16).eval()


MORE_CONFIGS = {
    # llm-compressor's W4A8: int8 tensors holding the 4-bit values, symmetric groups, int8 activations
    "ct_int": {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64},
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
    },
    # asymmetric, one group per output channel: weight_zero_point [N/8, 1] packed along N
    "ct_asym_channel": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel"},
            }
        },
        "ignore": ["lm_head"],
    },
    # GPTQ v1 quantizing lm_head too, with a zero point 0: stored z - 1 wraps to 15, read as 16 (GPTQ's kernels' value)
    "gptq_head": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": False,
        "sym": False,
        "lm_head": True,
    },
}


def write_more(directory, model, layout):
    """A checkpoint of ``layout`` (MORE_CONFIGS), and ``{linear name: expected PackedInt4Weight}``."""
    head = layout == "gptq_head"
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    quantized = {n for n, _ in model.named_modules() if n.rpartition(".")[2] in LINEARS or (head and n == "lm_head")}
    tensors = {
        n: t.contiguous() for n, t in state.items() if n.rpartition(".")[0] not in quantized or n.endswith(".bias")
    }
    expected = {}
    for name in sorted(quantized):
        weight = model.get_submodule(name).weight.detach().float()
        group = {"ct_int": 64, "ct_asym_channel": weight.shape[1], "gptq_head": 32}[layout]
        codes, zeros, scales = unpack_int4(quantize_int4(weight, group, symmetric=layout == "ct_int"))
        if layout == "ct_int":
            scales = scales.to(torch.bfloat16)
            stored = {"weight": (codes.to(torch.int16) - 8).to(torch.int8), "weight_scale": scales.t()}
        elif layout == "ct_asym_channel":
            stored = {"weight_packed": words(codes), "weight_zero_point": words(zeros).t(), "weight_scale": scales.t()}
        else:
            zeros[0, :3] = 0
            scales = scales.half()
            stored_zeros = ((zeros.to(torch.int16) - 1) & 0xF).to(torch.uint8)
            stored = {"qweight": words(codes).t(), "qzeros": words(stored_zeros), "scales": scales}
            zeros[0, :3] = 16
        tensors.update({f"{name}.{suffix}": t.contiguous() for suffix, t in stored.items()})
        expected[name] = pack_int4(codes, zeros, scales.float())
    config = model.config.to_dict()
    config["quantization_config"] = MORE_CONFIGS[layout]
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return expected


def packed_as(linear, *parts) -> bool:
    want = [unpack_int4(part) for part in parts]
    want = pack_int4(*(torch.cat([p[i] for p in want], dim=0 if i == 0 else 1) for i in range(3)))
    return all(
        torch.equal(ours, theirs)
        for ours, theirs in zip((linear.weight_packed, linear.weight_zeros, linear.weight_scale), want)
    )


@pytest.mark.parametrize("layout", list(MORE_CONFIGS))
def test_more_layouts_biases_tied_embeddings_and_quantized_heads(stock, biased, tmp_path, layout):
    source = stock if layout == "gptq_head" else biased
    expected = write_more(tmp_path, source, layout)
    model = kft.from_pretrained(tmp_path, kv_cache_pages=64)  # W4A8
    for i, layer in enumerate(model.model.layers):
        e = {name.removeprefix(f"model.layers.{i}."): p for name, p in expected.items() if f"layers.{i}." in name}
        attn, mlp = layer.self_attn, layer.mlp
        assert packed_as(attn.qkv_proj, e["self_attn.q_proj"], e["self_attn.k_proj"], e["self_attn.v_proj"])
        assert packed_as(attn.o_proj, e["self_attn.o_proj"]) and packed_as(mlp.down_proj, e["mlp.down_proj"])
        assert packed_as(mlp.gate_up_proj, e["mlp.gate_proj"], e["mlp.up_proj"])
        if source is biased:
            want = torch.cat(
                [source.get_submodule(f"model.layers.{i}.self_attn.{p}").bias for p in ("q_proj", "k_proj", "v_proj")]
            )
            assert torch.equal(attn.qkv_proj.bias, want.float())
    if layout == "gptq_head":
        assert model.lm_head.quant == "int4" and packed_as(model.lm_head, expected["lm_head"])
    else:
        assert model.lm_head.quant is None
    reference = dequantized_model(source, expected)
    ids = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert cosine(model(ids).logits[0], reference(ids).logits[0]) > 0.995


@pytest.mark.parametrize("quant", [None, "int8"])
def test_plain_sharded_tied_checkpoint(biased, tmp_path, quant):
    biased.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = kft.from_pretrained(tmp_path, quant=quant, kv_cache_pages=64)
    assert model.model.layers[0].mlp.down_proj.quant == quant
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert cosine(model(ids).logits[0], biased(ids).logits[0]) > (0.999 if quant is None else 0.99)


def test_broken_checkpoints_raise(awq_dir, tmp_path):
    from safetensors.torch import load_file

    tensors = load_file(awq_dir / "model.safetensors")
    config = json.loads((awq_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    missing = {n: t for n, t in tensors.items() if n != "model.layers.1.mlp.up_proj.qzeros"}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj.*qzeros"):
        kft.from_pretrained(tmp_path, kv_cache_pages=64)
    wrong = {**tensors, "model.layers.0.mlp.down_proj.scales": tensors["model.layers.0.mlp.down_proj.scales"][:1]}
    save_file(wrong, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj"):
        kft.from_pretrained(tmp_path, kv_cache_pages=64)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match="qwen3_moe"):
        kft.from_pretrained(tmp_path, kv_cache_pages=64)


_PEAK_SCRIPT = """
import ctypes, gc, json, sys
from kernforge.integrations import transformers as kft

def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))

kft.from_pretrained(sys.argv[2], kv_cache_pages=4)  # first use: code pages, thread pools, caches
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM from here on
before = status("VmRSS:")
model = kft.from_pretrained(sys.argv[1], kv_cache_pages=4)
peak = status("VmHWM:") - before
tensors = [*model.parameters(), *model.buffers()]
packed = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
print(json.dumps({"peak": peak, "packed": packed}))
"""


def write_random_gptq(directory, layers: int, hidden=1024, intermediate=2816, group=128):
    """A GPTQ checkpoint of random words (what a real one's bytes look like to the loader)."""
    directory.mkdir()
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=2048,
        tie_word_embeddings=False,
    ).to_dict()
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True}
    (directory / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    tensors = {"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = (torch.randn(2048, hidden, generator=g) * 0.02).to(torch.bfloat16)
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (512, hidden),
        "self_attn.v_proj": (512, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    for i in range(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name, (n, k) in shapes.items():
            prefix = f"model.layers.{i}.{name}"
            tensors[f"{prefix}.qweight"] = torch.randint(
                -(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=g
            )
            tensors[f"{prefix}.qzeros"] = torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32)
            tensors[f"{prefix}.scales"] = (torch.rand(k // group, n, generator=g) * 0.01).half()
    save_file(tensors, directory / "model.safetensors")


@pytest.mark.slow  # a child process loading a 150 MB checkpoint
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_at_load_is_the_packed_model(tmp_path):
    """Peak resident memory while loading a four-bit checkpoint stays within 1.3x of the packed model it
    makes (a bf16 copy of the quantized weights alone would be 4x theirs)."""
    import subprocess

    write_random_gptq(tmp_path / "model", layers=24)
    write_random_gptq(tmp_path / "warm", layers=1)
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "model"), str(tmp_path / "warm")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["peak"] <= 1.3 * result["packed"], result
