"""``kernforge.nn.Linear``: an ``nn.Linear`` whose weight is packed once for kernforge's GEMM.

* ``quant=None``: the weight is rounded to bf16 and packed with ``convert_weight_packed``; forward is
  ``weight_packed_linear`` (x in ``dtype``: bf16, fp16 or fp32; fp32 accumulation).
* ``quant="int8"``: w8a8. The weight is quantized per output channel, symmetric
  (``w_scale = amax / 127``, ``w_q = round(w / w_scale)``), and packed with
  ``convert_weight_packed_int8``; forward is ``int8_scaled_mm_with_quant`` (x quantized per token
  inside the kernel).
* ``quant="fp8_block"``: DeepSeek-V3's fp8 weights. The weight is quantized to e4m3fn with one fp32 scale
  per 128 x 128 block (``scale = block amax / 448``, ``w_q = w / scale`` rounded to e4m3) and packed with
  ``convert_weight_packed_fp8``; forward is ``fp8_scaled_mm`` (x in ``dtype``, fp32 accumulation per
  K block, bias added in fp32).
* ``quant="int4"`` / ``"int4_w4a16"``: four-bit weights, one zero point and fp32 scale per group of
  ``int4.DEFAULT_GROUP`` (128) K elements (``quantize_int4``: round to nearest, asymmetric), packed once;
  forward is ``int4_scaled_mm_cpu`` (W4A8: x quantized per token to int8 inside the kernel) or
  ``int4_w4a16_linear`` (x as it is). :meth:`Linear.from_int4` takes a weight that is already four-bit
  (a checkpoint's, through ``convert_weight_packed_scale_zp``).

The packed tensors are buffers, so ``state_dict``/``load_state_dict`` and ``torch.save`` of the module
work; a state dict loads into ``Linear(in_features, out_features, bias, dtype=..., quant=...)`` built
with the same arguments (the extra state records in/out features, quant and the layout version, and a
mismatch raises ValueError). The buffers' dtypes are the kernels' layout: do not ``.to(dtype)`` the module
(forward then raises the packed weight's ValueError); build it with the ``dtype`` you want instead.
"""

from __future__ import annotations

import torch
from torch import nn

from kernforge import torch_library
from kernforge.nn.gguf import GGUFLinear
from kernforge.ops._common import BoundCall
from kernforge.ops._registry import DTYPE_NAMES
from kernforge.ops.gemm import bf16, fp8, int4, int8

