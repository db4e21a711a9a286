"""Tests for the attention-state merging ops (FlashInfer's cascade): ``merge_state``,
``merge_state_in_place`` and ``merge_states``.

The states come from real attention: random q, k, v; the keys are split into segments and each
segment's attention output and log-sum-exp are computed in float64 in FlashInfer's convention,
``s = log2(sum_i exp(logit_i))`` (torch's natural logsumexp / ln 2; an empty segment is
``(0, -inf)``). The op merges the states rounded to the kernel dtype, and is compared with

* a float64 merge of the same rounded states (per-dtype tolerance), and
* attention over all the keys at once: in fp32, where rounding cannot hide a wrong convention,
  for v; in every dtype for s, which is float32 whatever v's dtype.

Every test runs on the best ISA tier and a slice of it on the lower ones (``tier`` fixture).
"""

import math

import pytest
import torch

import kernforge

from op_helpers import DTYPE_IDS, DTYPES, assert_outside_untouched, randn, seeded

LN2 = math.log(2.0)
NUM_HEADS = 3
KV_LEN = 40
QK_DIM = 16
HEAD_DIMS = [7, 72, 100, 128]  # below one vector, vector multiples plus tails (16 lanes: 4+8, 6+4), panels
SEQ_LENS = [1, 37]
LSE_TOL = dict(atol=1e-5, rtol=1e-5)  # s is float32 for every v dtype


# --------------------------------------------------------------------------- references


