"""Tests for the sampling ops (FlashInfer's generator-based sampling API).

Filters (the contract; x is a row in float32, S = sum(x)):
  top-k   keep x_i >= the k-th largest value (ties at the cut all kept; k >= vocab keeps all)
  top-p   keep x_i iff (mass of the values strictly larger than x_i) < p * S; p = 0 keeps the
          maximum (and entries equal to it), p >= 1 every nonzero entry
  min-p   keep x_i >= min_p * max(x) (min_p <= 0 keeps everything)
  top-k + top-p: "top_k_first" runs top-p on the top-k-renormalized row, "joint" intersects the
          top-k set with the top-p set of the full row.

* renorm / mask ops: exact kept set and values against a float64 torch reference of the filters.
* softmax against torch.softmax(logits.float() / temperature).
* sampling ops: every sample lies in the kept set; empirical frequencies over 100k samples match
  the renormalized reference (cosine similarity and a chi-square test, itself shown to reject a
  wrong distribution); ``*_from_logits`` gives exactly the samples of softmax + ``*_from_probs``;
  determinism (threads, generator, seed/offset); indices; return_valid; edge cases; errors.

A float32 kernel may sum a row in any order, so the test data keeps every filter decision away
from rounding: top-p and min-p values are moved to the middle of a gap between two consecutive
cut levels (safe_top_p, safe_min_p), and the "dyadic" rows (small integers times a power of two)
have partial sums that are exact in float32 whatever the order.
Every numeric test runs on every ISA tier this CPU can run (``tier`` fixture).
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import kernforge

from op_helpers import DTYPE_IDS, DTYPES, PAD, make_rows, randn, seeded

# sampler -> (name of its input, its filter parameters in call order)
SAMPLERS = {
    "sampling_from_probs": ("probs", ()),
    "sampling_from_logits": ("logits", ()),
    "top_p_sampling_from_probs": ("probs", ("top_p",)),
    "top_k_sampling_from_probs": ("probs", ("top_k",)),
    "min_p_sampling_from_probs": ("probs", ("min_p",)),
    "top_k_top_p_sampling_from_probs": ("probs", ("top_k", "top_p")),
    "top_k_top_p_sampling_from_logits": ("logits", ("top_k", "top_p")),
}
ORDERS = ("top_k_first", "joint")
# (sampler, filter_apply_order or None): the top-k + top-p samplers run with both orders
CASES = [
    pytest.param(name, order, id=name + (f"-{order}" if order else ""))
    for name, (_, filt) in SAMPLERS.items()
    for order in (ORDERS if filt == ("top_k", "top_p") else (None,))
]
FILTER_CASES = [c for c in CASES if SAMPLERS[c.values[0]][1]]
# the parameters that keep every nonzero entry, and those that keep only the maximum
KEEP_ALL = {"top_k": 10**6, "top_p": 1.0, "min_p": 0.0}
KEEP_MAX = {"top_k": 1, "top_p": 1e-7, "min_p": 1.0}

VOCABS = [1, 3, 17, 1000, 4099]  # none a multiple of 16 but the vector body still runs (1000, 4099)
BIG_VOCAB = 128256
FREQ_SAMPLES = 100_000
MIN_P_VALUE = 1e-4  # chi-square p-value a correct sampler must exceed


# --------------------------------------------------------------------------- float64 reference


def as_column(param, rows):
    """A scalar or [rows] tensor parameter as a float64 [rows, 1] column (a float32 tensor keeps
    the rounding the kernel sees)."""
    if isinstance(param, torch.Tensor):
        return param.to(torch.float64).reshape(rows, 1)
    return torch.full((rows, 1), float(param), dtype=torch.float64)


def larger_mass(x):
    """[B, V] -> for each x_i the sum of the values strictly larger than x_i.

    Sorted descending, entry j has the exclusive prefix sum of the entries before it; a run of
    equal values all take the prefix sum at the run's first position (what is strictly larger)."""
    B, V = x.shape
    vals, order = torch.sort(x, dim=-1, descending=True)
    before = torch.cat([torch.zeros(B, 1, dtype=x.dtype), vals.cumsum(-1)[:, :-1]], dim=-1)
    pos = torch.arange(V).expand(B, V)
    run_start = torch.ones(B, V, dtype=torch.bool)
    run_start[:, 1:] = vals[:, 1:] != vals[:, :-1]
    first = torch.where(run_start, pos, torch.zeros_like(pos)).cummax(-1).values
    return torch.empty_like(x).scatter_(-1, order, before.gather(-1, first))


def ref_top_k_keep(x, top_k):
    B, V = x.shape
    k = as_column(top_k, B).long().clamp(max=V)
    kth = x.sort(-1, descending=True).values.gather(-1, k - 1)
    return x >= kth


def ref_top_p_keep(x, top_p):
    p = as_column(top_p, x.shape[0])
    # p = 1 keeps every nonzero entry (as the spec says): in exact arithmetic the strictly-larger
    # mass of the smallest entry is below S, but a float64 sum may round a 1e-30 tail away.
    # p = 0 keeps the maximum and entries equal to it (the limit p -> 0+).
    return (
        (larger_mass(x) < p * x.sum(-1, keepdim=True))
        | ((p >= 1) & (x > 0))
        | ((p <= 0) & (x == x.amax(-1, keepdim=True)))
    )


def ref_min_p_keep(x, min_p):
    return x >= as_column(min_p, x.shape[0]) * x.amax(-1, keepdim=True)


def ref_top_k_top_p_keep(x, top_k, top_p, order):
    in_top_k = ref_top_k_keep(x, top_k)
    if order == "joint":
        return in_top_k & ref_top_p_keep(x, top_p)
    # top_k_first: top-p over the row restricted to the top-k set (S = the top-k mass)
    return in_top_k & ref_top_p_keep(torch.where(in_top_k, x, 0.0), top_p)


def ref_keep(name, probs, params, order=None):
    """The tokens sampler ``name`` may return for each row of ``probs``: kept by its filters, and
    never one of probability 0."""
    x = probs.double()
    filt = SAMPLERS[name][1]
    if filt == ():
        keep = torch.ones_like(x, dtype=torch.bool)
    elif filt == ("top_p",):
        keep = ref_top_p_keep(x, params["top_p"])
    elif filt == ("top_k",):
        keep = ref_top_k_keep(x, params["top_k"])
    elif filt == ("min_p",):
        keep = ref_min_p_keep(x, params["min_p"])
    else:
        keep = ref_top_k_top_p_keep(x, params["top_k"], params["top_p"], order)
    return keep & (x > 0)


def renormalize(x, keep):
    kept = torch.where(keep, x.double(), 0.0)
    return kept / kept.sum(-1, keepdim=True)


# --------------------------------------------------------------------------- safe parameters


def safe_top_p(row, p, min_gap=2e-4):
    """The top-p nearest ``p`` whose cut p*S lies mid-way between two consecutive cut levels of
    ``row`` that are at least ``min_gap * S`` apart: float32 rounding of S, of p * S or of the
    partial sums cannot then move any token across the cut."""
    row = row.double()
    vals, counts = torch.unique(row[row > 0], return_counts=True)
    group = (vals * counts).flip(0)  # mass of each run of equal values, largest value first
    upper = group.cumsum(0)
    total = upper[-1]
    mids = ((2 * upper - group) / 2 / total)[group >= min_gap * total]
    assert len(mids), "test data: no top-p cut with a safe margin"
    return mids[(mids - p).abs().argmin()].item()


def safe_min_p(row, m, min_gap=1e-3):
    """The min-p nearest ``m`` whose threshold min_p * max lies mid-way between two consecutive
    distinct values of ``row`` at least ``min_gap`` (relative) apart."""
    row = row.double()
    vals = torch.unique(torch.cat([row[row > 0], torch.zeros(1, dtype=torch.float64)]))
    lo, hi = vals[:-1], vals[1:]
    mids = ((lo + hi) / 2 / row.max())[hi - lo >= min_gap * hi]
    assert len(mids), "test data: no min-p threshold with a safe margin"
    return mids[(mids - m).abs().argmin()].item()


def pick_params(name, order, probs, g, per_row):
    """Filter parameters for sampler ``name`` on ``probs``: [B] tensors with different values per
    row (per_row), or Python scalars (then every row must be a permutation of row 0)."""
    filt = SAMPLERS[name][1]
    x = probs.double()
    B, V = x.shape
    n = B if per_row else 1
    params = {}
    if "top_k" in filt:
        # log-uniform over [1, V + 2]: small k as often as large ones, and sometimes k >= V
        k = torch.exp(torch.rand(n, generator=g, dtype=torch.float64) * math.log(V + 2)).long().clamp(min=1)
        params["top_k"] = k.to(torch.int32) if per_row else int(k[0])
    if "top_p" in filt:
        rows = x
        if "top_k" in filt and order == "top_k_first":
            rows = torch.where(ref_top_k_keep(x, params["top_k"]), x, 0.0)
        nominal = 0.05 + 0.95 * torch.rand(n, generator=g, dtype=torch.float64)
        ps = [safe_top_p(rows[i], nominal[i].item()) for i in range(n)]
        params["top_p"] = torch.tensor(ps, dtype=torch.float32) if per_row else ps[0]
    if "min_p" in filt:
        nominal = 0.5 * torch.rand(n, generator=g, dtype=torch.float64)
        ms = [safe_min_p(x[i], nominal[i].item()) for i in range(n)]
        params["min_p"] = torch.tensor(ms, dtype=torch.float32) if per_row else ms[0]
    return params


