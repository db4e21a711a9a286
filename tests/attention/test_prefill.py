"""Tests for prefill attention: ``BatchPrefillWithPagedKVCacheWrapper``,
``BatchPrefillWithRaggedKVCacheWrapper`` and ``single_prefill_with_kv_cache``.

The reference is plain PyTorch in float64, request by request (``references.attention_reference``),
with the mask built explicitly: causal bottom-right (query i of a request with qo_len queries and
kv_len keys sees keys j <= kv_len - qo_len + i), a custom mask instead of the causal one when given,
window_left w keeping j >= kv_len - qo_len + i - w, soft cap ``cap * tanh(x / cap)``; LSE is base 2
(``log2(e) * logsumexp``); a query that sees no key gives zeros and -inf. It sees the same rounded
inputs as the kernel (fp8 KV dequantized exactly), so only the kernel's arithmetic differs: out
within the tolerance of the coarsest dtype (bf16 1e-2, fp16 1e-3, fp32 1e-5), cosine > 0.9999, LSE
to 1e-3.

Variants are keyed by (q, KV, out dtype, head dims, tile, tier); the scenario matrix runs on a few,
the geometry tests (head dims 64/128/256 and MLA's 192/128, GQA 1/4/8, every tile the tuner may
pick) on one shape each, and test_any_head_dim runs head dims that are no whole vector (1, 13, 33,
55, 72, 200, 33/17) once per dtype path, on q/k/v/out that end at an inaccessible page. Every test
runs on the best ISA tier and a slice on the lower ones.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import shutil
import subprocess

import pytest
import torch

import kernforge
from kernforge.cache import disk
from kernforge.jit import core
from kernforge.jit.module import Entry, Module
from kernforge.ops.attention import prefill
from kernforge.ops.attention.decode import PlanStateError

from op_helpers import seeded
from references import attention_reference

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
MIN_COSINE = 0.9999
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(16 << 20, dtype=torch.uint8)


def rand(shape, dtype, g):
    x = torch.randn(shape, generator=g)
    return x.to(dtype)


def check(out, lse, ref_out, ref_lse, dtype, what="", v_scale=1.0):
    """``v_scale`` scales the absolute tolerance with the output (the errors of P rounded to bf16
    are relative to the V rows they weigh)."""
    tol = TOL[dtype]
    torch.testing.assert_close(
        out.double(), ref_out, atol=tol * max(1.0, v_scale), rtol=tol, msg=lambda m: f"{what}\n{m}"
    )
    if ref_out.numel() and ref_out.abs().max() > 0:
        cosine = torch.nn.functional.cosine_similarity(out.double().flatten(), ref_out.flatten(), dim=0)
        assert cosine > MIN_COSINE, f"{what}: cosine {cosine}"
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), f"{what}: -inf LSE where no key is visible"
        torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-3, rtol=1e-3)


def guarded(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that ends where an inaccessible page begins: a kernel reading or writing one
    byte past its last row faults (the last page of a cache may be the last bytes of a mapping)."""
    nbytes, page = t.numel() * t.element_size(), mmap.PAGESIZE
    size = -(-nbytes // page) * page + page
    raw = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # the tensor keeps the mapping alive
    guard = ctypes.c_void_p(raw.data_ptr() + size - page)
    assert ctypes.CDLL(None).mprotect(guard, ctypes.c_size_t(page), 0) == 0, "mprotect(PROT_NONE) failed"
    return raw[size - page - nbytes : size - page].view(t.dtype).view(t.shape).copy_(t)


def indptr_of(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0)), dtype=torch.int32)


def check_ragged(out, lse, q, k, v, qo_indptr, kv_indptr, dtype, what="", **ref_kwargs):
    """Each request of a ragged batch (k/v NHD) against the reference; ``lse`` may be None."""
    for b in range(qo_indptr.numel() - 1):
        rq, rk = (slice(int(p[b]), int(p[b + 1])) for p in (qo_indptr, kv_indptr))
        ref_out, ref_lse = attention_reference(q[rq], k[rk], v[rk], **ref_kwargs)
        check(out[rq], None if lse is None else lse[rq], ref_out, ref_lse, dtype, f"{what} request {b}")


# --------------------------------------------------------------------------- paged batches


def paged_batch(qo_lens, kv_lens, num_kv_heads, head_dim, page_size, layout, kv_dtype, g):
    """A cache with each request's pages drawn from a shuffled pool, plus two unused pages."""
    counts = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(counts) + 2
    pool = torch.randperm(num_pages, generator=g).to(torch.int32)
    indptr = indptr_of(counts)
    indices = pool[: sum(counts)].clone()
    last = torch.tensor([(n - 1) % page_size + 1 if n else 1 for n in kv_lens], dtype=torch.int32)
    shape = (
        (num_pages, 2, page_size, num_kv_heads, head_dim)
        if layout == "NHD"
        else (num_pages, 2, num_kv_heads, page_size, head_dim)
    )
    cache = rand(shape, kv_dtype, g)
    qo_indptr = indptr_of(qo_lens)
    return cache, qo_indptr, indptr, indices, last


def gather(cache, indptr, indices, kv_len, b, layout, which):
    pages = cache[indices[indptr[b] : indptr[b + 1]].long(), which]
    if layout == "HND":
        pages = pages.transpose(1, 2)
    return pages.reshape(-1, *pages.shape[2:])[:kv_len]


