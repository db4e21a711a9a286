"""Argument validation and empty inputs for every op.

* wrong dtype                       -> TypeError naming the argument
* wrong shape                       -> ValueError naming the argument
* non-CPU tensor (device='meta')    -> ValueError naming the argument
* out / in-place tensor whose last dim is not contiguous -> ValueError
* 0 rows                            -> empty result, no error
"""

import re

import pytest
import torch

import kernforge

PLAIN_NORMS = ["rmsnorm", "gemma_rmsnorm"]
FUSED_NORMS = ["fused_add_rmsnorm", "gemma_fused_add_rmsnorm"]
NORMS = PLAIN_NORMS + FUSED_NORMS
ACTS = ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"]
ALL_OPS = NORMS + ACTS
OUT_OPS = PLAIN_NORMS + ACTS  # ops taking out=

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

N, D = 4, 64  # norms: input [N, D]; activations: input [N, 2*D] -> [N, D]


def _op(name):
    return getattr(kernforge, name)


def _names(arg):
    """Regex: the message names the argument (as a whole word)."""
    return re.compile(rf"\b{re.escape(arg)}\b", re.IGNORECASE)


def _call(op, *, x=None, w=None, r=None, out=None, dtype=torch.float32, device="cpu", shape=None, eps=None):
    """Call ``op`` with well-formed defaults for every argument not given."""
    kw = {}
    if eps is not None:
        kw["eps"] = eps
    if op in ACTS:
        if x is None:
            x = torch.randn(shape or (N, 2 * D), dtype=dtype, device=device)
        if out is not None:
            kw["out"] = out
        return _op(op)(x, **kw)
    if x is None:
        x = torch.randn(shape or (N, D), dtype=dtype, device=device)
    if w is None:
        w = torch.randn(x.shape[-1] if x.dim() else D, dtype=x.dtype, device="cpu")
    if op in FUSED_NORMS:
        if r is None:
            r = torch.randn(x.shape, dtype=x.dtype, device="cpu")
        return _op(op)(x, r, w, **kw)
    if out is not None:
        kw["out"] = out
    return _op(op)(x, w, **kw)


# --------------------------------------------------------------------------- dtype -> TypeError


@pytest.mark.parametrize("bad", [torch.int32, torch.float64], ids=["int32", "float64"])
@pytest.mark.parametrize("op", ALL_OPS)
def test_unsupported_input_dtype(op, bad):
    # For the norms, weight (and residual) share the input's dtype so that the
    # input's dtype is the only thing wrong.
    if op in ACTS:
        x = torch.ones(N, 2 * D).to(bad)
    else:
        x = torch.ones(N, D).to(bad)
    with pytest.raises(TypeError, match=_names("input")):
        if op in ACTS:
            _call(op, x=x)
        elif op in FUSED_NORMS:
            _call(op, x=x, w=torch.ones(D).to(bad), r=torch.ones(N, D).to(bad))
        else:
            _call(op, x=x, w=torch.ones(D).to(bad))


@pytest.mark.parametrize(
    "in_dtype,w_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float16),
        (torch.float16, torch.bfloat16),
    ],
    ids=["bf16-fp32", "fp32-fp16", "fp16-bf16"],
)
@pytest.mark.parametrize("op", NORMS)
def test_weight_dtype_mismatch(op, in_dtype, w_dtype):
    x = torch.randn(N, D, dtype=in_dtype)
    with pytest.raises(TypeError, match=_names("weight")):
        _call(op, x=x, w=torch.randn(D, dtype=w_dtype))


@pytest.mark.parametrize("op", FUSED_NORMS)
def test_residual_dtype_mismatch(op):
    x = torch.randn(N, D, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=_names("residual")):
        _call(op, x=x, r=torch.randn(N, D, dtype=torch.float32))


@pytest.mark.parametrize("op", OUT_OPS)
def test_out_dtype_mismatch(op):
    x_dim = 2 * D if op in ACTS else D
    x = torch.randn(N, x_dim, dtype=torch.bfloat16)
    out = torch.empty(N, D, dtype=torch.float32)
    with pytest.raises(TypeError, match=_names("out")):
        _call(op, x=x, out=out)


# --------------------------------------------------------------------------- shape -> ValueError


@pytest.mark.parametrize("wshape", [(D + 1,), (D - 1,), (1, D), ()], ids=str)
@pytest.mark.parametrize("op", NORMS)
def test_weight_shape(op, wshape):
    with pytest.raises(ValueError, match=_names("weight")):
        _call(op, w=torch.randn(wshape))


@pytest.mark.parametrize("rshape", [(N + 1, D), (N, D + 1), (N - 1, D), (1, N, D), (N * D,)], ids=str)
@pytest.mark.parametrize("op", FUSED_NORMS)
def test_residual_shape(op, rshape):
    with pytest.raises(ValueError, match=_names("residual")):
        _call(op, r=torch.randn(rshape))


