"""Attention-state merging, FlashInfer's cascade ops: ``merge_state``, ``merge_state_in_place``,
``merge_states``.

An attention state of one (token, head) over a set of keys is ``(v, s)``: ``v`` the attention
output over those keys (``[head_dim]``, fp32/bf16/fp16) and ``s = log2(sum_i exp(logit_i))`` its
log-sum-exp in base 2, as float32: FlashInfer's convention, which kernforge's attention kernels
follow too (``kernforge/attention/softmax_state.h``). Merging the states of disjoint key sets
gives the state of their union, exactly the attention over all the keys:
``s = log2(sum_k 2**s_k)``, ``v = sum_k 2**(s_k - s) * v_k``, accumulated in fp32.

An empty set is ``(0, -inf)``: a state with ``s = -inf`` contributes nothing (its ``v`` is not
read), and merging only empty states gives ``(0, -inf)``, as ``merge_states`` over zero states
does. A NaN ``s`` gives a NaN result.

Layouts: ``v`` tensors may have any strides but a contiguous last dimension where they are
written (an input with a strided last dimension is copied); ``s`` tensors any strides (a written
``s`` needs a contiguous last dimension). Results are freshly allocated, contiguous. A read-only
``s`` of another floating dtype is converted to float32, as FlashInfer's ``.to(torch.float32)``;
the ``s`` that ``merge_state_in_place`` updates must be float32.
"""

from __future__ import annotations

import torch

from kernforge.jit.module import DType, Entry, Module, Struct
from kernforge.ops._common import check_no_overlap, num_threads, readable_rows, variant_for_input, writable_rows
from kernforge.ops._registry import kernel_op


def _int64_fields(*names: str) -> tuple[tuple[str, str], ...]:
    return tuple((name, "int64_t") for name in names)


# Filled by name per call. Strides are in elements, in each tensor's dimension order (v: token,
# head[, dim]; s: token, head); lse = 0 skips the merged s; mask = 0 merges every token.
_MERGED = ("out", "out_s0", "out_s1", "lse", "lse_s0", "lse_s1")  # the merged v and s
MERGE_PAIRS_ARGS = Struct(
    "kf_merge_pairs_args",
    _int64_fields(
        *_MERGED,
        *("v_a", "va_s0", "va_s1", "s_a", "sa_s0", "sa_s1"),
        *("v_b", "vb_s0", "vb_s1", "s_b", "sb_s0", "sb_s1"),
        *("mask", "mask_s0", "seq_len", "num_heads", "head_dim", "num_threads"),
    ),
)
MERGE_STATES_ARGS = Struct(
    "kf_merge_states_args",
    _int64_fields(
        *_MERGED,
        *("v", "v_s0", "v_s1", "v_s2", "s", "s_s0", "s_s1", "s_s2"),
        *("seq_len", "num_states", "num_heads", "head_dim", "num_threads"),
    ),
)
CASCADE = Module(
    "cascade",
    "cascade.cpp.jinja",
    params={"dtype": DType()},
    structs=[MERGE_PAIRS_ARGS, MERGE_STATES_ARGS],
    entries=[
        Entry("merge_pairs", "const kf_merge_pairs_args* args"),
        Entry("merge_states", "const kf_merge_states_args* args"),
    ],
)


