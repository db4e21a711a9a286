// How a GEMM driver walks its output, shared by every element type (bf16 linear, int8 w8a8): tasks
// of NR columns by row_block rows, one contiguous run of tasks per thread, by default column block
// first, so a thread's columns, and its slice of the packed weight, are contiguous; within a task,
// the tile is accumulated K block by K block, MR rows at a time, and stored with store_tile.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"

namespace kf::gemm {

// Which dimension consecutive tasks, and so the threads' contiguous runs of them, split first.
enum class Split {
  kN,  // a column block's row blocks in turn: a thread reads its own slice of the weight, once
  kM,  // a row block's column blocks in turn: a thread reads all of the weight, its rows of x stay in cache
};

// Calls task(m0, n0, rows) for every output tile [m0, m0 + rows) x [n0, n0 + NR). Either split
// falls back on the other dimension where its own has fewer blocks than threads.
template <int NR, Split kSplit = Split::kN, class Task>
inline void for_each_output_tile(int64_t m, int64_t n, int64_t k, int64_t row_block, int64_t min_macs_per_thread,
                                 int64_t num_threads, const Task& task) {
  const int64_t column_blocks = (n + NR - 1) / NR, row_blocks = (m + row_block - 1) / row_block;
  const int64_t tasks = column_blocks * row_blocks;
  const int64_t threads = useful_threads(num_threads, tasks, m * n * std::max<int64_t>(k, 1), min_macs_per_thread);
  parallel_for(tasks, threads, [&](int64_t t) {
    const int64_t column_block = kSplit == Split::kN ? t / row_blocks : t % column_blocks;
    const int64_t row_block_index = kSplit == Split::kN ? t % row_blocks : t / column_blocks;
    const int64_t m0 = row_block_index * row_block;
    task(m0, column_block * NR, std::min(row_block, m - m0));
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

// Adds bias (if any; any storage type) to a rows x NR fp32 tile and writes its first `columns`
// columns to out (ldo elements between rows).
template <int NR, class T, class Bias>
inline void store_tile(T* out, int64_t ldo, const float* tile, const Bias* bias, int64_t rows, int64_t columns) {
  constexpr int kWidth = VecF::kWidth;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < columns; j += kWidth) {
      VecF v = VecF::load(tile + r * NR + j);
      if (bias != nullptr) v += VecF::load(bias + j, columns - j);
      v.store(out + r * ldo + j, columns - j);
    }
  }
}

}  // namespace kf::gemm
