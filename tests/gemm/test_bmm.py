"""``bmm(out, a, b, scale=None)`` (sgl-kernel's ``bmm_cpu`` semantics) against fp32 torch of the same
operands: B 1 and 3, M/N/K with tails, prepacked b, per-tensor scale (bf16 and fp8 b), argument errors.
FlashInfer's ``bmm_fp8``: every e4m3/e5m2 pair, bf16 and fp16 out, column-major and other layouts,
FlashInfer's own test, empty sizes, argument errors with FlashInfer's messages where it has them."""

import pytest
import torch

import kernforge
from kernforge.ops.gemm.bf16 import convert_weight_packed
from kernforge.ops.gemm.bmm import bmm, bmm_fp8

from op_helpers import seeded

RTOL = 1e-2  # bf16 output; atol scales with the magnitude of the product


def _operands(batch, m, n, k, key=()):
    g = seeded("bmm", batch, m, n, k, *key)
    a = torch.randn(batch, m, k, generator=g).bfloat16()
    b = torch.randn(batch, n, k, generator=g).bfloat16()
    return a, b


def _assert_matches(out, ref):
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=RTOL, atol=RTOL * ref.abs().max().item() + 1e-6)


@pytest.mark.parametrize("batch, m, n, k", [(1, 1, 1, 1), (1, 7, 33, 17), (3, 33, 15, 65), (3, 2, 64, 128)])
def test_bmm_matches_torch(tier, batch, m, n, k):
    a, b = _operands(batch, m, n, k)
    out = torch.full((batch, m, n), float("nan"), dtype=torch.bfloat16)
    assert bmm(out, a, b) is out
    _assert_matches(out, a.float() @ b.float().transpose(1, 2))


def test_bmm_strided_a_and_out():
    a, b = _operands(3, 9, 17, 31, key=("strided",))
    a_strided = torch.randn(9, 3, 40).bfloat16()[:, :, :31].transpose(0, 1)  # [3, 9, 31], gaps between rows
    a_strided.copy_(a)
    backing = torch.zeros(3, 9, 20, dtype=torch.bfloat16)
    out = backing[:, :, 1:18]
    bmm(out, a_strided, b)
    _assert_matches(out, a.float() @ b.float().transpose(1, 2))
    assert backing[:, :, 0].eq(0).all() and backing[:, :, 18:].eq(0).all()  # nothing written outside out


def test_bmm_prepacked_b_and_kernforge_export():
    a, b = _operands(3, 5, 40, 19, key=("packed",))
    out = torch.empty(3, 5, 40, dtype=torch.bfloat16)
    kernforge.bmm(out, a, [convert_weight_packed(b_i) for b_i in b])
    _assert_matches(out, a.float() @ b.float().transpose(1, 2))


@pytest.mark.parametrize("scale", [torch.tensor(0.37), 2.5])
def test_bmm_scale_bf16_b(scale):
    a, b = _operands(3, 4, 17, 33, key=("scale",))
    out = torch.empty(3, 4, 17, dtype=torch.bfloat16)
    bmm(out, a, b, scale)
    _assert_matches(out, (a.float() @ b.float().transpose(1, 2)) * float(scale))


def test_bmm_fp8_b_with_scale():
    a, b = _operands(2, 6, 33, 47, key=("fp8",))
    b8 = b.float().to(torch.float8_e4m3fn)
    scale = torch.tensor(0.125)
    out = torch.empty(2, 6, 33, dtype=torch.bfloat16)
    bmm(out, a, b8, scale)
    _assert_matches(out, a.float() @ (b8.float() * 0.125).transpose(1, 2))


@pytest.mark.parametrize("k", [160, 1024, 4096])
def test_bmm_fp8_scale_applies_to_the_fp32_sums(tier, k):
    """The issue's repro, and deeper K: against float64 ``a @ wq.T * scale`` every output is within
    0.01 + 0.01 |ref| (folding the scale into bf16 weights rounds each product: 5 of 160 outside at
    K = 160, more as K grows)."""
    g = torch.Generator().manual_seed(k)
    a = torch.randn(1, 1, k, generator=g).bfloat16()
    w = torch.randn(k, k, generator=g).bfloat16()
    scale = w.abs().max().float() / 448
    wq = (w.float() / scale).to(torch.float8_e4m3fn)
    out = torch.empty(1, 1, k, dtype=torch.bfloat16)
    bmm(out, a, wq[None], scale)
    ref = (a.double()[0] @ wq.double().T) * scale.double()
    error = (out[0].double() - ref).abs()
    assert (error <= 0.01 + 0.01 * ref.abs()).all(), f"max error {error.max().item():.4g}"


