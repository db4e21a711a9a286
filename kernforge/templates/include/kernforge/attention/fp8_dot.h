// fp8 KV rows fed to the bf16 dot products (bf16_dot.h) on AVX512-BF16 + AVX512-VBMI.
//
// Every fp8 value (e4m3 and e5m2 alike, subnormals included) is exactly a bf16, so a row converts
// by table lookup, 64 bytes at a time: vpermt2b looks up the low and the high byte of the bf16 of
// each byte's 7 magnitude bits (two 128-entry tables, two registers each; the instruction reads
// index bits 6:0, so the sign bit is ignored), one vpternlogd ORs the sign into the high byte, and
// unpacklo/hi_epi8 pair the bytes into 64 bf16: 5 instructions per 64 values, against 6 per 16 to
// widen e4m3 to fp32. The unpacks work within 128-bit blocks, so the two bf16 vectors hold the row
// in "split" order: `first` has elements 16k..16k+7 in block k, `second` 16k+8..16k+15.
//
// q.k is a sum, so no reordering is needed if q is stored in the same split order (arrange_q,
// once per head). p.V pairs tokens as bf16_dot does: the two rows' bytes are interleaved first
// and looked up together (convert_pair), so a 64-element chunk of the accumulator is four vectors,
// vector c holding elements 16k + 4c .. 16k + 4c + 3 in block k; unscramble_chunk restores the
// order once, when the output is written. NaN (e4m3 S.1111.111; e5m2 exponent 31 with a
// mantissa) becomes a NaN.
#pragma once

#include "kernforge/attention/bf16_dot.h"
#include "kernforge/core/isa_features.h"

#if KF_HAS_FP8_DOT

#include <cstdint>

#include "kernforge/core/reduce_lanes.h"
#include "kernforge/core/types.h"
#include "kernforge/core/vec.h"

namespace kf {
namespace fp8_dot {

constexpr int kChunk = 64;  // fp8 elements per load, bf16 elements per split pair

template <class FP8>
struct Format;
template <>
struct Format<fp8_e4m3> {
  static constexpr int kMantissaBits = 3, kBias = 7;
  static constexpr bool is_nan(int magnitude) { return magnitude == 0x7f; }  // no infinities
  static constexpr bool is_inf(int) { return false; }
};
template <>
struct Format<fp8_e5m2> {
  static constexpr int kMantissaBits = 2, kBias = 15;
  static constexpr bool is_nan(int magnitude) { return magnitude > 0x7c; }
  static constexpr bool is_inf(int magnitude) { return magnitude == 0x7c; }
};

// bf16 bits of the fp8 value with these 7 magnitude bits (sign clear). Exact: bf16 has the wider
// exponent and the wider mantissa; a subnormal fp8 (exponent 0) is normalized.
template <class FP8>
constexpr uint16_t magnitude_to_bf16(int magnitude) {
  using F = Format<FP8>;
  if (F::is_nan(magnitude)) return 0x7fc0;
  if (F::is_inf(magnitude)) return 0x7f80;
  const int exponent = magnitude >> F::kMantissaBits, mantissa = magnitude & ((1 << F::kMantissaBits) - 1);
  if (exponent != 0) return uint16_t((exponent - F::kBias + 127) << 7 | mantissa << (7 - F::kMantissaBits));
  if (mantissa == 0) return 0;
  int top = F::kMantissaBits - 1;  // subnormal: mantissa * 2^(1 - bias - mantissa bits)
  while (!(mantissa >> top)) --top;
  const int value_exponent = top + 1 - F::kBias - F::kMantissaBits;
  return uint16_t((value_exponent + 127) << 7 | ((mantissa - (1 << top)) << (7 - top)));
}

// The lookup tables: low and high byte of the bf16 of each magnitude.
struct Tables {
  alignas(64) uint8_t low[128];
  alignas(64) uint8_t high[128];
};

template <class FP8>
constexpr Tables make_tables() {
  Tables t{};
  for (int m = 0; m < 128; ++m) {
    t.low[m] = uint8_t(magnitude_to_bf16<FP8>(m) & 0xff);
    t.high[m] = uint8_t(magnitude_to_bf16<FP8>(m) >> 8);
  }
  return t;
}

template <class FP8>
inline constexpr Tables kTables = make_tables<FP8>();

// The tables in registers; one per kernel call, reused for every row.
template <class FP8>
struct Converter {
  __m512i low0, low1, high0, high1, sign;

