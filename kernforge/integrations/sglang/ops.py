"""``torch.ops.sgl_kernel.*`` on kernforge's ops, with SGLang 0.5.23's schemas (the ops its CPU layers
call; the table is ``docs/notes/2026-11-29-issue-42-sglang-inventory.md``).

Importing this module defines the ``sgl_kernel`` namespace (``torch.library.Library("sgl_kernel", "DEF")``)
unless ``KERNFORGE_SGLANG=0`` or another library (a real CPU build of sgl-kernel) defined it first; then
it registers nothing and says so in :data:`REGISTERED` (empty) and :data:`SKIPPED`. Each op is an adapter:
its CPU implementation converts SGLang's calling convention to kernforge's public op and calls it; its Meta
implementation gives the output's shape for ``torch.compile``.

Packed weights. SGLang keeps what ``convert_weight_packed(weight)`` returns as ``layer.weight`` (wrapped in
an ``nn.Parameter``, which shares the tensor's storage) and passes it back to ``weight_packed_linear(x,
layer.weight, bias, True)``. kernforge's packer returns a :class:`kernforge.ops.gemm.bf16.PackedWeight`
(the packed tensor, ``[panels, ceil(K / 2), 32, 2]``, plus N and K). The adapter returns that packed
tensor's storage viewed as the weight's own shape: ``packed.as_strided((N, K), (K, 1))`` (the packed
buffer holds at least N * K elements: N is padded to whole panels, K to pairs). So the tensor SGLang
keeps says N and K in its shape, its storage is kernforge's packed buffer (no second copy, no side
table, nothing keyed by address that a freed weight could leave stale), and ``weight_packed_linear``
rebuilds the ``PackedWeight`` from it: the storage viewed at the packed shape (``as_strided`` refuses a
storage too small for it, e.g. a copy of the [N, K] view, with the ValueError below). As with
sgl-kernel, ``is_vnni=True`` is the caller's word that the tensor came from ``convert_weight_packed``;
``is_vnni=False`` packs ``mat2`` for the call. An int8 weight (w8a8) is packed the same way, its buffer the
packed weight followed by its int32 compensation (kernforge's kernel needs it; SGLang passes the scales
itself on every call), viewed as ``[N, K]`` int8; an e4m3fn weight (block fp8) is its packed buffer viewed
as ``[N, K]``; a stacked bf16 MoE weight ``[E, N, K]`` is kernforge's packed experts viewed as ``[E, N, K]``
(see the MoE section for how ``fused_experts_cpu`` reads w13 as gated).

Not adapted yet (NotImplementedError naming it): fp16 weights, quantized MoE experts (``moe_comp_method`` other
than UNQUANT, int8/fp8 shared experts), ``topk_*_cpu`` with ``correction_bias``, expert biases and gpt-oss's
clamped SwiGLU. Ops this module does not define at all (MLA, fused_linear_sigmoid_mul, the GDN / Mamba ops,
...) are listed in the inventory, ``docs/notes/2026-11-29-issue-42-sglang-inventory.md``.

Python-level names SGLang imports from ``sgl_kernel`` (:data:`PYTHON_NAMES`): ``assign_req_to_token_pool_cpu``
for real (bookkeeping, not a kernel); the others raise ``NotImplementedError`` naming the missing op when
called (SGLang imports them at module level; they run only for KV moves and speculative decoding).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import torch

import kernforge
from kernforge.integrations import sglang as _integration
from kernforge.ops.gemm import bf16 as _bf16
from kernforge.ops.gemm import fp8 as _fp8
from kernforge.ops.gemm import int8 as _int8
from kernforge.ops.moe import experts as _moe

NAMESPACE = "sgl_kernel"
REGISTERED: list[str] = []  # the ops this module defined
SKIPPED: list[str] = []  # why nothing was registered, if so
_LIB: torch.library.Library | None = None


# --------------------------------------------------------------------------- packed bf16 weights


def _packed_view(packed: _bf16.PackedWeight) -> torch.Tensor:
    """The packed buffer as the [N, K] tensor SGLang keeps (same storage)."""
    return packed.packed.as_strided((packed.n, packed.k), (packed.k, 1), 0)


def _rebuilt(mat2: torch.Tensor) -> _bf16.PackedWeight:
    """The PackedWeight whose buffer is ``mat2``'s storage (``mat2`` from :func:`convert_weight_packed`)."""
    if not isinstance(mat2, torch.Tensor):
        raise TypeError(f"mat2 must be a torch.Tensor, got {type(mat2).__name__}")
    if mat2.dtype is not torch.bfloat16:
        raise TypeError(f"mat2 has dtype {mat2.dtype}; kernforge's packed weights are torch.bfloat16")
    if mat2.dim() != 2 or mat2.stride() != (mat2.shape[1], 1) or mat2.storage_offset() != 0:
        raise ValueError(
            "mat2 (is_vnni=True) must be the [N, K] tensor sgl_kernel.convert_weight_packed returned, got shape "
            f"{tuple(mat2.shape)}, strides {tuple(mat2.stride())}, storage offset {mat2.storage_offset()}"
        )
    n, k = int(mat2.shape[0]), int(mat2.shape[1])
    shape = _bf16.packed_shape(n, k)
    try:
        packed = mat2.as_strided(shape, _contiguous_strides(shape), 0)
    except RuntimeError:
        raise ValueError(
            f"mat2's storage ({mat2.untyped_storage().nbytes()} bytes) is smaller than a packed [{n}, {k}] "
            "weight: pass the tensor sgl_kernel.convert_weight_packed returned (not a copy), or is_vnni=False"
        ) from None
    return _bf16.PackedWeight(packed, n, k)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# --------------------------------------------------------------------------- packed int8 weights
