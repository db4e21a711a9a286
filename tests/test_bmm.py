"""``bmm(out, a, b, scale=None)`` (sgl-kernel's ``bmm_cpu`` semantics) against fp32 torch of the same
operands: B 1 and 3, M/N/K with tails, prepacked b, per-tensor scale (bf16 and fp8 b), argument errors."""

import pytest
import torch

import kernforge
from kernforge.ops.bmm import bmm
from kernforge.ops.gemm import convert_weight_packed
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


def _args(**changes):
    a, b = _operands(2, 3, 5, 7, key=("errors",))
    args = {"out": torch.empty(2, 3, 5, dtype=torch.bfloat16), "a": a, "b": b, "scale": None}
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, error, match", [
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
])
def test_bmm_errors_name_the_argument(changes, error, match):
    with pytest.raises(error, match=match):
        bmm(**_args(**changes))