def run_paged(
    workspace,
    qo_lens,
    kv_lens,
    *,
    q_dtype=torch.bfloat16,
    kv_dtype=None,
    num_qo_heads=8,
    num_kv_heads=2,
    head_dim=128,
    page_size=16,
    layout="NHD",
    causal=True,
    window_left=-1,
    soft_cap=None,
    custom=None,
    packed=None,
    g=None,
    return_lse=True,
    disable_split_kv=False,
    **run_kwargs,
):
    kv_dtype = kv_dtype or q_dtype
    g = g or seeded(tuple(qo_lens), tuple(kv_lens), str(q_dtype), page_size, layout)
    cache, qo_indptr, indptr, indices, last = paged_batch(
        qo_lens, kv_lens, num_kv_heads, head_dim, page_size, layout, kv_dtype, g
    )
    q = rand((sum(qo_lens), num_qo_heads, head_dim), q_dtype, g)
    wrapper = kernforge.BatchPrefillWithPagedKVCacheWrapper(workspace, layout)
    wrapper.plan(
        qo_indptr,
        indptr,
        indices,
        last,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        causal=causal,
        window_left=window_left,
        logits_soft_cap=soft_cap,
        custom_mask=custom,
        packed_custom_mask=packed,
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
        disable_split_kv=disable_split_kv,
    )
    result = wrapper.run(q, cache, return_lse=return_lse, **run_kwargs)
    return wrapper, q, cache, (qo_indptr, indptr, indices), result


def check_paged(q, cache, indices, result, qo_lens, kv_lens, layout, dtype, masks=None, **ref_kwargs):
    v_scale = ref_kwargs.get("v_scale", 1.0)
    qo_indptr, indptr, pages = indices
    out, lse = result
    for b, (qo_len, kv_len) in enumerate(zip(qo_lens, kv_lens)):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        k = gather(cache, indptr, pages, kv_len, b, layout, 0)
        v = gather(cache, indptr, pages, kv_len, b, layout, 1)
        mask = None if masks is None else masks[b]
        ref_out, ref_lse = attention_reference(q[rows], k, v, mask=mask, **ref_kwargs)
        check(out[rows], lse[rows], ref_out, ref_lse, dtype, f"request {b} (qo {qo_len}, kv {kv_len})", v_scale)


# The pairs in one batch, with an empty request (qo_len 0) among them.
QO_LENS, KV_LENS = [1, 1, 17, 0, 100, 1023], [1, 4097, 17, 9, 1000, 1023]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_batch_matches_reference(tier, workspace, page_size, layout, causal):
    _, q, cache, indices, result = run_paged(
        workspace, QO_LENS, KV_LENS, num_qo_heads=4, num_kv_heads=1, page_size=page_size, layout=layout, causal=causal
    )
    check_paged(q, cache, indices, result, QO_LENS, KV_LENS, layout, torch.bfloat16, causal=causal)


@pytest.mark.parametrize(
    "q_dtype,kv_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, FP8), (torch.float16, FP8)],
)
def test_paged_dtypes(tier, workspace, q_dtype, kv_dtype):
    qo, kv = [3, 40, 65], [3, 90, 65]
    _, q, cache, indices, result = run_paged(workspace, qo, kv, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=5)
    dtype = (
        torch.bfloat16
        if torch.bfloat16 in (q_dtype, kv_dtype) or kv_dtype == FP8 and q_dtype == torch.bfloat16
        else q_dtype
    )
    check_paged(q, cache, indices, result, qo, kv, "NHD", dtype, causal=True)


def with_garbage(t, garbage):
    """``t`` at the start of a longer buffer (one preallocated for a larger batch), the rest garbage."""
    return torch.cat([t, torch.tensor(garbage, dtype=t.dtype)])


def test_paged_table_buffers_longer_than_the_batch(tier, workspace):
    """As in FlashInfer, the batch is qo_indptr's: paged_kv_indptr and paged_kv_last_page_len may be
    buffers of a larger batch (paired, indptr one entry longer), paged_kv_indices too; only the
    batch's entries are read and checked, so their garbage (decreasing, past the indices, negative,
    out of [1, page_size]) changes nothing."""
    qo, kv = [3, 1, 40], [30, 0, 77]
    g = seeded("paged buffers longer than the batch")
    cache, qo_indptr, indptr, indices, last = paged_batch(qo, kv, 2, 128, 16, "NHD", torch.bfloat16, g)
    q = rand((sum(qo), 8, 128), torch.bfloat16, g)
    wrapper = kernforge.BatchPrefillWithPagedKVCacheWrapper(workspace)
    shape = dict(num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, page_size=16, causal=True, q_data_type=torch.bfloat16)
    wrapper.plan(qo_indptr, indptr, indices, last, **shape)
    exact = wrapper.run(q, cache, return_lse=True)
    buffers = with_garbage(indptr, [0, 10**6, -5]), with_garbage(indices, [-1, 10**6]), with_garbage(last, [0, 999, -1])
    wrapper.plan(qo_indptr, *buffers, **shape)
    result = wrapper.run(q, cache, return_lse=True)
    check_paged(q, cache, (qo_indptr, indptr, indices), result, qo, kv, "NHD", torch.bfloat16, causal=True)
    assert torch.equal(result[0], exact[0]) and torch.equal(result[1], exact[1])


def test_ragged_kv_indptr_has_the_batch_length(workspace):
    """FlashInfer's ragged plan wants kv_indptr exactly as long as qo_indptr."""
    wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    for kv_indptr in ([0, 5, 0], [0]):
        with pytest.raises(ValueError, match=r"kv_indptr must be 1-D with 2 entries \(len\(qo_indptr\)\)"):
            wrapper.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor(kv_indptr, dtype=torch.int32), 4, 2, 64)


