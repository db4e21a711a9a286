"""One ModelSpec per optimize() call: pre-warm's kernels are the optimized model's, for every family.

optimize() reads one :class:`~kernforge.model_spec.ModelSpec` from the model's config and shapes
every replaced module by it; ``prewarm --model-config`` derives its manifest from the same spec
(``manifest_from_spec``). Here, for each family's small random model of the integration tests, the
kernel variants the optimized model loads while it generates (and runs a prompt of every GEMM row
bucket) must be exactly those the manifest of ``model._kernforge.model_spec`` lists, less the ones
the manifest holds for kernforge's other integrations.
"""

import copy
import importlib
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
import test_transformers_deepseek as deepseek_tests  # noqa: E402
import test_transformers_gemma3 as gemma3_tests  # noqa: E402
import test_transformers_integration as llama_tests  # noqa: E402
import test_transformers_moe as moe_tests  # noqa: E402
from transformers import (  # noqa: E402
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kernforge.integrations import transformers as kft  # noqa: E402
from kernforge.jit import core  # noqa: E402
from kernforge.model_spec import ModelSpec  # noqa: E402

prewarm = importlib.import_module("kernforge.prewarm")  # the module (``kernforge.prewarm`` is the function)

DENSE = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),  # biased q/k/v
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {}),  # per-head q/k norms
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": 16}),
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, gemma3_tests.OVERRIDES),  # Gemma norms, RoPE per layer type
}
FAMILIES = [*DENSE, *moe_tests.MODELS, *deepseek_tests.MODELS]
ROW_BUCKETS = [1 << i for i in range(11)]  # weight_packed_linear's M buckets (1 ... 1024)


def build(kind: str):
    """(stock bf16 model, its optimized copy) as the family's integration tests build them."""
    if kind in DENSE:
        model_class, config_class, overrides = DENSE[kind]
        torch.manual_seed(0)
        stock = model_class(config_class(**{**llama_tests.SHAPE, **overrides})).to(torch.bfloat16).eval()
        return stock, kft.optimize(copy.deepcopy(stock), kv_cache_pages=256)
    tests = moe_tests if kind in moe_tests.MODELS else deepseek_tests
    return tests.build(kind)


def loaded_variants(model) -> set:
    """The kernel variants ``model`` loads while it samples from a left-padded batch (DeepSeek: one
    prompt long enough for the unabsorbed prefill) and runs a prompt of each GEMM row bucket."""
    seen: set = set()
    load_spec = core.load_spec

    def record(spec):
        seen.add(spec)
        return load_spec(spec)

    core.load_spec = record
    core.invalidate_dispatch()  # every variant resolves again, through record
    try:
        ids, mask = llama_tests.padded_batch([13, 70], lowest_id=3)
        generator = torch.Generator().manual_seed(0)
        kft.generate(model, ids, attention_mask=mask, max_new_tokens=3, do_sample=True, top_k=5, generator=generator)
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        long = llama_tests.padded_batch([max(ROW_BUCKETS)], lowest_id=3)[0]
        with torch.no_grad():
            for rows in ROW_BUCKETS:
                model(long[:, :rows])
    finally:
        core.load_spec = load_spec
    return {spec for spec in seen if spec.module.name != "cpu_probe"}


def other_integrations(spec: ModelSpec) -> set:
    """What the manifest builds that the transformers integration does not run: the fused residual
    add of the norms and sampling on logits in the model's dtype (vLLM's; transformers adds the
    residuals itself and kft.generate samples fp32)."""
    entries = [
        {"op": "gemma_fused_add_rmsnorm" if spec.gemma_norms else "fused_add_rmsnorm", "dtype": spec.dtype},
        {"op": "top_k_top_p_sampling_from_logits", "dtype": spec.dtype},
    ]
    return set(prewarm.specs_from_manifest({"kernels": entries}))


