"""MoE routing: sgl-kernel's CPU routing ops as of sglang commit 0c71a5e9 (undated here; it has PR
#31956 of 2026-07; ``python/sglang/kernels/aot/csrc/cpu/topk.cpp``, formerly ``sgl-kernel/csrc/cpu/topk.cpp``),
with the rules of SGLang's Python references (``python/sglang/srt/layers/moe/topk.py``) where the CPU
kernels stop short (any expert count, any k up to 16, fused shared experts). sgl-kernel's
``topk_softmax_cpu`` / ``topk_sigmoid_cpu`` also take an optional ``correction_bias`` now; these do not.

Each op returns ``(topk_weights fp32 [T, k], topk_ids int32 [T, k])`` for a gating row per token
(``gating_output [T, E]``, fp32, bf16 or fp16, computed in fp32; rows may be strided);
``hidden_states`` gives only the token count ``T`` (its first dimension), as in sgl-kernel.

* ``topk_softmax``: the k largest of ``softmax(gating)``.
* ``topk_sigmoid``: the k largest of ``sigmoid(gating)``.
* ``grouped_topk`` (DeepSeek-V2): softmax scores; the experts form ``num_expert_group`` equal
  contiguous groups scored by their best expert; the ``topk_group`` best groups are kept and the k
  best experts among theirs chosen.
* ``biased_grouped_topk`` (DeepSeek-V3/R1): sigmoid scores; the choice (groups scored by the sum
  of their two best, then experts) uses ``score + correction_bias``, the weights are the unbiased
  scores of the chosen experts.

The k entries come best first (by the value they were chosen by: the biased score for the biased
rule, so its weights need not descend). Ties follow sgl-kernel's kernels: ``std::partial_sort``
(libstdc++) comparing values alone, over the candidates in sgl-kernel's order: every expert in index
order, or, for the grouped rules, the kept groups in the order ``std::partial_sort`` ranks them from
index order (ranked even when all are kept), each group's experts in index order. So for k = 1 the
first best candidate wins (for the ungrouped rules the lowest index, as ``torch.max`` gives it); for
k > 1 equal values are ordered, and cut at k, as libstdc++'s heap selection leaves them, which is
not ``torch.topk``'s order. ``ties="torch"`` gives ``torch.topk``'s order instead (CPU, over every
expert in index order, the groups not kept masked to -inf; the groups picked the same way): what
vLLM's CPU router chooses, which kernforge's vLLM plugin asks for. One difference: softmax and
sigmoid choose on the logits (the same order, being monotone), so two different logits never tie,
where sgl-kernel's fp32 softmax scores may.

``renormalize`` divides the weights by the sum of the routed ones. ``routed_scaling_factor`` (the
grouped rules; ``None`` is 1) multiplies every weight, with or without ``renormalize``, as
sgl-kernel's ``biased_grouped_topk_cpu`` does (one factor: ``routed_scaling_factor / sum`` when
renormalizing); SGLang passes it there only when the model does not scale the MoE output itself
(``apply_routed_scaling_factor_on_output``), so a caller that scales the output passes none.
``grouped_topk`` scales the same way (sgl-kernel's ``grouped_topk_cpu`` takes only ``None`` or 1).

``num_fused_shared_experts > 0`` (the grouped rules; SGLang's ``grouped_topk`` /
``biased_grouped_topk_impl``, which sgl-kernel's CPU ops refuse): ``topk`` counts one fused shared
expert, which takes the last slot (the k-th choice is dropped) with id ``E + t %
num_fused_shared_experts`` for token ``t`` (SGLang draws it at random in that range) and, given
``routed_scaling_factor``, weight ``sum(routed weights) / routed_scaling_factor`` (without it, the
dropped expert's weight stays, as in SGLang) before the factor above, whose sum is that of the
``k - 1`` routed weights. Renormalized and scaled, the shared expert weighs 1 and the routed ones
sum to ``routed_scaling_factor``: SGLang's routing followed by its scaling of the MoE output.

Wrong arguments raise before anything is written: ``TypeError`` for a wrong type or dtype,
``ValueError`` for a wrong shape or value, naming the argument.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from kernforge.jit.module import Codes, DType, Entry, Module
from kernforge.ops._common import num_threads, readable_rows, variant_for_input
from kernforge.ops._registry import DTYPE_NAMES, Traced, kernel_op, model_kernels

# How the kernel scores and chooses (kernforge/moe/routing.h).
RULE = Codes(
    "kf::moe::RoutingRule",
    (("kSoftmax", 0), ("kSigmoid", 1), ("kGroupedSoftmax", 2), ("kBiasedGroupedSigmoid", 3)),
)
# Whose order equal values come in: sgl-kernel's kernels' or torch.topk's (vLLM's CPU router).
TIES = Codes("kf::moe::TieOrder", (("kSglKernel", 0), ("kTorchTopk", 1)))
TIE_ORDERS = {"sgl-kernel": TIES.kSglKernel, "torch": TIES.kTorchTopk}
ROUTING = Module(
    "moe_routing",
    "moe_routing.cpp.jinja",
    params={"dtype": DType()},
    codes=[RULE, TIES],
    entries=[
        Entry(
            "route",
            "int64_t topk_weights, int64_t topk_ids, int64_t gating, int64_t gating_stride, int64_t num_tokens, "
            "int64_t num_experts, int64_t topk, int64_t rule, int64_t num_groups, int64_t topk_group, int64_t bias, "
            "int64_t renormalize, int64_t num_shared, double routed_scaling_factor, int64_t ties, int64_t num_threads",
        )
    ],
)
MAX_TOPK = 16
# The rules as plain ints (Codes' attribute lookup is a scan): read on every call.
_SOFTMAX, _SIGMOID, _GROUPED, _BIASED = RULE.kSoftmax, RULE.kSigmoid, RULE.kGroupedSoftmax, RULE.kBiasedGroupedSigmoid


def _routing_outputs(gating_output, topk):
    tokens = gating_output.shape[0]
    return (
        gating_output.new_empty((tokens, topk), dtype=torch.float32),
        gating_output.new_empty((tokens, topk), dtype=torch.int32),
    )


def _fake(hidden_states, gating_output, topk, *args):
    return _routing_outputs(gating_output, topk)


def _biased_fake(hidden_states, gating_output, correction_bias, topk, *args):
    return _routing_outputs(gating_output, topk)


_ROUTES = Traced("(Tensor, Tensor)", fake=_fake)
_BIASED_ROUTES = Traced("(Tensor, Tensor)", fake=_biased_fake)


@kernel_op(ROUTING, traced=_ROUTES)
def topk_softmax(
    hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool, ties: str = "sgl-kernel"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` largest of ``softmax(gating_output)`` per token: ``(weights fp32, ids int32)``."""
    return _route(topk_softmax.kernels, _SOFTMAX, hidden_states, gating_output, topk, renormalize, ties=ties)


