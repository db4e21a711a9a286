"""Reference implementations that more than one test family checks against.

Plain PyTorch on the same, already-rounded inputs the kernel sees, so only the kernel's own
arithmetic and its output rounding differ from them. Attention is computed in float64 (its
callers' tolerances assume it); the GEMM references are the float32 matmuls their tests' tolerances
were set against.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.0 / math.log(2.0)


# --------------------------------------------------------------------------- attention


def attention_reference(
    q, k, v, *, sm_scale=None, causal=False, window_left=-1, soft_cap=0.0, mask=None, k_scale=1.0, v_scale=1.0
):
    """float64 attention of one request, FlashInfer's conventions.

    q [qo_len, Hq, D_qk], k [kv_len, Hkv, D_qk], v [kv_len, Hkv, D_vo] (any dtype; an fp8 cache
    dequantizes exactly), Hq a multiple of Hkv (GQA: query head h reads KV head h // (Hq / Hkv));
    D_qk and D_vo may differ (MLA). Logits are ``sm_scale * k_scale * q.k`` (``sm_scale`` defaults
    to 1/sqrt(D_qk)), soft-capped as ``cap * tanh(x / cap)`` when ``soft_cap`` is set. Query i sees
    key j when: ``mask[i, j]`` if a custom mask [qo_len, kv_len] is given, else j <= kv_len -
    qo_len + i if ``causal`` (bottom-right aligned), else always; and, when ``window_left`` w >= 0,
    j >= kv_len - qo_len + i - w. A decode step is qo_len 1 (causal or not, the same).

    Returns (out [qo_len, Hq, D_vo], lse [qo_len, Hq]) in float64, out = softmax . V * v_scale and
    lse base 2 (``log2(e) * logsumexp``); a query that sees no key (or an empty request) gives
    zeros and -inf.
    """
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[:2]
    group = num_qo_heads // num_kv_heads
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    scale = (1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale) * k_scale
    logits = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if soft_cap:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    i = torch.arange(qo_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    keep = torch.ones(qo_len, kv_len, dtype=torch.bool)
    if mask is not None:
        keep &= mask
    elif causal:
        keep &= j <= kv_len - qo_len + i
    if window_left >= 0:
        keep &= j >= kv_len - qo_len + i - window_left
    logits = logits.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(logits, -1).T * LOG2E
    probabilities = torch.softmax(logits, -1).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probabilities, vv) * v_scale
    return out, lse


# --------------------------------------------------------------------------- GEMM


def linear_reference(x, w, bias=None):
    """float32 ``x @ w.T (+ bias)``: the bf16 GEMM (w [N, K]) on the rounded inputs."""
    ref = x.float() @ w.float().T
    return ref if bias is None else ref + bias.float()


def per_token_quant_reference(x):
    """sgl-kernel's per-token int8 quantization of ``x [..., K]`` in float32: ``(q uint8 = round(x *
    127 / amax) + 128, scale = amax / 127)``, amax at least 1e-7, rounding half to even."""
    xf = x.float()
    absmax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-7)
    q = torch.round(xf * (torch.full_like(absmax, 127.0) / absmax)).to(torch.int32) + 128
    return q.to(torch.uint8), (absmax / 127).squeeze(-1)


def int8_accumulate_reference(a_q, w):
    """The exact integer sums of the int8 GEMM, ``(a_q - 128) @ w.T``, in float64 (every partial sum
    is an integer below 2^53): a_q uint8 with zero point 128, w int8 [N, K]."""
    return (a_q.double() - 128) @ w.double().T


def int8_linear_reference(a_q, a_scale, w, w_scale, bias=None):
    """float32 int8 GEMM with per-row activation scales a_scale [M] and per-channel weight scales
    w_scale [N]: ``((a_q - 128) @ w.T) * a_scale[:, None] * w_scale (+ bias)``."""
    ref = ((a_q.float() - 128) @ w.float().T) * a_scale.reshape(-1, 1) * w_scale
    return ref if bias is None else ref + bias.float()


def fp8_block_dequantize(w, scale, block):
    """float32 ``w * S``, S the [N, K] expansion of the per-block scales (block = (rows, columns);
    the edge blocks may be partial)."""
    n, k = w.shape
    expanded = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w.float() * expanded


def fp8_block_linear_reference(x, w, scale, block, bias=None):
    """float32 ``x @ (w * S).T (+ bias)`` over the dequantized block-scaled fp8 weight."""
    ref = x.float() @ fp8_block_dequantize(w, scale, block).T
    return ref if bias is None else ref + bias.float()


# --------------------------------------------------------------------------- MoE routing


def partial_sort_order(values, k):
    """The positions of ``values`` (a list) that ``std::partial_sort(first, first + k, last,
    [](a, b) { return a.first > b.first; })`` (libstdc++) brings to the front, in its order: the k
    largest, the order among equal values and their cut at k included. sgl-kernel's CPU routing
    selects experts so. libstdc++'s heap selection (make_heap on the first k, a later element
    replaces the heap's root when strictly larger, then sort_heap), step for step."""
    order = list(range(len(values)))

    def before(a, b):
        return values[a] > values[b]

    def adjust(hole, length, item):  # __adjust_heap, then __push_heap
        top = child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if before(order[child], order[child - 1]):
                child -= 1
            order[hole] = order[child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            order[hole] = order[child - 1]
            hole = child - 1
        while hole > top and before(order[(hole - 1) // 2], item):
            order[hole] = order[(hole - 1) // 2]
            hole = (hole - 1) // 2
        order[hole] = item

    def pop(length, result):  # __pop_heap: the root to `result`, `result`'s item into the heap
        item = order[result]
        order[result] = order[0]
        adjust(0, length, item)

    for parent in range(k // 2 - 1, -1, -1):  # make_heap
        adjust(parent, k, order[parent])
    for i in range(k, len(values)):
        if before(order[i], order[0]):
            pop(k, i)
    for last in range(k - 1, 0, -1):  # sort_heap
        pop(last, last)
    return order[:k]
