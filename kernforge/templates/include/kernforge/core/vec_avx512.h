// AVX-512 tier (F/BW/VL/DQ): kf::VecF holds 16 fp32 lanes in one zmm register.
// Tails use AVX-512 masked loads/stores, which never touch (or fault on) masked-off memory
// (fp8 partial stores write only lanes below count, one by one).
#pragma once

#include "kernforge/core/intrinsics.h"

#include "kernforge/core/isa_features.h"
#include "kernforge/core/types.h"

namespace kf {

struct VecF {
  static constexpr int kWidth = 16;
  __m512 v;

  static VecF zero() { return {_mm512_setzero_ps()}; }
  static VecF broadcast(float x) { return {_mm512_set1_ps(x)}; }

  // Full loads/stores touch kWidth elements; the (p, count) forms touch min(count, kWidth),
  // reading zeros into the missing lanes.
  static VecF load(const fp32* p) { return {_mm512_loadu_ps(p)}; }
  static VecF load(const bf16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static VecF load(const fp16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }

  static VecF load(const fp32* p, int64_t count) {
    if (count >= kWidth) return load(p);
    return {_mm512_maskz_loadu_ps(tail_mask(count), p)};
  }
  static VecF load(const bf16* p, int64_t count) {
    if (count >= kWidth) return load(p);
    return widen_bf16(_mm256_maskz_loadu_epi16(tail_mask(count), p));
  }
  static VecF load(const fp16* p, int64_t count) {
    if (count >= kWidth) return load(p);
    return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(count), p))};
  }

  // fp8: 16 bytes -> 16 lanes, decoded in registers (the hot loop of fp8 attention reads these).
  static VecF load(const fp8_e4m3* p) { return widen_e4m3(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static VecF load(const fp8_e5m2* p) { return widen_e5m2(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static VecF load(const fp8_e4m3* p, int64_t count) {
    if (count >= kWidth) return load(p);
    return widen_e4m3(_mm_maskz_loadu_epi8(tail_mask(count), p));
  }
  static VecF load(const fp8_e5m2* p, int64_t count) {
    if (count >= kWidth) return load(p);
    return widen_e5m2(_mm_maskz_loadu_epi8(tail_mask(count), p));
  }

  void store(fp32* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16()); }
  void store(fp16* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_fp16()); }

  // Non-temporal full stores (bypass the caches); p must be aligned to the bytes stored.
  void stream(fp32* p) const { _mm512_stream_ps(p, v); }
  void stream(bf16* p) const { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), narrow_bf16()); }
  void stream(fp16* p) const { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), narrow_fp16()); }

  void store(fp32* p, int64_t count) const {
    if (count >= kWidth) return store(p);
    _mm512_mask_storeu_ps(p, tail_mask(count), v);
  }
  void store(bf16* p, int64_t count) const {
    if (count >= kWidth) return store(p);
    _mm256_mask_storeu_epi16(p, tail_mask(count), narrow_bf16());
  }
  void store(fp16* p, int64_t count) const {
    if (count >= kWidth) return store(p);
    _mm256_mask_storeu_epi16(p, tail_mask(count), narrow_fp16());
  }

  // fp8 stores narrow lane by lane with kf::from_float (exact, torch's rounding, not vectorized):
  // for writing caches, not for hot loops.
  void store(fp8_e4m3* p) const { store_lanes(p, kWidth); }
  void store(fp8_e5m2* p) const { store_lanes(p, kWidth); }
  void store(fp8_e4m3* p, int64_t count) const { store_lanes(p, count < kWidth ? count : kWidth); }
  void store(fp8_e5m2* p, int64_t count) const { store_lanes(p, count < kWidth ? count : kWidth); }

 private:
  // Lanes [0, count) set; count in [0, kWidth].
  static __mmask16 tail_mask(int64_t count) { return __mmask16(0xffffu >> (kWidth - count)); }

  static VecF widen_bf16(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }

  // e4m3 in 6 ops per 16 lanes (sign-extend, shift, and, compare, masked multiply, ternlog):
  // the 7 magnitude bits go to fp32 bits 20..26, where as an fp32 they are the fp8 value times
  // 2^-120 (its exponent field is the fp8 exponent, bias 127 instead of 7; an fp8 subnormal is an
  // fp32 subnormal with the same mantissa), so one multiply by 2^120 rebiases normals and
  // subnormals alike, exactly. Needs MXCSR.DAZ off (the default), else fp8 subnormals read as 0.
  // The NaN lanes (magnitude 0x7f) skip the multiply and take torch's NaN, 0x7ff00000; the sign
  // bit, sign-extended into bit 31 by the widening, is or-ed in last.
  static VecF widen_e4m3(__m128i bytes) {
    const __m512i shifted = _mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20);  // bit 31 = sign
    const __m512i magnitude = _mm512_and_si512(shifted, _mm512_set1_epi32(0x07f00000));
    const __mmask16 finite = _mm512_cmpneq_epi32_mask(magnitude, _mm512_set1_epi32(0x07f00000));
    const __m512 value = _mm512_mask_mul_ps(_mm512_castsi512_ps(_mm512_set1_epi32(0x7ff00000)), finite,
                                            _mm512_castsi512_ps(magnitude), _mm512_set1_ps(0x1p120f));
    // value | (shifted & sign bit)
    return {_mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(_mm512_castps_si512(value), shifted, _mm512_set1_epi32(int(0x80000000u)), 0xf8))};
  }

  // e5m2 in 3 ops per 16 lanes: each byte is the top half of an fp16 (zero-extend, shift, vcvtph2ps;
  // exact, Inf/NaN included, NaNs quieted as torch does).
  static VecF widen_e5m2(__m128i bytes) { return {_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8))}; }

  template <class Fp8>
  void store_lanes(Fp8* p, int64_t count) const {
    alignas(64) float lanes[kWidth];
    _mm512_store_ps(lanes, v);
    for (int64_t i = 0; i < count; ++i) p[i] = from_float<Fp8>(lanes[i]);
  }

  __m256i narrow_fp16() const { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

  __m256i narrow_bf16() const {
#if defined(__AVX512BF16__)
    // One instruction, RNE, NaN-preserving; but it flushes fp32 subnormals to zero, which
    // kf::float_to_bf16_bits (and torch) keep, so a vector holding any takes the path below.
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) == 0, 1)) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    // Same rounding as kf::float_to_bf16_bits: add 0x7fff plus the kept LSB, keep the top half.
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i kept_lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(kept_lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i quiet_nan = _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000));
    const __m512i result = _mm512_mask_blend_epi32(is_nan, rounded, quiet_nan);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(result, 16));
  }
};

