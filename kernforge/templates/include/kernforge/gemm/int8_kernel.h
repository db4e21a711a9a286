// int8 w8a8 GEMM (sgl-kernel's CPU int8_scaled_mm semantics): out = (A_q . W_q^T) * a_scale[m] * w_scale[n]
// (+ bias), with per-token activation quantization and per-channel symmetric int8 weights.
//
// Activations are int8 values shifted to uint8 (a + 128), which is what vpdpbusd multiplies (u8 x s8).
// The shift is undone with a per-column compensation computed once at pack time:
//   sum_k a[k] w[k] = sum_k (a[k] + 128) w[k] - 128 * sum_k w[k],
// so the kernel accumulates u8 x s8 products exactly in int32 and subtracts compensation[n].
//
// B layout, "VNNI-4 groups": K is taken four rows at a time. For group g, column j of B is one
// 32-bit word holding W[j][4g .. 4g+3] (the lowest K in the low byte); the words of a group lie
// contiguously, ldb words apart from one group to the next. K is padded with zero weights to whole
// groups, so an A group that runs past K multiplies zeros (and A itself is never read past K).
// One packing serves every tier: the micro-kernel is kf::dot4_u8s8 on kf::VecI32 columns (the vector
// layer, core/vec.h), which is vpdpbusd on the word as it is with VNNI, vpmaddwd on the bytes widened
// to int16 pairs without, and the same in scalar code on the generic tier.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernforge/core/isa_features.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"
#include "kernforge/gemm/amx_kernel.h"
#include "kernforge/gemm/tasks.h"