# --------------------------------------------------------------------------- test data


def dyadic_probs(B, V, g, zero_frac=0.0):
    """Small integers times one power of two: every partial sum is exact in float32 in any order
    (under 2**19 units in all), values tie a lot, and bf16 / fp16 hold them exactly (<= 255)."""
    top = max(1, min(255, 2**19 // V - 1))
    n = torch.randint(0, top + 1, (B, V), generator=g)
    if zero_frac:
        n[torch.rand(B, V, generator=g) < zero_frac] = 0
    n[:, 0] += (n.sum(-1) == 0).long()  # no all-zero row
    return (n.double() * 2.0 ** -math.ceil(math.log2(n.sum(-1).max().item()))).float()


def softmax_probs(B, V, g, scale=2.5, zero_frac=0.0):
    """LLM-like rows: softmax of scaled normals (a few dominant tokens and a long tail)."""
    p = torch.softmax(randn((B, V), g, scale), -1)
    if zero_frac:
        drop = torch.rand(B, V, generator=g) < zero_frac
        drop[torch.arange(B), p.argmax(-1)] = False
        p[drop] = 0.0
    return p


def permuted_rows(row, B, g):
    """B random permutations of ``row``: same multiset of values, so one scalar top-p / min-p is
    safe for all of them."""
    return torch.stack([row[torch.randperm(row.shape[-1], generator=g)] for _ in range(B)])


def sampler_input(name, kind, B, V, g, per_row=True):
    """(input, probs): the sampler's input (probs or logits) and the probabilities its contract
    refers to (kernforge.softmax of the logits for the *_from_logits samplers)."""
    from_logits = SAMPLERS[name][0] == "logits"
    n = B if per_row else 1
    if from_logits:
        # "dyadic": integer logits, so many probabilities tie exactly
        x = torch.randint(-6, 7, (n, V), generator=g).float() if kind == "dyadic" else randn((n, V), g, 2.5)
    else:
        x = dyadic_probs(n, V, g, zero_frac=0.3) if kind == "dyadic" else softmax_probs(n, V, g, zero_frac=0.2)
    if not per_row:
        x = permuted_rows(x[0], B, g)
    probs = kernforge.softmax(x) if from_logits else x
    return x, probs


def draw(name, x, params, order=None, **kw):
    """One call of sampler ``name`` on ``x`` with filter ``params`` ({"top_k": ...})."""
    args = [params[p] for p in SAMPLERS[name][1]]
    if order is not None:
        kw["filter_apply_order"] = order
    return getattr(kernforge, name)(x, *args, **kw)


def assert_in_kept(samples, keep, ctx, rows=None):
    """Every sample is a kept token of its input row (``rows[i]``, default i)."""
    rows = torch.arange(len(samples)) if rows is None else rows.long()
    ok = keep[rows, samples.long()]
    if not ok.all():
        i = int((~ok).nonzero()[0])
        raise AssertionError(
            f"{ctx}: {int((~ok).sum())} of {len(samples)} samples outside the kept "
            f"set, e.g. output row {i} (input row {int(rows[i])}) got token {int(samples[i])}"
        )


# --------------------------------------------------------------------------- statistics


def chi_square(counts, q):
    """Pearson's chi-square goodness of fit of ``counts`` [V] to probabilities ``q`` [V].

    Tokens with q == 0 are left out (the callers check they were never drawn); bins expected to
    get fewer than 5 samples are pooled into one bin, itself merged into the smallest other bin
    if still under 5. Returns (chi2, degrees of freedom, p-value)."""
    q = q.double() / q.double().sum()
    support = q > 0
    obs = counts.double()[support]
    exp = q[support] * counts.sum().item()
    small = exp < 5
    o, e = obs[~small], exp[~small]
    if small.any():
        po, pe = obs[small].sum().reshape(1), exp[small].sum().reshape(1)
        if pe.item() >= 5 or len(e) == 0:
            o, e = torch.cat([o, po]), torch.cat([e, pe])
        else:
            i = e.argmin()
            o[i] += po[0]
            e[i] += pe[0]
    chi2 = ((o - e) ** 2 / e).sum().item()
    df = len(e) - 1
    if df == 0:
        return chi2, 0, 1.0
    p = torch.special.gammaincc(
        torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)
    ).item()
    return chi2, df, p


def assert_frequencies(samples, q, ctx):
    """The samples follow ``q``: none where q == 0, cosine similarity of the empirical frequency to
    q above 0.99, and the chi-square test does not reject at MIN_P_VALUE."""
    counts = torch.bincount(samples.long(), minlength=len(q))
    assert len(counts) == len(q), f"{ctx}: token id {int(samples.max())} >= vocab {len(q)}"
    assert counts[q == 0].sum() == 0, (
        f"{ctx}: tokens outside the kept set drawn: {(counts * (q == 0)).nonzero().flatten().tolist()[:10]}"
    )
    cos = F.cosine_similarity(counts.double() / counts.sum(), q.double(), dim=0).item()
    assert cos > 0.99, f"{ctx}: cosine similarity {cos:.4f} of frequencies to the reference"
    chi2, df, p = chi_square(counts, q)
    assert p > MIN_P_VALUE, f"{ctx}: chi-square {chi2:.1f} with {df} dof, p-value {p:.2e}"
    return counts


# --------------------------------------------------------------------------- renorm / mask ops


def _renorm_inputs(op, dtype, B, V, kind, per_row, g):
    """(probs in dtype, top_k or top_p) for a renorm op; the reference uses the rounded probs."""
    if kind == "dyadic":
        rows = dyadic_probs(B if per_row else 1, V, g, zero_frac=0.2)
    else:
        rows = softmax_probs(B if per_row else 1, V, g, zero_frac=0.2)
    if not per_row:
        rows = permuted_rows(rows[0], B, g)
    x = rows.to(dtype)
    name = "top_k_sampling_from_probs" if op == "top_k_renorm_probs" else "top_p_sampling_from_probs"
    params = pick_params(name, None, x, g, per_row)
    return x, next(iter(params.values()))


@pytest.mark.parametrize("V", VOCABS, ids=lambda v: f"V{v}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", ["top_k_renorm_probs", "top_p_renorm_probs"])
def test_renorm_probs(op, dtype, V, tier, assert_close_ref):
    g = seeded(op, dtype, V)
    for kind in ("dyadic", "softmax"):
        for per_row in (True, False):
            for layout in ("contig", "padded"):  # padded: row stride V + 5
                for B in (1, 7):
                    ctx = (
                        f"{op} dtype={dtype} tier={tier} V={V} B={B} {kind} "
                        f"{'per-row' if per_row else 'scalar'} params, {layout}"
                    )
                    x, param = _renorm_inputs(op, dtype, B, V, kind, per_row, g)
                    view, backing, _ = make_rows(x, layout, g)
                    backing_before = backing.clone()
                    out = getattr(kernforge, op)(view, param)
                    x64 = x.double()
                    keep = ref_top_k_keep(x64, param) if op == "top_k_renorm_probs" else ref_top_p_keep(x64, param)
                    assert out.shape == (B, V) and out.dtype == dtype, ctx
                    expected_nonzero = keep & (x64 != 0)
                    if not torch.equal(out != 0, expected_nonzero):
                        diff = ((out != 0) != expected_nonzero).nonzero()[0].tolist()
                        raise AssertionError(
                            f"{ctx}: kept set differs, first at (row, token) {diff}: "
                            f"x={x64[diff[0], diff[1]].item()} out={out[diff[0], diff[1]].item()}"
                        )
                    assert_close_ref(out, renormalize(x64, keep).float(), dtype, ctx)
                    assert torch.equal(backing, backing_before), f"{ctx}: input storage was modified"


@pytest.mark.parametrize("V", VOCABS, ids=lambda v: f"V{v}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_top_k_mask_logits(dtype, V, tier):
    g = seeded("mask", dtype, V)
    for kind in ("randn", "integer"):  # integer logits: many ties at the k-th value
        for per_row in (True, False):
            for layout in ("contig", "padded"):
                for B in (1, 7):
                    ctx = f"top_k_mask_logits dtype={dtype} tier={tier} V={V} B={B} {kind} {layout}"
                    x = (
                        randn((B, V), g, 3.0) if kind == "randn" else torch.randint(-4, 5, (B, V), generator=g).float()
                    ).to(dtype)
                    params = pick_params("top_k_sampling_from_probs", None, x.float(), g, per_row)
                    view, backing, _ = make_rows(x, layout, g)
                    backing_before = backing.clone()
                    out = kernforge.top_k_mask_logits(view, params["top_k"])
                    keep = ref_top_k_keep(x.double(), params["top_k"])
                    assert out.shape == (B, V) and out.dtype == dtype, ctx
                    expected = torch.where(keep, x, torch.tensor(-math.inf, dtype=dtype))
                    assert torch.equal(out, expected), (
                        f"{ctx}: kept {int((out != -math.inf).sum())} tokens, expected {int(keep.sum())}"
                    )
                    assert torch.equal(backing, backing_before), f"{ctx}: input storage was modified"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_renorm_edge_params(dtype, tier, assert_close_ref):
    """k >= vocab and top_p = 1 keep every nonzero entry (even a 1e-30 tail whose mass is lost in a
    float32 sum); a tiny top_p keeps only the maximum (and entries equal to it)."""
    g = seeded("renorm-edge", dtype)
    V = 4099
    x = softmax_probs(5, V, g, scale=8.0, zero_frac=0.1)
    x[1, 17] = x[1, 400] = x[1].max() * 1.5  # row 1: two equal maxima
    x[2, 100:200] = 1e-30  # row 2: a tail far below float32 resolution of the row's mass
    # S ~ 1, so that x / S does not round the smallest fp16 subnormals to 0
    x = (x / x.sum(-1, keepdim=True)).to(dtype)
    x64 = x.double()
    ctx = f"dtype={dtype} tier={tier}"
    everything = renormalize(x64, x64 != 0).float()
    for k in (V, V + 100, 10**9):
        out = kernforge.top_k_renorm_probs(x, k)
        assert torch.equal(out != 0, x != 0), f"top_k_renorm_probs k={k} {ctx}: lost entries"
        assert_close_ref(out, everything, dtype, f"top_k_renorm_probs k={k} {ctx}")
        assert torch.equal(kernforge.top_k_mask_logits(x, k), x), f"top_k_mask_logits k={k} {ctx}"
    for p in (1.0, 1.5, float("inf")):  # FlashInfer takes top_p >= 1 as no top-p
        out = kernforge.top_p_renorm_probs(x, p)
        assert torch.equal(out != 0, x != 0), f"top_p_renorm_probs p={p} {ctx}: dropped nonzero entries"
        assert_close_ref(out, everything, dtype, f"top_p_renorm_probs p={p} {ctx}")
    is_max = x64 == x64.amax(-1, keepdim=True)
    # p = 0 (accepted by FlashInfer, whose top-p renorm keeps the top token) is the limit of a tiny p
    for p in (1e-7, 0.0, 0, torch.zeros(5), torch.zeros(5, dtype=torch.int64)):
        out = kernforge.top_p_renorm_probs(x, p)
        assert_close_ref(out, renormalize(x64, is_max).float(), dtype, f"top_p_renorm_probs p={p} {ctx}")
        assert (out[1] != 0).sum() == 2, f"top_p_renorm_probs p={p} {ctx}: both tied maxima must be kept"


# --------------------------------------------------------------------------- ties at the cut

# S = 1: one 0.3, four 0.1 (the run straddling the cut), six 0.05
TIE_ROW = [0.3, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]


def test_ties_at_threshold(tier):
    """Every filter below cuts inside the run of four 0.1s: all of them must be kept (more than k
    tokens for top-k) and sampled, and none of the 0.05s."""
    g = seeded("ties")
    row = torch.tensor(TIE_ROW)[torch.randperm(len(TIE_ROW), generator=g)]
    probs = row.reshape(1, -1)
    kept = (row >= 0.1).nonzero().flatten().tolist()  # the 0.3 and the four 0.1s
    expected = torch.where(row >= 0.1, row / 0.7, 0.0).reshape(1, -1)
    for name, out in [
        ("top_k_renorm_probs k=3", kernforge.top_k_renorm_probs(probs, 3)),
        ("top_k_renorm_probs k=2", kernforge.top_k_renorm_probs(probs, 2)),
        ("top_p_renorm_probs p=0.45", kernforge.top_p_renorm_probs(probs, 0.45)),
    ]:
        assert (out[0] != 0).nonzero().flatten().tolist() == kept, f"{name} tier={tier}"
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5, msg=f"{name} tier={tier}")
    # a cut above the run keeps only the 0.3 (its strictly-larger mass 0 < 0.2; the 0.1s have 0.3)
    out = kernforge.top_p_renorm_probs(probs, 0.2)
    assert (out[0] != 0).sum() == 1 and out[0, row.argmax()] == 1.0, f"top_p p=0.2 tier={tier}"
    masked = kernforge.top_k_mask_logits(probs.log(), 3)
    assert (masked[0] != -math.inf).nonzero().flatten().tolist() == kept, f"top_k_mask_logits tier={tier}"

    n = 20_000
    indices = torch.zeros(n, dtype=torch.int32)
    logits = probs.log()
    cases = [
        ("top_k_sampling_from_probs", probs, {"top_k": 3}, None),
        ("top_p_sampling_from_probs", probs, {"top_p": 0.45}, None),
        ("min_p_sampling_from_probs", probs, {"min_p": 0.3}, None),
    ]
    for order in ORDERS:  # k=2: the k-th value is 0.1; p=0.9 then keeps the whole top-k set
        cases.append(("top_k_top_p_sampling_from_probs", probs, {"top_k": 2, "top_p": 0.9}, order))
        cases.append(("top_k_top_p_sampling_from_logits", logits, {"top_k": 2, "top_p": 0.9}, order))
    for name, x, params, order in cases:
        samples = draw(name, x, params, order, indices=indices, generator=seeded("ties", name, order))
        drawn = sorted(set(samples.tolist()))
        assert drawn == kept, f"{name} {params} {order} tier={tier}: drew {drawn}, expected {kept}"


# --------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("temperature", ["none", "float", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softmax(dtype, temperature, tier, assert_close_ref):
    g = seeded("softmax", dtype, temperature)
    for B, V in [(1, 1), (1, 3), (7, 17), (33, 4099), (2, BIG_VOCAB)]:
        logits = randn((B, V), g, 3.0)
        logits[0] += 50.0  # exp(x / T) overflows float32 unless the row maximum is subtracted
        x = logits.to(dtype)
        if temperature == "none":
            T, T_ref = None, 1.0
        elif temperature == "float":
            T, T_ref = 0.7, 0.7
        else:
            T = 0.5 + 1.5 * torch.rand(B, generator=g)
            T_ref = T.reshape(B, 1)
        ctx = f"softmax dtype={dtype} T={temperature} tier={tier} B={B} V={V}"
        x_before = x.clone()
        out = kernforge.softmax(x, temperature=T)
        assert out.shape == (B, V) and out.dtype == torch.float32, ctx
        # float32 tolerance: the kernel computes in float32 from the (already rounded) input
        assert_close_ref(out, torch.softmax(x.float() / T_ref, -1), torch.float32, ctx)
        assert torch.equal(x, x_before), f"{ctx}: input was modified"
    # positional temperature, padded rows
    view, _, _ = make_rows(randn((4, 1000), g, 3.0).to(dtype), "padded", g)
    assert_close_ref(
        kernforge.softmax(view, 2.0),
        torch.softmax(view.float() / 2.0, -1),
        torch.float32,
        f"softmax padded dtype={dtype} tier={tier}",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softmax_equal_logits_equal_probs(dtype, tier):
    """Equal logits give bit-equal probabilities wherever they sit in the row (vector body or
    remainder): otherwise a tie in the logits is broken and a *_from_logits filter no longer
    keeps all the ties at its cut."""
    g = seeded("softmax-ties", dtype)
    for V in (3, 11, 17, 35, 1000, 4099):
        x = torch.randint(-6, 7, (4, V), generator=g).to(dtype)  # 13 distinct values, many ties
        for T in (None, 0.7):
            probs = kernforge.softmax(x, T)
            for r in range(x.shape[0]):
                for v in x[r].unique():
                    same = probs[r][x[r] == v]
                    assert (same == same[0]).all(), (
                        f"softmax dtype={dtype} tier={tier} V={V} T={T}: logit {v.item()} at tokens "
                        f"{(x[r] == v).nonzero().flatten().tolist()} gave probabilities "
                        f"{sorted(set(same.tolist()))}"
                    )


# --------------------------------------------------------------------------- samples in the kept set


@pytest.mark.parametrize("per_row", [True, False], ids=["per_row_params", "scalar_params"])
@pytest.mark.parametrize("name,order", CASES)
def test_samples_in_kept_set(name, order, per_row, tier):
    """Many rows, several draws each, vocab sizes 1 .. 4099, ties and zeros, padded rows: every
    sample is a kept token of its row."""
    g = seeded("kept", name, order, per_row)
    gen = seeded("kept-gen", name, order, per_row)
    for V in (1, 3, 17, 4099):
        for kind in ("dyadic", "softmax"):
            B = 96 if V > 17 else 8
            x, probs = sampler_input(name, kind, B, V, g, per_row)
            params = pick_params(name, order, probs, g, per_row)
            keep = ref_keep(name, probs, params, order)
            layout = "padded" if kind == "softmax" else "contig"
            view, _, _ = make_rows(x, layout, g)
            ctx = f"{name} {order} tier={tier} V={V} {kind} {layout} per_row={per_row}"
            for _ in range(4):
                samples = draw(name, view, params, order, generator=gen)
                assert samples.shape == (B,) and samples.dtype == torch.int32, ctx
                assert_in_kept(samples, keep, ctx)


@pytest.mark.parametrize(
    "name,order",
    [
        pytest.param("top_p_sampling_from_probs", None, id="top_p_sampling_from_probs"),
        pytest.param("top_k_top_p_sampling_from_logits", "top_k_first", id="top_k_top_p_from_logits-top_k_first"),
        pytest.param("min_p_sampling_from_probs", None, id="min_p_sampling_from_probs"),
    ],
)
def test_samples_in_kept_set_big_vocab(name, order, tier):
    """Llama-3 vocabulary, LLM-like rows (softmax of randn * 5), batch 1 and 8."""
    g = seeded("kept-big", name, order)
    gen = seeded("kept-big-gen", name, order)
    for B in (1, 8):
        if SAMPLERS[name][0] == "logits":
            x = randn((B, BIG_VOCAB), g, 5.0)
            probs = kernforge.softmax(x)
        else:
            x = probs = softmax_probs(B, BIG_VOCAB, g, scale=5.0)
        params = pick_params(name, order, probs, g, per_row=True)
        keep = ref_keep(name, probs, params, order)
        for _ in range(3):
            assert_in_kept(draw(name, x, params, order, generator=gen), keep, f"{name} tier={tier} B={B}")


@pytest.mark.parametrize("name,order", CASES)
def test_zero_entries_never_sampled(name, order, tier):
    """Filters that keep everything (top_k >= vocab keeps the zeros too, min_p = 0 keeps x >= 0)
    must still never draw a zero-probability token: rows 90 % zeros, the last entries zero, and
    nonzero values down to 1e-30."""
    g = seeded("zeros", name, order)
    B, V = 64, 4099
    probs = softmax_probs(B, V, g, scale=2.0)
    probs[torch.rand(B, V, generator=g) < 0.9] = 0.0
    probs[:, -40:] = 0.0
    probs[:, 0] = 0.5
    probs[::2, 1:200:3] = 1e-30
    x = probs if SAMPLERS[name][0] == "probs" else probs.log()  # log(0) = -inf: masked logits
    keep = ref_keep(name, kernforge.softmax(x) if SAMPLERS[name][0] == "logits" else probs, KEEP_ALL, order)
    gen = seeded("zeros-gen", name, order)
    for _ in range(16):
        assert_in_kept(draw(name, x, KEEP_ALL, order, generator=gen), keep, f"{name} {order} tier={tier}")


@pytest.mark.parametrize("name,order", FILTER_CASES)
def test_keep_only_max(name, order, tier):
    """top_k = 1, a tiny top_p (1e-7) and min_p = 1 leave only the argmax of each row."""
    g = seeded("argmax", name, order)
    B, V = 64, 4099
    x, probs = sampler_input(name, "softmax", B, V, g)
    expected = probs.argmax(-1).to(torch.int32)
    assert (probs == probs.amax(-1, keepdim=True)).sum(-1).eq(1).all(), "test data: unique maxima"
    gen = seeded("argmax-gen", name, order)
    for _ in range(3):
        samples = draw(name, x, KEEP_MAX, order, generator=gen)
        assert torch.equal(samples, expected), f"{name} {order} tier={tier}: not the argmax"
    if SAMPLERS[name][1] == ("top_k", "top_p"):  # each filter alone reaches the argmax
        for params in ({"top_k": 1, "top_p": 1.0}, {"top_k": V, "top_p": 1e-7}):
            assert torch.equal(draw(name, x, params, order, generator=gen), expected), (
                f"{name} {order} {params} tier={tier}"
            )


TOP_P_CASES = [c for c in FILTER_CASES if "top_p" in SAMPLERS[c.values[0]][1]]


@pytest.mark.parametrize("name,order", TOP_P_CASES)
def test_top_p_zero_is_greedy(name, order, tier):
    """top_p = 0 (FlashInfer accepts it; its top-p renorm keeps the top token) keeps the maximum
    of each row and the entries equal to it, as a scalar or per row (as float or int tensors),
    next to rows with other top-p values; every row is valid."""
    g = seeded("top-p-0", name, order)
    B, V = 16, 4099
    x, probs = sampler_input(name, "softmax", B, V, g)
    argmax = probs.argmax(-1).to(torch.int32)
    assert (probs == probs.amax(-1, keepdim=True)).sum(-1).eq(1).all(), "test data: unique maxima"
    top_k = {"top_k": 50} if "top_k" in SAMPLERS[name][1] else {}
    gen = seeded("top-p-0-gen", name, order)
    for top_p in (0.0, 0, torch.zeros(B), torch.zeros(B, dtype=torch.int64)):
        samples, valid = draw(name, x, {**top_k, "top_p": top_p}, order, generator=gen, return_valid=True)
        assert torch.equal(samples, argmax), f"{name} {order} top_p={top_p!r} tier={tier}: not the argmax"
        assert valid.all(), f"{name} {order} top_p={top_p!r} tier={tier}: invalid rows"
    mixed = torch.where(torch.arange(B) % 2 == 0, 0.0, 0.9)  # even rows greedy, odd rows nucleus
    params = {**top_k, "top_p": mixed}
    keep = ref_keep(name, probs, params, order)
    for _ in range(4):
        samples = draw(name, x, params, order, generator=gen)
        assert torch.equal(samples[::2], argmax[::2]), f"{name} {order} mixed tier={tier}: even rows"
        assert_in_kept(samples, keep, f"{name} {order} mixed tier={tier}")


def test_top_p_zero_keeps_tied_maxima(tier):
    """With top_p = 0, every entry equal to the row's maximum is kept and drawn, none other."""
    row = torch.tensor([0.1, 0.3, 0.05, 0.3, 0.25])
    probs, logits = row.reshape(1, -1), row.log().reshape(1, -1)
    indices = torch.zeros(4000, dtype=torch.int32)
    cases = [("top_p_sampling_from_probs", probs, {"top_p": 0.0}, None)]
    for order in ORDERS:
        for k in (1, 3, 5):
            cases.append(("top_k_top_p_sampling_from_probs", probs, {"top_k": k, "top_p": 0.0}, order))
            cases.append(("top_k_top_p_sampling_from_logits", logits, {"top_k": k, "top_p": 0.0}, order))
    for name, x, params, order in cases:
        samples = draw(name, x, params, order, indices=indices, generator=seeded("tied-max", name, order))
        drawn = sorted(set(samples.tolist()))
        assert drawn == [1, 3], f"{name} {params} {order} tier={tier}: drew {drawn}"
    out = kernforge.top_p_renorm_probs(probs, 0.0)
    assert torch.equal(out, torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])), f"top_p_renorm_probs tier={tier}: {out}"


