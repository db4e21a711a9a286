// AVX2 tier (AVX2 + FMA + F16C): kf::VecF holds 8 fp32 lanes in one ymm register.
// AVX2 has no 8- or 16-bit masked load/store, so bf16/fp16/fp8 tails go through a small stack buffer.
#pragma once

#include "kernforge/core/intrinsics.h"

#include <cstring>

#include "kernforge/core/types.h"

namespace kf {

struct VecF {
  static constexpr int kWidth = 8;
  __m256 v;

  static VecF zero() { return {_mm256_setzero_ps()}; }
  static VecF broadcast(float x) { return {_mm256_set1_ps(x)}; }

  // Full loads/stores touch kWidth elements; the (p, count) forms touch min(count, kWidth),
  // reading zeros into the missing lanes.
  static VecF load(const fp32* p) { return {_mm256_loadu_ps(p)}; }
  static VecF load(const bf16* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static VecF load(const fp16* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }

  static VecF load(const fp32* p, int64_t count) {
    if (count >= kWidth) return load(p);
    return {_mm256_maskload_ps(p, tail_mask(count))};  // masked-off lanes are not accessed
  }
  // fp8: 8 bytes -> 8 lanes, decoded in registers (the hot loop of fp8 attention reads these).
  static VecF load(const fp8_e4m3* p) { return widen_e4m3(load_8_bytes(p)); }
  static VecF load(const fp8_e5m2* p) { return widen_e5m2(load_8_bytes(p)); }

  template <class Narrow>  // bf16, fp16, fp8_e4m3 or fp8_e5m2
  static VecF load(const Narrow* p, int64_t count) {
    static_assert(sizeof(Narrow) <= 2, "narrow storage types only");
    if (count >= kWidth) return load(p);
    Narrow staged[kWidth] = {};
    std::memcpy(staged, p, count * sizeof(Narrow));
    return load(staged);
  }

  void store(fp32* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_bf16()); }
  void store(fp16* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_fp16()); }

  // Non-temporal full stores (bypass the caches); p must be aligned to the bytes stored.
  void stream(fp32* p) const { _mm256_stream_ps(p, v); }
  void stream(bf16* p) const { _mm_stream_si128(reinterpret_cast<__m128i*>(p), narrow_bf16()); }
  void stream(fp16* p) const { _mm_stream_si128(reinterpret_cast<__m128i*>(p), narrow_fp16()); }

  void store(fp32* p, int64_t count) const {
    if (count >= kWidth) return store(p);
    _mm256_maskstore_ps(p, tail_mask(count), v);
  }
  // fp8 stores narrow lane by lane with kf::from_float (exact, torch's rounding, not vectorized):
  // for writing caches, not for hot loops.
  void store(fp8_e4m3* p) const { store_lanes(p); }
  void store(fp8_e5m2* p) const { store_lanes(p); }

  template <class Narrow>  // bf16, fp16, fp8_e4m3 or fp8_e5m2
  void store(Narrow* p, int64_t count) const {
    static_assert(sizeof(Narrow) <= 2, "narrow storage types only");
    if (count >= kWidth) return store(p);
    Narrow staged[kWidth];
    store(staged);
    std::memcpy(p, staged, count * sizeof(Narrow));
  }

 private:
  // All-ones in lanes [0, count).
  static __m256i tail_mask(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }

  static VecF widen_bf16(__m128i h) { return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))}; }

  template <class Fp8>
  static __m128i load_8_bytes(const Fp8* p) {
    return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  }

  // e4m3 in 8 ops per 8 lanes: the 7 magnitude bits go to fp32 bits 20..26, where as an fp32 they
  // are the fp8 value times 2^-120 (exponent field = the fp8 exponent, bias 127 instead of 7; an
  // fp8 subnormal is an fp32 subnormal with the same mantissa), so one multiply by 2^120 rebiases
  // normals and subnormals alike, exactly. Needs MXCSR.DAZ off (the default), else fp8 subnormals
  // read as 0. NaN lanes (magnitude 0x7f) take torch's NaN, 0x7ff00000; the sign bit,
  // sign-extended into bit 31 by the widening, is or-ed in last.
  static VecF widen_e4m3(__m128i bytes) {
    const __m256i shifted = _mm256_slli_epi32(_mm256_cvtepi8_epi32(bytes), 20);  // bit 31 = sign
    const __m256i nan_magnitude = _mm256_set1_epi32(0x07f00000);
    const __m256i magnitude = _mm256_and_si256(shifted, nan_magnitude);
    const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, nan_magnitude));
    const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(0x1p120f));
    const __m256 nan_or_value = _mm256_blendv_ps(value, _mm256_castsi256_ps(_mm256_set1_epi32(0x7ff00000)), is_nan);
    const __m256 sign = _mm256_and_ps(_mm256_castsi256_ps(shifted), _mm256_set1_ps(-0.0f));
    return {_mm256_or_ps(nan_or_value, sign)};
  }

  // e5m2 in 2 ops per 8 lanes: interleaving zero bytes below makes each byte the top half of an
  // fp16, which vcvtph2ps widens exactly (Inf/NaN included, NaNs quieted as torch does).
  static VecF widen_e5m2(__m128i bytes) { return {_mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), bytes))}; }

  template <class Fp8>
  void store_lanes(Fp8* p) const {
    alignas(32) float lanes[kWidth];
    _mm256_store_ps(lanes, v);
    for (int i = 0; i < kWidth; ++i) p[i] = from_float<Fp8>(lanes[i]);
  }

  __m128i narrow_fp16() const { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

  // Same rounding as kf::float_to_bf16_bits: add 0x7fff plus the kept LSB, keep the top half.
  __m128i narrow_bf16() const {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i kept_lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(kept_lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i quiet_nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    const __m256i top_halves = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet_nan, is_nan), 16);
    // Values fit in 16 bits, so the unsigned-saturating pack is a plain narrowing.
    return _mm_packus_epi32(_mm256_castsi256_si128(top_halves), _mm256_extracti128_si256(top_halves, 1));
  }
};

