"""``from_gguf``: GGUF files written as llama.cpp's converter writes a Llama (``write_gguf``), each
tensor type kernforge reads, loaded by kernforge (blocks packed as they are) and by stock transformers
(every tensor dequantized): the logits agree within what kernforge's int8 activations change (the
activations are quantized per block of 32, as llama.cpp quantizes them), the weights are the file's
exactly, and damaged or unsupported files are refused before anything is built."""

import gguf
import numpy as np
import pytest
import torch

import kernforge
import kernforge.integrations.transformers as kft
from kernforge.integrations.random_llama import random_llama, write_gguf
from kernforge.integrations.real_model import stock_from_gguf
from kernforge.nn.gguf import GGUFEmbedding, GGUFLinear
from kernforge.ops.gemm import gguf as G

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# K-quant blocks (no quantizer in gguf-py): random codes and sub-scales, small fp16 super-block scales
K_TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "ffn_gate": "Q5_K",
    "ffn_up": "Q5_K",
    "ffn_down": "Q6_K",
}
_HALF_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _model(tied=False, seed=0):
    return random_llama("tiny", seed=seed, rope_parameters=ROPE, tie_word_embeddings=tied, initializer_range=0.05)


def _k_blocks(name: str, weight: np.ndarray):
    kind = next((t for part, t in K_TYPES.items() if f".{part}." in name), None)
    if kind is None:
        return None
    rows, k = weight.shape
    bt = G.BLOCK_TYPES[kind]
    rng = np.random.default_rng(abs(hash(name)) % (1 << 32))
    blocks = rng.integers(0, 256, (rows, k // bt.block, bt.size), dtype=np.uint8)
    for start in _HALF_FIELDS[kind]:
        half = (rng.random((rows, k // bt.block)) * 2e-4 + 1e-5).astype(np.float16)
        blocks[..., start : start + 2] = half.view(np.uint8).reshape(rows, k // bt.block, 2)
    return blocks.reshape(rows, -1), kind


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    model = _model()
    written = {kind: write_gguf(model, folder / f"{kind}.gguf", kind) for kind in ("F16", "Q8_0", "Q4_0", "Q4_1")}
    written["K"] = write_gguf(model, folder / "k.gguf", "Q8_0", encode=_k_blocks)
    written["tied"] = write_gguf(_model(tied=True, seed=1), folder / "tied.gguf", "Q4_1")
    return written


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "K", "tied"])
def test_logits_match_stock_transformers_on_the_dequantized_file(files, kind):
    path = files[kind]
    stock = stock_from_gguf(path, torch.float32)
    model = kft.from_gguf(path, kv_cache_pages=64)
    ids = torch.randint(3, 1024, (2, 37), generator=torch.Generator().manual_seed(0))
    reference, ours = _logprobs(stock, ids), _logprobs(model, ids)
    kl = (reference.exp() * (reference - ours)).sum(-1).mean().item()
    top1 = (reference.argmax(-1) == ours.argmax(-1)).float().mean().item()
    assert kl < 0.02 and top1 > 0.9, f"KL {kl:.4f}, top-1 agreement {top1:.3f}"


def test_every_tensor_runs_at_its_own_type_with_the_files_values(files):
    path = files["K"]
    model = kft.from_gguf(path, kv_cache_pages=16)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.qtypes == ("Q4_K", "Q6_K")  # q|k fused, v apart: one K, two types
    assert layer.mlp.gate_up_proj.qtypes == ("Q5_K",) and layer.mlp.down_proj.qtypes == ("Q6_K",)
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and model.lm_head.qtypes == ("Q8_0",)
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert torch.equal(G.dequantize(layer.mlp.down_proj.parts[0]), torch.from_numpy(expected.copy()))


def test_tied_head_and_embedding_share_one_packed_weight(files):
    model = kft.from_gguf(files["tied"], kv_cache_pages=16)
    assert isinstance(model.lm_head, GGUFLinear)
    assert model.lm_head.parts[0] is model.model.embed_tokens.weight_packed


@pytest.mark.parametrize("kind", ["Q4_0", "K"])
def test_no_dequantized_copy_in_memory(files, kind):
    """What the model holds: the packed blocks (the file's d and m as fp16, the K-quants' 6-bit
    sub-scales as bytes, 5- and 6-bit codes as bytes), fp32 norms, never a weight in the compute dtype:
    at most 1.3x the file."""
    path = files[kind]
    model = kft.from_gguf(path, kv_cache_pages=1)
    tensors = {}
    for module in model.modules():
        packed = [t for part in getattr(module, "parts", []) for t in part.tensors()]
        if isinstance(module, GGUFEmbedding):
            packed += module.weight_packed.tensors()
        for t in [*packed, *module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensors[t.data_ptr()] = t.numel() * t.element_size()
    held = sum(tensors.values())  # the KV cache included: one page
    assert held <= 1.3 * path.stat().st_size, f"{held} bytes held for a {path.stat().st_size}-byte file"


def test_generate_and_top_level_entry_points(files):
    model = kernforge.from_gguf(files["Q8_0"], kv_cache_pages=64)
    ids = torch.tensor([[5, 6, 7, 8]])
    out = kft.generate(model, ids, max_new_tokens=6)
    assert torch.equal(out, model.generate(ids, max_new_tokens=6, do_sample=False))


def _truncated(path, tmp_path):
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    return cut


def test_bad_files_are_refused_naming_what_is_wrong(files, tmp_path):
    with pytest.raises(ValueError, match="truncated"):
        kft.from_gguf(_truncated(files["Q4_0"], tmp_path))
    q5 = tmp_path / "q5_0.gguf"
    write_gguf(_model(), q5, "Q5_0")
    with pytest.raises(ValueError, match=r"tensor token_embd.weight has type Q5_0; kernforge reads Q4_0"):
        kft.from_gguf(q5)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        kft.from_gguf(not_gguf)
    with pytest.raises(FileNotFoundError):
        kft.from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="quant is not taken by from_gguf"):
        kft.from_gguf(files["Q4_0"], quant="int8")


def test_unsupported_architecture_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(kft.UnsupportedModelError, match="architecture 'gemma2' is not taken; kernforge reads llama"):
        kft.from_gguf(tmp_path / "g.gguf")


@pytest.mark.parametrize("kind", ["K", "tied"])
def test_prewarm_derives_the_kernels_the_gguf_model_loads(files, kind):
    """``prewarm --gguf``'s manifest is what the model loads: the GGUF GEMM at each tensor type of the
    file, no bf16 GEMM (every linear is quantized), the rest as for the model's config."""
    import importlib

    from test_model_spec_kernels import loaded_variants, other_integrations

    prewarm = importlib.import_module("kernforge.prewarm")
    model = kft.from_gguf(files[kind], kv_cache_pages=256)
    manifest = kft.gguf_manifest(files[kind])
    assert manifest["model"]["gguf_file"] == str(files[kind])
    specs = set(prewarm.specs_from_manifest(manifest))
    loaded = loaded_variants(model)
    assert sorted(map(str, loaded - specs)) == []
    assert sorted(map(str, specs - other_integrations(model._kernforge.model_spec) - loaded)) == []
    assert {spec.module.name for spec in specs} >= {"gemm_gguf"} and "gemm" not in {s.module.name for s in specs}


def test_missing_kernels_with_jit_off_say_prewarm_gguf(files, monkeypatch, tmp_path):
    monkeypatch.setenv("KERNFORGE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    with pytest.raises(kernforge.KernelNotCachedError, match=r"gemm_gguf\(.*prewarm --gguf .*Q4_0\.gguf"):
        kft.from_gguf(files["Q4_0"])


@pytest.mark.slow  # the real model (SmolLM2-135M-Instruct's Q4_1 file, downloaded once), both sides: ~1 min
def test_make_demos_script_runs_the_real_model():
    """examples/gguf_demo.py, what `make demo` runs first: both columns answer every prompt."""
    import subprocess
    import sys

    from conftest import EXAMPLES_DIR

    result = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / "gguf_demo.py"), "--max-new-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    for column in ("kernforge", "transformers"):
        assert result.stdout.count(f"  {column} ") == 3 and "TPOT" in result.stdout, result.stdout


def test_a_missing_package_names_the_extra_to_install():
    """Without transformers, kernforge.from_gguf says which extra brings what it needs."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import kernforge\n"
        "try:\n    kernforge.from_gguf\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout
    assert "pip install 'kernforge[gguf]'" in out, out
