"""Tests for MLA attention over a paged latent cache: ``BatchMLAPagedAttentionWrapper`` and
``append_paged_mla_kv_cache`` (FlashInfer's API).

The reference expands the latent cache into per-head keys and values, per request, in float64
(``references.attention_reference`` with one KV head: keys ``[ckv | kpe]``, values ``ckv``): the
request's pages are gathered in page-table order, so a kernel that ignored ``kv_indices`` fails
on the shuffled tables used throughout. An fp8 cache is dequantized exactly for the reference, so
only the kernel's arithmetic and output rounding differ: out within bf16 tolerance, LSE to 1e-4.
Batches mix an empty request, one-token requests, a multi-query (causal) request and lengths that
end mid-page; caches are adjacent views of one ``[..., 576]`` buffer (read in place) or separate
tensors (rows assembled by the kernel).
"""

from __future__ import annotations

import math

import pytest
import torch

import kernforge
from kernforge.ops.attention.prefill_core import PlanStateError

from op_helpers import randn, seeded
from references import attention_reference

CKV, KPE = 512, 64
SM_SCALE = 1.0 / math.sqrt(128 + 64)  # DeepSeek's qk_nope + qk_rope head dim
OUT_TOL = dict(atol=1e-2, rtol=1e-2)
LSE_TOL = dict(atol=1e-4, rtol=1e-4)
SPARE_PAGES = 3


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(64 << 20, dtype=torch.uint8)


def make_batch(qo_lens, kv_lens, page_size, g):
    """Index tensors of a batch with a shuffled page table (and spare pages no request owns)."""
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    pages = [-(-n // page_size) for n in kv_lens]
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    num_pages = int(kv_indptr[-1]) + SPARE_PAGES
    kv_indices = torch.randperm(num_pages, generator=g)[: int(kv_indptr[-1])].to(torch.int32)
    return qo_indptr, kv_indptr, kv_indices, torch.tensor(kv_lens, dtype=torch.int32), num_pages


def make_cache(num_pages, page_size, dtype, adjacent, g):
    if adjacent:
        buffer = randn((num_pages, page_size, CKV + KPE), g).to(dtype)
        return buffer[..., :CKV], buffer[..., CKV:]
    return randn((num_pages, page_size, CKV), g).to(dtype), randn((num_pages, page_size, KPE), g).to(dtype)


def reference(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens, causal, k_scale=1.0, v_scale=1.0):
    outs, lses = [], []
    for b in range(kv_lens.numel()):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        kv_len = int(kv_lens[b])
        latent = ckv[pages].flatten(0, 1)[:kv_len].double()
        rope = kpe[pages].flatten(0, 1)[:kv_len].double()  # [kv_len, 0] for MLA without a rope part
        q = torch.cat([q_nope[rows], q_pe[rows]], -1)
        k = torch.cat([latent, rope], -1)[:, None]
        out, lse = attention_reference(
            q, k, latent[:, None], sm_scale=SM_SCALE, causal=causal, k_scale=k_scale, v_scale=v_scale
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check(wrapper, inputs, causal, **scales):
    q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens = inputs
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True, **scales)
    ref_out, ref_lse = reference(
        q_nope, q_pe, ckv.float(), kpe.float(), qo_indptr, kv_indptr, kv_indices, kv_lens, causal, **scales
    )
    assert out.dtype == q_nope.dtype and out.shape == q_nope.shape
    torch.testing.assert_close(out.double(), ref_out, **OUT_TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOL)  # -inf where a query sees no key


# An empty request, decode requests, a request of 3 queries, lengths ending mid-page.
QO_LENS = [1, 1, 1, 3, 1]
KV_LENS = [37, 0, 1, 130, 64]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [1, 16, 128])
def test_matches_expanded_reference(tier, workspace, num_heads, page_size, kv_dtype):
    g = seeded("mla", num_heads, page_size, kv_dtype)
    qo_indptr, kv_indptr, kv_indices, kv_lens, num_pages = make_batch(QO_LENS, KV_LENS, page_size, g)
    total = int(qo_indptr[-1])
    q_nope = randn((total, num_heads, CKV), g).bfloat16()
    q_pe = randn((total, num_heads, KPE), g).bfloat16()
    wrapper = kernforge.BatchMLAPagedAttentionWrapper(workspace)
    for adjacent in (True, False):
        ckv, kpe = make_cache(num_pages, page_size, kv_dtype, adjacent, g)
        for causal in (False, True):
            wrapper.plan(
                qo_indptr, kv_indptr, kv_indices, kv_lens, num_heads, CKV, KPE, page_size, causal, SM_SCALE,
                torch.bfloat16, kv_dtype,
            )  # fmt: skip
            check(wrapper, (q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens), causal)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_request_split_across_threads(workspace, threads):
    """One long request and a short one: the long one's KV is split across threads and merged."""
    kernforge.set_num_threads(threads)
    try:
        g = seeded("split", threads)
        qo_indptr, kv_indptr, kv_indices, kv_lens, num_pages = make_batch([1, 2], [3000, 5], 16, g)
        q_nope = randn((3, 16, CKV), g).bfloat16()
        q_pe = randn((3, 16, KPE), g).bfloat16()
        ckv, kpe = make_cache(num_pages, 16, torch.bfloat16, True, g)
        wrapper = kernforge.BatchMLAPagedAttentionWrapper(workspace)
        wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, kv_lens, 16, CKV, KPE, 16, True, SM_SCALE, torch.bfloat16, torch.bfloat16
        )
        check(wrapper, (q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens), True)
    finally:
        kernforge.set_num_threads(None)


