"""The paged KV cache, as FlashInfer lays it out, and the ops that fill it.

A cache holds ``num_pages`` pages of ``page_size`` token slots for each of
``num_kv_heads`` heads, one ``head_dim`` row per slot, for K and for V. A request
owns the pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` in order, so its
token ``position`` lives in page ``kv_indices[kv_indptr[b] + position // page_size]``
at slot ``position % page_size``.

Every form FlashInfer takes for ``paged_kv_cache`` is accepted:

* one tensor ``[num_pages, 2, page_size, H, D]`` (NHD) or ``[num_pages, 2, H, page_size, D]``
  (HND), K at ``[:, 0]`` and V at ``[:, 1]``; ``[num_pages, 2, H, D]`` is page size 1;
* a ``(k_cache, v_cache)`` tuple (or list) of ``[num_pages, page_size, H, D]`` (NHD) or
  ``[num_pages, H, page_size, D]`` (HND) tensors; ``[num_pages, H, D]`` is page size 1.
  K and V may have different strides (views into larger buffers, pages not contiguous).

:func:`unpack_paged_kv_cache` checks a cache and describes it as a :class:`PagedKVCache`
(addresses, sizes, strides in elements) for the kernels. It runs once per layer
per step, so it reads attributes only: no views, no tensors are made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kernforge.jit.module import DType, Entry, Module, Struct
from kernforge.ops._common import BoundCall, index_vector, num_threads
from kernforge.ops._registry import FP8_DTYPE_NAMES, Traced, export, kernel_op, model_kernels

KV_LAYOUTS = ("NHD", "HND")
# Storage dtypes a cache may have (FlashInfer's decode reads fp8 caches as well).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


class KVLayoutError(ValueError, KeyError):
    """An unknown ``kv_layout``. FlashInfer raises KeyError with this message; kernforge's
    argument errors are ValueErrors: it is both."""

    __str__ = BaseException.__str__  # KeyError's would quote the message


class KVCacheTypeError(TypeError, KeyError):
    """A ``paged_kv_cache`` that is neither a tensor nor a pair (FlashInfer: KeyError)."""

    __str__ = BaseException.__str__


def check_kv_layout(kv_layout) -> None:
    """FlashInfer's ``_check_kv_layout``: "NHD" or "HND"."""
    if kv_layout not in KV_LAYOUTS:
        raise KVLayoutError(f"Invalid kv_layout {kv_layout}")


@dataclass(frozen=True, eq=False)
class PagedKVCache:
    """One layer's paged cache, checked; what kernels need to address it.

    ``k`` and ``v`` are the 4-D K and V views (``[num_pages, page_size, H, D]`` for NHD,
    ``[num_pages, H, page_size, D]`` for HND). For a single-tensor cache they are made
    on first use (a view costs ~1 us): kernels take ``k_ptr``/``v_ptr`` (the address of
    element ``[0, 0, 0, 0]``) and ``k_strides``/``v_strides`` instead.
    """

    layout: str
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    k_ptr: int
    v_ptr: int
    source: torch.Tensor | tuple = field(repr=False)  # what the caller passed
    # (page, token, head) strides in elements, None where head_dim is not contiguous
    k_plane_strides: tuple[int, int, int] | None = field(repr=False)
    v_plane_strides: tuple[int, int, int] | None = field(repr=False)

    @property
    def k_strides(self) -> tuple[int, int, int]:
        """``(page_stride, token_stride, head_stride)`` of K in elements (head_dim has stride 1)."""
        return self.k_plane_strides or self._strided_head_dim("K")

    @property
    def v_strides(self) -> tuple[int, int, int]:
        """``(page_stride, token_stride, head_stride)`` of V in elements (head_dim has stride 1)."""
        return self.v_plane_strides or self._strided_head_dim("V")

    @cached_property
    def k(self) -> torch.Tensor:
        return self._plane(0)

    @cached_property
    def v(self) -> torch.Tensor:
        return self._plane(1)

    def _plane(self, which: int) -> torch.Tensor:
        src = self.source
        plane = src[which] if isinstance(src, (tuple, list)) else src.select(1, which)
        if plane.dim() == 3:  # page size 1, squeezed: put the token dimension back
            plane = plane.unsqueeze(1 if self.layout == "NHD" else 2)
        return plane

    def _strided_head_dim(self, which: str):
        plane = self.k if which == "K" else self.v
        raise ValueError(
            f"the {which} cache's head_dim is not contiguous (shape {tuple(plane.shape)}, strides "
            f"{plane.stride()}); kernels need stride 1 along head_dim"
        )