def test_fp8_scales(tier, workspace):
    qo, kv = [7, 33], [20, 33]
    _, q, cache, indices, result = run_paged(workspace, qo, kv, kv_dtype=FP8, k_scale=0.5, v_scale=2.0)
    check_paged(
        q,
        cache,
        indices,
        result,
        qo,
        kv,
        "NHD",
        torch.bfloat16,
        causal=True,
        sm_scale=0.5 / math.sqrt(128),
        v_scale=2.0,
    )


@pytest.mark.parametrize("window_left,soft_cap", [(0, None), (37, None), (200, 30.0), (-1, 5.0)])
def test_window_and_soft_cap(tier, workspace, window_left, soft_cap):
    qo, kv = [50, 1, 130], [300, 64, 130]
    _, q, cache, indices, result = run_paged(workspace, qo, kv, window_left=window_left, soft_cap=soft_cap)
    check_paged(
        q,
        cache,
        indices,
        result,
        qo,
        kv,
        "NHD",
        torch.bfloat16,
        causal=True,
        window_left=window_left,
        soft_cap=soft_cap or 0.0,
    )


def random_masks(qo, kv, g):
    return [torch.rand(a, b, generator=g) < 0.7 for a, b in zip(qo, kv)]


def segment_packbits(masks):
    """FlashInfer's segment_packbits, little bit order: each request from a byte boundary."""
    packed = []
    for m in masks:
        bits = m.reshape(-1).to(torch.uint8)
        bits = torch.cat([bits, bits.new_zeros(-len(bits) % 8)])
        packed.append((bits.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1).to(torch.uint8))
    return torch.cat(packed)


@pytest.mark.parametrize("form", ["custom", "packed"])
def test_custom_mask_replaces_causal(tier, workspace, form):
    qo, kv = [5, 70, 3], [9, 70, 80]
    g = seeded("mask", form)
    masks = random_masks(qo, kv, g)
    masks[1][3] = False  # a query that sees no key at all: zeros and -inf
    kwargs = (
        {"custom": torch.cat([m.reshape(-1) for m in masks])}
        if form == "custom"
        else {"packed": segment_packbits(masks)}
    )
    _, q, cache, indices, result = run_paged(workspace, qo, kv, causal=True, g=g, **kwargs)
    check_paged(q, cache, indices, result, qo, kv, "NHD", torch.bfloat16, masks=masks)
    assert torch.equal(result[0][int(indices[0][1]) + 3], torch.zeros_like(result[0][0]))


def check_rows_without_keys(out, lse, rows, what=""):
    """Rows that see no key hold exactly 0 in out and -inf in lse (never NaN)."""
    assert not out.isnan().any() and (lse is None or not lse.isnan().any()), f"{what}: NaN"
    assert torch.equal(out[rows], torch.zeros_like(out[rows])), f"{what}: rows without keys are not 0"
    if lse is not None:
        assert (lse[rows] == -math.inf).all(), f"{what}: rows without keys have LSE {lse[rows]}"


def keyless_causal_rows(qo_lens, kv_lens):
    """Token indices of the queries that causal attention leaves without a key (qo_len > kv_len)."""
    rows, start = [], 0
    for qo_len, kv_len in zip(qo_lens, kv_lens):
        rows += range(start, start + max(0, qo_len - kv_len))
        start += qo_len
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("threads_setting", [1, 2, 8])
@pytest.mark.parametrize("disable_split_kv", [False, True])
@pytest.mark.parametrize(
    "q_dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8), (torch.float16, torch.float16)]
)
@pytest.mark.parametrize("qo,kv", [([34], [1]), ([34, 5, 3], [1, 300, 0])], ids=["flashinfer", "mixed"])
def test_causal_rows_without_keys(tier, workspace, qo, kv, q_dtype, kv_dtype, disable_split_kv, threads_setting):
    """FlashInfer's test_paged_prefill_fully_masked_rows (its issue #4452): causal with qo_len 34 >
    kv_len 1, page_size 16: the first 33 rows give 0 and LSE -inf, the last attends normally; and the
    same beside an ordinary request and one with no keys at all. A tile is split along the KV when
    the batch has fewer tiles than threads or the tile outweighs a thread's share of the batch, and
    it has at least two blocks per piece: with 2 or 8 threads the mixed batch's 300-key tile is
    (most of the batch's work), unless disable_split_kv."""
    try:
        kernforge.set_num_threads(threads_setting)
        wrapper, q, cache, indices, result = run_paged(
            workspace,
            qo,
            kv,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            num_qo_heads=4,
            num_kv_heads=1,
            disable_split_kv=disable_split_kv,
        )
    finally:
        kernforge.set_num_threads(None)
    split = threads_setting > 1 and not disable_split_kv and len(qo) > 1
    assert (wrapper._plan.args.num_merges > 0) == split
    dtype = torch.bfloat16 if torch.bfloat16 in (q_dtype, kv_dtype) else q_dtype
    check_paged(q, cache, indices, result, qo, kv, "NHD", dtype, causal=True)
    check_rows_without_keys(*result, keyless_causal_rows(qo, kv), "causal qo_len > kv_len")
    assert torch.isfinite(result[1][33]).all() and result[0][33].abs().sum() > 0


