"""DeepSeek MLA's absorbed projections with sgl-kernel's CPU semantics (``sgl-kernel/csrc/cpu/qkv_proj.cpp``).

``qkv_proj_with_rope(hidden_states, q_a_proj_weight, q_b_proj_weight, kv_a_proj_weight, w_kc, ...)``
turns a layer's hidden states ``[T, hidden]`` into the inputs of MLA's absorbed attention:

* ``q = rmsnorm(x @ q_a^T) @ q_b^T`` viewed ``[T, H, qk_nope_head_dim + rope_dim]``; ``q_input [T, H,
  kv_lora_rank + rope_dim]`` holds ``q_nope[:, h] @ w_kc[h]^T`` (W_UK absorbed: the query in the
  latent space) then ``rope(q_pe)``;
* ``kv = x @ kv_a^T`` ``[T, kv_lora_rank + rope_dim]``; ``k_input [T, 1, kv_lora_rank + rope_dim]`` is
  ``rmsnorm(kv latent) | rope(k_pe)`` and ``v_input [T, 1, kv_lora_rank]`` its first kv_lora_rank
  columns (a view: k_input and v_input share storage, as sgl-kernel returns them).

RoPE is DeepSeek's interleaved (GPT-J) form, the only one sgl-kernel's kernel has: pairs ``(2i, 2i +
1)`` turn by ``cos_sin_cache[pos, i]`` / ``cos_sin_cache[pos, rope_dim / 2 + i]``. Both RMSNorms take
the one ``eps``.

Weights, in kernforge form. ``is_vnni`` keeps sgl-kernel's meaning, "the weights come prepacked":

* ``is_vnni=True``: ``PackedWeight`` (bf16, ``convert_weight_packed``), ``PackedInt8Weight``
  (``use_int8_w8a8``) or ``PackedFp8Weight`` (``use_fp8_w8a16``), and ``w_kc`` a sequence of H
  ``PackedWeight`` ``[kv_lora_rank, qk_nope_head_dim]`` (:func:`absorb_kv_b_proj` makes them);
* ``is_vnni=False``: the raw ``[N, K]`` tensors (bf16, int8 with per-channel scales ``[N]`` / ``[N,
  1]``, e4m3fn with block scales) and ``w_kc`` bf16 or e4m3fn ``[H, kv_lora_rank, qk_nope_head_dim]``,
  packed on every call (costly: for tests and one-off calls).

A packed weight carries its scales: a ``*_scale`` argument may then be None; an int8 one given must
equal the packed scales, an fp8 one is the scale ``fp8_scaled_mm`` applies (``block_size`` None takes
the packed weight's).

``w_scale`` is sgl-kernel's per-tensor scale of W_UK (a 0-dim tensor; a float is also taken), in
any mode: SGLang's CPU path requantizes an fp8 ``kv_b_proj`` per tensor and passes its scale with
``use_fp8_w8a16``; sgl-kernel's ``bmm_cpu`` takes its fp8 path when the scale is given. The
absorbed query is then ``(q_nope @ w_kc[h]^T) * w_scale`` as :func:`~kernforge.ops.gemm.bmm.bmm`
computes it: the fp32 sums of the weights widened exactly to bf16, scaled, rounded once. An e4m3fn
``w_kc`` requires it; prepacked, fp8 W_UK is H ``PackedWeight`` of those exact values
(``convert_weight_packed(w.to(torch.bfloat16))``). None leaves the products unscaled (bf16 W_UK,
e.g. :func:`absorb_kv_b_proj`'s, which dequantizes ``kv_b_proj``). ``mla_output_proj`` takes W_UV's
the same way.

The work, in kernforge's ops (no torch arithmetic on the heavy parts): the q_a and kv_a GEMMs (one
GEMM over the fused weight in :func:`qkv_proj_with_rope_fused_weight`), the kv_a product allocated
as k_input's storage; two in-place RMSNorms (q's latent, then v_input's rows inside k_input); the
q_b GEMM; the per-head products (``bmm``'s GEMM kernel, its checks made once for all heads) writing
straight into ``q_input[..., :kv_lora_rank]``; one RoPE kernel call that reads q_pe from the q_b
product, writes it into ``q_input[..., kv_lora_rank:]`` and turns k_pe in place. Every argument is
checked before the first GEMM, except positions beyond an fp32 cos_sin_cache, which the RoPE kernel
finds before it writes: an error never leaves anything of the caller's written.

Differences from sgl-kernel, by design: ``hidden_states`` may be fp32, fp16 or bf16 (the outputs and
norm weights in its dtype) with strided rows; ``positions`` int32 or int64; ``cos_sin_cache`` float32
or hidden_states' dtype (a bf16 cache has its T rows gathered and widened, exactly, per call); any
even rope_dim (sgl-kernel's kernel needs a multiple of 32). With the fused weight, k_input (and
v_input) are views into the fused product's rows: for T > 1 their row stride is ``q_lora_rank +
kv_lora_rank + rope_dim``, not ``kv_lora_rank + rope_dim`` (the last dimension stays contiguous).
Prepacked fp8 W_UK / W_UV is held as its exact bf16 values (twice sgl-kernel's fp8 bytes). Not yet
here: the newest sgl-kernel's trailing ``need_q_lora`` and fourth output (the RMSNorm'd q_a product,
for DeepSeek-V3.2's indexer); these ops keep the three outputs of the sgl-kernel that added ``w_scale``.

``absorb_kv_b_proj(kv_b_proj_weight, qk_nope_head_dim, v_head_dim)`` derives ``w_kc`` and ``w_vc``
from ``kv_b_proj`` once, as SGLang's ``post_load_weights`` does, and packs them for ``bmm``;
``mla_output_proj(attn_latent, w_vc)`` is the output absorption (W_UV) before ``o_proj``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernforge.ops._common import check_no_overlap, checked_out, num_threads, variant_for_input
from kernforge.ops._registry import DTYPE_NAMES, export
from kernforge.ops.gemm import check_cpu_tensor, raise_for_status
from kernforge.ops.gemm.bf16 import (
    PackedWeight,
    checked_packed_weight,
    convert_weight_packed,
    linear_variant,
    weight_packed_linear,
)
from kernforge.ops.gemm.bmm import bmm, checked_scale, scaled_once
from kernforge.ops.gemm.fp8 import PackedFp8Weight, convert_weight_packed_fp8, fp8_scaled_mm
from kernforge.ops.gemm.int8 import PackedInt8Weight, convert_weight_packed_int8, int8_scaled_mm_with_quant
from kernforge.ops.norm import rmsnorm
from kernforge.ops.rope import CosSinAngles, checked_positions, cos_sin_angles, rotate_heads

# ----------------------------------------------------------------------------- the ops


def qkv_proj_with_rope(
    hidden_states: torch.Tensor,
    q_a_proj_weight,
    q_b_proj_weight,
    kv_a_proj_weight,
    w_kc,
    q_a_layernorm_weight: torch.Tensor,
    kv_a_layernorm_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    use_int8_w8a8: bool = False,
    use_fp8_w8a16: bool = False,
    q_a_proj_scale: torch.Tensor | None = None,
    q_b_proj_scale: torch.Tensor | None = None,
    kv_a_proj_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | float | None = None,
    is_vnni: bool = True,
    block_size=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sgl-kernel's ``qkv_proj_with_rope``: ``hidden_states [T, hidden]`` -> ``(q_input [T, H,
    kv_lora_rank + rope_dim], k_input [T, 1, kv_lora_rank + rope_dim], v_input [T, 1, kv_lora_rank])``.
    ``q_a_proj_weight [q_lora_rank, hidden]``, ``q_b_proj_weight [H * (qk_nope_head_dim + rope_dim),
    q_lora_rank]``, ``kv_a_proj_weight [kv_lora_rank + rope_dim, hidden]``, ``w_kc`` H weights
    ``[kv_lora_rank, qk_nope_head_dim]`` with ``w_scale`` its per-tensor scale (fp8 W_UK); see the
    module docstring for their forms."""
    mode = _mode(use_int8_w8a8, use_fp8_w8a16)
    x = _checked_hidden_states(hidden_states)
    q_a = _projection(q_a_proj_weight, q_a_proj_scale, "q_a_proj", mode, is_vnni, block_size)
    kv_a = _projection(kv_a_proj_weight, kv_a_proj_scale, "kv_a_proj", mode, is_vnni, block_size)
    _check_k(q_a, x.shape[1], "hidden_states' hidden size")
    _check_k(kv_a, x.shape[1], "hidden_states' hidden size")
    rest = _checked_rest(
        x, q_a.n, kv_a.n, q_b_proj_weight, q_b_proj_scale, w_kc, w_scale, q_a_layernorm_weight,
        kv_a_layernorm_weight, positions, cos_sin_cache, eps, mode, is_vnni, block_size,
    )  # fmt: skip
    return _absorbed_inputs(q_a(x), kv_a(x), *rest)