  Converter()
      : low0(_mm512_load_si512(kTables<FP8>.low)),
        low1(_mm512_load_si512(kTables<FP8>.low + 64)),
        high0(_mm512_load_si512(kTables<FP8>.high)),
        high1(_mm512_load_si512(kTables<FP8>.high + 64)),
        sign(_mm512_set1_epi8(char(0x80))) {}

  // 64 fp8 bytes -> their 64 bf16, unpacked within 128-bit blocks: `first` holds bytes
  // 16k..16k+7 of each block k, `second` 16k+8..16k+15.
  void widen(__m512i bytes, __m512i& first, __m512i& second) const {
    const __m512i low = _mm512_permutex2var_epi8(low0, bytes, low1);
    const __m512i high = _mm512_permutex2var_epi8(high0, bytes, high1);
    const __m512i signed_high = _mm512_ternarylogic_epi32(high, bytes, sign, 0xF8);  // high | (bytes & sign)
    first = _mm512_unpacklo_epi8(low, signed_high);
    second = _mm512_unpackhi_epi8(low, signed_high);
  }

  // 64 fp8 at p -> 64 bf16 in split order (see the top of the file).
  void convert(const FP8* p, __m512i& first, __m512i& second) const { widen(_mm512_loadu_si512(p), first, second); }

  // 64 fp8 of two rows a and b -> their bf16 interleaved by element for p.V: words[c] holds, in
  // block k, the pairs (a[e], b[e]) of elements e = 16k + 4c .. 16k + 4c + 3. The bytes are paired
  // before the lookup, so each lookup serves both rows: 12 instructions after the loads, not 14.
  void convert_pair(const FP8* a, const FP8* b, __m512i (&words)[4]) const {
    const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
    widen(_mm512_unpacklo_epi8(x, y), words[0], words[1]);
    widen(_mm512_unpackhi_epi8(x, y), words[2], words[3]);
  }
};

// 64 fp8 at src -> 64 bf16 at dst in element order (the split halves' 128-bit blocks interleaved).
template <class FP8>
inline void convert_chunk(const Converter<FP8>& table, const FP8* src, bf16* dst) {
  const __m512i low_half = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);  // qwords of first | second
  const __m512i high_half = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  __m512i first, second;
  table.convert(src, first, second);
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi64(first, low_half, second));
  _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi64(first, high_half, second));
}

// A bf16 row of head_dim elements (a multiple of kChunk) rearranged in place into split order,
// 64-element chunk by chunk: [elements 16k..16k+7 of each block k][16k+8..16k+15].
template <int kHeadDim>
inline void arrange_q(bf16* row) {
  static_assert(kHeadDim % kChunk == 0, "whole chunks");
  const __m512i first = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13);  // qwords: 4 bf16 each
  const __m512i second = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
  for (int d = 0; d < kHeadDim; d += kChunk) {
    const __m512i a = _mm512_loadu_si512(row + d), b = _mm512_loadu_si512(row + d + 32);
    _mm512_storeu_si512(row + d, _mm512_permutex2var_epi64(a, first, b));
    _mm512_storeu_si512(row + d + 32, _mm512_permutex2var_epi64(a, second, b));
  }
}