def test_buffers_given_scales_and_joined_queries(workspace):
    """out= and lse= are written in place; k_scale / v_scale scale logits and output; q_nope and
    q_pe sliced from one buffer are read as joined rows."""
    g = seeded("buffers")
    qo_indptr, kv_indptr, kv_indices, kv_lens, num_pages = make_batch([2, 1], [20, 45], 16, g)
    q = randn((3, 16, CKV + KPE), g).bfloat16()
    q_nope, q_pe = q[..., :CKV], q[..., CKV:]
    ckv, kpe = make_cache(num_pages, 16, torch.float8_e4m3fn, True, g)
    wrapper = kernforge.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(
        qo_indptr, kv_indptr, kv_indices, kv_lens, 16, CKV, KPE, 16, True, SM_SCALE, torch.bfloat16, torch.float8_e4m3fn
    )
    out = torch.full((3, 16, CKV), 7.0, dtype=torch.bfloat16)
    lse = torch.full((3, 16), 7.0)
    result = wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, k_scale=0.5, v_scale=2.0)
    assert result is out
    ref_out, ref_lse = reference(
        q_nope,
        q_pe,
        ckv.float(),
        kpe.float(),
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_lens,
        True,
        k_scale=0.5,
        v_scale=2.0,
    )
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOL)


def test_spare_pages_in_the_table(workspace):
    """kv_indptr may give a request more pages than kv_len_arr needs: the first ones are used."""
    g = seeded("spare")
    qo_indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 4, 6], dtype=torch.int32)
    kv_indices = torch.tensor([5, 2, 7, 0, 3, 1], dtype=torch.int32)
    kv_lens = torch.tensor([20, 3], dtype=torch.int32)  # request 0 needs 2 of its 4 pages, request 1 one of 2
    q_nope, q_pe = randn((2, 4, CKV), g).bfloat16(), randn((2, 4, KPE), g).bfloat16()
    ckv, kpe = make_cache(8, 16, torch.bfloat16, False, g)
    wrapper = kernforge.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(
        qo_indptr, kv_indptr, kv_indices, kv_lens, 4, CKV, KPE, 16, False, SM_SCALE, torch.bfloat16, torch.bfloat16
    )
    check(wrapper, (q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens), False)


def test_fp16(workspace):
    g = seeded("fp16")
    qo_indptr, kv_indptr, kv_indices, kv_lens, num_pages = make_batch([1, 2], [33, 9], 8, g)
    q_nope, q_pe = randn((3, 8, CKV), g).half(), randn((3, 8, KPE), g).half()
    ckv, kpe = make_cache(num_pages, 8, torch.float16, True, g)
    wrapper = kernforge.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(
        qo_indptr, kv_indptr, kv_indices, kv_lens, 8, CKV, KPE, 8, True, SM_SCALE, torch.float16, torch.float16
    )
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    ref_out, ref_lse = reference(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens, True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOL)


