"""MoE routing ops (``topk_softmax``, ``topk_sigmoid``, ``grouped_topk``, ``biased_grouped_topk``)
against a float64 torch reference of each rule: the weights as SGLang's Python references compute
them (``python/sglang/srt/layers/moe/topk.py``: ``fused_topk_torch_native``, ``grouped_topk_gpu``,
``biased_grouped_topk_impl``, with ``apply_routed_scaling_factor_on_output``), the experts and their
order as sgl-kernel's CPU kernels choose them (``std::partial_sort`` by value over their candidate
sequence: ``references.partial_sort_order``).

* Values: gating rows whose logits are distinct multiples of 1/32 (exact in bf16 and fp16), so the
  reference's order has no near-ties that fp32 could flip; the biased rule's inputs are redrawn
  until its choice values and group scores are well separated too. E in {8, 60, 64, 128, 256}, k in
  {1, 2, 6, 8, 16}, T in {0, 1, 7, 33}, renormalize on and off, fp32/bf16/fp16 gating, a column
  slice of a wider tensor and a transposed one as gating_output, every tier.
* Ties: the ids must be exactly sgl-kernel's, its order and cut among equal values (experts and
  groups, all groups kept or not), on fp32 and bf16 rows with few distinct values; for k = 1 the
  first of two tied best experts, as ``torch.max`` picks it.
* routed_scaling_factor times every weight (renormalized or not), fused shared experts on the
  grouped rules; many tokens over threads; every argument error.
"""

import math
import re

import pytest
import torch
import torch._dynamo.testing

import kernforge

from op_helpers import seeded
from references import partial_sort_order

