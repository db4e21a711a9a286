"""``kernforge.nn.Linear``: an ``nn.Linear`` whose weight is packed once for kernforge's GEMM.

* ``quant=None``: the weight is rounded to bf16 and packed with ``convert_weight_packed``; forward is
  ``weight_packed_linear`` (x in ``dtype``: bf16, fp16 or fp32; fp32 accumulation).
* ``quant="int8"``: w8a8. The weight is quantized per output channel, symmetric
  (``w_scale = amax / 127``, ``w_q = round(w / w_scale)``), and packed with
  ``convert_weight_packed_int8``; forward is ``int8_scaled_mm_with_quant`` (x quantized per token
  inside the kernel).
* ``quant="fp8_block"`` raises ``NotImplementedError``: ``fp8_scaled_mm`` exists but is not wired in here yet.

The packed tensors are buffers, so ``state_dict``/``load_state_dict`` and ``torch.save`` of the module
work; a state dict loads into ``Linear(in_features, out_features, bias, dtype=..., quant=...)`` built
with the same arguments (the extra state records in/out features, quant and the layout version, and a
mismatch raises ValueError). The buffers' dtypes are the kernels' layout: do not ``.to(dtype)`` the module
(forward then raises the packed weight's ValueError); build it with the ``dtype`` you want instead.
"""

from __future__ import annotations

import torch
from torch import nn

from kernforge.ops import gemm, gemm_int8
from kernforge.ops._registry import DTYPE_NAMES

QUANTS = (None, "int8", "fp8_block")


class Linear(nn.Module):
    """``y = x @ W.T + b`` on kernforge's prepacked GEMM; ``x [..., in_features]`` in ``dtype``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype = torch.bfloat16,
                 quant: str | None = None):
        super().__init__()
        _check_config(dtype, quant)
        if in_features < 1 or out_features < 1:
            raise ValueError(f"in_features and out_features must be positive, got {in_features}, {out_features}")
        self.in_features, self.out_features, self.dtype, self.quant = int(in_features), int(out_features), dtype, quant
        n, k = self.out_features, self.in_features
        if quant is None:
            self.register_buffer("weight_packed", torch.zeros(gemm.packed_shape(n, k), dtype=torch.bfloat16))
        else:
            self.register_buffer("weight_packed", torch.zeros(gemm_int8.packed_shape(n, k), dtype=torch.int8))
            self.register_buffer("weight_compensation", torch.zeros(n, dtype=torch.int32))
            self.register_buffer("weight_scale", torch.zeros(n, dtype=torch.float32))
        # int8_scaled_mm adds the bias in fp32; weight_packed_linear takes it in x's dtype
        bias_dtype = dtype if quant is None else torch.float32
        self.register_buffer("bias", torch.zeros(n, dtype=bias_dtype) if bias else None)

    @classmethod
    def from_linear(cls, layer: nn.Linear, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> "Linear":
        """Pack ``layer``'s weight (and keep its bias) for inputs of ``dtype``."""
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"layer must be a torch.nn.Linear, got {type(layer).__name__}")
        _check_config(dtype, quant)
        weight = layer.weight.detach()
        if not weight.is_cpu:
            raise ValueError(f"layer.weight is on device {weight.device}; kernforge kernels run on the CPU")
        if not weight.is_floating_point():
            raise TypeError(f"layer.weight has dtype {weight.dtype}; expected a floating dtype")
        module = cls(layer.in_features, layer.out_features, layer.bias is not None, dtype, quant)
        if quant is None:
            module.weight_packed.copy_(gemm.convert_weight_packed(weight.to(torch.bfloat16)).packed)
        else:
            packed = gemm_int8.convert_weight_packed_int8(*quantize_weight_int8(weight))
            module.weight_packed.copy_(packed.packed)
            module.weight_compensation.copy_(packed.compensation)
            module.weight_scale.copy_(packed.scale)
        if layer.bias is not None:
            module.bias.copy_(layer.bias.detach())
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.dtype is not self.dtype:
            raise TypeError(f"x has dtype {x.dtype} but this Linear was built for {self.dtype} "
                            "(Linear.from_linear(..., dtype=...))")
        if self.quant is None:
            packed = gemm.PackedWeight(self.weight_packed, self.out_features, self.in_features)
            return gemm.weight_packed_linear(x, packed, self.bias)
        packed = gemm_int8.PackedInt8Weight(self.weight_packed, self.weight_compensation, self.weight_scale,
                                            self.out_features, self.in_features)
        return gemm_int8.int8_scaled_mm_with_quant(x, packed, self.bias)

    def get_extra_state(self) -> dict:
        """What the buffers' shapes do not pin down (K and N pad to whole pairs/groups and panels)."""
        return {"in_features": self.in_features, "out_features": self.out_features, "quant": self.quant,
                "layout_version": _layout_version(self.quant)}

    def set_extra_state(self, state: dict) -> None:
        expected = self.get_extra_state()
        if state != expected:
            raise ValueError(f"state dict is for a kernforge Linear with {state}; this module is {expected}")

    def extra_repr(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={dtype}, quant={self.quant}")


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(w_q [N, K] int8, w_scale [N] fp32)`` with
    ``w_scale = amax / 127`` (an all-zero row gets a tiny scale instead of a division by zero)."""
    w = weight.float()
    scale = w.abs().amax(1).clamp_min(1e-10) / 127
    w_q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return w_q, scale


def replace_linears(model: nn.Module, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> int:
    """Swap every ``torch.nn.Linear`` in ``model``'s tree (in place) for a :class:`Linear`; returns how
    many were replaced. Skipped: subclasses of ``nn.Linear`` (``MultiheadAttention.out_proj`` reads its
    ``.weight`` directly), layers whose weight is not a floating CPU tensor, and empty layers."""
    _check_config(dtype, quant)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _replaceable(child):
                setattr(parent, name, Linear.from_linear(child, dtype=dtype, quant=quant))
                replaced += 1
    return replaced


def _replaceable(layer: nn.Module) -> bool:
    if type(layer) is not nn.Linear:
        return False
    weight = layer.weight
    return weight.is_cpu and weight.is_floating_point() and weight.numel() > 0


def _layout_version(quant: str | None) -> int:
    return gemm.LAYOUT_VERSION if quant is None else gemm_int8.LAYOUT_VERSION


def _check_config(dtype: object, quant: object) -> None:
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(map(repr, QUANTS))}, got {quant!r}")
    if quant == "fp8_block":
        raise NotImplementedError("quant='fp8_block' is not wired into kernforge.nn.Linear yet; pack the weight "
                                  "with convert_weight_packed_fp8 and call fp8_scaled_mm")
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
