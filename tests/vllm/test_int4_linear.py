"""The plugin's int4 linear kernel under vLLM's own 4-bit linear layers, in this process (no engine).

Each test builds a vLLM linear layer (``ReplicatedLinear``, or a fused ``MergedColumnParallelLinear``
loaded shard by shard) with an AWQ, GPTQ or compressed-tensors quantization config, loads a
checkpoint's tensors packed here by hand through the layer's weight loaders, runs vLLM's
``process_weights_after_loading`` (AWQ: vLLM's rewrite to the GPTQ-like layout, then the kernel's)
and the layer's forward, and compares it with the dequantized weight: W4A16 against the bf16
activations, W4A8 against their int8 per-token quantization (kernforge's ``per_token_quant_int8``)
and, looser, against the bf16 ones. The checkpoint packings:

* AWQ: ``qweight [K, N/8]``, ``qzeros [G, N/8]`` (column ``8c + j`` in nibble ``(0, 4, 1, 5, 2, 6, 3,
  7)[j]`` of word ``c``), ``scales [G, N]``;
* GPTQ (symmetric, what vLLM takes): ``qweight [K/8, N]`` (8 K rows per word), ``qzeros [G, N/8]``
  holding ``z - 1`` = 7 (vLLM ignores them), ``scales [G, N]``;
* compressed-tensors ``pack-quantized``: ``weight_packed [N, K/8]`` along K (values + 8),
  ``weight_scale [N, G]``, asymmetric ``weight_zero_point [N/8, G]`` along N;
  ``int-quantized`` (W4A8 int): the int8 weight ``[N, K]`` in [-8, 7].
"""

import inspect
import zlib

import pytest
import torch

import kernforge.integrations.vllm as plugin
from kernforge.integrations.vllm import int4, selfcheck
from kernforge.ops.gemm.int8 import per_token_quant_int8

K, GROUP = 256, 64
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SEQUENTIAL = tuple(range(8))
TOKEN_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}

# format -> (quantization config as a checkpoint's config.json has it, zero points?, vLLM's scheme class
# or linear method, as a name)
FORMATS = {
    "awq": ({"quant_method": "awq", "w_bit": 4, "q_group_size": GROUP, "zero_point": True}, True),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True}, False),
    "ct-w4a16": ("pack-quantized", None, True, "group"),
    "ct-w4a16-asym": ("pack-quantized", None, False, "group"),
    "ct-w4a16-channel": ("pack-quantized", None, True, "channel"),
    "ct-w4a8": ("pack-quantized", TOKEN_INT8, True, "group"),
    "ct-w4a8-int": ("int-quantized", TOKEN_INT8, True, "group"),
}
GROUP_OF = {fmt: K if FORMATS[fmt][-1] == "channel" else GROUP for fmt in FORMATS}
SCHEMES = {
    "awq": "AutoAWQMarlinLinearMethod",
    "gptq": "AutoGPTQLinearMethod",
    "ct-w4a16": "CompressedTensorsWNA16",
    "ct-w4a16-asym": "CompressedTensorsWNA16",
    "ct-w4a16-channel": "CompressedTensorsWNA16",
    "ct-w4a8": "CompressedTensorsWNA8Int",
    "ct-w4a8-int": "CompressedTensorsW4A8Int",
}


@pytest.fixture(scope="module")
def registered():
    """kernforge's int4 kernel first in vLLM's CPU list (what the plugin's ``int4`` part does;
    idempotent), nothing else of the plugin's."""
    assert int4.register_int4_linear()