namespace kf::gemm::int8 {

constexpr int kGroup = 4;  // K elements per 32-bit word of packed B
constexpr int32_t kActivationZeroPoint = 128;
constexpr float kMinAbsMax = 1e-7f;  // sgl-kernel's eps: an all-zero row gets a tiny scale, not 0

namespace detail {

// A's group g of one row as a word; the last group of a K that is not a multiple of 4 reads only
// the bytes that exist (B's padding is zero, so the missing bytes' value does not matter).
inline uint32_t load_group(const uint8_t* row, int64_t g, int64_t k) {
  uint32_t word = 0;
  std::memcpy(&word, row + g * kGroup, size_t(std::min<int64_t>(kGroup, k - g * kGroup)));
  return word;
}

}  // namespace detail

// C[MR x NR] += A[MR x k] . B[k x NR] in int32: A uint8 row-major (lda bytes between rows), B packed in
// VNNI-4 groups (ldb words between groups), C int32 row-major (ldc between rows), read and written whole.
template <int MR, int NR>
inline void micro_kernel(const uint8_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k, int32_t* c,
                         int64_t ldc) {
  using namespace detail;
  constexpr int kLanes = VecI32::kWidth, kVectors = NR / kLanes;
  static_assert(NR % kLanes == 0, "NR must be a multiple of the int32 vector width");
  VecI32 acc[MR][kVectors];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = VecI32::load(c + r * ldc + v * kLanes);
  const auto step = [&](const uint32_t* group, const uint32_t (&a_words)[MR]) {
    VecI32 b_vec[kVectors];
    for (int v = 0; v < kVectors; ++v) b_vec[v] = VecI32::load(group + v * kLanes);
    for (int r = 0; r < MR; ++r) {
      const U8Quad a_op = U8Quad::broadcast(a_words[r]);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = dot4_u8s8(acc[r][v], a_op, b_vec[v]);
    }
  };
  const int64_t full_groups = k / kGroup, groups = (k + kGroup - 1) / kGroup;
  uint32_t a_words[MR];
  for (int64_t g = 0; g < full_groups; ++g) {
    for (int r = 0; r < MR; ++r) std::memcpy(&a_words[r], a + r * lda + g * kGroup, sizeof(uint32_t));
    step(b + g * ldb, a_words);
  }
  if (groups > full_groups) {
    for (int r = 0; r < MR; ++r) a_words[r] = load_group(a + r * lda, full_groups, k);
    step(b + full_groups * ldb, a_words);
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v].store(c + r * ldc + v * kLanes);
}

// The same for 1 <= rows <= MR: the M tail runs the kernel instantiated for its row count.
template <int MR, int NR>
inline void micro_kernel_rows(int64_t rows, const uint8_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k,
                              int32_t* c, int64_t ldc) {
  if constexpr (MR > 1) {
    if (rows < MR) return micro_kernel_rows<MR - 1, NR>(rows, a, lda, b, ldb, k, c, ldc);
  }
  micro_kernel<MR, NR>(a, lda, b, ldb, k, c, ldc);
}

// Default tiles, sized to the register file. vpdpbusd: 4 x 64 -> 16 accumulators, 4 B, 1 A (sgl-kernel's
// 4 x 64 too). vpmaddwd needs the widened A and B halves besides: 4 x 32 on AVX-512, 4 x 16 on AVX2
// (8 of 16 ymm accumulate). Generic: 4 x 16 in arrays the compiler vectorizes.
struct DefaultTile {
  static constexpr int kMR = 4;
#if KF_HAS_VNNI
  static constexpr int kNR = 64;
#elif defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  static constexpr int kNR = 32;
#else
  static constexpr int kNR = 16;
#endif
};

// --------------------------------------------------------------------------- activation quantization

// sgl-kernel's quantize_row_int8: scale = max(amax, 1e-7) / 127, q = round(x * (127 / amax)) + 128 as
// uint8, rounding half to even (its AVX-512 path, and torch.round). Returns the scale: NaN for a row
// holding NaN (or Inf, whose x * (127 / amax) is NaN), so the row's output is NaN as sgl-kernel's
// (its vectorized max propagates NaN into the scale) and torch's are; such an element's code is 128.
template <class T>
inline float quantize_row(uint8_t* q, const T* x, int64_t k) {
  constexpr int kWidth = VecF::kWidth;
  VecF amax = VecF::zero();
  for (int64_t j = 0; j < k; j += kWidth) amax = max(amax, abs(VecF::load(x + j, k - j)));
  const float absmax = std::max(reduce_max(amax), kMinAbsMax);
  const VecF inv_scale = VecF::broadcast(127.0f / absmax);
  alignas(64) float rounded[kWidth];
  bool finite = true;
  for (int64_t j = 0; j < k; j += kWidth) {
    rint(VecF::load(x + j, k - j) * inv_scale).store(rounded);
    const int64_t count = std::min<int64_t>(kWidth, k - j);
    for (int64_t i = 0; i < count; ++i) {
      const bool number = rounded[i] == rounded[i];  // converting NaN to an int is undefined
      finite &= number;
      q[j + i] = uint8_t((number ? int32_t(rounded[i]) : 0) + kActivationZeroPoint);
    }
  }
  return finite ? absmax / 127.0f : std::numeric_limits<float>::quiet_NaN();
}

template <class T>
inline void quantize_rows(uint8_t* q, int64_t ldq, float* scales, const T* x, int64_t ldx, int64_t m, int64_t k,
                          int64_t num_threads) {
  const int64_t threads = useful_threads(num_threads, m, m * k, int64_t(1) << 16);
  parallel_for(m, threads, [&](int64_t row) { scales[row] = quantize_row(q + row * ldq, x + row * ldx, k); });
}

// --------------------------------------------------------------------------- the GEMM driver

constexpr int64_t kRowBlock = 64;     // a multiple of every MR
constexpr int64_t kDepthBlock = 256;  // a multiple of kGroup: a B block of 256 x 64 bytes stays in L1
constexpr int64_t kMinMacsPerThread = int64_t(1) << 18;  // a fork/join (~1 us) buys this much int8 work

enum Status : int64_t { kOk = 0, kBadPanelWidth = 1 };

// Runs the int32 GEMM of a [m x k] (uint8) by the packed weight, handing each finished tile to
// epilogue(m0, n0, rows, columns, tile) with tile[r * NR + j] = sum_k (a + 128) w, before compensation.
// Tasks are (NR columns) x (kRowBlock rows), column block first, a contiguous run per thread: a thread's
// columns, and so its slice of the packed weight, are contiguous.
template <int MR, int NR, class Epilogue>
int64_t gemm(const uint8_t* a, int64_t lda, const uint32_t* packed, int64_t panel_width, int64_t m, int64_t n,
             int64_t k, int64_t num_threads, const Epilogue& epilogue) {
  static_assert(kRowBlock % MR == 0 && kDepthBlock % kGroup == 0, "blocks hold whole tiles and groups");
  if (panel_width <= 0 || panel_width % NR != 0) return kBadPanelWidth;
  if (m <= 0 || n <= 0) return kOk;
#if KF_HAS_AMX  // AMX tiles from a few rows on (gemm/amx_kernel.h): the same int32 sums
  if (amx::gemm_u8s8<NR>(a, lda, packed, panel_width, m, n, k, num_threads, epilogue)) return kOk;
#endif
  const int64_t groups = (k + kGroup - 1) / kGroup;
  for_each_output_tile<NR>(
      m, n, k, kRowBlock, kMinMacsPerThread, num_threads, [&](int64_t m0, int64_t n0, int64_t rows) {
        // Column n0's words: panel n0 / panel_width, offset n0 % panel_width within each group.
        const uint32_t* b = packed + (n0 / panel_width) * groups * panel_width + n0 % panel_width;
        alignas(64) int32_t tile[kRowBlock * NR];
        std::fill_n(tile, rows * NR, 0);
        accumulate_tile<MR>(rows, k, kDepthBlock, [&](int64_t row_count, int64_t r0, int64_t k0, int64_t depth) {
          micro_kernel_rows<MR, NR>(row_count, a + (m0 + r0) * lda + k0, lda, b + k0 / kGroup * panel_width,
                                    panel_width, depth, tile + r0 * NR, NR);
        });
        epilogue(m0, n0, rows, std::min<int64_t>(NR, n - n0), static_cast<const int32_t*>(tile));
      });
  return kOk;
}

// out[m][n] = float(acc - compensation[n]) * a_scale[m] * w_scale[n] (+ bias[n]), as sgl-kernel's
// int8_scaled_mm; bias fp32 or null.
template <int NR, class T>
struct DequantEpilogue {
  T* out;
  int64_t ldo;
  const float* a_scale;
  const int32_t* compensation;
  const float* w_scale;
  const float* bias;