def _args(**changes):
    a, b = _operands(2, 3, 5, 7, key=("errors",))
    args = {"out": torch.empty(2, 3, 5, dtype=torch.bfloat16), "a": a, "b": b, "scale": None}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"a": torch.zeros(3, 7, dtype=torch.bfloat16)}, ValueError, "a must be 3-D"),
        ({"a": torch.zeros(2, 3, 7, dtype=torch.int32)}, TypeError, "a has dtype"),
        ({"b": torch.zeros(2, 5, 8, dtype=torch.bfloat16)}, ValueError, r"b must be \[2, N, 7\]"),
        ({"b": torch.zeros(3, 5, 7, dtype=torch.bfloat16)}, ValueError, r"b must be \[2, N, 7\]"),
        ({"b": torch.zeros(2, 5, 7, dtype=torch.float16)}, TypeError, "b has dtype"),
        ({"b": torch.zeros(2, 5, 7).to(torch.float8_e4m3fn)}, ValueError, "scale is required"),
        ({"b": "weights"}, TypeError, "b must be"),
        ({"b": [convert_weight_packed(torch.zeros(5, 7, dtype=torch.bfloat16))]}, ValueError, "b must hold 2"),
        ({"scale": torch.ones(2)}, ValueError, "scale must be a 0-dim"),
        ({"scale": "2"}, TypeError, "scale must be"),
        ({"out": torch.empty(2, 3, 6, dtype=torch.bfloat16)}, ValueError, "out must have shape"),
        ({"out": torch.empty(2, 3, 5)}, TypeError, "out has dtype"),
        ({"out": torch.empty(2, 5, 3, dtype=torch.bfloat16).transpose(1, 2)}, ValueError, "out must have a contiguous"),
    ],
)
def test_bmm_errors_name_the_argument(changes, error, match):
    with pytest.raises(error, match=match):
        bmm(**_args(**changes))


# --------------------------------------------------------------------------- bmm_fp8 (FlashInfer)

FP8_PAIRS = [
    (torch.float8_e4m3fn, torch.float8_e4m3fn),
    (torch.float8_e4m3fn, torch.float8_e5m2),
    (torch.float8_e5m2, torch.float8_e4m3fn),
    (torch.float8_e5m2, torch.float8_e5m2),
]
FP8_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3}


def _to_float8(x, dtype):
    """FlashInfer's tests' per-tensor quantization: (x * scale) saturated to fp8, and 1 / scale."""
    finfo = torch.finfo(dtype)
    scale = finfo.max / x.abs().max().clamp(min=1e-12)
    return (x * scale).clamp(min=finfo.min, max=finfo.max).to(dtype), scale.float().reciprocal()


def _fp8_operands(batch, m, n, k, a_dtype, b_dtype, key=()):
    """A [b, m, k] and B [b, k, n] column-major (a transposed [b, n, k], as FlashInfer passes it)."""
    g = seeded("bmm-fp8", batch, m, n, k, *key)
    a, a_scale = _to_float8(torch.randn(batch, m, k, generator=g), a_dtype)
    b, b_scale = _to_float8(torch.randn(batch, n, k, generator=g).transpose(1, 2), b_dtype)
    return a, b, a_scale, b_scale


def _assert_fp8_matches(out, a, b, a_scale, b_scale, dtype):
    expected = (a.float() @ b.float()) * a_scale * b_scale
    assert out.dtype is dtype and out.shape == expected.shape
    rtol = FP8_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=rtol * expected.abs().max().item() + 1e-6)