def with_garbage(t, garbage, dtype=torch.int32):
    """``t`` at the start of a longer buffer (one preallocated for a larger batch), the rest garbage."""
    return torch.cat([t.to(dtype), torch.tensor(garbage, dtype=dtype)])


def test_page_table_buffers_longer_than_the_batch(tier, workspace):
    """As FlashInfer's planner, the batch is kv_len_arr's: qo_indptr and kv_indptr may be buffers of a
    larger batch, whose first len(kv_len_arr) + 1 entries are read and checked. Their garbage (values
    that decrease, pass kv_indices' end, are negative or exceed int32) changes nothing."""
    g = seeded("buffers longer than the batch")
    qo_indptr, kv_indptr, kv_indices, kv_lens, num_pages = make_batch(QO_LENS, KV_LENS, 16, g)
    total = int(qo_indptr[-1])
    q_nope, q_pe = randn((total, 16, CKV), g).bfloat16(), randn((total, 16, KPE), g).bfloat16()
    ckv, kpe = make_cache(num_pages, 16, torch.bfloat16, False, g)
    plan_args = (16, CKV, KPE, 16, True, SM_SCALE, torch.bfloat16, torch.bfloat16)
    wrapper = kernforge.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, *plan_args)
    exact = wrapper.run(q_nope, q_pe, ckv, kpe)
    buffers = (
        with_garbage(qo_indptr, [0, total - 1, -7]),
        with_garbage(kv_indptr, [2**40, 0, -1], torch.int64),
        with_garbage(kv_indices, [num_pages + 100, -3]),
    )
    wrapper.plan(*buffers, kv_lens, *plan_args)
    check(wrapper, (q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens), True)
    assert torch.equal(wrapper.run(q_nope, q_pe, ckv, kpe), exact)


def nope_batch(kv_lens, page_size, dtype, kpe_form, g):
    """A latent cache without a rope part (``kpe_form``: 'empty', a [pages, page_size, 0] tensor of its
    own; 'view', the empty tail of the ckv buffer) filled by append_paged_mla_kv_cache with each
    request's rows: (ckv, kpe, per-request latents as appended, page table)."""
    qo_indptr, kv_indptr, kv_indices, kv_lens, num_pages = make_batch([1] * len(kv_lens), kv_lens, page_size, g)
    ckv = randn((num_pages, page_size, CKV), g).to(dtype)  # unwritten slots hold noise
    kpe = ckv[..., CKV:] if kpe_form == "view" else torch.empty(num_pages, page_size, 0, dtype=dtype)
    latents = [randn((n, CKV), g).to(dtype) for n in kv_lens.tolist()]
    append_indptr = torch.tensor([0, *kv_lens.cumsum(0).tolist()], dtype=torch.int32)
    nnz = int(append_indptr[-1])
    batch_indices, positions = kernforge.get_batch_indices_positions(append_indptr, kv_lens, nnz)
    last_page_len = torch.where(kv_lens > 0, (kv_lens - 1) % page_size + 1, 1).to(torch.int32)
    append_kpe = torch.empty(nnz, 0, dtype=dtype)
    kernforge.append_paged_mla_kv_cache(
        torch.cat(latents), append_kpe, batch_indices, positions, ckv, kpe, kv_indices, kv_indptr, last_page_len
    )
    return ckv, kpe, latents, (qo_indptr, kv_indptr, kv_indices, kv_lens)


