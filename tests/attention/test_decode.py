"""Tests for decode attention over a paged KV cache: ``BatchDecodeWithPagedKVCacheWrapper``
(plan / run / work_lists) and ``single_decode_with_kv_cache``.

The reference is plain PyTorch, per request, in float64 (``references.attention_reference``, with
qo_len 1): the request's pages are gathered from the cache in page-table order, the logits
``sm_scale * q_scale * k_scale * q.k`` are soft-capped (``cap * tanh(x / cap)``), keys outside the
window (``window_left = w`` keeps positions ``>= kv_len - 1 - w``) are masked explicitly, and out =
softmax . V * v_scale. LSE is FlashInfer's: base 2 of the final logits, ``log2(e) * logsumexp``; an
empty request gives zeros and -inf. It sees the same rounded inputs as the kernel (an fp8 cache is
dequantized as ``cache.float() * scale``), so only the kernel's arithmetic and its output rounding
differ: out within the tolerance of the coarsest of the q, KV and out dtypes (bf16 1e-2, fp16 1e-3,
fp32 1e-5; bf16 q and KV may multiply in bf16), cosine > 0.9999 per request, LSE to 1e-4.

Compiled variants are keyed by (q, KV, out dtype, head_dim, group or 0 above 8, tier); the tests
use nine of them per tier: the scenario matrix (batch shapes, page sizes, cache forms, windows,
soft cap, scales, strided q/out/lse, empty requests) runs on two (bf16 and fp32, 8 query heads on
2 KV heads, head_dim 128), the variant matrix covers the other dtypes and geometries. Every test
runs on the best ISA tier and a representative slice on the lower ones (``tier`` fixture).

The planner is checked as a property: for random batches and thread counts, the items of
``work_lists()`` cover every (request, visible KV token, KV head) exactly once, split units write
distinct workspace slots, and big batches are balanced across the lists.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import pytest
import torch

import kernforge
from kernforge.ops.attention.decode import PlanStateError

from op_helpers import assert_outside_untouched, make_rows, randn, seeded
from references import attention_reference

LSE_TOL = dict(atol=1e-4, rtol=1e-4)  # LSE is float32 whatever the dtypes
MIN_COSINE = 0.9999
LAYOUTS = ["NHD", "HND"]
WORKSPACE_BYTES = 32 << 20
SPARE_PAGES = 3  # pages of the cache that no request owns
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SENTINEL = -3.25


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8)


@pytest.fixture
def threads():
    """``threads(n)`` sets kernforge's thread count for the test (plan() reads it); restored after."""
    yield kernforge.set_num_threads
    kernforge.set_num_threads(None)


# --------------------------------------------------------------------------- batches and caches


@dataclass(frozen=True)
class Batch:
    """A page table: request b owns pages indices[indptr[b]:indptr[b + 1]] (in a shuffled order)."""

    lengths: tuple
    page_size: int
    num_pages: int
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor

    def pages(self, b):
        return self.indices[self.indptr[b] : self.indptr[b + 1]]


def make_batch(lengths, page_size, g, empty_last_page_len=0):
    """Pages drawn from a shuffled pool (a request's pages are not contiguous, nor in order), with
    SPARE_PAGES unused ones. Empty requests get ``empty_last_page_len`` (ignored: they have no page)."""
    counts = [-(-n // page_size) for n in lengths]
    used = sum(counts)
    pool = torch.randperm(used + SPARE_PAGES, generator=g)[:used].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 if n else empty_last_page_len for n in lengths], dtype=torch.int32)
    return Batch(tuple(lengths), page_size, used + SPARE_PAGES, indptr, pool, last)


def cache_values(batch, heads, head_dim, dtype, g):
    """K and V as logical NHD planes [pages, page_size, heads, head_dim], rounded to ``dtype``."""
    shape = (batch.num_pages, batch.page_size, heads, head_dim)
    return randn(shape, g).to(dtype), randn(shape, g).to(dtype)


def as_cache(k, v, form, layout, g):
    """The ``paged_kv_cache`` argument holding the NHD planes k, v in ``form`` and ``layout``.

    tensor: one [pages, 2, ...] tensor. tuple: two contiguous 4-D tensors. strided: K is a view
    with padded rows starting one element in (rows not vector-aligned), V every other page of a
    buffer laid out in the other layout, so K and V have different strides. squeezed: page size 1
    without its token dimension ([pages, 2, H, D] tensor); squeezed_tuple: the same as a pair of
    [pages, H, D] tensors. nan_padded: K and V rows each followed by NaNs (rows of an odd head_dim
    start anywhere): a kernel that reads a full vector past a row's end gets NaN into its output
    (q's zero padding times NaN is NaN)."""

    def plane(x):  # NHD [P, ps, H, D] -> the layout's [P, ps, H, D] / [P, H, ps, D]
        return x if layout == "NHD" else x.transpose(1, 2).contiguous()

    if form == "tensor":
        return torch.stack([plane(k), plane(v)], dim=1)
    if form == "tuple":
        return plane(k), plane(v)
    if form == "squeezed":
        assert k.shape[1] == 1
        return torch.stack([k[:, 0], v[:, 0]], dim=1)
    if form == "squeezed_tuple":  # [pages, H, D] each, V with padded rows
        assert k.shape[1] == 1
        v_buf = randn(v[:, 0].shape[:-1] + (v.shape[-1] + 3,), g).to(v.dtype)
        v_buf[..., : v.shape[-1]] = v[:, 0]
        return k[:, 0].contiguous(), v_buf[..., : v.shape[-1]]
    if form == "nan_padded":

        def padded(x):
            buf = torch.full(x.shape[:-1] + (x.shape[-1] + 7,), math.nan).to(x.dtype)
            buf[..., : x.shape[-1]] = x
            return buf[..., : x.shape[-1]]

        return padded(plane(k)), padded(plane(v))
    assert form == "strided"
    pk = plane(k)
    k_buf = randn(pk.shape[:-1] + (pk.shape[-1] + 5,), g).to(k.dtype)
    k_view = k_buf[..., 1 : 1 + pk.shape[-1]]
    k_view.copy_(pk)
    # V in the other layout's memory order, every other page: [2P, H, ps, D] viewed as NHD, or back.
    other = v.transpose(1, 2) if layout == "NHD" else v  # memory order of the buffer, per page
    v_buf = randn((2 * v.shape[0],) + tuple(other.shape[1:]), g).to(v.dtype)
    v_buf[1::2] = other
    v_view = v_buf[1::2].transpose(1, 2)  # NHD view of an HND buffer, or HND view of an NHD one
    assert v_view.stride() != k_view.stride() and not v_view.is_contiguous()
    return k_view, v_view


