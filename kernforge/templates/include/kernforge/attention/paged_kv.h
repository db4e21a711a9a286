// The paged KV cache as kernels see it (FlashInfer's layout; kernforge/ops/page.py describes it):
// K and V are each a plane of num_pages pages x page_size token slots x num_kv_heads heads, one
// contiguous head_dim row per (page, slot, head), addressed by strides in elements. The NHD and HND
// layouts differ only in which of the token and head strides is larger, so one kernel serves both
// with runtime strides; K and V may have different strides (views into larger buffers).
//
// A request b owns the pages indices[indptr[b] .. indptr[b + 1]) in order; its token `position`
// lives in page indices[indptr[b] + position / page_size], slot position % page_size.
//
// Also here: appending tokens to the cache (append_paged_kv_cache), which validates every index it
// will use before it writes anything.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernforge/core/parallel.h"
#include "kernforge/core/rows.h"
#include "kernforge/core/vec.h"

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

// Where a request's tokens live: the page-table half of the cache.
struct PageTable {
  const int32_t* indices;  // pages, request after request
  const int32_t* indptr;   // request b owns indices[indptr[b] .. indptr[b + 1])
  int64_t page_size;

  // The entry of `indices` naming the page that holds token `position` of `request`.
  int64_t entry(int64_t request, int64_t position) const { return indptr[request] + position / page_size; }
  int64_t page(int64_t request, int64_t position) const { return indices[entry(request, position)]; }
  int64_t slot(int64_t position) const { return position % page_size; }
};

// ---- appending ---------------------------------------------------------------------------------

namespace paged_kv_detail {

// A fixed-size copy: the compiler emits it as one or two register moves, no call.
template <int kBytes>
inline void move(char* dst, const char* src) {
  std::memcpy(dst, src, kBytes);
}

// Copies n bytes inline with wide moves. A call to libc's memcpy per head_dim row (256 bytes for
// bf16 x 128) would cost as much again as the copy itself.
inline void copy_bytes(void* dst_ptr, const void* src_ptr, int64_t n) {
  char* dst = static_cast<char*>(dst_ptr);
  const char* src = static_cast<const char*>(src_ptr);
  int64_t i = 0;
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  for (; i + 64 <= n; i += 64) _mm512_storeu_si512(dst + i, _mm512_loadu_si512(src + i));
  if (i < n) {  // the last partial 64 bytes in one masked move
    const __mmask64 tail = ~uint64_t(0) >> (64 - (n - i));
    _mm512_mask_storeu_epi8(dst + i, tail, _mm512_maskz_loadu_epi8(tail, src + i));
  }
#else
  for (; i + 32 <= n; i += 32) move<32>(dst + i, src + i);
  const int64_t rest = n - i;  // < 32: one fixed-size move per set bit
  if (rest & 16) move<16>(dst + i, src + i), i += 16;
  if (rest & 8) move<8>(dst + i, src + i), i += 8;
  if (rest & 4) move<4>(dst + i, src + i), i += 4;
  if (rest & 2) move<2>(dst + i, src + i), i += 2;
  if (rest & 1) dst[i] = src[i];
#endif
}

}  // namespace paged_kv_detail

// Why an append was refused; the entry point returns (kind << 32) | the offending index.
enum AppendError : int64_t {
  kAppendBadBatchIndex = 1,  // batch_indices[i] outside [0, batch_size)
  kAppendBadPosition = 2,    // positions[i] < 0, or past the pages of its request
  kAppendBadIndptr = 3,      // kv_indptr[b], kv_indptr[b + 1] not a range inside kv_indices
  kAppendBadPage = 4,        // kv_indices[j] outside [0, num_pages)
};

// The tokens to append: token i of `key`/`value` (rows (i, head)) goes to request batch_indices[i]
// at position positions[i].
template <class T>
struct AppendBatch {
  StridedRows<const T> key, value;
  const int32_t* batch_indices;
  const int32_t* positions;
  int64_t num_tokens;
};

inline int64_t append_error(AppendError kind, int64_t index) { return (int64_t(kind) << 32) | index; }

// Checks every index the append will use: 0, or the first error. O(tokens), single-threaded.
template <class T>
inline int64_t check_append(const AppendBatch<T>& batch, const PageTable& table, int64_t batch_size,
                            int64_t num_indices, int64_t num_pages) {
  for (int64_t i = 0; i < batch.num_tokens; ++i) {
    const int64_t request = batch.batch_indices[i], position = batch.positions[i];
    if (request < 0 || request >= batch_size) return append_error(kAppendBadBatchIndex, i);
    const int64_t first = table.indptr[request], end = table.indptr[request + 1];
    if (first < 0 || first > end || end > num_indices) return append_error(kAppendBadIndptr, request);
    if (position < 0 || table.entry(request, position) >= end) return append_error(kAppendBadPosition, i);
    const int64_t page = table.page(request, position);
    if (page < 0 || page >= num_pages) return append_error(kAppendBadPage, table.entry(request, position));
  }
  return 0;
}

// Bytes of K and V rows per thread below which a second thread does not pay for its fork/join.
// Measured on Zen 5 (bf16, 8 heads x 128, rows into a 16 MiB cache, idle machine): 64 tokens
// (256 KiB of rows) take 4.2 us on one thread and 3.2 us on two.
constexpr int64_t kAppendMinBytesPerThread = int64_t(64) << 10;

// append_paged_kv_cache: writes each token's K and V rows into its slot, after check_append
// accepted every index (so a refused call writes nothing). Returns 0 or check_append's error.
// K and V rows may differ in length: append_paged_mla_kv_cache's planes are the latent (key_dim
// 512) and the rope part (value_dim 64, or 0 for MLA without one) of one head.
template <class T>
int64_t append_paged_kv(PagePlane<T> k_cache, PagePlane<T> v_cache, const AppendBatch<T>& batch, const PageTable& table,
                        int64_t batch_size, int64_t num_indices, int64_t num_pages, int64_t num_heads, int64_t key_dim,
                        int64_t value_dim, int64_t num_threads) {
  if (const int64_t error = check_append(batch, table, batch_size, num_indices, num_pages)) return error;
  const int64_t key_bytes = key_dim * int64_t(sizeof(T)), value_bytes = value_dim * int64_t(sizeof(T));
  const int64_t token_bytes = num_heads * (key_bytes + value_bytes);
  const int64_t threads =
      useful_threads(num_threads, batch.num_tokens, batch.num_tokens * token_bytes, kAppendMinBytesPerThread);
  parallel_for(batch.num_tokens, threads, [&](int64_t i) {
    const int64_t position = batch.positions[i];
    const int64_t page = table.page(batch.batch_indices[i], position), slot = table.slot(position);
    for (int64_t head = 0; head < num_heads; ++head) {
      paged_kv_detail::copy_bytes(k_cache.row(page, slot, head), batch.key.row(i, head), key_bytes);
      // MLA without a rope part has no V rows: its empty planes may be at any address, even null.
      if (value_bytes > 0)
        paged_kv_detail::copy_bytes(v_cache.row(page, slot, head), batch.value.row(i, head), value_bytes);
    }
  });
  return 0;
}

}  // namespace kf
