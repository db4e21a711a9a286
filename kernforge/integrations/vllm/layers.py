"""kernforge's norm, activation, RoPE and linear kernels under vLLM's layers.

* RMSNorm (and its fused residual add), SiluAndMul and the rotary embeddings that share
  ``RotaryEmbedding``'s forward (Llama 3, linear, NTK and YaRN scaling...) through vLLM's
  out-of-tree custom-op registration (``CustomOp.register_oot``): subclasses whose
  ``forward_native`` (what vLLM runs under torch.compile, its CPU default) and ``forward_cpu`` (with
  custom ops on) call ``kernforge.torch_library``'s ops, which Dynamo traces as one graph node
  each. Arguments kernforge does not take (a variance size override, RoPE without a key) go to
  vLLM's own forward. vLLM's own ``RotaryEmbedding.forward_cpu`` (its C++ ``rotary_embedding``,
  what an eager engine runs) mis-rotates DeepSeek MLA's 3-D strided q_pe and strided k_pe
  (vLLM 0.32; its ``forward_native`` is right): kernforge's rotation matches ``forward_native`` and a
  float64 one there, so on an MLA model an eager stock engine, not this plugin, is the one off.
* Unquantized linear layers: vLLM prepacks them for oneDNN in
  ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, for which vLLM has no
  extension point. :func:`patch_linear_dispatch` replaces that function (checked against the
  signature it was written for) with one that packs bf16 weights for kernforge's
  ``weight_packed_linear`` where the plugin's self-check found it faster for that weight's shape
  (:mod:`kernforge.integrations.vllm.selfcheck`) and hands every other weight to vLLM's.
* int8 w8a8 linear layers (compressed-tensors and other int8 checkpoints vLLM loads): vLLM picks
  the first kernel of its CPU int8 list that can implement a layer. :func:`register_int8_linear`
  adds :class:`KernforgeInt8ScaledMMLinearKernel` through ``register_linear_kernel`` and moves it
  ahead of vLLM's oneDNN kernel (which takes every layer); it takes the layers whose activations
  are quantized per token, dynamically and symmetrically (what kernforge's
  ``int8_scaled_mm_with_quant`` does, as sgl-kernel's), and leaves static or asymmetric schemes to
  vLLM.
"""

from __future__ import annotations

import functools
import inspect

import torch
from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    Int8ScaledMMLinearKernel,
    Int8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers import utils as layer_utils
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.quantization.utils.w8a8_utils import convert_to_channelwise
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.platforms import PlatformEnum, current_platform

import kernforge
from kernforge import torch_library as ops
from kernforge.integrations.vllm import selfcheck

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KernforgeRMSNorm(RMSNorm):
    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.variance_size_override is not None or x.dtype not in KERNEL_DTYPES or x.dtype != self.weight.dtype:
            return super().forward_native(x, residual)
        rows = x.reshape(-1, x.shape[-1])
        if residual is None:
            return ops.rmsnorm(rows, self.weight.data, self.variance_epsilon).view(x.shape)
        # in place on both (views of x and residual, or copies of strided ones, returned either way)
        residual_rows = residual.reshape(-1, residual.shape[-1])
        ops.fused_add_rmsnorm(rows, residual_rows, self.weight.data, self.variance_epsilon)
        return rows.view(x.shape), residual_rows.view(residual.shape)

    forward_cpu = forward_native


class KernforgeSiluAndMul(SiluAndMul):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES:
            return SiluAndMul.forward_native(x)
        return ops.silu_and_mul(x)

    forward_cpu = forward_native


class KernforgeRotaryEmbedding:
    """Mixed into each RotaryEmbedding class whose forward is RotaryEmbedding's own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's cos/sin values (its cache is rounded to the model's dtype) in the fp32 kernforge
        # takes, converted once: a Llama 3 cache has 131072 rows (none without init_cache)
        cache = getattr(self, "cos_sin_cache", None)
        fp32 = None if cache is None else cache.to(self.dtype).float()
        self.register_buffer("kernforge_cos_sin_cache", fp32, persistent=False)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        unsupported = key is None or query.dtype != self.dtype or query.dtype not in KERNEL_DTYPES
        if unsupported or self.kernforge_cos_sin_cache is None:
            return RotaryEmbedding.forward_native(self, positions, query, key)
        return ops.apply_rope_with_cos_sin_cache(
            positions.flatten(), query, key, self.head_size, self.kernforge_cos_sin_cache, self.is_neox_style
        )

    forward_cpu = forward_native


def rotary_embedding_classes() -> list[type]:
    """RotaryEmbedding and its subclasses that differ from it only in their cos/sin cache."""
    found, pending = [], [RotaryEmbedding]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if all(getattr(cls, name) is getattr(RotaryEmbedding, name) for name in ("forward_native", "forward_cpu")):
            found.append(cls)
    return found


def register_custom_ops() -> list[str]:
    """Register the out-of-tree layers (once per process); the names of the replaced layers."""
    RMSNorm.register_oot(KernforgeRMSNorm)
    SiluAndMul.register_oot(KernforgeSiluAndMul)
    names = [RMSNorm.__name__, SiluAndMul.__name__]
    for cls in rotary_embedding_classes():
        mixed = type(f"Kernforge{cls.__name__}", (KernforgeRotaryEmbedding, cls), {})
        cls.register_oot(mixed, name=cls.__name__)
        names.append(cls.__name__)
    return names


# --------------------------------------------------------------------------- linear layers

DISPATCH_PARAMETERS = ["layer", "remove_weight"]  # vLLM 0.32's dispatch_cpu_unquantized_gemm


def patch_linear_dispatch() -> bool:
    """Replace vLLM's CPU linear dispatch with kernforge's for bf16 weights; False (nothing
    replaced) when vLLM's function is not the one this was written for."""
    original = getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or list(inspect.signature(original).parameters) != DISPATCH_PARAMETERS:
        return False
    if getattr(original, "kernforge_original", None) is not None:
        return True  # already patched in this process
    layer_utils.dispatch_cpu_unquantized_gemm = _kernforge_dispatch(original)
    return True


