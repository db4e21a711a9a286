"""Fuzz targets: MoE. ``fused_experts`` and ``shared_expert`` over every weight kind (bf16 packed and
raw, int8 w8a8, fp8 block-scaled, int4 W4A8 and W4A16), and the routing ops ``topk_softmax``,
``topk_sigmoid``, ``grouped_topk``, ``biased_grouped_topk``.

The experts' reference is tests/moe's, in float64: per expert, ``silu(x W1g^T) * (x W1u^T)`` rounded to
the activations' dtype (as the kernel stores it), times ``W2^T``, weighted; over the dequantized weights,
with x and the intermediate quantized per token as the kernel does for int8 w8a8 and W4A8. Both sides are
divided by the reference's largest magnitude, so the tolerance is tests/moe's "max error <= tol x the
output's scale" (fp32 2e-5, fp16 2e-3, bf16 1.6e-2; 1.6e-2 for the quantized activations, see
experts_tolerance).

Routing: gating rows are distinct multiples of 1/32 (exact in bf16 and fp16; test_moe_routing.py's
grid), and a biased row is redrawn until its choice values and group scores are well apart, so no two
candidates tie, nor nearly (fp32 scores could flip a near-tie): the choice is then one set in one order
on every tier and for both ``ties`` rules, and the tiers must agree. (Ties themselves are
test_moe_routing.py's: sgl-kernel's partial_sort order is checked there.) Weights to test_moe_routing's
(1e-7, 1e-5), ids exactly.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from fuzzing import FuzzFailure, generator, size
from targets_attention import target, threads

import kernforge
from kernforge.ops.moe.experts import (
    CPUQuantMethod,
    pack_experts,
    pack_experts_fp8,
    pack_experts_int4,
    pack_experts_int8,
)

from references import fp8_block_dequantize, partial_sort_order, per_token_quant_reference

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EXPERTS_TOL = {FP32: 2e-5, FP16: 2e-3, BF16: 1.6e-2}  # x the output's scale (tests/moe)
QUANTIZED_TOL = 1.6e-2  # int8 w8a8 and W4A8 (test_fused_experts.py's int8 test)
ROUTING_TOL = (1e-7, 1e-5)  # test_moe_routing.py: the fp32 kernel (polynomial exp) vs float64
KINDS = ["bf16", "bf16", "bf16_raw", "int8", "int8_raw", "fp8", "fp8_raw", "int4_w4a16", "int4_w4a8"]
FP8_BLOCKS = [(128, 128), (64, 64), (32, 48)]


# --------------------------------------------------------------------------- experts


def draw_experts(shared: bool):
    def draw(rng: random.Random) -> dict:
        kind = rng.choice(KINDS)
        int4 = kind.startswith("int4")
        experts = 1 if shared else rng.choice([1, 2, 4, 8, 16, 60])
        # int4 groups need K (H and I) a multiple of 4; I a multiple of 32 may be packed in one part
        hidden = rng.choice([64, 96, 128, 200] if int4 else [33, 64, 96, 130, 200])
        inter = rng.choice([32, 40, 64, 72] if int4 else [17, 32, 40, 64, 70])
        return {
            "seed": rng.getrandbits(31),
            "kind": kind,
            "dtype": rng.choice([BF16, BF16, FP16, FP32]),
            "tokens": rng.choice([size(rng, 70), size(rng, 70), rng.randint(71, 300)]),
            "hidden": hidden,
            "inter": inter,
            "experts": experts,
            "topk": 1 if shared else rng.randint(1, min(8, experts)),
            "skew": rng.choice([None, None, "one", "few"]),
            "one_part": inter % 32 == 0 and kind == "bf16" and rng.random() < 0.5,  # w1 packed unsplit
            "block": rng.choice(FP8_BLOCKS),
            "x_rows": rng.choice(["contiguous", "strided"]),
            "weights_dtype": rng.choice([FP32, FP32, BF16, torch.float64]),  # topk_weights, read as fp32
            "ids_dtype": rng.choice([torch.int32, torch.int64]),
            "output": rng.choice(["fresh", "fresh", "out", "inplace"]),
            "routed": shared and rng.random() < 0.7,  # shared_expert's fused_experts_out and scaling factor
            "scaling": rng.choice([1.0, 2.5, 0.3]),
            "threads": rng.choice([1, 2, 3]),
        }

    return draw


def route(case, g):
    """(topk_weights [T, k], topk_ids [T, k]): distinct experts per token, k slots in random order."""
    T, E, k = case["tokens"], case["experts"], case["topk"]
    scores = torch.rand(T, E, generator=g)
    if case["skew"] == "few":
        scores[:, 2 * k :] = -1.0
    if case["skew"] == "one":
        scores[:, 3 % E] = 2.0
    weights, ids = torch.topk(scores, k, dim=-1)
    order = torch.argsort(torch.rand(T, k, generator=g), dim=-1)
    return weights.gather(1, order).softmax(-1), ids.gather(1, order)


def expert_weights(case, g):
    """(w1 args, w2 args, call kwargs, dequantized w1 [E, 2I, H], dequantized w2 [E, H, I]) in float64."""
    E, H, inter, kind = case["experts"], case["hidden"], case["inter"], case["kind"]
    w1 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).bfloat16()
    if kind in ("bf16", "bf16_raw"):
        if kind == "bf16_raw":
            return w1, w2, {}, w1.double(), w2.double()
        return pack_experts(w1, gated=not case["one_part"]), pack_experts(w2), {}, w1.double(), w2.double()
    if kind.startswith("int8"):
        q1 = torch.randint(-127, 128, (E, 2 * inter, H), generator=g, dtype=torch.int8)
        q2 = torch.randint(-127, 128, (E, H, inter), generator=g, dtype=torch.int8)
        s1 = (torch.rand(E, 2 * inter, generator=g) + 0.5) / (73 * H**0.5)
        s2 = (torch.rand(E, H, generator=g) + 0.5) / (73 * inter**0.5)
        d1, d2 = q1.double() * s1.double()[..., None], q2.double() * s2.double()[..., None]
        if kind == "int8_raw":
            return q1, q2, {"use_int8_w8a8": True, "w1_scale": s1, "w2_scale": s2}, d1, d2
        p1, p2 = pack_experts_int8(q1, s1, gated=True), pack_experts_int8(q2, s2)
        return p1, p2, {"use_int8_w8a8": True}, d1, d2
    if kind.startswith("fp8"):
        block = case["block"]

        def stack(n, k):
            w = (torch.randn(E, n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = (torch.rand(E, -(-n // block[0]), -(-k // block[1]), generator=g) + 0.5) / (64 * k**0.5)
            dequantized = torch.stack([fp8_block_dequantize(w[e], scale[e], block) for e in range(E)]).double()
            return w, scale, dequantized

        (q1, s1, d1), (q2, s2, d2) = stack(2 * inter, H), stack(H, inter)
        if kind == "fp8_raw":
            flags = {"use_fp8_w8a16": True, "w1_scale": s1, "w2_scale": s2, "block_size": list(block)}
            return q1, q2, flags, d1, d2
        p1, p2 = pack_experts_fp8(q1, s1, block, gated=True), pack_experts_fp8(q2, s2, block)
        return p1, p2, {"use_fp8_w8a16": True}, d1, d2
    p1, p2 = pack_experts_int4(w1, w2, group_size=None)
    method = CPUQuantMethod.INT4_W4A8 if kind == "int4_w4a8" else CPUQuantMethod.INT4_W4A16
    return p1, p2, {"moe_comp_method": method}, p1.dequantize(torch.float64), p2.dequantize(torch.float64)


def experts_reference(x, d1, d2, topk_weights, topk_ids, quantized: bool):
    """float64 MoE over dequantized experts: silu(gate) * up rounded to x's dtype; ``quantized``: x and
    the intermediate per token to int8 first (int8 w8a8, W4A8), as the kernel multiplies them."""
    tokens, hidden = x.shape
    inter = d2.shape[2]

    def rows(a):
        if not quantized:
            return a.double()
        q, scale = per_token_quant_reference(a)
        return (q.double() - 128) * scale.double()[:, None]

    out = torch.zeros(tokens, hidden, dtype=torch.float64)
    xs = rows(x)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate_up = xs[token] @ d1[e].T
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        out.index_add_(0, token, (rows(act) @ d2[e].T) * topk_weights[token, slot, None].double())
    return out


def experts_inputs(case):
    g = generator(case)
    w1, w2, flags, d1, d2 = expert_weights(case, g)
    x = torch.randn(case["tokens"], case["hidden"], generator=g).to(case["dtype"])
    weights, ids = route(case, g)
    routed = torch.randn(case["tokens"], case["hidden"], generator=g).to(case["dtype"])
    quantized = case["kind"].startswith("int8") or case["kind"] == "int4_w4a8"
    expected = experts_reference(x, d1, d2, weights.to(case["weights_dtype"]).float(), ids, quantized)
    return {"x": x, "w1": w1, "w2": w2, "flags": flags, "weights": weights, "ids": ids, "routed": routed,
            "expected": expected}  # fmt: skip


def laid_out_rows(x: torch.Tensor, how: str) -> torch.Tensor:
    if how != "strided":
        return x.clone()
    backing = torch.full((x.shape[0], x.shape[1] + 5), math.nan, dtype=x.dtype)
    backing[:, 2 : 2 + x.shape[1]] = x
    return backing[:, 2 : 2 + x.shape[1]]


def output_args(case, x):
    """(inplace, out) of the case: run() allocates, writes a NaN-filled buffer, or writes into x."""
    if case["output"] == "inplace":
        return True, None
    if case["output"] == "out":
        return False, torch.full(x.shape, math.nan, dtype=x.dtype)
    return False, None


def scaled(result: torch.Tensor, expected: torch.Tensor) -> dict:
    scale = max(expected.abs().max().item(), 1e-3) if expected.numel() else 1.0
    return {"out": result.double() / scale}


def fused_experts_run(case, inputs):
    x = laid_out_rows(inputs["x"], case["x_rows"])
    inplace, out = output_args(case, x)
    weights = inputs["weights"].to(case["weights_dtype"])
    ids = inputs["ids"].to(case["ids_dtype"])
    with threads(case["threads"]):
        result = kernforge.fused_experts(
            x, inputs["w1"], inputs["w2"], weights, ids, inplace=inplace, out=out, **inputs["flags"]
        )
    if (inplace and result is not x) or (out is not None and result is not out):
        raise FuzzFailure("fused_experts did not return the tensor it was told to write")
    return scaled(result, inputs["expected"])


def fused_experts_reference(case, inputs):
    return scaled(inputs["expected"], inputs["expected"])


def single(w):
    """A raw stacked weight of one expert as a shared expert's raw weight; packed ones as they are."""
    return w[0] if isinstance(w, torch.Tensor) else w


