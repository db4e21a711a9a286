"""``random_llama.quantize_awq``: the AWQ GEMM checkpoint it writes holds exactly ``quantize_int4``'s
codes, zeros and (fp16) scales in AWQ's nibble order, and kernforge's loader runs it as the bf16 model
with those weights dequantized."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.integrations.random_llama import make_model_dir, quantize_awq  # noqa: E402
from kernforge.ops.gemm.int4 import quantize_int4, unpack_int4  # noqa: E402

GROUP = 128
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j of a word is in nibble AWQ_NIBBLE[j] (AutoAWQ's packing)


def awq_values(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` -> ``[R, 8C]``, undoing AWQ's order one column at a time."""
    columns = [(words >> (4 * AWQ_NIBBLE[j])) & 0xF for j in range(8)]
    return torch.stack(columns, dim=-1).reshape(words.shape[0], -1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    source = make_model_dir(tmp_path_factory.mktemp("bf16"), "tiny")
    return source, quantize_awq(source, tmp_path_factory.mktemp("awq"), GROUP)


def awq_weights(directory) -> dict:
    """``{linear weight name: dequantized [N, K] fp32}`` from the AWQ tensors."""
    tensors, out = load_file(directory / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        prefix = name.removesuffix("qweight")
        codes, zeros = awq_values(tensors[name]).t(), awq_values(tensors[prefix + "qzeros"]).t()
        scales = tensors[prefix + "scales"].float().t()
        out[prefix + "weight"] = (codes - zeros.repeat_interleave(GROUP, 1)) * scales.repeat_interleave(GROUP, 1)
    return out


def test_awq_tensors_are_quantize_int4s(dirs):
    source, awq = dirs
    stock, tensors = load_file(source / "model.safetensors"), load_file(awq / "model.safetensors")
    config = json.loads((awq / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
                      "modules_to_not_convert": None}  # fmt: skip
    quantized = [n for n in stock if n.endswith("proj.weight")]
    assert len(quantized) == 2 * 7
    for name in quantized:
        codes, zeros, scales = unpack_int4(quantize_int4(stock[name], GROUP))
        prefix = name.removesuffix("weight")
        assert prefix + "weight" not in tensors
        assert tensors[prefix + "qweight"].dtype == torch.int32
        assert torch.equal(awq_values(tensors[prefix + "qweight"]).t(), codes.to(torch.int32))
        assert torch.equal(awq_values(tensors[prefix + "qzeros"]), zeros.to(torch.int32))
        assert torch.equal(tensors[prefix + "scales"], scales.half())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(tensors[name], stock[name])
    assert (awq / "tokenizer.json").exists()
    assert quantize_awq(source, awq, GROUP) == awq  # kept


def test_loads_as_the_dequantized_model(dirs):
    source, awq = dirs
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, weight in awq_weights(awq).items():
            reference.get_parameter(name).copy_(weight)
    model = kft.from_pretrained(awq, quant="int4_w4a16", kv_cache_pages=64)
    ids = torch.randint(3, 1024, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, want = model(ids).logits[0].double(), reference(ids).logits[0].double()
    # the reference holds the dequantized weights rounded to bf16; kernforge's kernel does not round them
    assert torch.nn.functional.cosine_similarity(ours, want, dim=-1).min() > 0.995