@pytest.mark.parametrize("name,order", [c for c in FILTER_CASES if {"top_p", "min_p"} & set(SAMPLERS[c.values[0]][1])])
def test_no_filter_values(name, order, tier):
    """FlashInfer takes top_p >= 1 as no top-p (its renorm's p >= 1 path) and min_p <= 0 as no
    min-p (a threshold below every entry): the same samples as top_p = 1 / min_p = 0."""
    g = seeded("no-filter", name, order)
    B, V = 8, 1000
    x, probs = sampler_input(name, "softmax", B, V, g)
    filt = SAMPLERS[name][1]
    base = {p: KEEP_ALL[p] for p in filt}
    expected = draw(name, x, base, order, seed=5, offset=0)
    variants = []
    if "top_p" in filt:
        variants += [
            {**base, "top_p": v}
            for v in (1.5, float("inf"), torch.full((B,), 1.5), torch.full((B,), 2, dtype=torch.int64))
        ]
    if "min_p" in filt:
        variants += [{**base, "min_p": v} for v in (-0.5, -float("inf"), torch.full((B,), -1.0))]
    for params in variants:
        samples = draw(name, x, params, order, seed=5, offset=0)
        assert torch.equal(samples, expected), f"{name} {order} {params} tier={tier}"


def test_param_tensors_cast_by_value(tier):
    """As in FlashInfer (``.int()`` for top_k, ``.float()`` for top_p / min_p), a parameter tensor of
    any dtype is cast by value: an int64 ``torch.full((B,), 1)`` is min_p = 1, a float top_k
    truncates, a bool top_k of True is 1; non-contiguous tensors are fine."""
    g = seeded("cast")
    B, V = 6, 1000
    probs = softmax_probs(B, V, g)
    logits = probs.log()
    argmax = probs.argmax(-1).to(torch.int32)
    ones = torch.full((B,), 1)  # int64
    kw = {"seed": 11, "offset": 0}
    ctx = f"tier={tier}"
    assert torch.equal(kernforge.min_p_sampling_from_probs(probs, ones, **kw), argmax), ctx
    for k in (ones.double() + 0.9, ones.bool(), ones.short(), ones.int(), ones.to(torch.uint8)):
        assert torch.equal(kernforge.top_k_sampling_from_probs(probs, k, **kw), argmax), f"top_k {k.dtype} {ctx}"
    k = torch.full((2 * B,), 37.9, dtype=torch.float64)[::2]  # truncates to 37; stride 2
    assert torch.equal(
        kernforge.top_k_sampling_from_probs(probs, k, **kw), kernforge.top_k_sampling_from_probs(probs, 37, **kw)
    ), ctx
    assert torch.equal(kernforge.top_k_renorm_probs(probs, k), kernforge.top_k_renorm_probs(probs, 37)), ctx
    assert torch.equal(kernforge.top_k_mask_logits(logits, k), kernforge.top_k_mask_logits(logits, 37)), ctx
    # top_p = 1 as an int tensor: no top-p, as the scalar 1.0
    assert torch.equal(
        kernforge.top_p_sampling_from_probs(probs, ones, **kw), kernforge.top_p_sampling_from_probs(probs, 1.0, **kw)
    ), ctx
    assert torch.equal(kernforge.top_p_renorm_probs(probs, ones), kernforge.top_p_renorm_probs(probs, 1.0)), ctx
    # float64 top_p / min_p: their float32 values
    p = torch.linspace(0.1, 0.9, B, dtype=torch.float64)
    assert torch.equal(
        kernforge.top_p_sampling_from_probs(probs, p, **kw), kernforge.top_p_sampling_from_probs(probs, p.float(), **kw)
    ), ctx
    assert torch.equal(kernforge.top_p_renorm_probs(probs, p), kernforge.top_p_renorm_probs(probs, p.float())), ctx
    assert torch.equal(
        kernforge.min_p_sampling_from_probs(probs, p / 2, **kw),
        kernforge.min_p_sampling_from_probs(probs, (p / 2).float(), **kw),
    ), ctx
    k64 = torch.arange(1, B + 1) * 7
    for order in ORDERS:
        for op, x in (("top_k_top_p_sampling_from_probs", probs), ("top_k_top_p_sampling_from_logits", logits)):
            call = getattr(kernforge, op)
            assert torch.equal(
                call(x, k64.double(), p, filter_apply_order=order, **kw),
                call(x, k64.int(), p.float(), filter_apply_order=order, **kw),
            ), f"{op} {order} {ctx}"