@pytest.fixture
def single_rank(registered, monkeypatch):
    """vLLM's linear layers and parameters as one rank builds them (no process group here), under a
    default vLLM config; KERNFORGE_VLLM=1 (no self-check) unless a test says otherwise."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor import parameter
    from vllm.model_executor.layers import linear

    for module in (parameter, linear):
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "1")
    monkeypatch.delenv(int4.MODE_VARIABLE, raising=False)
    with set_current_vllm_config(VllmConfig()):
        yield


# --------------------------------------------------------------------------- checkpoints


def _generator(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _pack(values, order=SEQUENTIAL):
    """int ``[R, C]`` (0..15) -> int32 ``[R, C/8]``: element ``8c + j`` in nibble ``order[j]`` of word ``c``."""
    shifts = torch.tensor([4 * i for i in order], dtype=torch.int32)
    words = values.to(torch.int32).view(values.shape[0], -1, 8) << shifts
    return words.sum(-1, dtype=torch.int32)


class Checkpoint:
    """A random 4-bit weight ``[N, K]``: codes 0..15, zero points (8 where symmetric), bf16 group
    scales; ``tensors()`` packs it as a format stores it."""

    def __init__(self, fmt, n, seed):
        generator = _generator(fmt, n, seed)
        self.fmt, self.n = fmt, n
        self.group = GROUP_OF[fmt]
        groups = K // self.group
        self.codes = torch.randint(0, 16, (n, K), generator=generator)
        self.zeros = (
            torch.randint(3, 13, (groups, n), generator=generator) if _zero_points(fmt) else torch.full((groups, n), 8)
        )
        self.scales = (torch.rand(groups, n, generator=generator) * 0.02 + 0.005).to(torch.bfloat16)

    def dequantized(self):
        zeros = self.zeros.t().repeat_interleave(self.group, dim=1)
        scales = self.scales.float().t().repeat_interleave(self.group, dim=1)
        return (self.codes - zeros).float() * scales

    def tensors(self) -> dict:
        codes, zeros, scales = self.codes, self.zeros, self.scales
        if self.fmt == "awq":
            return {"qweight": _pack(codes.t(), AWQ_ORDER), "qzeros": _pack(zeros, AWQ_ORDER), "scales": scales}
        if self.fmt == "gptq":
            return {"qweight": _pack(codes).t().contiguous(), "qzeros": _pack(zeros - 1), "scales": scales}
        if self.fmt == "ct-w4a8-int":
            return {"weight": (codes - 8).to(torch.int8), "weight_scale": scales.t().contiguous()}
        tensors = {"weight_packed": _pack(codes), "weight_scale": scales.t().contiguous()}
        if _zero_points(self.fmt):
            tensors["weight_zero_point"] = _pack(zeros).t().contiguous()
        return tensors


def _zero_points(fmt):
    return fmt == "awq" or fmt.endswith("-asym")


def _quant_config(fmt):
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    if fmt == "awq":
        return AutoAWQConfig.from_config(FORMATS[fmt][0])
    if fmt == "gptq":
        return AutoGPTQConfig.from_config(FORMATS[fmt][0])
    form, input_quant, symmetric, strategy = FORMATS[fmt]
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": strategy, "dynamic": False}
    if strategy == "group":
        weights["group_size"] = GROUP
    group = {"targets": ["Linear"], "weights": weights, "input_activations": input_quant}
    return CompressedTensorsConfig.from_config(
        {"quant_method": "compressed-tensors", "format": form, "config_groups": {"group_0": group}, "ignore": []}
    )


def _layer(fmt, sizes, bias=True, seed=0):
    """A vLLM linear layer of ``fmt`` with output parts ``sizes`` (one: ReplicatedLinear; more: a
    fused MergedColumnParallelLinear) loaded part by part, weights processed; its checkpoints."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear

    config = _quant_config(fmt)
    arguments = {"bias": bias, "quant_config": config, "params_dtype": torch.bfloat16, "disable_tp": True}
    if len(sizes) == 1:
        layer = ReplicatedLinear(K, sizes[0], prefix="model.layers.0.mlp.down_proj", **arguments)
    else:
        layer = MergedColumnParallelLinear(K, list(sizes), prefix="model.layers.0.mlp.gate_up_proj", **arguments)
    parts = [Checkpoint(fmt, n, (seed, i)) for i, n in enumerate(sizes)]
    biases = [torch.randn(n, generator=_generator("bias", n, seed, i)).to(torch.bfloat16) for i, n in enumerate(sizes)]
    for shard, (part, part_bias) in enumerate(zip(parts, biases)):
        tensors = part.tensors()
        if bias:
            tensors["bias"] = part_bias
        if fmt.startswith("ct") and fmt != "ct-w4a8-int":
            tensors["weight_shape"] = torch.tensor([part.n, K])
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            if len(sizes) == 1:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)
    full_bias = torch.cat(biases) if bias else None
    return layer, torch.cat([part.dequantized() for part in parts]), full_bias


def _kernel(layer):
    scheme = getattr(layer, "scheme", None)
    return (scheme if scheme is not None else layer.quant_method).kernel


def _scheme_name(layer):
    scheme = getattr(layer, "scheme", None)
    return type(scheme if scheme is not None else layer.quant_method).__name__


