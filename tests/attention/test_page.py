"""Tests for the paged KV cache: ``unpack_paged_kv_cache`` / ``PagedKVCache`` (every cache form
FlashInfer accepts), ``append_paged_kv_cache``, ``get_seq_lens`` and ``get_batch_indices_positions``.

Append is compared bit for bit with torch's scatter into a copy of the cache's whole backing
storage, so each check also proves that every element the append must not touch (spare pages,
the free slots of partly filled last pages, other requests' tokens, the gaps between the pages
and rows of strided caches) still holds the sentinel it was filled with. Bad indices must raise
ValueError naming the argument with the cache left untouched, even when the bad entry is the
last one (the kernel checks everything before it writes).

Kernel tests run on the best ISA tier and a slice of the matrix on the lower ones (``tier``).
"""

import pytest
import torch

import kernforge
from kernforge.ops.attention.page import (
    KVCacheTypeError,
    KVLayoutError,
    PagedKVCache,
    check_kv_layout,
    unpack_paged_kv_cache,
)

from op_helpers import seeded

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
CACHE_DTYPE_IDS = ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
SENTINEL = -7.0  # exact in every cache dtype
HEADS, HEAD_DIM = 3, 40  # rows of 40 elements: vector multiples plus a tail in every dtype
PAGE_SIZES = [1, 5, 16, 64]
LAYOUTS = ["NHD", "HND"]
BATCHES = [1, 37]
SPARE_PAGES = 3  # allocated but owned by no request: must stay untouched


# --------------------------------------------------------------------------- caches


def plane_shape(layout, num_pages, page_size, heads=HEADS, head_dim=HEAD_DIM):
    return (num_pages, page_size, heads, head_dim) if layout == "NHD" else (num_pages, heads, page_size, head_dim)


def new_backing(form, layout, num_pages, page_size, dtype, heads=HEADS, head_dim=HEAD_DIM):
    """The storage a cache of ``form`` lives in, filled with the sentinel."""
    plane = plane_shape(layout, num_pages, page_size, heads, head_dim)
    if form == "tensor":
        shapes = [(num_pages, 2, *plane[1:])]
    elif form == "tuple":  # K: every other page of a larger buffer; V: head_dim rows padded by 3
        shapes = [(2 * num_pages + 1, *plane[1:]), (*plane[:3], head_dim + 3)]
    elif form == "tensor_page1":  # page size 1, squeezed: [pages, 2, H, D]
        shapes = [(num_pages, 2, heads, head_dim)]
    elif form == "tuple_page1":  # [pages, H, D] each, V with padded rows
        shapes = [(num_pages, heads, head_dim), (num_pages, heads, head_dim + 3)]
    else:
        raise AssertionError(form)
    return [torch.full(shape, SENTINEL, dtype=dtype) for shape in shapes]


def cache_views(form, layout, backing, head_dim=HEAD_DIM):
    """(the paged_kv_cache argument, K as a 4-D plane view, V as a 4-D plane view) over ``backing``."""
    token_dim = 1 if layout == "NHD" else 2  # where a squeezed page-size-1 plane gets its token dim back
    if form == "tensor":
        return backing[0], backing[0][:, 0], backing[0][:, 1]
    if form == "tuple":
        k, v = backing[0][1::2], backing[1][..., :head_dim]
        return (k, v), k, v
    if form == "tensor_page1":
        t = backing[0]
        return t, t[:, 0].unsqueeze(token_dim), t[:, 1].unsqueeze(token_dim)
    k, v = backing[0], backing[1][..., :head_dim]
    return (k, v), k.unsqueeze(token_dim), v.unsqueeze(token_dim)