# --------------------------------------------------------------------------- reference


def reference(q, k, v, batch, *, sm_scale, window_left=-1, soft_cap=0.0, k_scale=1.0, v_scale=1.0):
    """float64 decode attention of q [B, Hq, D] over the NHD planes k, v [pages, ps, Hkv, D] of
    ``batch``: each request's pages gathered in page-table order, then ``attention_reference``.
    Returns (out [B, Hq, D], lse [B, Hq] base 2) as float32."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), -math.inf, dtype=torch.float64)
    for b, kv_len in enumerate(batch.lengths):
        pages = batch.pages(b).long()
        kb = k[pages].reshape(-1, Hkv, D)[:kv_len]
        vb = v[pages].reshape(-1, Hkv, D)[:kv_len]
        ob, lb = attention_reference(
            q[b : b + 1],
            kb,
            vb,
            sm_scale=sm_scale,
            window_left=window_left,
            soft_cap=soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        out[b], lse[b] = ob[0], lb[0]
    return out.float(), lse.float()


_PRECISION = [torch.float32, torch.float16, torch.bfloat16]  # finer to coarser


def computed_in(*dtypes):
    """The dtype whose tolerance applies: the coarsest of q, out and a 16-bit KV (the kernel may
    multiply in it: bf16 dot products take bf16 probabilities). fp8 KV converts exactly to bf16/fp16,
    so it adds no rounding of its own."""
    return max((d for d in dtypes if d not in FP8), key=_PRECISION.index)


def check_against_reference(out, lse, ref_out, ref_lse, dtype, lengths, ctx, assert_close_ref, out_dtype=None):
    """out (dtype ``out_dtype``, default ``dtype``) within ``dtype``'s tolerance of ref_out, cosine per
    request, zeros for empty requests; lse (if given) within LSE_TOL of ref_lse."""
    assert out.dtype == (out_dtype or dtype) and out.shape == ref_out.shape, ctx
    assert_close_ref(out, ref_out, dtype, msg=ctx)
    for b, kv_len in enumerate(lengths):
        if kv_len == 0:
            assert torch.all(out[b] == 0), f"{ctx}: empty request {b} must give zeros"
            continue
        cosine = torch.nn.functional.cosine_similarity(out[b].float().flatten(), ref_out[b].flatten(), dim=0)
        assert cosine > MIN_COSINE, f"{ctx}: request {b} (kv_len {kv_len}) has cosine {cosine:.6f}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape, ctx
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL, msg=lambda m: f"{ctx}: lse\n{m}")


# --------------------------------------------------------------------------- one case, end to end


@dataclass(frozen=True)
class Case:
    lengths: tuple
    page_size: int = 16
    num_qo_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    form: str = "tensor"  # as_cache
    io: str = "fresh"  # fresh: run() allocates out/lse; views: strided q, out= and lse= views
    window_left: int = -1
    soft_cap: float | None = None
    sm_scale: float | None = None
    q_scale: float | None = None
    k_scale: float | torch.Tensor | None = None
    v_scale: float | torch.Tensor | None = None
    q_magnitude: float = 1.0
    empty_last_page_len: int = 0
    index_dtype: torch.dtype = torch.int32  # of indptr, indices and last_page_len


def _float(x):
    return 1.0 if x is None else float(x)


def run_case(case, q_dtype, kv_dtype, out_dtype, layout, workspace, assert_close_ref, key):
    g = seeded("decode", key, layout)
    batch = make_batch(case.lengths, case.page_size, g, case.empty_last_page_len)
    B, Hq, Hkv, D = len(case.lengths), case.num_qo_heads, case.num_kv_heads, case.head_dim
    k, v = cache_values(batch, Hkv, D, kv_dtype, g)
    cache = as_cache(k, v, case.form, layout, g)
    q_values = (randn((B, Hq, D), g) * case.q_magnitude).to(q_dtype)

    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace, layout)
    wrapper.plan(
        *(t.to(case.index_dtype) for t in (batch.indptr, batch.indices, batch.last_page_len)),
        Hq,
        Hkv,
        D,
        case.page_size,
        window_left=case.window_left,
        logits_soft_cap=case.soft_cap,
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
        o_data_type=out_dtype,
        sm_scale=case.sm_scale,
    )
    scales = dict(q_scale=case.q_scale, k_scale=case.k_scale, v_scale=case.v_scale)
    if case.io == "fresh":
        q = q_values
        out, lse = wrapper.run(q, cache, return_lse=True, **scales)
    else:
        assert case.io == "views"
        qkv = randn((B, Hq + 2 * Hkv, D), g).to(q_dtype)  # a packed projection; q is its first Hq heads
        q = qkv[:, :Hq]
        q.copy_(q_values)
        out, out_backing, out_mask = make_rows(torch.zeros(B, Hq, D, dtype=out_dtype), "gap", g)
        lse, lse_backing, lse_mask = make_rows(torch.zeros(B, Hq), "padded", g)
        out_before, lse_before, qkv_before = out_backing.clone(), lse_backing.clone(), qkv.clone()
        got = wrapper.run(q, cache, out=out, lse=lse, return_lse=True, **scales)
        assert got[0] is out and got[1] is lse, "out= and lse= must be filled in place and returned"
        assert_outside_untouched(out_backing, out_before, out_mask, "out")
        assert_outside_untouched(lse_backing, lse_before, lse_mask, "lse")
        assert torch.equal(qkv, qkv_before), "run() must not write to q"

    sm_scale = (1.0 / math.sqrt(D) if case.sm_scale is None else case.sm_scale) * _float(case.q_scale)
    ref_out, ref_lse = reference(
        q_values,
        k,
        v,
        batch,
        sm_scale=sm_scale,
        window_left=case.window_left,
        soft_cap=case.soft_cap or 0.0,
        k_scale=_float(case.k_scale),
        v_scale=_float(case.v_scale),
    )
    ctx = f"{key} {layout} lengths={case.lengths}"
    check_against_reference(
        out,
        lse,
        ref_out,
        ref_lse,
        computed_in(q_dtype, kv_dtype, out_dtype),
        case.lengths,
        ctx,
        assert_close_ref,
        out_dtype,
    )
    return wrapper


# --------------------------------------------------------------------------- the scenario matrix

UNEVEN = (1, 7, 1023, 4097)
SCENARIOS = {
    "uneven": Case(UNEVEN),
    "batch1": Case((300,), page_size=64, form="tuple"),
    "batch37": Case(
        tuple((0 if i % 9 == 4 else 1 + (i * 37) % 211) for i in range(37)),
        form="tuple",
        empty_last_page_len=5,
        index_dtype=torch.int64,
    ),
    "page1": Case((5, 33, 70, 1), page_size=1, form="squeezed"),
    "page1_tuple": Case((3, 17, 0), page_size=1, form="squeezed_tuple"),
    "page64_partial": Case((63, 64, 65, 130), page_size=64),
    "odd_page": Case((13, 14, 1, 200, 0), page_size=13, form="strided"),
    "empty_mixed": Case((0, 0, 5, 0, 40, 0), page_size=16),
    "all_empty": Case((0, 0)),
    "window": Case((1, 7, 150, 1023), window_left=100),
    "window0": Case((1, 50, 333), window_left=0, form="tuple"),
    "window_long": Case((20, 2000), window_left=1500, page_size=64),
    "soft_cap": Case((1, 70, 900), soft_cap=5.0, q_magnitude=4.0),
    "soft_cap_window": Case((33, 500), soft_cap=2.0, q_magnitude=3.0, window_left=64, page_size=7),
    "scales": Case((9, 300), sm_scale=0.05, q_scale=1.5, k_scale=0.7, v_scale=2.0, form="tuple"),
    "strided_io": Case((1, 7, 129, 517), io="views", form="strided"),
}
SCENARIO_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", list(SCENARIO_DTYPES))
def test_decode_scenarios(dtype, scenario, layout, tier, workspace, assert_close_ref):
    t = SCENARIO_DTYPES[dtype]
    run_case(SCENARIOS[scenario], t, t, t, layout, workspace, assert_close_ref, (dtype, scenario))


# --------------------------------------------------------------------------- the variant matrix

_VARIANT_LENGTHS = (1, 7, 300, 1029, 0)
# name: (q dtype, KV dtype, out dtype, case). Each is one more compiled variant per tier.
VARIANTS = {
    "fp16_d64_group1": (
        torch.float16,
        torch.float16,
        torch.float16,
        Case(_VARIANT_LENGTHS, num_qo_heads=4, num_kv_heads=4, head_dim=64),
    ),
    "bf16_d256_group8": (
        torch.bfloat16,
        torch.bfloat16,
        torch.bfloat16,
        Case(_VARIANT_LENGTHS, num_qo_heads=16, num_kv_heads=2, head_dim=256, page_size=64),
    ),
    "bf16_d80_group5": (
        torch.bfloat16,
        torch.bfloat16,
        torch.bfloat16,
        Case(_VARIANT_LENGTHS, num_qo_heads=10, num_kv_heads=2, head_dim=80, page_size=13, form="tuple"),
    ),
    "fp16_d512_group2": (
        torch.float16,
        torch.float16,
        torch.float16,
        Case((1, 77, 600, 0), num_qo_heads=4, num_kv_heads=2, head_dim=512, form="strided"),
    ),
    "fp8_e4m3": (torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16, Case(_VARIANT_LENGTHS, k_scale=0.5, v_scale=1.7)),
    "fp8_e5m2": (
        torch.float16,
        torch.float8_e5m2,
        torch.float16,
        Case(_VARIANT_LENGTHS, k_scale=torch.tensor(1.3), v_scale=torch.tensor([0.6]), form="strided"),
    ),
    # MQA and large groups share the runtime-group variant (group 0); out in fp32 (o_data_type != q).
    "mqa16_out_fp32": (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
        Case(_VARIANT_LENGTHS, num_qo_heads=16, num_kv_heads=1),
    ),
    "mqa32_out_fp32": (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
        Case((4097, 3, 0), num_qo_heads=32, num_kv_heads=1, window_left=2000),
    ),
    "group12_out_fp32": (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
        Case((1, 100, 700), num_qo_heads=24, num_kv_heads=2, soft_cap=10.0, io="views"),
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode_variants(name, layout, tier, workspace, assert_close_ref):
    q_dtype, kv_dtype, out_dtype, case = VARIANTS[name]
    run_case(case, q_dtype, kv_dtype, out_dtype, layout, workspace, assert_close_ref, name)


# --------------------------------------------------------------------------- any head_dim

# head_dim: (q dtype, KV dtype, out dtype, case) for each head_dim class: below one vector (1, 13),
# one partial vector after whole ones (33, 55, 200, 264 on AVX-512; 72 and 200 are whole on AVX2),
# a multiple of 16 not 32 (48: no bf16 dot product), of 32 not 64 (96: no fp8 dot product), above
# 256 (264). The dims share out one GQA geometry each (groups 1, 4, 8, MQA on the runtime group)
# and one dtype combination, so every q, KV and out dtype meets a tail; rows are NaN-padded (a read
# past a row shows) or strided; windows and soft caps at two dims.
BATCH_SHAPES = {"batch1": (200,), "uneven": (1, 7, 300, 0, 1029)}
ODD_DIMS = {
    1: (torch.float32, torch.float32, torch.float32, Case((), num_qo_heads=4, num_kv_heads=4, form="nan_padded")),
    13: (
        torch.bfloat16,
        torch.bfloat16,
        torch.bfloat16,
        Case((), num_qo_heads=8, num_kv_heads=2, page_size=7, form="nan_padded"),
    ),
    33: (
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.bfloat16,
        Case(
            (),
            num_qo_heads=16,
            num_kv_heads=2,
            form="nan_padded",
            window_left=150,
            soft_cap=4.0,
            q_magnitude=3.0,
            k_scale=0.5,
            v_scale=1.5,
        ),
    ),
    48: (torch.bfloat16, torch.bfloat16, torch.float32, Case((), num_qo_heads=8, num_kv_heads=2, form="strided")),
    55: (
        torch.float16,
        torch.float8_e5m2,
        torch.float16,
        Case((), num_qo_heads=16, num_kv_heads=1, form="nan_padded", io="views"),
    ),
    72: (torch.float16, torch.float16, torch.float16, Case((), num_qo_heads=8, num_kv_heads=1, form="nan_padded")),
    96: (
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.bfloat16,
        Case((), num_qo_heads=4, num_kv_heads=4, form="nan_padded"),
    ),
    200: (
        torch.bfloat16,
        torch.bfloat16,
        torch.bfloat16,
        Case((), num_qo_heads=32, num_kv_heads=4, page_size=13, form="nan_padded", window_left=40, soft_cap=10.0),
    ),
    264: (torch.float32, torch.float32, torch.float32, Case((), num_qo_heads=8, num_kv_heads=2, form="nan_padded")),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", list(BATCH_SHAPES))
@pytest.mark.parametrize("head_dim", list(ODD_DIMS))
def test_decode_any_head_dim(head_dim, shape, layout, tier, workspace, threads, assert_close_ref):
    """Head dims that are not whole vectors, against the float64 reference, on 3 threads: the
    uneven batch's long request is split (unless a window shortens it) and its partial states
    (head_dim floats) merged."""
    q_dtype, kv_dtype, out_dtype, case = ODD_DIMS[head_dim]
    threads(3)
    case = replace(case, lengths=BATCH_SHAPES[shape], head_dim=head_dim)
    wrapper = run_case(case, q_dtype, kv_dtype, out_dtype, layout, workspace, assert_close_ref, (f"D{head_dim}", shape))
    if shape == "uneven" and case.window_left < 0:
        assert _split_units(wrapper), "the uneven batch should split its long request across 3 threads"


# --------------------------------------------------------------------------- plan reuse, splitting, threads


def _main_plan(wrapper, batch, **kwargs):
    wrapper.plan(
        batch.indptr,
        batch.indices,
        batch.last_page_len,
        8,
        2,
        128,
        batch.page_size,
        q_data_type=torch.bfloat16,
        **kwargs,
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_serves_several_layers(layout, tier, workspace, threads, assert_close_ref):
    """One plan, several run() calls: different q, different layers' caches (and cache forms), one
    reused out= buffer; edits to the caller's page table after plan() change nothing; the thread
    count may change between plan() and run()."""
    g = seeded("layers", layout)
    batch = make_batch((1, 7, 1023, 0, 2500), 16, g)
    threads(3)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace, layout)
    _main_plan(wrapper, batch)
    threads(1)
    reference_batch = replace(
        batch, indptr=batch.indptr.clone(), indices=batch.indices.clone(), last_page_len=batch.last_page_len.clone()
    )
    batch.indices.fill_(0)  # the plan holds its own copy
    batch.indptr.zero_()
    out = torch.empty(5, 8, 128, dtype=torch.bfloat16)
    for layer, form in enumerate(("tensor", "tuple", "strided", "tensor")):
        k, v = cache_values(batch, 2, 128, torch.bfloat16, g)
        q = randn((5, 8, 128), g).to(torch.bfloat16)
        got = wrapper.run(q, as_cache(k, v, form, layout, g), out=out)
        assert got is out
        ref_out, _ = reference(q, k, v, reference_batch, sm_scale=1 / math.sqrt(128))
        check_against_reference(
            out, None, ref_out, None, torch.bfloat16, batch.lengths, f"layer {layer} {form}", assert_close_ref
        )


def test_page_table_views_of_larger_buffers(tier, workspace, assert_close_ref):
    """A page table given as the batch's views of buffers preallocated for a larger batch (how a
    caller with such buffers passes them to FlashInfer's decode, which takes no longer indptr):
    what follows the views in the buffers (garbage) is never read."""
    g = seeded("views of larger buffers")
    batch = make_batch((1, 7, 300, 0, 1029), 16, g)

    def view_of_buffer(t, garbage):  # t's entries at the start of a longer buffer, as a view
        return torch.cat([t, torch.tensor(garbage, dtype=t.dtype)])[: len(t)]

    views = (
        view_of_buffer(batch.indptr, [0, 10**6, -5]),
        view_of_buffer(batch.indices, [-1, 10**6]),
        view_of_buffer(batch.last_page_len, [0, 999, -1]),
    )
    k, v = cache_values(batch, 2, 128, torch.bfloat16, g)
    q = randn((5, 8, 128), g).to(torch.bfloat16)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(*views, 8, 2, 128, 16, q_data_type=torch.bfloat16)
    out, lse = wrapper.run(q, torch.stack([k, v], dim=1), return_lse=True)
    ref_out, ref_lse = reference(q, k, v, batch, sm_scale=1 / math.sqrt(128))
    check_against_reference(out, lse, ref_out, ref_lse, torch.bfloat16, batch.lengths, "views", assert_close_ref)


def _split_units(wrapper):
    return [item for items in wrapper.work_lists() for item in items if item[5] >= 0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disable_split_kv(layout, tier, workspace, threads, assert_close_ref):
    """A long request split across threads (merged by LSE) and the same batch unsplit agree with
    the reference and with each other."""
    g = seeded("split", layout)
    batch = make_batch((4097, 3, 700), 16, g)
    k, v = cache_values(batch, 2, 128, torch.float32, g)
    cache = as_cache(k, v, "tensor", layout, g)
    q = randn((3, 8, 128), g)
    ref_out, ref_lse = reference(q, k, v, batch, sm_scale=1 / math.sqrt(128))
    threads(4)
    results = {}
    for disable in (False, True):
        wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace, layout)
        wrapper.plan(
            batch.indptr,
            batch.indices,
            batch.last_page_len,
            8,
            2,
            128,
            16,
            q_data_type=torch.float32,
            disable_split_kv=disable,
        )
        assert bool(_split_units(wrapper)) != disable, f"disable_split_kv={disable}: {wrapper.work_lists()}"
        results[disable] = wrapper.run(q, cache, return_lse=True)
        check_against_reference(
            *results[disable],
            ref_out,
            ref_lse,
            torch.float32,
            batch.lengths,
            f"disable_split_kv={disable}",
            assert_close_ref,
        )
    torch.testing.assert_close(results[False][0], results[True][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results[False][1], results[True][1], atol=1e-5, rtol=1e-6)


def test_lse_buffer_written_without_return_lse(tier, workspace, assert_close_ref):
    """A given lse= is written whether or not return_lse is set (FlashInfer's behaviour): run()
    returns out alone and fills lse with what return_lse=True returns."""
    g = seeded("lse_written")
    batch = make_batch((5, 40, 0), 16, g)
    k, v = cache_values(batch, 2, 128, torch.bfloat16, g)
    q = randn((3, 8, 128), g).to(torch.bfloat16)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    _main_plan(wrapper, batch)
    lse = torch.full((3, 8), math.nan)
    out = wrapper.run(q, (k, v), lse=lse)
    assert isinstance(out, torch.Tensor)
    assert not torch.isnan(lse).any(), "run(lse=...) without return_lse left lse unwritten"
    expected_out, expected_lse = wrapper.run(q, (k, v), return_lse=True)
    assert torch.equal(lse, expected_lse) and torch.equal(out, expected_out)
    ref_out, ref_lse = reference(q, k, v, batch, sm_scale=1 / math.sqrt(128))
    check_against_reference(
        out, lse, ref_out, ref_lse, torch.bfloat16, batch.lengths, "lse without return_lse", assert_close_ref
    )


def test_workspace_exact_size(tier, threads, assert_close_ref):
    """plan() names the bytes it needs; a workspace of exactly that size works (split partial states
    and per-thread scratch included) and nothing past it is written."""
    g = seeded("workspace")
    batch = make_batch((4097, 1, 2000, 0), 16, g)
    k, v = cache_values(batch, 2, 128, torch.bfloat16, g)
    q = randn((4, 8, 128), g).to(torch.bfloat16)
    threads(4)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"float_workspace_buffer is too small.* needs \d+") as info:
        _main_plan(wrapper, batch)
    needed = int(re.search(r"needs (\d+)", str(info.value)).group(1))
    guard = 4096
    buffer = torch.full((needed + guard,), 0x5A, dtype=torch.uint8)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(buffer[:needed])
    _main_plan(wrapper, batch)
    assert _split_units(wrapper), "the batch should split its long requests across 4 threads"
    out = wrapper.run(q, (k, v))
    assert torch.all(buffer[needed:] == 0x5A), "run() wrote past the end of the workspace"
    ref_out, _ = reference(q, k, v, batch, sm_scale=1 / math.sqrt(128))
    check_against_reference(
        out, None, ref_out, None, torch.bfloat16, batch.lengths, "exact workspace", assert_close_ref
    )


# --------------------------------------------------------------------------- single_decode_with_kv_cache


SINGLE_CASES = {
    "len1": dict(kv_len=1),
    "len333": dict(kv_len=333),
    "empty": dict(kv_len=0),
    "window": dict(kv_len=200, window_left=31),
    "soft_cap_scales": dict(kv_len=90, logits_soft_cap=3.0, sm_scale=0.2, k_scale=0.8, v_scale=1.5),
    "head_dim_33": dict(kv_len=150, head_dim=33, window_left=100),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(SINGLE_CASES))
def test_single_decode(case, layout, tier, assert_close_ref):
    opts = dict(SINGLE_CASES[case])
    kv_len, D = opts.pop("kv_len"), opts.pop("head_dim", 128)
    g = seeded("single", case, layout)
    q = randn((8, D), g).to(torch.bfloat16)
    k_nhd, v_nhd = (randn((kv_len, 2, D), g).to(torch.bfloat16) for _ in range(2))
    if layout == "NHD":
        k, v = k_nhd, v_nhd
    else:  # HND views of NHD storage: strided k and v
        k, v = k_nhd.transpose(0, 1), v_nhd.transpose(0, 1)
    out, lse = kernforge.single_decode_with_kv_cache(q, k, v, layout, return_lse=True, **opts)
    assert out.shape == (8, D) and out.dtype == torch.bfloat16 and lse.shape == (8,)
    batch = make_batch((kv_len,), max(kv_len, 1), g)  # one page holding the whole request
    pages = torch.zeros(batch.num_pages, max(kv_len, 1), 2, D, dtype=torch.bfloat16)
    k_pages, v_pages = pages.clone(), pages.clone()
    if kv_len:
        k_pages[batch.pages(0)[0]], v_pages[batch.pages(0)[0]] = k_nhd, v_nhd
    ref_out, ref_lse = reference(
        q[None],
        k_pages,
        v_pages,
        batch,
        sm_scale=opts.get("sm_scale", 1 / math.sqrt(D)) * opts.get("k_scale", 1.0),
        window_left=opts.get("window_left", -1),
        soft_cap=opts.get("logits_soft_cap", 0.0),
        v_scale=opts.get("v_scale", 1.0),
    )
    check_against_reference(
        out[None], lse[None], ref_out, ref_lse, torch.bfloat16, (kv_len,), f"single {case}", assert_close_ref
    )
    plain = kernforge.single_decode_with_kv_cache(q, k, v, layout, **opts)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


# --------------------------------------------------------------------------- the planner


def _check_partition(lists, batch, num_kv_heads, window_left, ctx):
    """Every (request, visible KV token, KV head) in exactly one item; every (request, KV head) in
    exactly one unit (empty requests too: their zeros and -inf must be written); the pieces of a
    split unit write distinct, consecutive workspace slots (the merge reads them as one range)."""
    coverage = [torch.zeros(num_kv_heads, n, dtype=torch.int32) for n in batch.lengths]
    units = {}
    for items in lists:
        for request, kv_head, num_heads, begin, end, slot in items:
            n = batch.lengths[request]
            first = max(0, n - 1 - window_left) if window_left >= 0 else 0
            assert num_heads >= 1 and 0 <= kv_head and kv_head + num_heads <= num_kv_heads, ctx
            assert first <= begin <= end <= n, f"{ctx}: item {begin}..{end} outside request {request}'s [{first}, {n})"
            coverage[request][kv_head : kv_head + num_heads, begin:end] += 1
            units.setdefault((request, kv_head, num_heads), []).append(slot)
    for b, n in enumerate(batch.lengths):
        first = max(0, n - 1 - window_left) if window_left >= 0 else 0
        assert torch.all(coverage[b][:, first:] == 1), f"{ctx}: request {b}: visible tokens not covered exactly once"
        assert torch.all(coverage[b][:, :first] == 0), f"{ctx}: request {b}: tokens outside the window planned"
        heads = torch.zeros(num_kv_heads, dtype=torch.int32)
        for request, kv_head, num_heads in units:
            if request == b:
                heads[kv_head : kv_head + num_heads] += 1
        assert torch.all(heads == 1), f"{ctx}: request {b}: KV heads in {heads.tolist()} units"
    all_slots = []
    for unit, slots in units.items():
        if len(slots) == 1:
            assert slots == [-1], f"{ctx}: unsplit unit {unit} writes to a workspace slot {slots}"
            continue
        assert min(slots) >= 0, f"{ctx}: a piece of split unit {unit} writes to the output: {slots}"
        assert sorted(slots) == list(range(min(slots), min(slots) + len(slots))), f"{ctx}: unit {unit}: {slots}"
        all_slots += slots
    assert len(all_slots) == len(set(all_slots)), f"{ctx}: two pieces share a workspace slot"


def test_planner_covers_each_token_once(workspace, threads):
    g = seeded("planner")
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    split_trials = 0
    for trial in range(60):
        batch_size = int(torch.randint(1, 40, (), generator=g))
        kind = trial % 3  # short, long and mixed requests; a quarter of them empty
        top = (40, 6000, 3000)[kind]
        lengths = torch.randint(0, top, (batch_size,), generator=g)
        if kind == 2:
            lengths[torch.rand(batch_size, generator=g) < 0.5] //= 100
        lengths[torch.rand(batch_size, generator=g) < 0.25] = 0
        page_size = int((1, 16, 64, 13)[trial % 4])
        num_kv_heads = int(torch.randint(1, 9, (), generator=g))
        window_left = -1 if trial % 5 else int(torch.randint(0, 2000, (), generator=g))
        num_lists = trial % 4 + 1
        batch = make_batch(lengths.tolist(), page_size, g, empty_last_page_len=trial % (page_size + 1))
        threads(num_lists)
        wrapper.plan(
            batch.indptr,
            batch.indices,
            batch.last_page_len,
            4 * num_kv_heads,
            num_kv_heads,
            128,
            page_size,
            window_left=window_left,
            q_data_type=torch.bfloat16,
            disable_split_kv=trial % 7 == 6,
        )
        lists = wrapper.work_lists()
        ctx = (
            f"trial {trial}: lengths={batch.lengths} page_size={page_size} num_kv_heads={num_kv_heads} "
            f"window_left={window_left} threads={num_lists}"
        )
        assert len(lists) == num_lists, ctx
        _check_partition(lists, batch, num_kv_heads, window_left, ctx)
        split_trials += any(item[5] >= 0 for items in lists for item in items)
        if trial % 7 == 6:
            assert not any(item[5] >= 0 for items in lists for item in items), f"{ctx}: split with disable_split_kv"
    assert split_trials >= 10, f"only {split_trials} of the random batches split a request: the test lost its bite"


BALANCE_BATCHES = {
    "uniform": ((1024,) * 64, 8),
    "one_long": ((16384,), 1),
    "few_requests": ((4096, 4096), 8),
    "uneven": ((128, 16384) * 8, 8),
    "uneven_sorted": ((16384,) * 4 + (128,) * 60, 2),
}


@pytest.mark.parametrize("num_lists", [2, 4])
@pytest.mark.parametrize("name", list(BALANCE_BATCHES))
def test_planner_balances_big_batches(name, num_lists, workspace, threads):
    """No list reads more than 5% above the mean of KV tokens x KV heads (nor 10% below) on batches
    big enough to split."""
    lengths, num_kv_heads = BALANCE_BATCHES[name]
    batch = make_batch(lengths, 16, seeded("balance", name))
    threads(num_lists)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(
        batch.indptr,
        batch.indices,
        batch.last_page_len,
        4 * num_kv_heads,
        num_kv_heads,
        128,
        16,
        q_data_type=torch.bfloat16,
    )
    lists = wrapper.work_lists()
    _check_partition(lists, batch, num_kv_heads, -1, name)
    costs = [sum(heads * (end - begin) for _, _, heads, begin, end, _ in items) for items in lists]
    mean = sum(costs) / num_lists
    assert max(costs) <= 1.05 * mean and min(costs) >= 0.9 * mean, f"{name}: list costs {costs}"


# --------------------------------------------------------------------------- errors


@pytest.fixture
def planned(workspace):
    """A planned wrapper (bf16, 8 query heads on 2 KV heads, head_dim 128, page 16) with its
    q and cache: (wrapper, q, cache)."""
    g = seeded("errors")
    batch = make_batch((5, 40), 16, g)
    k, v = cache_values(batch, 2, 128, torch.bfloat16, g)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    _main_plan(wrapper, batch)
    return wrapper, randn((2, 8, 128), g).to(torch.bfloat16), torch.stack([k, v], dim=1)


def _plan_args(**changes):
    """plan() arguments of a valid 2-request batch (page 16, 4 pages), with ``changes``."""
    args = dict(
        indptr=torch.tensor([0, 1, 3], dtype=torch.int32),
        indices=torch.tensor([2, 0, 3], dtype=torch.int32),
        last_page_len=torch.tensor([5, 16], dtype=torch.int32),
        num_qo_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        q_data_type=torch.bfloat16,
    )
    args.update(changes)
    return args


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


PLAN_ERRORS = {
    "indptr_start": (dict(indptr=_i32(1, 1, 3)), ValueError, r"indptr must start at 0"),
    "indptr_decreasing": (dict(indptr=_i32(0, 2, 1)), ValueError, r"indptr must be non-decreasing"),
    "indptr_beyond_indices": (dict(indptr=_i32(0, 1, 4)), ValueError, r"indptr ends beyond indices"),
    "indptr_length": (dict(indptr=_i32(0, 1)), ValueError, r"indptr must be 1-D with 3 entries"),
    # FlashInfer's decode takes the batch from last_page_len and pairs indptr with it (get_seq_lens):
    # unlike prefill's and MLA's plans, no longer indptr buffer
    "indptr_longer_than_batch": (
        dict(indptr=_i32(0, 1, 3, 3, 0)),
        ValueError,
        r"indptr must be 1-D with 3 entries \(len\(last_page_len\) \+ 1\), got shape \(5,\)",
    ),
    "indptr_2d": (dict(indptr=_i32(0, 1, 3)[None]), ValueError, r"indptr must be 1-D"),
    "indptr_float": (dict(indptr=torch.tensor([0.0, 1.0, 3.0])), TypeError, r"indptr"),
    "indices_beyond_int32": (dict(indices=torch.tensor([2, 2**32, 3])), ValueError, r"indices"),
    "negative_index": (dict(indices=_i32(2, -1, 3)), ValueError, r"indices holds a negative page index"),
    "last_page_len_0": (dict(last_page_len=_i32(0, 16)), ValueError, r"last_page_len"),
    "last_page_len_big": (dict(last_page_len=_i32(5, 17)), ValueError, r"last_page_len"),
    "heads_not_divisible": (
        dict(num_qo_heads=6, num_kv_heads=4),
        ValueError,
        r"num_qo_heads\(6\) must be divisible by num_kv_heads\(4\)",
    ),
    "head_dim_0": (dict(head_dim=0), ValueError, r"head_dim"),
    "head_dim_513": (dict(head_dim=513), ValueError, r"head_dim must be an int in \[1, 512\], got 513"),
    "page_size_0": (dict(page_size=0), ValueError, r"page_size"),
    "rope_llama": (dict(pos_encoding_mode="ROPE_LLAMA"), NotImplementedError, r"ROPE_LLAMA"),
    "alibi": (dict(pos_encoding_mode="ALIBI"), NotImplementedError, r"ALIBI"),
    "bad_pos_mode": (dict(pos_encoding_mode="none"), KeyError, r"Invalid pos_encoding_mode none"),
    "bad_dtype_type": (dict(q_data_type=3), TypeError, r"dtype must be a string or torch.dtype"),
    "int_kv_dtype": (dict(kv_data_type=torch.int8), TypeError, r"kv_data_type"),
    "fp8_out_dtype": (dict(o_data_type=torch.float8_e4m3fn), TypeError, r"o_data_type"),
    "negative_soft_cap": (dict(logits_soft_cap=-1.0), ValueError, r"logits_soft_cap"),
    "infinite_soft_cap": (dict(logits_soft_cap=float("inf")), ValueError, r"logits_soft_cap"),
    "nan_soft_cap": (dict(logits_soft_cap=float("nan")), ValueError, r"logits_soft_cap"),
    "window_none": (dict(window_left=None), TypeError, r"window_left"),
    "window_float": (dict(window_left=2.5), TypeError, r"window_left"),
    "q_len_per_req": (dict(q_len_per_req=2), NotImplementedError, r"q_len_per_req"),
}


@pytest.mark.parametrize("name", list(PLAN_ERRORS))
def test_plan_errors(name, workspace):
    changes, error, message = PLAN_ERRORS[name]
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    with pytest.raises(error, match=message):
        wrapper.plan(**_plan_args(**changes))


def test_plan_error_types_match_flashinfer(workspace):
    """FlashInfer raises KeyError for an unknown pos_encoding_mode and kv_layout and AttributeError
    for run() before plan(); kernforge's errors are ValueErrors that are also those."""
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    with pytest.raises(ValueError, match="Invalid pos_encoding_mode XYZ"):
        wrapper.plan(**_plan_args(pos_encoding_mode="XYZ"))
    with pytest.raises(KeyError):
        kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace, "NDH")
    with pytest.raises(ValueError, match="Invalid kv_layout NDH"):
        kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace, "NDH")
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 2, 16, 2, 128, dtype=torch.bfloat16)
    for error in (PlanStateError, AttributeError, ValueError):
        with pytest.raises(error, match="before plan"):
            wrapper.run(q, cache)