def shared_flags(flags: dict) -> dict:
    """fused_experts' flags for one shared expert: raw scales without the expert dimension."""
    return {name: value[0] if name.endswith("_scale") else value for name, value in flags.items()}


def shared_inputs(case):
    inputs = experts_inputs(case)
    mlp = inputs["expected"]  # every token on the one expert, weight 1
    if case["routed"]:
        inputs["expected"] = mlp + case["scaling"] * inputs["routed"].double()
    return inputs


def shared_expert_run(case, inputs):
    x = laid_out_rows(inputs["x"], case["x_rows"])
    inplace, out = output_args(case, x)
    routed = (inputs["routed"].clone(), case["scaling"]) if case["routed"] else (None, None)
    with threads(case["threads"]):
        result = kernforge.shared_expert(
            x, single(inputs["w1"]), single(inputs["w2"]), *routed, inplace=inplace, out=out,
            **shared_flags(inputs["flags"]),
        )  # fmt: skip
    if (inplace and result is not x) or (out is not None and result is not out):
        raise FuzzFailure("shared_expert did not return the tensor it was told to write")
    return scaled(result, inputs["expected"])


def draw_shared(rng: random.Random) -> dict:
    case = draw_experts(True)(rng)
    case["topk"], case["skew"] = 1, None
    return case


