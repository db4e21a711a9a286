// Register-blocked GEMM micro-kernels: C[MR x NR] += A[MR x K] . B[K x NR], accumulated in fp32.
// Every GEMM-shaped kernel (linear layers, prefill attention, fused MoE) builds on these.
//
// B layout, "VNNI-2 pairs": K is taken two rows at a time. For pair p, column j of B is one 32-bit
// word, B[2p][j] in its low half and B[2p+1][j] in its high half; the words of one pair lie
// contiguously, ldb words apart from one pair to the next (ldb >= NR, so a kernel may cover part
// of a wider packed panel). An odd K is padded with a zero row. vdpbf16ps consumes exactly this;
// the other tiers split each word into two fp32 vectors with a shift and a mask (exact: a bf16 is
// the top half of an fp32), so one packing serves every tier.
//
// A is row-major, lda elements between rows, any storage type: bf16 A on AVX512-BF16 is multiplied
// as it is (a pair of A broadcast as one 32-bit word); other types and tiers widen A to fp32 and FMA.
// C is fp32, row-major, ldc floats between rows, read and written whole (MR x NR floats).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernforge/core/isa_features.h"
#include "kernforge/core/vec.h"

namespace kf::gemm {

namespace detail {

inline uint32_t load_word(const void* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));  // A's pairs need not be 4-byte aligned (odd lda)
  return w;
}

// One vector of pair words as two fp32 vectors: the even K row and the odd K row.
inline void split_pairs(const uint32_t* words, VecF& even, VecF& odd) {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  const __m512i w = _mm512_loadu_si512(words);
  even.v = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd.v = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xffff0000u))));
#elif defined(KF_TIER_AVX2)
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
  even.v = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd.v = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
#else
  for (int i = 0; i < VecF::kWidth; ++i) {
    even.lane[i] = bit_cast<float>(words[i] << 16);
    odd.lane[i] = bit_cast<float>(words[i] & 0xffff0000u);
  }
#endif
}

// Widen A, multiply by the widened B pairs, FMA. The last pair of an odd K uses its even row only:
// A[k] does not exist (and B's padding row is zero anyway).
template <int MR, int NR, class T>
inline void micro_kernel_fma(const T* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k, float* c,
                             int64_t ldc) {
  constexpr int kWidth = VecF::kWidth, kVectors = NR / kWidth;
  static_assert(NR % kWidth == 0, "NR must be a multiple of the vector width");
  VecF acc[MR][kVectors];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = VecF::load(c + r * ldc + v * kWidth);
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* row = b + p * ldb;
    VecF a_even[MR], a_odd[MR];
    for (int r = 0; r < MR; ++r) {
      a_even[r] = VecF::broadcast(to_float(a[r * lda + 2 * p]));
      a_odd[r] = VecF::broadcast(to_float(a[r * lda + 2 * p + 1]));
    }
    for (int v = 0; v < kVectors; ++v) {
      VecF even, odd;
      split_pairs(row + v * kWidth, even, odd);
      for (int r = 0; r < MR; ++r) acc[r][v] = fma(a_odd[r], odd, fma(a_even[r], even, acc[r][v]));
    }
  }
  if (k & 1) {
    const uint32_t* row = b + pairs * ldb;
    for (int v = 0; v < kVectors; ++v) {
      VecF even, odd;
      split_pairs(row + v * kWidth, even, odd);
      for (int r = 0; r < MR; ++r) acc[r][v] = fma(VecF::broadcast(to_float(a[r * lda + k - 1])), even, acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v].store(c + r * ldc + v * kWidth);
}

#if KF_HAS_DPBF16
// vdpbf16ps: each lane j adds A[2p] * B[2p][j] + A[2p+1] * B[2p+1][j], 32 products per instruction.
template <int MR, int NR>
inline void micro_kernel_dpbf16(const bf16* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k, float* c,
                                int64_t ldc) {
  constexpr int kVectors = NR / 16;
  static_assert(NR % 16 == 0, "NR must be a multiple of 16");
  __m512 acc[MR][kVectors];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_loadu_ps(c + r * ldc + v * 16);
  const auto step = [&](const uint32_t* row, const uint32_t (&a_words)[MR]) {
    __m512bh pairs_of_b[kVectors];
    for (int v = 0; v < kVectors; ++v) pairs_of_b[v] = (__m512bh)_mm512_loadu_si512(row + v * 16);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a_pair = (__m512bh)_mm512_set1_epi32(int(a_words[r]));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a_pair, pairs_of_b[v]);
    }
  };
  const int64_t pairs = k / 2;
  uint32_t a_words[MR];
  for (int64_t p = 0; p < pairs; ++p) {
    for (int r = 0; r < MR; ++r) a_words[r] = load_word(a + r * lda + 2 * p);
    step(b + p * ldb, a_words);
  }
  if (k & 1) {  // the high half of the pair is zero: A[k] does not exist, and may not be read
    for (int r = 0; r < MR; ++r) a_words[r] = a[r * lda + k - 1].bits;
    step(b + pairs * ldb, a_words);
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
}
#endif

}  // namespace detail

// Whether A of type T is multiplied with vdpbf16ps (else widened to fp32 and FMA'd).
template <class T>
constexpr bool kUsesDpbf16 =
#if KF_HAS_DPBF16
    std::is_same_v<T, bf16>;
#else
    false;
#endif

// C[MR x NR] += A[MR x k] . B[k x NR]; B in pairs as described above.
template <int MR, int NR, class T>
inline void micro_kernel(const T* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k, float* c, int64_t ldc) {
#if KF_HAS_DPBF16
  if constexpr (kUsesDpbf16<T>) {
    detail::micro_kernel_dpbf16<MR, NR>(a, lda, b, ldb, k, c, ldc);
    return;
  }
#endif
  detail::micro_kernel_fma<MR, NR>(a, lda, b, ldb, k, c, ldc);
}

// The same for 1 <= rows <= MR: the M tail runs the kernel instantiated for its row count.
template <int MR, int NR, class T>
inline void micro_kernel_rows(int64_t rows, const T* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k,
                              float* c, int64_t ldc) {
  if constexpr (MR > 1) {
    if (rows < MR) return micro_kernel_rows<MR - 1, NR>(rows, a, lda, b, ldb, k, c, ldc);
  }
  micro_kernel<MR, NR>(a, lda, b, ldb, k, c, ldc);
}

// Default tiles, sized to the register file: accumulators + B vectors + A broadcasts fit in it.
// vdpbf16ps (32 zmm): 8 x 32 -> 16 accumulators, 2 B, 1 A. FMA on AVX-512: 4 x 32 -> 8 accumulators
// and 8 A broadcasts (or memory operands). AVX2 and generic (16 ymm / 8-float arrays): 4 x 16.
// kernforge.ops.gemm.TILE_CANDIDATES ranks these first (the untuned choice) and tunes over a few others.
template <class T>
struct DefaultTile {
  static constexpr int kMR = kUsesDpbf16<T> ? 8 : 4;
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  static constexpr int kNR = 32;
#else
  static constexpr int kNR = 16;
#endif
};

}  // namespace kf::gemm
