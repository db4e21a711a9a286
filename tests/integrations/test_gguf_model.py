"""``from_gguf``: GGUF files written as llama.cpp's converter writes a Llama (``write_gguf``), each
tensor type kernforge reads, loaded by kernforge (blocks packed as they are) and by stock transformers
(every tensor dequantized): the logits agree within what kernforge's int8 activations change (the
activations are quantized per block of 32, as llama.cpp quantizes them), the weights are the file's
exactly, and damaged or unsupported files are refused before anything is built."""

import zlib

import gguf
import numpy as np
import pytest
import torch

import kernforge
import kernforge.integrations.transformers as kft
from kernforge.integrations.random_llama import random_llama, write_gguf
from kernforge.integrations.real_model import stock_from_gguf
from kernforge.nn.gguf import GGUFEmbedding, GGUFExperts, GGUFLinear
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
    "ffn_gate_exps": "Q4_K",  # a MoE's experts: gate and up of two types (one expert's gate|up, two parts)
    "ffn_up_exps": "Q5_K",
    "ffn_down_exps": "Q6_K",
}
_HALF_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _model(tied=False, seed=0):
    return random_llama("tiny", seed=seed, rope_parameters=ROPE, tie_word_embeddings=tied, initializer_range=0.05)


def _k_blocks(name: str, weight: np.ndarray):
    kind = next((t for part, t in K_TYPES.items() if f".{part}." in name), None)
    if kind is None:
        return None
    *lead, k = weight.shape  # [rows, k], or a MoE's stacked [experts, rows, k]
    rows = int(np.prod(lead))
    bt = G.BLOCK_TYPES[kind]
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # not hash(): salted per process
    blocks = rng.integers(0, 256, (rows, k // bt.block, bt.size), dtype=np.uint8)
    for start in _HALF_FIELDS[kind]:
        half = (rng.random((rows, k // bt.block)) * 2e-4 + 1e-5).astype(np.float16)
        blocks[..., start : start + 2] = half.view(np.uint8).reshape(rows, k // bt.block, 2)
    return blocks.reshape(*lead, -1), kind


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


@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_0", "Q4_1", "K", "tied"])
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


def _path(files, moe_files, kind):
    """``files[kind]``, or ``moe_files``' for a kind ``moe:KEY``."""
    return moe_files[kind.removeprefix("moe:")][0] if kind.startswith("moe:") else files[kind]


@pytest.mark.parametrize("kind", ["Q4_0", "K", "moe:qwen3moe-K", "moe:mixtral-Q4_0"])
def test_no_dequantized_copy_in_memory(files, moe_files, kind):
    """What the model holds: the packed blocks (the file's d and m as fp16, the K-quants' 6-bit
    sub-scales as bytes, 5- and 6-bit codes as bytes; a MoE's every expert), fp32 norms, never a
    weight in the compute dtype: at most 1.3x the file."""
    path = _path(files, moe_files, kind)
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


@pytest.mark.parametrize("kind", ["K", "tied", "moe:qwen3moe-K", "moe:mixtral-Q4_0", "moe:mixtral-F16"])
def test_prewarm_derives_the_kernels_the_gguf_model_loads(files, moe_files, kind):
    """``prewarm --gguf``'s manifest is what the model loads: the GGUF GEMM at each tensor type of the
    file, no bf16 GEMM where every linear is quantized (a MoE's F32 router's only; an F16 file's all),
    a MoE's quantized experts' silu_and_mul in place of fused_experts, the rest as for the model's config."""
    import importlib

    from test_model_spec_kernels import loaded_variants, other_integrations

    prewarm = importlib.import_module("kernforge.prewarm")
    path = _path(files, moe_files, kind)
    model = kft.from_gguf(path, kv_cache_pages=256)
    manifest = kft.gguf_manifest(path)
    assert manifest["model"]["gguf_file"] == str(path)
    specs = set(prewarm.specs_from_manifest(manifest))
    loaded = loaded_variants(model)
    assert sorted(map(str, loaded - specs)) == []
    assert sorted(map(str, specs - other_integrations(model._kernforge.model_spec) - loaded)) == []
    modules = {spec.module.name for spec in specs}
    if not kind.startswith("moe:"):
        assert "gemm_gguf" in modules and "gemm" not in modules
    else:  # F16: bf16 GEMMs and fused_experts; quantized: the router's bf16 GEMM, GGUF GEMMs, no fused_experts
        assert ("moe_experts" in modules) == kind.endswith("F16") and ("gemm_gguf" in modules) != kind.endswith("F16")


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


# --------------------------------------------------------------------------- mixtures of experts
# A Qwen3-MoE (architecture qwen3moe: q/k norms, q/k rows as they are) and a Mixtral (a llama with
# llama.expert_count: q/k rows permuted), 8 experts of 256, 2 per token, as convert_hf_to_gguf writes
# them (write_gguf): stacked ffn_{gate,up,down}_exps, an F32 router. 256 wide so that the K-quants fit.
MOE_SHAPE = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024, num_hidden_layers=2
)
MOE_FILES = {
    "qwen3moe-Q8_0": "Q8_0",
    "qwen3moe-Q4_1": "Q4_1",
    "qwen3moe-K": "K",
    "mixtral-Q4_0": "Q4_0",
    "mixtral-K": "K",
    "mixtral-F16": "F16",  # plain experts: stacked parameters, SparseMoE's fused_experts on bf16
}


def _qwen3_moe(seed=3):
    return random_llama(
        "tiny-moe", seed=seed, rope_parameters=ROPE, initializer_range=0.05, moe_intermediate_size=256, **MOE_SHAPE
    )


def _mixtral(seed=4):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **MOE_SHAPE,
        intermediate_size=256,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_parameters=ROPE,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return MixtralForCausalLM(config).to(torch.bfloat16).eval()  # transformers' init: N(0, 0.05), norms 1


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-moe")
    sources = {"qwen3moe": _qwen3_moe(), "mixtral": _mixtral()}
    written = {}
    for key, kind in MOE_FILES.items():
        source = sources[key.split("-")[0]]
        path = folder / f"{key}.gguf"
        written[key] = (
            write_gguf(source, path, "Q8_0", encode=_k_blocks) if kind == "K" else write_gguf(source, path, kind),
            source,
        )
    return written


def _dequantized_stock(path, source):
    """Stock transformers (``source``'s class and config, fp32, sdpa) holding every tensor of the file
    dequantized by the gguf package, put back where write_gguf took it from (llama's q/k rows
    un-permuted, gate and up stacked as transformers' experts.gate_up_proj)."""
    import copy

    reader = gguf.GGUFReader(path)
    values = {
        t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float() for t in reader.tensors
    }
    stock = copy.deepcopy(source).float()
    stock.config._attn_implementation = "sdpa"
    config, llama = stock.config, reader.fields["general.architecture"].contents() == "llama"

    def rope_rows(w, heads):  # llama.cpp's (head, pair, half) rows back to (head, half, pair)
        return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape) if llama else w

    state = {
        "model.embed_tokens.weight": values["token_embd.weight"],
        "model.norm.weight": values["output_norm.weight"],
    }
    state["lm_head.weight"] = values["output.weight"]
    for i in range(config.num_hidden_layers):
        blk, layer = f"blk.{i}.", f"model.layers.{i}."
        state |= {
            layer + "input_layernorm.weight": values[blk + "attn_norm.weight"],
            layer + "post_attention_layernorm.weight": values[blk + "ffn_norm.weight"],
            layer + "self_attn.q_proj.weight": rope_rows(values[blk + "attn_q.weight"], config.num_attention_heads),
            layer + "self_attn.k_proj.weight": rope_rows(values[blk + "attn_k.weight"], config.num_key_value_heads),
            layer + "self_attn.v_proj.weight": values[blk + "attn_v.weight"],
            layer + "self_attn.o_proj.weight": values[blk + "attn_output.weight"],
            layer + "mlp.gate.weight": values[blk + "ffn_gate_inp.weight"],
            layer + "mlp.experts.gate_up_proj": torch.cat(
                [values[blk + "ffn_gate_exps.weight"], values[blk + "ffn_up_exps.weight"]], 1
            ),
            layer + "mlp.experts.down_proj": values[blk + "ffn_down_exps.weight"],
        }
        if not llama:
            state[layer + "self_attn.q_norm.weight"] = values[blk + "attn_q_norm.weight"]
            state[layer + "self_attn.k_norm.weight"] = values[blk + "attn_k_norm.weight"]
    stock.load_state_dict(state, strict=True)
    return stock.eval()


@pytest.mark.parametrize("key", list(MOE_FILES))
def test_moe_logits_match_stock_transformers_on_the_dequantized_file(moe_files, key):
    path, source = moe_files[key]
    stock = _dequantized_stock(path, source)
    model = kft.from_gguf(path, kv_cache_pages=64)
    assert type(model).__name__ == type(source).__name__
    ids = torch.randint(3, 1024, (2, 37), generator=torch.Generator().manual_seed(0))
    reference, ours = _logprobs(stock, ids), _logprobs(model, ids)
    kl = (reference.exp() * (reference - ours)).sum(-1).mean().item()
    top1 = (reference.argmax(-1) == ours.argmax(-1)).float().mean().item()
    assert kl < 0.02 and top1 > 0.9, f"KL {kl:.4f}, top-1 agreement {top1:.3f}"


@pytest.mark.parametrize("key", ["qwen3moe-Q8_0", "mixtral-Q4_0"])
def test_moe_prefill_then_decode_follows_stocks_greedy_choices(moe_files, key):
    """One prompt (each decode step runs its one token's two experts, six of eight idle), then a batch
    of two (each step's tokens grouped by expert): stock, teacher-forced on kernforge's greedy sequence,
    ranks each token kernforge picked first, or within a near-tie of its first (the tiny random models'
    next-token logits are flat: top two 0.01 apart happen, and int8 activations may flip those)."""
    path, source = moe_files[key]
    stock, model = _dequantized_stock(path, source), kft.from_gguf(path, kv_cache_pages=64)
    for ids in (torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]])):
        ours = kft.generate(model, ids, max_new_tokens=8)
        assert ours.shape == (ids.shape[0], ids.shape[1] + 8)
        with torch.no_grad():
            logits = stock(ours).logits.float()[:, ids.shape[1] - 1 : -1]
        shortfall = logits.max(-1).values - logits.gather(-1, ours[:, ids.shape[1] :, None]).squeeze(-1)
        exact = (shortfall == 0).float().mean().item()
        assert shortfall.max() < 0.25 and exact >= 0.75, f"{shortfall}, {exact:.2f} exactly stock's"


def test_moe_config_is_the_source_models(moe_files):
    """transformers' GGUF conversion leaves Qwen3-MoE's expert width at its default and reads a Mixtral
    file as a dense Llama: the configs from_gguf builds are the written models'."""
    shared = ["model_type", "hidden_size", "intermediate_size", "num_experts_per_tok", "head_dim"]
    for key, names in (
        ("qwen3moe-Q8_0", [*shared, "moe_intermediate_size", "num_experts", "norm_topk_prob"]),
        ("mixtral-Q4_0", [*shared, "num_local_experts", "num_key_value_heads"]),
    ):
        path, source = moe_files[key]
        config = kft._gguf.gguf_config(path)
        assert {n: getattr(config, n) for n in names} == {n: getattr(source.config, n) for n in names}


def test_moe_experts_run_at_the_files_types_with_its_values(moe_files):
    path, _ = moe_files["qwen3moe-K"]
    model = kft.from_gguf(path, kv_cache_pages=16)
    moe = model.model.layers[1].mlp
    experts = moe.gguf_experts
    assert isinstance(experts, GGUFExperts) and experts.num_experts == 8
    assert all(e.qtypes == ("Q4_K", "Q5_K") for e in experts.gate_up) and all(
        e.qtypes == ("Q6_K",) for e in experts.down
    )
    reader = gguf.GGUFReader(path)
    router = next(t for t in reader.tensors if t.name == "blk.1.ffn_gate_inp.weight")
    assert router.tensor_type.name == "F32" and type(moe.gate) is kernforge.nn.Linear  # plain: the bf16 GEMM
    for name, layers in (("blk.1.ffn_down_exps.weight", experts.down), ("blk.1.ffn_up_exps.weight", experts.gate_up)):
        tensor = next(t for t in reader.tensors if t.name == name)
        expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        for e in (0, 5):
            assert torch.equal(G.dequantize(layers[e].parts[-1]), expected[e])


def test_gguf_experts_match_a_float64_reference_of_the_dequantized_weights():
    """GGUFExperts on packed Q4_0 / Q8_0 experts, a batch whose tokens route to different experts (two
    of six get none, one token picks the same expert as its neighbour): each token's weighted sum of its
    experts' ``down(silu(gate x) * up x)``, within what int8 activations change."""
    experts, hidden, width = 6, 64, 96
    rng = np.random.default_rng(0)

    def packed(kind, rows, k):
        values = rng.standard_normal((rows, k)).astype(np.float32) * 0.1
        blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
        return G.pack_gguf(torch.from_numpy(blocks), kind, rows, k)

    gate_up = [GGUFLinear([packed("Q4_0", 2 * width, hidden)], None, torch.float32) for _ in range(experts)]
    down = [GGUFLinear([packed("Q8_0", hidden, width)], None, torch.float32) for _ in range(experts)]
    layer = GGUFExperts(gate_up, down)
    x = torch.randn(5, hidden)
    ids = torch.tensor([[0, 3], [3, 0], [1, 4], [4, 1], [0, 1]], dtype=torch.int32)  # experts 2 and 5: none
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5], [0.9, 0.1], [0.2, 0.8]])
    out = layer(x, ids, weights)
    reference = torch.zeros(5, hidden, dtype=torch.float64)
    for t in range(5):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            h = G.dequantize(gate_up[e].parts[0]).double() @ x[t].double()
            gated = torch.nn.functional.silu(h[:width]) * h[width:]
            reference[t] += w * (G.dequantize(down[e].parts[0]).double() @ gated)
    error = (out.double() - reference).norm() / reference.norm()
    assert error < 0.02, f"relative error {error:.4f}"
    one = layer(x[4:5], ids[4:5], weights[4:5])  # decode's path (one token) against the grouped path's row
    assert torch.allclose(one, out[4:5], rtol=0, atol=1e-5), (one - out[4:5]).abs().max()
    with pytest.raises(ValueError, match=r"top_k_index must lie in \[0, 6\)"):
        layer(x, ids + 6, weights)


