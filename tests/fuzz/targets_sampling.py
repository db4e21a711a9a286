"""Fuzz targets: the sampling ops. ``softmax``, ``top_k_mask_logits``, ``top_k_renorm_probs`` and
``top_p_renorm_probs`` against float64 references of FlashInfer's filters (kernforge/ops/sampling.py's
contract: a filter keeps ``x >= t`` for one threshold, ties at the cut all kept); the samplers by the
properties kernforge promises rather than by values:

* every sample is a token its row's filters keep (top-k / top-p / min-p, never a zero probability),
  and every row with mass is ``valid``;
* the samples are a function of (seed, offset, output row): a call repeated with the same seed and
  offset, or with a generator in the same state, draws the same tokens, and a seed drawn from a
  generator is the one ``torch`` draws from it (offset 0);
* ``*_from_logits`` draws exactly the tokens of ``softmax`` followed by the ``*_from_probs`` op;
* on "dyadic" rows (small integers times a power of two: every partial sum exact in fp32 in any
  order) the samplers of probabilities draw exactly the token of the inverse CDF in index order at
  the Philox4x32-10 uniform of the output row, computed here: the same token on every tier.

Shapes: batch 0 to 40 (and 1 or 2 rows of 8K to 20K tokens: several chunks of a row, a row split over
threads), any vocabulary, padded rows, ``indices`` mapping output rows to input rows (int32 and
int64), per-row parameter tensors or scalars. Filter parameters are moved to the middle of a gap
between two cut levels (``safe_*``), so that fp32 rounding of a row's mass cannot move a token
across the cut; the special values (top_k >= vocab, top_p 0 and >= 1, min_p <= 0 and 1) are drawn too.
"""

from __future__ import annotations

import math
import random

import torch
from fuzzing import FLOAT_DTYPES, TOLERANCES, Target, generator, size, threaded_target

import kernforge

BIG_VOCABS = [8191, 8193, 12289, 20000]  # kChunk = 4096: rows of several chunks, split over threads


# --------------------------------------------------------------------------- float64 filters


def larger_mass(x: torch.Tensor) -> torch.Tensor:
    """[B, V] -> for each x_i the mass of the entries strictly larger than x_i."""
    b, v = x.shape
    vals, order = torch.sort(x, dim=-1, descending=True)
    before = torch.cat([torch.zeros(b, 1, dtype=x.dtype), vals.cumsum(-1)[:, :-1]], dim=-1)
    pos = torch.arange(v).expand(b, v)
    run_start = torch.ones(b, v, dtype=torch.bool)
    run_start[:, 1:] = vals[:, 1:] != vals[:, :-1]
    first = torch.where(run_start, pos, torch.zeros_like(pos)).cummax(-1).values
    return torch.empty_like(x).scatter_(-1, order, before.gather(-1, first))


def column(param, rows: int, integral: bool = False) -> torch.Tensor:
    """A scalar or [rows] parameter as the kernel sees it (int64 or fp32), float64 [rows, 1]."""
    if isinstance(param, torch.Tensor):
        return param.to(torch.int64 if integral else torch.float32).double().reshape(rows, 1)
    value = float(int(param)) if integral else float(torch.tensor(float(param), dtype=torch.float32))
    return torch.full((rows, 1), value, dtype=torch.float64)


def top_k_keep(x: torch.Tensor, top_k) -> torch.Tensor:
    b, v = x.shape
    if v == 0 or b == 0:
        return torch.ones_like(x, dtype=torch.bool)
    k = column(top_k, b, integral=True).long().clamp(max=v)
    kth = x.sort(-1, descending=True).values.gather(-1, k - 1)
    return x >= kth


def top_p_keep(x: torch.Tensor, top_p) -> torch.Tensor:
    p = column(top_p, x.shape[0])
    return (
        (larger_mass(x) < p * x.sum(-1, keepdim=True))
        | ((p >= 1) & (x > 0))
        | ((p <= 0) & (x == x.amax(-1, keepdim=True)))
    )


def min_p_keep(x: torch.Tensor, min_p) -> torch.Tensor:
    return x >= column(min_p, x.shape[0]) * x.amax(-1, keepdim=True)


