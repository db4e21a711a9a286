// Row-wise kernel plumbing shared by the row-wise op headers (norm.h, activation.h, rope.h and
// attention/): strided row addressing and non-temporal stores for large outputs. (The vector loop is
// in loops.h, threads in parallel.h.)
#pragma once

#include <cstdint>

#include "kernforge/core/intrinsics.h"  // _mm_sfence, behind the gcc-12 warning guard
#include "kernforge/core/vec.h"

namespace kf {

// A batch of rows indexed (i0, i1); each row's elements are contiguous. Strides are in elements
// and 64-bit: tensors and strides may exceed 2^31.
template <class T>
struct StridedRows {
  T* base;
  int64_t stride0;
  int64_t stride1;

  T* row(int64_t i0, int64_t i1) const { return base + i0 * stride0 + i1 * stride1; }
};

// Kernel entry points receive tensors as integer addresses.
template <class T>
inline StridedRows<T> rows_at(int64_t address, int64_t stride0, int64_t stride1) {
  return {reinterpret_cast<T*>(address), stride0, stride1};
}

// Outputs at least this large are written with non-temporal stores. They cannot stay in the L3 for
// the next op anyway, and a regular store first reads each line in (read-for-ownership): a third
// more memory traffic for a streaming kernel. Smaller outputs keep regular stores, so the next op
// finds them in cache.
constexpr int64_t kStreamingMinBytes = int64_t(32) << 20;

// Whether a kernel writing `bytes` of output to rows starting at `row` streams them: only rows
// aligned to a vector's bytes, so every full vector of the row is aligned too.
template <class T>
inline bool streams(int64_t bytes, const T* row) {
  return bytes >= kStreamingMinBytes && reinterpret_cast<uintptr_t>(row) % (VecF::kWidth * sizeof(T)) == 0;
}

// Stores v's first `count` lanes at p; full vectors of a streaming row bypass the caches.
template <class T>
inline void store_out(VecF v, T* p, int64_t count, bool stream) {
  if (stream && count == VecF::kWidth) {
    v.stream(p);
  } else {
    v.store(p, count);
  }
}

// Non-temporal stores are weakly ordered: fence them before the results are handed to other threads.
inline void fence_streaming_stores(bool streamed) {
#if defined(__SSE2__)
  if (streamed) _mm_sfence();
#else
  (void)streamed;
#endif
}

}  // namespace kf