def test_softmax_temperature_tensor_dtypes(tier):
    """A temperature tensor may be float16, bfloat16, float32 or float64 (FlashInfer's list): its
    values as float32."""
    logits = randn((4, 33), seeded("softmax-T-dtypes"), 3.0)
    t = torch.tensor([0.5, 1.0, 2.0, 0.75])
    expected = kernforge.softmax(logits, t)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        assert torch.equal(kernforge.softmax(logits, t.to(dtype)), expected), f"{dtype} tier={tier}"


def test_masked_logits_pipeline(tier):
    """top_k_mask_logits then sampling_from_logits: -inf logits are never drawn."""
    g = seeded("pipeline")
    logits = randn((32, 4099), g, 3.0)
    k = torch.randint(1, 50, (32,), generator=g)
    masked = kernforge.top_k_mask_logits(logits, k)
    keep = ref_top_k_keep(logits.double(), k)
    gen = seeded("pipeline-gen")
    for _ in range(8):
        assert_in_kept(kernforge.sampling_from_logits(masked, generator=gen), keep, f"tier={tier}")


# --------------------------------------------------------------------------- frequencies

FREQ_V = 1000


def _frequency_case(name, order, g):
    """(input [1, V], scalar params, reference distribution q [V]) for a frequency test."""
    from_logits = SAMPLERS[name][0] == "logits"
    if from_logits:
        x = randn((1, FREQ_V), g, 1.5)
        probs = kernforge.softmax(x)
    else:
        x = probs = softmax_probs(1, FREQ_V, g, scale=1.5, zero_frac=0.1)
    row = probs[0].double()
    params = {}
    filt = SAMPLERS[name][1]
    if filt == ("top_p",):
        params["top_p"] = safe_top_p(row, 0.7)
    elif filt == ("top_k",):
        params["top_k"] = 60
    elif filt == ("min_p",):
        params["min_p"] = safe_min_p(row, 0.05)
    elif filt:
        # top-k 100 holds less than 60 % of the mass: "joint" keeps the whole top-k set while
        # "top_k_first" keeps 60 % of the top-k mass, so the two orders differ
        params["top_k"] = 100
        restricted = torch.where(ref_top_k_keep(probs.double(), 100)[0], row, 0.0)
        params["top_p"] = safe_top_p(restricted if order == "top_k_first" else row, 0.6)
        other = "joint" if order == "top_k_first" else "top_k_first"
        assert not torch.equal(ref_keep(name, probs, params, order), ref_keep(name, probs, params, other)), (
            "test data: the two filter orders keep the same set"
        )
    q = renormalize(probs.double(), ref_keep(name, probs, params, order))[0]
    return x, params, q