@pytest.mark.parametrize("kpe_form", ["empty", "view"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_without_rope_part(tier, workspace, kv_dtype, kpe_form):
    """head_dim_kpe = 0 (FlashInfer's NoPE MLA), end to end: the latents appended with an empty
    append_kpe, then attention over them alone, against the reference over the appended latents (not
    the cache: an append that wrote nothing fails)."""
    g = seeded("nope", kv_dtype, kpe_form)
    kv_lens = [37, 0, 1, 130, 64]
    ckv, kpe, latents, table = nope_batch(kv_lens, 16, kv_dtype, kpe_form, g)
    q_nope = randn((len(kv_lens), 16, CKV), g).bfloat16()
    wrapper = kernforge.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(*table, 16, CKV, 0, 16, False, SM_SCALE, torch.bfloat16, kv_dtype)
    for q_pe in (torch.empty(len(kv_lens), 16, 0, dtype=torch.bfloat16), q_nope[..., CKV:]):
        out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
        for b, latent in enumerate(latents):
            latent = latent.double()[:, None]
            ref_out, ref_lse = attention_reference(q_nope[b : b + 1], latent, latent, sm_scale=SM_SCALE)
            torch.testing.assert_close(out[b : b + 1].double(), ref_out, **OUT_TOL)
            torch.testing.assert_close(lse[b : b + 1].double(), ref_lse, **LSE_TOL)


def test_without_rope_part_traced(workspace):
    """torch.library's traced run (one kernforge::attention_run) takes the empty q_pe and kpe_cache."""
    import kernforge.torch_library as tl

    g = seeded("nope traced")
    ckv, kpe, _, table = nope_batch([20, 45], 16, torch.bfloat16, "empty", g)
    q_nope, q_pe = randn((2, 16, CKV), g).bfloat16(), torch.empty(2, 16, 0, dtype=torch.bfloat16)
    wrapper = tl.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(*table, 16, CKV, 0, 16, False, SM_SCALE, torch.bfloat16, torch.bfloat16)
    compiled = torch.compile(lambda *t: wrapper.run(*t, return_lse=True), backend="eager", fullgraph=True)
    out, lse = compiled(q_nope, q_pe, ckv, kpe)
    eager_out, eager_lse = kernforge.BatchMLAPagedAttentionWrapper.run(wrapper, q_nope, q_pe, ckv, kpe, return_lse=True)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


# --------------------------------------------------------------------------- errors


def planned(workspace, **changes):
    g = seeded("errors")
    qo_indptr, kv_indptr, kv_indices, kv_lens, num_pages = make_batch([1, 1], [20, 5], 16, g)
    args = dict(
        qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_lens, num_heads=4,
        head_dim_ckv=CKV, head_dim_kpe=KPE, page_size=16, causal=False, sm_scale=SM_SCALE,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )  # fmt: skip
    args.update(changes)
    wrapper = kernforge.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(**args)
    q_nope, q_pe = randn((2, 4, CKV), g).bfloat16(), randn((2, 4, KPE), g).bfloat16()
    return wrapper, q_nope, q_pe, make_cache(num_pages, 16, torch.bfloat16, True, g)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"kv_len_arr": torch.tensor([40, 5], dtype=torch.int32)}, r"kv_len_arr\[0\] = 40 needs 3 pages"),
        ({"kv_len_arr": torch.tensor([-1, 5], dtype=torch.int32)}, "kv_len_arr must be >= 0"),
        ({"kv_indptr": torch.tensor([0, 2], dtype=torch.int32)}, r"kv_indptr must be 1-D with at least 3 entries"),
        ({"qo_indptr": torch.tensor([0, 1], dtype=torch.int32)}, r"qo_indptr must be 1-D with at least 3 entries"),
        ({"kv_indptr": torch.tensor([[0, 1, 2]], dtype=torch.int32)}, r"kv_indptr must be 1-D"),
        ({"kv_indptr": torch.tensor([0.0, 1.0, 2.0])}, "kv_indptr has dtype torch.float32"),
        ({"kv_len_arr": torch.tensor([[20, 5]], dtype=torch.int32)}, "kv_len_arr must be 1-D"),
        ({"head_dim_kpe": -1}, r"head_dim_kpe must be an int >= 0"),
        ({"kv_indptr": torch.tensor([1, 2, 3], dtype=torch.int32)}, "kv_indptr must start at 0"),
        ({"kv_indices": torch.tensor([0, 1, -4], dtype=torch.int32)}, "kv_indices holds a negative page"),
        ({"num_heads": 0}, "num_heads"),
        ({"head_dim_ckv": 1024}, "head_dim_ckv 1024 \\+ head_dim_kpe 64"),
        ({"head_dim_kpe": 128}, "head_dim_ckv <= 512 and head_dim_ckv \\+ head_dim_kpe <= 576"),
        ({"sm_scale": None}, "sm_scale"),
        ({"kv_data_type": torch.int8}, "kv_data_type"),
    ],
)
def test_plan_errors(workspace, changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        planned(workspace, **changes)


def test_run_errors_write_nothing(workspace):
    wrapper, q_nope, q_pe, (ckv, kpe) = planned(workspace)
    out = torch.full((2, 4, CKV), 3.0, dtype=torch.bfloat16)
    bad_runs = [
        ((q_nope[:, :3], q_pe, ckv, kpe), "q_nope must have shape"),
        ((q_nope.float(), q_pe, ckv, kpe), "dtype of q_nope"),
        ((q_nope, q_pe, ckv.float(), kpe.float()), "dtype of ckv_cache"),
        ((q_nope, q_pe, ckv, kpe[..., :32]), "kpe_cache has head_dim 32"),
        ((q_nope, q_pe, ckv, kpe.float()), "must match"),
        ((q_nope, q_pe, ckv[:1], kpe[:1]), "beyond ckv_cache's 1 pages"),
        ((q_nope, q_pe, ckv[:, :8], kpe[:, :8]), "page_size 8"),
        ((q_nope, q_pe, ckv[0], kpe), "3-D"),
    ]
    for args, match in bad_runs:
        with pytest.raises((ValueError, TypeError), match=match):
            wrapper.run(*args, out=out)
    assert bool((out == 3.0).all())
    with pytest.raises(PlanStateError):
        kernforge.BatchMLAPagedAttentionWrapper(workspace).run(q_nope, q_pe, ckv, kpe)
    with pytest.raises(NotImplementedError):
        kernforge.BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True)