@kernel_op(ROUTING, traced=_ROUTES)
def topk_sigmoid(
    hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool, ties: str = "sgl-kernel"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` largest of ``sigmoid(gating_output)`` per token: ``(weights fp32, ids int32)``."""
    return _route(topk_sigmoid.kernels, _SIGMOID, hidden_states, gating_output, topk, renormalize, ties=ties)


@kernel_op(ROUTING, traced=_ROUTES)
def grouped_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    num_fused_shared_experts: int = 0,
    routed_scaling_factor: float | None = None,
    ties: str = "sgl-kernel",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing: softmax scores, the ``topk_group`` groups with the best expert kept,
    the ``topk`` best experts of those; weights times ``routed_scaling_factor`` (see the module's
    docstring for it and the shared expert)."""
    return _route(
        grouped_topk.kernels,
        _GROUPED,
        hidden_states,
        gating_output,
        topk,
        renormalize,
        num_expert_group,
        topk_group,
        num_fused_shared_experts,
        routed_scaling_factor,
        ties=ties,
    )


@kernel_op(ROUTING, traced=_BIASED_ROUTES)
def biased_grouped_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    num_fused_shared_experts: int = 0,
    routed_scaling_factor: float | None = None,
    ties: str = "sgl-kernel",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing: sigmoid scores, chosen by ``score + correction_bias`` (groups by the
    sum of their two best), weighted by the unbiased scores times ``routed_scaling_factor`` (see the
    module's docstring)."""
    return _route(
        biased_grouped_topk.kernels,
        _BIASED,
        hidden_states,
        gating_output,
        topk,
        renormalize,
        num_expert_group,
        topk_group,
        num_fused_shared_experts,
        routed_scaling_factor,
        correction_bias,
        ties,
    )


# --------------------------------------------------------------------------- checks and the call


def _int(value, name: str) -> int:
    if type(value) is int:  # the warm path
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _gating(gating_output, hidden_states) -> tuple[torch.Tensor, int, int, int]:
    """(rows to read, their stride, T, E), after the checks of gating_output and hidden_states."""
    shape = gating_output.shape
    if len(shape) != 2:
        raise ValueError(f"gating_output must be 2-D [tokens, experts], got shape {tuple(shape)}")
    tokens, experts = shape
    if experts < 1:
        raise ValueError(f"gating_output must have at least one expert, got shape {tuple(gating_output.shape)}")
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dim() < 1 or hidden_states.shape[0] != tokens:
        raise ValueError(
            f"hidden_states must have gating_output's {tokens} tokens as its first dimension, got shape "
            f"{tuple(hidden_states.shape)}"
        )
    rows, strides = readable_rows(gating_output, shape, gating_output.stride())
    return rows, strides[0], tokens, experts


def _bias(correction_bias, experts: int) -> torch.Tensor:
    """correction_bias as a contiguous fp32 [E] tensor, after its checks."""
    if not isinstance(correction_bias, torch.Tensor):
        raise TypeError(f"correction_bias must be a torch.Tensor, got {type(correction_bias).__name__}")
    if correction_bias.dtype not in DTYPE_NAMES:
        raise TypeError(
            f"correction_bias has dtype {correction_bias.dtype}; expected torch.float32, torch.bfloat16 or "
            "torch.float16"
        )
    if not correction_bias.is_cpu:
        raise ValueError(f"correction_bias is on device {correction_bias.device}; kernforge kernels run on the CPU")
    if tuple(correction_bias.shape) != (experts,):
        raise ValueError(
            f"correction_bias must have shape [{experts}] (gating_output's experts), got {tuple(correction_bias.shape)}"
        )
    return correction_bias.to(torch.float32).contiguous()


def _route(
    kernels,
    rule: int,
    hidden_states,
    gating_output,
    topk,
    renormalize,
    num_expert_group=1,
    topk_group=1,
    num_fused_shared_experts=0,
    routed_scaling_factor=None,
    correction_bias=None,
    ties="sgl-kernel",
):
    variant = variant_for_input(kernels, gating_output, "gating_output")
    rows, row_stride, tokens, experts = _gating(gating_output, hidden_states)
    topk = _int(topk, "topk")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    groups, kept = _int(num_expert_group, "num_expert_group"), _int(topk_group, "topk_group")
    shared = _int(num_fused_shared_experts, "num_fused_shared_experts")
    if groups < 1 or experts % groups:
        raise ValueError(f"num_expert_group must divide the {experts} experts, got {groups}")
    if not 1 <= kept <= groups:
        raise ValueError(f"topk_group must be in [1, num_expert_group = {groups}], got {kept}")
    if rule == _BIASED and experts // groups < 2:
        raise ValueError(
            f"num_expert_group = {groups} leaves {experts // groups} expert per group; biased_grouped_topk scores a "
            "group by its two best experts"
        )
    available = kept * (experts // groups)
    if not 1 <= topk <= min(MAX_TOPK, available):
        where = f"the {experts} experts" if kept == groups else f"the {available} experts of {kept} groups"
        raise ValueError(f"topk must be in [1, {min(MAX_TOPK, available)}] ({where}, at most {MAX_TOPK}), got {topk}")
    if shared < 0:
        raise ValueError(f"num_fused_shared_experts must be >= 0, got {shared}")
    if shared and topk < 2:
        raise ValueError(f"topk must be >= 2 with a fused shared expert (it takes the last of the topk), got {topk}")
    scaling = 0.0  # none
    if routed_scaling_factor is not None:
        if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, Real):
            raise TypeError(
                f"routed_scaling_factor must be a float or None, got {type(routed_scaling_factor).__name__}"
            )
        scaling = float(routed_scaling_factor)
        if not (math.isfinite(scaling) and scaling > 0):
            raise ValueError(f"routed_scaling_factor must be finite and > 0, got {routed_scaling_factor}")
    tie_order = TIE_ORDERS.get(ties) if isinstance(ties, str) else None
    if tie_order is None:
        raise ValueError(f"ties must be one of {sorted(TIE_ORDERS)}, got {ties!r}")
    bias = None if rule != _BIASED else _bias(correction_bias, experts)

    weights = torch.empty((tokens, topk), dtype=torch.float32)
    ids = torch.empty((tokens, topk), dtype=torch.int32)
    if tokens:
        variant.kernel().route(
            weights.data_ptr(),
            ids.data_ptr(),
            rows.data_ptr(),
            row_stride,
            tokens,
            experts,
            topk,
            rule,
            groups,
            kept,
            0 if bias is None else bias.data_ptr(),
            int(renormalize),
            shared,
            scaling,
            tie_order,
            num_threads(),
        )
    return weights, ids


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    """A MoE model routes its router's logits (in the router's dtype: fp32 for DeepSeek's) with one
    kernel for every rule (topk_softmax, grouped_topk, biased_grouped_topk)."""
    return [{"op": "topk_softmax", "dtype": spec.router_dtype}] if spec.num_experts else []