@pytest.mark.parametrize("name,order", CASES)
def test_sampling_frequencies(name, order, tier):
    """100k samples of one row (indices all 0) follow the renormalized kept distribution."""
    g = seeded("freq", name, order)
    x, params, q = _frequency_case(name, order, g)
    indices = torch.zeros(FREQ_SAMPLES, dtype=torch.int32)
    samples = draw(name, x, params, order, indices=indices, generator=seeded("freq-gen", name, order))
    assert samples.shape == (FREQ_SAMPLES,)
    assert_frequencies(samples, q, f"{name} {order} {params} tier={tier} (kept {int((q > 0).sum())} tokens)")


@pytest.mark.parametrize("name,order", CASES)
def test_keep_all_params_frequencies(name, order, tier):
    """top_k >= vocab, top_p = 1, min_p = 0: plain sampling from the whole (normalized) row."""
    g = seeded("freq-all", name, order)
    V = 64
    probs = softmax_probs(1, V, g, scale=1.0)
    probs[0, 5:60:7] = 0.0
    x = probs if SAMPLERS[name][0] == "probs" else probs.log()
    q = renormalize(probs.double(), probs > 0)[0]
    indices = torch.zeros(FREQ_SAMPLES, dtype=torch.int64)
    for params in (KEEP_ALL, {"top_k": V, "top_p": 1.0, "min_p": 0.0}) if SAMPLERS[name][1] else (KEEP_ALL,):
        samples = draw(name, x, params, order, indices=indices, generator=seeded("freq-all-gen", name, order))
        assert samples.dtype == torch.int64
        assert_frequencies(samples, q, f"{name} {order} {params} tier={tier}")


def test_chi_square_can_fail(tier):
    """The statistical check has power: the same kernforge samples are rejected against a
    reference perturbed by +-10 % on alternate kept tokens, and so are torch.multinomial samples
    of the perturbed distribution; torch.multinomial samples of the true one pass."""
    g = seeded("chi2-power")
    x, params, q = _frequency_case("top_p_sampling_from_probs", None, g)
    wrong = q * (1.0 + 0.1 * (torch.arange(FREQ_V) % 2 * 2 - 1))
    wrong /= wrong.sum()
    indices = torch.zeros(FREQ_SAMPLES, dtype=torch.int32)
    samples = draw("top_p_sampling_from_probs", x, params, indices=indices, generator=seeded("chi2-gen"))
    counts = assert_frequencies(samples, q, f"kernforge tier={tier}")
    chi2, df, p = chi_square(counts, wrong)
    assert p < 1e-6, f"perturbed reference not rejected: chi2 {chi2:.1f}, {df} dof, p {p:.2e}"
    assert_frequencies(torch.multinomial(q, FREQ_SAMPLES, replacement=True, generator=g), q, "multinomial")
    counts = torch.bincount(torch.multinomial(wrong, FREQ_SAMPLES, replacement=True, generator=g), minlength=FREQ_V)
    chi2, df, p = chi_square(counts, q)
    assert p < 1e-6, f"multinomial(wrong) not rejected: chi2 {chi2:.1f}, {df} dof, p {p:.2e}"


# --------------------------------------------------------------------------- from_logits == softmax + from_probs


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name,order", [c for c in CASES if SAMPLERS[c.values[0]][0] == "logits"])
def test_from_logits_equals_softmax_then_from_probs(name, order, dtype, tier):
    g = seeded("logits-exact", name, order, dtype)
    probs_name = name.replace("_from_logits", "_from_probs")
    for B, V in [(64, 4099), (2, BIG_VOCAB)]:
        logits = randn((B, V), g, 3.0).to(dtype)
        probs = kernforge.softmax(logits)
        params = {
            "top_k": torch.randint(1, 200, (B,), generator=g, dtype=torch.int32),
            "top_p": 0.2 + 0.8 * torch.rand(B, generator=g),
        }
        ctx = f"{name} {order} dtype={dtype} tier={tier} B={B} V={V}"
        rngs = {  # each makes the random-state arguments of one call, the same for both calls
            "generator": lambda: {"generator": torch.Generator().manual_seed(12345)},
            "seed/offset ints": lambda: {"seed": 7, "offset": 3},
            "seed/offset tensors": lambda: {"seed": torch.arange(B) + 100, "offset": torch.tensor([11])},
        }
        for what, rng in rngs.items():
            a = draw(name, logits, params, order, **rng())
            b = draw(probs_name, probs, params, order, **rng())
            assert torch.equal(a, b), f"{ctx} {what}: {int((a != b).sum())} of {B} samples differ"