@pytest.mark.parametrize("threads_setting", [2, 5])
def test_split_kv_rows_without_keys(tier, workspace, threads_setting):
    """A tile split along the KV whose custom mask leaves rows without any key (in every piece: the
    merge of empty states is empty) or without keys in some pieces (weight 0 in the merge)."""
    qo, kv = [16], [1100]  # one tile for every tile size: split across the threads
    g = seeded("split-empty", threads_setting)
    masks = random_masks(qo, kv, g)
    masks[0][3] = False  # no key at all
    masks[0][7, :600] = False  # none in the first pieces
    masks[0][9, 200:] = False  # none in the last pieces
    try:
        kernforge.set_num_threads(threads_setting)
        wrapper, q, cache, indices, result = run_paged(
            workspace, qo, kv, num_qo_heads=2, num_kv_heads=1, g=g, custom=masks[0].reshape(-1)
        )
    finally:
        kernforge.set_num_threads(None)
    assert wrapper._plan.args.num_merges > 0, "the tile was not split"
    check_paged(q, cache, indices, result, qo, kv, "NHD", torch.bfloat16, masks=masks)
    check_rows_without_keys(*result, torch.tensor([3]), "split, masked row")


def test_ragged_and_single_rows_without_keys(tier, workspace):
    """Causal qo_len > kv_len (and a request with no keys) over ragged K/V and in single prefill."""
    qo, kv = [50, 3, 20], [20, 0, 20]
    g = seeded("ragged-empty")
    q = rand((sum(qo), 4, 64), torch.float16, g)
    k, v = (rand((sum(kv), 2, 64), torch.float16, g) for _ in range(2))
    qo_indptr, kv_indptr = indptr_of(qo), indptr_of(kv)
    wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(qo_indptr, kv_indptr, 4, 2, 64, causal=True, q_data_type=torch.float16)
    out, lse = wrapper.run_return_lse(q, k, v)
    check_ragged(out, lse, q, k, v, qo_indptr, kv_indptr, torch.float16, causal=True)
    check_rows_without_keys(out, lse, keyless_causal_rows(qo, kv), "ragged")
    out, lse = kernforge.single_prefill_with_kv_cache(q[:50], k[:20], v[:20], causal=True, return_lse=True)
    check(out, lse, *attention_reference(q[:50], k[:20], v[:20], causal=True), torch.float16, "single")
    check_rows_without_keys(out, lse, torch.arange(30), "single")


def test_qo_len_one_matches_decode(tier, workspace):
    lengths = [1, 77, 300]
    wrapper, q, cache, indices, (out, lse) = run_paged(workspace, [1, 1, 1], lengths)
    decode = kernforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8))
    decode.plan(
        indices[1],
        indices[2],
        torch.tensor([(n - 1) % 16 + 1 for n in lengths], dtype=torch.int32),
        8,
        2,
        128,
        16,
        q_data_type=torch.bfloat16,
    )
    d_out, d_lse = decode.run(q, cache, return_lse=True)
    torch.testing.assert_close(out.float(), d_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, d_lse, atol=1e-3, rtol=1e-3)