@pytest.mark.parametrize("kind", FAMILIES)
def test_prewarm_derives_the_kernels_the_optimized_model_loads(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every family runs wholly on kernforge
        stock, ours = build(kind)
    spec = ours._kernforge.model_spec
    assert spec == ModelSpec.from_config({**stock.config.to_dict(), "dtype": "bfloat16"})
    manifest = set(prewarm.specs_from_manifest(prewarm.manifest_from_spec(spec)))
    loaded = loaded_variants(ours)
    assert sorted(map(str, loaded - manifest)) == []  # nothing the model runs is missing from pre-warm
    assert sorted(map(str, manifest - other_integrations(spec) - loaded)) == []  # nor anything built for naught


@pytest.mark.parametrize("kind", FAMILIES)
def test_modules_take_their_shapes_from_the_model_spec(kind):
    """Each replaced module's shape is the spec's: heads, KV heads, head dim, sm_scale and windows
    (Llama family), the latent dims (DeepSeek), the router's top-k and renormalization (MoE)."""
    _, ours = build(kind)
    spec, runtime = ours._kernforge.model_spec, ours._kernforge.spec
    layers = ours.model.layers
    assert runtime.num_layers == spec.num_hidden_layers == len(layers)
    if spec.is_mla:
        names = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for layer in layers:
            attn = layer.self_attn
            assert attn.num_heads == spec.num_attention_heads
            assert {name: getattr(attn, name) for name in names} == {name: getattr(spec, name) for name in names}
    else:
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            assert (attn.num_qo_heads, attn.num_kv_heads, attn.head_dim, attn.scaling) == (
                spec.num_attention_heads,
                spec.num_key_value_heads,
                spec.head_dim,
                spec.sm_scale,  # head_dim**-0.5, Gemma 3's query_pre_attn_scalar**-0.5
            )
            assert runtime.window_lefts[index] == spec.window_left(index)
    for layer in layers:
        if hasattr(layer.mlp, "top_k"):
            assert (layer.mlp.top_k, layer.mlp.renormalize) == (spec.num_experts_per_tok, spec.renormalize)
        assert layer.input_layernorm.eps == spec.rms_norm_eps


def packed_linears(model) -> dict:
    """The optimized model's kernforge Linears by the names ModelSpec.linear_shapes() gives them."""
    linears = {"lm_head": model.lm_head}
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        names = ("qkv_proj", "qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj")
        linears |= {name: getattr(attn, name) for name in names if hasattr(attn, name)}
        if hasattr(mlp, "w1"):  # the experts run in fused_experts; the router and shared expert are linears
            linears["router"] = mlp.gate
            if getattr(mlp, "shared_expert", None) is not None:
                linears["shared_expert.gate_up_proj"] = mlp.shared_expert.gate_up_proj
                linears["shared_expert.down_proj"] = mlp.shared_expert.down_proj
                linears["shared_expert_gate"] = mlp.shared_expert_gate
        else:
            linears |= {"gate_up_proj": mlp.gate_up_proj, "down_proj": mlp.down_proj}
    return {name: [linear.out_features, linear.in_features] for name, linear in linears.items()}


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_linears_optimize_packs_are_the_model_specs(kind):
    """Pre-warm builds GEMMs for ModelSpec.linear_shapes(): exactly the linears the model packs (the
    dense MLP's only where some layer has one; DeepSeek's absorbed W_UK / W_UV run as bmm pieces)."""
    _, ours = build(kind)
    spec = ours._kernforge.model_spec
    shapes = {name: shape for name, shape in spec.linear_shapes().items() if name not in ("w_kc", "w_vc")}
    assert packed_linears(ours) == shapes


def test_model_spec_reads_windows_as_transformers_does():
    """Qwen2-MoE slides on its "sliding_attention" layers only, Mistral and Mixtral on every layer,
    Llama nowhere."""
    for kind, windows in (("qwen2_moe", (7, -1)), ("mixtral", (7, 7)), ("mistral", (15, 15)), ("llama", (-1, -1))):
        _, ours = build(kind)
        assert ours._kernforge.spec.window_lefts == windows
    spec = ModelSpec.from_config({**llama_tests.SHAPE, "model_type": "llama"})
    assert spec.sliding_windows == (None, None) and spec.window_left(1) == -1


def test_head_dim_absent_from_the_config_is_the_split_of_hidden_size():
    """transformers' rule, ``getattr(config, "head_dim", hidden_size // num_attention_heads)``, is
    the spec's; a module whose attribute disagrees runs by the spec (its projections must fit it)."""
    config = {k: v for k, v in llama_tests.SHAPE.items() if k != "head_dim"}
    assert ModelSpec.from_config(config).head_dim == 256 // 4
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**config, "num_hidden_layers": 1})).to(torch.bfloat16)
    for layer in model.model.layers:
        layer.self_attn.head_dim = 32  # a stale attribute: the config (and the weights) say 64
    ours = kft.optimize(model, kv_cache_pages=16)
    assert ours.model.layers[0].self_attn.head_dim == ours._kernforge.spec.head_dim == 64