export("qkv_proj_with_rope", qkv_proj_with_rope)


def qkv_proj_with_rope_fused_weight(
    hidden_states: torch.Tensor,
    qkv_a_proj_weight,
    q_b_proj_weight,
    w_kc,
    q_a_layernorm_weight: torch.Tensor,
    kv_a_layernorm_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    use_int8_w8a8: bool,
    use_fp8_w8a16: bool,
    qkv_a_proj_scale: torch.Tensor | None,
    q_b_proj_scale: torch.Tensor | None,
    w_scale: torch.Tensor | float | None,
    is_vnni: bool,
    block_size,
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sgl-kernel's ``qkv_proj_with_rope_fused_weight``: :func:`qkv_proj_with_rope` with q_a and kv_a
    stacked in one ``qkv_a_proj_weight [q_lora_rank + kv_lora_rank + qk_rope_head_dim, hidden]`` (SGLang's
    ``fused_qkv_a_proj_with_mqa``), run as one GEMM; its scales are the fused weight's. k_input and
    v_input are views into that GEMM's rows (see the module docstring)."""
    mode = _mode(use_int8_w8a8, use_fp8_w8a16)
    x = _checked_hidden_states(hidden_states)
    ranks = {"q_lora_rank": q_lora_rank, "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim}
    for name, value in ranks.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    qkv_a = _projection(qkv_a_proj_weight, qkv_a_proj_scale, "qkv_a_proj", mode, is_vnni, block_size)
    _check_k(qkv_a, x.shape[1], "hidden_states' hidden size")
    kv_n = kv_lora_rank + qk_rope_head_dim
    w_kc_rank = _checked_head_weights(w_kc, "w_kc", w_scale).n
    if w_kc_rank != kv_lora_rank:
        raise ValueError(f"kv_lora_rank is {kv_lora_rank} but w_kc's weights are [{w_kc_rank}, qk_nope_head_dim]")
    if qkv_a.n != q_lora_rank + kv_n:
        raise ValueError(
            f"qkv_a_proj_weight has {qkv_a.n} rows; expected q_lora_rank + kv_lora_rank + qk_rope_head_dim = "
            f"{q_lora_rank} + {kv_lora_rank} + {qk_rope_head_dim}"
        )
    rest = _checked_rest(
        x, q_lora_rank, kv_n, q_b_proj_weight, q_b_proj_scale, w_kc, w_scale, q_a_layernorm_weight,
        kv_a_layernorm_weight, positions, cos_sin_cache, eps, mode, is_vnni, block_size,
    )  # fmt: skip
    qkv = qkv_a(x)
    return _absorbed_inputs(qkv[:, :q_lora_rank], qkv[:, q_lora_rank:], *rest)


export("qkv_proj_with_rope_fused_weight", qkv_proj_with_rope_fused_weight)


def mla_output_proj(
    attn_latent: torch.Tensor,
    w_vc,
    out: torch.Tensor | None = None,
    w_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """MLA's output absorption (W_UV), SGLang's CPU ``bmm_cpu`` after the attention: ``attn_latent [T, H,
    kv_lora_rank]`` (any strides, last dimension contiguous) -> ``out [T, H * v_head_dim]`` with
    ``out[:, h * v_head_dim:(h + 1) * v_head_dim] = attn_latent[:, h] @ w_vc[h]^T (* w_scale)``, o_proj's
    input. ``w_vc``: H ``PackedWeight`` ``[v_head_dim, kv_lora_rank]`` (:func:`absorb_kv_b_proj`), or a
    bf16 or float8_e4m3fn tensor ``[H, v_head_dim, kv_lora_rank]`` packed per call; ``w_scale`` its
    per-tensor scale, as ``bmm_cpu``'s ``scale`` (required with fp8 ``w_vc``; see the module docstring).
    ``out`` (optional) must be ``[T, H * v_head_dim]`` with a contiguous last dimension."""
    check_cpu_tensor(attn_latent, "attn_latent")
    if attn_latent.dtype not in DTYPE_NAMES:
        raise TypeError(
            f"attn_latent has dtype {attn_latent.dtype}; expected torch.float32, torch.bfloat16 or torch.float16"
        )
    if attn_latent.dim() != 3:
        raise ValueError(f"attn_latent must be 3-D [T, H, kv_lora_rank], got shape {tuple(attn_latent.shape)}")
    tokens, heads, rank = attn_latent.shape
    absorbed = _checked_head_weights(w_vc, "w_vc", w_scale, heads, "attn_latent's heads")
    if absorbed.k != rank:
        raise ValueError(f"w_vc's weights have K = {absorbed.k}; attn_latent's last dimension is {rank}")
    shape = (tokens, heads * absorbed.n)
    if out is None:
        out = torch.empty(shape, dtype=attn_latent.dtype)
    else:
        check_cpu_tensor(out, "out")
        if out.dtype is not attn_latent.dtype:
            raise TypeError(f"out has dtype {out.dtype} but attn_latent has {attn_latent.dtype}; they must match")
        if tuple(out.shape) != shape or (out.stride(-1) != 1 and shape[-1] > 1):
            raise ValueError(f"out must be {shape} with a contiguous last dimension, got shape {tuple(out.shape)}")
        check_no_overlap(out, "out", attn_latent, "attn_latent")
    if out.numel():
        heads_out = out.unflatten(1, (heads, absorbed.n)).transpose(0, 1)
        _per_head_products(heads_out, attn_latent.transpose(0, 1), absorbed)
    return out


export("mla_output_proj", mla_output_proj)


# ----------------------------------------------------------------------------- weight preparation


@dataclass
class AbsorbedMLAWeights:
    """``kv_b_proj`` split per head and packed for :func:`bmm`, as the absorbed MLA ops take it.

    ``w_kc[h]`` is ``PackedWeight [kv_lora_rank, qk_nope_head_dim]`` (SGLang's ``w_kc[h].T``: the
    query's absorption, ``q_nope @ w_kc[h]^T``); ``w_vc[h]`` is ``PackedWeight [v_head_dim,
    kv_lora_rank]`` (SGLang's ``w_vc[h].T``: the output's, ``latent @ w_vc[h]^T``). Survives
    ``torch.save``/``torch.load``."""

    w_kc: list[PackedWeight]
    w_vc: list[PackedWeight]
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int


torch.serialization.add_safe_globals([AbsorbedMLAWeights])


def split_kv_b_proj(
    kv_b_proj_weight: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``post_load_weights`` split of ``kv_b_proj_weight [H * (qk_nope_head_dim + v_head_dim),
    kv_lora_rank]`` (any dtype): ``(w_kc [H, qk_nope_head_dim, kv_lora_rank], w_vc [H, kv_lora_rank,
    v_head_dim])``, views of it: ``q_nope_latent[:, h] = q_nope[:, h] @ w_kc[h]``, ``out_h = latent_h @
    w_vc[h]``."""
    check_cpu_tensor(kv_b_proj_weight, "kv_b_proj_weight")
    for name, value in (("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    head_rows = qk_nope_head_dim + v_head_dim
    if kv_b_proj_weight.dim() != 2 or kv_b_proj_weight.shape[0] % head_rows:
        raise ValueError(
            f"kv_b_proj_weight must be [H * (qk_nope_head_dim + v_head_dim) = H * {head_rows}, kv_lora_rank], "
            f"got shape {tuple(kv_b_proj_weight.shape)}"
        )
    w_kc, w_vc = kv_b_proj_weight.unflatten(0, (-1, head_rows)).split([qk_nope_head_dim, v_head_dim], dim=1)
    return w_kc, w_vc.transpose(1, 2)


def absorb_kv_b_proj(
    kv_b_proj_weight: torch.Tensor,
    qk_nope_head_dim: int,
    v_head_dim: int,
    weight_scale: torch.Tensor | None = None,
    block_size=None,
) -> AbsorbedMLAWeights:
    """Once per layer: ``kv_b_proj_weight`` (bf16; int8 with per-channel ``weight_scale [N]``/``[N, 1]``;
    e4m3fn with block scales ``weight_scale`` and ``block_size``, dequantized to bf16 as SGLang does)
    split by :func:`split_kv_b_proj` and packed per head for :func:`qkv_proj_with_rope` (``w_kc``) and
    :func:`mla_output_proj` (``w_vc``)."""
    weight = _dequantized_kv_b(kv_b_proj_weight, weight_scale, block_size)
    w_kc, w_vc = split_kv_b_proj(weight, qk_nope_head_dim, v_head_dim)
    return AbsorbedMLAWeights(
        w_kc=[convert_weight_packed(w.T) for w in w_kc],
        w_vc=[convert_weight_packed(w.T) for w in w_vc],
        num_heads=int(w_kc.shape[0]),
        kv_lora_rank=int(weight.shape[1]),
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim,
    )


export("absorb_kv_b_proj", absorb_kv_b_proj)


def _dequantized_kv_b(weight: torch.Tensor, scale, block_size) -> torch.Tensor:
    """SGLang's bf16 ``kv_b_proj`` for w_kc / w_vc: int8 ``w.bf16 * scale.bf16`` (per channel), fp8
    blocks ``(w.float() * S).bf16``."""
    check_cpu_tensor(weight, "kv_b_proj_weight")
    if weight.dtype is torch.bfloat16:
        if scale is not None:
            raise ValueError("weight_scale must be None for a bf16 kv_b_proj_weight")
        return weight
    if weight.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise TypeError(f"kv_b_proj_weight has dtype {weight.dtype}; expected bfloat16, int8 or float8_e4m3fn")
    if weight.dim() != 2:
        raise ValueError(f"kv_b_proj_weight must be 2-D, got shape {tuple(weight.shape)}")
    check_cpu_tensor(scale, "weight_scale")
    if not scale.is_floating_point():
        raise TypeError(f"weight_scale has dtype {scale.dtype}; expected a floating dtype")
    n, k = weight.shape
    if weight.dtype is torch.int8:
        if tuple(scale.shape) not in ((n,), (n, 1)):
            raise ValueError(
                f"weight_scale must be ({n},) or ({n}, 1) for an int8 kv_b_proj_weight, got {tuple(scale.shape)}"
            )
        return weight.to(torch.bfloat16) * scale.reshape(n, 1).to(torch.bfloat16)
    bn, bk = _block(block_size)
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(
            f"weight_scale must have shape {(-(-n // bn), -(-k // bk))} for a [{n}, {k}] weight in blocks "
            f"{(bn, bk)}, got {tuple(scale.shape)}"
        )
    expanded = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * expanded).to(torch.bfloat16)


# ----------------------------------------------------------------------------- the shared pipeline


@dataclass
class _HeadWeights:
    """H weights [n, k] for bmm (a list of PackedWeight, or a bf16 / e4m3fn [H, n, k] tensor it packs)
    and their per-tensor scale (None: unscaled)."""

    weights: object
    n: int
    k: int
    scale: float | None


def _absorbed_inputs(qa, kv, w_kc, q_b, q_a_norm, kv_a_norm, rope, eps, heads):
    """Stages 2-5 on the q_a product ``qa [T, q_lora_rank]`` and the kv_a product ``kv [T, kv_lora_rank +
    rope_dim]`` (rows of the fused product, or its own tensor: k_input's storage either way)."""
    tokens, rank = qa.shape[0], w_kc.n
    rope_dim = kv.shape[1] - rank
    q_input = torch.empty(tokens, heads, rank + rope_dim, dtype=qa.dtype)
    k_input = kv.unsqueeze(1)
    v_input = k_input[..., :rank]
    if tokens == 0:
        return q_input, k_input, v_input
    rmsnorm(qa, q_a_norm, eps, out=qa)
    latent = kv[:, :rank]
    rmsnorm(latent, kv_a_norm, eps, out=latent)
    q = q_b(qa).view(tokens, heads, -1)  # [T, H, qk_nope_head_dim + rope_dim]
    nope = q.shape[2] - rope_dim
    _per_head_products(q_input[..., :rank].transpose(0, 1), q[..., :nope].transpose(0, 1), w_kc)
    # one RoPE kernel call, interleaved pairs: q_pe out of place into q_input, k_pe in place
    k_pe = k_input[..., rank:]
    rotate_heads(q[..., nope:], q_input[..., rank:], k_pe, k_pe, rope, interleave=True)
    return q_input, k_input, v_input


def _per_head_products(out: torch.Tensor, a: torch.Tensor, weights: _HeadWeights) -> None:
    """``out[h] = a[h] @ W_h^T (* scale)`` (``a [H, M, K]``, ``out [H, M, N]``, rows at any strides):
    ``bmm``, whose per-head GEMM calls check their arguments every time (about 10 us a head, a decode
    step's cost at 16 heads and more). Prepacked weights take the same GEMM kernel here, with the checks
    made once for all heads, and a scale applied as ``bmm`` applies it; a raw tensor goes to ``bmm``,
    which packs it (an fp8 one widened exactly to bf16)."""
    if isinstance(weights.weights, torch.Tensor):
        bmm(out, a, weights.weights, weights.scale)
        return
    variant_for_input(weight_packed_linear.kernels, a, "a")
    checked_out(out, (*a.shape[:2], weights.n), a)
    if a.stride(2) != 1 and a.shape[2] > 1:
        a = a.contiguous()
    for packed in weights.weights:
        checked_packed_weight(packed)
    if weights.scale is None:
        _packed_products(out, a, weights.weights)
    else:
        scaled_once(out, a, weights.scale, lambda sums, a32: _packed_products(sums, a32, weights.weights))


def _packed_products(out: torch.Tensor, a: torch.Tensor, packed: Sequence[PackedWeight]) -> None:
    """``out[h] = a[h] @ packed[h]^T`` on the GEMM kernel, one call a head, for checked arguments of one
    dtype (``a``'s last dimension contiguous)."""
    heads, m, k = a.shape
    n = packed[0].n
    kernel, size, threads = linear_variant(a.dtype, m, n, k).kernel(), a.element_size(), num_threads()
    a_ptr, out_ptr = a.data_ptr(), out.data_ptr()
    for h, weight in enumerate(packed):
        status = kernel.linear(
            out_ptr + h * out.stride(0) * size, out.stride(1), a_ptr + h * a.stride(0) * size, a.stride(1),
            weight.packed.data_ptr(), weight.panel_width, 0, m, n, k, threads,
        )  # fmt: skip
        raise_for_status(status, "the per-head GEMM")


# ----------------------------------------------------------------------------- checks


_MODES = {(False, False): "bf16", (True, False): "int8", (False, True): "fp8"}


def _mode(use_int8_w8a8: object, use_fp8_w8a16: object) -> str:
    mode = _MODES.get((bool(use_int8_w8a8), bool(use_fp8_w8a16)))
    if mode is None:
        raise ValueError("use_int8_w8a8 and use_fp8_w8a16 cannot both be set")
    return mode


def _checked_hidden_states(x: object) -> torch.Tensor:
    check_cpu_tensor(x, "hidden_states")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"hidden_states has dtype {x.dtype}; expected torch.bfloat16, torch.float16 or torch.float32")
    if x.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [T, hidden_size], got shape {tuple(x.shape)}")
    return x


def _check_k(projection, k: int, what: str) -> None:
    if projection.k != k:
        raise ValueError(f"{projection.name}_weight has K = {projection.k}; it must match {what} ({k})")


def _checked_rest(
    x, q_lora_rank, kv_n, q_b_proj_weight, q_b_proj_scale, w_kc, w_scale, q_a_norm, kv_a_norm,
    positions, cos_sin_cache, eps, mode, is_vnni, block_size,
):  # fmt: skip
    """Everything past the first GEMM, checked: (w_kc, q_b, q_a_norm, kv_a_norm, rope, eps, heads)."""
    q_b = _projection(q_b_proj_weight, q_b_proj_scale, "q_b_proj", mode, is_vnni, block_size)
    _check_k(q_b, q_lora_rank, "q_a_proj's N (q_lora_rank)")
    if not is_vnni and isinstance(w_kc, (list, tuple)):
        raise TypeError("w_kc is a list of packed weights but is_vnni is False (raw tensors, packed per call)")
    if is_vnni and isinstance(w_kc, torch.Tensor):
        raise TypeError("w_kc is a tensor but is_vnni is True: pass H PackedWeight (absorb_kv_b_proj's w_kc)")
    w_kc = _checked_head_weights(w_kc, "w_kc", w_scale)
    heads, rank, nope = len(w_kc.weights), w_kc.n, w_kc.k
    rope_dim = kv_n - rank
    if rope_dim < 2:
        raise ValueError(
            f"kv_a_proj_weight has {kv_n} rows; it must be kv_lora_rank ({rank}, w_kc's N) + rope_dim (at least 2)"
        )
    if q_b.n % heads or q_b.n // heads != nope + rope_dim:
        raise ValueError(
            f"q_b_proj_weight has {q_b.n} rows; expected H * (qk_nope_head_dim + rope_dim) = {heads} * "
            f"({nope} + {rope_dim}) from w_kc and kv_a_proj_weight"
        )
    _check_norm_weight(q_a_norm, "q_a_layernorm_weight", q_lora_rank, x)
    _check_norm_weight(kv_a_norm, "kv_a_layernorm_weight", rank, x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    rope = _checked_rope(positions, cos_sin_cache, x, rope_dim)
    return w_kc, q_b, q_a_norm, kv_a_norm, rope, float(eps), heads


def _check_norm_weight(weight: object, name: str, size: int, x: torch.Tensor) -> None:
    check_cpu_tensor(weight, name)
    if weight.dtype is not x.dtype:
        raise TypeError(f"{name} has dtype {weight.dtype} but hidden_states has {x.dtype}; they must match")
    if tuple(weight.shape) != (size,):
        raise ValueError(f"{name} must have shape ({size},), got {tuple(weight.shape)}")


def _checked_rope(positions, cos_sin_cache, x: torch.Tensor, rope_dim: int) -> CosSinAngles:
    tokens = x.shape[0]
    if rope_dim % 2:
        raise ValueError(f"rope_dim (kv_a_proj_weight's rows - kv_lora_rank) must be even, got {rope_dim}")
    check_cpu_tensor(cos_sin_cache, "cos_sin_cache")
    if cos_sin_cache.dtype is not torch.float32 and cos_sin_cache.dtype is not x.dtype:
        raise TypeError(
            f"cos_sin_cache has dtype {cos_sin_cache.dtype}; expected torch.float32 or hidden_states' {x.dtype}"
        )
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rope_dim = {rope_dim}] (cos | sin halves), "
            f"got shape {tuple(cos_sin_cache.shape)}"
        )
    positions = checked_positions(positions, tokens)
    rows = cos_sin_cache.shape[0]
    if cos_sin_cache.dtype is not torch.float32:  # gather this call's rows, widened exactly
        if tokens and not 0 <= int(positions.min()) <= int(positions.max()) < rows:
            bad = int(((positions < 0) | (positions >= rows)).nonzero()[0])
            raise ValueError(
                f"positions[{bad}] = {int(positions[bad])} is out of range for cos_sin_cache, which has {rows} rows"
            )
        cos_sin_cache = cos_sin_cache.index_select(0, positions.long()).float()
        positions = torch.arange(tokens, dtype=torch.int32)
    return cos_sin_angles(positions, cos_sin_cache, tokens)


def _checked_head_weights(
    w: object, name: str, scale: object, heads: int | None = None, heads_from: str = ""
) -> _HeadWeights:
    """H weights [n, k] for bmm and their per-tensor ``w_scale``: a sequence of PackedWeight, or a bf16
    or e4m3fn [H, n, k] tensor (e4m3fn with a scale, as sgl-kernel's fp8 bmm)."""
    if isinstance(w, torch.Tensor):
        check_cpu_tensor(w, name)
        if w.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise TypeError(
                f"{name} has dtype {w.dtype}; expected torch.bfloat16 or torch.float8_e4m3fn ([H, N, K], "
                "packed per call)"
            )
        if w.dim() != 3 or w.shape[0] == 0:
            raise ValueError(f"{name} must be 3-D [H, N, K] with H >= 1, got shape {tuple(w.shape)}")
        count, n, k = w.shape
    elif isinstance(w, Sequence) and w and all(isinstance(p, PackedWeight) for p in w):
        count, (n, k) = len(w), w[0].shape
        if any(p.shape != (n, k) for p in w):
            raise ValueError(f"{name} must hold packed weights of one shape, got {[p.shape for p in w]}")
    else:
        raise TypeError(f"{name} must be a non-empty sequence of PackedWeight or a bf16 / e4m3fn [H, N, K] tensor")
    if heads is not None and count != heads:
        raise ValueError(f"{name} holds {count} heads' weights; {heads_from} are {heads}")
    return _HeadWeights(w, int(n), int(k), checked_scale(scale, w, "w_scale", name))


# ----------------------------------------------------------------------------- projections


@dataclass
class _Projection:
    """A checked dense weight of one mode: ``n``, ``k`` and ``run(x) -> x @ W^T`` (x's dtype)."""

    name: str
    n: int
    k: int
    run: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def _projection(weight, scale, name: str, mode: str, is_vnni: bool, block_size) -> _Projection:
    """``weight`` (``<name>_weight``) and its ``scale`` (``<name>_scale``) checked for ``mode``; raw
    tensors are packed here."""
    wname, sname = f"{name}_weight", f"{name}_scale"
    packed_type = {"bf16": PackedWeight, "int8": PackedInt8Weight, "fp8": PackedFp8Weight}[mode]
    if is_vnni and not isinstance(weight, packed_type):
        raise TypeError(
            f"{wname} must be a {packed_type.__name__} with is_vnni=True ({mode} weights), got {type(weight).__name__}"
        )
    if not is_vnni and not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"{wname} must be a [N, K] tensor with is_vnni=False (packed per call), got {type(weight).__name__}"
        )
    if mode == "bf16":
        if scale is not None:
            raise ValueError(f"{sname} must be None for bf16 weights")
        packed = weight if is_vnni else _packing(convert_weight_packed, wname, sname, weight)
        return _Projection(name, packed.n, packed.k, lambda x: weight_packed_linear(x, packed))
    if mode == "int8":
        if is_vnni:
            packed = weight
            if scale is not None and not _same_values(scale, packed.scale, sname):
                raise ValueError(f"{sname} differs from the scales {wname} was packed with")
        else:
            packed = _packing(convert_weight_packed_int8, wname, sname, weight, _required(scale, sname))
        return _Projection(name, packed.n, packed.k, lambda x: int8_scaled_mm_with_quant(x, packed))
    if is_vnni:
        packed = weight
        block = packed.block_size if block_size is None else _block(block_size)
        scale = packed.weight_scale if scale is None else scale
        _check_fp8_scale(scale, sname, packed, block)
    else:
        block = _block(_required(block_size, "block_size"))
        packed = _packing(convert_weight_packed_fp8, wname, sname, weight, _required(scale, sname), block)
        scale = packed.weight_scale
    return _Projection(name, packed.n, packed.k, lambda x: fp8_scaled_mm(x, packed, scale, block, out_dtype=x.dtype))


def _packing(convert, wname: str, sname: str, *args):
    """``convert(*args)``, its errors naming the op's arguments rather than ``weight`` / ``weight_scale``."""
    try:
        return convert(*args)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        for generic, specific in (("weight_scale", sname), ("weight", wname)):
            if message.startswith(generic):
                message = specific + message[len(generic) :]
                break
        raise type(exc)(message) from None


def _check_fp8_scale(scale: object, name: str, packed: PackedFp8Weight, block: tuple[int, int]) -> None:
    check_cpu_tensor(scale, name)
    if scale.dtype is not torch.float32:
        raise TypeError(f"{name} has dtype {scale.dtype}; expected torch.float32")
    expected = (-(-packed.n // block[0]), -(-packed.k // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{name} must have shape {expected} for a [{packed.n}, {packed.k}] weight in blocks {block}, "
            f"got {tuple(scale.shape)}"
        )


def _required(value, name: str):
    if value is None:
        raise ValueError(f"{name} is required for quantized weights passed as tensors (is_vnni=False)")
    return value


def _same_values(scale: object, packed_scale: torch.Tensor, name: str) -> bool:
    check_cpu_tensor(scale, name)
    return scale.numel() == packed_scale.numel() and torch.equal(scale.reshape(-1).float(), packed_scale)


def _block(block_size, name: str = "block_size") -> tuple[int, int]:
    try:
        bn, bk = (int(s) for s in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be two sizes (block_n, block_k), got {block_size!r}") from None
    if bn <= 0 or bk <= 0:
        raise ValueError(f"{name} must hold two positive sizes (block_n, block_k), got {block_size!r}")
    return bn, bk
