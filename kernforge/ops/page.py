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

from dataclasses import dataclass, field
from functools import cached_property

import torch

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
        raise ValueError(f"the {which} cache's head_dim is not contiguous (shape {tuple(plane.shape)}, strides "
                         f"{plane.stride()}); kernels need stride 1 along head_dim")


_new_object = object.__new__
_ITEMSIZE = {dtype: dtype.itemsize for dtype in KV_DTYPES}


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
        + (f" ({name} has {len(paged_kv_cache)} entries, not 2)" if isinstance(paged_kv_cache, (tuple, list))
           else ""))


def _unpack_tensor(t: torch.Tensor, kv_layout: str, name: str) -> PagedKVCache:
    shape, strides = t.shape, t.stride()  # read once: torch.Size slices cost 0.4 us each
    _check_storage(t, name)
    if len(shape) == 5 and shape[1] == 2:
        pages, _, a, b, head_dim = shape
        page_stride, kv_stride, a_stride, b_stride, dim_stride = strides
    elif len(shape) == 4 and shape[1] == 2:  # page size 1
        pages, _, heads, head_dim = shape
        page_stride, kv_stride, head_stride, dim_stride = strides
        a, b, a_stride, b_stride = _squeezed(kv_layout, heads, head_stride, head_dim, dim_stride)
    else:
        raise ValueError(f"{name} must be [num_pages, 2, {_plane_dims(kv_layout)}] (or [num_pages, 2, H, D] for "
                         f"page size 1) for kv_layout {kv_layout}, got shape {tuple(shape)}")
    k_ptr = t.data_ptr()
    rows = _rows(kv_layout, page_stride, a_stride, b_stride, dim_stride, head_dim)
    return _new(t, kv_layout, name, pages, a, b, head_dim, t.dtype, k_ptr,
                k_ptr + kv_stride * _ITEMSIZE[t.dtype], rows, rows, None)


def _unpack_pair(pair, kv_layout: str, name: str) -> PagedKVCache:
    k, v = pair
    for plane, which in ((k, 0), (v, 1)):
        if not isinstance(plane, torch.Tensor):
            raise TypeError(f"{name}[{which}] must be a torch.Tensor, got {type(plane).__name__}")
        _check_storage(plane, f"{name}[{which}]")
    shape = k.shape
    if v.shape != shape:
        raise ValueError(f"{name}: the V cache has shape {tuple(v.shape)} but the K cache has {tuple(shape)}; "
                         "they must match")
    if v.dtype is not k.dtype:
        raise TypeError(f"{name}: the V cache has dtype {v.dtype} but the K cache has {k.dtype}; they must match")
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
        raise ValueError(f"{name}[0] (the K cache) must be [num_pages, {_plane_dims(kv_layout)}] (or "
                         f"[num_pages, H, D] for page size 1) for kv_layout {kv_layout}, got shape {tuple(shape)}")
    return _new(pair, kv_layout, name, pages, a, b, head_dim, k.dtype, k.data_ptr(), v.data_ptr(), k_rows, v_rows,
                planes)


def _check_storage(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _ITEMSIZE:
        raise TypeError(f"{name} has dtype {t.dtype}; a KV cache is float32, bfloat16, float16, "
                        "float8_e4m3fn or float8_e5m2")
    if not t.is_cpu:
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
        raise ValueError(f"{name} has an empty page, head or head_dim dimension (page_size {page_size}, "
                         f"num_kv_heads {heads}, head_dim {head_dim}) in kv_layout {kv_layout}")
    cache = _new_object(PagedKVCache)
    state = cache.__dict__  # filled directly: the generated __init__ pays object.__setattr__ per field (3x slower)
    state.update({"layout": kv_layout, "num_pages": pages, "page_size": page_size, "num_kv_heads": heads,
                  "head_dim": head_dim, "dtype": dtype, "k_ptr": k_ptr, "v_ptr": v_ptr, "source": source,
                  "k_plane_strides": k_rows, "v_plane_strides": v_rows})
    if planes is not None:
        state["k"], state["v"] = planes
    return cache
