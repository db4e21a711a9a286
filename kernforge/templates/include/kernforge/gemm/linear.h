// out[m x n] = x[m x k] . W^T (+ bias) with W prepacked in panels of VNNI-2 pairs
// (kernforge/gemm/micro_kernel.h): the packed weight is [n_panels][ceil(k/2)][panel_width] 32-bit
// words, n padded with zero columns to whole panels, k with a zero row to whole pairs.
//
// Work is cut into tasks of (NR columns) x (RowBlock<MR, Rows> rows), by default ordered column block
// first (Split::kN), and each thread takes one contiguous run of tasks: a thread's columns, and so
// its part of the packed weight, are one contiguous slice; rows are split too only where columns run
// short (large M on few panels). A task accumulates its row block x NR tile in an fp32 scratch tile
// over K blocks of Depth, so the B block a micro-kernel call streams (256 x 32 bf16 = 16 KB by
// default) stays in L1 while the row block's MR-row tiles pass over it. The tile, Rows, Depth and
// the split are template parameters: kernforge.ops.gemm.TILE_CANDIDATES tunes them per machine.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernforge/core/isa_features.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"
#include "kernforge/gemm/amx_kernel.h"
#include "kernforge/gemm/micro_kernel.h"
#include "kernforge/gemm/tasks.h"

namespace kf::gemm {

// Rows per task: the most whole MR tiles in Rows rows (60 of 64 for MR = 6).
template <int MR, int Rows = 64>
constexpr int64_t RowBlock = Rows / MR * MR;
constexpr int64_t kDepthBlock = 256;  // the default K block; any K block is even: only the last may end in half a pair
// Multiply-adds per thread before a second thread pays off (a fork/join costs ~1 us).
constexpr int64_t kMinMacsPerThread = 1 << 17;

enum LinearStatus : int64_t { kOk = 0, kBadPanelWidth = 1 };

template <int MR, int NR, int Rows = 64, int Depth = kDepthBlock, Split kSplit = Split::kN, class T>
int64_t packed_linear(T* out, int64_t ldo, const T* x, int64_t ldx, const uint32_t* packed, int64_t panel_width,
                      const T* bias, int64_t m, int64_t n, int64_t k, int64_t num_threads) {
  static_assert(MR >= 1 && MR <= Rows && NR >= 1, "a row block holds at least one tile");
  static_assert(Depth > 0 && Depth % 2 == 0, "K blocks are whole pairs");
  constexpr int64_t kRowBlock = RowBlock<MR, Rows>;
  if (panel_width <= 0 || panel_width % NR != 0) return kBadPanelWidth;
  if (m <= 0 || n <= 0) return kOk;
#if KF_HAS_AMX
  if constexpr (std::is_same_v<T, bf16>) {  // AMX tiles from a few rows on (gemm/amx_kernel.h)
    const auto store = [&](int64_t m0, int64_t n0, int64_t rows, int64_t columns, const float* tile) {
      store_tile<amx::kBlockColumns>(out + m0 * ldo + n0, ldo, tile, bias == nullptr ? nullptr : bias + n0, rows,
                                     columns);
    };
    if (amx::linear_bf16(x, ldx, packed, panel_width, m, n, k, num_threads, store)) return kOk;
  }
#endif
  const int64_t pairs = (k + 1) / 2;
  for_each_output_tile<NR, kSplit>(
      m, n, k, kRowBlock, kMinMacsPerThread, num_threads, [&](int64_t m0, int64_t n0, int64_t rows) {
        // Column n0's words: panel n0 / panel_width, offset n0 % panel_width within each pair.
        const uint32_t* b = packed + (n0 / panel_width) * pairs * panel_width + n0 % panel_width;
        alignas(64) float tile[RowBlock<MR, Rows> * NR];  // not kRowBlock: gcc 12 ICEs on it in this lambda
        std::fill_n(tile, rows * NR, 0.0f);  // only the rows used: a one-row task would clear 8 KB for 128 bytes
        accumulate_tile<MR>(rows, k, Depth, [&](int64_t row_count, int64_t r0, int64_t k0, int64_t depth) {
          micro_kernel_rows<MR, NR>(row_count, x + (m0 + r0) * ldx + k0, ldx, b + k0 / 2 * panel_width, panel_width,
                                    depth, tile + r0 * NR, NR);
        });
        store_tile<NR>(out + m0 * ldo + n0, ldo, tile, bias == nullptr ? nullptr : bias + n0, rows,
                       std::min<int64_t>(NR, n - n0));
      });
  return kOk;
}

}  // namespace kf::gemm