_new_object = object.__new__
_ITEMSIZE = {dtype: dtype.itemsize for dtype in KV_DTYPES}


def paged_kv_halves(paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A paged cache as two tensors, for a custom op's schema: ``(cache, None)`` for one tensor,
    ``(k_cache, v_cache)`` for a pair; :func:`paged_kv_from_halves` is the inverse."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache as a tuple must be (k_cache, v_cache), got {len(paged_kv_cache)} entries")
        return paged_kv_cache[0], paged_kv_cache[1]
    return paged_kv_cache, None


def paged_kv_from_halves(kv: torch.Tensor, v: torch.Tensor | None):
    return kv if v is None else (kv, v)


def unpack_paged_kv_cache(paged_kv_cache, kv_layout: str, name: str = "paged_kv_cache") -> PagedKVCache:
    """Check ``paged_kv_cache`` (any FlashInfer form, see the module docstring) and describe it.

    Raises KVLayoutError (a ValueError and KeyError, FlashInfer's message) for a bad
    ``kv_layout``, TypeError for a bad type or dtype, ValueError for a bad device,
    rank, shape or a K/V mismatch, each naming ``name``.
    """
    check_kv_layout(kv_layout)
    if isinstance(paged_kv_cache, torch.Tensor):
        return _unpack_tensor(paged_kv_cache, kv_layout, name)
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        return _unpack_pair(paged_kv_cache, kv_layout, name)
    raise KVCacheTypeError(
        f"Unrecognized paged_kv_cache type {type(paged_kv_cache)}, expect a single tensor or a tuple of tensor."
        + (f" ({name} has {len(paged_kv_cache)} entries, not 2)" if isinstance(paged_kv_cache, (tuple, list)) else "")
    )


def _unpack_tensor(t: torch.Tensor, kv_layout: str, name: str) -> PagedKVCache:
    dtype = _storage_dtype(t, name)
    shape, strides = t.shape, t.stride()  # read once: torch.Size slices cost 0.4 us each
    if len(shape) == 5 and shape[1] == 2:
        pages, _, a, b, head_dim = shape
        page_stride, kv_stride, a_stride, b_stride, dim_stride = strides
    elif len(shape) == 4 and shape[1] == 2:  # page size 1
        pages, _, heads, head_dim = shape
        page_stride, kv_stride, head_stride, dim_stride = strides
        a, b, a_stride, b_stride = _squeezed(kv_layout, heads, head_stride, head_dim, dim_stride)
    else:
        raise ValueError(
            f"{name} must be [num_pages, 2, {_plane_dims(kv_layout)}] (or [num_pages, 2, H, D] for "
            f"page size 1) for kv_layout {kv_layout}, got shape {tuple(shape)}"
        )
    k_ptr = t.data_ptr()
    rows = _rows(kv_layout, page_stride, a_stride, b_stride, dim_stride, head_dim)
    return _new(
        t, kv_layout, name, pages, a, b, head_dim, dtype, k_ptr, k_ptr + kv_stride * _ITEMSIZE[dtype], rows, rows, None
    )


