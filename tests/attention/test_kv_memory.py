"""Tests for KV caches in huge pages (``kernforge.memory``): ``empty_kv_cache``,
``advise_huge_pages`` and ``zero_in_huge_pages``.

What Linux does with the advice (whether a fault finds a free huge page) is not the library's to
promise, so the checks are what the library does: the tensor's shape, dtype, alignment and memory,
and, where transparent huge pages are not disabled, that the kernel took the advice (the mapping
holding the tensor is THP-eligible in /proc/self/smaps). A decode over a cache from
``empty_kv_cache`` must equal the same decode over ``torch.empty``'s.
"""

import sys

import pytest
import torch

import kernforge
from kernforge.memory import HUGE_PAGE

from op_helpers import THP_OFF, thp_eligible

needs_thp = pytest.mark.skipif(
    THP_OFF, reason="transparent huge pages are disabled or not Linux's here: the advice has nothing to take it"
)


@pytest.mark.parametrize(
    "size, dtype",
    [
        ((3, 2, 16, 8, 128), torch.bfloat16),  # 196 KiB: below a huge page, plain torch.empty
        ((64, 2, 16, 8, 128), torch.bfloat16),  # 4 MiB
        ((2, 401, 2, 8, 5, 40), torch.float8_e4m3fn),  # layers x odd pages, HND, 1-byte rows of 40: 2.6 MB
        ((97, 2, 16, 8, 128), torch.float32),  # not a whole number of huge pages
        ((0, 2, 16, 8, 128), torch.bfloat16),  # empty
    ],
)
def test_empty_kv_cache_is_a_whole_usable_tensor(size, dtype):
    cache = kernforge.empty_kv_cache(*size, dtype=dtype)
    assert cache.shape == size and cache.dtype == dtype and cache.is_contiguous()
    nbytes = cache.numel() * cache.element_size()
    if nbytes >= HUGE_PAGE:
        assert cache.data_ptr() % HUGE_PAGE == 0
    bytes_view = cache.view(torch.uint8).view(-1)
    bytes_view.copy_(torch.arange(bytes_view.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    assert torch.equal(bytes_view, torch.arange(bytes_view.numel()).remainder(251).to(torch.uint8))
    assert kernforge.empty_kv_cache(size, dtype=dtype).shape == size  # the size as one tuple


@needs_thp
def test_empty_kv_cache_is_advised_before_first_touch():
    cache = kernforge.empty_kv_cache(256, 2, 16, 8, 128)  # 16 MiB
    assert thp_eligible(cache.data_ptr())
    assert thp_eligible(cache.data_ptr() + cache.numel() * cache.element_size() - 1)


@needs_thp
def test_advise_huge_pages_keeps_the_contents():
    cache = torch.randn(10 << 20, dtype=torch.float32)  # 40 MiB, written before the advice
    before = cache.clone()
    advised = kernforge.advise_huge_pages(cache)
    nbytes = cache.numel() * cache.element_size()
    assert advised % HUGE_PAGE == 0 and nbytes - 2 * HUGE_PAGE < advised <= nbytes
    assert thp_eligible(-(-cache.data_ptr() // HUGE_PAGE) * HUGE_PAGE)
    assert torch.equal(cache, before)
    assert kernforge.advise_huge_pages(cache[1::3], collapse=False) == advised  # a view: its storage's pages


@pytest.mark.parametrize("offset", [0, 4, 4100])
def test_zero_in_huge_pages_zeroes_the_tensor_and_leaves_its_neighbours(offset):
    """Every byte of the tensor reads zero (the whole huge pages handed back, the ends zeroed in
    place); the storage's bytes around it keep theirs; on Linux with THP, huge pages from then on."""
    storage = torch.randint(1, 255, (offset + (12 << 20) + 333,), dtype=torch.uint8)  # ~12 MiB, no zeros
    before = storage.clone()
    view = storage[offset : offset + (12 << 20)].view(torch.float32)  # the storage's bytes around it kept
    released = kernforge.zero_in_huge_pages(view)
    assert not view.any()
    assert torch.equal(storage[:offset], before[:offset]) and torch.equal(storage[-333:], before[-333:])
    if released:
        assert released % HUGE_PAGE == 0 and (12 << 20) - 2 * HUGE_PAGE <= released <= 12 << 20
        assert THP_OFF or thp_eligible(-(-view.data_ptr() // HUGE_PAGE) * HUGE_PAGE)
    else:
        assert not sys.platform.startswith("linux")


def test_zero_in_huge_pages_below_a_huge_page_zeroes_in_place():
    small = torch.ones(1000)
    assert kernforge.zero_in_huge_pages(small) == 0 and not small.any()


def test_advise_huge_pages_below_a_huge_page_advises_nothing():
    assert kernforge.advise_huge_pages(torch.zeros(1000)) == 0


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: kernforge.empty_kv_cache(4, 2.5), TypeError, "size"),
        (lambda: kernforge.empty_kv_cache(4, True), TypeError, "size"),
        (lambda: kernforge.empty_kv_cache(4, -1), ValueError, "size"),
        (lambda: kernforge.empty_kv_cache(4, 8, dtype="bfloat16"), TypeError, "dtype"),
        (lambda: kernforge.advise_huge_pages([1.0]), TypeError, "tensor"),
        (lambda: kernforge.advise_huge_pages(torch.zeros(4, device="meta")), ValueError, "tensor"),
        (lambda: kernforge.zero_in_huge_pages(b"kv"), TypeError, "tensor"),
        (lambda: kernforge.zero_in_huge_pages(torch.zeros(4, 4).t()), ValueError, "contiguous"),
        (lambda: kernforge.zero_in_huge_pages(torch.zeros(4, device="meta")), ValueError, "tensor"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_decode_over_an_empty_kv_cache_equals_torch_empty():
    g = torch.Generator().manual_seed(0)
    pages, page, heads, qo_heads, dim = 300, 16, 4, 8, 128  # 4.9 MB: in huge pages
    values = torch.randn(pages, 2, page, heads, dim, generator=g).to(torch.float8_e4m3fn)
    huge = kernforge.empty_kv_cache(pages, 2, page, heads, dim, dtype=torch.float8_e4m3fn)
    huge.copy_(values)
    assert huge.data_ptr() % HUGE_PAGE == 0
    plain = torch.empty_like(values).copy_(values)
    indptr = torch.tensor([0, 97, 300], dtype=torch.int32)
    indices = torch.randperm(pages, generator=g).to(torch.int32)
    last = torch.tensor([16, 5], dtype=torch.int32)
    q = torch.randn(2, qo_heads, dim, generator=g).to(torch.bfloat16)
    w = kernforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8))
    w.plan(indptr, indices, last, qo_heads, heads, dim, page, q_data_type=torch.bfloat16, kv_data_type=values.dtype)
    assert torch.equal(w.run(q, huge, k_scale=0.5, v_scale=0.25), w.run(q, plain, k_scale=0.5, v_scale=0.25))
