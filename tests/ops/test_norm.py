"""Numerical tests for the RMSNorm family.

Ops: ``rmsnorm``, ``gemma_rmsnorm`` (out-of-place, optional ``out=``) and
``fused_add_rmsnorm``, ``gemma_fused_add_rmsnorm`` (in place on ``input`` and
``residual``). Every test runs for float32, bfloat16 and float16 on the best ISA
tier this CPU can run, and a representative slice of it on each lower tier (``tier``
fixture; ``--all-tiers``: everything everywhere).

The reference is plain PyTorch in float32, computed from the same (already
rounded) inputs the kernel sees.
"""

import os
from pathlib import Path

import pytest
import torch

import kernforge

from op_helpers import (
    DTYPE_IDS,
    DTYPES,
    IN_OUT_LAYOUTS,
    PAD,
    ROWS,
    SHAPES_2D,
    SHAPES_3D,
    assert_outside_untouched,
    make_rows,
    randn,
    seeded,
)

HIDDEN = [1, 111, 4109, 16384]

PLAIN_OPS = ["rmsnorm", "gemma_rmsnorm"]
FUSED_OPS = ["fused_add_rmsnorm", "gemma_fused_add_rmsnorm"]
GEMMA = {"rmsnorm": False, "gemma_rmsnorm": True, "fused_add_rmsnorm": False, "gemma_fused_add_rmsnorm": True}

DEFAULT_EPS = 1e-6


# --------------------------------------------------------------------------- helpers


def _rows_varied(shape, g):
    """randn rows with per-row magnitudes spread over 1e-2 .. 1e2.

    The large rows overflow float16 if squares were accumulated in half
    precision (x ~ 400 -> x^2 ~ 1.6e5 > 65504)."""
    x = randn(shape, g)
    row_scale = 10.0 ** (torch.rand(shape[:-1] + (1,), generator=g) * 4.0 - 2.0)
    return x * row_scale


def _weight(D, dtype, g, gemma):
    # Gemma weights are stored as an offset from 1.
    w = randn((D,), g, 0.5 if gemma else 1.0)
    return w.to(dtype)


def ref_rmsnorm(x, weight, eps, gemma):
    """float32 reference: x / sqrt(mean(x^2) + eps) * weight  (or * (1 + weight))."""
    xf = x.to(torch.float32)
    wf = weight.to(torch.float32)
    scale = (1.0 + wf) if gemma else wf
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * scale


def ref_fused(x, residual, weight, eps, gemma):
    """Returns (expected new input as float32, expected new residual in the dtype)."""
    s = x.to(torch.float32) + residual.to(torch.float32)
    return ref_rmsnorm(s, weight, eps, gemma), s.to(x.dtype)


def _op(name):
    return getattr(kernforge, name)


# --------------------------------------------------------------------------- rmsnorm / gemma_rmsnorm