def _unpack_pair(pair, kv_layout: str, name: str) -> PagedKVCache:
    k, v = pair
    dtype = _storage_dtype(k, name, 0)
    if _storage_dtype(v, name, 1) is not dtype:
        raise TypeError(f"{name}: the V cache has dtype {v.dtype} but the K cache has {dtype}; they must match")
    shape = k.shape
    if v.shape != shape:
        raise ValueError(
            f"{name}: the V cache has shape {tuple(v.shape)} but the K cache has {tuple(shape)}; they must match"
        )
    k_strides, v_strides = k.stride(), v.stride()
    if len(shape) == 4:
        pages, a, b, head_dim = shape
        k_rows = _rows(kv_layout, *k_strides, head_dim)
        v_rows = _rows(kv_layout, *v_strides, head_dim)
        planes = pair  # the caller's 4-D tensors are the views
    elif len(shape) == 3:  # page size 1
        pages, heads, head_dim = shape
        a, b, ka, kb = _squeezed(kv_layout, heads, k_strides[1], head_dim, k_strides[2])
        _, _, va, vb = _squeezed(kv_layout, heads, v_strides[1], head_dim, v_strides[2])
        k_rows = _rows(kv_layout, k_strides[0], ka, kb, k_strides[2], head_dim)
        v_rows = _rows(kv_layout, v_strides[0], va, vb, v_strides[2], head_dim)
        planes = None  # views made on first use
    else:
        raise ValueError(
            f"{name}[0] (the K cache) must be [num_pages, {_plane_dims(kv_layout)}] (or "
            f"[num_pages, H, D] for page size 1) for kv_layout {kv_layout}, got shape {tuple(shape)}"
        )
    return _new(pair, kv_layout, name, pages, a, b, head_dim, dtype, k.data_ptr(), v.data_ptr(), k_rows, v_rows, planes)


def _storage_dtype(t, name: str, which: int | None = None) -> torch.dtype:
    """The dtype of a CPU cache tensor ``t`` (``name``, or ``name[which]`` of a pair)."""
    try:  # warm path: two attribute reads
        if t.dtype in _ITEMSIZE and t.is_cpu:
            return t.dtype
    except AttributeError:
        pass
    name = name if which is None else f"{name}[{which}]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _ITEMSIZE:
        raise TypeError(
            f"{name} has dtype {t.dtype}; a KV cache is float32, bfloat16, float16, float8_e4m3fn or float8_e5m2"
        )
    raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")


def _plane_dims(kv_layout: str) -> str:
    return "page_size, num_kv_heads, head_dim" if kv_layout == "NHD" else "num_kv_heads, page_size, head_dim"


def _squeezed(kv_layout, heads, head_stride, head_dim, dim_stride):
    """The (a, b) dims and strides of a page-size-1 plane [pages, H, D] with its token dim
    restored as unsqueeze does (NHD [pages, 1, H, D], HND [pages, H, 1, D])."""
    if kv_layout == "NHD":
        return 1, heads, heads * head_stride, head_stride
    return heads, 1, head_stride, head_dim * dim_stride


def _rows(kv_layout, page_stride, a_stride, b_stride, dim_stride, head_dim):
    """(page, token, head) strides of a [pages, a, b, D] plane; None if head_dim is strided."""
    if dim_stride != 1 and head_dim != 1:
        return None
    return (page_stride, a_stride, b_stride) if kv_layout == "NHD" else (page_stride, b_stride, a_stride)


def _new(source, kv_layout, name, pages, a, b, head_dim, dtype, k_ptr, v_ptr, k_rows, v_rows, planes):
    """The PagedKVCache of [pages, a, b, head_dim] planes ((page_size, H) for NHD, (H, page_size) for HND)."""
    page_size, heads = (a, b) if kv_layout == "NHD" else (b, a)
    if page_size < 1 or heads < 1 or head_dim < 1:
        raise ValueError(
            f"{name} has an empty page, head or head_dim dimension (page_size {page_size}, "
            f"num_kv_heads {heads}, head_dim {head_dim}) in kv_layout {kv_layout}"
        )
    cache = _new_object(PagedKVCache)
    state = cache.__dict__  # filled directly: the generated __init__ pays object.__setattr__ per field (3x slower)
    state.update(
        {
            "layout": kv_layout,
            "num_pages": pages,
            "page_size": page_size,
            "num_kv_heads": heads,
            "head_dim": head_dim,
            "dtype": dtype,
            "k_ptr": k_ptr,
            "v_ptr": v_ptr,
            "source": source,
            "k_plane_strides": k_rows,
            "v_plane_strides": v_rows,
        }
    )
    if planes is not None:
        state["k"], state["v"] = planes
    return cache