def _reference(x, weight, bias):
    out = x.float() @ weight.t()
    return out if bias is None else out + bias.float()


def _x(tokens, seed=1):
    return torch.randn(tokens, K, generator=_generator("x", tokens, seed)).to(torch.bfloat16)


def _assert_matches(out, x, weight, bias, w4a8):
    """W4A16: the bf16 activations' product (bf16 output rounding). W4A8: the product of their int8
    per-token quantization, as tight, and within that quantization's error of the bf16 one."""
    assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], weight.shape[0])
    if not w4a8:
        torch.testing.assert_close(out.float(), _reference(x, weight, bias), atol=2e-2, rtol=1e-2)
        return
    q, scale = per_token_quant_int8(x)
    quantized = (q.float() - 128) * scale[:, None]
    torch.testing.assert_close(out.float(), _reference(quantized, weight, bias), atol=2e-2, rtol=1e-2)
    step = x.float().abs().amax(-1, keepdim=True) / 254  # half an int8 step per token, at most, per element
    bound = 2e-2 + step * weight.abs().sum(1)[None]
    assert ((out.float() - _reference(x, weight, bias)).abs() <= bound).all()


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("mode", int4.MODES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int4_layer_runs_kernforge_and_matches_the_dequantized_weight(single_rank, monkeypatch, fmt, mode):
    monkeypatch.setenv(int4.MODE_VARIABLE, mode)
    layer, weight, bias = _layer(fmt, [96])
    assert _scheme_name(layer) == SCHEMES[fmt]
    kernel = _kernel(layer)
    assert type(kernel) is int4.KernforgeInt4LinearKernel and kernel.vllm_kernel is None
    assert kernel.w4a8 is (mode == "w4a8")
    for name, param in layer.named_parameters(remove_duplicate=False):  # the checkpoint's tensors freed
        assert param.numel() == 0 or name.startswith("kernforge_int4_") or name in ("bias", "weight_shape"), name
    assert layer.kernforge_int4_weight.dtype == torch.uint8
    assert layer.kernforge_int4_scales.shape == layer.kernforge_int4_zeros.shape == (K // GROUP_OF[fmt], 96)
    for tokens in (1, 37):
        x = _x(tokens)
        out, _ = layer(x)
        _assert_matches(out, x, weight, bias, mode == "w4a8")


@pytest.mark.parametrize("mode", int4.MODES)
def test_layer_compiles_into_one_graph(single_rank, monkeypatch, mode):
    """Dynamo traces the layer's forward without a break: the kernel's apply_weights calls
    kernforge's custom op on the layer's parameters."""
    monkeypatch.setenv(int4.MODE_VARIABLE, mode)
    layer, weight, bias = _layer("awq", [96], seed=6)
    compiled = torch.compile(lambda x: layer(x)[0], fullgraph=True, backend="eager")
    x = _x(5, seed=7)
    out = compiled(x)
    assert torch.equal(out, layer(x)[0])
    _assert_matches(out, x, weight, bias, mode == "w4a8")


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct-w4a16-asym", "ct-w4a8-int"])
def test_fused_layer_loaded_shard_by_shard(single_rank, fmt):
    """gate_up-style fused layer, parts of 64 and 32 outputs (N = 96: a panel and a half), no bias,
    3-D activations."""
    layer, weight, _ = _layer(fmt, [64, 32], bias=False, seed=3)
    assert type(_kernel(layer)) is int4.KernforgeInt4LinearKernel
    x = _x(10, seed=4).view(2, 5, K)
    out, _ = layer(x)
    assert out.shape == (2, 5, 96)
    _assert_matches(out.view(10, 96), x.view(10, K), weight, None, w4a8=True)


def _mp_config(weight_type, zero_points, k=K, n=96, group=GROUP, act_type=torch.bfloat16):
    from vllm.model_executor.kernels.linear import MPLinearLayerConfig

    return MPLinearLayerConfig(
        full_weight_shape=(k, n),
        partition_weight_shape=(k, n),
        weight_type=weight_type,
        act_type=act_type,
        group_size=group,
        zero_points=zero_points,
    )


def test_registry_picks_kernforge_first_for_what_it_takes(registered):
    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.model_executor.kernels.linear import CPUWNA16LinearKernel, choose_mp_linear_kernel
    from vllm.platforms import PlatformEnum
    from vllm.scalar_type import scalar_types

    cpu_kernels = linear_kernels._POSSIBLE_KERNELS[PlatformEnum.CPU]
    assert cpu_kernels[0] is int4.KernforgeInt4LinearKernel and CPUWNA16LinearKernel in cpu_kernels
    assert cpu_kernels.count(int4.KernforgeInt4LinearKernel) == 1
    ours = int4.KernforgeInt4LinearKernel
    for config in (
        _mp_config(scalar_types.uint4, True),  # AWQ, compressed-tensors asymmetric
        _mp_config(scalar_types.uint4b8, False),  # GPTQ, compressed-tensors symmetric
        _mp_config(scalar_types.int4, False, group=K),  # compressed-tensors int-quantized W4A8, per channel
        _mp_config(scalar_types.uint4b8, False, group=-1, act_type=torch.float16),
    ):
        assert choose_mp_linear_kernel(config) is ours, config
    # what kernforge does not take goes to vLLM's kernels: uint4 without zero points, groups of 2
    for config in (_mp_config(scalar_types.uint4, False), _mp_config(scalar_types.uint4b8, False, group=2)):
        assert not ours.can_implement(config)[0]
        assert choose_mp_linear_kernel(config) is CPUWNA16LinearKernel
    assert not ours.can_implement(_mp_config(scalar_types.uint8b128, False))[0]


def test_register_names_the_int4_part(monkeypatch):
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "int4")
    assert plugin.register() == ["int4 linear layers (AWQ, GPTQ, compressed-tensors)"]
    assert "int4" in plugin.PARTS


def test_mode_variable_is_checked(monkeypatch):
    monkeypatch.delenv(int4.MODE_VARIABLE, raising=False)
    assert int4.int4_mode() == "w4a8"
    monkeypatch.setenv(int4.MODE_VARIABLE, " W4A16 ")
    assert int4.int4_mode() == "w4a16"
    monkeypatch.setenv(int4.MODE_VARIABLE, "int8")
    with pytest.raises(ValueError, match=r"KERNFORGE_VLLM_INT4='int8'.*'w4a8', 'w4a16'"):
        int4.int4_mode()


@pytest.mark.parametrize("kernforge_faster", [True, False], ids=["kernforge-won", "vllm-won"])
@pytest.mark.parametrize("fmt", ["awq", "ct-w4a16"])
def test_layer_runs_the_side_its_verdict_names(single_rank, monkeypatch, fmt, kernforge_faster):
    """The verdict is asked once per layer with its mode and shape; where vLLM's kernel won, the
    layer holds it, with the weights vLLM prepared, and runs its apply_weights."""
    from vllm.model_executor.kernels.linear import CPUWNA16LinearKernel

    asked = []

    def verdict(part, shapes, cases):
        asked.append((part, shapes))
        return kernforge_faster

    monkeypatch.setattr(selfcheck, "kernforge_is_faster", verdict)
    layer, weight, bias = _layer(fmt, [96])
    weight_type = "uint4" if fmt == "awq" else "uint4b8"
    assert asked == [("int4", f"w4a8 bfloat16 {weight_type} N=96 K={K} G={GROUP}")]
    kernel = _kernel(layer)
    assert (kernel.vllm_kernel is None) is kernforge_faster
    assert hasattr(layer, "kernforge_int4_weight") is kernforge_faster
    if not kernforge_faster:
        assert type(kernel.vllm_kernel) is CPUWNA16LinearKernel
    x = _x(9)
    out, _ = layer(x)
    # vLLM's CPU kernel runs W4A8 with AMX (VLLM_CPU_INT4_W4A8), else W4A16
    _assert_matches(out, x, weight, bias, w4a8=kernforge_faster or bool(getattr(layer, "use_w4a8", False)))


@pytest.mark.parametrize("mode", int4.MODES)
def test_self_check_times_vllms_own_kernel_on_the_same_weights(single_rank, monkeypatch, mode):
    """Both sides of the int4 check compute the layer's product (vLLM's kernel prepared on a
    stand-in: the layer is left as it is); then the layer gets the side the check recorded."""
    from vllm.model_executor.kernels.linear import CPUWNA16LinearKernel

    monkeypatch.setenv(int4.MODE_VARIABLE, mode)
    seen = {}

    def verdict(part, shapes, cases):
        seen["cases"] = cases()
        return True

    monkeypatch.setattr(selfcheck, "kernforge_is_faster", verdict)
    layer, weight, _ = _layer("ct-w4a16-asym", [96], bias=False)
    cases = seen["cases"]
    assert set(cases) == {f"M={rows}" for rows in int4.INT4_CHECK_ROWS}
    for name, (kernforge_call, vllm_call) in cases.items():
        x = kernforge_call.args[0]
        assert x.shape == (int(name[2:]), K) and vllm_call.args[1] is x
        assert type(vllm_call.func.__self__) is CPUWNA16LinearKernel
        stand_in = vllm_call.args[0]
        _assert_matches(kernforge_call(), x, weight, None, mode == "w4a8")
        _assert_matches(vllm_call(), x, weight, None, bool(getattr(stand_in, "use_w4a8", False)))
    assert _kernel(layer).vllm_kernel is None and hasattr(layer, "kernforge_int4_weight")


def test_self_check_records_the_int4_verdict(single_rank, monkeypatch, tmp_path):
    """KERNFORGE_VLLM unset: the first layer of a shape is measured and recorded, the next one
    (another process, here the verdicts forgotten) reads the record."""
    import json

    monkeypatch.delenv(plugin.ENABLE_VARIABLE)
    monkeypatch.setenv("KERNFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    monkeypatch.setattr(selfcheck, "MIN_SECONDS", 0.002)
    monkeypatch.setattr(selfcheck, "ROUNDS", 1)
    layer, weight, bias = _layer("gptq", [96])
    (entry,) = json.loads((tmp_path / "cache" / "tuning" / "vllm-int4.json").read_text()).values()
    assert entry["bucket"].startswith(f"w4a8 bfloat16 uint4b8 N=96 K={K} G={GROUP}|vllm ")
    assert set(entry["seconds"]) == {f"M={rows}" for rows in int4.INT4_CHECK_ROWS}
    assert (_kernel(layer).vllm_kernel is None) is entry["winner"]["kernforge"]
    selfcheck._verdicts.clear()

    def never(*args):
        raise AssertionError("a recorded verdict was measured again")

    monkeypatch.setattr(int4, "_int4_cases", never)
    again, _, _ = _layer("gptq", [96], seed=5)
    assert (_kernel(again).vllm_kernel is None) is entry["winner"]["kernforge"]


def test_a_layout_it_does_not_read_goes_to_vllms_kernel(single_rank, monkeypatch):
    """A layer whose weight is not in a layout the kernel reads (here AWQ's own, as if vLLM no
    longer rewrote it first) is handed to vLLM's kernel rather than misread, self-check or not."""
    from vllm.model_executor.kernels.linear import CPUWNA16LinearKernel

    layer = _layer_unprocessed("awq")
    kernel = _kernel(layer)
    assert int4.checkpoint_tensors(kernel, layer) is None
    handed = []
    monkeypatch.setattr(CPUWNA16LinearKernel, "process_weights_after_loading", lambda self, layer: handed.append(layer))
    kernel.process_weights_after_loading(layer)  # the kernel's own, skipping vLLM's AWQ rewrite
    assert handed == [layer] and type(kernel.vllm_kernel) is CPUWNA16LinearKernel


def _layer_unprocessed(fmt):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(K, 96, bias=False, quant_config=_quant_config(fmt), params_dtype=torch.bfloat16,
                             prefix="model.layers.0.mlp.down_proj", disable_tp=True)  # fmt: skip
    for name, tensor in Checkpoint(fmt, 96, 0).tensors().items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    return layer


def test_vllm_internals_the_int4_kernel_relies_on_are_unchanged(registered):
    """Each check names what to revisit in int4.py when it fails."""
    from vllm.model_executor.kernels.linear import choose_mp_linear_kernel
    from vllm.model_executor.layers.quantization import auto_awq

    assert "_POSSIBLE_KERNELS" in inspect.getsource(choose_mp_linear_kernel), (
        "register_int4_linear: vLLM's mixed-precision layers pick their kernel from another list now"
    )
    process = inspect.getsource(auto_awq.AutoAWQMarlinLinearMethod.process_weights_after_loading)
    assert process.index("_convert_awq_to_standard_format(") < process.index(
        "self.kernel.process_weights_after_loading"
    )
    assert "AutoAWQMarlinLinearMethod(self)" in inspect.getsource(auto_awq.AutoAWQConfig.get_quant_method), (
        "AWQ on the CPU no longer goes through choose_mp_linear_kernel"
    )