def experts_tolerance(case):
    if case["kind"].startswith("int8") or case["kind"] == "int4_w4a8":
        # Activations quantized per token: an fp32 intermediate one ulp off the reference's (the kernel's
        # summation order) flips an int8 code now and then, a few 1e-4 of the output's scale at fp32 and
        # fp16; test_fused_experts.py's int8 tolerance, 1.6e-2, whatever the activations' dtype.
        return (QUANTIZED_TOL, 0.0)
    return (EXPERTS_TOL[case["dtype"]], 0.0)


# --------------------------------------------------------------------------- routing

RULES = ("topk_softmax", "topk_sigmoid", "grouped_topk", "biased_grouped_topk")
# (E, num_expert_group choices): DeepSeek-V3's 256 experts in 8 groups, and smaller ones
EXPERT_COUNTS = [3, 8, 16, 60, 64, 128, 256]


def draw_routing(rule: str):
    def draw(rng: random.Random) -> dict:
        grouped = rule in ("grouped_topk", "biased_grouped_topk")
        counts = [e for e in EXPERT_COUNTS if not (rule == "biased_grouped_topk" and e < 4)]
        experts = rng.choice(counts)
        groups = 1
        if grouped:
            minimum = 2 if rule == "biased_grouped_topk" else 1  # the biased rule scores a group by its two best
            divisors = [d for d in range(1, min(experts, 16) + 1) if experts % d == 0 and experts // d >= minimum]
            groups = rng.choice(divisors)
        kept = rng.randint(1, groups)
        available = min(16, kept * experts // groups)
        shared = grouped and available >= 2 and rng.random() < 0.25  # a fused shared expert takes one of k >= 2
        topk = rng.randint(2 if shared else 1, available)
        return {
            "seed": rng.getrandbits(31),
            "tokens": size(rng, 40),
            "experts": experts,
            "topk": topk,
            "renormalize": rng.random() < 0.5,
            "groups": groups,
            "kept": kept,
            "shared": rng.choice([1, 2]) if shared else 0,
            "scaling": rng.choice([None, 2.5]) if grouped else None,
            "dtype": rng.choice([FP32, BF16, FP16]),
            "layout": rng.choice(["contiguous", "column_slice", "transposed"]),
            "ties": rng.choice(["sgl-kernel", "torch"]),
            "threads": rng.choice([1, 2, 3]),
        }

    return draw


def grid_logits(tokens, experts, g):
    """Each row: distinct multiples of 1/32 (a shifted random permutation), exact in bf16 and fp16."""
    rows = [torch.randperm(experts, generator=g) for _ in range(tokens)]
    perm = torch.stack(rows) if rows else torch.empty(0, experts, dtype=torch.int64)
    shift = torch.randint(-8, 9, (tokens, 1), generator=g)
    return (perm - experts // 2 + shift).float() / 32


def separated(values, gap=2e-6) -> bool:
    """Whether the distinct values of each row differ by more than ``gap`` (relative)."""
    if values is None or values.numel() == 0:
        return True
    ordered = values.sort(dim=-1).values
    diffs = ordered[:, 1:] - ordered[:, :-1]
    scale = ordered.abs()[:, 1:].clamp_min(1e-30)
    return bool(((diffs == 0) | (diffs > gap * scale)).all())


def route_reference(rule, case, gating, bias):
    """(weights float64 [T, k], ids int32 [T, k], choice values, group scores) of ``rule`` in float64:
    SGLang's Python references' weights, sgl-kernel's choice (test_moe_routing.py's ref_route)."""
    x = gating.double()
    tokens, experts = x.shape
    groups, kept, topk = case["groups"], case["kept"], case["topk"]
    scores = x.softmax(-1) if rule in ("topk_softmax", "grouped_topk") else x.sigmoid()
    choice = scores if bias is None else scores + bias.double()
    group_scores = None
    if rule in ("grouped_topk", "biased_grouped_topk"):
        by_group = choice.view(tokens, groups, experts // groups)
        if rule == "grouped_topk":
            group_scores = by_group.max(dim=-1).values
        else:
            group_scores = by_group.topk(2, dim=-1)[0].sum(dim=-1)
    chosen = []
    for t in range(tokens):
        values = choice[t].tolist()
        if group_scores is None or groups == 1:
            candidates = list(range(experts))
        else:
            size_ = experts // groups
            candidates = [
                gi * size_ + e for gi in partial_sort_order(group_scores[t].tolist(), kept) for e in range(size_)
            ]
        order = partial_sort_order([values[c] for c in candidates], topk)
        chosen.append([candidates[i] for i in order])
    ids = torch.tensor(chosen, dtype=torch.int64).view(tokens, topk)
    weights = scores.gather(1, ids)
    shared, scaling = case["shared"], case["scaling"]
    if shared:
        ids[:, -1] = experts + torch.arange(tokens) % shared
        if scaling is not None:
            weights[:, -1] = weights[:, :-1].sum(dim=-1) / scaling
    if case["renormalize"]:
        routed = weights if shared == 0 else weights[:, :-1]
        weights = weights / routed.sum(dim=-1, keepdim=True)
    if scaling is not None:
        weights = weights * scaling
    return weights, ids.to(torch.int32), choice, group_scores


def routing_inputs(rule: str):
    def inputs(case):
        g = generator(case)
        gating = grid_logits(case["tokens"], case["experts"], g).to(case["dtype"])
        bias = None
        if rule == "biased_grouped_topk":
            bias = (torch.rand(case["experts"], generator=g) * 0.5 - 0.25).to(case["dtype"])
            for t in range(case["tokens"]):
                for _ in range(100):
                    _, _, choice, group_scores = route_reference(rule, case, gating[t : t + 1], bias)
                    if separated(choice) and separated(group_scores):
                        break
                    gating[t] = grid_logits(1, case["experts"], g)[0].to(case["dtype"])
                else:
                    raise AssertionError("no well-separated row in 100 draws")
        layout = case["layout"]
        given = gating
        if layout == "column_slice":
            wide = torch.randn(case["tokens"], case["experts"] + 13, generator=g).to(case["dtype"])
            wide[:, 5 : 5 + case["experts"]] = gating
            given = wide[:, 5 : 5 + case["experts"]]
        elif layout == "transposed":
            given = gating.t().contiguous().t()
        return gating, given, bias

    return inputs


def routing_run(rule: str):
    op = getattr(kernforge, rule)

    def run(case, inputs):
        _, gating, bias = inputs
        hidden = torch.empty(case["tokens"], 3, dtype=BF16)
        args = [hidden, gating] + ([bias] if bias is not None else []) + [case["topk"], case["renormalize"]]
        kwargs = {"ties": case["ties"]}
        if rule in ("grouped_topk", "biased_grouped_topk"):
            args += [case["groups"], case["kept"], case["shared"], case["scaling"]]
        with threads(case["threads"]):
            weights, ids = op(*args, **kwargs)
        return {"weights": weights, "ids": ids}

    return run


def routing_reference(rule: str):
    def reference(case, inputs):
        gating, _, bias = inputs
        weights, ids, _, _ = route_reference(rule, case, gating, bias)
        return {"weights": weights, "ids": ids}

    return reference


TARGETS = [
    target(
        "fused_experts", draw_experts(False), experts_inputs, fused_experts_run, fused_experts_reference,
        experts_tolerance,
    ),
    target("shared_expert", draw_shared, shared_inputs, shared_expert_run, fused_experts_reference, experts_tolerance),
    *(
        target(rule, draw_routing(rule), routing_inputs(rule), routing_run(rule), routing_reference(rule),
               lambda case: ROUTING_TOL)
        for rule in RULES
    ),
]  # fmt: skip