# --------------------------------------------------------------------------- appending

_I64 = "int64_t"
# The append kernel's arguments: the new rows (key/value at token and head strides), where they go
# (each token's request and position), the K and V planes (address and page, token, head strides),
# and the page table. Filled per call by name (append_rows).
APPEND_ARGS = Struct(
    "kf_append_args",
    tuple(
        (name, _I64)
        for name in (
            "key",
            "key_stride_n",
            "key_stride_h",
            "value",
            "value_stride_n",
            "value_stride_h",
            "batch_indices",
            "positions",
            "num_tokens",
            "k_cache",
            "k_page_stride",
            "k_token_stride",
            "k_head_stride",
            "v_cache",
            "v_page_stride",
            "v_token_stride",
            "v_head_stride",
            "kv_indices",
            "num_kv_indices",
            "kv_indptr",
            "batch_size",
            "num_pages",
            "page_size",
            "num_heads",
            "head_dim",
            "value_dim",  # V rows' length: head_dim, except for MLA's rope part
            "num_threads",
        )
    ),
)
# Appending copies rows, so one variant per element type; fp8 caches are appended in fp8, as FlashInfer.
PAGE = Module(
    "page",
    "page.cpp.jinja",
    params={"dtype": DType(choices=("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"))},
    structs=[APPEND_ARGS],
    entries=[Entry("append", "const kf_append_args* args", returns=_I64)],
)


def _append_to_schema(
    append_key,
    append_value,
    batch_indices,
    positions,
    paged_kv_cache,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
    kv_layout="NHD",
):
    halves = paged_kv_halves(paged_kv_cache)
    return (
        append_key,
        append_value,
        batch_indices,
        positions,
        *halves,
        kv_indices,
        kv_indptr,
        kv_last_page_len,
        kv_layout,
    ), None


def _append_from_schema(
    append_key,
    append_value,
    batch_indices,
    positions,
    paged_kv_cache,
    paged_v_cache,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
    kv_layout="NHD",
):
    append_paged_kv_cache(
        append_key,
        append_value,
        batch_indices,
        positions,
        paged_kv_from_halves(paged_kv_cache, paged_v_cache),
        kv_indices,
        kv_indptr,
        kv_last_page_len,
        kv_layout,
    )


# The custom op takes the paged cache as its two halves (one tensor: V None), both written.
_APPEND_TRACED = Traced(
    arguments="Tensor append_key, Tensor append_value, Tensor batch_indices, Tensor positions, "
    "Tensor(a!) paged_kv_cache, Tensor(b!)? paged_v_cache, Tensor kv_indices, Tensor kv_indptr, "
    'Tensor kv_last_page_len, str kv_layout="NHD"',
    from_schema=_append_from_schema,
    to_schema=_append_to_schema,
)


