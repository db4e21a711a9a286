// reduce_lanes(v): kWidth vectors in, one vector out whose lane i is the sum of v[i]'s lanes.
//
// The many-dot-products-at-once reduction of attention scores: a dot product over head_dim is
// accumulated lane-wise in one vector, and kWidth of them are reduced together by a transpose-and-
// add tree (avx512: 46 shuffles and adds for 16 dots, against ~8 each one at a time).
#pragma once

#include "kernforge/core/vec.h"

namespace kf {

#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)

inline VecF reduce_lanes(const VecF (&v)[16]) {
  // Level 1: each pair's 256-bit halves added; level 2: 128-bit blocks; levels 3-4: within blocks.
  __m512 r[8], s[4], t[2];
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0x44),
                         _mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  }
  // s[k] block i holds 4 partial sums of v[4k + i]. Pair s[0] with s[1], s[2] with s[3].
  for (int i = 0; i < 2; ++i) {
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4i + k of u is the sum of v[i + 4k]: transpose the 4x4 back to lane n = v[n].
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(order, u)};
}

#elif defined(KF_TIER_AVX2)

inline VecF reduce_lanes(const VecF (&v)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0].v, v[1].v), _mm256_hadd_ps(v[2].v, v[3].v));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4].v, v[5].v), _mm256_hadd_ps(v[6].v, v[7].v));
  // a's low 128 bits hold the low-half sums of v[0..3], its high 128 bits their high-half sums.
  return {_mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31))};
}

#else

inline VecF reduce_lanes(const VecF (&v)[VecF::kWidth]) {
  float sums[VecF::kWidth];
  for (int i = 0; i < VecF::kWidth; ++i) sums[i] = reduce_add(v[i]);
  return VecF::load(sums);
}

#endif

}  // namespace kf
