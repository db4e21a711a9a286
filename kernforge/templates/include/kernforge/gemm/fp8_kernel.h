// fp8 block-scaled GEMM (DeepSeek-V3 style, sgl-kernel's CPU fp8_scaled_mm semantics):
//   out[m][n] = sum_kb scale[n / bn][kb] * sum_{k in block kb} x[m][k] * W[n][k]  (+ bias[n]),
// W e4m3fn [N, K], one fp32 scale per (bn x bk) block of W. The weight stays fp8 in memory and is
// widened to fp32 in registers (VecF::load of fp8, every tier), so each weight byte is read once per
// use, a quarter of the bf16 GEMM's weight traffic.
//
// Because the scale changes at every K block, the micro-kernel accumulates one K block into fresh
// registers and then adds (block sum * column scales) into the fp32 tile; the driver's depth block is
// the weight's bk, so a step never straddles two scales.
//
// B layout: N in panels of panel_width columns; within a panel, K rows of panel_width bytes (row k
// holds W[n0 .. n0 + panel_width)[k]), so NR consecutive columns of one k are one contiguous load.
// N is padded with zero weights to whole panels. The block scales are read as given, [ceil(N / bn),
// ceil(K / bk)] fp32: a task gathers its NR columns' scales once per K block (any bn, not only
// multiples of NR), so the micro-kernel scales with one vector load.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernforge/gemm/tasks.h"
#include "kernforge/parallel.h"
#include "kernforge/vec.h"

namespace kf::gemm::fp8 {

// kWidth weights at p, widened. With AVX2/AVX-512 (F16C) an e4m3 byte becomes an fp16 in three integer
// ops: sign-extend to 16 bits and shift left by 7 puts the magnitude bits at fp16's exponent and
// mantissa (bits 13..7) and the sign at bits 15 and 14; clearing bit 14 leaves exactly value * 2^-8
// (fp16's exponent bias is 8 more than e4m3's; subnormals map to subnormals), which vcvtph2ps widens.
// kWeightScale (2^8) is folded into the block scales. That is half the work of VecF's exact widening,
// at the price of NaN codes (S.1111.111) reading as +-480 / 2^8: the packer rejects NaN weights.
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
constexpr float kWeightScale = 256.0f;
inline VecF load_weights(const fp8_e4m3* p) {
  const __m256i halves = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(halves, 7), _mm256_set1_epi16(int16_t(0xbfff))))};
}
#elif defined(KF_TIER_AVX2)
constexpr float kWeightScale = 256.0f;
inline VecF load_weights(const fp8_e4m3* p) {
  const __m128i halves = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(halves, 7), _mm_set1_epi16(int16_t(0xbfff))))};
}
#else
constexpr float kWeightScale = 1.0f;
inline VecF load_weights(const fp8_e4m3* p) { return VecF::load(p); }
#endif