@kernel_op(CASCADE)
def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges the states of two KV segments A and B: ``v_*`` ``[seq_len, num_heads, head_dim]``,
    ``s_*`` float32 ``[seq_len, num_heads]``. Returns ``(v, s)`` of the segment ``[A: B]``."""
    kernel = variant_for_input(merge_state.kernels, v_a, "v_a").kernel()
    s_a, s_b = _scores(s_a, "s_a"), _scores(s_b, "s_b")
    v_b = _second_v(v_b, "v_b", v_a, "v_a")
    _pair_shapes(v_a, s_a, v_b, s_b, ("v_a", "s_a", "v_b", "s_b"))
    v_merged = torch.empty(v_a.shape, dtype=v_a.dtype)
    s_merged = torch.empty(s_a.shape, dtype=torch.float32)
    _merge_pairs(kernel, v_merged, s_merged, v_a, s_a, v_b, s_b, None)
    return v_merged, s_merged


@kernel_op(CASCADE)
def merge_state_in_place(
    v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor, mask: torch.Tensor | None = None
) -> None:
    """In place: ``(v, s) = merge((v, s), (v_other, s_other))`` for every token, or only for the
    tokens where the bool ``mask`` ``[seq_len]`` is True (the others are left untouched)."""
    kernel = variant_for_input(merge_state_in_place.kernels, v, "v").kernel()
    _cpu_tensor(s, "s")
    if s.dtype != torch.float32:
        raise TypeError(f"s must be a float32 tensor (it is updated in place), got dtype {s.dtype}")
    s_other = _scores(s_other, "s_other")
    v_other = _second_v(v_other, "v_other", v, "v")
    _pair_shapes(v, s, v_other, s_other, ("v", "s", "v_other", "s_other"))
    writable_rows(v.shape, v.stride(), "v")
    writable_rows(s.shape, s.stride(), "s")
    # v and s are written as the other state is read: the very same state merges with itself (each
    # element read, then written), a shifted one would be read after it was overwritten
    check_no_overlap(v, "v", v_other, "v_other", same_ok=True)
    check_no_overlap(s, "s", s_other, "s_other", same_ok=True)
    check_no_overlap(s, "s", v, "v")
    if mask is not None:
        _check_mask(mask, v.shape[0])
    _merge_pairs(kernel, v, s, v, s, v_other, s_other, mask)


@kernel_op(CASCADE)
def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges ``num_states`` states per token: ``v`` ``[seq_len, num_states, num_heads, head_dim]``,
    ``s`` float32 ``[seq_len, num_states, num_heads]``. Returns ``(v, s)`` of their union,
    ``[seq_len, num_heads, head_dim]`` and ``[seq_len, num_heads]``; zero states give ``(0, -inf)``."""
    kernel = variant_for_input(merge_states.kernels, v, "v").kernel()
    s = _scores(s, "s")
    _check_dim(v, "v", 4)
    _check_dim(s, "s", 3)
    if s.shape != v.shape[:3]:
        raise ValueError(
            f"s must have shape {tuple(v.shape[:3])} (v's [seq_len, num_states, num_heads]), got {tuple(s.shape)}"
        )
    seq_len, num_states, num_heads, head_dim = v.shape
    v, v_strides = readable_rows(v, v.shape, v.stride())
    v_merged = torch.empty((seq_len, num_heads, head_dim), dtype=v.dtype)
    s_merged = torch.empty((seq_len, num_heads), dtype=torch.float32)
    if seq_len * num_heads == 0:
        return v_merged, s_merged
    (out_s0, out_s1, _), (lse_s0, lse_s1) = v_merged.stride(), s_merged.stride()
    (v_s0, v_s1, v_s2, _), (s_s0, s_s1, s_s2) = v_strides, s.stride()
    args = {
        "out": v_merged.data_ptr(),
        "out_s0": out_s0,
        "out_s1": out_s1,
        "lse": s_merged.data_ptr(),
        "lse_s0": lse_s0,
        "lse_s1": lse_s1,
        "v": v.data_ptr(),
        "v_s0": v_s0,
        "v_s1": v_s1,
        "v_s2": v_s2,
        "s": s.data_ptr(),
        "s_s0": s_s0,
        "s_s1": s_s1,
        "s_s2": s_s2,
        "seq_len": seq_len,
        "num_states": num_states,
        "num_heads": num_heads,
        "head_dim": head_dim,
        "num_threads": num_threads(),
    }
    kernel.merge_states(kernel.new("kf_merge_states_args", args))
    return v_merged, s_merged


# --------------------------------------------------------------------------- checks


