// bf16 dot products for attention on AVX512-BF16 (vdpbf16ps: 32 bf16 products per instruction,
// summed in pairs into 16 fp32 lanes): q.k and p.V read bf16 rows as they are, with no widening,
// and do half the instructions of fp32 FMAs.
//
// p.V pairs tokens: the V rows of tokens j and j + 1 are interleaved element by element
// (unpacklo/hi_epi16) and multiplied by the pair (p_j, p_j+1) broadcast as one 32-bit word. The
// interleave works within 128-bit blocks, so a 32-element chunk of the accumulator is kept
// "scrambled": its low vector holds elements 8k..8k+3 of block k, its high vector 8k+4..8k+7;
// unscramble_chunk restores the order once, when the output is written. The probabilities are
// rounded to bf16 (relative error 2^-9, as in GPU kernels' bf16 P.V); the softmax sum stays fp32.
#pragma once

#include "kernforge/core/isa_features.h"

#if KF_HAS_DPBF16

#include <cstdint>

#include "kernforge/core/reduce_lanes.h"
#include "kernforge/core/vec.h"

namespace kf {
namespace bf16_dot {

constexpr int kChunk = 32;  // bf16 elements per vector

inline __m512bh load_pairs(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// kHeads x kTokens dot products over head_dim of unscaled bf16 rows; lane h * kTokens + t.
template <int kHeads, int kTokens, int kHeadDim>
inline VecF score_tile(const bf16* q, const bf16* const (&k)[kTokens]) {
  static_assert(kHeads * kTokens == 16 && kHeadDim % kChunk == 0, "one vector of scores, whole chunks");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int d = 0; d < kHeadDim; d += kChunk) {
    __m512bh kv[kTokens];
    for (int t = 0; t < kTokens; ++t) kv[t] = load_pairs(k[t] + d);
    for (int h = 0; h < kHeads; ++h) {
      const __m512bh qv = load_pairs(q + h * kHeadDim + d);
      for (int t = 0; t < kTokens; ++t) acc[h * kTokens + t] = _mm512_dpbf16_ps(acc[h * kTokens + t], qv, kv[t]);
    }
  }
  VecF sums[16];
  for (int i = 0; i < 16; ++i) sums[i] = VecF{acc[i]};
  return reduce_lanes(sums);
}

// Rounds `count` probabilities (a multiple of 32) to bf16 pairs in place: word i of p becomes
// (p[2i], p[2i+1]). In address order, each step writes below what the later ones read.
inline void pack_probabilities(float* p, int64_t count) {
  for (int64_t j = 0; j < count; j += kChunk) {
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + j + 16), _mm512_loadu_ps(p + j));
    _mm512_storeu_si512(p + j / 2, (__m512i)pairs);
  }
}

// acc[h] (kChunks scrambled 32-element chunks, 2 vectors each) = acc[h] * alpha[h]
//   + sum over token pairs of (p_j, p_j+1) . (V_j, V_j+1), for the tokens [0, count).
// Token j's chunk starts at v[j] + offset; zero (kChunks chunks of zeros) stands in for token
// `count` when count is odd.
// between(), once per token pair, lets the caller interleave its own work (prefetches) evenly.
template <int kHeads, int kChunks, class Between>
inline void accumulate_values(const bf16* const* v, int64_t offset, const bf16* zero, int64_t count,
                              const uint32_t* const* pairs, const float* alpha, float* const* acc,
                              const Between& between) {
  __m512 lo[kHeads][kChunks], hi[kHeads][kChunks];
  for (int h = 0; h < kHeads; ++h) {
    const __m512 a = _mm512_set1_ps(alpha[h]);
    for (int c = 0; c < kChunks; ++c) {
      lo[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[h] + c * kChunk), a);
      hi[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[h] + c * kChunk + 16), a);
    }
  }
  for (int64_t j = 0; j < count; j += 2) {
    between();
    const bf16* first = v[j] + offset;
    const bf16* second = j + 1 < count ? v[j + 1] + offset : zero;
    __m512bh v_lo[kChunks], v_hi[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      const __m512i a = _mm512_loadu_si512(first + c * kChunk), b = _mm512_loadu_si512(second + c * kChunk);
      v_lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      v_hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int h = 0; h < kHeads; ++h) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(int(pairs[h][j / 2]));
      for (int c = 0; c < kChunks; ++c) {
        lo[h][c] = _mm512_dpbf16_ps(lo[h][c], p, v_lo[c]);
        hi[h][c] = _mm512_dpbf16_ps(hi[h][c], p, v_hi[c]);
      }
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kChunks; ++c) {
      _mm512_storeu_ps(acc[h] + c * kChunk, lo[h][c]);
      _mm512_storeu_ps(acc[h] + c * kChunk + 16, hi[h][c]);
    }
  }
}

// A scrambled 32-element accumulator chunk back in element order: 128-bit blocks interleaved,
// [lo.0 hi.0 lo.1 hi.1] and [lo.2 hi.2 lo.3 hi.3].
inline void unscramble_chunk(const float* scrambled, float* out) {
  const __m512 lo = _mm512_loadu_ps(scrambled), hi = _mm512_loadu_ps(scrambled + 16);
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo, second, hi));
}

}  // namespace bf16_dot
}  // namespace kf

#endif  // KF_HAS_DPBF16