@pytest.mark.parametrize("D", HIDDEN, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", PLAIN_OPS)
def test_norm_values(op, dtype, D, tier, assert_close_ref):
    gemma = GEMMA[op]
    g = seeded(op, dtype, D)
    w = _weight(D, dtype, g, gemma)
    for N in ROWS:
        x = _rows_varied((N, D), g).to(dtype)
        x_before = x.clone()
        w_before = w.clone()
        y = _op(op)(x, w)
        ctx = f"{op} dtype={dtype} tier={tier} N={N} D={D}"
        assert isinstance(y, torch.Tensor), ctx
        assert y.dtype == dtype and y.device.type == "cpu", ctx
        assert y.data_ptr() != x.data_ptr(), f"{ctx}: result aliases the input"
        assert_close_ref(y, ref_rmsnorm(x, w, DEFAULT_EPS, gemma), dtype, ctx)
        assert torch.equal(x, x_before), f"{ctx}: input was modified"
        assert torch.equal(w, w_before), f"{ctx}: weight was modified"


@pytest.mark.parametrize("case", list(IN_OUT_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", PLAIN_OPS)
def test_norm_layouts(op, dtype, case, tier, assert_close_ref):
    in_layout, out_layout, ndim = IN_OUT_LAYOUTS[case]
    gemma = GEMMA[op]
    g = seeded(op, dtype, case)
    lead_shapes = SHAPES_3D if ndim == 3 else [(n,) for n in SHAPES_2D]
    for D in HIDDEN:
        w = _weight(D, dtype, g, gemma)
        for lead in lead_shapes:
            shape = tuple(lead) + (D,)
            ctx = f"{op} {case} dtype={dtype} tier={tier} shape={shape}"
            x, xb, xmask = make_rows(_rows_varied(shape, g).to(dtype), in_layout, g)
            xb_before = xb.clone()
            expected = ref_rmsnorm(x, w, DEFAULT_EPS, gemma)
            if out_layout is None:
                y = _op(op)(x, w)
                assert y.shape == shape and y.dtype == dtype, ctx
            else:
                out, ob, omask = make_rows(
                    torch.empty(shape, dtype=dtype), out_layout, g, pad=PAD + 2, fill=float("nan")
                )
                ob_before = ob.clone()
                y = _op(op)(x, w, out=out)
                assert y is out, f"{ctx}: out= was not returned"
                assert_outside_untouched(ob, ob_before, omask, f"{ctx} (out)")
            assert_close_ref(y, expected, dtype, ctx)
            assert torch.equal(xb, xb_before), f"{ctx}: input storage was modified"


# --------------------------------------------------------------------------- fused add + rmsnorm


def _check_fused(op, x, r, w, eps, dtype, ctx, assert_close_ref, call_kw=None):
    gemma = GEMMA[op]
    exp_x, exp_r = ref_fused(x, r, w, eps, gemma)
    w_before = w.clone()
    ret = _op(op)(x, r, w, **(call_kw or {}))
    assert ret is None, f"{ctx}: in-place op returned {type(ret).__name__}, expected None"
    assert x.dtype == dtype and r.dtype == dtype, ctx
    # The residual is specified exactly: fp32 sum of the two inputs, rounded once.
    torch.testing.assert_close(
        r, exp_r, atol=0, rtol=0, msg=lambda m: f"{ctx}: residual != (input + residual in fp32) rounded to {dtype}\n{m}"
    )
    assert_close_ref(x, exp_x, dtype, f"{ctx}: input")
    assert torch.equal(w, w_before), f"{ctx}: weight was modified"


@pytest.mark.parametrize("D", HIDDEN, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", FUSED_OPS)
def test_fused_values(op, dtype, D, tier, assert_close_ref):
    g = seeded(op, dtype, D)
    w = _weight(D, dtype, g, GEMMA[op])
    for N in ROWS:
        x = _rows_varied((N, D), g).to(dtype)
        r = _rows_varied((N, D), g).to(dtype)
        ctx = f"{op} dtype={dtype} tier={tier} N={N} D={D}"
        _check_fused(op, x, r, w, DEFAULT_EPS, dtype, ctx, assert_close_ref)


# (input layout, residual layout, ndim)
FUSED_LAYOUTS = {
    "2d_strided_both": ("padded", "padded", 2),
    "2d_strided_input": ("padded", "contig", 2),
    "2d_strided_residual": ("contig", "padded", 2),
    "3d": ("contig", "contig", 3),
    "3d_transposed_gap": ("transposed", "gap", 3),
    "3d_gap_transposed": ("gap", "transposed", 3),
}


@pytest.mark.parametrize("case", list(FUSED_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", FUSED_OPS)
def test_fused_layouts(op, dtype, case, tier, assert_close_ref):
    in_layout, res_layout, ndim = FUSED_LAYOUTS[case]
    g = seeded(op, dtype, case)
    lead_shapes = SHAPES_3D if ndim == 3 else [(n,) for n in SHAPES_2D]
    for D in HIDDEN:
        w = _weight(D, dtype, g, GEMMA[op])
        for lead in lead_shapes:
            shape = tuple(lead) + (D,)
            ctx = f"{op} {case} dtype={dtype} tier={tier} shape={shape}"
            x, xb, xmask = make_rows(_rows_varied(shape, g).to(dtype), in_layout, g)
            r, rb, rmask = make_rows(_rows_varied(shape, g).to(dtype), res_layout, g, pad=PAD + 6)
            xb_before, rb_before = xb.clone(), rb.clone()
            _check_fused(op, x, r, w, DEFAULT_EPS, dtype, ctx, assert_close_ref)
            assert_outside_untouched(xb, xb_before, xmask, f"{ctx} (input)")
            assert_outside_untouched(rb, rb_before, rmask, f"{ctx} (residual)")


# --------------------------------------------------------------------------- eps


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", PLAIN_OPS + FUSED_OPS)
def test_eps_is_honoured(op, dtype, tier, assert_close_ref):
    """A large eps (1.0) and the default eps (1e-6) both follow the reference.

    The inputs are chosen so eps visibly matters: mean(x^2) ~ 1e-2 for the
    eps=1.0 case and ~ 1e-6 for the default-eps case."""
    D, N = 4109, 5
    gemma = GEMMA[op]
    fused = op in FUSED_OPS
    g = seeded(op, dtype, "eps")
    w = _weight(D, dtype, g, gemma)
    for scale, eps in ((0.1, 1.0), (1e-3, None)):
        x = randn((N, D), g, scale).to(dtype)
        r = randn((N, D), g, scale).to(dtype)
        eff_eps = DEFAULT_EPS if eps is None else eps
        kw = {} if eps is None else {"eps": eps}
        ctx = f"{op} dtype={dtype} tier={tier} eps={eps if eps is not None else 'default'}"
        # Sanity of the test itself: eps must change the expected result a lot.
        other_eps = 0.0 if eps is None else DEFAULT_EPS
        base = (x.float() + r.float()) if fused else x
        a = ref_rmsnorm(base, w, eff_eps, gemma)
        b = ref_rmsnorm(base, w, other_eps, gemma)
        assert not torch.allclose(a, b, atol=0.05, rtol=0.05), "test inputs do not exercise eps"
        if fused:
            _check_fused(op, x, r, w, eff_eps, dtype, ctx, assert_close_ref, call_kw=kw)
        else:
            y = _op(op)(x, w, **kw)
            assert_close_ref(y, a, dtype, ctx)


# --------------------------------------------------------------------------- 64-bit offsets


def test_rmsnorm_64bit_row_offsets(tier, assert_close_ref):
    """Rows more than 2**31 elements apart in one bf16 storage (input and out).

    Only the rows used are touched, so the 4 GiB allocation costs no memory."""
    dtype = torch.bfloat16
    D = 4109
    stride = 2**31 + D
    g = seeded("rmsnorm64", tier)
    base = torch.empty(2**31 + 3 * D, dtype=dtype)
    # input rows: [D, 2D) and [2^31 + 2D, 2^31 + 3D); out rows: [0, D) and [2^31 + D, 2^31 + 2D)
    x = base.as_strided((2, D), (stride, 1), D)
    out = base.as_strided((2, D), (stride, 1), 0)
    vals = _rows_varied((2, D), g).to(dtype)
    x.copy_(vals)
    out.fill_(float("nan"))
    w = _weight(D, dtype, g, False)
    expected = ref_rmsnorm(vals, w, DEFAULT_EPS, False)

    y = kernforge.rmsnorm(x, w)
    assert_close_ref(y, expected, dtype, f"rmsnorm 64-bit input offsets tier={tier}")

    y = kernforge.rmsnorm(x, w, out=out)
    assert y is out
    assert_close_ref(out, expected, dtype, f"rmsnorm 64-bit input+out offsets tier={tier}")
    assert torch.equal(x, vals), "input rows were modified"


# --------------------------------------------------------------------------- cache isolation


def test_kernels_are_built_in_the_session_cache(kernforge_cache_dir):
    """The run's KERNFORGE_CACHE_DIR (fresh, or the --reuse-cache one) is the cache actually used."""
    cache_dir = Path(os.environ["KERNFORGE_CACHE_DIR"])
    assert cache_dir == Path(kernforge_cache_dir)
    kernforge.rmsnorm(torch.randn(3, 64), torch.ones(64))
    files = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert files, f"no kernel artifacts were written to KERNFORGE_CACHE_DIR={cache_dir}"