def test_failed_plan_leaves_no_plan(planned):
    """A plan() that raises must not leave the previous plan in place for run()."""
    wrapper, q, cache = planned
    wrapper.run(q, cache)
    with pytest.raises(ValueError, match="indptr"):
        wrapper.plan(**_plan_args(indptr=_i32(0, 2, 1)))
    with pytest.raises(PlanStateError):
        wrapper.run(q, cache)


def _cache_with(cache, **changes):
    """The 5-D NHD cache [P, 2, ps, H, D] with one of its sizes or its dtype changed."""
    P, _, ps, H, D = cache.shape
    shape = (changes.get("pages", P), 2, changes.get("page_size", ps), changes.get("heads", H), changes.get("dim", D))
    return torch.zeros(shape, dtype=changes.get("dtype", cache.dtype))


RUN_ERRORS = {
    "q_dtype": (
        lambda q, c: dict(q=q.half()),
        ValueError,
        r"The dtype of q torch.float16 does not match the q_data_type torch.bfloat16 specified in plan "
        r"function\.",
    ),
    "q_shape": (lambda q, c: dict(q=q[:1]), ValueError, r"q must have shape"),
    "q_heads": (lambda q, c: dict(q=q[:, :4]), ValueError, r"q must have shape"),
    "q_head_dim_strided": (lambda q, c: dict(q=torch.zeros(2, 8, 256, dtype=q.dtype)[..., ::2]), ValueError, r"q"),
    "cache_dtype": (
        lambda q, c: dict(paged_kv_cache=c.half()),
        ValueError,
        r"The dtype of k torch.float16 does not match the kv_data_type torch.bfloat16",
    ),
    "cache_int_dtype": (lambda q, c: dict(paged_kv_cache=c.to(torch.int16)), TypeError, r"paged_kv_cache"),
    "cache_kv_dim": (
        lambda q, c: dict(paged_kv_cache=torch.cat([c, c[:, :1]], dim=1)),
        ValueError,
        r"paged_kv_cache must be \[num_pages, 2",
    ),
    "cache_rank": (lambda q, c: dict(paged_kv_cache=c[0]), ValueError, r"paged_kv_cache"),
    "cache_heads": (lambda q, c: dict(paged_kv_cache=_cache_with(c, heads=4)), ValueError, r"num_kv_heads"),
    "cache_page_size": (lambda q, c: dict(paged_kv_cache=_cache_with(c, page_size=8)), ValueError, r"page_size"),
    "cache_head_dim": (lambda q, c: dict(paged_kv_cache=_cache_with(c, dim=64)), ValueError, r"head_dim"),
    # 4 of the 7 pages are used: the highest used page is >= 3
    "cache_too_few_pages": (lambda q, c: dict(paged_kv_cache=c[:3]), ValueError, r"indices holds page \d+"),
    "cache_type": (lambda q, c: dict(paged_kv_cache=[c]), KeyError, r"Unrecognized paged_kv_cache type"),
    "out_shape": (
        lambda q, c: dict(out=torch.full((2, 8, 64), SENTINEL, dtype=q.dtype)),
        ValueError,
        r"Invalid shape of out",
    ),
    "out_dtype": (lambda q, c: dict(out=torch.full((2, 8, 128), SENTINEL)), ValueError, r"Invalid dtype of out"),
    "out_rows_overlap": (  # an expanded out: both rows are one memory, written by two threads
        lambda q, c: dict(out=torch.full((1, 8, 128), SENTINEL, dtype=q.dtype).expand(2, 8, 128)),
        ValueError,
        r"out's rows overlap",
    ),
    "lse_shape": (lambda q, c: dict(lse=torch.empty(2, 4), return_lse=True), ValueError, r"Invalid shape of lse"),
    "lse_rows_overlap": (
        lambda q, c: dict(lse=torch.empty(1, 8).expand(2, 8), return_lse=True),
        ValueError,
        r"lse's rows overlap",
    ),
    "lse_dtype": (
        lambda q, c: dict(lse=torch.empty(2, 8, dtype=torch.float16), return_lse=True),
        ValueError,
        r"Invalid dtype of lse",
    ),
    "window_left_differs": (lambda q, c: dict(window_left=10), ValueError, r"window_left"),
    "sinks": (lambda q, c: dict(sinks=torch.zeros(8)), NotImplementedError, r"sinks"),
    "kv_cache_sf": (lambda q, c: dict(kv_cache_sf=torch.ones(1)), NotImplementedError, r"kv_cache_sf"),
}