struct MaskF {
  __mmask16 m;
};

inline VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VecF operator-(VecF a) { return {_mm512_xor_ps(a.v, _mm512_set1_ps(-0.0f))}; }
inline VecF& operator+=(VecF& a, VecF b) { return a = a + b; }
inline VecF& operator*=(VecF& a, VecF b) { return a = a * b; }

// a * b + c with a single rounding.
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF abs(VecF a) { return {_mm512_abs_ps(a.v)}; }
// |magnitude| with the sign bit of sign_source.
inline VecF copysign(VecF magnitude, VecF sign_source) {
  const __m512 sign_bit = _mm512_set1_ps(-0.0f);
  return {_mm512_or_ps(_mm512_andnot_ps(sign_bit, magnitude.v), _mm512_and_ps(sign_bit, sign_source.v))};
}
// min(max(x, lo), hi), but a NaN x stays NaN (vmaxps/vminps return their second operand on NaN).
inline VecF clamp(VecF x, VecF lo, VecF hi) { return {_mm512_min_ps(hi.v, _mm512_max_ps(lo.v, x.v))}; }
// Round to the nearest integral value, ties to even.
inline VecF rint(VecF x) { return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// x * 2^n for integral-valued n; vscalefps gets overflow to Inf and gradual underflow right.
inline VecF ldexp(VecF x, VecF n) { return {_mm512_scalef_ps(x.v, n.v)}; }

inline float reduce_add(VecF a) { return _mm512_reduce_add_ps(a.v); }

inline VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float reduce_max(VecF a) { return _mm512_reduce_max_ps(a.v); }

// Ordered comparisons: false for NaN lanes.
inline MaskF operator<(VecF a, VecF b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ)}; }
inline MaskF operator>=(VecF a, VecF b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ)}; }
inline VecF select(MaskF m, VecF if_true, VecF if_false) { return {_mm512_mask_blend_ps(m.m, if_false.v, if_true.v)}; }
// Bit i set where lane i is set.
inline uint32_t to_bits(MaskF m) { return uint32_t(m.m); }
// acc + (m ? v : 0) in one masked add.
inline VecF add_if(MaskF m, VecF acc, VecF v) { return {_mm512_mask_add_ps(acc.v, m.m, acc.v, v.v)}; }
// Writes v's lanes where m is set, packed, at dst; returns how many. Stores a whole vector, so dst
// needs kWidth writable floats. (Compress in a register, then a plain store: the memory form of
// vcompressps is microcoded and slow on AMD.)
inline int compress_store(float* dst, MaskF m, VecF v) {
  _mm512_storeu_ps(dst, _mm512_maskz_compress_ps(m.m, v.v));
  return __builtin_popcount(uint32_t(m.m));
}

// ---- int32 lanes for the int8 kernels (the contract: vec.h)

struct VecI32 {
  static constexpr int kWidth = 16;
  __m512i v;

  static VecI32 zero() { return {_mm512_setzero_si512()}; }
  static VecI32 load(const void* p) { return {_mm512_loadu_si512(p)}; }
  void store(int32_t* p) const { _mm512_storeu_si512(p, v); }
};

#if KF_HAS_VNNI
// vpdpbusd multiplies the broadcast word as it is.
struct U8Quad {
  __m512i v;
  static U8Quad broadcast(uint32_t word) { return {_mm512_set1_epi32(int(word))}; }
};
inline VecI32 dot4_u8s8(VecI32 acc, const U8Quad& a, VecI32 b) { return {_mm512_dpbusd_epi32(acc.v, a.v, b.v)}; }
#else
// Without VNNI: vpmaddwd on int16 lanes (vec.h), a's bytes 0, 2 in `even`, bytes 1, 3 in `odd`.
struct U8Quad {
  __m512i even, odd;
  static U8Quad broadcast(uint32_t word) {
    const __m512i w = _mm512_set1_epi32(int(word));
    return {_mm512_and_si512(w, _mm512_set1_epi16(0x00ff)), _mm512_srli_epi16(w, 8)};
  }
};
inline VecI32 dot4_u8s8(VecI32 acc, const U8Quad& a, VecI32 b) {
  const __m512i b_even = _mm512_srai_epi16(_mm512_slli_epi16(b.v, 8), 8), b_odd = _mm512_srai_epi16(b.v, 8);
  return {
      _mm512_add_epi32(acc.v, _mm512_add_epi32(_mm512_madd_epi16(a.even, b_even), _mm512_madd_epi16(a.odd, b_odd)))};
}
#endif

}  // namespace kf
