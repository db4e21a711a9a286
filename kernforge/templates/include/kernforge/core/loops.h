// The vector loop of every kernel: for_each_vector walks [begin, end) in kf::VecF vectors, four
// independent ones per step, ending in a partial vector or (for threshold passes) scalar elements;
// Chains holds one accumulator per independent vector of a step.
#pragma once

#include <cstdint>

#include "kernforge/core/vec.h"

namespace kf {

// Vectors per main-loop step. Each is its own dependency chain: four exps (say) next to each other
// are overlapped by the out-of-order core, and a reduction that keeps one accumulator per chain
// hides the add/FMA latency, which a single accumulator would pay on every vector (in sampling's
// passes over L2, twice the time of the pass). Without -ffast-math the compiler may not reassociate
// a reduction to do this itself.
constexpr int kChains = 4;

// Calls op(chain, j, count) for consecutive vectors covering [begin, end). The main loop hands out
// kChains full vectors per step, as chains 0, 1, 2, 3; the full vectors after it come one at a
// time as chain 0, then a shorter last one (count = end - j < VecF::kWidth) as chain 0. count is
// VecF::kWidth, a compile-time constant, in every call but the last, so the partial load/store
// branches vanish from the loops.
//
// The four calls of a step are written out, so chain is a constant and each chain's accumulator
// stays in registers; on the generic tier they stay a loop over the chains instead. There a VecF is
// two SSE registers, four chains of accumulators no longer fit the sixteen, and gcc 12 either
// spills them or vectorizes across steps with shuffles: measured on Zen 5 (1 thread, 8 rows of
// 128K), sampling_from_probs takes 840 us written out against 190 us as a loop.
template <class Op>
inline void for_each_vector(int64_t begin, int64_t end, const Op& op) {
  constexpr int64_t kWidth = VecF::kWidth;
  int64_t j = begin;
  for (; j + kChains * kWidth <= end; j += kChains * kWidth) {
#if defined(KF_TIER_GENERIC)
    for (int chain = 0; chain < kChains; ++chain) op(chain, j + chain * kWidth, kWidth);
#else
    static_assert(kChains == 4, "four calls written out");
    op(0, j, kWidth);
    op(1, j + kWidth, kWidth);
    op(2, j + 2 * kWidth, kWidth);
    op(3, j + 3 * kWidth, kWidth);
#endif
  }
  for (; j + kWidth <= end; j += kWidth) op(0, j, kWidth);
  if (j < end) op(0, j, end - j);
}

// The same loop with a scalar tail: op(chain, j) for the full vectors of [begin, end), then
// tail(i) for each element after them. For passes that compare entries with a threshold: a padding
// lane of a partial vector (loaded as 0) could pass a comparison with a threshold <= 0.
template <class VecOp, class TailOp>
inline void for_each_vector(int64_t begin, int64_t end, const VecOp& op, const TailOp& tail) {
  for_each_vector(begin, end, [&](int chain, int64_t j, int64_t count) {
    if (count == VecF::kWidth) {
      op(chain, j);
    } else {
      for (int64_t i = j; i < j + count; ++i) tail(i);
    }
  });
}

// Accumulators, one per chain of for_each_vector, combined in a fixed order.
struct Chains {
  VecF v[kChains];

  static Chains of(float x) {
    Chains c;
    for (VecF& a : c.v) a = VecF::broadcast(x);
    return c;
  }
  VecF sum() const { return (v[0] + v[1]) + (v[2] + v[3]); }
  VecF max() const { return kf::max(kf::max(v[0], v[1]), kf::max(v[2], v[3])); }
};
static_assert(kChains == 4, "Chains::sum and Chains::max combine four chains");

}  // namespace kf
