"""Outputs of 32 MiB or more are written with non-temporal stores (kernforge/core/rows.h,
kStreamingMinBytes) when their rows are vector-aligned; other rows of the same
call fall back to regular stores. Both paths must give the reference result,
on every tier (the lower ones run a slice covering each dtype and alignment),
without touching memory outside the output."""

import pytest
import torch
import torch.nn.functional as F

import kernforge

STREAMING_MIN_BYTES = 32 << 20
DTYPES = [torch.float32, torch.bfloat16]


def _rows_for(min_bytes, width, dtype):
    """Rows of `width` elements whose total just exceeds `min_bytes`."""
    return min_bytes // (width * torch.tensor([], dtype=dtype).element_size()) + 3


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "mixed-alignment"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rmsnorm_large_output(dtype, misaligned, tier, assert_close_ref):
    hidden = 4096
    rows = _rows_for(STREAMING_MIN_BYTES, hidden, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    # A one-element offset moves most row starts off the vector alignment (regular stores);
    # the few that still land on it stream, so one call mixes both paths.
    backing = torch.full((rows, hidden + 1), 7.0, dtype=dtype)
    out = backing[:, 1:] if misaligned else backing[:, :hidden]
    kernforge.rmsnorm(x, w, out=out)
    ref = F.rms_norm(x.float(), (hidden,), w.float(), 1e-6)
    assert_close_ref(out, ref, dtype, f"rmsnorm {dtype} {tier} misaligned={misaligned}")
    untouched = backing[:, 0] if misaligned else backing[:, hidden]
    assert torch.all(untouched == 7.0), "wrote outside the output rows"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_silu_and_mul_large_output(dtype, tier, assert_close_ref):
    d = 4096
    rows = _rows_for(STREAMING_MIN_BYTES, d, dtype)
    g = torch.Generator().manual_seed(2)
    h = (torch.randn(rows, 2 * d, generator=g) * 3).to(dtype)
    out = kernforge.silu_and_mul(h)
    ref = F.silu(h[:, :d].float()) * h[:, d:].float()
    assert_close_ref(out, ref, dtype, f"silu_and_mul {dtype} {tier}")
