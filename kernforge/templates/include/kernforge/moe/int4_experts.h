// Four-bit experts for fused_experts (kernforge/moe/experts.h): the Product policies that multiply a
// block of routed rows by NR columns of one expert's int4 weight, on gemm/int4_kernel.h's kernels:
// * Int4W4A8Weights: rows quantized per row to int8 (uint8 + 128 with an fp32 scale, as the int8
//   experts' are), each group's exact int32 sums scaled by the group's scales, then by the row's;
// * Int4W4A16Weights<T>: rows as they are (bf16, fp16, fp32), fp32 sums per group, scaled.
// The MoE work split (experts.h's passes, their tasks and threads) is unchanged: a Product is one
// task's tile, called from inside the pass's own parallel loop.
//
// Layout (kernforge.ops.moe.pack_experts_int4): per expert and part, kernforge.ops.gemm.int4's packing
// of a [part_n, k] weight: uint8 nibbles [panels of 64][k / 4][128], zero points uint8 [G][part_n],
// scales fp32 [G][part_n]. They travel in PackedExperts' slots: `words` the nibbles, `compensation`
// the zero points (as bytes), `scale` the scales, `block_k` the group size (K values per scale).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernforge/gemm/int4_kernel.h"
#include "kernforge/moe/experts.h"

namespace kf::moe {

// A task's tile on gemm/int4_kernel.h's per-task functions (decode from the nibbles, unpacked blocks
// scaled in registers, AMX tiles), up to this header's kRowBlock rows.
using Int4Blocking = gemm::int4::Blocking<kRowBlock, 4>;

// Expert `expert`'s part `part` of a packed int4 weight as the int4 kernels' problem (rows rows).
inline gemm::int4::Problem int4_problem(const PackedExperts& w, int64_t expert, int64_t part, int64_t rows) {
  namespace int4 = gemm::int4;
  const int64_t part_n = w.n / w.parts, groups = w.k / w.block_k;
  const int64_t part_bytes =
      (part_n + int4::kPanelWidth - 1) / int4::kPanelWidth * (w.k / int4::kQuad) * int4::kQuadBytes;
  const int64_t index = w.part_index(expert, part);
  const auto* packed = reinterpret_cast<const uint8_t*>(w.words) + index * part_bytes;
  const auto* zeros = reinterpret_cast<const uint8_t*>(w.compensation) + index * groups * part_n;
  return {packed, zeros, w.scale + index * groups * part_n, nullptr, rows, part_n, w.k, w.block_k};
}

// W4A8: a is uint8 (int8 + 128) with per-row scales.
class Int4W4A8Weights {
 public:
  using A = uint8_t;
  static constexpr int kMR = gemm::int4::W4A8Tile::kMR, kNR = gemm::int4::W4A8Tile::kNR;
  static constexpr bool kQuantized = true;

  void operator()(float* tile, int64_t rows, const A* a, int64_t lda, const float* a_scale, const PackedExperts& w,
                  int64_t expert, int64_t part, int64_t n0) {
    gemm::int4::w4a8_task<kMR, kNR, Int4Blocking>(int4_problem(w, expert, part, rows), a, lda, rows, n0, tile);
    for (int64_t r = 0; r < rows; ++r) {
      const VecF row_scale = VecF::broadcast(a_scale[r]);
      for (int j = 0; j < kNR; j += VecF::kWidth)
        (VecF::load(tile + r * kNR + j) * row_scale).store(tile + r * kNR + j);
    }
  }
};

// W4A16: a in the activations' type, as it is.
template <class T>
class Int4W4A16Weights {
 public:
  using A = T;
  static constexpr int kMR = gemm::int4::W4A16Tile<T>::kMR, kNR = gemm::int4::W4A16Tile<T>::kNR;
  static constexpr bool kQuantized = false;

  void operator()(float* tile, int64_t rows, const A* a, int64_t lda, const float*, const PackedExperts& w,
                  int64_t expert, int64_t part, int64_t n0) {
    gemm::int4::w4a16_task<kMR, kNR, Int4Blocking>(int4_problem(w, expert, part, rows), a, lda, rows, n0, tile);
  }
};

}  // namespace kf::moe
