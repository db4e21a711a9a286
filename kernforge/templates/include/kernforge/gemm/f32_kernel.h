// The fp32 companion of micro_kernel.h: C[MR x NR] += A[MR x K] . B[K x NR] with B plain fp32 rows
// (ldb floats apart) instead of bf16 pairs, for operands that bf16 would round (fp16 and fp32
// attention, where the reference tolerance is tighter than bf16's). A is any storage type, widened.
#pragma once

#include <cstdint>

#include "kernforge/core/vec.h"

namespace kf::gemm {

template <int MR, int NR, class T>
inline void micro_kernel_f32(const T* a, int64_t lda, const float* b, int64_t ldb, int64_t k, float* c, int64_t ldc) {
  constexpr int kWidth = VecF::kWidth, kVectors = NR / kWidth;
  static_assert(NR % kWidth == 0, "NR must be a multiple of the vector width");
  VecF acc[MR][kVectors];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = VecF::load(c + r * ldc + v * kWidth);
  for (int64_t i = 0; i < k; ++i) {
    VecF b_row[kVectors];
    for (int v = 0; v < kVectors; ++v) b_row[v] = VecF::load(b + i * ldb + v * kWidth);
    for (int r = 0; r < MR; ++r) {
      const VecF a_ri = VecF::broadcast(to_float(a[r * lda + i]));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = fma(a_ri, b_row[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v].store(c + r * ldc + v * kWidth);
}

// The same for 1 <= rows <= MR.
template <int MR, int NR, class T>
inline void micro_kernel_f32_rows(int64_t rows, const T* a, int64_t lda, const float* b, int64_t ldb, int64_t k,
                                  float* c, int64_t ldc) {
  if constexpr (MR > 1) {
    if (rows < MR) return micro_kernel_f32_rows<MR - 1, NR>(rows, a, lda, b, ldb, k, c, ldc);
  }
  micro_kernel_f32<MR, NR>(a, lda, b, ldb, k, c, ldc);
}

}  // namespace kf::gemm