# --------------------------------------------------------------------------- determinism


def _flat(B, V, g):
    """Rows of values in [0.5, 1.5): flat enough that independent draws almost never agree."""
    return 0.5 + torch.rand(B, V, generator=g)


def _flat_case(name, B, V, g):
    """A flat-ish input for the sampler (probs or logits) and params that keep much of each row,
    so two independent draws of B rows practically never agree everywhere."""
    x = _flat(B, V, g) if SAMPLERS[name][0] == "probs" else randn((B, V), g, 0.5)
    return x, _flat_params(name, V)


def _flat_params(name, V):
    return {"top_k": V // 2, "top_p": 0.5, "min_p": 0.6}


@pytest.mark.parametrize("name,order", CASES)
def test_same_samples_for_any_thread_count(name, order, tier):
    """Batch 256 splits rows over threads; batch 1 at 128k splits one row over threads."""
    g = seeded("threads", name, order)
    for B, V in [(256, 4099), (1, BIG_VOCAB)]:
        x = _flat(B, V, g) if SAMPLERS[name][0] == "probs" else randn((B, V), g, 3.0)
        params = _flat_params(name, V)
        results = []
        try:
            for n in (1, 2):
                kernforge.set_num_threads(n)
                results.append(draw(name, x, params, order, generator=torch.Generator().manual_seed(99)))
        finally:
            kernforge.set_num_threads(None)
        assert torch.equal(results[0], results[1]), f"{name} {order} tier={tier} B={B}: threads change samples"


@pytest.mark.parametrize("name,order", CASES)
def test_generator_advances(name, order, tier):
    g = seeded("advance", name, order)
    B, V = 64, 1000
    x, params = _flat_case(name, B, V, g)
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    a = draw(name, x, params, order, generator=gen)
    assert not torch.equal(gen.get_state(), state), f"{name} tier={tier}: generator state did not advance"
    b = draw(name, x, params, order, generator=gen)
    assert not torch.equal(a, b), f"{name} {order} tier={tier}: consecutive calls drew the same {B} samples"
    again = draw(name, x, params, order, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, again), f"{name} {order} tier={tier}: same generator state, different samples"


@pytest.mark.parametrize("name,order", CASES)
def test_seed_and_offset(name, order, tier):
    g = seeded("seed", name, order)
    B, V = 64, 1000
    x, params = _flat_case(name, B, V, g)
    ctx = f"{name} {order} tier={tier}"

    def run(**kw):
        return draw(name, x, params, order, **kw)

    base = run(seed=1234, offset=8)
    assert torch.equal(base, run(seed=1234, offset=8)), f"{ctx}: int seed/offset not reproducible"
    assert not torch.equal(base, run(seed=1234, offset=9)), f"{ctx}: another offset drew the same samples"
    assert not torch.equal(base, run(seed=1235, offset=8)), f"{ctx}: another seed drew the same samples"
    # int64 tensors of length 1 apply to every row, like ints; so do length-B tensors of one value
    one = run(seed=torch.tensor([1234]), offset=torch.tensor([8]))
    assert torch.equal(one, base), f"{ctx}: length-1 seed/offset tensors differ from ints"
    assert torch.equal(run(seed=torch.full((B,), 1234), offset=torch.full((B,), 8)), base), (
        f"{ctx}: length-B seed/offset tensors of one value differ from ints"
    )
    per_row = run(seed=torch.tensor([1234]), offset=torch.arange(B) * 3)
    assert torch.equal(per_row, run(seed=torch.tensor([1234]), offset=torch.arange(B) * 3)), (
        f"{ctx}: per-row offsets not reproducible"
    )
    assert not torch.equal(per_row, base), f"{ctx}: per-row offsets drew the int offset's samples"
    # with both seed and offset the generator is neither used nor advanced
    gen = torch.Generator().manual_seed(77)
    state = gen.get_state()
    assert torch.equal(run(seed=1234, offset=8, generator=gen), base), f"{ctx}: generator used despite seed/offset"
    assert torch.equal(gen.get_state(), state), f"{ctx}: generator advanced despite seed/offset"


# --------------------------------------------------------------------------- indices


def _disjoint_rows(R, V, g):
    """R rows with disjoint supports (row r: tokens t with t % R == r), each with a unique maximum."""
    probs = torch.zeros(R, V)
    for r in range(R):
        tokens = torch.arange(r, V, R)
        probs[r, tokens] = torch.rand(len(tokens), generator=g) + 0.1
        probs[r, tokens[len(tokens) // 2]] = 3.0
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("idx_dtype", [None, torch.int32, torch.int64], ids=["none", "int32", "int64"])
@pytest.mark.parametrize("name,order", CASES)
def test_indices(name, order, idx_dtype, tier):
    """Output row i samples input row indices[i] with output row i's parameters; token ids have
    the indices' dtype (int32 without indices)."""
    g = seeded("indices", name, order, idx_dtype)
    R, V = 5, 67
    probs = _disjoint_rows(R, V, g)
    # -1e4: exp underflows to exactly 0, so the supports stay disjoint
    x = probs if SAMPLERS[name][0] == "probs" else torch.where(probs > 0, probs.log(), -1e4)
    if idx_dtype is None:
        indices, rows = None, torch.arange(R)
    else:
        rows = torch.randint(0, R, (300,), generator=g)  # several outputs from each row
        indices = rows.to(idx_dtype)
    B = len(rows)
    # even output rows keep everything, odd ones only the maximum: the parameters follow output rows
    only_max = torch.arange(B) % 2 == 1
    params = {
        "top_k": torch.where(only_max, 1, V).to(torch.int32),
        "top_p": torch.where(only_max, 1e-7, 1.0).float(),
        "min_p": torch.where(only_max, 1.0, 0.0).float(),
    }
    if SAMPLERS[name][1] == ("top_k", "top_p"):  # top-k alone narrows odd rows to the maximum
        params["top_p"] = torch.ones(B)
    ctx = f"{name} {order} indices={idx_dtype} tier={tier}"
    gen = seeded("indices-gen", name, order)
    argmax = probs.argmax(-1)[rows]
    drew_non_max = False
    for _ in range(8):
        samples = draw(name, x, params, order, indices=indices, generator=gen)
        assert samples.shape == (B,), ctx
        assert samples.dtype == (idx_dtype or torch.int32), f"{ctx}: samples dtype {samples.dtype}"
        assert_in_kept(samples, probs > 0, ctx, rows)
        if SAMPLERS[name][1]:
            assert torch.equal(samples[only_max].long(), argmax[only_max]), (
                f"{ctx}: rows keeping only the maximum drew another token"
            )
            drew_non_max |= bool((samples[~only_max].long() != argmax[~only_max]).any())
    # each maximum holds ~30 % of its row: rows keeping everything must draw other tokens too
    assert drew_non_max or not SAMPLERS[name][1], f"{ctx}: rows keeping everything drew only maxima"


# --------------------------------------------------------------------------- return_valid / NaN


@pytest.mark.parametrize("name,order", CASES)
def test_return_valid(name, order, tier):
    """A row with a NaN, and a row with no mass (all zeros; all -inf logits), give sample 0 and
    valid False; the other rows are valid and sample their support."""
    g = seeded("valid", name, order)
    V = 300
    probs = softmax_probs(5, V, g, zero_frac=0.5)
    probs[:, 0] = 0.0  # sample 0 is never a valid draw
    from_logits = SAMPLERS[name][0] == "logits"
    x = torch.where(probs > 0, probs.log(), -math.inf) if from_logits else probs.clone()
    x[1, 123] = math.nan
    x[3] = -math.inf if from_logits else 0.0
    params = {"top_k": 50, "top_p": 0.9, "min_p": 0.05}
    ctx = f"{name} {order} tier={tier}"
    samples, valid = draw(name, x, params, order, generator=seeded("valid-gen"), return_valid=True)
    assert valid.dtype == torch.bool and valid.shape == (5,), ctx
    assert valid.tolist() == [True, False, True, False, True], f"{ctx}: valid={valid.tolist()}"
    assert samples[1] == 0 and samples[3] == 0, f"{ctx}: invalid rows sampled {samples.tolist()}"
    ok = valid.nonzero().flatten()
    assert (probs[ok, samples[ok].long()] > 0).all(), f"{ctx}: valid rows drew zero-probability tokens"
    with pytest.raises(ValueError, match=re.compile("nan", re.IGNORECASE)):
        draw(name, x, params, order, generator=seeded("valid-gen"), check_nan=True)
    # a clean batch passes check_nan
    clean = x[[0, 2, 4]].contiguous()
    assert draw(name, clean, params, order, generator=seeded("valid-gen"), check_nan=True).shape == (3,), ctx


# --------------------------------------------------------------------------- errors

N_E, V_E = 4, 32


def _names(arg):
    """Regex: the message names the argument (as a whole word); or ``arg`` itself, a compiled
    regex for an exact message (FlashInfer's, which does not name the parameter)."""
    if isinstance(arg, re.Pattern):
        return arg
    return re.compile(rf"\b{re.escape(arg)}\b", re.IGNORECASE)


# FlashInfer's check_tensor_param (csrc/sampling_utils.h), word for word
FI_0D = (
    "Expected a 1D tensor of shape (batch_size,) or scalar for the sampling parameter, but got a 0-dimensional tensor."
)


def fi_nd(ndim):
    return f"Expected a 1D tensor or scalar for the sampling parameter, but got a {ndim}D tensor."


def fi_length(expected, got):
    return (
        f"Sampling parameter tensor batch size mismatch: expected length {expected} to match the "
        f"reference tensor batch size, but got length {got}."
    )


def _exactly(message):
    """The whole message (pytest's ``match`` also sees the exception's notes, on their own lines)."""
    return re.compile(rf"^{re.escape(message)}(?:\n|\Z)")


def _sampler_call(name, **kw):
    """Call sampler ``name`` with well-formed defaults for every argument not given."""
    kind, filt = SAMPLERS[name]
    x = kw.pop(kind, None)
    if x is None:
        x = torch.softmax(torch.randn(N_E, V_E), -1) if kind == "probs" else torch.randn(N_E, V_E)
    defaults = {"top_k": 5, "top_p": 0.9, "min_p": 0.1}
    args = [kw.pop(p, defaults[p]) for p in filt]
    return getattr(kernforge, name)(x, *args, **kw)


def _sampler_errors():
    cases = []
    for name, (kind, filt) in SAMPLERS.items():

        def add(what, exc, arg, **kw):
            cases.append(pytest.param(name, kw, exc, arg, id=f"{name}-{what}"))

        if kind == "probs":  # sampling from probs takes float32 only
            add("bf16", TypeError, "probs", probs=torch.rand(N_E, V_E).bfloat16())
            add("fp16", TypeError, "probs", probs=torch.rand(N_E, V_E).half())
        add("int", TypeError, kind, **{kind: torch.ones(N_E, V_E, dtype=torch.int32)})
        add("float64", TypeError, kind, **{kind: torch.rand(N_E, V_E, dtype=torch.float64)})
        add("1d", ValueError, kind, **{kind: torch.rand(V_E)})
        add("3d", ValueError, kind, **{kind: torch.rand(2, N_E, V_E)})
        add("meta", ValueError, kind, **{kind: torch.rand(N_E, V_E, device="meta")})
        add("indices-float", TypeError, "indices", indices=torch.zeros(N_E))
        add("indices-negative", ValueError, "indices", indices=torch.tensor([0, -1, 1], dtype=torch.int32))
        add("indices-too-big", ValueError, "indices", indices=torch.tensor([0, N_E, 1]))
        add("seed-length", ValueError, "seed", seed=torch.tensor([1, 2, 3]), offset=0)
        add("offset-length", ValueError, "offset", seed=1, offset=torch.tensor([1, 2, 3]))
        if "top_k" in filt:
            add("top_k-0", ValueError, "top_k", top_k=0)
            add("top_k-negative", ValueError, "top_k", top_k=-3)
            add("top_k-tensor-0", ValueError, "top_k", top_k=torch.tensor([5, 0, 5, 5]))
            # cast by value as FlashInfer's .int(): 0.5 truncates to 0
            add("top_k-float-tensor-0.5", ValueError, "top_k", top_k=torch.tensor([5, 0.5, 5, 5]))
            add("top_k-length", ValueError, _exactly(fi_length(N_E, 3)), top_k=torch.tensor([5, 5, 5]))
            # 3 output rows from 4 input rows: parameters are per output row
            add(
                "top_k-length-indices",
                ValueError,
                _exactly(fi_length(3, 4)),
                top_k=torch.tensor([5, 5, 5, 5]),
                indices=torch.tensor([0, 1, 2]),
            )
            add("top_k-meta", ValueError, "top_k", top_k=torch.tensor([5, 5, 5, 5], device="meta"))
        if "top_p" in filt:  # 0 (greedy) and > 1 (no top-p) are valid, as in FlashInfer
            for bad in (-0.1, float("nan")):
                add(f"top_p-{bad}", ValueError, "top_p", top_p=bad)
            add("top_p-tensor-negative", ValueError, "top_p", top_p=torch.tensor([0.5, -0.1, 0.9, 0.9]))
            add("top_p-tensor-nan", ValueError, "top_p", top_p=torch.tensor([0.5, float("nan"), 0.9, 0.9]))
            add("top_p-length", ValueError, _exactly(fi_length(N_E, N_E + 1)), top_p=torch.full((N_E + 1,), 0.9))
            add("top_p-meta", ValueError, "top_p", top_p=torch.full((N_E,), 0.9, device="meta"))
        if "min_p" in filt:  # < 0 is valid (no min-p), as in FlashInfer
            for bad in (1.5, float("nan")):
                add(f"min_p-{bad}", ValueError, "min_p", min_p=bad)
            add("min_p-tensor", ValueError, "min_p", min_p=torch.tensor([0.1, 0.1, 1.5, 0.1]))
            add("min_p-length", ValueError, _exactly(fi_length(N_E, 2)), min_p=torch.full((2,), 0.1))
        if filt == ("top_k", "top_p"):
            add("filter_apply_order", ValueError, "filter_apply_order", filter_apply_order="bogus")
    return cases


@pytest.mark.parametrize("name,kw,exc,arg", _sampler_errors())
def test_sampler_errors(name, kw, exc, arg):
    with pytest.raises(exc, match=_names(arg)):
        _sampler_call(name, generator=torch.Generator().manual_seed(0), **kw)


def _other_errors():
    probs = torch.softmax(torch.randn(N_E, V_E), -1)
    logits = torch.randn(N_E, V_E)
    ints = torch.ones(N_E, V_E, dtype=torch.int32)
    return [
        pytest.param(lambda: kernforge.softmax(ints), TypeError, "logits", id="softmax-int"),
        pytest.param(lambda: kernforge.softmax(torch.randn(V_E)), ValueError, "logits", id="softmax-1d"),
        pytest.param(lambda: kernforge.softmax(logits.to("meta")), ValueError, "logits", id="softmax-meta"),
        pytest.param(lambda: kernforge.softmax(logits, 0.0), ValueError, "temperature", id="softmax-T0"),
        pytest.param(lambda: kernforge.softmax(logits, -1.0), ValueError, "temperature", id="softmax-T-neg"),
        pytest.param(
            lambda: kernforge.softmax(logits, torch.tensor([1.0, 0.0, 1.0, 1.0])),
            ValueError,
            "temperature",
            id="softmax-T-tensor-0",
        ),
        pytest.param(
            lambda: kernforge.softmax(logits, torch.ones(N_E + 1)), ValueError, "temperature", id="softmax-T-length"
        ),
        # FlashInfer's _validate_softmax_temperature, word for word
        pytest.param(
            lambda: kernforge.softmax(logits, torch.ones(N_E + 1)),
            ValueError,
            _exactly(f"temperature tensor length must equal logits.size(0) ({N_E}), got {N_E + 1}"),
            id="softmax-T-length-message",
        ),
        pytest.param(
            lambda: kernforge.softmax(logits, torch.tensor(1.0)),
            ValueError,
            _exactly("temperature tensor must be 1D with one value per logits row, got shape ()"),
            id="softmax-T-0d",
        ),
        pytest.param(
            lambda: kernforge.softmax(logits, torch.ones(N_E, 1)),
            ValueError,
            _exactly(f"temperature tensor must be 1D with one value per logits row, got shape ({N_E}, 1)"),
            id="softmax-T-2d",
        ),
        pytest.param(
            lambda: kernforge.softmax(logits, torch.ones(N_E, dtype=torch.int64)),
            ValueError,
            _exactly("temperature tensor must have dtype float16, bfloat16, float32, or float64, got torch.int64"),
            id="softmax-T-int-tensor",
        ),
        pytest.param(
            lambda: kernforge.softmax(logits, torch.ones(N_E, device="meta")),
            ValueError,
            _exactly("temperature tensor must be on the same device as logits (cpu), got meta"),
            id="softmax-T-meta",
        ),
        pytest.param(
            lambda: kernforge.softmax(logits, "1.0"),
            TypeError,
            _exactly(
                "temperature must be None, a real scalar, or a 1D floating-point tensor with one value per logits row"
            ),
            id="softmax-T-str",
        ),
        pytest.param(lambda: kernforge.softmax(logits, True), TypeError, "temperature", id="softmax-T-bool"),
        pytest.param(lambda: kernforge.softmax(logits, float("inf")), ValueError, "temperature", id="softmax-T-inf"),
        pytest.param(lambda: kernforge.top_p_renorm_probs(ints, 0.9), TypeError, "probs", id="top_p_renorm-int"),
        pytest.param(lambda: kernforge.top_p_renorm_probs(probs[0], 0.9), ValueError, "probs", id="top_p_renorm-1d"),
        pytest.param(
            lambda: kernforge.top_p_renorm_probs(probs.to("meta"), 0.9), ValueError, "probs", id="top_p_renorm-meta"
        ),
        pytest.param(
            lambda: kernforge.top_p_renorm_probs(probs, -0.5), ValueError, "top_p", id="top_p_renorm-p-negative"
        ),
        pytest.param(
            lambda: kernforge.top_p_renorm_probs(probs, float("nan")), ValueError, "top_p", id="top_p_renorm-p-nan"
        ),
        pytest.param(
            lambda: kernforge.top_p_renorm_probs(probs, torch.tensor([0.5, -0.5, 0.5, 0.5])),
            ValueError,
            "top_p",
            id="top_p_renorm-tensor-negative",
        ),
        pytest.param(
            lambda: kernforge.top_p_renorm_probs(probs, torch.full((2,), 0.5)),
            ValueError,
            _exactly(fi_length(N_E, 2)),
            id="top_p_renorm-length",
        ),
        pytest.param(lambda: kernforge.top_k_renorm_probs(ints, 3), TypeError, "probs", id="top_k_renorm-int"),
        pytest.param(
            lambda: kernforge.top_k_renorm_probs(probs.reshape(1, N_E, V_E), 3),
            ValueError,
            "probs",
            id="top_k_renorm-3d",
        ),
        pytest.param(lambda: kernforge.top_k_renorm_probs(probs, 0), ValueError, "top_k", id="top_k_renorm-k0"),
        pytest.param(
            lambda: kernforge.top_k_renorm_probs(probs, torch.tensor([5, 0, 5, 5])),
            ValueError,
            "top_k",
            id="top_k_renorm-tensor-0",
        ),
        pytest.param(
            lambda: kernforge.top_k_renorm_probs(probs, torch.tensor([5, 5])),
            ValueError,
            _exactly(fi_length(N_E, 2)),
            id="top_k_renorm-length",
        ),
        pytest.param(lambda: kernforge.top_k_mask_logits(ints, 3), TypeError, "logits", id="top_k_mask-int"),
        pytest.param(
            lambda: kernforge.top_k_mask_logits(logits.double(), 3), TypeError, "logits", id="top_k_mask-float64"
        ),
        pytest.param(lambda: kernforge.top_k_mask_logits(logits[0], 3), ValueError, "logits", id="top_k_mask-1d"),
        pytest.param(lambda: kernforge.top_k_mask_logits(logits, 0), ValueError, "top_k", id="top_k_mask-k0"),
        pytest.param(
            lambda: kernforge.top_k_mask_logits(logits, torch.tensor([3, 3, -1, 3])),
            ValueError,
            "top_k",
            id="top_k_mask-tensor-neg",
        ),
        pytest.param(
            lambda: kernforge.softmax(logits.bfloat16(), out=logits.bfloat16()), TypeError, "out", id="softmax-out-bf16"
        ),
        pytest.param(
            lambda: kernforge.top_p_renorm_probs(probs, 0.9, out=probs[:2]),
            ValueError,
            "out",
            id="top_p_renorm-out-shape",
        ),
        pytest.param(
            lambda: kernforge.top_k_renorm_probs(probs, 3, out=torch.empty(V_E, N_E).t()),
            ValueError,
            "out",
            id="top_k_renorm-out-strided",
        ),
        pytest.param(
            lambda: kernforge.top_k_mask_logits(logits, 3, out=logits.tolist()),
            TypeError,
            "out",
            id="top_k_mask-out-list",
        ),
        pytest.param(
            lambda: kernforge.top_k_mask_logits(logits, 3, out=torch.empty(V_E).expand(N_E, V_E)),
            ValueError,
            "out",
            id="top_k_mask-out-overlapping-rows",
        ),
    ]


@pytest.mark.parametrize("call,exc,arg", _other_errors())
def test_renorm_mask_softmax_errors(call, exc, arg):
    with pytest.raises(exc, match=_names(arg)):
        call()


PARAM_OPS = [pytest.param(name, p, id=f"{name}-{p}") for name, (_, filt) in SAMPLERS.items() for p in filt] + [
    pytest.param(op, p, id=f"{op}-{p}")
    for op, p in (("top_p_renorm_probs", "top_p"), ("top_k_renorm_probs", "top_k"), ("top_k_mask_logits", "top_k"))
]
GOOD_PARAMS = {"top_k": 5, "top_p": 0.9, "min_p": 0.1}


def _call_with_param(op, param, value, **kw):
    if op in SAMPLERS:
        return _sampler_call(op, seed=0, offset=0, **{param: value}, **kw)
    x = torch.randn(N_E, V_E) if op == "top_k_mask_logits" else torch.softmax(torch.randn(N_E, V_E), -1)
    return getattr(kernforge, op)(x, value)


@pytest.mark.parametrize("op,param", PARAM_OPS)
def test_param_tensor_shape_errors_are_flashinfers(op, param):
    """A 0-D, 2-D ([batch, vocab], as in FlashInfer's own test), 3-D or wrong-length parameter tensor
    raises FlashInfer's ValueError with its exact message, whatever its dtype; where Python has
    exception notes (>= 3.11), a note names the parameter."""
    v = GOOD_PARAMS[param]
    cases = [
        (torch.tensor(v), FI_0D),
        (torch.full((N_E, V_E), v), fi_nd(2)),
        (torch.full((1, N_E), v), fi_nd(2)),
        (torch.full((N_E, 1, 1), v), fi_nd(3)),
        (torch.full((N_E - 1,), v), fi_length(N_E, N_E - 1)),
        (torch.full((N_E + 1,), v), fi_length(N_E, N_E + 1)),
        (torch.full((0,), v), fi_length(N_E, 0)),
    ]
    for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
        for t, message in cases:
            with pytest.raises(ValueError) as info:
                _call_with_param(op, param, t.to(dtype))
            assert str(info.value) == message, f"{op} {param} {dtype} {tuple(t.shape)}"
            if hasattr(ValueError, "add_note"):
                assert any(param in note for note in info.value.__notes__), info.value.__notes__
    if op in SAMPLERS:  # with indices, one value per output row: the reference length is theirs
        indices = torch.tensor([0, 1, 2, 3, 0, 1])
        with pytest.raises(ValueError) as info:
            _call_with_param(op, param, torch.full((N_E,), v), indices=indices)
        assert str(info.value) == fi_length(len(indices), N_E)
        assert _call_with_param(op, param, torch.full((len(indices),), v), indices=indices).shape == (len(indices),)


# --------------------------------------------------------------------------- out=


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", ["top_k_renorm_probs", "top_p_renorm_probs", "top_k_mask_logits", "softmax"])
def test_out_preallocated_and_in_place(op, dtype, tier):
    """``out=`` (beyond FlashInfer's signatures) gives the allocating call's result, also when it is
    the input itself; only rows of ``out`` are written (a padded row stride keeps its padding)."""
    g = seeded("out", op, dtype)
    B, V = 5, 4099
    x = (softmax_probs(B, V, g) if "renorm" in op else torch.randn(B, V, generator=g) * 3).to(dtype)
    param = () if op == "softmax" else (0.8,) if op == "top_p_renorm_probs" else (37,)
    call = getattr(kernforge, op)
    expected = call(x, *param)
    backing = torch.full((B, V + PAD), 7.0, dtype=expected.dtype)
    out = backing[:, :V]
    assert call(x, *param, out=out) is out
    assert torch.equal(out, expected), f"{op} {dtype} tier={tier}: out= differs from the allocating call"
    assert torch.all(backing[:, V:] == 7.0), f"{op} {dtype} tier={tier}: wrote into the row padding"
    if expected.dtype == dtype:  # in place
        x_in_place = x.clone()
        call(x_in_place, *param, out=x_in_place)
        assert torch.equal(x_in_place, expected), f"{op} {dtype} tier={tier}: in place differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_top_k_mask_logits_with_nan(dtype, tier):
    """NaN logits (some in the last lanes of a vector, which a vector max can pass on) never reach
    the top-k selection: they come out -inf and the rest is masked as without them."""
    g = seeded("mask-nan", dtype)
    B, V, k = 3, 4099, 20
    logits = torch.randn(B, V, generator=g).to(dtype)
    nan_at = torch.tensor([0, 15, 31, 1000, 4095, 4098])
    logits[:, nan_at] = float("nan")
    out = kernforge.top_k_mask_logits(logits, k)
    finite = logits.float().nan_to_num(nan=-float("inf"))
    kth = finite.topk(k, -1).values[:, -1:]
    expected = torch.where(finite >= kth, finite, -float("inf"))
    assert torch.equal(out.float(), expected), f"dtype={dtype} tier={tier}"
