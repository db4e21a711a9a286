// The paged KV cache as kernels see it (FlashInfer's layout; kernforge/ops/page.py describes it):
// K and V are each a plane of num_pages pages x page_size token slots x num_kv_heads heads, one
// contiguous head_dim row per (page, slot, head), addressed by strides in elements. The NHD and HND
// layouts differ only in which of the token and head strides is larger, so one kernel serves both
// with runtime strides; K and V may have different strides (views into larger buffers).
//
// A request b owns the pages indices[indptr[b] .. indptr[b + 1]) in order; its token `position`
// lives in page indices[indptr[b] + position / page_size], slot position % page_size.
#pragma once

#include <cstdint>

namespace kf {

// One plane (K or V) of a paged cache. T is the storage type, const for readers.
template <class T>
struct PagePlane {
  T* base;  // element [0, 0, 0, 0]
  int64_t page_stride, token_stride, head_stride;

  // The head_dim row of (page, slot in the page, head); its elements are contiguous.
  T* row(int64_t page, int64_t token_in_page, int64_t head) const {
    return base + page * page_stride + token_in_page * token_stride + head * head_stride;
  }
};

// Kernel entry points receive the plane as an address and its strides.
template <class T>
inline PagePlane<T> page_plane_at(int64_t address, int64_t page_stride, int64_t token_stride, int64_t head_stride) {
  return {reinterpret_cast<T*>(address), page_stride, token_stride, head_stride};
}

}  // namespace kf