#
# kernforge's PackedInt8Weight is the packed tensor ([panels, ceil(K / 4), 64, 4] int8) plus the
# compensation (int32 [N], 128 * the row sums, which the kernel needs) and the scales; SGLang keeps the
# scales itself (layer.weight_scale, passed to every call). So the tensor SGLang keeps is one int8 buffer,
# the packed weight followed by the compensation, viewed as [N, K]: still one copy of the weight.


def _int8_storage_bytes(n: int, k: int) -> tuple[int, int]:
    """(the packed weight's bytes, the whole buffer's: the weight then the int32 compensation)."""
    packed = math.prod(_int8.packed_shape(n, k))  # a multiple of 4 (64 columns per panel)
    return packed, packed + 4 * n


def _convert_int8(weight: torch.Tensor) -> torch.Tensor:
    n, k = int(weight.shape[0]), int(weight.shape[1])
    packed = kernforge.convert_weight_packed_int8(weight, torch.ones(n, dtype=torch.float32))
    weight_bytes, total = _int8_storage_bytes(n, k)
    buffer = torch.empty(total, dtype=torch.int8)
    buffer[:weight_bytes].copy_(packed.packed.view(-1))
    buffer[weight_bytes:].view(torch.int32).copy_(packed.compensation)
    return buffer.as_strided((n, k), (k, 1), 0)