struct MaskF {
  __m256 m;
};

inline VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VecF operator-(VecF a) { return {_mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f))}; }
inline VecF& operator+=(VecF& a, VecF b) { return a = a + b; }
inline VecF& operator*=(VecF& a, VecF b) { return a = a * b; }

// a * b + c with a single rounding.
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF abs(VecF a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
// |magnitude| with the sign bit of sign_source.
inline VecF copysign(VecF magnitude, VecF sign_source) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  return {_mm256_or_ps(_mm256_andnot_ps(sign_bit, magnitude.v), _mm256_and_ps(sign_bit, sign_source.v))};
}
// min(max(x, lo), hi), but a NaN x stays NaN (vmaxps/vminps return their second operand on NaN).
inline VecF clamp(VecF x, VecF lo, VecF hi) { return {_mm256_min_ps(hi.v, _mm256_max_ps(lo.v, x.v))}; }
// Round to the nearest integral value, ties to even.
inline VecF rint(VecF x) { return {_mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }

// x * 2^n for integral-valued n in [-252, 254], as x * 2^(n - m) * 2^m with m = clamp(n, -126, 127):
// both factors are normal floats. The first is 1 unless n is outside [-126, 127], and then the
// first multiply is exact whenever the result is not 0 or Inf anyway, so results that overflow
// become Inf and results in the subnormal range are rounded once, by the last multiply.
inline VecF ldexp(VecF x, VecF n) {
  const __m256i n_int = _mm256_cvtps_epi32(n.v);
  const __m256i last = _mm256_min_epi32(_mm256_max_epi32(n_int, _mm256_set1_epi32(-126)), _mm256_set1_epi32(127));
  const __m256i first = _mm256_sub_epi32(n_int, last);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 scale_first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, bias), 23));
  const __m256 scale_last = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(last, bias), 23));
  return {_mm256_mul_ps(_mm256_mul_ps(x.v, scale_first), scale_last)};
}

inline float reduce_add(VecF a) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

inline VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline float reduce_max(VecF a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Ordered comparisons: false for NaN lanes.
inline MaskF operator<(VecF a, VecF b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)}; }
inline MaskF operator>=(VecF a, VecF b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_GE_OQ)}; }
inline VecF select(MaskF m, VecF if_true, VecF if_false) { return {_mm256_blendv_ps(if_false.v, if_true.v, m.m)}; }
// Bit i set where lane i is set.
inline uint32_t to_bits(MaskF m) { return uint32_t(_mm256_movemask_ps(m.m)); }
// acc + (m ? v : 0).
inline VecF add_if(MaskF m, VecF acc, VecF v) { return {_mm256_add_ps(acc.v, _mm256_and_ps(m.m, v.v))}; }
// Writes v's lanes where m is set, packed, at dst; returns how many. dst needs kWidth writable
// floats (the AVX-512 form stores a whole vector).
inline int compress_store(float* dst, MaskF m, VecF v) {
  alignas(32) float lanes[VecF::kWidth];
  _mm256_store_ps(lanes, v.v);
  int kept = 0;
  for (uint32_t bits = to_bits(m); bits; bits &= bits - 1) dst[kept++] = lanes[__builtin_ctz(bits)];
  return kept;
}

// ---- int32 lanes for the int8 kernels (the contract: vec.h)

struct VecI32 {
  static constexpr int kWidth = 8;
  __m256i v;

  static VecI32 zero() { return {_mm256_setzero_si256()}; }
  static VecI32 load(const void* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
  void store(int32_t* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
};

// vpmaddwd on int16 lanes (vec.h), a's bytes 0, 2 in `even`, bytes 1, 3 in `odd`.
struct U8Quad {
  __m256i even, odd;
  static U8Quad broadcast(uint32_t word) {
    const __m256i w = _mm256_set1_epi32(int(word));
    return {_mm256_and_si256(w, _mm256_set1_epi16(0x00ff)), _mm256_srli_epi16(w, 8)};
  }
};
inline VecI32 dot4_u8s8(VecI32 acc, const U8Quad& a, VecI32 b) {
  const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b.v, 8), 8), b_odd = _mm256_srai_epi16(b.v, 8);
  return {
      _mm256_add_epi32(acc.v, _mm256_add_epi32(_mm256_madd_epi16(a.even, b_even), _mm256_madd_epi16(a.odd, b_odd)))};
}

}  // namespace kf
