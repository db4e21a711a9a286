// How a GEMM driver walks its output, shared by every element type (bf16 linear, int8 w8a8): tasks
// of NR columns by row_block rows, column block first and one contiguous run of tasks per thread, so
// a thread's columns, and its slice of the packed weight, are contiguous; within a task, the tile
// is accumulated K block by K block, MR rows at a time.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernforge/parallel.h"

namespace kf::gemm {

// Calls task(m0, n0, rows) for every output tile [m0, m0 + rows) x [n0, n0 + NR).
template <int NR, class Task>
inline void for_each_output_tile(int64_t m, int64_t n, int64_t k, int64_t row_block, int64_t min_macs_per_thread,
                                 int64_t num_threads, const Task& task) {
  const int64_t column_blocks = (n + NR - 1) / NR, row_blocks = (m + row_block - 1) / row_block;
  const int64_t tasks = column_blocks * row_blocks;
  const int64_t threads = useful_threads(num_threads, tasks, m * n * std::max<int64_t>(k, 1), min_macs_per_thread);
  parallel_for(tasks, threads, [&](int64_t t) {
    const int64_t n0 = t / row_blocks * NR, m0 = t % row_blocks * row_block;
    task(m0, n0, std::min(row_block, m - m0));
  });
}

// Calls step(row_count, r0, k0, depth) over a tile of `rows` rows: K blocks of depth_block, and
// within each, MR rows at a time (the last step may have fewer).
template <int MR, class Step>
inline void accumulate_tile(int64_t rows, int64_t k, int64_t depth_block, const Step& step) {
  for (int64_t k0 = 0; k0 < k; k0 += depth_block) {
    const int64_t depth = std::min(depth_block, k - k0);
    for (int64_t r0 = 0; r0 < rows; r0 += MR) step(std::min<int64_t>(MR, rows - r0), r0, k0, depth);
  }
}

}  // namespace kf::gemm