@kernel_op(PAGE, traced=_APPEND_TRACED)
def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    """Write ``append_key[i]``/``append_value[i]`` (``[nnz, num_kv_heads, head_dim]``) into the slot
    of token ``positions[i]`` of request ``batch_indices[i]``, as FlashInfer does.

    The pages must already be allocated (``kv_indices``/``kv_indptr`` include them);
    ``kv_last_page_len`` gives the batch size and is not otherwise read, as in FlashInfer.
    Index tensors are int32 (other integer dtypes are converted, as FlashInfer's ``.int()``).
    Every index used is checked before anything is written: a batch index outside
    ``[0, batch_size)``, a position below 0 or past the request's pages, a ``kv_indptr``
    range outside ``kv_indices`` or a page outside ``[0, num_pages)`` raises ValueError
    naming the argument and the entry, with the cache untouched.
    """
    cache = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    key = _token_rows(append_key, "append_key", cache)
    value = _token_rows(append_value, "append_value", cache)
    planes = (cache.k_ptr, *cache.k_strides), (cache.v_ptr, *cache.v_strides)
    shape = CacheShape(cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim, cache.head_dim)
    append_rows(
        key,
        value,
        ("append_key", "append_value"),
        batch_indices,
        positions,
        cache.dtype,
        planes,
        shape,
        kv_indices,
        kv_indptr,
        kv_last_page_len,
    )


