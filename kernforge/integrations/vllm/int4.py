"""kernforge's four-bit GEMM under vLLM's int4 linear layers (AWQ, GPTQ, compressed-tensors).

vLLM's 4-bit linear methods pick their kernel with ``choose_mp_linear_kernel``: the first class of
``vllm.model_executor.kernels.linear._POSSIBLE_KERNELS[CPU]`` (vLLM 0.32: ``Dynamic4bitLinearKernel``,
``ZentorchWNA16LinearKernel``, ``CPUWNA16LinearKernel``) whose ``can_implement`` takes the layer.
:func:`register_int4_linear` adds :class:`KernforgeInt4LinearKernel` through vLLM's
``register_linear_kernel(..., "mp")`` and moves it first. The layers it meets on the CPU (vLLM 0.32):

* AWQ (``AutoAWQConfig``, ``uint4`` with zero points): ``AutoAWQMarlinLinearMethod`` loads the AWQ
  checkpoint (``qweight [K, N/8]`` in AWQ's nibble order, ``qzeros [G, N/8]``, ``scales [G, N]``)
  and, before the kernel sees it, rewrites it to the GPTQ-like layout (``qweight [K/8, N]`` packed
  along K, ``qzeros [N/8, G]`` packed along N, both in sequential nibble order, the zero points
  themselves, not minus one).
* GPTQ (``AutoGPTQConfig``: symmetric only, ``uint4b8``; ``desc_act`` is refused by vLLM):
  ``qweight [K/8, N]`` packed along K, ``scales [G, N]``; the checkpoint's ``qzeros`` are ignored
  (zero 8), as vLLM's own kernel does.
* compressed-tensors ``pack-quantized`` weight-only (``CompressedTensorsWNA16``, W4A16) and with
  dynamic per-token int8 activations (``CompressedTensorsWNA8Int``): ``weight_packed [N, K/8]``
  packed along K (values + 8), ``weight_scale [N, G]``, asymmetric ones ``weight_zero_point [N/8,
  G]`` packed along N (zero points + 8).
* compressed-tensors ``int-quantized`` W4A8 (``CompressedTensorsW4A8Int``, ``int4``): the weight
  unpacked, int8 ``[N, K]`` in [-8, 7], ``weight_scale [N, G]``, no zero points.

The kernel reads the layout the layer holds from its vLLM parameters' ``input_dim`` /
``output_dim`` / ``packed_dim`` (anything else is left to vLLM's kernel), turns it into
compressed-tensors' pack-quantized layout (transposes, and the int8 weight packed into words) and
converts it with ``convert_weight_packed_scale_zp(..., PACK_QUANTIZED)``; it then runs
``int4_scaled_mm_cpu`` (W4A8: activations quantized per token to int8 in the call) or, with
``KERNFORGE_VLLM_INT4=w4a16``, ``int4_w4a16_linear`` (activations as they are), on every int4 layer
whatever its checkpoint declares. vLLM's own CPU kernel (``CPUWNA16LinearKernel``) runs W4A8
(sgl-kernel's ``int4_scaled_mm_cpu``) on bf16 layers where the CPU has AMX and ``VLLM_CPU_INT4_W4A8``
is on (its default), else W4A16 (``cpu_gemm_wna16``); ``KERNFORGE_VLLM_INT4=w4a16`` keeps a
weight-only checkpoint's numerics where stock vLLM would run W4A16.

Per layer shape, the plugin's self-check (:mod:`kernforge.integrations.vllm.selfcheck`, part
``int4``) times kernforge's op against the kernel vLLM would have picked (prepared on a stand-in
layer with copies of the weights); where vLLM's wins, the layer holds an instance of that kernel,
hands it its weights and runs its ``apply_weights``.

Four-bit MoE experts (AWQ, GPTQ, compressed-tensors ``RoutedExperts``) go through vLLM's
``fused_moe.oracle.int_wna16`` (``CPUExpertsInt4``, ``fused_experts_cpu`` with sgl-kernel's int4
W4A8 method); this module does not touch them.
"""

from __future__ import annotations

import functools
import os

import torch
from vllm import envs
from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel, MPLinearLayerConfig
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import PlatformEnum, current_platform
from vllm.scalar_type import scalar_types