// C[MR x NR] += (A[MR x depth] . B[depth x NR] / kWeightScale) * scale[0 .. NR): A row-major (lda elements between
// rows), B fp8 rows of ldb bytes, C fp32 (ldc between rows).
template <int MR, int NR, class T>
inline void micro_kernel(const T* a, int64_t lda, const fp8_e4m3* b, int64_t ldb, const float* scale, int64_t depth,
                         float* c, int64_t ldc) {
  constexpr int kWidth = VecF::kWidth, kVectors = NR / kWidth;
  static_assert(NR % kWidth == 0, "NR must be a multiple of the vector width");
  VecF acc[MR][kVectors];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = VecF::zero();
  for (int64_t k = 0; k < depth; ++k) {
    VecF b_vec[kVectors];
    for (int v = 0; v < kVectors; ++v) b_vec[v] = load_weights(b + k * ldb + v * kWidth);
    for (int r = 0; r < MR; ++r) {
      const VecF a_k = VecF::broadcast(to_float(a[r * lda + k]));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = fma(a_k, b_vec[v], acc[r][v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const VecF s = VecF::load(scale + v * kWidth);
    for (int r = 0; r < MR; ++r) {
      float* out = c + r * ldc + v * kWidth;
      fma(acc[r][v], s, VecF::load(out)).store(out);
    }
  }
}

// The same for 1 <= rows <= MR: the M tail runs the kernel instantiated for its row count.
template <int MR, int NR, class T>
inline void micro_kernel_rows(int64_t rows, const T* a, int64_t lda, const fp8_e4m3* b, int64_t ldb,
                              const float* scale, int64_t depth, float* c, int64_t ldc) {
  if constexpr (MR > 1) {
    if (rows < MR) return micro_kernel_rows<MR - 1, NR>(rows, a, lda, b, ldb, scale, depth, c, ldc);
  }
  micro_kernel<MR, NR>(a, lda, b, ldb, scale, depth, c, ldc);
}

// MR x NR accumulators plus NR / width widened B vectors and one broadcast: AVX-512 4 x 64 is 16 + 4
// of 32 zmm; AVX2 4 x 16 is 8 + 2 of 16 ymm (the fp8 widening needs a few temporaries); generic 4 x 16.
struct DefaultTile {
  static constexpr int kMR = 4;
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  static constexpr int kNR = 64;
#else
  static constexpr int kNR = 16;
#endif
};

constexpr int64_t kRowBlock = 64;                        // a multiple of every MR
constexpr int64_t kMinMacsPerThread = int64_t(1) << 16;  // a fork/join (~1 us) buys this much work

enum Status : int64_t { kOk = 0, kBadPanelWidth = 1, kBadBlockSize = 2 };

// out = x . dequant(W)^T (+ bias): x [m x k] (lda), packed as above, scales [ceil(n / block_n) x
// ceil(k / block_k)] fp32 contiguous, bias fp32 [n] or null, out [m x n] (ldo).
template <int MR, int NR, class T, class Out>
int64_t scaled_mm(const T* x, int64_t lda, const fp8_e4m3* packed, int64_t panel_width, const float* scales,
                  int64_t block_n, int64_t block_k, const float* bias, Out* out, int64_t ldo, int64_t m, int64_t n,
                  int64_t k, int64_t num_threads) {
  static_assert(kRowBlock % MR == 0, "a row block holds whole tiles");
  if (panel_width <= 0 || panel_width % NR != 0) return kBadPanelWidth;
  if (block_n <= 0 || block_k <= 0) return kBadBlockSize;
  if (m <= 0 || n <= 0) return kOk;
  const int64_t k_blocks = (k + block_k - 1) / block_k;
  for_each_output_tile<NR>(m, n, k, kRowBlock, kMinMacsPerThread, num_threads, [&](int64_t m0, int64_t n0,
                                                                                  int64_t rows) {
    // Column n0 of row k: panel n0 / panel_width, offset n0 % panel_width within each row.
    const fp8_e4m3* b = packed + (n0 / panel_width) * k * panel_width + n0 % panel_width;
    alignas(64) float tile[kRowBlock * NR];
    std::fill_n(tile, rows * NR, 0.0f);
    const int64_t columns = std::min<int64_t>(NR, n - n0);
    alignas(64) float column_scale[NR] = {};  // columns past n keep 0 (their weights are 0 too)
    int64_t scale_block = -1;
    accumulate_tile<MR>(rows, k, block_k, [&](int64_t row_count, int64_t r0, int64_t k0, int64_t depth) {
      if (k0 / block_k != scale_block) {
        scale_block = k0 / block_k;
        for (int64_t j = 0; j < columns; ++j)
          column_scale[j] = scales[(n0 + j) / block_n * k_blocks + scale_block] * kWeightScale;
      }
      micro_kernel_rows<MR, NR>(row_count, x + (m0 + r0) * lda + k0, lda, b + k0 * panel_width, panel_width,
                                column_scale, depth, tile + r0 * NR, NR);
    });
    constexpr int kWidth = VecF::kWidth;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < columns; j += kWidth) {
        VecF v = VecF::load(tile + r * NR + j, columns - j);
        if (bias != nullptr) v += VecF::load(bias + n0 + j, columns - j);
        v.store(out + (m0 + r) * ldo + n0 + j, columns - j);
      }
  });
  return kOk;
}

}  // namespace kf::gemm::fp8