def layer_caches(paged_kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A model's per-layer cache tensors, checked to share one shape, strides and dtype: a bound call
    over them checks the first and reaches each at the first's offsets from its own base."""
    caches = list(paged_kv_caches)
    if not caches or not all(isinstance(t, torch.Tensor) for t in caches):
        raise TypeError("paged_kv_caches must be a non-empty sequence of cache tensors")
    first = caches[0]
    for index, t in enumerate(caches):
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype is not first.dtype:
            raise ValueError(f"paged_kv_caches[{index}] differs from paged_kv_caches[0] in shape, strides or dtype")
    return caches


def bound_append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_caches: Sequence[torch.Tensor],
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> BoundCall:
    """:func:`append_paged_kv_cache` into any of ``paged_kv_caches`` (a model's layers: tensors of one
    shape, strides and dtype), checked once, as a call of the cache's index (a prepared decode step's
    append, planned once per step). The call writes whatever ``append_key``/``append_value`` hold."""
    caches = layer_caches(paged_kv_caches)
    first = caches[0]
    cache = unpack_paged_kv_cache(first, kv_layout)
    key = _token_rows(append_key, "append_key", cache)
    value = _token_rows(append_value, "append_value", cache)
    if value[3] != key[3]:
        raise ValueError(f"append_value has {value[3]} tokens but append_key has {key[3]}; they must match")
    if key[0] is not append_key or value[0] is not append_value:
        raise ValueError("append_key and append_value need a contiguous head_dim: the bound call reads them in place")
    batch_size = _batch_size(kv_last_page_len)
    tokens_name = "append_key's tokens"
    batch_indices = index_vector(batch_indices, "batch_indices", key[3], tokens_name)
    positions = index_vector(positions, "positions", key[3], tokens_name)
    kv_indptr = index_vector(kv_indptr, "kv_indptr", batch_size + 1, "len(kv_last_page_len) + 1")
    kv_indices = index_vector(kv_indices, "kv_indices", None, None)
    planes = (cache.k_ptr, *cache.k_strides), (cache.v_ptr, *cache.v_strides)
    shape = CacheShape(cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim, cache.head_dim)
    kernel = (_APPEND_VARIANTS.get(cache.dtype) or _first_append_variant(cache.dtype)).kernel()
    args = kernel.new(
        "kf_append_args",
        _append_args(key, value, batch_indices, positions, planes, kv_indices, kv_indptr, batch_size, shape),
    )
    # every layer's planes lie where the first's do, from its own base
    offsets = cache.k_ptr - first.data_ptr(), cache.v_ptr - first.data_ptr()
    addresses = [(t.data_ptr() + offsets[0], t.data_ptr() + offsets[1]) for t in caches]

    def append(layer: int) -> None:
        if not key[3]:
            return
        args.k_cache, args.v_cache = addresses[layer]
        status = kernel.append(args)
        if status:
            _raise_append_error(status, batch_indices, positions, kv_indices, kv_indptr, shape)

    return BoundCall(append, append_key, append_value, batch_indices, positions, kv_indices, kv_indptr, caches)


@dataclass(frozen=True)
class CacheShape:
    """What the append kernel needs to know of a cache besides its planes' addresses."""

    num_pages: int
    page_size: int
    num_heads: int
    key_dim: int  # K rows' length
    value_dim: int  # V rows' length (MLA: the rope part, shorter than the latent)


def append_rows(
    key,
    value,
    names,
    batch_indices,
    positions,
    dtype,
    planes,
    shape: CacheShape,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
) -> None:
    """The append kernel over checked token rows: ``key``/``value`` are (tensor, token stride, head
    stride, tokens); ``planes`` the K and V planes as (address, page, token, head strides). Every
    index is checked before anything is written (errors name the arguments)."""
    variant = _APPEND_VARIANTS.get(dtype) or _first_append_variant(dtype)
    num_tokens, value_tokens = key[3], value[3]
    if value_tokens != num_tokens:
        raise ValueError(f"{names[1]} has {value_tokens} tokens but {names[0]} has {num_tokens}; they must match")
    batch_size = _batch_size(kv_last_page_len)
    tokens_name = f"{names[0]}'s tokens"
    batch_indices = index_vector(batch_indices, "batch_indices", num_tokens, tokens_name)
    positions = index_vector(positions, "positions", num_tokens, tokens_name)
    kv_indptr = index_vector(kv_indptr, "kv_indptr", batch_size + 1, "len(kv_last_page_len) + 1")
    kv_indices = index_vector(kv_indices, "kv_indices", None, None)
    if num_tokens == 0:
        return
    kernel = variant.kernel()
    args = _append_args(key, value, batch_indices, positions, planes, kv_indices, kv_indptr, batch_size, shape)
    status = kernel.append(kernel.new("kf_append_args", args))
    if status:
        _raise_append_error(status, batch_indices, positions, kv_indices, kv_indptr, shape)


def _append_args(
    key_rows: tuple,
    value_rows: tuple,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    planes: tuple,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    batch_size: int,
    shape: CacheShape,
) -> dict[str, int]:
    """APPEND_ARGS' fields for checked rows (``key_rows``/``value_rows``: append_rows' ``key`` and
    ``value``), index vectors and planes."""
    (key, key_n, key_h, num_tokens), (value, value_n, value_h, _) = key_rows, value_rows
    (k_cache, k_page, k_token, k_head), (v_cache, v_page, v_token, v_head) = planes
    return {
        "key": key.data_ptr(),
        "key_stride_n": key_n,
        "key_stride_h": key_h,
        "value": value.data_ptr(),
        "value_stride_n": value_n,
        "value_stride_h": value_h,
        "batch_indices": batch_indices.data_ptr(),
        "positions": positions.data_ptr(),
        "num_tokens": num_tokens,
        "k_cache": k_cache,
        "k_page_stride": k_page,
        "k_token_stride": k_token,
        "k_head_stride": k_head,
        "v_cache": v_cache,
        "v_page_stride": v_page,
        "v_token_stride": v_token,
        "v_head_stride": v_head,
        "kv_indices": kv_indices.data_ptr(),
        "num_kv_indices": kv_indices.numel(),
        "kv_indptr": kv_indptr.data_ptr(),
        "batch_size": batch_size,
        "num_pages": shape.num_pages,
        "page_size": shape.page_size,
        "num_heads": shape.num_heads,
        "head_dim": shape.key_dim,
        "value_dim": shape.value_dim,
        "num_threads": num_threads(),
    }


_APPEND_VARIANTS = append_paged_kv_cache.kernels.by_dtype  # {cache dtype: variant}, filled on first use


def _first_append_variant(dtype: torch.dtype):
    if dtype in FP8_DTYPE_NAMES:  # storage-only dtypes: the registry's op dtypes (what pre-warm builds) are floats
        _APPEND_VARIANTS[dtype] = PAGE.variant(dtype=FP8_DTYPE_NAMES[dtype])
        return _APPEND_VARIANTS[dtype]
    return append_paged_kv_cache.kernels.variant(dtype)  # unpack admitted only cache dtypes


def _token_rows(t, name: str, cache: PagedKVCache):
    """``t`` as [tokens, num_kv_heads, head_dim] rows of the cache's dtype:
    (tensor, token stride, head stride, tokens)."""
    try:  # warm path: attribute reads
        if t.dtype is cache.dtype and t.is_cpu:
            tokens, heads, head_dim = t.shape
            token_stride, head_stride, dim_stride = t.stride()
            if heads == cache.num_kv_heads and head_dim == cache.head_dim and (dim_stride == 1 or head_dim == 1):
                return t, token_stride, head_stride, tokens
    except (AttributeError, ValueError):  # not a tensor, not 3-D: explained below
        pass
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not cache.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but paged_kv_cache has {cache.dtype}; they must match")
    if not t.is_cpu:
        raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")
    if t.dim() != 3 or t.shape[1] != cache.num_kv_heads or t.shape[2] != cache.head_dim:
        raise ValueError(
            f"{name} must be [nnz, num_kv_heads, head_dim] = [nnz, {cache.num_kv_heads}, "
            f"{cache.head_dim}] to match paged_kv_cache, got shape {tuple(t.shape)}"
        )
    t = t.contiguous()  # only read: a strided head_dim is copied
    return t, t.stride(0), t.stride(1), t.shape[0]


def _batch_size(kv_last_page_len) -> int:
    """The batch size, from kv_last_page_len (append reads nothing else of it, as FlashInfer)."""
    try:
        if kv_last_page_len.dim() == 1:
            return kv_last_page_len.numel()
    except AttributeError:
        raise TypeError(f"kv_last_page_len must be a torch.Tensor, got {type(kv_last_page_len).__name__}") from None
    raise ValueError(f"kv_last_page_len must be 1-D [batch_size], got shape {tuple(kv_last_page_len.shape)}")


def _raise_append_error(status: int, batch_indices, positions, kv_indices, kv_indptr, cache: CacheShape) -> None:
    kind, index = status >> 32, status & 0xFFFFFFFF
    if kind == 1:
        raise ValueError(
            f"batch_indices[{index}] = {int(batch_indices[index])} is out of range "
            f"[0, {kv_indptr.numel() - 1}) (the batch size of kv_indptr and kv_last_page_len)"
        )
    if kind == 2:
        request, position = int(batch_indices[index]), int(positions[index])
        if position < 0:
            raise ValueError(f"positions[{index}] = {position} is negative")
        pages = int(kv_indptr[request + 1]) - int(kv_indptr[request])
        raise ValueError(
            f"positions[{index}] = {position} is beyond the pages of request {request}: it needs page "
            f"{position // cache.page_size} of the request (page size {cache.page_size}) but kv_indptr "
            f"gives the request {pages} pages"
        )
    if kind == 3:
        raise ValueError(
            f"kv_indptr[{index}:{index + 2}] = {kv_indptr[index : index + 2].tolist()} is not a range "
            f"of kv_indices (which has {kv_indices.numel()} entries)"
        )
    if kind == 4:
        raise ValueError(
            f"kv_indices[{index}] = {int(kv_indices[index])} is out of range "
            f"[0, {cache.num_pages}) (the pages of paged_kv_cache)"
        )
    raise AssertionError(f"append kernel returned unknown status {status:#x}")


# --------------------------------------------------------------------------- index helpers


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Sequence lengths from the page table, FlashInfer's formula:
    ``clamp(pages - 1, min=0) * page_size + kv_last_page_len`` per request.

    The table is checked first, as the planners check it (FlashInfer's is bare torch arithmetic: a
    length mismatch raises torch's RuntimeError there, a bad value gives a wrong length):
    ``kv_indptr`` [batch + 1] and ``kv_last_page_len`` [batch] integer CPU tensors, ``kv_indptr``
    non-decreasing, ``kv_last_page_len`` in [1, page_size] for a request with pages and >= 0 else."""
    _check_index_tensor(kv_indptr, "kv_indptr")
    _check_index_tensor(kv_last_page_len, "kv_last_page_len")
    if kv_last_page_len.numel() + 1 != kv_indptr.numel():
        raise ValueError(
            f"kv_last_page_len must have one entry per request, len(kv_indptr) - 1 = {kv_indptr.numel() - 1}, "
            f"got {kv_last_page_len.numel()}"
        )
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    pages = kv_indptr[1:] - kv_indptr[:-1]
    if bool((pages < 0).any()):
        raise ValueError(f"kv_indptr must be non-decreasing, got {kv_indptr.tolist()}")
    bad = (kv_last_page_len < 0) | (kv_last_page_len > page_size) | ((pages > 0) & (kv_last_page_len < 1))
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise ValueError(
            f"kv_last_page_len[{b}] = {int(kv_last_page_len[b])} must be in [1, page_size = {page_size}] for a "
            "request with pages (0 for one without)"
        )
    return torch.clamp(pages - 1, min=0) * page_size + kv_last_page_len


def _check_index_tensor(t, name: str) -> None:
    """A 1-D integer CPU tensor (TypeError or ValueError naming ``name``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} has dtype {t.dtype}; expected an integer tensor (int32)")
    if not t.is_cpu:
        raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")


export("get_seq_lens", get_seq_lens)


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int):
    """For each of the ``nnz`` appended tokens (ragged by ``append_indptr``), its request and its
    position in the request's sequence, where ``seq_lens`` already counts the appended tokens:
    token ``j`` of request ``b`` (``append_indptr[b] <= j < append_indptr[b + 1]``) is at
    ``seq_lens[b] - append_indptr[b + 1] + j``. Both int32, as in FlashInfer.

    Unlike FlashInfer's, a sequence shorter than its appended tokens (which would give negative
    positions) raises ValueError, and the arguments must be 1-D integer CPU tensors."""
    _check_index_tensor(append_indptr, "append_indptr")
    _check_index_tensor(seq_lens, "seq_lens")
    batch_size = len(append_indptr) - 1
    if len(seq_lens) != batch_size:
        raise ValueError(
            f"seq_lens must have one entry per request ({batch_size}, from append_indptr), "
            f"got shape {tuple(seq_lens.shape)}"
        )
    append_indptr = append_indptr.to(torch.int64)
    appended = append_indptr[1:] - append_indptr[:-1]
    total = int(append_indptr[-1] - append_indptr[0]) if batch_size else 0
    if nnz != total or (batch_size and int(append_indptr[0]) != 0):
        raise ValueError(f"nnz = {nnz} must equal append_indptr[-1] = {total}, with append_indptr[0] = 0")
    if batch_size and bool((appended < 0).any()):
        raise ValueError("append_indptr must be non-decreasing")
    short = seq_lens.to(torch.int64) < appended
    if bool(short.any()):
        b = int(short.nonzero()[0])
        raise ValueError(
            f"seq_lens[{b}] = {int(seq_lens[b])} is less than request {b}'s {int(appended[b])} appended tokens "
            "(seq_lens counts them)"
        )
    batch_indices = torch.repeat_interleave(torch.arange(batch_size, dtype=torch.int64), appended, output_size=nnz)
    shift = seq_lens.to(torch.int64) - append_indptr[1:]  # position - token index, per request
    positions = torch.arange(nnz, dtype=torch.int64) + shift[batch_indices]
    return batch_indices.to(torch.int32), positions.to(torch.int32)


export("get_batch_indices_positions", get_batch_indices_positions)


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    if spec.is_mla:  # appends latents (kernforge.ops.mla.attention's hook)
        return []
    return [{"op": "append_paged_kv_cache", "dtype": spec.dtype}]  # each step's K/V into the cache