@pytest.mark.parametrize("a_dtype, b_dtype", FP8_PAIRS, ids=["e4m3_e4m3", "e4m3_e5m2", "e5m2_e4m3", "e5m2_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, m, n, k", [(1, 1, 1, 1), (3, 17, 33, 40), (2, 48, 80, 64)])
def test_bmm_fp8_matches_fp32(tier, a_dtype, b_dtype, dtype, batch, m, n, k):
    a, b, a_scale, b_scale = _fp8_operands(batch, m, n, k, a_dtype, b_dtype)
    assert b.transpose(1, 2).is_contiguous()  # column-major
    _assert_fp8_matches(bmm_fp8(a, b, a_scale, b_scale, dtype), a, b, a_scale, b_scale, dtype)


def test_bmm_fp8_as_flashinfer_tests_it():
    """FlashInfer's test: cosine similarity with the bf16 product of the unquantized operands > 0.99."""
    g = seeded("bmm-fp8-flashinfer")
    x = torch.randn(4, 48, 64, generator=g).bfloat16()
    w = torch.randn(4, 80, 64, generator=g).bfloat16().transpose(-2, -1)
    x_fp8, x_inv_s = _to_float8(x, torch.float8_e4m3fn)
    w_fp8, w_inv_s = _to_float8(w, torch.float8_e4m3fn)
    res = torch.empty(4, 48, 80, dtype=torch.bfloat16)
    assert kernforge.bmm_fp8(x_fp8, w_fp8, x_inv_s, w_inv_s, torch.bfloat16, res, backend="cublas") is res
    reference = torch.bmm(x.float(), w.float())
    assert torch.nn.functional.cosine_similarity(reference.reshape(-1), res.float().reshape(-1), dim=0) > 0.99


def test_bmm_fp8_any_layout_and_scales_of_one_element():
    """Row-major B, a transposed A, [1]-shaped scales, a strided out; a large product in fp16 only
    fits once scaled (the scales are applied before the rounding)."""
    a, b, a_scale, b_scale = _fp8_operands(3, 9, 21, 70, torch.float8_e4m3fn, torch.float8_e4m3fn, key=("layout",))
    a_t = a.transpose(1, 2).contiguous().transpose(1, 2)
    b_rows = b.contiguous()
    backing = torch.zeros(3, 21, 9, dtype=torch.float16)
    out = backing.transpose(1, 2)
    bmm_fp8(a_t, b_rows, a_scale.reshape(1), b_scale.reshape(1), torch.float16, out)
    _assert_fp8_matches(out, a, b, a_scale, b_scale, torch.float16)
    assert (a.float() @ b.float()).abs().max() > torch.finfo(torch.float16).max


def test_bmm_fp8_empty_sizes():
    scale = torch.tensor(1.0)
    e4m3 = torch.float8_e4m3fn
    assert bmm_fp8(
        torch.zeros(0, 3, 4, dtype=e4m3), torch.zeros(0, 4, 5, dtype=e4m3), scale, scale, torch.bfloat16
    ).shape == (0, 3, 5)
    assert bmm_fp8(
        torch.zeros(2, 0, 4, dtype=e4m3), torch.zeros(2, 4, 5, dtype=e4m3), scale, scale, torch.bfloat16
    ).shape == (2, 0, 5)
    out = bmm_fp8(torch.zeros(2, 3, 0, dtype=e4m3), torch.zeros(2, 0, 5, dtype=e4m3), scale, scale, torch.float16)
    assert out.shape == (2, 3, 5) and not out.any()


def _fp8_args(**changes):
    a, b, a_scale, b_scale = _fp8_operands(2, 3, 5, 7, torch.float8_e4m3fn, torch.float8_e4m3fn, key=("errors",))
    args = {
        "A": a,
        "B": b,
        "A_scale": a_scale,
        "B_scale": b_scale,
        "dtype": torch.bfloat16,
        "out": None,
        "backend": "cublas",
    }
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (
            {"dtype": torch.float32},
            ValueError,
            r"Unsupported output dtype: torch.float32. Only torch.bfloat16 and torch.float16 are supported for "
            r"FP8 GEMM",
        ),
        ({"backend": "cuda"}, ValueError, "backend must be one of 'cudnn', 'cublas', 'cutlass', 'auto'"),
        (
            {"backend": "cutlass", "B": torch.zeros(2, 7, 5, dtype=torch.float8_e5m2)},
            ValueError,
            "e5m2 is not supported for bmm_fp8 with cutlass backend",
        ),
        ({"A": torch.zeros(2, 3, 7, dtype=torch.bfloat16)}, TypeError, "A has dtype torch.bfloat16; bmm_fp8 takes"),
        ({"B": torch.zeros(2, 7, 5, dtype=torch.int8)}, TypeError, "B has dtype torch.int8"),
        ({"A": "a"}, TypeError, "A must be a torch.Tensor"),
        ({"A": torch.zeros(3, 7, dtype=torch.float8_e4m3fn)}, ValueError, "A must be 3-D"),
        ({"B": torch.zeros(3, 7, 5, dtype=torch.float8_e4m3fn)}, ValueError, r"B must be \[2, 7, n\]"),
        ({"B": torch.zeros(2, 8, 5, dtype=torch.float8_e4m3fn)}, ValueError, r"B must be \[2, 7, n\]"),
        ({"B": torch.zeros(2, 7, 5, dtype=torch.float8_e4m3fn, device="meta")}, ValueError, "B is on device meta"),
        ({"A_scale": torch.tensor(1.0, dtype=torch.float64)}, TypeError, "A_scale has dtype torch.float64"),
        ({"B_scale": torch.ones(2)}, ValueError, "B_scale must hold one element"),
        ({"B_scale": 0.5}, TypeError, "B_scale must be a torch.Tensor"),
        ({"out": torch.empty(2, 3, 5, dtype=torch.float16)}, TypeError, "out has dtype torch.float16 but dtype is"),
        ({"out": torch.empty(2, 5, 3, dtype=torch.bfloat16)}, ValueError, r"out must have shape \(2, 3, 5\)"),
    ],
)
def test_bmm_fp8_errors_name_the_argument(changes, error, match):
    with pytest.raises(error, match=match):
        bmm_fp8(**_fp8_args(**changes))


def test_bmm_fp8_is_exported():
    assert kernforge.bmm_fp8 is bmm_fp8