def test_masked_blocks_are_skipped(workspace):
    """Causal attention visits only key blocks some query of the tile sees: for one request of
    L = 640 queries, tiles of 16 queries (64 rows, GQA 4) and blocks of 64 keys, tile t visits
    blocks 0 .. (16t + 15) // 64, against all 10 without the mask."""
    length, tile = 640, (64, 64)
    qo_indptr = kv_indptr = torch.tensor([0, length], dtype=torch.int32)
    g = seeded("skip")
    q, k, v = (rand((length, h, 64), torch.bfloat16, g) for h in (4, 1, 1))
    counts = {}
    for causal in (True, False):
        wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        wrapper.plan_with_tile(qo_indptr, kv_indptr, 4, 1, 64, tile, causal=causal)
        out = wrapper.run(q, k, v)
        counts[causal] = wrapper.computed_blocks()
        check(out, None, attention_reference(q, k, v, causal=causal)[0], None, torch.bfloat16, f"causal={causal}")
    tiles = length // 16
    assert counts[False] == tiles * (length // 64)
    assert counts[True] == sum((16 * t + 15) // 64 + 1 for t in range(tiles))


def test_keyless_tiles_visit_no_block(workspace):
    """Causal with qo_len 640 > kv_len 100: a tile whose last query sees no key visits no block (and
    writes zeros, LSE -inf); the others visit the blocks up to their last query's last key."""
    qo_len, kv_len, tile = 640, 100, (64, 64)
    g = seeded("skip-keyless")
    q, k, v = (
        rand((qo_len, 4, 64), torch.bfloat16, g),
        rand((kv_len, 1, 64), torch.bfloat16, g),
        rand((kv_len, 1, 64), torch.bfloat16, g),
    )
    wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan_with_tile(
        torch.tensor([0, qo_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32), 4, 1, 64, tile
    )
    out, lse = wrapper.run_return_lse(q, k, v)
    check(out, lse, *attention_reference(q, k, v, causal=True), torch.bfloat16)
    check_rows_without_keys(out, lse, keyless_causal_rows([qo_len], [kv_len]))
    last_keys = [min(kv_len, kv_len - qo_len + 16 * t + 16) for t in range(qo_len // 16)]  # hi of each last query
    assert wrapper.computed_blocks() == sum(-(-hi // 64) for hi in last_keys if hi > 0)


# --------------------------------------------------------------------------- ragged and single


@pytest.mark.parametrize(
    "head_dim_qk,head_dim_vo,num_qo_heads,num_kv_heads",
    [
        (64, 64, 8, 8),
        (128, 128, 8, 1),
        (256, 256, 4, 1),
        (192, 128, 16, 2),
        (128, 128, 16, 2),
    ],
)
def test_ragged_geometries(tier, workspace, head_dim_qk, head_dim_vo, num_qo_heads, num_kv_heads):
    qo, kv = [1, 33, 0, 64], [40, 33, 5, 100]
    g = seeded("ragged", head_dim_qk, head_dim_vo, num_qo_heads, num_kv_heads)
    q = rand((sum(qo), num_qo_heads, head_dim_qk), torch.bfloat16, g)
    k = rand((sum(kv), num_kv_heads, head_dim_qk), torch.bfloat16, g)
    v = rand((sum(kv), num_kv_heads, head_dim_vo), torch.bfloat16, g)
    qo_indptr, kv_indptr = indptr_of(qo), indptr_of(kv)
    wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(
        qo_indptr,
        kv_indptr,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        head_dim_vo,
        causal=True,
        q_data_type=torch.bfloat16,
    )
    out, lse = wrapper.run_return_lse(q, k, v)
    assert out.shape == (sum(qo), num_qo_heads, head_dim_vo) and lse.shape == (sum(qo), num_qo_heads)
    check_ragged(out, lse, q, k, v, qo_indptr, kv_indptr, torch.bfloat16, causal=True)


# (head_dim_qk, head_dim_vo, q dtype, KV dtype): dims that are no whole vector (nor pair) for each path
# of the kernel (bf16 pairs, fp8 widened, fp32 for fp16/fp32), MLA's 192/128 among them.
ANY_HEAD_DIMS = [
    (1, 1, torch.bfloat16, torch.bfloat16),
    (13, 13, torch.float16, torch.float16),
    (33, 33, torch.float32, torch.float32),
    (55, 55, torch.bfloat16, FP8),
    (72, 72, torch.bfloat16, torch.bfloat16),
    (200, 200, torch.float16, torch.float16),
    (33, 17, torch.bfloat16, torch.bfloat16),
    (33, 17, torch.float32, torch.float32),
    (192, 128, torch.float16, torch.float16),
]


@pytest.mark.parametrize(
    "head_dim_qk,head_dim_vo,q_dtype,kv_dtype",
    ANY_HEAD_DIMS,
    ids=[f"{qk}-{vo}-{str(q).split('.')[1]}-{str(kv).split('.')[1]}" for qk, vo, q, kv in ANY_HEAD_DIMS],
)
def test_any_head_dim(tier, workspace, head_dim_qk, head_dim_vo, q_dtype, kv_dtype):
    """Paged (where K and V share a head_dim), ragged and single prefill at any head dim, NHD and
    HND, causal or not, GQA 3, against the reference: the kernel pads its own packed copies and
    never reads past a q, k or v row nor writes past an out row (the ragged tensors end at a guard page)."""
    qo, kv = [1, 37, 0, 20, 9], [5, 80, 3, 20, 4]
    g = seeded("head dims", head_dim_qk, head_dim_vo, str(q_dtype), str(kv_dtype))
    dtype = torch.bfloat16 if torch.bfloat16 in (q_dtype, kv_dtype) else q_dtype
    q = rand((sum(qo), 6, head_dim_qk), q_dtype, g)
    k, v = (rand((sum(kv), 2, d), kv_dtype, g) for d in (head_dim_qk, head_dim_vo))
    qo_indptr, kv_indptr = indptr_of(qo), indptr_of(kv)
    for layout in ("NHD", "HND"):
        kk, vv = (guarded(t.transpose(0, 1) if layout == "HND" else t) for t in (k, v))
        for causal in (True, False):
            what = f"{layout}, causal={causal}"
            if head_dim_qk == head_dim_vo:
                _, pq, cache, indices, result = run_paged(
                    workspace,
                    qo,
                    kv,
                    q_dtype=q_dtype,
                    kv_dtype=kv_dtype,
                    num_qo_heads=6,
                    num_kv_heads=2,
                    head_dim=head_dim_qk,
                    page_size=7,
                    layout=layout,
                    causal=causal,
                    g=g,
                )
                check_paged(pq, cache, indices, result, qo, kv, layout, dtype, causal=causal)
            wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace, layout)
            wrapper.plan(
                qo_indptr,
                kv_indptr,
                6,
                2,
                head_dim_qk,
                head_dim_vo,
                causal=causal,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
            out, lse = wrapper.run(
                guarded(q),
                kk,
                vv,
                out=guarded(torch.empty(sum(qo), 6, head_dim_vo, dtype=q_dtype)),
                lse=guarded(torch.empty(sum(qo), 6)),
                return_lse=True,
            )
            check_ragged(out, lse, q, k, v, qo_indptr, kv_indptr, dtype, f"ragged {what}", causal=causal)
            rq, rk = slice(qo_indptr[-2], None), slice(kv_indptr[-2], None)  # the last request: at the guard
            out, lse = kernforge.single_prefill_with_kv_cache(
                guarded(q)[rq],
                kk[:, rk] if layout == "HND" else kk[rk],
                vv[:, rk] if layout == "HND" else vv[rk],
                causal=causal,
                kv_layout=layout,
                return_lse=True,
            )
            check(out, lse, *attention_reference(q[rq], k[rk], v[rk], causal=causal), dtype, f"single {what}")


def test_head_dim_one_q_of_any_last_stride(workspace):
    """A head_dim of one element is contiguous whatever its stride: run() takes such a q (torch gives an
    empty [0, 1, 1] tensor strides (1, 0, 0) after arithmetic; the fuzzer's single_prefill_with_kv_cache
    case, refused as "q must be contiguous in head_dim" before)."""
    g = seeded("head_dim 1 strides")
    k, v = rand((9, 1, 1), torch.bfloat16, g), rand((9, 1, 1), torch.bfloat16, g)
    q = rand((4, 2, 2), torch.bfloat16, g)[..., ::2]  # [4, 2, 1], last stride 2
    out, lse = kernforge.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    check(out, lse, *attention_reference(q, k, v, causal=True), torch.bfloat16)
    empty = torch.empty(0, dtype=torch.bfloat16).as_strided((0, 1, 1), (1, 0, 0))
    out, lse = kernforge.single_prefill_with_kv_cache(empty, k, v, return_lse=True)
    assert out.shape == (0, 1, 1) and lse.shape == (0, 1)
    wrapper = kernforge.BatchPrefillWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr_of([4]), indptr_of([9]), torch.arange(9, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                 2, 1, 1, 1, causal=True, q_data_type=torch.bfloat16)  # fmt: skip
    out = wrapper.run(q, torch.stack([k, v], 1))  # pages of one token: [9, 2, 1, 1, 1]
    check(out, None, attention_reference(q, k, v, causal=True)[0], None, torch.bfloat16)


@pytest.mark.parametrize("tile", prefill.TILES)
def test_every_tile(tier, workspace, tile):
    """Each tile the tuner may pick, on a batch with partial tiles and blocks."""
    qo, kv = [70, 5], [200, 5]
    g = seeded("tile", tile)
    q = rand((sum(qo), 12, 64), torch.bfloat16, g)
    k, v = (rand((sum(kv), 4, 64), torch.bfloat16, g) for _ in range(2))
    qo_indptr = torch.tensor([0, 70, 75], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 200, 205], dtype=torch.int32)
    wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan_with_tile(qo_indptr, kv_indptr, 12, 4, 64, tile)
    out = wrapper.run(q, k, v)
    check_ragged(out, None, q, k, v, qo_indptr, kv_indptr, torch.bfloat16, f"tile {tile}", causal=True)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_single_prefill(tier, layout, dtype):
    g = seeded("single", layout, str(dtype))
    q = rand((31, 4, 128), dtype, g)
    k, v = (rand((47, 2, 128), dtype, g) for _ in range(2))
    kk, vv = (t.transpose(0, 1).contiguous() if layout == "HND" else t for t in (k, v))
    out, lse = kernforge.single_prefill_with_kv_cache(q, kk, vv, causal=True, kv_layout=layout, return_lse=True)
    check(out, lse, *attention_reference(q, k, v, causal=True), dtype)
    mask = torch.rand(31, 47, generator=g) < 0.5
    out = kernforge.single_prefill_with_kv_cache(q, kk, vv, custom_mask=mask, kv_layout=layout)
    check(out, None, attention_reference(q, k, v, mask=mask)[0], None, dtype)


def test_strided_q_out_lse(tier, workspace):
    """q as a view of a fused qkv buffer, out and lse into wider buffers: written in place."""
    g = seeded("strided")
    qkv = rand((40, 8 + 2 + 2, 64), torch.bfloat16, g)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    out_buffer = torch.full((40, 10, 64), 7.0, dtype=torch.bfloat16)
    lse_buffer = torch.full((40, 9), 7.0)
    wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    indptr = torch.tensor([0, 40], dtype=torch.int32)
    wrapper.plan(indptr, indptr, 8, 2, 64, causal=True, q_data_type=torch.bfloat16)
    out, lse = wrapper.run(q, k, v, out=out_buffer[:, 1:9], lse=lse_buffer[:, :8], return_lse=True)
    check(out, lse, *attention_reference(q, k, v, causal=True), torch.bfloat16)
    assert (out_buffer[:, [0, 9]] == 7).all() and (lse_buffer[:, 8] == 7).all()


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_lse_buffer_without_return_lse(tier, workspace, kind):
    """run(..., out=o, lse=buf) without return_lse fills buf as FlashInfer does, with the values
    return_lse=True gives (-inf for the rows that see no key)."""
    qo, kv = [5, 40], [60, 20]
    out_buffer = torch.empty(sum(qo), 8, 64, dtype=torch.bfloat16)
    lse_buffer = torch.full((sum(qo), 8), math.nan)
    if kind == "paged":
        wrapper, q, cache, indices, returned = run_paged(
            workspace, qo, kv, head_dim=64, return_lse=False, out=out_buffer, lse=lse_buffer
        )
        args = (q, cache)
    else:
        g = seeded("lse buffer")
        q = rand((sum(qo), 8, 64), torch.bfloat16, g)
        k, v = (rand((sum(kv), 2, 64), torch.bfloat16, g) for _ in range(2))
        wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        wrapper.plan(indptr_of(qo), indptr_of(kv), 8, 2, 64, causal=True, q_data_type=torch.bfloat16)
        args = (q, k, v)
        returned = wrapper.run(*args, out=out_buffer, lse=lse_buffer)
    assert returned is out_buffer
    out, lse = wrapper.run(*args, return_lse=True)
    assert torch.equal(lse_buffer, lse) and torch.equal(out_buffer, out)
    keyless = keyless_causal_rows(qo, kv)  # tokens 5 .. 24
    assert (lse_buffer[keyless] == -math.inf).all() and torch.isfinite(lse_buffer).sum() == (sum(qo) - 20) * 8


# --------------------------------------------------------------------------- errors


def plan_paged(workspace, **overrides):
    args = dict(
        qo_indptr=torch.tensor([0, 4, 9], dtype=torch.int32),
        paged_kv_indptr=torch.tensor([0, 1, 2], dtype=torch.int32),
        paged_kv_indices=torch.tensor([1, 0], dtype=torch.int32),
        paged_kv_last_page_len=torch.tensor([4, 9], dtype=torch.int32),
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim_qk=64,
        page_size=16,
        causal=True,
        q_data_type=torch.bfloat16,
    )
    args.update(overrides)
    wrapper = kernforge.BatchPrefillWithPagedKVCacheWrapper(workspace)
    wrapper.plan(**args)
    return wrapper


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"paged_kv_indptr": torch.tensor([0, 2], dtype=torch.int32)}, "paged_kv_indptr must be 1-D with at least 3"),
        (
            {"paged_kv_last_page_len": torch.tensor([4], dtype=torch.int32)},
            "paged_kv_last_page_len must be 1-D with at least 2",
        ),
        ({"paged_kv_indptr": torch.tensor([[0, 1, 2]], dtype=torch.int32)}, "paged_kv_indptr must be 1-D"),
        # longer buffers pair up, as FlashInfer's get_seq_lens needs them to
        ({"paged_kv_indptr": torch.tensor([0, 1, 2, 0], dtype=torch.int32)}, "must pair up"),
        # FlashInfer's mask_indptr wants paged_kv_indptr exactly as long as qo_indptr
        (
            {
                "paged_kv_indptr": torch.tensor([0, 1, 2, 2], dtype=torch.int32),
                "paged_kv_last_page_len": torch.tensor([4, 9, 1], dtype=torch.int32),
                "custom_mask": torch.ones(4 * 4 + 5 * 9, dtype=torch.bool),
            },
            r"paged_kv_indptr must be 1-D with 3 entries",
        ),
        ({"paged_kv_last_page_len": torch.tensor([4, 17], dtype=torch.int32)}, "paged_kv_last_page_len"),
        ({"paged_kv_indices": torch.tensor([0, -1], dtype=torch.int32)}, "negative page"),
        ({"qo_indptr": torch.tensor([0, 5, 4], dtype=torch.int32)}, "qo_indptr"),
        ({"head_dim_qk": 0}, "head_dim_qk"),
        ({"head_dim_qk": 577}, "head_dim_qk"),
        ({"head_dim_vo": 32}, "head_dim_vo"),
        ({"num_kv_heads": 3}, "divisible"),
        ({"custom_mask": torch.ones(5, dtype=torch.bool)}, "custom_mask"),
        ({"packed_custom_mask": torch.ones(2, dtype=torch.uint8)}, "packed_custom_mask"),
        ({"logits_soft_cap": -1.0}, "logits_soft_cap"),
    ],
)
def test_plan_errors(workspace, overrides, match):
    with pytest.raises(ValueError, match=match):
        plan_paged(workspace, **overrides)
    with pytest.raises(TypeError, match="q_data_type"):
        plan_paged(workspace, q_data_type=torch.int32)


def test_run_errors(workspace):
    with pytest.raises(PlanStateError):
        kernforge.BatchPrefillWithPagedKVCacheWrapper(workspace).run(torch.zeros(1), torch.zeros(1))
    wrapper = plan_paged(workspace)
    cache = torch.zeros(2, 2, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(9, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype of q"):
        wrapper.run(q.float(), cache)
    with pytest.raises(ValueError, match=r"q.shape\[0\]"):
        wrapper.run(q[:8], cache)
    with pytest.raises(ValueError, match="dtype of k"):
        wrapper.run(q, cache.float())
    with pytest.raises(ValueError, match="beyond paged_kv_cache"):
        wrapper.run(q, cache[:1])
    with pytest.raises(ValueError, match="Invalid shape of out"):
        wrapper.run(q, cache, out=torch.zeros(9, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="o_data_type"):
        wrapper.run(q, cache, out=torch.zeros(9, 4, 64))
    with pytest.raises(NotImplementedError):
        wrapper.run(q, cache, sinks=torch.zeros(4))
    ragged = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    ragged.plan(
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([0, 5], dtype=torch.int32),
        4,
        2,
        64,
        q_data_type=torch.bfloat16,
    )
    k = torch.zeros(5, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k must have shape"):
        ragged.run(q[:3], k[:4], k)
    with pytest.raises(ValueError, match="v must have shape"):
        ragged.run(q[:3], k, torch.zeros(5, 1, 64, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError):
        ragged.plan(
            torch.tensor([0, 3], dtype=torch.int32),
            torch.tensor([0, 5], dtype=torch.int32),
            4,
            2,
            64,
            pos_encoding_mode="ROPE_LLAMA",
        )


# --------------------------------------------------------------------------- AMX tier

PREFILL_EMULATED = Module(
    "prefill_amx_emulated",
    "prefill_amx_emulated.cpp.jinja",
    params=prefill.PREFILL.params,
    structs=prefill.PREFILL.structs.values(),
    codes=prefill.PREFILL.codes,
    entries=[*prefill.PREFILL.entries.values(), Entry("take_counters", "int64_t counters")],
)


def _amx_counters(kernel) -> dict:
    counters = torch.zeros(3, dtype=torch.int64)
    kernel.take_counters(counters.data_ptr())
    faults, last, dots = counters.tolist()
    return {"faults": faults, "last_fault": last, "dot_products": dots}


@pytest.mark.parametrize(
    "kv_dtype,num_qo_heads,tile,head_dims",
    [
        (torch.bfloat16, 12, (64, 64), (64, 64)),
        (FP8, 8, (32, 32), (64, 64)),
        (torch.bfloat16, 6, (128, 64), (64, 64)),
        (torch.bfloat16, 6, (64, 64), (33, 17)),
        (FP8, 32, (128, 64), (576, 512)),  # MLA's absorbed rows: latent + rope, values the latent
    ],
)
def test_amx_path_emulated(test_templates, workspace, kv_dtype, num_qo_heads, tile, head_dims):
    """The AMX products of the prefill kernel, with the tile instructions emulated (the same
    template the amx tier compiles, built on avx512): rows per item that are not whole 32-row
    blocks (GQA 3 x 21 queries), a partial last key block, causal and windowed masks, queries that
    see no key (qo_len > kv_len), head dims padded to whole pairs and 32-column blocks (33/17), and
    MLA's 576 / 512."""
    if not kernforge.jit.isa.runnable("avx512"):
        pytest.skip("the emulated AMX kernels are built on the avx512 tier, which this CPU cannot run")
    qo, kv = [45, 1, 70, 40], [100, 33, 70, 7]
    head_dim_qk, head_dim_vo = head_dims
    g = seeded("amx", str(kv_dtype), num_qo_heads, head_dims)
    q = rand((sum(qo), num_qo_heads, head_dim_qk), torch.bfloat16, g)
    k, v = (rand((sum(kv), 2, d), kv_dtype, g) for d in head_dims)
    qo_indptr, kv_indptr = indptr_of(qo), indptr_of(kv)
    with kernforge.use_isa("avx512"):
        for window in (-1, 40):
            wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
            wrapper.plan_with_tile(
                qo_indptr,
                kv_indptr,
                num_qo_heads,
                2,
                head_dim_qk,
                tile,
                head_dim_vo,
                window_left=window,
                kv_data_type=kv_dtype,
                module=PREFILL_EMULATED,
            )
            kernel = wrapper._plan.kernel
            _amx_counters(kernel)
            out, lse = wrapper.run_return_lse(q, k, v)
            counters = _amx_counters(kernel)
            assert counters["faults"] == 0 and counters["dot_products"] > 0, counters
            check_ragged(
                out,
                lse,
                q,
                k,
                v,
                qo_indptr,
                kv_indptr,
                torch.bfloat16,
                f"window {window}",
                causal=True,
                window_left=window,
            )
            check_rows_without_keys(out, lse, keyless_causal_rows(qo, kv), f"window {window}")


def test_amx_build_compiles_with_the_tile_path(cache):
    """The amx tier's build of the prefill module compiles here, with the tile instructions in it."""
    params = prefill.prefill_variant_params(
        torch.bfloat16, torch.bfloat16, torch.bfloat16, 128, 128, 4, prefill.TILES[0]
    )
    result, _ = core.build(core.KernelSpec.make(prefill.PREFILL, params, "amx"), load=False)  # compile only
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed: cannot look into the built library")
    code = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(disk.Entry(cache, result.key).so)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for mnemonic in ("tdpbf16ps", "ldtilecfg", "tileloadd", "tilestored", "tilezero", "tilerelease"):
        assert mnemonic in code, f"the amx build of prefill has no {mnemonic}"


@pytest.mark.skipif(
    not kernforge.jit.isa.runnable("amx"),
    reason="this CPU or OS offers no AMX tiles: the "
    "amx tier's prefill runs only where it does (its tile logic is tested emulated above)",
)
def test_amx_tier_matches_reference(workspace):
    with kernforge.use_isa("amx"):
        _, q, cache, indices, result = run_paged(workspace, [40, 100], [40, 300])
        check_paged(q, cache, indices, result, [40, 100], [40, 300], "NHD", torch.bfloat16, causal=True)


@pytest.mark.parametrize("threads_setting", [2, 5])
def test_kv_split_when_tiles_are_fewer_than_threads(tier, workspace, threads_setting):
    """One tile of a long request on more threads than tiles: plan() cuts its keys into pieces
    whose partial states run() merges by LSE; the result equals the reference and the unsplit run."""
    g = seeded("split", threads_setting)
    q = rand((10, 2, 64), torch.bfloat16, g)
    k, v = (rand((1100, 1, 64), torch.bfloat16, g) for _ in range(2))
    indptr_q, indptr_kv = torch.tensor([0, 10], dtype=torch.int32), torch.tensor([0, 1100], dtype=torch.int32)
    results = {}
    try:
        kernforge.set_num_threads(threads_setting)
        for disable in (False, True):
            wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
            wrapper.plan(
                indptr_q,
                indptr_kv,
                2,
                1,
                64,
                causal=True,
                window_left=900,
                q_data_type=torch.bfloat16,
                disable_split_kv=disable,
            )
            items = wrapper._plan.args.num_items
            assert items == (1 if disable else threads_setting), (disable, items)
            results[disable] = wrapper.run_return_lse(q, k, v)
    finally:
        kernforge.set_num_threads(None)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True, window_left=900)
    check(*results[False], ref_out, ref_lse, torch.bfloat16, "split")
    torch.testing.assert_close(results[False][0].float(), results[True][0].float(), atol=1e-2, rtol=1e-2)