@pytest.mark.parametrize("name", list(RUN_ERRORS))
def test_run_errors(name, planned):
    """Each bad argument raises the named error, and nothing is written to out."""
    wrapper, q, cache = planned
    make, error, message = RUN_ERRORS[name]
    kwargs = dict(q=q, paged_kv_cache=cache, out=torch.full((2, 8, 128), SENTINEL, dtype=torch.bfloat16))
    kwargs.update(make(q, cache))
    out = kwargs["out"]
    before = out.clone()
    with pytest.raises(error, match=message):
        wrapper.run(kwargs.pop("q"), kwargs.pop("paged_kv_cache"), **kwargs)
    assert torch.equal(out, before), "a failed run() wrote to out"


def test_run_accepts_the_planned_window(planned):
    wrapper, q, cache = planned
    torch.testing.assert_close(wrapper.run(q, cache, window_left=-1), wrapper.run(q, cache))


def test_forward_is_run_with_the_planned_options(planned):
    """FlashInfer's deprecated forward(): sm_scale and the scales per call, the window in the plan."""
    wrapper, q, cache = planned
    expected = wrapper.run(q, cache, k_scale=0.5)
    torch.testing.assert_close(wrapper.forward(q, cache, k_scale=0.5), expected)
    out, lse = wrapper.forward_return_lse(q, cache, sm_scale=0.5 / 128**0.5)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="window_left"):
        wrapper.forward(q, cache, window_left=3)


def test_single_decode_errors():
    q = torch.zeros(8, 128, dtype=torch.bfloat16)
    k = torch.zeros(10, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="v has dtype"):
        kernforge.single_decode_with_kv_cache(q, k, k.half())
    with pytest.raises(ValueError, match="k must be contiguous in head_dim"):
        kernforge.single_decode_with_kv_cache(q, torch.zeros(10, 2, 256, dtype=k.dtype)[..., ::2], k)
    with pytest.raises(NotImplementedError, match="ROPE_LLAMA"):
        kernforge.single_decode_with_kv_cache(q, k, k, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(KeyError, match="Invalid kv_layout"):
        kernforge.single_decode_with_kv_cache(q, k, k, kv_layout="XYZ")
    with pytest.raises(ValueError, match="num_qo_heads"):
        kernforge.single_decode_with_kv_cache(q[:3], k, k)
    with pytest.raises(ValueError, match="same shape"):
        kernforge.single_decode_with_kv_cache(q, k, k[:5])
    with pytest.raises(ValueError, match="head_dim"):
        kernforge.single_decode_with_kv_cache(q[:, :64], k, k)