def bits(t):
    """``t`` reinterpreted as integers of its element size: exact comparison and scatter for every dtype."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(actual_backing, expected_backing):
    for actual, expected in zip(actual_backing, expected_backing):
        mismatch = bits(actual) != bits(expected)
        assert not mismatch.any(), f"{int(mismatch.sum())} elements differ, first at {mismatch.nonzero()[0].tolist()}"


# --------------------------------------------------------------------------- batches


class Batch:
    """A batch of requests with pages allocated for their tokens after the append, in scattered
    page order, and the appended tokens' request and position (get_batch_indices_positions)."""

    def __init__(self, seq_before, appended, page_size, g, dtype, heads=HEADS, head_dim=HEAD_DIM):
        seq_before = torch.tensor(seq_before, dtype=torch.int32)
        appended = torch.tensor(appended, dtype=torch.int32)
        seq_after = seq_before + appended
        pages = (seq_after + page_size - 1) // page_size
        self.kv_indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
        self.kv_indptr[1:] = torch.cumsum(pages, 0)
        used = int(self.kv_indptr[-1])
        self.num_pages = used + SPARE_PAGES
        self.kv_indices = torch.randperm(self.num_pages, generator=g)[:used].to(torch.int32)
        self.kv_last_page_len = torch.where(seq_after > 0, (seq_after - 1) % page_size + 1, 0).to(torch.int32)
        self.page_size = page_size
        append_indptr = torch.zeros(len(appended) + 1, dtype=torch.int32)
        append_indptr[1:] = torch.cumsum(appended, 0)
        self.nnz = int(append_indptr[-1])
        seq_lens = kernforge.get_seq_lens(self.kv_indptr, self.kv_last_page_len, page_size)
        assert torch.equal(seq_lens, seq_after)
        self.batch_indices, self.positions = kernforge.get_batch_indices_positions(append_indptr, seq_lens, self.nnz)
        self.key = torch.randn(self.nnz, heads, head_dim, generator=g).to(dtype)
        self.value = torch.randn(self.nnz, heads, head_dim, generator=g).to(dtype)

    def args(self, cache, **changes):
        """append_paged_kv_cache's positional arguments (some replaced by ``changes``)."""
        a = dict(
            append_key=self.key,
            append_value=self.value,
            batch_indices=self.batch_indices,
            positions=self.positions,
            paged_kv_cache=cache,
            kv_indices=self.kv_indices,
            kv_indptr=self.kv_indptr,
            kv_last_page_len=self.kv_last_page_len,
        )
        a.update(changes)
        return a

    def scatter(self, k, v, layout, key=None, value=None):
        """torch's reference: write each token's rows into its slot of the K and V planes."""
        pages = self.kv_indices[self.kv_indptr[self.batch_indices.long()] + self.positions // self.page_size].long()
        slots = (self.positions % self.page_size).long()
        for plane, rows in ((k, self.key if key is None else key), (v, self.value if value is None else value)):
            index = (pages, slots) if layout == "NHD" else (pages, slice(None), slots)
            bits(plane)[index] = bits(rows)


def random_batch(batch, page_size, g, dtype, **dims):
    if batch == 1:  # a prefill chunk that crosses pages, after a partly filled last page
        seq_before, appended = [int(torch.randint(0, 2 * page_size, (1,), generator=g))], [2 * page_size + 3]
    else:  # decode-like: 0..3 tokens per request, some requests empty, some with nothing appended
        seq_before = torch.randint(0, 3 * page_size + 2, (batch,), generator=g).tolist()
        appended = torch.randint(0, 4, (batch,), generator=g).tolist()
        seq_before[1], appended[1] = 0, 0  # an empty request: no pages at all
        appended[0] = max(appended[0], 1)
    return Batch(seq_before, appended, page_size, g, dtype, **dims)


def run_append(form, layout, batch, dtype, append=None, **dims):
    """Append ``batch`` (Batch) into a fresh cache of ``form`` and check against the scatter."""
    backing = new_backing(form, layout, batch.num_pages, batch.page_size, dtype, **dims)
    expected = [t.clone() for t in backing]
    cache, _, _ = cache_views(form, layout, backing, dims.get("head_dim", HEAD_DIM))
    _, k_ref, v_ref = cache_views(form, layout, expected, dims.get("head_dim", HEAD_DIM))
    key, value = append or (batch.key, batch.value)
    batch.scatter(k_ref, v_ref, layout, key, value)
    assert any(not torch.equal(bits(e), bits(b)) for e, b in zip(expected, backing)), "the reference writes nothing"
    kernforge.append_paged_kv_cache(**batch.args(cache, append_key=key, append_value=value), kv_layout=layout)
    assert_bits_equal(backing, expected)


# --------------------------------------------------------------------------- append


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("form", ["tensor", "tuple"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=CACHE_DTYPE_IDS)
def test_append_matches_scatter(dtype, page_size, layout, form, batch, tier):
    g = seeded("append", dtype, page_size, layout, form, batch)
    run_append(form, layout, random_batch(batch, page_size, g, dtype), dtype)


@pytest.mark.parametrize("form", ["tensor_page1", "tuple_page1"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_page_size_1_squeezed(layout, form, tier):
    """FlashInfer's page-size-1 forms without the token dimension: [pages, 2, H, D] and [pages, H, D] pairs."""
    g = seeded("page1", layout, form)
    run_append(form, layout, random_batch(37, 1, g, torch.bfloat16), torch.bfloat16)


# Row bytes below one 16-byte move, between moves, and several 64-byte vectors plus a tail; the odd
# head dims of SGLang's tests (13, 33, 55) and one above 128 (200). Pages in shuffled order (Batch).
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [1, 3, 13, 17, 33, 55, 100, 200, 256])
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=CACHE_DTYPE_IDS)
def test_append_head_dims(dtype, head_dim, layout, tier):
    g = seeded("head_dim", dtype, head_dim, layout)
    dims = dict(heads=2, head_dim=head_dim)
    form = "tuple" if head_dim % 2 else "tensor"  # tuple: K every other page, V rows padded
    batch = random_batch(37, 16, g, dtype, **dims)
    assert not torch.equal(batch.kv_indices, torch.arange(len(batch.kv_indices), dtype=torch.int32))
    run_append(form, layout, batch, dtype, **dims)


@pytest.mark.parametrize("append_layout", ["packed_kv", "padded_heads", "strided_head_dim"])
def test_append_strided_inputs(append_layout, tier):
    """append_key/append_value as views: K and V of one packed [nnz, 2, H, D] tensor (FlashInfer's
    non-contiguous case), heads padded apart, and a strided head_dim (copied first)."""
    g = seeded("strided", append_layout)
    batch = random_batch(37, 16, g, torch.float16)
    key, value = batch.key, batch.value
    if append_layout == "packed_kv":
        packed = torch.stack([key, value], dim=1)
        view_key, view_value = packed[:, 0], packed[:, 1]
    elif append_layout == "padded_heads":
        view_key = torch.zeros(batch.nnz, HEADS + 2, HEAD_DIM + 5, dtype=key.dtype)[:, 1 : HEADS + 1, :HEAD_DIM]
        view_value = torch.zeros(batch.nnz, HEADS, HEAD_DIM + 8, dtype=key.dtype)[..., 8:]
        view_key.copy_(key), view_value.copy_(value)
    else:
        view_key = torch.stack([key, key], dim=-1)[..., 0]
        view_value = torch.stack([value, value], dim=-1)[..., 1]
    assert not view_key.is_contiguous() and not view_value.is_contiguous()
    run_append("tensor", "HND", batch, torch.float16, append=(view_key, view_value))


def test_append_many_tokens_on_threads(tier):
    """Enough bytes that the copy is split over threads (see kAppendMinBytesPerThread)."""
    g = seeded("threads")
    dims = dict(heads=4, head_dim=128)
    batch = Batch([5, 0, 40], [300, 150, 200], 16, g, torch.float32, **dims)  # 650 tokens, 2.6 MB of rows
    kernforge.set_num_threads(2)
    try:
        run_append("tuple", "NHD", batch, torch.float32, **dims)
    finally:
        kernforge.set_num_threads(None)


def test_append_index_dtypes_converted(tier):
    """Index tensors of other integer dtypes and non-contiguous ones are taken as FlashInfer's .int() takes them."""
    g = seeded("index dtypes")
    batch = random_batch(37, 5, g, torch.bfloat16)
    batch.batch_indices = batch.batch_indices.long()
    batch.positions = torch.stack([batch.positions, batch.positions], dim=1)[:, 0]
    batch.kv_indices = batch.kv_indices.long()
    batch.kv_indptr = batch.kv_indptr.to(torch.int16)
    run_append("tensor", "NHD", batch, torch.bfloat16)


def test_append_nothing():
    g = seeded("empty append")
    batch = Batch([3, 7], [0, 0], 4, g, torch.bfloat16)
    backing = new_backing("tensor", "NHD", batch.num_pages, 4, torch.bfloat16)
    before = backing[0].clone()
    kernforge.append_paged_kv_cache(**batch.args(backing[0]))
    assert torch.equal(bits(backing[0]), bits(before))


# --------------------------------------------------------------------------- append: bad indices


def _bad_index_cases(batch):
    """(argument name, its bad replacement, message pattern); the bad entry is the last one used."""
    last = batch.nnz - 1
    request = int(batch.batch_indices[last])

    def with_last(t, value):
        t = t.clone()
        t[-1] = value
        return t

    pages = int(batch.kv_indptr[request + 1] - batch.kv_indptr[request])
    bad_indptr = batch.kv_indptr.clone()
    bad_indptr[request + 1 :] += len(batch.kv_indices)  # request's range runs past kv_indices
    bad_page = batch.kv_indices.clone()
    bad_page[int(batch.kv_indptr[request]) + int(batch.positions[last]) // batch.page_size] = batch.num_pages
    negative_page = bad_page.clone()
    negative_page[negative_page == batch.num_pages] = -1
    decreasing = batch.kv_indptr.clone()
    decreasing[request + 1] = decreasing[request] - 1  # later requests append nothing: only this range is read
    return [
        ("batch_indices", with_last(batch.batch_indices, len(batch.kv_last_page_len)), rf"batch_indices\[{last}\]"),
        ("batch_indices", with_last(batch.batch_indices, -1), rf"batch_indices\[{last}\]"),
        ("positions", with_last(batch.positions, -1), rf"positions\[{last}\] = -1 is negative"),
        (
            "positions",
            with_last(batch.positions, pages * batch.page_size),
            rf"positions\[{last}\] = {pages * batch.page_size} is beyond the pages of request {request}",
        ),
        ("kv_indptr", bad_indptr, rf"kv_indptr\[{request}:{request + 2}\]"),
        ("kv_indptr", decreasing, rf"kv_indptr\[{request}:{request + 2}\]"),
        ("kv_indices", bad_page, rf"kv_indices\[\d+\] = {batch.num_pages} is out of range \[0, {batch.num_pages}\)"),
        ("kv_indices", negative_page, r"kv_indices\[\d+\] = -1 is out of range"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_append_bad_index_writes_nothing(case, tier):
    g = seeded("bad index")
    batch = random_batch(37, 5, g, torch.bfloat16)
    name, bad, pattern = _bad_index_cases(batch)[case]
    backing = new_backing("tuple", "HND", batch.num_pages, 5, torch.bfloat16)
    before = [t.clone() for t in backing]
    cache, _, _ = cache_views("tuple", "HND", backing)
    with pytest.raises(ValueError, match=pattern):
        kernforge.append_paged_kv_cache(**batch.args(cache, **{name: bad}), kv_layout="HND")
    assert_bits_equal(backing, before)


def test_append_argument_errors():
    g = seeded("argument errors")
    batch = random_batch(37, 5, g, torch.bfloat16)
    cache = new_backing("tensor", "NHD", batch.num_pages, 5, torch.bfloat16)[0]
    cases = [
        (dict(append_key=batch.key.float()), TypeError, "append_key has dtype torch.float32 but paged_kv_cache has"),
        (dict(append_value=batch.value[:, :2]), ValueError, r"append_value must be \[nnz, num_kv_heads, head_dim\]"),
        (dict(append_key=batch.key[..., :-1]), ValueError, "append_key must be"),
        (dict(append_value=batch.value[:-1]), ValueError, "append_value has .* tokens but append_key has"),
        (dict(append_key=batch.key.tolist()), TypeError, "append_key must be a torch.Tensor"),
        (dict(batch_indices=batch.batch_indices[:-1]), ValueError, r"batch_indices must be 1-D with \d+ entries"),
        (dict(positions=batch.positions.float()), TypeError, "positions has dtype torch.float32"),
        (dict(kv_indptr=batch.kv_indptr[:-1]), ValueError, r"kv_indptr must be 1-D with 38 entries"),
        (dict(kv_indices=batch.kv_indices.view(1, -1)), ValueError, "kv_indices must be 1-D"),
        (dict(kv_last_page_len=[1, 2]), TypeError, "kv_last_page_len must be a torch.Tensor"),
        (dict(positions=batch.positions.to("meta")), ValueError, "positions is on device meta"),
        # int64 indices are range-checked before the int32 conversion (FlashInfer's .int() wraps them)
        (dict(positions=batch.positions.long() + 2**32), ValueError, "positions holds values beyond int32"),
        (dict(kv_indices=batch.kv_indices.long() - 2**32), ValueError, "kv_indices holds values beyond int32"),
    ]
    before = cache.clone()
    for change, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            kernforge.append_paged_kv_cache(**batch.args(cache, **change))
    with pytest.raises(KVLayoutError, match="Invalid kv_layout nhd"):
        kernforge.append_paged_kv_cache(**batch.args(cache), kv_layout="nhd")
    assert torch.equal(bits(cache), bits(before))


def test_append_strided_cache_head_dim_refused():
    g = seeded("strided cache")
    batch = random_batch(37, 5, g, torch.bfloat16)
    k = torch.zeros(*plane_shape("NHD", batch.num_pages, 5), 2, dtype=torch.bfloat16)[..., 0]
    v = torch.zeros(*plane_shape("NHD", batch.num_pages, 5), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the K cache's head_dim is not contiguous"):
        kernforge.append_paged_kv_cache(**batch.args((k, v)))


# --------------------------------------------------------------------------- unpack / PagedKVCache


@pytest.mark.parametrize("form", ["tensor", "tuple", "list", "tensor_page1", "tuple_page1"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=CACHE_DTYPE_IDS)
def test_unpack_describes_the_planes(dtype, layout, form):
    """Sizes, addresses and strides address exactly the elements of the K and V views."""
    page_size = 1 if form.endswith("page1") else 5
    backing = new_backing(form.replace("list", "tuple"), layout, 7, page_size, dtype)
    cache_arg, k, v = cache_views(form.replace("list", "tuple"), layout, backing)
    if form == "list":
        cache_arg = list(cache_arg)
    cache = unpack_paged_kv_cache(cache_arg, layout)
    assert isinstance(cache, PagedKVCache)
    assert (cache.layout, cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim, cache.dtype) == (
        layout,
        7,
        page_size,
        HEADS,
        HEAD_DIM,
        dtype,
    )
    size = dtype.itemsize
    for plane, view, ptr, strides in (
        (cache.k, k, cache.k_ptr, cache.k_strides),
        (cache.v, v, cache.v_ptr, cache.v_strides),
    ):
        assert plane.shape == view.shape and plane.stride() == view.stride() and plane.data_ptr() == view.data_ptr()
        assert ptr == view.data_ptr()
        page_stride, token_stride, head_stride = strides
        for page, token, head in [(0, 0, 0), (6, page_size - 1, HEADS - 1), (3, page_size // 2, 1)]:
            index = (page, token, head) if layout == "NHD" else (page, head, token)
            assert (
                view[index].data_ptr() == ptr + (page * page_stride + token * token_stride + head * head_stride) * size
            )
    assert cache.k_strides != cache.v_strides or form.startswith("tensor")  # the tuples have different strides
    with pytest.raises(AttributeError):
        cache.page_size = 2  # frozen


def test_unpack_strided_head_dim_strides_raise():
    k = torch.zeros(4, 5, 3, 16, 2)[..., 0]
    cache = unpack_paged_kv_cache((k, torch.zeros(4, 5, 3, 16)), "NHD")
    assert cache.v_strides == (240, 48, 16)
    with pytest.raises(ValueError, match="head_dim is not contiguous"):
        _ = cache.k_strides


def test_check_kv_layout():
    check_kv_layout("NHD")
    check_kv_layout("HND")
    for bad in ["nhd", "NDH", "", None]:
        with pytest.raises(KeyError) as info:  # FlashInfer's exception type and message ...
            check_kv_layout(bad)
        assert isinstance(info.value, ValueError)  # ... and kernforge's
        assert str(info.value) == f"Invalid kv_layout {bad}"


def test_unpack_errors():
    t = torch.zeros(4, 2, 5, 3, 16)
    cases = [
        (t, "XYZ", KVLayoutError, "Invalid kv_layout XYZ"),
        ({"k": t}, "NHD", KVCacheTypeError, "Unrecognized paged_kv_cache type <class 'dict'>, expect a single tensor"),
        ((t[:, 0], t[:, 1], t[:, 0]), "NHD", KVCacheTypeError, "has 3 entries, not 2"),
        ((t[:, 0], None), "NHD", TypeError, r"paged_kv_cache\[1\] must be a torch.Tensor"),
        (t[:, 0, 0], "NHD", ValueError, r"must be \[num_pages, 2, page_size, num_kv_heads, head_dim\]"),
        (t.unsqueeze(0), "HND", ValueError, r"must be \[num_pages, 2, num_kv_heads, page_size, head_dim\]"),
        (torch.zeros(4, 3, 5, 3, 16), "NHD", ValueError, r"got shape \(4, 3, 5, 3, 16\)"),
        ((t[:, 0, 0, 0], t[:, 1, 0, 0]), "NHD", ValueError, r"the K cache\) must be \[num_pages, page_size"),
        ((t[:, 0], t[:, 1, :4]), "NHD", ValueError, "the V cache has shape"),
        ((t[:, 0], t[:, 1].half()), "NHD", TypeError, "the V cache has dtype torch.float16"),
        (t.int(), "NHD", TypeError, "has dtype torch.int32; a KV cache is float32"),
        (t.to("meta"), "NHD", ValueError, "is on device meta"),
        (torch.zeros(4, 2, 5, 3, 0), "NHD", ValueError, "empty page, head or head_dim"),
        (torch.zeros(4, 2, 0, 3, 16), "NHD", ValueError, "empty page, head or head_dim"),
    ]
    for cache, layout, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            unpack_paged_kv_cache(cache, layout)
    with pytest.raises(KeyError):  # FlashInfer raises KeyError for an unknown cache type
        unpack_paged_kv_cache(3, "NHD")
    with pytest.raises(ValueError, match="^my_cache is on device meta"):
        unpack_paged_kv_cache(t.to("meta"), "NHD", name="my_cache")


# --------------------------------------------------------------------------- index helpers


def ref_batch_indices_positions(append_indptr, seq_lens):
    """FlashInfer's test reference, a loop per request."""
    batch_indices, positions = [], []
    for b in range(len(seq_lens)):
        start, end = int(append_indptr[b]), int(append_indptr[b + 1])
        for offset in range(start, end):
            batch_indices.append(b)
            positions.append(offset + int(seq_lens[b]) - end)
    return torch.tensor(batch_indices, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32)


@pytest.mark.parametrize(
    ("append_lengths", "seq_lens"),
    [
        ([1, 2, 3, 4], [5, 5, 5, 5]),
        ([45, 8, 25, 22], [45, 8, 25, 22]),
        ([0, 3, 0, 5, 1], [7, 10, 2, 8, 6]),
        ([7], [11]),
        ([0, 0, 0], [3, 4, 5]),
        ([], []),
    ],
)
def test_get_batch_indices_positions(append_lengths, seq_lens):
    append_indptr = torch.tensor(
        [0, *torch.tensor(append_lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
    )
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    nnz = sum(append_lengths)
    batch_indices, positions = kernforge.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    expected = ref_batch_indices_positions(append_indptr, seq_lens)
    assert batch_indices.dtype == positions.dtype == torch.int32
    assert torch.equal(batch_indices, expected[0]) and torch.equal(positions, expected[1])


def test_get_batch_indices_positions_flashinfer_example():
    append_indptr = torch.tensor([0, 1, 3, 6, 10], dtype=torch.int32)
    batch_indices, positions = kernforge.get_batch_indices_positions(append_indptr, torch.tensor([5, 5, 5, 5]), 10)
    assert batch_indices.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert positions.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]


def test_get_batch_indices_positions_errors():
    append_indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="nnz = 4 must equal append_indptr"):
        kernforge.get_batch_indices_positions(append_indptr, torch.tensor([3, 6]), 4)
    with pytest.raises(ValueError, match="seq_lens must have one entry per request"):
        kernforge.get_batch_indices_positions(append_indptr, torch.tensor([3, 6, 1]), 5)
    with pytest.raises(ValueError, match="non-decreasing"):
        kernforge.get_batch_indices_positions(torch.tensor([0, 3, 2, 5]), torch.tensor([3, 6, 9]), 5)


def test_get_seq_lens():
    kv_indptr = torch.tensor([0, 3, 4, 6, 8, 8], dtype=torch.int32)  # the last request has no pages
    kv_last_page_len = torch.tensor([13, 8, 9, 6, 0], dtype=torch.int32)
    seq_lens = kernforge.get_seq_lens(kv_indptr, kv_last_page_len, 16)
    assert seq_lens.tolist() == [45, 8, 25, 22, 0]  # FlashInfer's docstring example, plus an empty request
    assert seq_lens.dtype == torch.int32