@pytest.mark.parametrize("shape", [(D,), (2, 3, 4, D)], ids=["1d", "4d"])
@pytest.mark.parametrize("op", NORMS)
def test_norm_input_ndim(op, shape):
    # weight [D] and (for fused ops) a residual of the same shape as the input:
    # only the input's rank is wrong.
    with pytest.raises(ValueError, match=_names("input")):
        _call(op, shape=shape)


@pytest.mark.parametrize("last", [1, 3, 2 * D + 1], ids=lambda v: f"last{v}")
@pytest.mark.parametrize("op", ACTS)
def test_act_odd_last_dim(op, last):
    with pytest.raises(ValueError, match=_names("input")):
        _call(op, shape=(N, last))


def _bad_out_shapes(op):
    if op in ACTS:  # correct: (N, D)
        return [(N, 2 * D), (N + 1, D), (N, D + 1), (N * D,), (1, N, D)]
    return [(N, D + 1), (N + 1, D), (N - 1, D), (N * D,), (1, N, D)]


@pytest.mark.parametrize("op", OUT_OPS)
def test_out_shape(op):
    for oshape in _bad_out_shapes(op):
        with pytest.raises(ValueError, match=_names("out")):
            _call(op, out=torch.empty(oshape))


# --------------------------------------------------------------------------- device -> ValueError


def _device_cases():
    cases = []
    for op in ALL_OPS:
        cases.append((op, "input"))
        if op in NORMS:
            cases.append((op, "weight"))
        if op in FUSED_NORMS:
            cases.append((op, "residual"))
        if op in OUT_OPS:
            cases.append((op, "out"))
    return cases


@pytest.mark.parametrize("op,arg", _device_cases(), ids=lambda v: v)
def test_non_cpu_tensor(op, arg):
    meta = {"device": "meta"}
    x_dim = 2 * D if op in ACTS else D
    x = torch.randn(N, x_dim, **(meta if arg == "input" else {}))
    kw = {"x": x}
    if arg == "weight":
        kw["w"] = torch.randn(D, **meta)
    if arg == "residual":
        kw["r"] = torch.randn(N, D, **meta)
    if arg == "out":
        kw["out"] = torch.empty(N, D, **meta)
    if arg == "input" and op in NORMS:
        kw["w"] = torch.randn(D)
        if op in FUSED_NORMS:
            kw["r"] = torch.randn(N, D)
    with pytest.raises(ValueError, match=_names(arg)):
        _call(op, **kw)


# --------------------------------------------------------------------------- non-contiguous outputs


def _noncontig(rows, cols, dtype=torch.float32):
    t = torch.randn(rows, 2 * cols, dtype=dtype)[:, ::2]
    assert t.shape == (rows, cols) and t.stride(-1) == 2
    return t


@pytest.mark.parametrize("op", OUT_OPS)
def test_out_last_dim_not_contiguous(op):
    with pytest.raises(ValueError):
        _call(op, out=_noncontig(N, D))


@pytest.mark.parametrize("which", ["input", "residual"])
@pytest.mark.parametrize("op", FUSED_NORMS)
def test_inplace_last_dim_not_contiguous(op, which):
    kw = {"x": _noncontig(N, D)} if which == "input" else {"r": _noncontig(N, D)}
    with pytest.raises(ValueError):
        _call(op, **kw)


# --------------------------------------------------------------------------- empty inputs

EMPTY_LEADS = [(0,), (0, 3), (2, 0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", ALL_OPS)
def test_empty_input(op, dtype):
    for lead in EMPTY_LEADS:
        if op in ACTS:
            x = torch.empty(lead + (2 * D,), dtype=dtype)
            y = _call(op, x=x)
            assert y.shape == lead + (D,) and y.dtype == dtype, (op, lead)
            out = torch.empty(lead + (D,), dtype=dtype)
            assert _call(op, x=x, out=out) is out, (op, lead)
        elif op in FUSED_NORMS:
            x = torch.empty(lead + (D,), dtype=dtype)
            r = torch.empty(lead + (D,), dtype=dtype)
            assert _call(op, x=x, r=r, w=torch.randn(D).to(dtype)) is None, (op, lead)
            assert x.shape == lead + (D,) and r.shape == lead + (D,)
        else:
            x = torch.empty(lead + (D,), dtype=dtype)
            w = torch.randn(D).to(dtype)
            y = _call(op, x=x, w=w)
            assert y.shape == lead + (D,) and y.dtype == dtype, (op, lead)
            out = torch.empty(lead + (D,), dtype=dtype)
            assert _call(op, x=x, w=w, out=out) is out, (op, lead)