# --------------------------------------------------------------------------- Gemma 3

# A tiny Gemma 3 laid out as llama.cpp runs one (a file holds no layer pattern: five sliding layers,
# then a global one; the sliding layers' RoPE base 10000), head_dim 256 and query_pre_attn_scalar 256
# as Gemma 3 1B's (what llama.cpp's scale rule and transformers' default agree on), norms drawn off 0.
GEMMA3_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    vocab_size=1024,
    max_position_embeddings=4096,
    sliding_window=16,  # the prompts are longer: the window matters
    initializer_range=0.05,
)


def _gemma3(seed=5):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3_SHAPE))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def gemma3_files(tmp_path_factory):
    from kernforge.integrations.random_llama import write_gemma3_gguf

    folder, model = tmp_path_factory.mktemp("gemma3"), _gemma3()
    written = {kind: write_gemma3_gguf(model, folder / f"{kind}.gguf", kind) for kind in ("F32", "F16", "Q8_0", "Q4_0")}
    written["K"] = write_gemma3_gguf(model, folder / "k.gguf", "Q8_0", encode=_k_blocks)
    return model, written


def test_gemma3_file_is_the_model_as_transformers_reads_it(gemma3_files):
    """write_gemma3_gguf writes what transformers' GGUF loader (its Gemma norm fix-up, no q/k
    permutation) reads back as the model: an F32 file gives the source model's logits exactly."""
    model, files = gemma3_files
    stock = stock_from_gguf(files["F32"], torch.float32)
    assert stock.config.layer_types == model.config.layer_types
    ids = torch.randint(3, 1024, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(stock(ids).logits, model(ids).logits)


# (not "K": its random codes make near-uniform next-token distributions, whose top-1 is a coin toss)
@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_0"])
def test_gemma3_logits_match_stock_transformers_on_the_dequantized_file(gemma3_files, kind, record_property):
    path = gemma3_files[1][kind]
    stock = stock_from_gguf(path, torch.float32)
    model = kft.from_gguf(path, kv_cache_pages=64)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.tie_word_embeddings is False
    ids = torch.randint(3, 1024, (2, 37), generator=torch.Generator().manual_seed(0))
    reference, ours = _logprobs(stock, ids), _logprobs(model, ids)
    kl = (reference.exp() * (reference - ours)).sum(-1).mean().item()
    top1 = (reference.argmax(-1) == ours.argmax(-1)).float().mean().item()
    record_property("kl_top1", (kl, top1))
    assert kl < 0.02 and top1 > 0.9, f"KL {kl:.4f}, top-1 agreement {top1:.3f}"


def test_gemma3_norms_embedding_and_head_are_the_files(gemma3_files):
    """The norms hold the source model's weights (the file's minus 1), the embedding scales by
    sqrt(hidden_size), lm_head multiplies by the embedding's packed blocks (tied)."""
    source, files = gemma3_files
    model = kft.from_gguf(files["Q8_0"], kv_cache_pages=16)
    layer, stock_layer = model.model.layers[5], source.model.layers[5]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    for name in norms:
        assert torch.equal(getattr(layer, name).weight, getattr(stock_layer, name).weight.to(torch.bfloat16)), name
    assert torch.equal(layer.self_attn.k_norm.weight, stock_layer.self_attn.k_norm.weight.to(torch.bfloat16))
    assert model.model.embed_tokens.scale == 16.0
    assert model.lm_head.parts[0] is model.model.embed_tokens.weight_packed


def test_gemma3_generate_picks_stocks_greedy_tokens(gemma3_files):
    path = gemma3_files[1]["Q8_0"]
    stock, model = stock_from_gguf(path, torch.float32), kft.from_gguf(path, kv_cache_pages=64)
    ids = torch.randint(3, 1024, (1, 20), generator=torch.Generator().manual_seed(2))
    expected = stock.generate(ids, max_new_tokens=12, do_sample=False)
    assert expected.shape == (1, 32)  # no EOS on the way
    assert torch.equal(kft.generate(model, ids, max_new_tokens=12), expected)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), expected)