def _cpu_tensor(t: object, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")


def _scores(s: object, name: str) -> torch.Tensor:
    """A read-only s as float32 (FlashInfer converts with ``.to(torch.float32)``)."""
    _cpu_tensor(s, name)
    if s.dtype == torch.float32:
        return s
    if not s.is_floating_point():
        raise TypeError(f"{name} must be a float32 tensor of base-2 log-sum-exp values, got dtype {s.dtype}")
    return s.to(torch.float32)


def _second_v(v: object, name: str, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """A second v tensor: it must have the first one's dtype."""
    _cpu_tensor(v, name)
    if v.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {v.dtype} but {like_name} has {like.dtype}; they must match")
    return v


def _check_dim(t: torch.Tensor, name: str, ndim: int) -> None:
    if t.dim() != ndim:  # FlashInfer's CHECK_DIM message, then the shape
        raise ValueError(f"{name} must be a {ndim}D tensor, got shape {tuple(t.shape)}")


def _check_same_shape(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    for i, (x, y) in enumerate(zip(a.shape, b.shape)):  # FlashInfer's CHECK_SHAPE messages
        if x != y:
            raise ValueError(f"{a_name}->shape[{i}] and {b_name}->shape[{i}] mismatch ({x} vs {y})")


def _pair_shapes(v_a, s_a, v_b, s_b, names) -> None:
    """FlashInfer's checks, in its order: ranks, v_a ~ v_b, s_a ~ s_b, then s against v."""
    n_va, n_sa, n_vb, n_sb = names
    for t, name, ndim in ((v_a, n_va, 3), (s_a, n_sa, 2), (v_b, n_vb, 3), (s_b, n_sb, 2)):
        _check_dim(t, name, ndim)
    _check_same_shape(v_a, n_va, v_b, n_vb)
    _check_same_shape(s_a, n_sa, s_b, n_sb)
    if s_a.shape != v_a.shape[:2]:
        raise ValueError(
            f"{n_sa} must have shape {tuple(v_a.shape[:2])} ({n_va}'s [seq_len, num_heads]), got {tuple(s_a.shape)}"
        )


def _check_mask(mask: object, seq_len: int) -> None:
    _cpu_tensor(mask, "mask")
    if mask.dtype not in (torch.bool, torch.uint8):  # the kernel reads one byte per token, nonzero = merge
        raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    _check_dim(mask, "mask", 1)
    if mask.shape[0] != seq_len:
        raise ValueError(f"mask must have one entry per token of v ({seq_len}), got {mask.shape[0]}")


def _merge_pairs(kernel, out, lse, v_a, s_a, v_b, s_b, mask) -> None:
    seq_len, num_heads, head_dim = v_a.shape
    if seq_len * num_heads == 0:
        return
    # Inputs with a strided last dimension are read from a copy; out (maybe v_a) is written in place.
    out_strides = out.stride()
    v_a, va_strides = readable_rows(v_a, v_a.shape, v_a.stride())
    v_b, vb_strides = readable_rows(v_b, v_b.shape, v_b.stride())
    (lse_s0, lse_s1), (sa_s0, sa_s1), (sb_s0, sb_s1) = lse.stride(), s_a.stride(), s_b.stride()
    args = {
        "out": out.data_ptr(),
        "out_s0": out_strides[0],
        "out_s1": out_strides[1],
        "lse": lse.data_ptr(),
        "lse_s0": lse_s0,
        "lse_s1": lse_s1,
        "v_a": v_a.data_ptr(),
        "va_s0": va_strides[0],
        "va_s1": va_strides[1],
        "s_a": s_a.data_ptr(),
        "sa_s0": sa_s0,
        "sa_s1": sa_s1,
        "v_b": v_b.data_ptr(),
        "vb_s0": vb_strides[0],
        "vb_s1": vb_strides[1],
        "s_b": s_b.data_ptr(),
        "sb_s0": sb_s0,
        "sb_s1": sb_s1,
        "seq_len": seq_len,
        "num_heads": num_heads,
        "head_dim": head_dim,
        "num_threads": num_threads(),
    }
    if mask is not None:  # else 0: every token merged
        args["mask"], args["mask_s0"] = mask.data_ptr(), mask.stride(0)
    kernel.merge_pairs(kernel.new("kf_merge_pairs_args", args))
