// RMSNorm, optionally fused with the residual add (FlashInfer semantics), optionally Gemma-style
// (scale by 1 + weight). Written once against kf::VecF.
//
// Each row is read twice: pass 1 accumulates the sum of squares, pass 2 re-reads the row (now hot
// in L1/L2) and writes the scaled result. Accumulation is fp32; outputs are rounded once.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernforge/core/loops.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/rows.h"
#include "kernforge/core/vec.h"

namespace kf {

namespace norm_detail {

// Sum of squares of the fp32 row produced by load(j, count), one accumulator per chain of
// for_each_vector: four independent accumulators hide the FMA latency; without -ffast-math the
// compiler may not reassociate to do this itself.
template <class Load>
inline float sum_of_squares(int64_t n, const Load& load) {
  Chains acc = Chains::of(0.0f);
  for_each_vector(0, n, [&](int chain, int64_t j, int64_t count) {
    const VecF v = load(j, count);
    acc.v[chain] = fma(v, v, acc.v[chain]);
  });
  return reduce_add(acc.sum());
}

inline VecF inverse_rms(float sum_of_squares, int64_t n, double eps) {
  return VecF::broadcast(float(1.0 / std::sqrt(double(sum_of_squares) / double(n) + eps)));
}

template <bool kGemma, class T>
inline VecF load_scale(const T* weight, int64_t j, int64_t count) {
  const VecF w = VecF::load(weight + j, count);
  return kGemma ? w + VecF::broadcast(1.0f) : w;
}

// out = x / rms(x) * scale
template <bool kGemma, class T>
inline void rmsnorm_row(T* out, const T* x, const T* weight, int64_t n, double eps, bool stream) {
  const auto load_x = [&](int64_t j, int64_t count) { return VecF::load(x + j, count); };
  const VecF inv_rms = inverse_rms(sum_of_squares(n, load_x), n, eps);
  for_each_vector(0, n, [&](int, int64_t j, int64_t count) {
    store_out(load_x(j, count) * inv_rms * load_scale<kGemma>(weight, j, count), out + j, count, stream);
  });
}

// s = x + residual (fp32); residual = s; out = s / rms(s) * scale.
// The fp32 sum, not its rounded copy in `residual`, is normalized, so pass 2 recomputes it from
// x and the not-yet-overwritten residual instead of re-reading a rounded value. `out` may alias
// `x`: every element is read before it is written.
template <bool kGemma, class T>
inline void fused_add_rmsnorm_row(T* out, T* residual, const T* x, const T* weight, int64_t n, double eps) {
  const auto load_sum = [&](int64_t j, int64_t count) {
    return VecF::load(x + j, count) + VecF::load(residual + j, count);
  };
  const VecF inv_rms = inverse_rms(sum_of_squares(n, load_sum), n, eps);
  for_each_vector(0, n, [&](int, int64_t j, int64_t count) {
    const VecF sum = load_sum(j, count);
    sum.store(residual + j, count);
    (sum * inv_rms * load_scale<kGemma>(weight, j, count)).store(out + j, count);
  });
}

}  // namespace norm_detail

// Rows are split across threads only above this many elements per thread. Measured on Zen 5 (bf16,
// hidden 4096): one thread takes 1.9 us for 8 rows, where forking two takes 2.7 us; the two
// threads win from 16 rows on.
constexpr int64_t kNormMinElementsPerThread = 32 * 1024;

// Normalizes the n0 x n1 rows of `hidden` elements each. With kFusedAdd, `residual` is updated in
// place and `out` receives the normalized sum (FlashInfer passes out == input).
template <class T, bool kFusedAdd, bool kGemma>
void rmsnorm(StridedRows<T> out, StridedRows<const T> input, StridedRows<T> residual, const T* weight, int64_t n0,
             int64_t n1, int64_t hidden, double eps, int64_t num_threads) {
  const int64_t num_rows = n0 * n1;
  if (num_rows <= 0 || hidden <= 0) return;
  const int64_t threads = useful_threads(num_threads, num_rows, num_rows * hidden, kNormMinElementsPerThread);
  parallel_for(num_rows, threads, [&](int64_t r) {
    const int64_t i0 = r / n1, i1 = r % n1;
    if constexpr (kFusedAdd) {
      norm_detail::fused_add_rmsnorm_row<kGemma>(out.row(i0, i1), residual.row(i0, i1), input.row(i0, i1), weight,
                                                 hidden, eps);
    } else {
      // In-place fused rows rewrite lines they just read; only out-of-place output may stream.
      T* out_row = out.row(i0, i1);
      const bool stream = streams(num_rows * hidden * int64_t(sizeof(T)), out_row);
      norm_detail::rmsnorm_row<kGemma>(out_row, input.row(i0, i1), weight, hidden, eps, stream);
      fence_streaming_stores(stream);
    }
  });
}

}  // namespace kf