import kernforge
from kernforge import torch_library as ops
from kernforge.integrations.vllm import selfcheck
from kernforge.integrations.vllm.layers import register_first_cpu_kernel
from kernforge.ops.gemm.int4 import PACK_QUANTIZED, QUAD

MODE_VARIABLE = "KERNFORGE_VLLM_INT4"
MODES = ("w4a8", "w4a16")  # the first is the default
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PACK = 8  # nibbles per int32 word
INT4_CHECK_ROWS = (1, 128)  # the self-check's cases: a decode step's row, a prefill chunk's rows
# the vLLM parameter attributes that say how a tensor is laid out
LAYOUT_ATTRIBUTES = ("input_dim", "output_dim", "packed_dim", "packed_factor")


def int4_mode() -> str:
    """``w4a8`` (the default: int8 activations, per token) or ``w4a16``, as ``KERNFORGE_VLLM_INT4`` says."""
    value = os.environ.get(MODE_VARIABLE, "").strip().lower() or MODES[0]
    if value not in MODES:
        raise ValueError(f"{MODE_VARIABLE}={value!r}: use one of {MODES} (unset: {MODES[0]})")
    return value


def _group_size(c: MPLinearLayerConfig) -> int:
    return c.partition_weight_shape[0] if c.group_size == -1 else c.group_size


class KernforgeInt4LinearKernel(MPLinearKernel):
    """A 4-bit linear layer on kernforge's ``int4_scaled_mm_cpu`` (W4A8) or ``int4_w4a16_linear``:
    the checkpoint's weight, zero points and group scales converted once after loading. Where the
    self-check found vLLM's kernel faster on the layer's shape, ``vllm_kernel`` holds it and the
    layer runs that instead."""

    vllm_kernel: MPLinearKernel | None = None  # vLLM's kernel, where it won the self-check
    w4a8: bool = True

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
        if not current_platform.is_cpu():
            return False, "requires CPU"
        k, n = c.partition_weight_shape
        if c.weight_type == scalar_types.uint4:
            if not c.zero_points:
                return False, "uint4 weights without zero points are not taken"
        elif c.weight_type in (scalar_types.uint4b8, scalar_types.int4):
            if c.zero_points:
                return False, f"{c.weight_type} weights with zero points are not taken"
        else:
            return False, f"weight type {c.weight_type} is not four-bit (uint4, uint4b8, int4)"
        if c.act_type not in KERNEL_DTYPES:
            return False, f"activation dtype {c.act_type} is not bf16, fp16 or fp32"
        group = _group_size(c)
        if k % PACK or group < QUAD or group % QUAD or k % group:
            return (
                False,
                f"K = {k} must be a multiple of {PACK} split into groups of a multiple of {QUAD} (group {group})",
            )
        if c.zero_points and n % PACK:
            return False, f"N = {n} must be a multiple of {PACK} (zero points packed along N)"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.w4a8 = int4_mode() == "w4a8"
        tensors = checkpoint_tensors(self, layer)
        # converted only where kernforge's kernel is measured or runs: a recorded verdict for vLLM's needs none
        convert = functools.cache(lambda: kernforge.convert_weight_packed_scale_zp(*tensors, PACK_QUANTIZED))
        self.vllm_kernel = self._vllm_kernel_if_faster(layer, tensors is not None, convert)
        if self.vllm_kernel is not None:
            self.vllm_kernel.process_weights_after_loading(layer)
            return
        if tensors is None:
            raise ValueError(
                f"{type(self).__name__}: the layer's {self.w_q_name} / {self.w_s_name} / {self.w_zp_name} are in a "
                "layout this kernel does not read, and no kernel of vLLM's takes it"
            )
        w, w_zeros, w_scales = convert()
        for name, tensor in (("weight", w), ("zeros", w_zeros), ("scales", w_scales)):
            layer.register_parameter(f"kernforge_int4_{name}", torch.nn.Parameter(tensor, requires_grad=False))
        bias = getattr(layer, "bias", None)
        layer.kernforge_bias = None if bias is None else bias.detach().float()
        # the converted copies are the ones read from now on (compressed-tensors' int-quantized W4A8
        # registers its weight twice, as weight and weight_packed: both names go)
        for name in (self.w_q_name, self.w_s_name, self.w_zp_name):
            old = getattr(layer, name, None) if name else None
            for alias in [alias for alias, param in layer._parameters.items() if old is not None and param is old]:
                replace_parameter(layer, alias, torch.empty(0, dtype=old.dtype))

    def _vllm_kernel_if_faster(self, layer: torch.nn.Module, readable: bool, convert) -> MPLinearKernel | None:
        """vLLM's own kernel for this layer where the self-check found it faster on its shape (or
        where kernforge does not read the layer's layout)."""
        vllm_class = vllm_kernel_class(self.config)
        if vllm_class is None:
            return None  # no kernel of vLLM's takes the layer: nothing to compare with
        vllm_kernel = vllm_class(self.config, self.w_q_name, self.w_s_name, self.w_zp_name)
        if not readable:
            return vllm_kernel

        def cases() -> dict:
            return _int4_cases(self, vllm_kernel, layer, convert())

        try:
            faster = selfcheck.kernforge_is_faster("int4", self.shapes(), cases)
        except VLLMKernelFailed as failure:
            from vllm.logger import init_logger

            init_logger(__name__).warning_once(
                "kernforge int4 (%s): vLLM's %s failed on a copy of the layer (%s); the layer runs kernforge's",
                self.shapes(),
                vllm_class.__name__,
                failure.__cause__,
            )
            return None
        return None if faster else vllm_kernel

    def shapes(self) -> str:
        """The self-check's key: the mode, the activations' dtype and the weight's type and shape."""
        c = self.config
        k, n = c.partition_weight_shape
        dtype = str(c.act_type).removeprefix("torch.")
        return f"{'w4a8' if self.w4a8 else 'w4a16'} {dtype} {c.weight_type} N={n} K={k} G={_group_size(c)}"

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.vllm_kernel is not None:
            return self.vllm_kernel.apply_weights(layer, x, bias)
        fp32_bias = None if bias is None else layer.kernforge_bias
        op = ops.int4_scaled_mm_cpu if self.w4a8 else ops.int4_w4a16_linear
        return op(x, layer.kernforge_int4_weight, layer.kernforge_int4_zeros, layer.kernforge_int4_scales, fp32_bias)