def _gemma3_metadata_file(path, layers: int, rope_scaling: str | None):
    """A Gemma 3 file's metadata (no tensors): 27B's width per head when ``layers`` is 62."""
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for add, value in (
        (writer.add_block_count, layers),
        (writer.add_context_length, 4096),
        (writer.add_embedding_length, 5376),
        (writer.add_feed_forward_length, 21504),
        (writer.add_head_count, 32),
        (writer.add_head_count_kv, 16),
        (writer.add_key_length, 128),
        (writer.add_value_length, 128),
        (writer.add_rope_freq_base, 1_000_000.0),
        (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_sliding_window, 1024),
        (writer.add_vocab_size, 262_144),
    ):
        add(value)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        writer.add_rope_scaling_factor(8.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("layers, scalar", [(62, 5376 // 32), (34, 128)])
def test_gemma3_config_is_llama_cpps_reading(tmp_path, layers, scalar):
    """What transformers' GGUF conversion leaves out, read as llama.cpp reads it: the global layers'
    linear RoPE scaling, the softmax scale (hidden_size / heads for the 62-layer 27B, else head_dim)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = kft._gguf.gguf_config(_gemma3_metadata_file(tmp_path / "g.gguf", layers, "linear"))
    assert config.query_pre_attn_scalar == scalar
    assert config.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10_000.0}
    rotary = Gemma3RotaryEmbedding(config)
    unscaled = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    assert torch.allclose(rotary.full_attention_inv_freq, unscaled / 8)
    with pytest.raises(ValueError, match="gemma3.rope.scaling.type 'yarn'; Gemma 3 files scale RoPE linearly"):
        kft._gguf.gguf_config(_gemma3_metadata_file(tmp_path / "y.gguf", layers, "yarn"))


def test_gemma3_prewarm_derives_the_kernels_the_gguf_model_loads(gemma3_files):
    import importlib

    from test_model_spec_kernels import loaded_variants, other_integrations

    prewarm = importlib.import_module("kernforge.prewarm")
    path = gemma3_files[1]["K"]
    model = kft.from_gguf(path, kv_cache_pages=256)
    specs = set(prewarm.specs_from_manifest(kft.gguf_manifest(path)))
    loaded = loaded_variants(model)
    assert sorted(map(str, loaded - specs)) == []
    assert sorted(map(str, specs - other_integrations(model._kernforge.model_spec) - loaded)) == []