QUANTS = (None, "int8", "fp8_block", *int4.QUANTS)
_QUANTIZE_ROWS = 8192  # rows quantized at once (an fp32 block of 8192 x 8192 is 256 MiB)
FP8_BLOCK = (128, 128)  # (N, K) block of one fp8 weight scale, DeepSeek-V3's
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class Linear(nn.Module):
    """``y = x @ W.T + b`` on kernforge's prepacked GEMM; ``x [..., in_features]`` in ``dtype``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        quant: str | None = None,
        group_size: int | None = None,
    ):
        """``group_size``: int4's K elements per scale (default ``int4.default_group_size(K)``); other
        quants take none."""
        super().__init__()
        if group_size is not None and quant not in int4.QUANTS:
            raise ValueError(f"group_size is for quant='int4' or 'int4_w4a16', not quant={quant!r}")
        _check_config(dtype, quant)
        if in_features < 1 or out_features < 1:
            raise ValueError(f"in_features and out_features must be positive, got {in_features}, {out_features}")
        self.in_features, self.out_features, self.dtype, self.quant = int(in_features), int(out_features), dtype, quant
        n, k = self.out_features, self.in_features
        if quant is None:
            self.register_buffer("weight_packed", torch.zeros(bf16.packed_shape(n, k), dtype=torch.bfloat16))
        elif quant == "int8":
            self.register_buffer("weight_packed", torch.zeros(int8.packed_shape(n, k), dtype=torch.int8))
            self.register_buffer("weight_compensation", torch.zeros(n, dtype=torch.int32))
            self.register_buffer("weight_scale", torch.zeros(n, dtype=torch.float32))
        elif quant == "fp8_block":
            self.register_buffer("weight_packed", torch.zeros(fp8.packed_shape(n, k), dtype=torch.float8_e4m3fn))
            self.register_buffer("weight_scale", torch.zeros(fp8.scale_shape(n, k, FP8_BLOCK)))
        else:
            self._register_int4(n, k, int4.checked_group_size(k, group_size, "in_features"))
        # the quantized GEMMs add the bias in fp32; weight_packed_linear takes it in x's dtype
        bias_dtype = dtype if quant is None else torch.float32
        self.register_buffer("bias", torch.zeros(n, dtype=bias_dtype) if bias else None)

    @classmethod
    def from_linear(cls, layer: nn.Linear, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> Linear:
        """Pack ``layer``'s weight (and keep its bias) for inputs of ``dtype``. ``layer`` may be an
        :class:`Int4LinearWeights` (a weight that is four-bit already): quant "int4"/"int4_w4a16" pack its
        codes as they are, the other quants take its dequantized weight; a :class:`~kernforge.nn.gguf.GGUFLinear`
        is returned as it is (its blocks run at the file's types)."""
        if isinstance(layer, GGUFLinear):  # a GGUF file's blocks run at their own type, packed already
            return layer
        if isinstance(layer, Int4LinearWeights):
            _check_config(dtype, quant)
            if quant in int4.QUANTS:
                return cls.from_int4(layer.int4(), layer.bias, dtype, quant)
            layer = layer.dequantized()
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"layer must be a torch.nn.Linear, got {type(layer).__name__}")
        _check_config(dtype, quant)
        weight = layer.weight.detach()
        if not weight.is_cpu:
            raise ValueError(f"layer.weight is on device {weight.device}; kernforge kernels run on the CPU")
        if not weight.is_floating_point():
            raise TypeError(f"layer.weight has dtype {weight.dtype}; expected a floating dtype")
        if quant in int4.QUANTS:
            packed = int4.quantize_int4(weight, group_size=None)
            return cls.from_int4(packed, layer.bias, dtype, quant)
        module = cls(layer.in_features, layer.out_features, layer.bias is not None, dtype, quant)
        if quant is None:
            module.weight_packed.copy_(bf16.convert_weight_packed(weight.to(torch.bfloat16)).packed)
        elif quant == "int8":
            packed = int8.convert_weight_packed_int8(*quantize_weight_int8(weight))
            module.weight_packed.copy_(packed.packed)
            module.weight_compensation.copy_(packed.compensation)
            module.weight_scale.copy_(packed.scale)
        else:
            packed = fp8.convert_weight_packed_fp8(*quantize_weight_fp8_block(weight), FP8_BLOCK)
            module.weight_packed.copy_(packed.packed)
            module.weight_scale.copy_(packed.weight_scale)
        if layer.bias is not None:
            module.bias.copy_(layer.bias.detach())
        return module

    @classmethod
    def from_int4(
        cls,
        packed: int4.PackedInt4Weight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        quant: str = "int4",
    ) -> Linear:
        """A Linear on an already four-bit weight (``quantize_int4``'s, or a checkpoint's through
        ``convert_weight_packed_scale_zp`` and ``PackedInt4Weight.from_tensors``); ``quant``: "int4"
        (W4A8) or "int4_w4a16"."""
        if quant not in int4.QUANTS:
            raise ValueError(f"quant must be one of {int4.QUANTS} for a four-bit weight, got {quant!r}")
        if not isinstance(packed, int4.PackedInt4Weight):
            raise TypeError(f"packed must be a PackedInt4Weight, got {type(packed).__name__}")
        module = cls(packed.k, packed.n, bias is not None, dtype, quant, packed.group_size)
        module.weight_packed.copy_(packed.packed)
        module.weight_zeros.copy_(packed.zeros)
        module.weight_scale.copy_(packed.scales)
        if bias is not None:
            module.bias.copy_(bias.detach())
        return module

    def _register_int4(self, n: int, k: int, group_size: int) -> None:
        self.group_size = group_size
        panels, quads = -(-n // int4.PANEL_WIDTH), k // int4.QUAD
        self.register_buffer("weight_packed", torch.zeros(panels, quads, int4.QUAD_BYTES, dtype=torch.uint8))
        self.register_buffer("weight_zeros", torch.zeros(k // group_size, n, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(k // group_size, n, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.dtype is not self.dtype:
            raise TypeError(
                f"x has dtype {x.dtype} but this Linear was built for {self.dtype} (Linear.from_linear(..., dtype=...))"
            )
        if self.quant is None:
            packed = bf16.PackedWeight(self.weight_packed, self.out_features, self.in_features)
            return torch_library.weight_packed_linear(x, packed, self.bias)  # a graph node under torch.compile
        if self.quant == "fp8_block":
            packed = fp8.PackedFp8Weight(
                self.weight_packed, self.weight_scale, FP8_BLOCK, self.out_features, self.in_features
            )
            return fp8.fp8_scaled_mm(x, packed, self.weight_scale, FP8_BLOCK, self.bias, out_dtype=self.dtype)
        if self.quant in int4.QUANTS:
            op = torch_library.int4_scaled_mm_cpu if self.quant == "int4" else torch_library.int4_w4a16_linear
            return op(x, self.weight_packed, self.weight_zeros, self.weight_scale, self.bias)
        packed = int8.PackedInt8Weight(
            self.weight_packed, self.weight_compensation, self.weight_scale, self.out_features, self.in_features
        )
        return torch_library.int8_scaled_mm_with_quant(x, packed, self.bias)

    def bound(self, x: torch.Tensor, out: torch.Tensor) -> BoundCall:
        """``out = self(x)`` checked once, as a call of no arguments (a prepared decode step's): the bf16
        GEMM bound (``bf16.bound_weight_packed_linear``); a quantized weight runs its forward into ``out``."""
        if self.quant is None:
            packed = bf16.PackedWeight(self.weight_packed, self.out_features, self.in_features)
            return bf16.bound_weight_packed_linear(x, packed, self.bias, out)
        forward = self.forward
        return BoundCall(lambda: out.copy_(forward(x)), x, out)

    def get_extra_state(self) -> dict:
        """What the buffers' shapes do not pin down (K and N pad to whole pairs/groups and panels)."""
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "quant": self.quant,
            "layout_version": _layout_version(self.quant),
            **({"group_size": self.group_size} if self.quant in int4.QUANTS else {}),
        }

    def set_extra_state(self, state: dict) -> None:
        expected = self.get_extra_state()
        if state != expected:
            raise ValueError(f"state dict is for a kernforge Linear with {state}; this module is {expected}")

    def extra_repr(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        group = f", group_size={self.group_size}" if self.quant in int4.QUANTS else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"dtype={dtype}, quant={self.quant}{group}"
        )


class Int4LinearWeights(nn.Module):
    """What stands where an ``nn.Linear`` would for a weight that is four-bit already (a checkpoint's,
    packed as it was stored until kernforge packs it): :meth:`Linear.from_linear` packs its codes as
    they are (no requantizing). ``in_features``, ``out_features`` and ``bias`` (a tensor or None) as
    ``nn.Linear``'s. This class holds a :class:`~kernforge.ops.gemm.int4.PackedInt4Weight`; subclasses
    (a checkpoint's formats) override :meth:`int4` and :meth:`codes`."""

    def __init__(
        self, packed: int4.PackedInt4Weight | None, bias: torch.Tensor | None, in_features: int, out_features: int
    ):
        super().__init__()
        self.in_features, self.out_features, self._packed = int(in_features), int(out_features), packed
        self.bias = None if bias is None else bias.detach()

    def int4(self) -> int4.PackedInt4Weight:
        """The weight, packed for the int4 ops."""
        return self._packed

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes uint8 [N, K], zeros uint8 [G, N], scales [G, N])``: the weight is ``(codes - zeros) * scales``."""
        return int4.unpack_int4(self.int4())

    def dequantized(self) -> nn.Linear:
        """An ``nn.Linear`` with the dequantized weight (fp32) and the bias."""
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        layer.weight = nn.Parameter(int4.dequantize_int4(self.int4()), requires_grad=False)
        if self.bias is not None:
            layer.bias = nn.Parameter(self.bias.float(), requires_grad=False)
        return layer

    @classmethod
    def concatenated(cls, layers) -> Int4LinearWeights:
        """One weight whose output is the layers' outputs side by side (q|k|v, gate|up): their codes,
        zeros and scales concatenated along N and packed (a fused layer's codes are unpacked here, one
        fused layer at a time)."""
        if not all(isinstance(layer, Int4LinearWeights) for layer in layers):
            kinds = ", ".join(type(layer).__name__ for layer in layers)
            raise ValueError(f"cannot fuse four-bit weights with other linears ({kinds}): all or none must be four-bit")
        k = layers[0].in_features
        if any(layer.in_features != k for layer in layers):
            raise ValueError(f"layers to fuse take {[layer.in_features for layer in layers]} inputs; they must agree")
        fused = torch.empty(sum(layer.out_features for layer in layers), k, dtype=torch.uint8)
        zeros, scales, row = [], [], 0
        for layer in layers:
            codes, z, s = layer.codes()
            if scales and s.shape[0] != scales[0].shape[0]:
                raise ValueError(
                    f"layers to fuse have {scales[0].shape[0]} and {s.shape[0]} groups along K: "
                    "fused weights share one group size"
                )
            fused[row : row + codes.shape[0]] = codes
            row += codes.shape[0]
            del codes
            zeros.append(z)
            scales.append(s.to(torch.float32))
        packed = int4.pack_int4(fused, torch.cat(zeros, dim=1), torch.cat(scales, dim=1))
        del fused
        bias = None
        if any(layer.bias is not None for layer in layers):  # zeros for a layer without one
            bias = torch.cat(
                [torch.zeros(layer.out_features) if layer.bias is None else layer.bias.float() for layer in layers]
            )
        return cls(packed, bias, packed.k, packed.n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(w_q [N, K] int8, w_scale [N] fp32)`` with
    ``w_scale = amax / 127`` (an all-zero row gets a tiny scale instead of a division by zero).
    Rows are taken a block at a time: an fp32 copy of a whole 150k-row lm_head would be 1.2 GB."""
    w_q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], _QUANTIZE_ROWS):
        rows = slice(start, start + _QUANTIZE_ROWS)
        w = weight[rows].to(torch.float32, copy=True)  # divided in place below
        scale[rows] = w.abs().amax(1).clamp_min(1e-10) / 127
        w_q[rows] = w.div_(scale[rows, None]).round_().clamp_(-127, 127)
    return w_q, scale


def quantize_weight_fp8_block(
    weight: torch.Tensor, block_size: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block quantization: ``(w_q [N, K] float8_e4m3fn, scale [ceil(N / bn), ceil(K / bk)] fp32)``
    with ``scale = block amax / 448`` and ``w_q = w / scale`` (round to nearest; an all-zero block gets a
    tiny scale instead of a division by zero). Partial blocks at the edges take their own amax."""
    bn, bk = block_size
    n, k = weight.shape
    blocks_n, blocks_k = -(-n // bn), -(-k // bk)
    padded = weight.float().new_zeros(blocks_n * bn, blocks_k * bk)
    padded[:n, :k] = weight
    blocks = padded.view(blocks_n, bn, blocks_k, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-10) / E4M3_MAX
    w_q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view_as(padded)[:n, :k]
    return w_q.to(torch.float8_e4m3fn), scale


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
    if quant in int4.QUANTS:
        return int4.LAYOUT_VERSION
    return {None: bf16.LAYOUT_VERSION, "int8": int8.LAYOUT_VERSION, "fp8_block": fp8.LAYOUT_VERSION}[quant]


def _check_config(dtype: object, quant: object) -> None:
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(map(repr, QUANTS))}, got {quant!r}")
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