# --------------------------------------------------------------------------- append


@pytest.mark.parametrize("adjacent", [True, False], ids=["one-buffer", "two-tensors"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_append_writes_the_slots(tier, adjacent, dtype):
    g = seeded("append", adjacent, dtype)
    page_size = 4
    _, kv_indptr, kv_indices, kv_lens, num_pages = make_batch([1, 1, 1], [6, 0, 9], page_size, g)
    last_page_len = torch.tensor([2, 1, 1], dtype=torch.int32)
    ckv, kpe = make_cache(num_pages, page_size, dtype, adjacent, g)
    before_ckv, before_kpe = ckv.clone(), kpe.clone()
    batch_indices = torch.tensor([2, 0, 2, 0], dtype=torch.int32)
    positions = torch.tensor([8, 5, 0, 1], dtype=torch.int32)
    new_ckv, new_kpe = randn((4, CKV), g).to(dtype), randn((4, KPE), g).to(dtype)
    kernforge.append_paged_mla_kv_cache(
        new_ckv, new_kpe, batch_indices, positions, ckv, kpe, kv_indices, kv_indptr, last_page_len
    )
    expected_ckv, expected_kpe = before_ckv.clone(), before_kpe.clone()
    for i in range(4):
        b, pos = int(batch_indices[i]), int(positions[i])
        page = int(kv_indices[int(kv_indptr[b]) + pos // page_size])
        expected_ckv[page, pos % page_size] = new_ckv[i]
        expected_kpe[page, pos % page_size] = new_kpe[i]
    assert torch.equal(ckv.view(torch.uint8), expected_ckv.view(torch.uint8))
    assert torch.equal(kpe.view(torch.uint8), expected_kpe.view(torch.uint8))


def test_append_errors_write_nothing():
    g = seeded("append-errors")
    _, kv_indptr, kv_indices, _, num_pages = make_batch([1], [8], 4, g)
    ckv, kpe = make_cache(num_pages, 4, torch.bfloat16, True, g)
    before = ckv.clone(), kpe.clone()
    rows = randn((2, CKV), g).bfloat16(), randn((2, KPE), g).bfloat16()
    last = torch.tensor([4], dtype=torch.int32)
    cases = [
        ((*rows, torch.tensor([0, 1]), torch.tensor([0, 1])), r"batch_indices\[1\] = 1 is out of range"),
        ((*rows, torch.tensor([0, 0]), torch.tensor([0, 8])), r"positions\[1\] = 8 is beyond the pages"),
        ((rows[0], rows[1][:1], torch.tensor([0, 0]), torch.tensor([0, 1])), "append_kpe has 1 tokens"),
        ((rows[0][:, :100], rows[1], torch.tensor([0, 0]), torch.tensor([0, 1])), r"append_ckv must be \[nnz, 512\]"),
        ((rows[0].float(), rows[1], torch.tensor([0, 0]), torch.tensor([0, 1])), "append_ckv has dtype"),
    ]
    for (c, k, b, p), match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            kernforge.append_paged_mla_kv_cache(c, k, b, p, ckv, kpe, kv_indices, kv_indptr, last)
    assert torch.equal(ckv, before[0]) and torch.equal(kpe, before[1])