RULES = ["topk_softmax", "topk_sigmoid", "grouped_topk", "biased_grouped_topk"]
GROUPED = ["grouped_topk", "biased_grouped_topk"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
EXPERTS = [8, 60, 64, 128, 256]
TOPKS = [1, 2, 6, 8, 16]
TOKENS = [0, 1, 7, 33]
# (num_expert_group, topk_group) per expert count for the grouped rules (DeepSeek-V3: 256, 8, 4)
GROUPS = {8: (4, 2), 60: (6, 3), 64: (8, 4), 128: (8, 4), 256: (8, 4)}
# weights: fp32 kernel (polynomial exp) vs float64
ATOL, RTOL = 1e-7, 1e-5


# --------------------------------------------------------------------------- reference


def ref_route(
    rule,
    gating,
    topk,
    renormalize,
    num_expert_group=1,
    topk_group=1,
    num_fused_shared_experts=0,
    routed_scaling_factor=None,
    correction_bias=None,
):
    """(weights float64 [T, k], ids int32 [T, k], choice values, group scores) of ``rule``, in float64."""
    x = gating.double()
    tokens, experts = x.shape
    scores = x.softmax(-1) if rule in ("topk_softmax", "grouped_topk") else x.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.double()
    group_scores = None
    if rule in GROUPED:
        by_group = choice.view(tokens, num_expert_group, experts // num_expert_group)
        if rule == "grouped_topk":
            group_scores = by_group.max(dim=-1).values
        else:
            group_scores = by_group.topk(2, dim=-1)[0].sum(dim=-1)
    by_token = [None] * tokens if group_scores is None else group_scores.tolist()
    chosen = [sgl_kernel_choice(choice[t].tolist(), by_token[t], topk, topk_group) for t in range(tokens)]
    ids = torch.tensor(chosen, dtype=torch.int64).view(tokens, topk)
    weights = scores.gather(1, ids)
    if num_fused_shared_experts:
        ids[:, -1] = experts + torch.arange(tokens) % num_fused_shared_experts  # SGLang: random in that range
        if routed_scaling_factor is not None:
            weights[:, -1] = weights[:, :-1].sum(dim=-1) / routed_scaling_factor
    if renormalize:
        routed = weights if num_fused_shared_experts == 0 else weights[:, :-1]
        weights = weights / routed.sum(dim=-1, keepdim=True)
    if routed_scaling_factor is not None:  # sgl-kernel: renormalized or not (SGLang's Python: renormalized only)
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32), choice, group_scores


def sgl_kernel_choice(choice, group_scores, topk, topk_group):
    """One token's experts, best first, as sgl-kernel's kernels choose them: the candidates are every
    expert in index order or, by groups, the experts of the ``topk_group`` groups ``partial_sort``
    ranks first, in that order; then ``partial_sort`` of their values."""
    if group_scores is None or len(group_scores) == 1:
        candidates = list(range(len(choice)))
    else:
        size = len(choice) // len(group_scores)
        kept = partial_sort_order(group_scores, topk_group)
        candidates = [g * size + e for g in kept for e in range(size)]
    order = partial_sort_order([choice[c] for c in candidates], topk)
    return [candidates[i] for i in order]


def call(rule, hidden, gating, topk, renormalize, groups=(1, 1), bias=None, **kwargs):
    op = getattr(kernforge, rule)
    if rule == "biased_grouped_topk":
        return op(hidden, gating, bias, topk, renormalize, *groups, **kwargs)
    if rule == "grouped_topk":
        return op(hidden, gating, topk, renormalize, *groups, **kwargs)
    return op(hidden, gating, topk, renormalize)


def check(rule, got, gating, topk, renormalize, groups=(1, 1), bias=None, ctx="", **kwargs):
    weights, ids = got
    tokens = gating.shape[0]
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32, ctx
    assert weights.shape == ids.shape == (tokens, topk), ctx
    assert weights.is_contiguous() and ids.is_contiguous(), ctx
    want_w, want_ids, _, _ = ref_route(rule, gating, topk, renormalize, *groups, correction_bias=bias, **kwargs)
    assert torch.equal(ids, want_ids), f"{ctx}\nids {ids.tolist()}\nwant {want_ids.tolist()}"
    torch.testing.assert_close(weights.double(), want_w, atol=ATOL, rtol=RTOL, msg=lambda m: f"{ctx}\n{m}")


def grid_logits(tokens, experts, g):
    """Each row: distinct multiples of 1/32 (a shifted random permutation), exact in bf16 and fp16."""
    rows = [torch.randperm(experts, generator=g) for _ in range(tokens)]
    perm = torch.stack(rows) if rows else torch.empty(0, experts, dtype=torch.int64)
    shift = torch.randint(-8, 9, (tokens, 1), generator=g)
    return (perm - experts // 2 + shift).float() / 32  # |32 x| <= 136: 8 significant bits


def separated(values, gap=2e-6) -> bool:
    """Whether the distinct values of each row differ by more than ``gap`` (relative; fp32's
    scores are within a few 1e-7)."""
    if values is None or values.numel() == 0:
        return True
    ordered = values.sort(dim=-1).values
    diffs = ordered[:, 1:] - ordered[:, :-1]
    scale = ordered.abs()[:, 1:].clamp_min(1e-30)
    return bool(((diffs == 0) | (diffs > gap * scale)).all())


def inputs(rule, tokens, experts, dtype, g, groups=(1, 1)):
    """(hidden_states, gating_output, correction_bias or None) of ``dtype``. The biased rule's rows
    are redrawn until its choice values and group scores are well separated."""
    hidden = torch.empty(tokens, 3, dtype=torch.bfloat16)
    gating = grid_logits(tokens, experts, g).to(dtype)
    if rule != "biased_grouped_topk":
        return hidden, gating, None
    bias = (torch.rand(experts, generator=g) * 0.5 - 0.25).to(dtype)
    for t in range(tokens):
        for _ in range(100):
            _, _, choice, group_scores = ref_route(rule, gating[t : t + 1], 1, False, *groups, correction_bias=bias)
            if separated(choice) and separated(group_scores):
                break
            gating[t] = grid_logits(1, experts, g)[0].to(dtype)
        else:
            raise AssertionError("no well-separated row in 100 draws")
    return hidden, gating, bias


def _matrix():
    for rule in RULES:
        for experts in EXPERTS:
            available = experts
            if rule in GROUPED:
                groups, kept = GROUPS[experts]
                available = kept * experts // groups
            for topk in TOPKS:
                if topk <= available:
                    yield rule, experts, topk


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rule,experts,topk", list(_matrix()), ids=lambda v: str(v))
def test_routing_matches_the_reference(rule, experts, topk, dtype, tier):
    groups = GROUPS[experts] if rule in GROUPED else (1, 1)
    g = seeded("values", rule, experts, topk, dtype)
    for tokens in TOKENS:
        hidden, gating, bias = inputs(rule, tokens, experts, dtype, g, groups)
        for renormalize in (False, True):
            ctx = f"{rule} E={experts} k={topk} T={tokens} {dtype} renormalize={renormalize} tier={tier}"
            got = call(rule, hidden, gating, topk, renormalize, groups, bias)
            check(rule, got, gating, topk, renormalize, groups, bias, ctx)
            if renormalize and tokens:
                torch.testing.assert_close(got[0].sum(-1), torch.ones(tokens), atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", ["column_slice", "transposed"])
@pytest.mark.parametrize("rule", RULES)
def test_strided_gating_output(rule, layout, tier):
    """A column slice of a wider tensor (rows further apart) and a transposed tensor (strided last
    dimension, copied) give the contiguous result."""
    experts, topk, groups = 64, 6, GROUPS[64]
    hidden, gating, bias = inputs(rule, 9, experts, torch.bfloat16, seeded("strided", rule, layout), groups)
    if layout == "column_slice":
        wide = torch.randn(9, experts + 13).to(torch.bfloat16)
        wide[:, 5 : 5 + experts] = gating
        strided = wide[:, 5 : 5 + experts]
    else:
        strided = gating.t().contiguous().t()
    assert not strided.is_contiguous()
    got = call(rule, hidden, strided, topk, True, groups, bias)
    check(rule, got, gating, topk, True, groups, bias, f"{rule} {layout}")
    want = call(rule, hidden, gating, topk, True, groups, bias)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("rule", RULES)
def test_many_tokens_over_threads(rule, tier):
    """Enough tokens for every thread; the result does not depend on the thread count."""
    experts, topk, groups = 128, 8, GROUPS[128]
    hidden, gating, bias = inputs(rule, 700, experts, torch.float32, seeded("threads", rule), groups)
    saved = kernforge.ops._common._threads_override
    try:
        kernforge.set_num_threads(3)  # more threads than this machine may have: the split is still right
        got = call(rule, hidden, gating, topk, False, groups, bias)
        kernforge.set_num_threads(1)
        one = call(rule, hidden, gating, topk, False, groups, bias)
    finally:
        kernforge.set_num_threads(saved)
    check(rule, got, gating, topk, False, groups, bias, f"{rule} T=700")
    assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])


def test_hidden_states_gives_only_the_token_count():
    gating = grid_logits(5, 64, seeded("hidden"))
    want = kernforge.topk_softmax(torch.empty(5, 16), gating, 4, True)
    for hidden in (torch.empty(5, dtype=torch.int8), torch.empty(5, 2, 3, dtype=torch.float64), torch.empty(5, 0)):
        got = kernforge.topk_softmax(hidden, gating, 4, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --------------------------------------------------------------------------- ties


def tie_rows(tokens, experts, values, g, dtype=torch.float32):
    """Rows drawn from a few distinct values (multiples of 1/4, exact in every dtype): ties
    everywhere, at the cut too."""
    return (torch.randint(0, values, (tokens, experts), generator=g).float() / 4).to(dtype)


TIE_DTYPES = [torch.float32, torch.bfloat16]
# (E, k): k = 1 (the first best), k = E (the whole heap sorted), ties cut at k otherwise
TIE_SHAPES = [(8, 1), (8, 3), (8, 8), (60, 6), (64, 1), (64, 2), (128, 1), (128, 2), (128, 16), (256, 1), (256, 8)]


@pytest.mark.parametrize("dtype", TIE_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("experts,topk", TIE_SHAPES, ids=str)
@pytest.mark.parametrize("rule", ["topk_softmax", "topk_sigmoid"])
def test_ties_come_out_as_sgl_kernel_gives_them(rule, experts, topk, dtype, tier):
    g = seeded("ties", rule, experts, topk, dtype)
    hidden = torch.empty(40, 1)
    for values in (1, 2, 3, 5):
        gating = tie_rows(40, experts, values, g, dtype)
        got = call(rule, hidden, gating, topk, False)
        check(rule, got, gating, topk, False, ctx=f"{rule} E={experts} k={topk} {dtype} values={values}")
    # all equal: sgl-kernel's order of a constant row, whatever the dtype
    for dtype in DTYPES:
        got = call(rule, torch.empty(2, 1), torch.zeros(2, experts, dtype=dtype), topk, True)
        assert got[1][0].tolist() == partial_sort_order([0.0] * experts, topk)
        torch.testing.assert_close(got[0], torch.full((2, topk), 1.0 / topk))


@pytest.mark.parametrize("dtype", TIE_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("experts", [8, 60, 256])
@pytest.mark.parametrize("rule", RULES)
def test_k1_picks_the_first_of_two_tied_best(rule, experts, dtype, tier):
    """Two experts tie exactly for the best score (in one group, for the grouped rules): sgl-kernel
    picks the first, as torch.max does (torch.topk(k=1) on the CPU need not, below 64 experts)."""
    tokens = 24
    g = seeded("first of tied", rule, experts, dtype)
    groups = GROUPS[experts] if rule in GROUPED else (1, 1)
    size = experts // groups[0]
    gating = grid_logits(tokens, experts, g)
    pairs = []  # two experts of one group per token, in index order
    for _ in range(tokens):
        group = int(torch.randint(0, groups[0], (1,), generator=g))
        pairs.append(sorted((group * size + torch.randperm(size, generator=g)[:2]).tolist()))
    low, high = torch.tensor(pairs).T
    best = gating.max(-1).values + 0.25
    rows = torch.arange(tokens)
    gating[rows, low] = best
    gating[rows, high] = best
    gating = gating.to(dtype)
    assert torch.equal(gating[rows, low], gating[rows, high])
    bias = torch.zeros(experts) if rule == "biased_grouped_topk" else None
    weights, ids = call(rule, torch.empty(tokens, 1), gating, 1, False, groups, bias)
    assert torch.equal(ids[:, 0].long(), low), f"{rule} {dtype}: {ids[:, 0].tolist()} want {low.tolist()}"
    assert torch.equal(gating.double().max(-1).indices, low)  # torch.max's rule, the same
    check(rule, (weights, ids), gating, 1, False, groups, bias, f"{rule} {dtype}")


def grouped_tie_rows(tokens, experts, groups, g):
    """Every group of a row a permutation of the same few values: each group scores the same (bit
    for bit, in fp32 as in float64), and experts tie inside groups."""
    size = experts // groups
    rows = []
    for _ in range(tokens):
        base = torch.randint(0, 3, (size,), generator=g).float() / 4
        rows.append(torch.cat([base[torch.randperm(size, generator=g)] for _ in range(groups)]))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", TIE_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "experts,groups,kept,topk",
    [(8, 4, 2, 3), (8, 4, 4, 3), (64, 8, 4, 6), (64, 8, 3, 1), (64, 8, 8, 6), (256, 8, 4, 8), (256, 16, 3, 2)],
    ids=str,
)
@pytest.mark.parametrize("rule", GROUPED)
def test_grouped_ties_come_out_as_sgl_kernel_gives_them(rule, experts, groups, kept, topk, dtype, tier):
    g = seeded("grouped ties", rule, experts, groups, kept, topk, dtype)
    gating = grouped_tie_rows(30, experts, groups, g).to(dtype)
    bias = torch.zeros(experts) if rule == "biased_grouped_topk" else None
    got = call(rule, torch.empty(30, 1), gating, topk, True, (groups, kept), bias)
    check(rule, got, gating, topk, True, (groups, kept), bias, f"{rule} E={experts} groups={groups}/{kept} k={topk}")
    # and rows of few values overall (group scores tie sometimes, not always)
    gating = tie_rows(30, experts, 3, g, dtype)
    got = call(rule, torch.empty(30, 1), gating, topk, False, (groups, kept), bias)
    check(rule, got, gating, topk, False, (groups, kept), bias, f"{rule} E={experts} few values")


# --------------------------------------------------------------------------- bias, shared experts, scaling


def test_bias_chooses_but_does_not_weigh():
    """A large bias on the worst experts makes them chosen; their weights stay their sigmoid."""
    gating = grid_logits(4, 64, seeded("bias"))
    worst = gating[0].argsort()[:2]  # token 0's two worst experts
    bias = torch.zeros(64)
    bias[worst] = 10.0
    weights, ids = kernforge.biased_grouped_topk(torch.empty(4, 1), gating, bias, 2, False, 8, 8)
    assert set(ids[0].tolist()) == set(worst.tolist())
    torch.testing.assert_close(weights[0], gating[0, ids[0].long()].sigmoid())


@pytest.mark.parametrize("scaling", [None, 2.5], ids=["no_scaling", "scaling2.5"])
@pytest.mark.parametrize("shared", [1, 2])
@pytest.mark.parametrize("experts,topk", [(64, 2), (64, 7), (256, 9)], ids=str)
@pytest.mark.parametrize("rule", GROUPED)
def test_fused_shared_experts(rule, experts, topk, shared, scaling, tier):
    groups = GROUPS[experts]
    hidden, gating, bias = inputs(rule, 11, experts, torch.bfloat16, seeded("shared", rule, experts, topk), groups)
    for renormalize in (False, True):
        kwargs = {"num_fused_shared_experts": shared, "routed_scaling_factor": scaling}
        ctx = f"{rule} E={experts} k={topk} shared={shared} scaling={scaling} renormalize={renormalize}"
        got = call(rule, hidden, gating, topk, renormalize, groups, bias, **kwargs)
        check(rule, got, gating, topk, renormalize, groups, bias, ctx, **kwargs)
        weights, ids = got
        assert ((ids[:, -1] >= experts) & (ids[:, -1] < experts + shared)).all(), ctx
        assert (ids[:, :-1] < experts).all(), ctx
        if scaling is not None:  # the shared weight, scaled too: (routed sum) / scaling
            torch.testing.assert_close(weights[:, -1] * scaling, weights[:, :-1].sum(-1), rtol=1e-6, atol=1e-7)
        if scaling is not None and renormalize:  # SGLang's model output: the shared expert once
            torch.testing.assert_close(weights[:, -1], torch.ones(11), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scaling", [1.0, 1.125, 2.5])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("rule", GROUPED)
def test_routed_scaling_factor_scales_every_weight(rule, renormalize, scaling, tier):
    """sgl-kernel's biased_grouped_topk_cpu multiplies the weights by routed_scaling_factor, after
    renormalizing or without it (its own test: SGLang's reference times the factor); 1 (or None)
    changes nothing. The experts do not change."""
    experts, topk, groups = 64, 6, GROUPS[64]
    hidden, gating, bias = inputs(rule, 9, experts, torch.bfloat16, seeded("scaling", rule, renormalize), groups)
    plain = call(rule, hidden, gating, topk, renormalize, groups, bias)
    scaled = call(rule, hidden, gating, topk, renormalize, groups, bias, routed_scaling_factor=scaling)
    ctx = f"{rule} renormalize={renormalize} scaling={scaling}"
    check(rule, scaled, gating, topk, renormalize, groups, bias, ctx, routed_scaling_factor=scaling)
    assert torch.equal(scaled[1], plain[1]), ctx
    if scaling == 1.0:
        assert torch.equal(scaled[0], plain[0]), ctx
    torch.testing.assert_close(scaled[0], plain[0] * scaling, rtol=1e-6, atol=0, msg=lambda m: f"{ctx}\n{m}")
    if renormalize:
        torch.testing.assert_close(scaled[0].sum(-1), torch.full((9,), scaling), rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- errors


def _names(arg):
    return re.compile(rf"\b{re.escape(arg)}\b")


def _args(rule, **change):
    """Well-formed arguments of ``rule`` (E = 64 in 8 groups, 4 kept, k = 6), with ``change``."""
    args = {
        "hidden_states": torch.zeros(5, 16, dtype=torch.bfloat16),
        "gating_output": torch.randn(5, 64),
        "topk": 6,
        "renormalize": True,
    }
    if rule in GROUPED:
        args.update(num_expert_group=8, topk_group=4)
    if rule == "biased_grouped_topk":
        args["correction_bias"] = torch.zeros(64)
    args.update(change)
    return args


ERRORS = [  # (rules, change, exception, the argument named)
    (RULES, {"gating_output": torch.randn(5, 64).int()}, TypeError, "gating_output"),
    (RULES, {"gating_output": torch.randn(5, 64).double()}, TypeError, "gating_output"),
    (RULES, {"gating_output": [[0.0] * 64] * 5}, TypeError, "gating_output"),
    (RULES, {"gating_output": torch.randn(5, 64, device="meta")}, ValueError, "gating_output"),
    (RULES, {"gating_output": torch.randn(64)}, ValueError, "gating_output"),
    (RULES, {"gating_output": torch.randn(1, 5, 64)}, ValueError, "gating_output"),
    (RULES, {"gating_output": torch.randn(5, 0)}, ValueError, "gating_output"),
    (RULES, {"hidden_states": torch.zeros(4, 16)}, ValueError, "hidden_states"),
    (RULES, {"hidden_states": torch.zeros(())}, ValueError, "hidden_states"),
    (RULES, {"hidden_states": None}, TypeError, "hidden_states"),
    (RULES, {"topk": 0}, ValueError, "topk"),
    (RULES, {"topk": 17}, ValueError, "topk"),
    (RULES, {"topk": 2.0}, TypeError, "topk"),
    (["topk_softmax"], {"gating_output": torch.randn(5, 4)}, ValueError, "topk"),  # k > E
    (RULES, {"renormalize": 1}, TypeError, "renormalize"),
    (GROUPED, {"num_expert_group": 7}, ValueError, "num_expert_group"),
    (GROUPED, {"num_expert_group": 0}, ValueError, "num_expert_group"),
    (GROUPED, {"num_expert_group": 8.0}, TypeError, "num_expert_group"),
    (GROUPED, {"topk_group": 0}, ValueError, "topk_group"),
    (GROUPED, {"topk_group": 9}, ValueError, "topk_group"),
    (GROUPED, {"topk_group": 1, "topk": 9}, ValueError, "topk"),  # more than one group's 8 experts
    (GROUPED, {"num_fused_shared_experts": -1}, ValueError, "num_fused_shared_experts"),
    (GROUPED, {"num_fused_shared_experts": 1, "topk": 1}, ValueError, "topk"),
    (GROUPED, {"routed_scaling_factor": 0.0}, ValueError, "routed_scaling_factor"),
    (GROUPED, {"routed_scaling_factor": -2.5}, ValueError, "routed_scaling_factor"),
    (GROUPED, {"routed_scaling_factor": math.inf}, ValueError, "routed_scaling_factor"),
    (GROUPED, {"routed_scaling_factor": "2.5"}, TypeError, "routed_scaling_factor"),
    (["biased_grouped_topk"], {"num_expert_group": 64, "topk_group": 8}, ValueError, "num_expert_group"),
    (["biased_grouped_topk"], {"correction_bias": torch.zeros(63)}, ValueError, "correction_bias"),
    (["biased_grouped_topk"], {"correction_bias": torch.zeros(1, 64)}, ValueError, "correction_bias"),
    (["biased_grouped_topk"], {"correction_bias": torch.zeros(64, dtype=torch.int32)}, TypeError, "correction_bias"),
    (["biased_grouped_topk"], {"correction_bias": None}, TypeError, "correction_bias"),
    (["biased_grouped_topk"], {"correction_bias": torch.zeros(64, device="meta")}, ValueError, "correction_bias"),
]


@pytest.mark.parametrize(
    "rule,change,error,named",
    [(rule, change, error, named) for rules, change, error, named in ERRORS for rule in rules],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_argument_errors_name_the_argument(rule, change, error, named):
    args = _args(rule, **change)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
    with pytest.raises(error, match=_names(named)):
        getattr(kernforge, rule)(**args)
    for k, v in before.items():
        assert torch.equal(args[k], v), f"{k} was written"


def test_no_tokens_gives_empty_results():
    for rule in RULES:
        weights, ids = getattr(kernforge, rule)(
            **_args(rule, hidden_states=torch.empty(0, 16), gating_output=torch.empty(0, 64))
        )
        assert weights.shape == ids.shape == (0, 6) and weights.dtype == torch.float32 and ids.dtype == torch.int32


# --------------------------------------------------------------------------- traced


def test_routing_compiles_into_one_graph():
    """torch.compile traces each op as one torch.ops.kernforge node (fake kernels give the shapes)."""
    from kernforge import torch_library as tl

    hidden, gating, bias = inputs("biased_grouped_topk", 6, 64, torch.bfloat16, seeded("compiled"), GROUPS[64])

    def route(hidden, gating, bias):
        weights, ids = tl.biased_grouped_topk(hidden, gating, bias, 6, True, 8, 4, 1, 2.5)
        soft_weights, soft_ids = tl.topk_softmax(hidden, gating, 4, False)
        return weights * 2, ids, soft_weights.sum(-1), soft_ids

    counter = torch._dynamo.testing.CompileCounter()
    got = torch.compile(route, backend=counter, fullgraph=True)(hidden, gating, bias)
    want = route(hidden, gating, bias)
    assert counter.frame_count == 1
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("topk", [1, 3, 8])
def test_torch_tie_order_is_torch_topks(dtype, topk):
    """ties="torch" (vLLM's CPU router): the experts torch.topk picks from the values the choice is
    made on (the logits; the groups not kept masked to -inf), equal values included."""
    tokens, experts, groups, kept = 37, 16, 4, 2
    gating = torch.randint(-3, 4, (tokens, experts), generator=torch.Generator().manual_seed(topk)).to(dtype)
    values = gating.float()
    _, ids = kernforge.topk_softmax(gating, gating, topk, False, ties="torch")
    assert torch.equal(ids, torch.topk(values, topk).indices.int())
    _, ids = kernforge.grouped_topk(gating, gating, topk, False, groups, kept, ties="torch")
    kept_groups = torch.topk(values.view(tokens, groups, -1).max(-1).values, kept).indices
    in_kept = torch.zeros(tokens, groups, dtype=torch.bool).scatter_(1, kept_groups, True)
    masked = values.masked_fill(~in_kept.repeat_interleave(experts // groups, 1), float("-inf"))
    assert torch.equal(ids, torch.topk(masked, topk).indices.int())


def test_unknown_tie_order_is_an_error_naming_the_choices():
    gating = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"ties must be one of \['sgl-kernel', 'torch'\]"):
        kernforge.topk_sigmoid(gating, gating, 2, False, ties="aten")
