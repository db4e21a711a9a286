// Row-wise kernel plumbing shared by norm.h and activation.h: strided row addressing, a per-row
// vector loop with a partial tail, and an OpenMP loop that forks only when it pays.
#pragma once

#include <algorithm>
#include <cstdint>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "kernforge/vec.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

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

// Calls op(j, count) for consecutive vectors covering [begin, end): count is VecF::kWidth except
// for a shorter last one. In the main loop count is a compile-time constant, so the partial
// load/store branches vanish there. Four vectors per step put independent dependency chains
// (e.g. four exps) next to each other, which the out-of-order core overlaps.
template <class Op>
inline void for_each_vector(int64_t begin, int64_t end, const Op& op) {
  constexpr int64_t kWidth = VecF::kWidth;
  int64_t j = begin;
  for (; j + 4 * kWidth <= end; j += 4 * kWidth) {
    op(j, kWidth);
    op(j + kWidth, kWidth);
    op(j + 2 * kWidth, kWidth);
    op(j + 3 * kWidth, kWidth);
  }
  for (; j + kWidth <= end; j += kWidth) op(j, kWidth);
  if (j < end) op(j, end - j);
}

// Threads worth using: at most `requested` (<= 0 means OpenMP's default), at most one per task,
// and at most one per `min_elements_per_thread` elements of work. An OpenMP fork/join costs ~1 us
// here, so small jobs must stay on the calling thread; each kernel measures its own break-even.
inline int64_t useful_threads(int64_t requested, int64_t num_tasks, int64_t total_elements,
                              int64_t min_elements_per_thread) {
#if defined(_OPENMP)
  if (requested <= 0) requested = omp_get_max_threads();
#else
  requested = 1;
#endif
  const int64_t by_work = std::max<int64_t>(1, total_elements / min_elements_per_thread);
  return std::min({requested, num_tasks, by_work});
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

// Runs body(task) for task in [0, num_tasks), each thread taking one contiguous block of tasks;
// with num_threads <= 1 it runs inline, without touching OpenMP.
template <class Body>
inline void parallel_for(int64_t num_tasks, int64_t num_threads, const Body& body) {
  if (num_threads <= 1) {
    for (int64_t task = 0; task < num_tasks; ++task) body(task);
    return;
  }
#pragma omp parallel for num_threads(int(num_threads)) schedule(static)
  for (int64_t task = 0; task < num_tasks; ++task) body(task);
}

}  // namespace kf