// kHeads x kTokens dot products over head_dim of q (bf16, split order, unscaled) and fp8 K rows
// (unscaled); lane h * kTokens + t.
template <int kHeads, int kTokens, int kHeadDim, class FP8>
inline VecF score_tile(const bf16* q, const FP8* const (&k)[kTokens]) {
  static_assert(kHeads * kTokens == 16 && kHeadDim % kChunk == 0, "one vector of scores, whole chunks");
  const Converter<FP8> table;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int d = 0; d < kHeadDim; d += kChunk) {
    for (int t = 0; t < kTokens; ++t) {
      __m512i first, second;
      table.convert(k[t] + d, first, second);
      for (int h = 0; h < kHeads; ++h) {
        const bf16* qh = q + h * kHeadDim + d;
        acc[h * kTokens + t] = _mm512_dpbf16_ps(acc[h * kTokens + t], bf16_dot::load_pairs(qh), (__m512bh)first);
        acc[h * kTokens + t] = _mm512_dpbf16_ps(acc[h * kTokens + t], bf16_dot::load_pairs(qh + 32), (__m512bh)second);
      }
    }
  }
  VecF sums[16];
  for (int i = 0; i < 16; ++i) sums[i] = VecF{acc[i]};
  return reduce_lanes(sums);
}

// acc[h] (kChunks scrambled 64-element chunks, 4 vectors each) = acc[h] * alpha[h]
//   + sum over token pairs of (p_j, p_j+1) . (V_j, V_j+1), for the tokens [0, count).
// Token j's chunk starts at v[j] + offset; zero (kChunks chunks of zero bytes) stands in for token
// `count` when count is odd. kHeads * kChunks <= 4 keeps the accumulators in registers.
// between(), once per token pair, lets the caller interleave its own work (prefetches) evenly.
template <int kHeads, int kChunks, class FP8, class Between>
inline void accumulate_values(const FP8* const* v, int64_t offset, const FP8* zero, int64_t count,
                              const uint32_t* const* pairs, const float* alpha, float* const* acc,
                              const Between& between) {
  static_assert(kHeads * kChunks <= 4, "16 accumulators at most");
  const Converter<FP8> table;
  __m512 sums[kHeads][kChunks][4];
  for (int h = 0; h < kHeads; ++h) {
    const __m512 a = _mm512_set1_ps(alpha[h]);
    for (int c = 0; c < kChunks; ++c) {
      for (int i = 0; i < 4; ++i) sums[h][c][i] = _mm512_mul_ps(_mm512_loadu_ps(acc[h] + c * kChunk + 16 * i), a);
    }
  }
  for (int64_t j = 0; j < count; j += 2) {
    between();
    const FP8* first_row = v[j] + offset;
    const FP8* second_row = j + 1 < count ? v[j + 1] + offset : zero;
    __m512i words[kChunks][4];
    for (int c = 0; c < kChunks; ++c) table.convert_pair(first_row + c * kChunk, second_row + c * kChunk, words[c]);
    for (int h = 0; h < kHeads; ++h) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(int(pairs[h][j / 2]));
      for (int c = 0; c < kChunks; ++c) {
        for (int i = 0; i < 4; ++i) sums[h][c][i] = _mm512_dpbf16_ps(sums[h][c][i], p, (__m512bh)words[c][i]);
      }
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kChunks; ++c) {
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc[h] + c * kChunk + 16 * i, sums[h][c][i]);
    }
  }
}

// A scrambled 64-element accumulator chunk back in element order: output block k of vector n is
// block n of scrambled vector k (a 4 x 4 transpose of 128-bit blocks).
inline void unscramble_chunk(const float* scrambled, float* out) {
  __m512 s[4], t[4];
  for (int i = 0; i < 4; ++i) s[i] = _mm512_loadu_ps(scrambled + 16 * i);
  t[0] = _mm512_shuffle_f32x4(s[0], s[1], 0x44);  // s0.b0 s0.b1 s1.b0 s1.b1
  t[1] = _mm512_shuffle_f32x4(s[2], s[3], 0x44);
  t[2] = _mm512_shuffle_f32x4(s[0], s[1], 0xEE);  // s0.b2 s0.b3 s1.b2 s1.b3
  t[3] = _mm512_shuffle_f32x4(s[2], s[3], 0xEE);
  _mm512_storeu_ps(out, _mm512_shuffle_f32x4(t[0], t[1], 0x88));  // s0.b0 s1.b0 s2.b0 s3.b0
  _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  _mm512_storeu_ps(out + 32, _mm512_shuffle_f32x4(t[2], t[3], 0x88));
  _mm512_storeu_ps(out + 48, _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
}

}  // namespace fp8_dot
}  // namespace kf

#endif  // KF_HAS_FP8_DOT