def kept(x: torch.Tensor, params: dict, order: str = "top_k_first") -> torch.Tensor:
    """The tokens the filters in ``params`` keep in each row of probabilities ``x`` (float64), never
    one of probability 0."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if "top_k" in params:
        keep &= top_k_keep(x, params["top_k"])
    if "top_p" in params:
        rows = torch.where(keep, x, 0.0) if order == "top_k_first" else x
        keep &= top_p_keep(rows, params["top_p"])
    if "min_p" in params:
        keep &= min_p_keep(x, params["min_p"])
    return keep & (x > 0)


# --------------------------------------------------------------------------- safe parameters


def safe_top_p(row: torch.Tensor, p: float, min_gap: float = 2e-4) -> float:
    """The top-p nearest ``p`` whose cut lies mid-way between two cut levels of ``row`` at least
    ``min_gap`` of the mass apart (fp32 rounding of the sums cannot move a token across it)."""
    vals, counts = torch.unique(row[row > 0], return_counts=True)
    group = (vals * counts).flip(0)  # mass of each run of equal values, largest first
    upper = group.cumsum(0)
    mids = ((2 * upper - group) / 2 / upper[-1])[group >= min_gap * upper[-1]]
    return mids[(mids - p).abs().argmin()].item() if len(mids) else 1.0


def safe_min_p(row: torch.Tensor, m: float, min_gap: float = 1e-3) -> float:
    """The min-p nearest ``m`` whose threshold lies mid-way between two distinct values of ``row``
    at least ``min_gap`` (relative) apart."""
    vals = torch.unique(torch.cat([row[row > 0], torch.zeros(1, dtype=torch.float64)]))
    lo, hi = vals[:-1], vals[1:]
    mids = ((lo + hi) / 2 / row.max())[hi - lo >= min_gap * hi]
    return mids[(mids - m).abs().argmin()].item() if len(mids) else 0.0


def safe_top_k(row: torch.Tensor, k: int, min_gap: float = 1e-5) -> int:
    """The k nearest ``k`` whose k-th value is at least ``min_gap`` (relative) above the next lower
    value of ``row`` (probabilities from logits: fp32 may tie values that float64 tells apart)."""
    v = row.numel()
    vals = torch.unique(row).flip(0)  # distinct values, largest first
    at_least = v - torch.searchsorted(row.sort().values, vals)  # entries >= each value
    gaps = vals[:-1] - vals[1:] >= min_gap * vals[:-1]
    safe = torch.cat([at_least[:-1][gaps], torch.tensor([v])])  # k >= vocab: no top-k
    return int(safe[(safe - k).abs().argmin()])


# --------------------------------------------------------------------------- rows


def dyadic_probs(b: int, v: int, g: torch.Generator, zero_frac: float) -> torch.Tensor:
    """Small integers times one power of two: every partial sum exact in fp32 in any order; many ties;
    no all-zero row."""
    top = max(1, min(255, 2**19 // v - 1))
    n = torch.randint(0, top + 1, (b, v), generator=g)
    n[torch.rand(b, v, generator=g) < zero_frac] = 0
    n[:, 0] += (n.sum(-1) == 0).long()
    total = n.sum(-1).max().item() if b else 1
    return (n.double() * 2.0 ** -math.ceil(math.log2(max(total, 1)))).float()


def softmax_probs(b: int, v: int, g: torch.Generator, scale: float, zero_frac: float) -> torch.Tensor:
    """LLM-like rows: softmax of scaled normals, some entries zeroed (never a row's maximum)."""
    p = torch.softmax(torch.randn(b, v, generator=g, dtype=torch.float64) * scale, -1)
    drop = torch.rand(b, v, generator=g) < zero_frac
    if b:
        drop[torch.arange(b), p.argmax(-1)] = False
    return torch.where(drop, 0.0, p).float()


def padded(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout != "padded":
        return x
    backing = torch.full((x.shape[0], x.shape[1] + 5), float("nan"), dtype=x.dtype)
    backing[:, : x.shape[1]] = x
    return backing[:, : x.shape[1]]


def draw_shape(rng: random.Random) -> tuple[int, int]:
    if rng.random() < 0.08:
        return rng.choice([1, 2]), rng.choice(BIG_VOCABS)
    return size(rng, 40), size(rng, 5000, zero=False)


def draw_rows(rng: random.Random) -> dict:
    batch, vocab = draw_shape(rng)
    return {
        "seed": rng.getrandbits(31),
        "batch": batch,
        "vocab": vocab,
        "per_row": rng.random() < 0.6,  # scalar parameters: every row a permutation of row 0
        "layout": rng.choice(["contiguous", "contiguous", "padded"]),
    }


def permuted(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Every row a permutation of row 0 (one scalar safe parameter fits them all)."""
    if x.shape[0] == 0:
        return x
    return torch.stack([x[0][torch.randperm(x.shape[1], generator=g)] for _ in range(x.shape[0])])


def probabilities(case: dict, g: torch.Generator) -> torch.Tensor:
    b, v = (case["batch"] if case["per_row"] else 1), case["vocab"]
    if case["kind"] == "dyadic":
        x = dyadic_probs(b, v, g, case["zero_frac"])
    else:
        x = softmax_probs(b, v, g, case["scale"], case["zero_frac"])
    return x if case["per_row"] else permuted(x.expand(case["batch"], v), g)


def logits_rows(case: dict, g: torch.Generator) -> torch.Tensor:
    b, v = (case["batch"] if case["per_row"] else 1), case["vocab"]
    if case["kind"] == "integer":  # many exact ties
        x = torch.randint(-6, 7, (b, v), generator=g).float()
    else:
        x = torch.randn(b, v, generator=g) * case["scale"]
    return x if case["per_row"] else permuted(x.expand(case["batch"], v), g)


# --------------------------------------------------------------------------- softmax


TEMPERATURES = [0.25, 0.5, 0.7, 1.0, 2.0, 5.0]


def draw_softmax(rng: random.Random) -> dict:
    case = draw_rows(rng)
    case.update(
        dtype=rng.choice(FLOAT_DTYPES),
        scale=rng.choice([0.1, 1.0, 3.0, 8.0]),
        offset=rng.choice([0.0, 0.0, 20.0, -30.0]),
        temperature=rng.choice(["none", "float", "tensor"]),
        out=rng.choice([None, None, "preallocated", "in_place"]),
    )
    # The kernel scales the logits by 1 / T in fp32, as FlashInfer does: keep |x / T| <= 64, where
    # that rounding (half an ulp of 64, 4e-6) stays inside fp32's tolerance of the probabilities.
    lowest = (abs(case["offset"]) + 5 * case["scale"]) / 64
    choices = [t for t in TEMPERATURES if t >= lowest]
    if case["temperature"] == "none" and lowest > 1:
        case["temperature"] = "float"
    case["t"] = rng.choice(choices)
    case["t_dtype"] = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16])
    if case["out"] == "in_place" and case["dtype"] != torch.float32:
        case["out"] = "preallocated"  # out= is fp32: only fp32 logits can be their own output
    return case


def softmax_inputs(case: dict):
    g = generator(case)
    b, v = case["batch"], case["vocab"]
    x = torch.randn(b, v, generator=g) * case["scale"] + case["offset"]
    temperature = None
    if case["temperature"] == "float":
        temperature = case["t"]
    elif case["temperature"] == "tensor":
        temperature = (case["t"] * (1 + 3 * torch.rand(b, generator=g))).to(case["t_dtype"])
    return padded(x.to(case["dtype"]), case["layout"]), temperature


def softmax_run(case, tensors):
    x, temperature = tensors
    before = x.clone()
    if case["out"] == "in_place":
        x = x.clone()
        out = kernforge.softmax(x, temperature, out=x)
        assert out is x, "out= was not returned"
    elif case["out"] == "preallocated":
        target = torch.full(x.shape, float("nan"))
        out = kernforge.softmax(x, temperature, out=target)
        assert out is target, "out= was not returned"
    else:
        out = kernforge.softmax(x, temperature)
        assert torch.equal(x, before) or x.numel() == 0, "the logits were modified"
    assert out.dtype == torch.float32, f"softmax returned {out.dtype}"
    return {"probs": out}


def softmax_reference(case, tensors):
    x, temperature = tensors
    if temperature is None:
        t = torch.ones(x.shape[0], 1, dtype=torch.float64)
    else:
        t = column(temperature, x.shape[0])
    return {"probs": torch.softmax(x.double() / t, -1)}


SOFTMAX = threaded_target(
    "softmax", draw_softmax, softmax_inputs, softmax_run, softmax_reference, lambda case: TOLERANCES[torch.float32]
)


# --------------------------------------------------------------------------- top_k_mask_logits


def draw_top_k(rng: random.Random) -> tuple[str, object]:
    """How top_k is given, and a nominal k (log-uniform over [1, vocab + 2]; sometimes huge)."""
    form = rng.choice(["int", "int", "int32", "int64"])
    return form, rng.choice([1, 2, 10**9]) if rng.random() < 0.15 else None


def top_k_values(case: dict, rows: torch.Tensor, g: torch.Generator, safe: bool):
    """top_k for every row of ``rows`` (float64 values that decide the filter): a scalar or tensor."""
    b, v = rows.shape
    n = b if case["per_row"] and b else 1
    nominal = torch.exp(torch.rand(n, generator=g, dtype=torch.float64) * math.log(v + 2)).long().clamp(min=1)
    if case["fixed_k"] is not None:
        nominal[:] = case["fixed_k"]
    ks = [int(k) for k in nominal]
    if safe and b:
        ks = [safe_top_k(rows[i], k) if k < v else k for i, k in enumerate(ks)]
    if case["top_k_form"] == "int" and not case["per_row"]:
        return ks[0]
    values = torch.tensor(ks * (b if n == 1 else 1), dtype=torch.int64)
    return values.to(torch.int32 if case["top_k_form"] == "int32" else torch.int64)


def draw_mask(rng: random.Random) -> dict:
    case = draw_rows(rng)
    form, fixed = draw_top_k(rng)
    case.update(
        dtype=rng.choice(FLOAT_DTYPES),
        kind=rng.choice(["randn", "integer"]),
        scale=rng.choice([1.0, 3.0]),
        top_k_form=form,
        fixed_k=fixed,
        out=rng.choice([None, None, "preallocated", "in_place"]),
    )
    return case


def mask_inputs(case: dict):
    g = generator(case)
    x = logits_rows(case, g).to(case["dtype"])
    top_k = top_k_values(case, x.double(), g, safe=False)  # exact values: no rounding decides the cut
    return padded(x, case["layout"]), top_k


def mask_run(case, tensors):
    x, top_k = tensors
    if case["out"] == "in_place":
        x = x.clone()
        out = kernforge.top_k_mask_logits(x, top_k, out=x)
        assert out is x, "out= was not returned"
    elif case["out"] == "preallocated":
        target = torch.full(x.shape, float("nan"), dtype=x.dtype)
        out = kernforge.top_k_mask_logits(x, top_k, out=target)
        assert out is target, "out= was not returned"
    else:
        out = kernforge.top_k_mask_logits(x, top_k)
    assert out.dtype == case["dtype"], f"top_k_mask_logits returned {out.dtype}"
    return {"masked": out}


def mask_reference(case, tensors):
    x, top_k = tensors
    keep = top_k_keep(x.double(), top_k)
    return {"masked": torch.where(keep, x.double(), -math.inf)}


TOP_K_MASK_LOGITS = threaded_target(
    "top_k_mask_logits", draw_mask, mask_inputs, mask_run, mask_reference, lambda case: (0.0, 0.0)
)


# --------------------------------------------------------------------------- renorm


def draw_renorm(op: str):
    def draw(rng: random.Random) -> dict:
        case = draw_rows(rng)
        form, fixed = draw_top_k(rng)
        case.update(
            dtype=rng.choice(FLOAT_DTYPES),
            kind=rng.choice(["dyadic", "softmax"]),
            scale=rng.choice([1.0, 2.5, 8.0]),
            zero_frac=rng.choice([0.0, 0.2, 0.9]),
            top_k_form=form,
            fixed_k=fixed,
            top_p_form=rng.choice(["float", "float32", "float64"]),
            special_p=rng.choice([None] * 6 + [0.0, 1.0, 1.5]),
            out=rng.choice([None, None, "preallocated", "in_place"]),
        )
        return case

    return draw


def top_p_values(case: dict, rows: torch.Tensor, g: torch.Generator):
    """A safe top_p for every row of ``rows`` (float64): a scalar or tensor."""
    b = rows.shape[0]
    n = b if case["per_row"] and b else 1
    nominal = 0.05 + 0.95 * torch.rand(n, generator=g, dtype=torch.float64)
    ps = [safe_top_p(rows[i], float(nominal[i])) for i in range(min(n, b))] or [0.5]
    if case["special_p"] is not None:
        ps = [case["special_p"]] * n
    if case["top_p_form"] == "float" and not case["per_row"]:
        return ps[0]
    values = torch.tensor(ps * (b if n == 1 else 1), dtype=torch.float64)
    return values.to(torch.float32 if case["top_p_form"] == "float32" else torch.float64)


def renorm_inputs(op: str):
    def build(case: dict):
        g = generator(case)
        x = probabilities(case, g).to(case["dtype"])
        rows = x.double()
        param = top_k_values(case, rows, g, safe=False) if op == "top_k" else top_p_values(case, rows, g)
        return padded(x, case["layout"]), param

    return build


def renorm_target(op: str) -> Target:
    fn = getattr(kernforge, f"{op}_renorm_probs")

    def run(case, tensors):
        x, param = tensors
        if case["out"] == "in_place":
            x = x.clone()
            out = fn(x, param, out=x)
            assert out is x, "out= was not returned"
        elif case["out"] == "preallocated":
            target = torch.full(x.shape, float("nan"), dtype=x.dtype)
            out = fn(x, param, out=target)
            assert out is target, "out= was not returned"
        else:
            out = fn(x, param)
        assert out.dtype == case["dtype"], f"{fn.__name__} returned {out.dtype}"
        return {"probs": out, "kept": out != 0}

    def reference(case, tensors):
        x, param = tensors
        x = x.double()
        keep = kept(x, {op: param})
        mass = torch.where(keep, x, 0.0).sum(-1, keepdim=True)
        return {"probs": torch.where(keep, x, 0.0) / mass, "kept": keep}

    def tolerance(case):
        return {"probs": TOLERANCES[case["dtype"]], "kept": (0.0, 0.0)}

    return threaded_target(fn.__name__, draw_renorm(op), renorm_inputs(op), run, reference, tolerance)


# --------------------------------------------------------------------------- samplers

# sampler -> (its input, its filters in call order)
SAMPLERS = {
    "sampling_from_probs": ("probs", ()),
    "sampling_from_logits": ("logits", ()),
    "top_p_sampling_from_probs": ("probs", ("top_p",)),
    "top_k_sampling_from_probs": ("probs", ("top_k",)),
    "min_p_sampling_from_probs": ("probs", ("min_p",)),
    "top_k_top_p_sampling_from_probs": ("probs", ("top_k", "top_p")),
    "top_k_top_p_sampling_from_logits": ("logits", ("top_k", "top_p")),
}
FROM_PROBS = {
    "sampling_from_logits": "sampling_from_probs",
    "top_k_top_p_sampling_from_logits": "top_k_top_p_sampling_from_probs",
}


def philox_uniform(seed: int, offset: int, row: int) -> float:
    """kf::sampling::uniform: a double in [0, 1) from Philox4x32-10 keyed by ``seed``, counter
    ``(row, offset)`` (kernforge/sampling/rng.h; the generator itself is pinned by
    tests/ops/test_sampling_rng.py's known answers)."""
    mask = 0xFFFFFFFF
    seed, offset = seed % 2**64, offset % 2**64
    c = [row & mask, row >> 32, offset & mask, offset >> 32]
    k0, k1 = seed & mask, seed >> 32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & mask, (p0 >> 32) ^ c[3] ^ k1, p0 & mask]
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return ((c[0] << 21) | (c[1] >> 11)) * 2.0**-53


def inverse_cdf(x: torch.Tensor, keep: torch.Tensor, u: float) -> int:
    """The first kept token whose running mass in index order exceeds ``u`` times the kept mass."""
    mass = torch.where(keep, x, 0.0).cumsum(0)
    return int((mass > u * mass[-1].item()).nonzero()[0])


def draw_sampler(name: str):
    source, filters = SAMPLERS[name]

    def draw(rng: random.Random) -> dict:
        case = draw_rows(rng)
        form, fixed = draw_top_k(rng)
        case.update(
            dtype=rng.choice(FLOAT_DTYPES) if source == "logits" else torch.float32,
            kind=rng.choice(["dyadic", "softmax"] if source == "probs" else ["integer", "randn"]),
            scale=rng.choice([1.0, 2.5, 5.0]),
            zero_frac=rng.choice([0.0, 0.3, 0.9]),
            top_k_form=form,
            fixed_k=fixed,
            top_p_form=rng.choice(["float", "float32", "float64"]),
            special_p=rng.choice([None] * 8 + [0.0, 1.0, 2.0]),
            special_min_p=rng.choice([None] * 8 + [0.0, -0.5, 1.0]),
            order=rng.choice(["top_k_first", "joint"]) if filters == ("top_k", "top_p") else None,
            indices=rng.choice([None, None, torch.int32, torch.int64]),
            outputs=size(rng, 40),  # output rows, with indices
            sampler_seed=rng.choice([0, 1, 2**31, 2**63 - 1, -5, rng.getrandbits(64) - 2**63]),
            offset=rng.choice([0, 1, 2**32 + 3, rng.getrandbits(63)]),
            seed_form=rng.choice(["int", "int", "tensor1", "tensor_rows"]),
            generator_seed=rng.getrandbits(32),
            check_nan=rng.random() < 0.2,
        )
        if source == "logits":
            case["zero_frac"] = 0.0
        if case["batch"] == 0:
            case["indices"] = None  # nothing to index
        # input row 0 holds a NaN, or has no mass (probabilities 0, logits -inf): token 0, not valid
        case["bad_row"] = rng.choice([None] * 8 + ["nan", "no_mass"]) if case["batch"] else None
        if case["bad_row"] == "nan":
            case["check_nan"] = False  # check_nan refuses such an input (a correct ValueError)
        return case

    return draw


def sampler_inputs(name: str):
    source, filters = SAMPLERS[name]

    def build(case: dict):
        g = generator(case)
        if source == "probs":
            x = probabilities(case, g)
            probs = x.double()
        else:
            x = logits_rows(case, g).to(case["dtype"])
            probs = torch.softmax(x.double(), -1)  # kernforge.softmax's, to well within the safe margins
        b = case["batch"]
        if case["indices"] is not None:
            rows = torch.randint(0, b, (case["outputs"],), generator=g)
            indices = rows.to(case["indices"])
        else:
            rows, indices = torch.arange(b), None
        row_probs = probs[rows]  # the probabilities each output row samples from
        view = dict(case, batch=len(rows), per_row=case["per_row"] or indices is not None)
        params = {}
        if "top_k" in filters:
            params["top_k"] = top_k_values(view, row_probs, g, safe=source == "logits")
        if "top_p" in filters:
            top_k_set = kept(row_probs, {"top_k": params["top_k"]}) if "top_k" in params else None
            restricted = (
                row_probs if top_k_set is None or case["order"] == "joint" else torch.where(top_k_set, row_probs, 0.0)
            )
            params["top_p"] = top_p_values(view, restricted, g)
        if "min_p" in filters:
            n = len(rows) if view["per_row"] else 1
            nominal = 0.5 * torch.rand(max(n, 1), generator=g, dtype=torch.float64)
            ms = [safe_min_p(row_probs[i], float(nominal[i])) for i in range(min(n, len(rows)))] or [0.1]
            if case["special_min_p"] is not None:
                ms = [case["special_min_p"]] * max(n, 1)
            if view["per_row"]:
                params["min_p"] = torch.tensor(ms[: len(rows)], dtype=torch.float32)
            else:
                params["min_p"] = ms[0]
        keep = kept(row_probs, params, case["order"] or "top_k_first")
        bad = rows == 0 if case["bad_row"] else torch.zeros(len(rows), dtype=torch.bool)
        if case["bad_row"]:  # after the parameters: they were drawn for the clean rows
            x = x.clone()
            if case["bad_row"] == "nan":
                x[0, case["vocab"] // 2] = math.nan
            else:
                x[0] = 0.0 if source == "probs" else -math.inf
            keep[bad] = False
            keep[bad, 0] = True  # token 0 is what such a row gives
        return padded(x, case["layout"]), indices, params, keep, row_probs, bad

    return build


def seed_arguments(case: dict, outputs: int) -> tuple:
    seed, offset = case["sampler_seed"], case["offset"]
    if case["seed_form"] == "tensor1":
        return torch.tensor([seed], dtype=torch.int64), torch.tensor([offset], dtype=torch.int64)
    if case["seed_form"] == "tensor_rows" and outputs:
        return torch.full((outputs,), seed, dtype=torch.int64), torch.full((outputs,), offset, dtype=torch.int64)
    return seed, offset


def generator_seed(case: dict) -> int:
    """The Philox seed a call draws from ``torch.Generator().manual_seed(generator_seed)``."""
    gen = torch.Generator().manual_seed(case["generator_seed"])
    return int(torch.empty((), dtype=torch.int64).random_(generator=gen))


def exact(case: dict) -> bool:
    """Dyadic rows of probabilities: every sum exact, so the token itself is known."""
    return SAMPLERS[case["name"]][0] == "probs" and case["kind"] == "dyadic"


def sampler_target(name: str) -> Target:
    op = getattr(kernforge, name)
    source, filters = SAMPLERS[name]

    def call(fn, case, x, indices, params, check_nan=None, **kw):
        args = [params[f] for f in filters]
        if case["order"] is not None:
            kw["filter_apply_order"] = case["order"]
        check_nan = case["check_nan"] if check_nan is None else check_nan
        return fn(x, *args, indices=indices, check_nan=check_nan, **kw)

    def run(case, tensors):
        x, indices, params, keep, _, _ = tensors
        outputs = keep.shape[0]
        seed, offset = seed_arguments(case, outputs)
        samples, valid = call(op, case, x, indices, params, seed=seed, offset=offset, return_valid=True)
        expected_dtype = torch.int32 if indices is None else indices.dtype
        assert samples.dtype == expected_dtype and samples.shape == (outputs,), f"samples {samples.dtype}"
        again = call(op, case, x, indices, params, seed=seed, offset=offset)
        gen = torch.Generator().manual_seed(case["generator_seed"])
        from_generator = call(op, case, x, indices, params, generator=gen)
        advanced = call(op, case, x, indices, params, generator=gen)
        repeat = call(op, case, x, indices, params, generator=torch.Generator().manual_seed(case["generator_seed"]))
        result = {
            "in_kept": keep[torch.arange(outputs), samples.long()] if outputs else torch.ones(0, dtype=torch.bool),
            "gen_in_kept": keep[torch.arange(outputs), advanced.long()] if outputs else torch.ones(0, dtype=torch.bool),
            "valid": valid,
            "same_seed_same_samples": torch.tensor(torch.equal(samples, again)),
            "same_generator_same_samples": torch.tensor(torch.equal(from_generator, repeat)),
        }
        if name in FROM_PROBS:  # exactly softmax, then the from_probs op
            probs = kernforge.softmax(x)  # NaN where a row of logits has no mass: check_nan would refuse it
            from_probs = getattr(kernforge, FROM_PROBS[name])
            fused = call(from_probs, case, probs, indices, params, check_nan=False, seed=seed, offset=offset)
            result["softmax_then_from_probs"] = torch.tensor(torch.equal(fused, samples))
        if exact(case):
            result["samples"] = samples.long()
            result["generator_samples"] = from_generator.long()
        return result

    def reference(case, tensors):
        x, indices, params, keep, row_probs, bad = tensors
        outputs = keep.shape[0]
        true = torch.ones(outputs, dtype=torch.bool)
        result = {
            "in_kept": true,
            "gen_in_kept": true,
            "valid": ~bad,
            "same_seed_same_samples": torch.tensor(True),
            "same_generator_same_samples": torch.tensor(True),
        }
        if name in FROM_PROBS:
            result["softmax_then_from_probs"] = torch.tensor(True)
        if exact(case):

            def tokens(seed: int, offset: int) -> torch.Tensor:
                drawn = [
                    0 if bad[r] else inverse_cdf(row_probs[r], keep[r], philox_uniform(seed, offset, r))
                    for r in range(outputs)
                ]
                return torch.tensor(drawn, dtype=torch.int64)

            result["samples"] = tokens(case["sampler_seed"], case["offset"])
            result["generator_samples"] = tokens(generator_seed(case), 0)
        return result

    draw = draw_sampler(name)
    return threaded_target(name, lambda rng: {"name": name, **draw(rng)}, sampler_inputs(name), run, reference)


TARGETS = [
    SOFTMAX,
    TOP_K_MASK_LOGITS,
    renorm_target("top_k"),
    renorm_target("top_p"),
    *(sampler_target(name) for name in SAMPLERS),
]