def _rebuilt_int8(mat2: torch.Tensor, scales2: torch.Tensor) -> _int8.PackedInt8Weight:
    n, k = _packed_2d(mat2, torch.int8)
    weight_bytes, total = _int8_storage_bytes(n, k)
    if mat2.untyped_storage().nbytes() < total:
        raise ValueError(
            f"mat2's storage ({mat2.untyped_storage().nbytes()} bytes) is smaller than a packed [{n}, {k}] int8 "
            "weight: pass the tensor sgl_kernel.convert_weight_packed returned (not a copy), or is_vnni=False"
        )
    shape = _int8.packed_shape(n, k)
    packed = mat2.as_strided(shape, _contiguous_strides(shape), 0)
    compensation = torch.empty(0, dtype=torch.int32).set_(mat2.untyped_storage(), weight_bytes // 4, (n,), (1,))
    return _int8.PackedInt8Weight(packed, compensation, _channel_scales(scales2, n), n, k)


def _channel_scales(scales2: torch.Tensor, n: int) -> torch.Tensor:
    if not isinstance(scales2, torch.Tensor):
        raise TypeError(f"scales2 must be a torch.Tensor, got {type(scales2).__name__}")
    if scales2.numel() != n:
        raise ValueError(f"scales2 must hold one scale per output channel ({n}), got shape {tuple(scales2.shape)}")
    return scales2.reshape(n).to(torch.float32).contiguous()  # SGLang's [N, 1] fp32: a view, no copy


def _packed_2d(mat2: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    if not isinstance(mat2, torch.Tensor):
        raise TypeError(f"mat2 must be a torch.Tensor, got {type(mat2).__name__}")
    if mat2.dtype is not dtype:
        raise TypeError(f"mat2 has dtype {mat2.dtype}; expected {dtype}")
    if mat2.dim() != 2 or mat2.stride() != (mat2.shape[1], 1) or mat2.storage_offset() != 0:
        raise ValueError(
            "mat2 (is_vnni=True) must be the [N, K] tensor sgl_kernel.convert_weight_packed returned, got shape "
            f"{tuple(mat2.shape)}, strides {tuple(mat2.stride())}, storage offset {mat2.storage_offset()}"
        )
    return int(mat2.shape[0]), int(mat2.shape[1])


def int8_scaled_mm_with_quant(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scales2: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    is_vnni: bool = True,
) -> torch.Tensor:
    if is_vnni:
        packed = _rebuilt_int8(mat2, scales2)
    else:
        packed = kernforge.convert_weight_packed_int8(mat2, scales2)
    return kernforge.int8_scaled_mm_with_quant(mat1, packed, bias, out_dtype)


def _int8_mm_fake(mat1: torch.Tensor, mat2: torch.Tensor, *args: Any) -> Any:
    return mat1.new_empty((*mat1.shape[:-1], mat2.shape[0]))


# --------------------------------------------------------------------------- packed fp8 weights
#
# kernforge's PackedFp8Weight is the packed tensor ([panels, K, 32] e4m3fn) plus the block scales, which
# fp8_scaled_mm takes again on every call (SGLang passes layer.weight_scale_inv): the tensor SGLang keeps
# is the packed buffer viewed as [N, K] e4m3fn, and the scales stored with the dataclass are not read.


def _convert_fp8(weight: torch.Tensor) -> torch.Tensor:
    n, k = int(weight.shape[0]), int(weight.shape[1])
    block = (128, 128)  # any: the call's block_size and scales are the ones used
    ones = torch.ones(_fp8.scale_shape(n, k, block), dtype=torch.float32)
    packed = kernforge.convert_weight_packed_fp8(weight, ones, block)
    return packed.packed.as_strided((n, k), (k, 1), 0)


def fp8_scaled_mm_cpu(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scales2: torch.Tensor,
    block_size: list[int],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    is_vnni: bool = True,
) -> torch.Tensor:
    block = _fp8.checked_block_size(block_size)
    if is_vnni:
        n, k = _packed_2d(mat2, torch.float8_e4m3fn)
        shape = _fp8.packed_shape(n, k)
        try:
            buffer = mat2.as_strided(shape, _contiguous_strides(shape), 0)
        except RuntimeError:
            raise ValueError(
                f"mat2's storage ({mat2.untyped_storage().nbytes()} bytes) is smaller than a packed [{n}, {k}] "
                "fp8 weight: pass the tensor sgl_kernel.convert_weight_packed returned (not a copy), or is_vnni=False"
            ) from None
        packed = _fp8.PackedFp8Weight(buffer, scales2, block, n, k)
    else:
        packed = kernforge.convert_weight_packed_fp8(mat2, scales2, block)
    return kernforge.fp8_scaled_mm(mat1, packed, scales2, block, bias, out_dtype)


# --------------------------------------------------------------------------- MoE experts (bf16)
#
# SGLang packs w13 [E, 2I, H] and w2 [E, H, I] with the same convert_weight_packed, so the packer cannot
# know which is gated. kernforge packs a gated w1 as two parts (gate rows, up rows), each to whole panels of
# 32 rows; an ungated packing of [E, 2I, H] is byte for byte that layout when I is a multiple of 32 (every
# Llama-family MoE: Qwen2/3-MoE 768 or 1408, DeepSeek-V2 1408, Mixtral 14336). So a 3-D weight is packed
# ungated and read as gated by fused_experts_cpu; an I that is not a multiple of 32 is refused there. A 2-D
# packed weight (a shared expert's gate_up_proj / down_proj, packed as linears) is the same layout with one
# expert.


def _convert_experts(weight: torch.Tensor) -> torch.Tensor:
    packed = _moe.pack_experts(weight)
    return packed.packed.as_strided(tuple(weight.shape), _contiguous_strides(tuple(weight.shape)), 0)


def _packed_experts(w: torch.Tensor, name: str, gated: bool) -> _moe.PackedExperts:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype is not torch.bfloat16:
        raise TypeError(f"{name} has dtype {w.dtype}; kernforge's packed experts here are torch.bfloat16")
    shape = tuple(int(d) for d in w.shape)
    if w.dim() not in (2, 3) or w.stride() != _contiguous_strides(shape) or w.storage_offset() != 0:
        raise ValueError(
            f"{name} (is_vnni=True) must be the tensor sgl_kernel.convert_weight_packed returned, got shape {shape}, "
            f"strides {tuple(w.stride())}, storage offset {w.storage_offset()}"
        )
    experts, n, k = (1, *shape) if len(shape) == 2 else shape
    parts = 2 if gated else 1
    if gated and (n % 2 or (n // 2) % _moe.PANEL_WIDTH):
        raise NotImplementedError(
            f"sgl_kernel: a packed gated {name} [E, 2I, H] needs I to be a multiple of {_moe.PANEL_WIDTH} "
            f"in kernforge's layout, got 2I = {n}"
        )
    packed_shape = _moe.packed_experts_shape(experts, n, k, parts)
    try:
        buffer = w.as_strided(packed_shape, _contiguous_strides(packed_shape), 0)
    except RuntimeError:
        raise ValueError(
            f"{name}'s storage is smaller than packed [{experts}, {n}, {k}] experts: pass the tensor "
            "sgl_kernel.convert_weight_packed returned (not a copy), or is_vnni=False"
        ) from None
    return _moe.PackedExperts(buffer, experts, n, k, parts)


def _unquantized_only(op: str, **options: Any) -> None:
    given = [name for name, value in options.items() if value is not None and value is not False]
    if given:
        raise NotImplementedError(
            f"sgl_kernel.{op}: kernforge's adapter takes unquantized bf16 experts here; got {given}"
        )


def fused_experts_cpu(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    inplace: bool,
    moe_comp_method: int,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w1_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
    block_size: list[int] | None = None,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    alpha: float | None = None,
    limit: float | None = None,
    is_vnni: bool = True,
    activation: str | None = None,
) -> torch.Tensor:
    if activation not in (None, "silu"):
        raise NotImplementedError(
            f"sgl_kernel.fused_experts_cpu: kernforge's experts are SiLU-gated, got {activation!r}"
        )
    if moe_comp_method != 0:  # CPUQuantMethod.UNQUANT
        raise NotImplementedError(
            f"sgl_kernel.fused_experts_cpu: moe_comp_method {moe_comp_method} (quantized experts) is not adapted yet"
        )
    _unquantized_only(
        "fused_experts_cpu", w1_bias=w1_bias, w2_bias=w2_bias, alpha=alpha, limit=limit, w1_scale=w1_scale,
        w2_scale=w2_scale, w1_zero=w1_zero, w2_zero=w2_zero,
    )  # fmt: skip
    if is_vnni:
        packed1: Any = _packed_experts(w1, "w1", gated=True)
        packed2: Any = _packed_experts(w2, "w2", gated=False)
    else:
        packed1, packed2 = w1, w2
    return kernforge.fused_experts(hidden_states, packed1, packed2, topk_weights, topk_ids, inplace)


def shared_expert_cpu(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    fused_experts_out: torch.Tensor | None,
    routed_scaling_factor: float | None,
    inplace: bool,
    use_int8_w8a8: bool,
    use_fp8_w8a16: bool,
    w1_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block_size: list[int] | None,
    is_vnni: bool = True,
) -> torch.Tensor:
    _unquantized_only("shared_expert_cpu", use_int8_w8a8=use_int8_w8a8, use_fp8_w8a16=use_fp8_w8a16)
    if is_vnni:
        packed1: Any = _packed_experts(w1, "w1", gated=True)
        packed2: Any = _packed_experts(w2, "w2", gated=False)
    else:
        packed1, packed2 = w1, w2
    return kernforge.shared_expert(hidden_states, packed1, packed2, fused_experts_out, routed_scaling_factor, inplace)


# --------------------------------------------------------------------------- int4 (AWQ, GPTQ): kernforge's own
# ops take sgl-kernel's tensors as they are (convert_weight_packed_scale_zp returns three tensors)


def convert_weight_packed_scale_zp(
    weight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, quant_method_4bit: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernforge.convert_weight_packed_scale_zp(weight, qzeros, scales, quant_method_4bit)


def int4_scaled_mm_cpu(
    x: torch.Tensor, w: torch.Tensor, w_zeros: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return kernforge.int4_scaled_mm_cpu(x, w, w_zeros, w_scales, bias)


def _int4_mm_fake(x: torch.Tensor, w: torch.Tensor, w_zeros: torch.Tensor, w_scales: torch.Tensor, *args: Any) -> Any:
    return x.new_empty((*x.shape[:-1], w_scales.shape[-1]))


def _scale_zp_fake(weight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, method: int) -> Any:
    raise NotImplementedError("sgl_kernel.convert_weight_packed_scale_zp runs at load time, not under torch.compile")


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype is torch.int8 and weight.dim() == 2:
        return _convert_int8(weight)
    if weight.dtype is torch.float8_e4m3fn and weight.dim() == 2:
        return _convert_fp8(weight)
    if weight.dtype is torch.bfloat16 and weight.dim() == 3:
        return _convert_experts(weight)
    if weight.dtype is not torch.bfloat16:
        # fp16: kernforge packs no fp16 weight (SGLang's CPU default is bf16)
        raise NotImplementedError(
            "sgl_kernel.convert_weight_packed: kernforge packs bf16, int8 and float8_e4m3fn [N, K] weights here, "
            f"got {weight.dtype}"
        )
    if weight.dim() != 2:
        raise NotImplementedError(
            "sgl_kernel.convert_weight_packed: kernforge packs 2-D [N, K] weights here (MoE [E, N, K] "
            f"weights: not yet), got shape {tuple(weight.shape)}"
        )
    return _packed_view(kernforge.convert_weight_packed(weight))


def weight_packed_linear(
    mat1: torch.Tensor, mat2: torch.Tensor, bias: torch.Tensor | None, is_vnni: bool = True
) -> torch.Tensor:
    packed = _rebuilt(mat2) if is_vnni else kernforge.convert_weight_packed(mat2)
    if bias is not None and isinstance(mat1, torch.Tensor) and bias.dtype != mat1.dtype:
        # SGLang keeps a packed layer's bias in fp32; kernforge's GEMM adds it in x's dtype
        bias = bias.to(mat1.dtype)
    return kernforge.weight_packed_linear(mat1, packed, bias)


def _linear_fake(mat1: torch.Tensor, mat2: torch.Tensor, bias: torch.Tensor | None, is_vnni: bool = True) -> Any:
    return mat1.new_empty((*mat1.shape[:-1], mat2.shape[0]))


# --------------------------------------------------------------------------- norms, activations, RoPE


def _in_place_norm(op: Callable[..., None]) -> Callable[..., None]:
    def impl(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        op(input, residual, weight, eps)

    return impl


# id(cache) -> (a weak reference to it, its version when converted, the fp32 copy)
_FP32_CACHES: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}


def _fp32_cos_sin_cache(cache: torch.Tensor) -> torch.Tensor:
    """kernforge's RoPE takes an fp32 cache; SGLang casts its cache to the query's dtype once (and keeps it).
    The fp32 copy is made once per cache tensor (again if it is written), not per call: a Llama 3 cache has
    131072 rows. Entries are for live tensors only (checked through a weak reference), the newest few."""
    if not isinstance(cache, torch.Tensor) or cache.dtype is torch.float32:
        return cache
    found = _FP32_CACHES.get(id(cache))
    if found is not None and found[0]() is cache and found[1] == cache._version:
        return found[2]
    if len(_FP32_CACHES) >= 8:  # a model has one or two caches
        _FP32_CACHES.pop(next(iter(_FP32_CACHES)))
    fp32 = cache.float()
    _FP32_CACHES[id(cache)] = (weakref.ref(cache), cache._version, fp32)
    return fp32


def rotary_embedding_cpu(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = kernforge.apply_rope_with_cos_sin_cache(
        positions.flatten() if isinstance(positions, torch.Tensor) else positions,
        query,
        key,
        head_size,
        _fp32_cos_sin_cache(cos_sin_cache),
        is_neox,
    )
    return q, k


def _rope_fake(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, *args: Any) -> Any:
    return torch.empty_like(query), torch.empty_like(key)


# --------------------------------------------------------------------------- MoE routing


def _no_correction_bias(correction_bias: torch.Tensor | None, op: str) -> None:
    if correction_bias is not None:
        raise NotImplementedError(
            f"sgl_kernel.{op}: kernforge's routing has no correction_bias here (biased_grouped_topk_cpu has one)"
        )


def topk_softmax_cpu(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _no_correction_bias(correction_bias, "topk_softmax_cpu")
    return kernforge.topk_softmax(hidden_states, gating_output, topk, renormalize)


def topk_sigmoid_cpu(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _no_correction_bias(correction_bias, "topk_sigmoid_cpu")
    return kernforge.topk_sigmoid(hidden_states, gating_output, topk, renormalize)


def _no_padding(num_token_non_padded: torch.Tensor | None, op: str) -> None:
    if num_token_non_padded is not None:
        raise NotImplementedError(f"sgl_kernel.{op}: num_token_non_padded is not supported (nor by sgl-kernel)")


def grouped_topk_cpu(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    num_fused_shared_experts: int,
    routed_scaling_factor: float | None,
    num_token_non_padded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _no_padding(num_token_non_padded, "grouped_topk_cpu")
    return kernforge.grouped_topk(
        hidden_states,
        gating_output,
        topk,
        renormalize,
        num_expert_group,
        topk_group,
        num_fused_shared_experts,
        routed_scaling_factor,
    )


def biased_grouped_topk_cpu(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    num_fused_shared_experts: int,
    routed_scaling_factor: float | None,
    num_token_non_padded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _no_padding(num_token_non_padded, "biased_grouped_topk_cpu")
    return kernforge.biased_grouped_topk(
        hidden_states,
        gating_output,
        correction_bias,
        topk,
        renormalize,
        num_expert_group,
        topk_group,
        num_fused_shared_experts,
        routed_scaling_factor,
    )


def _routing_fake(hidden_states: torch.Tensor, gating_output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    topk = args[1] if isinstance(args[0], torch.Tensor) else args[0]  # biased: correction_bias first
    tokens = gating_output.shape[0]
    return (
        gating_output.new_empty((tokens, topk), dtype=torch.float32),
        gating_output.new_empty((tokens, topk), dtype=torch.int32),
    )


# --------------------------------------------------------------------------- threads and collectives


def init_cpu_threads_env(cpu_ids: str) -> str:
    from kernforge.distributed import init_cpu_threads_env as bind

    return bind(cpu_ids)


def initialize(size: int, rank: int) -> None:
    """sgl-kernel sets up its shared memory here, from MASTER_ADDR/MASTER_PORT, and SGLang calls it before
    ``torch.distributed.init_process_group``; kernforge's communicator rides on the process group, so it is
    made now if the group exists, else by the first collective (``kernforge.distributed`` makes one per group)."""
    import torch.distributed as dist

    from kernforge.distributed import initialize as start

    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= rank < size:
        raise ValueError(f"sgl_kernel.initialize: rank {rank!r} is not in a world of size {size!r}")
    if dist.is_initialized():
        start(size, rank)


REDUCE_OP_SUM = 0  # int(torch.distributed.ReduceOp.SUM), what SGLang passes


def shm_allreduce(data: torch.Tensor, reduce_op: int) -> None:
    import torch.distributed as dist

    from kernforge.distributed import shm_allreduce as all_reduce

    if int(reduce_op) != REDUCE_OP_SUM:
        raise ValueError(f"sgl_kernel.shm_allreduce: only ReduceOp.SUM is supported, got reduce_op={reduce_op}")
    all_reduce(data, dist.ReduceOp.SUM)


def shm_allgather(data: torch.Tensor, dim: int) -> torch.Tensor:
    from kernforge.distributed import shm_allgather as all_gather

    return all_gather(data, dim)


def _allgather_fake(data: torch.Tensor, dim: int) -> Any:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    shape = list(data.shape)
    shape[dim] *= world
    return data.new_empty(shape)


# --------------------------------------------------------------------------- the registrations


def _like(input: torch.Tensor, *args: Any) -> Any:
    return torch.empty_like(input)


def _half_width(input: torch.Tensor) -> Any:
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


_NORM = "(Tensor input, Tensor weight, float eps) -> Tensor"
_FUSED_NORM = "(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()"
_ROUTING = "int topk, bool renormalize"
_GROUPED = (
    f"{_ROUTING}, int num_expert_group, int topk_group, int num_fused_shared_experts, "
    "float? routed_scaling_factor, Tensor? num_token_non_padded=None) -> (Tensor, Tensor)"
)

# name -> (schema after the name, CPU implementation, Meta implementation), SGLang 0.5.23's schemas
OPS: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
    "convert_weight_packed": ("(Tensor weight) -> Tensor", convert_weight_packed, _like),
    "weight_packed_linear": (
        "(Tensor mat1, Tensor mat2, Tensor? bias, bool is_vnni=True) -> Tensor",
        weight_packed_linear,
        _linear_fake,
    ),
    "int8_scaled_mm_with_quant": (
        "(Tensor mat1, Tensor mat2, Tensor scales2, Tensor? bias, ScalarType out_dtype, bool is_vnni=True) -> Tensor",
        int8_scaled_mm_with_quant,
        _int8_mm_fake,
    ),
    "fp8_scaled_mm_cpu": (
        "(Tensor mat1, Tensor mat2, Tensor scales2, int[] block_size, Tensor? bias, ScalarType out_dtype, "
        "bool is_vnni=True) -> Tensor",
        fp8_scaled_mm_cpu,
        _int8_mm_fake,
    ),
    "convert_weight_packed_scale_zp": (
        "(Tensor weight, Tensor qzeros, Tensor scales, int quant_method_4bit) -> (Tensor, Tensor, Tensor)",
        convert_weight_packed_scale_zp,
        _scale_zp_fake,
    ),
    "int4_scaled_mm_cpu": (
        "(Tensor x, Tensor w, Tensor w_zeros, Tensor w_scales, Tensor? bias) -> Tensor",
        int4_scaled_mm_cpu,
        _int4_mm_fake,
    ),
    "fused_experts_cpu": (
        "(Tensor(a!) hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, bool inplace, "
        "int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, Tensor? w1_zero, Tensor? w2_zero, "
        "int[]? block_size, Tensor? w1_bias, Tensor? w2_bias, float? alpha, float? limit, bool is_vnni=True, "
        "str? activation=None) -> Tensor",
        fused_experts_cpu,
        _like,
    ),
    "shared_expert_cpu": (
        "(Tensor(a!) hidden_states, Tensor w1, Tensor w2, Tensor? fused_experts_out, float? routed_scaling_factor, "
        "bool inplace, bool use_int8_w8a8, bool use_fp8_w8a16, Tensor? w1_scale, Tensor? w2_scale, "
        "int[]? block_size, bool is_vnni=True) -> Tensor",
        shared_expert_cpu,
        _like,
    ),
    "rmsnorm_cpu": (_NORM, kernforge.rmsnorm, _like),
    "fused_add_rmsnorm_cpu": (_FUSED_NORM, _in_place_norm(kernforge.fused_add_rmsnorm), _nothing),
    "gemma_rmsnorm_cpu": (_NORM, kernforge.gemma_rmsnorm, _like),
    "gemma_fused_add_rmsnorm_cpu": (_FUSED_NORM, _in_place_norm(kernforge.gemma_fused_add_rmsnorm), _nothing),
    # Gemma 3's RMSNorm is Gemma's: x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32, rounded once
    "gemma3_rmsnorm_cpu": (_NORM, kernforge.gemma_rmsnorm, _like),
    "silu_and_mul_cpu": ("(Tensor input) -> Tensor", kernforge.silu_and_mul, _half_width),
    "gelu_and_mul_cpu": ("(Tensor input) -> Tensor", kernforge.gelu_and_mul, _half_width),
    "gelu_tanh_and_mul_cpu": ("(Tensor input) -> Tensor", kernforge.gelu_tanh_and_mul, _half_width),
    "rotary_embedding_cpu": (
        "(Tensor positions, Tensor query, Tensor key, int head_size, Tensor cos_sin_cache, bool is_neox) "
        "-> (Tensor, Tensor)",
        rotary_embedding_cpu,
        _rope_fake,
    ),
    "topk_softmax_cpu": (
        f"(Tensor hidden_states, Tensor gating_output, {_ROUTING}, Tensor? correction_bias=None) -> (Tensor, Tensor)",
        topk_softmax_cpu,
        _routing_fake,
    ),
    "topk_sigmoid_cpu": (
        f"(Tensor hidden_states, Tensor gating_output, {_ROUTING}, Tensor? correction_bias=None) -> (Tensor, Tensor)",
        topk_sigmoid_cpu,
        _routing_fake,
    ),
    "grouped_topk_cpu": (f"(Tensor hidden_states, Tensor gating_output, {_GROUPED}", grouped_topk_cpu, _routing_fake),
    "biased_grouped_topk_cpu": (
        f"(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, {_GROUPED}",
        biased_grouped_topk_cpu,
        _routing_fake,
    ),
    "init_cpu_threads_env": ("(str cpu_ids) -> str", init_cpu_threads_env, init_cpu_threads_env),
    "initialize": ("(int size, int rank) -> ()", initialize, _nothing),
    "shm_allreduce": ("(Tensor(a!) data, int reduce_op) -> ()", shm_allreduce, _nothing),
    "shm_allgather": ("(Tensor data, int dim) -> Tensor", shm_allgather, _allgather_fake),
}


NO_TENSORS = ("init_cpu_threads_env", "initialize")


def _unserved(name: str, blocks: str) -> Callable[..., NoReturn]:
    def impl(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name}: kernforge has no kernel for it yet (it blocks {blocks})")

    return impl


# Ops SGLang reads from torch.ops.sgl_kernel at import once the AMX gate is open (a module would fail to
# import without them) that kernforge does not compute yet: defined, raising NotImplementedError when called.
# name -> (schema after the name, what calls it)
UNSERVED: dict[str, tuple[str, str]] = {
    "apply_rotary_pos_emb_cpu": (
        "(Tensor query, Tensor key, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
        "sglang.srt.layers.rotary_embedding.utils.apply_rotary_pos_emb: vision RoPE (Qwen-VL ...), Gemma 3",
    ),
    "flash_attn_varlen_func": (
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
        "int max_seqlen_k, bool causal, float sm_scale=-1.0) -> Tensor",
        "vision towers' attention (sglang.srt.layers.attention.vision)",
    ),
    "conv3d_embed_cpu": (
        "(Tensor input, Tensor weight, Tensor bias, bool is_vnni) -> Tensor",
        "Qwen-VL patch embedding (sglang.srt.layers.conv)",
    ),
}


def _void(fn: Callable[..., Any]) -> Callable[..., None]:
    def impl(*args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)

    return impl


def register() -> list[str]:
    """Define the ``sgl_kernel`` ops (once per process); the names registered."""
    global _LIB
    if _LIB is not None or SKIPPED:
        return REGISTERED
    if not _integration.enabled():
        SKIPPED.append(f"{_integration.ENABLE_VARIABLE}=0")
        return REGISTERED
    if hasattr(torch.ops, NAMESPACE) and hasattr(getattr(torch.ops, NAMESPACE), "convert_weight_packed"):
        SKIPPED.append("torch.ops.sgl_kernel is already defined (a build of sgl-kernel is loaded)")
        return REGISTERED
    _integration.check_sglang_version()
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, (schema, impl, fake) in OPS.items():
        lib.define(name + schema)
        cpu_impl = _void(impl) if schema.endswith("-> ()") else impl
        if name in NO_TENSORS:  # no tensor argument to dispatch on: one implementation for every key
            lib.impl(name, cpu_impl, "CompositeExplicitAutograd")
        else:
            lib.impl(name, cpu_impl, "CPU")
            lib.impl(name, fake, "Meta")  # what FakeTensorMode runs (as kernforge.torch_library)
        REGISTERED.append(name)
    for name, (schema, blocks) in UNSERVED.items():
        lib.define(name + schema)
        lib.impl(name, _unserved(name, blocks), "CPU")
    _LIB = lib
    _register_attention(lib)
    _integration.open_amx_gate()
    return REGISTERED


def _register_attention(lib: torch.library.Library) -> None:
    """The attention ops (decode_attention_cpu, extend_attention_cpu, store_cache_cpu), on the same library."""
    from kernforge.integrations.sglang import attention

    attention.register(lib)
    REGISTERED.extend(attention.SCHEMAS)


# --------------------------------------------------------------------------- Python-level names


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` = the next ``end - start``
    entries of ``out_cache_loc``, request after request (SGLang's Triton kernel ``assign_req_to_token_pool``).

    Plain torch on purpose: this is the scheduler's bookkeeping (a few index writes per request per
    step), not a kernel kernforge has or hides here."""
    for name, t in (("req_pool_indices", req_pool_indices), ("start_offset", start_offset)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be 2-D [pool rows, pool_len], got shape {tuple(req_to_token.shape)}")
    if not (req_pool_indices.numel() == start_offset.numel() == end_offset.numel()):
        raise ValueError("req_pool_indices, start_offset and end_offset must hold one entry per request")
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        if not 0 <= start <= end <= min(pool_len, req_to_token.shape[1]):
            raise ValueError(f"request row {row}: [{start}, {end}) is outside req_to_token's {pool_len} columns")
        n = end - start
        if offset + n > out_cache_loc.numel():
            raise ValueError(f"out_cache_loc holds {out_cache_loc.numel()} slots; the requests need more")
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _missing(name: str, what: str) -> Callable[..., NoReturn]:
    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name}: kernforge has no kernel for it yet ({what}); SGLang calls it only for {what}"
        )

    call.__name__ = call.__qualname__ = name
    return call


_KV_MOVES = "moving KV cache rows between slots"
_SPECULATIVE = "speculative (EAGLE) decoding"
MISSING = {
    "copy_all_layer_kv_cache_cpu": _KV_MOVES,
    "assign_draft_cache_locs_contiguous_cpu": _SPECULATIVE,
    "assign_extend_cache_locs_cpu": _SPECULATIVE,
    "fill_accept_out_cache_loc_cpu": _SPECULATIVE,
    "fill_bonus_tokens_cpu": _SPECULATIVE,
    "rotate_input_ids_cpu": _SPECULATIVE,
    "build_tree_kernel_efficient_cpu": _SPECULATIVE,
    "verify_tree_greedy_cpu": _SPECULATIVE,
    "build_draft_decode_metadata_cpu": _SPECULATIVE,
}
PYTHON_NAMES: dict[str, Callable[..., Any]] = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    **{name: _missing(name, what) for name, what in MISSING.items()},
}
globals().update(PYTHON_NAMES)
register()