def attention_states(seq_len, head_dim, bounds, g):
    """States of the key segments [bounds[i], bounds[i + 1]) and of all keys [bounds[0], bounds[-1]).

    Returns (v [seq_len, segments, heads, head_dim], s [seq_len, segments, heads], (v_all, s_all)),
    float64, s in base 2."""
    q = randn((seq_len, NUM_HEADS, QK_DIM), g).double()
    k = randn((KV_LEN, NUM_HEADS, QK_DIM), g).double()
    values = randn((KV_LEN, NUM_HEADS, head_dim), g).double()
    logits = torch.einsum("thd,khd->thk", q, k) * 0.6  # spread of a few units: the weights differ a lot

    def state(lo, hi):
        if lo == hi:
            return (
                torch.zeros(seq_len, NUM_HEADS, head_dim, dtype=torch.float64),
                torch.full((seq_len, NUM_HEADS), -math.inf, dtype=torch.float64),
            )
        seg = logits[..., lo:hi]
        out = torch.einsum("thk,khd->thd", torch.softmax(seg, dim=-1), values[lo:hi])
        return out, torch.logsumexp(seg, dim=-1) / LN2

    parts = [state(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    v = torch.stack([p[0] for p in parts], dim=1)
    s = torch.stack([p[1] for p in parts], dim=1)
    return v, s, state(bounds[0], bounds[-1])


def ref_merge(v, s):
    """float64 merge of states v [T, N, H, D], s [T, N, H] (base 2) over N; empty -> (0, -inf).
    A state with s = -inf contributes nothing, whatever its v holds."""
    v64, s64 = v.double(), s.double()
    v64 = torch.where(torch.isneginf(s64)[..., None], 0.0, v64)
    s_max = s64.amax(dim=1, keepdim=True) if s64.shape[1] else torch.full_like(s64[:, :1], -math.inf)
    empty = torch.isneginf(s_max)
    w = torch.exp2(s64 - torch.where(empty, 0.0, s_max))
    total = w.sum(dim=1, keepdim=True)
    out = (v64 * (w / torch.where(empty, 1.0, total))[..., None]).sum(dim=1)
    lse = torch.where(empty, -math.inf, s_max + torch.log2(total)).squeeze(1)
    return out, lse


def random_bounds(num_segments, g):
    cuts = sorted(torch.randint(0, KV_LEN + 1, (num_segments - 1,), generator=g).tolist())
    return [0, *cuts, KV_LEN]


def check_merged(out, lse, v_in, s_in, whole, dtype, ctx, assert_close_ref):
    """out/lse against the float64 merge of the inputs the op saw, and against whole-KV attention."""
    assert out.dtype == dtype and lse.dtype == torch.float32, ctx
    expected_v, expected_s = ref_merge(v_in, s_in)
    assert_close_ref(out, expected_v, dtype, ctx)
    torch.testing.assert_close(lse, expected_s.float(), **LSE_TOL, msg=lambda m: f"{ctx}: s\n{m}")
    v_all, s_all = whole
    torch.testing.assert_close(lse, s_all.float(), **LSE_TOL, msg=lambda m: f"{ctx}: s vs all keys\n{m}")
    if dtype == torch.float32:
        assert_close_ref(out, v_all, dtype, f"{ctx}: v vs attention over all keys")


# --------------------------------------------------------------------------- split KV


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_merge_states_split_kv(dtype, head_dim, tier, assert_close_ref):
    g = seeded("merge_states", dtype, head_dim)
    for seq_len in SEQ_LENS:
        for num_states in range(1, 6):
            bounds = random_bounds(num_states, g)
            v, s, whole = attention_states(seq_len, head_dim, bounds, g)
            v, s = v.to(dtype), s.float()
            v_before, s_before = v.clone(), s.clone()
            out, lse = kernforge.merge_states(v, s)
            ctx = f"merge_states dtype={dtype} tier={tier} T={seq_len} N={num_states} D={head_dim} bounds={bounds}"
            assert out.shape == (seq_len, NUM_HEADS, head_dim) and lse.shape == (seq_len, NUM_HEADS), ctx
            check_merged(out, lse, v, s, whole, dtype, ctx, assert_close_ref)
            assert torch.equal(v, v_before) and torch.equal(s, s_before), f"{ctx}: inputs modified"


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_merge_state_split_kv(dtype, head_dim, tier, assert_close_ref):
    g = seeded("merge_state", dtype, head_dim)
    for seq_len in SEQ_LENS:
        for cut in (0, 13, KV_LEN):  # A empty, both keyed, B empty
            v, s, whole = attention_states(seq_len, head_dim, [0, cut, KV_LEN], g)
            v, s = v.to(dtype), s.float()
            v_a, v_b, s_a, s_b = v[:, 0].clone(), v[:, 1].clone(), s[:, 0].clone(), s[:, 1].clone()
            out, lse = kernforge.merge_state(v_a, s_a, v_b, s_b)
            ctx = f"merge_state dtype={dtype} tier={tier} T={seq_len} D={head_dim} cut={cut}"
            assert out.shape == v_a.shape and lse.shape == s_a.shape, ctx
            check_merged(out, lse, v, s, whole, dtype, ctx, assert_close_ref)
            assert torch.equal(v_a, v[:, 0]) and torch.equal(s_b, s[:, 1]), f"{ctx}: inputs modified"


MASKS = ["none", "random", "all_false", "uint8"]


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("head_dim", [7, 100], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_merge_state_in_place(dtype, head_dim, mask_kind, tier, assert_close_ref):
    g = seeded("merge_state_in_place", dtype, head_dim, mask_kind)
    for seq_len in SEQ_LENS:
        v, s, whole = attention_states(seq_len, head_dim, [0, 17, KV_LEN], g)
        v, s = v.to(dtype), s.float()
        merge = torch.ones(seq_len, dtype=torch.bool)
        if mask_kind in ("random", "uint8"):
            merge = torch.rand(seq_len, generator=g) < 0.5
            merge[0] = seq_len == 1  # a 1-token batch merges, a longer one starts with an untouched row
        elif mask_kind == "all_false":
            merge[:] = False
        mask = {"none": None, "uint8": merge.to(torch.uint8)}.get(mask_kind, merge)
        v_self, s_self = v[:, 0].clone(), s[:, 0].clone()
        ret = kernforge.merge_state_in_place(v_self, s_self, v[:, 1], s[:, 1], mask)
        ctx = f"merge_state_in_place dtype={dtype} tier={tier} T={seq_len} D={head_dim} mask={mask_kind}"
        assert ret is None, ctx
        assert torch.equal(v_self[~merge], v[~merge, 0]), f"{ctx}: a masked-off row of v changed"
        assert torch.equal(s_self[~merge], s[~merge, 0]), f"{ctx}: a masked-off row of s changed"
        if merge.any():
            check_merged(
                v_self[merge],
                s_self[merge],
                v[merge],
                s[merge],
                (whole[0][merge], whole[1][merge]),
                dtype,
                ctx,
                assert_close_ref,
            )


def test_many_states(tier, assert_close_ref):
    """More states than the kernel keeps on its stack (64): the heap path."""
    g = seeded("many_states")
    seq_len, num_states, head_dim = 3, 67, 72
    v = randn((seq_len, num_states, NUM_HEADS, head_dim), g).to(torch.bfloat16)
    s = randn((seq_len, num_states, NUM_HEADS), g, 4.0)
    s[:, ::5] = -math.inf
    out, lse = kernforge.merge_states(v, s)
    expected_v, expected_s = ref_merge(v, s)
    assert_close_ref(out, expected_v, torch.bfloat16, f"67 states tier={tier}")
    torch.testing.assert_close(lse, expected_s.float(), **LSE_TOL)


# --------------------------------------------------------------------------- empty and NaN states


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty_states(dtype, tier, assert_close_ref):
    """s = -inf is an empty segment: it contributes nothing, even if its v holds NaN garbage, and
    merging only empty states (or none) gives (0, -inf), as FlashInfer's empty state."""
    g = seeded("empty", dtype)
    T, N, H, D = 4, 4, NUM_HEADS, 100
    v = randn((T, N, H, D), g).to(dtype)
    s = randn((T, N, H), g, 3.0)
    s[:, 1] = -math.inf
    v[:, 1] = math.nan
    s[2] = -math.inf  # token 2: every state empty
    s[3, :, 0] = -math.inf  # token 3, head 0 too
    out, lse = kernforge.merge_states(v, s)
    expected_v, expected_s = ref_merge(v, s)
    assert not out.isnan().any(), "an empty state's v leaked into the result"
    assert_close_ref(out, expected_v, dtype, f"empty states dtype={dtype} tier={tier}")
    torch.testing.assert_close(lse, expected_s.float(), **LSE_TOL)
    assert torch.all(out[2] == 0) and torch.all(out[3, 0] == 0) and torch.isneginf(lse[2]).all()

    out, lse = kernforge.merge_states(v[:, :0], s[:, :0])  # zero states
    assert torch.all(out == 0) and out.shape == (T, H, D) and torch.isneginf(lse).all()

    both_empty = torch.full((T, H), -math.inf)
    out, lse = kernforge.merge_state(v[:, 1], both_empty, v[:, 1], both_empty)
    assert torch.all(out == 0) and torch.isneginf(lse).all()
    out, lse = kernforge.merge_state(v[:, 0], s[:, 0], v[:, 1], both_empty)  # B empty: A (or empty)
    assert_close_ref(out, torch.where(torch.isneginf(s[:, 0])[..., None], 0.0, v[:, 0].float()), dtype)
    assert torch.equal(lse, s[:, 0])

    v_self, s_self = v[:, 1].clone(), both_empty.clone()
    kernforge.merge_state_in_place(v_self, s_self, v[:, 1], both_empty)
    assert torch.all(v_self == 0) and torch.isneginf(s_self).all()


def test_nan_score_propagates(tier):
    v = torch.randn(2, 3, NUM_HEADS, 20)
    s = torch.randn(2, 3, NUM_HEADS)
    s[0, 1, 2] = math.nan
    out, lse = kernforge.merge_states(v, s)
    assert out[0, 2].isnan().all() and lse[0, 2].isnan()
    assert not out[1].isnan().any() and not lse[1].isnan().any() and not out[0, :2].isnan().any()


def test_zero_sizes(tier):
    out, lse = kernforge.merge_states(torch.randn(0, 2, NUM_HEADS, 8), torch.randn(0, 2, NUM_HEADS))
    assert out.shape == (0, NUM_HEADS, 8) and lse.shape == (0, NUM_HEADS)
    out, lse = kernforge.merge_state(*(torch.randn(5, 0, 8), torch.randn(5, 0)) * 2)
    assert out.shape == (5, 0, 8) and lse.shape == (5, 0)
    # head_dim 0 still merges s
    s = torch.randn(2, 3, NUM_HEADS)
    out, lse = kernforge.merge_states(torch.randn(2, 3, NUM_HEADS, 0), s)
    torch.testing.assert_close(lse, ref_merge(torch.zeros(2, 3, NUM_HEADS, 0), s)[1].float(), **LSE_TOL)


# --------------------------------------------------------------------------- layouts


def _padded(t, pad=5):
    """t with every row (last dim) padded: strided rows, contiguous last dimension."""
    backing = torch.full(t.shape[:-1] + (t.shape[-1] + pad,), 7.0, dtype=t.dtype)
    view = backing[..., : t.shape[-1]]
    view.copy_(t)
    return view, backing


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layouts(dtype, tier, assert_close_ref):
    g = seeded("layouts", dtype)
    T, D = 37, 72
    v, s, whole = attention_states(T, D, [0, 9, 9, 30, KV_LEN], g)
    v, s = v.to(dtype), s.float()
    expected = ref_merge(v, s)

    def check(out, lse, ctx):
        assert_close_ref(out, expected[0], dtype, f"{ctx} dtype={dtype} tier={tier}")
        torch.testing.assert_close(lse, expected[1].float(), **LSE_TOL)

    # merge_states: padded rows; states-major memory; s with strided heads; v with a strided last dim (copied)
    check(*kernforge.merge_states(_padded(v)[0], s), "padded v")
    check(
        *kernforge.merge_states(
            v.transpose(0, 1).contiguous().transpose(0, 1), s.transpose(0, 2).contiguous().transpose(0, 2)
        ),
        "transposed v, s",
    )
    s_strided = torch.zeros(s.shape + (2,)).select(-1, 0)
    s_strided.copy_(s)
    check(*kernforge.merge_states(v, s_strided), "strided s")
    v_wide = torch.zeros(v.shape + (3,), dtype=dtype).select(-1, 1)
    v_wide.copy_(v)
    check(*kernforge.merge_states(v_wide, s), "strided last dim of v")

    # merge_state on views of the states tensor (strided rows, shared storage)
    pair_expected = ref_merge(v[:, :2], s[:, :2])
    out, lse = kernforge.merge_state(v[:, 0], s[:, 0], v_wide[:, 1], s_strided[:, 1])
    assert_close_ref(out, pair_expected[0], dtype, f"merge_state views dtype={dtype} tier={tier}")
    torch.testing.assert_close(lse, pair_expected[1].float(), **LSE_TOL)

    # merge_state_in_place into padded v rows and padded s rows: nothing outside the views is written
    v_self, v_backing = _padded(v[:, 0], pad=3)
    s_self, s_backing = _padded(s[:, 0], pad=2)
    v_backing_before, s_backing_before = v_backing.clone(), s_backing.clone()
    mask = torch.arange(T) % 3 != 1
    kernforge.merge_state_in_place(v_self, s_self, v[:, 1], s[:, 1], mask=mask)
    assert_close_ref(v_self[mask], pair_expected[0][mask], dtype, f"in place padded dtype={dtype} tier={tier}")
    torch.testing.assert_close(s_self[mask], pair_expected[1][mask].float(), **LSE_TOL)
    assert torch.equal(v_self[~mask], v[~mask, 0]) and torch.equal(s_self[~mask], s[~mask, 0])
    inside_v = torch.zeros_like(v_backing, dtype=torch.bool)
    inside_v[..., :D] = True
    inside_s = torch.zeros_like(s_backing, dtype=torch.bool)
    inside_s[..., :NUM_HEADS] = True
    assert_outside_untouched(v_backing, v_backing_before, inside_v, "merge_state_in_place v")
    assert_outside_untouched(s_backing, s_backing_before, inside_s, "merge_state_in_place s")


def test_read_only_scores_are_converted(tier, assert_close_ref):
    """As FlashInfer (``s.to(torch.float32)``), a read-only s of another float dtype is accepted."""
    v = torch.randn(4, 2, NUM_HEADS, 16)
    s = torch.randn(4, 2, NUM_HEADS).to(torch.bfloat16)
    out, lse = kernforge.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    expected = ref_merge(v, s.float())
    assert_close_ref(out, expected[0], torch.float32)
    torch.testing.assert_close(lse, expected[1].float(), **LSE_TOL)
    out, lse = kernforge.merge_states(v, s)
    assert_close_ref(out, expected[0], torch.float32)


# --------------------------------------------------------------------------- errors


T, H, D = 4, NUM_HEADS, 16


def _pair(dtype=torch.float32):
    return torch.randn(T, H, D).to(dtype), torch.randn(T, H), torch.randn(T, H, D).to(dtype), torch.randn(T, H)


def _with(args, **replace):
    names = ("v_a", "s_a", "v_b", "s_b")
    return [replace.get(n, a) for n, a in zip(names, args)]


MERGE_STATE_ERRORS = {
    "v_a int": (dict(v_a=torch.zeros(T, H, D, dtype=torch.int32)), TypeError, r"\bv_a\b"),
    "v_a not a tensor": (dict(v_a=[[0.0]]), TypeError, r"\bv_a\b"),
    "v_a meta": (dict(v_a=torch.zeros(T, H, D, device="meta")), ValueError, r"\bv_a\b"),
    "v_b dtype": (dict(v_b=torch.zeros(T, H, D, dtype=torch.float16)), TypeError, r"\bv_b\b.*\bv_a\b"),
    "s_b meta": (dict(s_b=torch.zeros(T, H, device="meta")), ValueError, r"\bs_b\b"),
    "s_a int": (dict(s_a=torch.zeros(T, H, dtype=torch.int64)), TypeError, r"\bs_a\b"),
    "v_a rank": (dict(v_a=torch.zeros(T, H * D)), ValueError, r"v_a must be a 3D tensor"),
    "s_a rank": (dict(s_a=torch.zeros(T, H, 1)), ValueError, r"s_a must be a 2D tensor"),
    "v_b shape": (dict(v_b=torch.zeros(T, H, D + 1)), ValueError, r"v_a->shape\[2\] and v_b->shape\[2\] mismatch"),
    "s_b shape": (dict(s_b=torch.zeros(T + 1, H)), ValueError, r"s_a->shape\[0\] and s_b->shape\[0\] mismatch"),
    "s vs v": (dict(s_a=torch.zeros(T, H + 1), s_b=torch.zeros(T, H + 1)), ValueError, r"\bs_a\b"),
}


@pytest.mark.parametrize("case", list(MERGE_STATE_ERRORS))
def test_merge_state_errors(case):
    replace, error, pattern = MERGE_STATE_ERRORS[case]
    with pytest.raises(error, match=pattern):
        kernforge.merge_state(*_with(_pair(), **replace))


def _in_place_args(**replace):
    v, s, v_other, s_other = _pair()
    args = dict(v=v, s=s, v_other=v_other, s_other=s_other, mask=None)
    args.update(replace)
    return args


IN_PLACE_ERRORS = {
    "s fp16": (dict(s=torch.zeros(T, H, dtype=torch.float16)), TypeError, r"\bs\b.*float32"),
    "v_other dtype": (dict(v_other=torch.zeros(T, H, D, dtype=torch.bfloat16)), TypeError, r"\bv_other\b"),
    "v_other shape": (dict(v_other=torch.zeros(T, H + 1, D)), ValueError, r"v->shape\[1\] and v_other->shape\[1\]"),
    "s rank": (dict(s=torch.zeros(T * H)), ValueError, r"s must be a 2D tensor"),
    "v strided last dim": (dict(v=torch.zeros(T, H, 2 * D)[..., ::2]), ValueError, r"\bv\b.*contiguous last"),
    "v overlapping rows": (dict(v=torch.zeros(1, 1, D).expand(T, H, D)), ValueError, r"\bv\b.*overlap"),
    "mask dtype": (dict(mask=torch.ones(T, dtype=torch.int32)), TypeError, r"\bmask\b"),
    "mask rank": (dict(mask=torch.ones(T, 1, dtype=torch.bool)), ValueError, r"mask must be a 1D tensor"),
    "mask length": (dict(mask=torch.ones(T + 1, dtype=torch.bool)), ValueError, r"\bmask\b"),
    "mask meta": (dict(mask=torch.ones(T, dtype=torch.bool, device="meta")), ValueError, r"\bmask\b"),
}


@pytest.mark.parametrize("case", list(IN_PLACE_ERRORS))
def test_merge_state_in_place_errors(case):
    replace, error, pattern = IN_PLACE_ERRORS[case]
    args = _in_place_args(**replace)
    v_before, s_before = args["v"].clone(), args["s"].clone()
    with pytest.raises(error, match=pattern):
        kernforge.merge_state_in_place(**args)
    assert torch.equal(args["v"], v_before) and torch.equal(args["s"], s_before), "a refused call wrote"


MERGE_STATES_ERRORS = {
    "v int": (torch.zeros(T, 2, H, D, dtype=torch.int8), torch.zeros(T, 2, H), TypeError, r"\bv\b"),
    "v rank": (torch.zeros(T, H, D), torch.zeros(T, 2, H), ValueError, r"v must be a 4D tensor"),
    "s rank": (torch.zeros(T, 2, H, D), torch.zeros(T, 2), ValueError, r"s must be a 3D tensor"),
    "s shape": (torch.zeros(T, 2, H, D), torch.zeros(T, 3, H), ValueError, r"\bs must have shape"),
    "s int": (torch.zeros(T, 2, H, D), torch.zeros(T, 2, H, dtype=torch.int32), TypeError, r"\bs\b"),
}


@pytest.mark.parametrize("case", list(MERGE_STATES_ERRORS))
def test_merge_states_errors(case):
    v, s, error, pattern = MERGE_STATES_ERRORS[case]
    with pytest.raises(error, match=pattern):
        kernforge.merge_states(v, s)