def _kernforge_dispatch(original):
    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2 or weight.dtype != torch.bfloat16:
            return original(layer, remove_weight)
        # packed only where kernforge's GEMM is measured or runs: a recorded verdict for vLLM's needs none
        pack = functools.cache(functools.partial(kernforge.convert_weight_packed, weight.detach()))
        n, k = weight.shape

        def cases() -> dict:
            return _linear_cases(original, weight.detach(), pack())

        if not selfcheck.kernforge_is_faster("linear", f"bf16 N={n} K={k}", cases):
            return original(layer, remove_weight)
        packed = pack()
        layer.kernforge_packed_weight = packed
        layer.cpu_linear = lambda x, weight, bias: ops.weight_packed_linear(x, packed, bias)
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)

    dispatch_cpu_unquantized_gemm.kernforge_original = original
    return dispatch_cpu_unquantized_gemm


LINEAR_CHECK_ROWS = (1, 128)  # a decode step's row, a prefill chunk's rows


def _linear_cases(original, weight: torch.Tensor, packed) -> dict:
    """The linear self-check: ``weight_packed_linear`` against the kernel vLLM's own dispatch picks
    for ``weight`` (prepared on a stand-in layer, so the real one is left as it is)."""
    stand_in = torch.nn.Module()
    stand_in.weight = torch.nn.Parameter(weight, requires_grad=False)
    original(stand_in, False)
    cases = {}
    for rows in LINEAR_CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        cases[f"M={rows}"] = (
            functools.partial(kernforge.weight_packed_linear, x, packed),
            functools.partial(stand_in.cpu_linear, x, weight, None),
        )
    return cases


class KernforgeInt8ScaledMMLinearKernel(Int8ScaledMMLinearKernel):
    """A w8a8 int8 linear layer on kernforge's ``int8_scaled_mm_with_quant``: the activation
    quantized per token inside the call, per-channel weight scales, an fp32 bias."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return (True, None) if current_platform.is_cpu() else (False, "requires CPU.")

    @classmethod
    def can_implement(cls, c: Int8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        if c.is_static_input_scheme:
            return False, "kernforge quantizes activations dynamically, per token."
        if not c.input_symmetric:
            return False, "kernforge quantizes activations symmetrically."
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight_name, scale_name = self.layer_param_names[:2]
        weight, scale = getattr(layer, weight_name), getattr(layer, scale_name)
        if not self.config.is_channelwise:  # a fused layer's per-tensor scales, one per part
            scale = convert_to_channelwise(scale, layer.logical_widths)
        layer.kernforge_packed_weight = kernforge.convert_weight_packed_int8(weight.detach(), scale.detach())
        bias = getattr(layer, "bias", None)
        layer.kernforge_bias = None if bias is None else bias.detach().float()
        # the packed copy is the one read from now on
        setattr(layer, weight_name, torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False))

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        fp32_bias = None if bias is None else layer.kernforge_bias
        return ops.int8_scaled_mm_with_quant(x, layer.kernforge_packed_weight, fp32_bias)

    def _get_layer_params(self, layer):
        return tuple(getattr(layer, name, None) for name in self.layer_param_names)


def register_int8_linear() -> bool:
    """Put :class:`KernforgeInt8ScaledMMLinearKernel` first in vLLM's CPU int8 kernels; False
    (nothing registered) when vLLM's kernel list is not the one this was written for."""
    return register_first_cpu_kernel(KernforgeInt8ScaledMMLinearKernel, "_POSSIBLE_INT8_KERNELS", "int8")


def register_first_cpu_kernel(kernel: type, kernel_list: str, kind: str) -> bool:
    """Register ``kernel`` with vLLM's ``register_linear_kernel(kernel, CPU, kind)`` and move it to the
    front of the CPU entry of ``linear_kernels.<kernel_list>`` (vLLM appends, and takes the first kernel
    that can implement a layer); False, nothing registered, where vLLM has no such list or function."""
    kernels = getattr(linear_kernels, kernel_list, None)
    register = getattr(linear_kernels, "register_linear_kernel", None)
    if not isinstance(kernels, dict) or register is None:
        return False
    cpu_kernels = kernels.setdefault(PlatformEnum.CPU, [])
    if kernel not in cpu_kernels:
        register(kernel, PlatformEnum.CPU, kind)
        cpu_kernels.insert(0, cpu_kernels.pop())
    return True
