"""fp8 KV on the bf16 dot products (kernforge/attention/fp8_dot.h, AVX512-BF16 + VBMI).

The table conversion is checked exactly: all 256 bit patterns of e4m3 and e5m2 against torch's
``.to(torch.bfloat16)`` bit for bit (a NaN pattern must give a NaN; torch writes every NaN as
0x7fc0, the kernel keeps the sign), in the split order the header documents, and against q
rearranged into that order by ``arrange_q`` (what makes q.k need no reordering). One score tile and
p.V over odd and even token counts (with the accumulator unscrambled) are checked against float64
on the same rounded inputs; then whole decode runs (bf16 q, fp8 KV) over head dims 64/128/256 and
GQA groups 1, 2, 8 and MQA, with odd token counts and a partly filled last page, through
test_decode's run_case (against references.attention_reference). The piece tests need the avx512
tier with both extensions and skip elsewhere; the decode runs hold on any tier (other tiers take
the fp32 path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_decode import Case, run_case

import kernforge
from kernforge.jit import core, isa, render
from kernforge.jit.module import Entry, Module

from conftest import TEST_TEMPLATES
from op_helpers import seeded

KINDS = {"e4m3": (0, torch.float8_e4m3fn), "e5m2": (1, torch.float8_e5m2)}
HEAD_DIM = 128  # of the score and value entries

FP8_DOT = Module(
    "fp8_dot_test",
    "fp8_dot.cpp.jinja",
    params={},
    entries=[
        Entry("available", "", returns="int64_t"),
        Entry("convert", "int64_t kind, int64_t src, int64_t n, int64_t dst", returns="int64_t"),
        Entry("arrange", "int64_t row, int64_t n", returns="int64_t"),
        Entry("scores", "int64_t kind, int64_t q, int64_t k, int64_t out", returns="int64_t"),
        Entry("values", "int64_t kind, int64_t v, int64_t count, int64_t pairs, int64_t out", returns="int64_t"),
    ],
    tiers={"avx512": "avx512"},
    register=False,
)


@pytest.fixture(scope="module")
def fp8_dot():
    if not isa.runnable("avx512"):
        pytest.skip("no avx512 tier on this CPU")
    saved = list(render._user_dirs)
    kernforge.register_template_dir(TEST_TEMPLATES)
    try:
        kernel = core.load_kernel(FP8_DOT, {}, "avx512")
    finally:
        render._user_dirs[:] = saved
        render.search_path_changed()
    if not kernel.available():
        pytest.skip("the avx512 tier here has no AVX512-BF16 or no AVX512-VBMI: no fp8 dot products")
    return kernel


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def finite_bytes(dtype, n, g) -> torch.Tensor:
    """n random fp8 bit patterns with no NaN or Inf."""
    x = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    bad = ~x.view(dtype).float().isfinite()
    x[bad] = x[bad] & 0xF0  # same sign and high exponent bits, low ones cleared: finite in both formats
    assert x.view(dtype).float().isfinite().all()
    return x


# --------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("kind", list(KINDS))
def test_table_conversion_is_exact_for_every_byte(kind, fp8_dot):
    code, dtype = KINDS[kind]
    everything = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = np.zeros(256, dtype=np.uint16)
    assert fp8_dot.convert(code, everything.data_ptr(), 256, got.ctypes.data) == 0
    want = bits16(everything.view(dtype).to(torch.bfloat16))
    nan = everything.view(dtype).float().isnan().numpy()

    # Split order, 64-element chunk by chunk: position 32 * s + 8 * k + i holds element 16 * k + 8 * s + i.
    pos = np.arange(256)
    w = pos % 64
    natural = pos // 64 * 64 + 16 * (w % 32 // 8) + 8 * (w // 32) + w % 8
    in_order = np.empty_like(got)
    in_order[natural] = got
    got_nan = (in_order & 0x7FFF) > 0x7F80
    assert np.array_equal(got_nan, nan), f"{kind}: NaN patterns {np.flatnonzero(got_nan != nan)}"
    wrong = np.flatnonzero((in_order != want) & ~nan)
    assert wrong.size == 0, "; ".join(
        f"{kind} 0x{b:02x}: got 0x{in_order[b]:04x}, torch 0x{want[b]:04x}" for b in wrong[:8]
    )
    assert np.array_equal(in_order[nan] & 0x8000, (everything.numpy()[nan] & 0x80).astype(np.uint16) << 8)

    # arrange_q puts a bf16 row in the same order, which is all q.k relies on.
    arranged = want.copy()
    assert fp8_dot.arrange(arranged.ctypes.data, 256) == 0
    assert np.array_equal(arranged[~nan[natural]], got[~nan[natural]])


@pytest.mark.parametrize("kind", list(KINDS))
def test_score_tile(kind, fp8_dot):
    code, dtype = KINDS[kind]
    g = seeded("fp8_dot scores", kind)
    q = torch.randn(4, HEAD_DIM, generator=g).to(torch.bfloat16)
    k = finite_bytes(dtype, 4 * HEAD_DIM, g)
    got = np.zeros(16, dtype=np.float32)
    assert fp8_dot.scores(code, q.data_ptr(), k.data_ptr(), got.ctypes.data) == 0
    kf = k.view(dtype).double().reshape(4, HEAD_DIM)
    terms = q.double()[:, None, :] * kf[None, :, :]  # [head, token, d]: lane head * 4 + token
    want, scale = terms.sum(-1).flatten().numpy(), terms.abs().sum(-1).flatten().numpy()
    # Products of bf16 are exact in fp32; the sums round in fp32.
    assert np.all(np.abs(got - want) <= 1e-5 * scale), f"{kind}: got {got}\nwant {want}"


@pytest.mark.parametrize("count", [1, 7, 10])
@pytest.mark.parametrize("kind", list(KINDS))
def test_values(kind, count, fp8_dot):
    code, dtype = KINDS[kind]
    g = seeded("fp8_dot values", kind, count)
    v = finite_bytes(dtype, count * HEAD_DIM, g)
    pairs = (count + 1) // 2 * 2
    p = torch.zeros(2, pairs, dtype=torch.bfloat16)
    p[:, :count] = torch.rand(2, count, generator=g).to(torch.bfloat16)
    got = np.zeros((2, HEAD_DIM), dtype=np.float32)
    assert fp8_dot.values(code, v.data_ptr(), count, p.data_ptr(), got.ctypes.data) == 0
    terms = p[:, :count].double()[:, :, None] * v.view(dtype).double().reshape(count, HEAD_DIM)[None]
    want, scale = terms.sum(1).numpy(), terms.abs().sum(1).numpy()
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), f"{kind} count {count}"


# --------------------------------------------------------------------------- whole decode runs

_LENGTHS = (1, 7, 300, 1029, 0)
# name: (KV dtype, layout, case), q and out bf16. Each is one compiled variant per tier.
DECODE_CASES = {
    "e4m3_d64_group2": (
        torch.float8_e4m3fn,
        "NHD",
        Case(_LENGTHS, num_qo_heads=4, num_kv_heads=2, head_dim=64, k_scale=0.5, v_scale=1.7),
    ),
    "e4m3_d128_group1": (
        torch.float8_e4m3fn,
        "HND",
        Case(_LENGTHS, num_qo_heads=2, num_kv_heads=2, page_size=13, form="tuple"),
    ),
    "e4m3_d256_group8": (
        torch.float8_e4m3fn,
        "NHD",
        Case(_LENGTHS, num_qo_heads=16, num_kv_heads=2, head_dim=256, k_scale=0.3, v_scale=3.0),
    ),
    "e5m2_d128_mqa12": (
        torch.float8_e5m2,
        "HND",
        Case(_LENGTHS, num_qo_heads=12, num_kv_heads=1, form="strided", soft_cap=5.0),
    ),
}


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(32 << 20, dtype=torch.uint8)


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_bf16_q_fp8_kv(name, workspace, assert_close_ref):
    kv_dtype, layout, case = DECODE_CASES[name]
    run_case(case, torch.bfloat16, kv_dtype, torch.bfloat16, layout, workspace, assert_close_ref, ("fp8_dot", name))
