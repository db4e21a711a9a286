"""Numerical tests for the gated activations.

``silu_and_mul``, ``gelu_and_mul`` (exact erf GELU) and ``gelu_tanh_and_mul``
(torch's approximate='tanh'): input [..., 2d] -> out [..., d] with
out = act(x[..., :d]) * x[..., d:]. Every test runs for float32, bfloat16 and
float16 on the best ISA tier this CPU can run, and a representative slice of it on
each lower tier (``tier`` fixture; ``--all-tiers``: everything everywhere), against
a float32 PyTorch reference computed from the same (already rounded) inputs.
"""

import pytest
import torch
import torch.nn.functional as F

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

HIDDEN = [1, 111, 4109, 11008]  # d; the input's last dim is 2*d

OPS = ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"]
ACT = {
    "silu_and_mul": F.silu,
    "gelu_and_mul": lambda a: F.gelu(a, approximate="none"),
    "gelu_tanh_and_mul": lambda a: F.gelu(a, approximate="tanh"),
}


# --------------------------------------------------------------------------- helpers


def ref_act_and_mul(op, x):
    """float32 reference: act(x[..., :d]) * x[..., d:]."""
    xf = x.to(torch.float32)
    d = xf.shape[-1] // 2
    return ACT[op](xf[..., :d]) * xf[..., d:]


def _op(name):
    return getattr(kernforge, name)


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("d", HIDDEN, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS)
def test_act_values(op, dtype, d, tier, assert_close_ref):
    g = seeded(op, dtype, d)
    for N in ROWS:
        # randn * 4: |x| reaches ~16, so the activation tails matter.
        x = randn((N, 2 * d), g, 4.0).to(dtype)
        x_before = x.clone()
        y = _op(op)(x)
        ctx = f"{op} dtype={dtype} tier={tier} N={N} d={d}"
        assert isinstance(y, torch.Tensor), ctx
        assert y.shape == (N, d) and y.dtype == dtype and y.device.type == "cpu", ctx
        assert_close_ref(y, ref_act_and_mul(op, x), dtype, ctx)
        assert torch.equal(x, x_before), f"{ctx}: input was modified"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS)
def test_act_tails(op, dtype, tier, assert_close_ref):
    """Saturated tails and exp-overflow territory.

    Rows 0-2: gate values sweep [-80, 80] in ascending, descending and shuffled
    order, so both the vector body and the remainder of a row see the extremes.
    Row 3: log-spaced magnitudes 1e-30 .. 1e30 of both signs (3e4 for float16),
    shuffled. The up half is in [-1, 1] so the product stays finite."""
    d = 4109
    g = seeded(op, dtype, "tails")
    ramp = torch.linspace(-80.0, 80.0, d)
    limit = 3e4 if dtype == torch.float16 else 1e30
    mags = torch.logspace(-30.0, float(torch.tensor(limit).log10()), 64)
    extremes = torch.cat([mags, -mags]).repeat(d // 128 + 1)[:d]
    gate = torch.stack(
        [
            ramp,
            ramp.flip(0),
            ramp[torch.randperm(d, generator=g)],
            extremes[torch.randperm(d, generator=g)],
        ]
    )
    up = torch.rand((4, d), generator=g) * 2.0 - 1.0
    x = torch.cat([gate, up], dim=-1).to(dtype)
    y = _op(op)(x)
    ctx = f"{op} tails dtype={dtype} tier={tier}"
    assert not torch.isnan(y).any(), f"{ctx}: NaN in output"
    assert_close_ref(y, ref_act_and_mul(op, x), dtype, ctx)


@pytest.mark.parametrize("case", list(IN_OUT_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS)
def test_act_layouts(op, dtype, case, tier, assert_close_ref):
    in_layout, out_layout, ndim = IN_OUT_LAYOUTS[case]
    g = seeded(op, dtype, case)
    lead_shapes = SHAPES_3D if ndim == 3 else [(n,) for n in SHAPES_2D]
    for d in HIDDEN:
        for lead in lead_shapes:
            lead = tuple(lead)
            ctx = f"{op} {case} dtype={dtype} tier={tier} shape={lead + (2 * d,)}"
            x, xb, _ = make_rows(randn(lead + (2 * d,), g, 4.0).to(dtype), in_layout, g)
            xb_before = xb.clone()
            expected = ref_act_and_mul(op, x)
            if out_layout is None:
                y = _op(op)(x)
                assert y.shape == lead + (d,) and y.dtype == dtype, ctx
            else:
                out, ob, omask = make_rows(
                    torch.empty(lead + (d,), dtype=dtype), out_layout, g, pad=PAD + 2, fill=float("nan")
                )
                ob_before = ob.clone()
                y = _op(op)(x, out=out)
                assert y is out, f"{ctx}: out= was not returned"
                assert_outside_untouched(ob, ob_before, omask, f"{ctx} (out)")
            assert_close_ref(y, expected, dtype, ctx)
            assert torch.equal(xb, xb_before), f"{ctx}: input storage was modified"


# --------------------------------------------------------------------------- 64-bit offsets


def test_silu_and_mul_64bit_row_offsets(tier, assert_close_ref):
    """Rows more than 2**31 elements apart in one bf16 storage (input and out).

    Only the rows used are touched, so the 4 GiB allocation costs no memory."""
    dtype = torch.bfloat16
    d = 4109
    D = 2 * d
    stride = 2**31 + D
    g = seeded("silu64", tier)
    base = torch.empty(2**31 + 3 * D, dtype=dtype)
    # input rows: [D, 2D) and [2^31 + 2D, 2^31 + 3D); out rows: [0, d) and [2^31 + D, 2^31 + D + d)
    x = base.as_strided((2, D), (stride, 1), D)
    out = base.as_strided((2, d), (stride, 1), 0)
    vals = randn((2, D), g, 4.0).to(dtype)
    x.copy_(vals)
    out.fill_(float("nan"))
    expected = ref_act_and_mul("silu_and_mul", vals)

    y = kernforge.silu_and_mul(x)
    assert_close_ref(y, expected, dtype, f"silu_and_mul 64-bit input offsets tier={tier}")

    y = kernforge.silu_and_mul(x, out=out)
    assert y is out
    assert_close_ref(out, expected, dtype, f"silu_and_mul 64-bit input+out offsets tier={tier}")
    assert torch.equal(x, vals), "input rows were modified"


# --------------------------------------------------------------------------- empty 4-D inputs


@pytest.mark.parametrize("shape", [(0, 5, 0, 22), (5, 5, 0, 22), (2, 3, 4, 0)], ids=["0x5x0", "5x5x0", "d0"])
@pytest.mark.parametrize("op", OPS)
def test_act_empty_4d(op, shape):
    """4-D inputs whose last two dims hold no element: an empty result (also into out=), not the
    RuntimeError of merging the leading dims as view(-1, ...), which is ambiguous for 0 elements
    (found by the fuzzer)."""
    x = torch.empty(shape, dtype=torch.bfloat16)
    expected_shape = (*shape[:-1], shape[-1] // 2)
    y = _op(op)(x)
    assert y.shape == expected_shape and y.dtype == torch.bfloat16
    out = torch.empty(expected_shape, dtype=torch.bfloat16)
    assert _op(op)(x, out=out) is out