  void operator()(int64_t m0, int64_t n0, int64_t rows, int64_t columns, const int32_t* tile) const {
    constexpr int kWidth = VecF::kWidth;
    alignas(64) float row[NR];
    for (int64_t r = 0; r < rows; ++r) {
      const float scale = a_scale[m0 + r];
      for (int64_t j = 0; j < columns; ++j) row[j] = float(tile[r * NR + j] - compensation[n0 + j]) * scale;
      for (int64_t j = 0; j < columns; j += kWidth) {
        VecF v = VecF::load(row + j, columns - j) * VecF::load(w_scale + n0 + j, columns - j);
        if (bias != nullptr) v += VecF::load(bias + n0 + j, columns - j);
        v.store(out + (m0 + r) * ldo + n0 + j, columns - j);
      }
    }
  }
};

// out[m][n] = acc - compensation[n]: the exact int32 product of the int8 operands (for tests and for
// callers that dequantize themselves).
template <int NR>
struct Int32Epilogue {
  int32_t* out;
  int64_t ldo;
  const int32_t* compensation;

  void operator()(int64_t m0, int64_t n0, int64_t rows, int64_t columns, const int32_t* tile) const {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < columns; ++j) out[(m0 + r) * ldo + n0 + j] = tile[r * NR + j] - compensation[n0 + j];
  }
};

}  // namespace kf::gemm::int8