def checkpoint_tensors(
    kernel: MPLinearKernel, layer: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """The layer's weight, zero points and scales as compressed-tensors' pack-quantized layout has
    them (what ``convert_weight_packed_scale_zp(..., PACK_QUANTIZED)`` takes): int32 ``[N, K/8]``
    packed along K, int32 ``[N/8, G]`` packed along N or None (symmetric: zero 8), ``[N, G]``.
    None where the layer holds a layout not listed in the module's docstring."""
    c = kernel.config
    k, n = c.partition_weight_shape
    groups = k // _group_size(c)
    weight, scales = getattr(layer, kernel.w_q_name, None), getattr(layer, kernel.w_s_name, None)
    zeros = getattr(layer, kernel.w_zp_name, None) if kernel.w_zp_name else None
    qweight = _packed_weight(weight, c, k, n)
    if qweight is None or scales is None:
        return None
    layout, scales = _dims(scales), scales.detach()
    if layout.get("output_dim") == 1:  # [G, N] (AWQ, GPTQ); compressed-tensors' are [N, G]
        scales = scales.t()
    if tuple(scales.shape) != (n, groups):
        return None
    qzeros = None
    if c.zero_points:
        dims = _dims(zeros) if zeros is not None else {}
        if zeros is None or dims.get("output_dim") != 0 or dims.get("packed_dim") != 0 or zeros.dtype != torch.int32:
            return None  # only compressed-tensors' [N/8, G] (vLLM rewrites AWQ's into it)
        if tuple(zeros.shape) != (n // PACK, groups):
            return None
        qzeros = zeros.detach().contiguous()
    return qweight, qzeros, scales.contiguous()


def _dims(param: torch.Tensor) -> dict:
    return {name: getattr(param, name) for name in LAYOUT_ATTRIBUTES if hasattr(param, name)}


def _packed_weight(weight: torch.Tensor | None, c: MPLinearLayerConfig, k: int, n: int) -> torch.Tensor | None:
    if weight is None:
        return None
    dims, data = _dims(weight), weight.detach()
    if c.weight_type == scalar_types.int4:  # compressed-tensors int-quantized: int8 [N, K] in [-8, 7]
        if data.dtype != torch.int8 or tuple(data.shape) != (n, k) or dims.get("input_dim") != 1:
            return None
        return pack_int4_words(data.to(torch.int32) + 8)
    if data.dtype != torch.int32 or dims.get("packed_factor", PACK) != PACK:
        return None
    if dims.get("input_dim") == dims.get("packed_dim") == 0 and tuple(data.shape) == (k // PACK, n):
        return data.t().contiguous()  # GPTQ's [K/8, N]: word [i, n] holds K 8i..8i+7 of column n
    if dims.get("input_dim") == dims.get("packed_dim") == 1 and tuple(data.shape) == (n, k // PACK):
        return data.contiguous()
    return None


def pack_int4_words(codes: torch.Tensor) -> torch.Tensor:
    """``codes [R, C]`` (0..15) -> int32 ``[R, C/8]``, element ``8c + j`` in nibble ``j`` of word ``c``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    rows, columns = codes.shape
    words = codes.to(torch.int32).view(rows, columns // PACK, PACK) << shifts
    return words.sum(-1, dtype=torch.int32)  # the nibbles do not overlap: the sum is their OR


def vllm_kernel_class(config: MPLinearLayerConfig) -> type[MPLinearKernel] | None:
    """The kernel vLLM's ``choose_mp_linear_kernel`` would pick for the layer without kernforge's."""
    for kernel in linear_kernels._POSSIBLE_KERNELS.get(PlatformEnum.CPU, []):
        if kernel is KernforgeInt4LinearKernel or kernel.__name__ in envs.VLLM_DISABLED_KERNELS:
            continue
        if kernel.can_implement(config)[0]:
            return kernel
    return None


def _stand_in(layer: torch.nn.Module, kernel: MPLinearKernel) -> torch.nn.Module:
    """A module with copies of ``layer``'s weight, scales, zero points and bias (and their vLLM
    layout attributes), for vLLM's kernel to prepare without touching the layer."""
    stand_in = torch.nn.Module()
    for name in dict.fromkeys(n for n in (kernel.w_q_name, kernel.w_s_name, kernel.w_zp_name, "bias") if n):
        param, copy = getattr(layer, name, None), None
        if param is not None:
            copy = torch.nn.Parameter(param.detach().clone(), requires_grad=False)
            for attribute, value in _dims(param).items():
                setattr(copy, attribute, value)
        setattr(stand_in, name, copy)
    return stand_in


class VLLMKernelFailed(RuntimeError):
    """vLLM's kernel failed to prepare the self-check's copy of a layer."""


def _int4_cases(
    ours: KernforgeInt4LinearKernel, vllm_kernel: MPLinearKernel, layer: torch.nn.Module, converted
) -> dict:
    """The int4 self-check: kernforge's op on the converted weight against ``vllm_kernel`` prepared
    on a stand-in layer (so the real one is left as it is), at one row and at a prefill chunk."""
    stand_in = _stand_in(layer, vllm_kernel)
    try:
        vllm_kernel.process_weights_after_loading(stand_in)
    except Exception as failure:  # vLLM's kernel cannot run here: nothing to compare with
        raise VLLMKernelFailed(type(vllm_kernel).__name__) from failure
    op = kernforge.int4_scaled_mm_cpu if ours.w4a8 else kernforge.int4_w4a16_linear
    k = ours.config.partition_weight_shape[0]
    cases = {}
    for rows in INT4_CHECK_ROWS:
        x = torch.randn(rows, k).to(ours.config.act_type)
        cases[f"M={rows}"] = (
            functools.partial(op, x, *converted, None),
            functools.partial(vllm_kernel.apply_weights, stand_in, x, None),
        )
    return cases


def register_int4_linear() -> bool:
    """Put :class:`KernforgeInt4LinearKernel` first in vLLM's CPU mixed-precision kernels (ahead of
    Dynamic4bit / CPUWNA16); False (nothing registered) when vLLM's kernel list is not the one this was
    written for."""
    int4_mode()  # a wrong KERNFORGE_VLLM_INT4 fails at startup, not at the first layer
    return register_first_cpu_kernel(KernforgeInt4LinearKernel, "_POSSIBLE_KERNELS", "mp")
