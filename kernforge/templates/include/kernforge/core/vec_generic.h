// Generic tier: plain C++ for any x86-64 CPU. kf::VecF is an array of 8 floats and every operation
// is a fixed-length loop, which gcc -O3 turns into SSE2 code where it can.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernforge/core/types.h"

namespace kf {

struct VecF {
  static constexpr int kWidth = 8;
  float lane[kWidth];

  static VecF zero() { return broadcast(0.0f); }
  static VecF broadcast(float x) {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.lane[i] = x;
    return r;
  }

  // Full loads/stores touch kWidth elements; the (p, count) forms touch min(count, kWidth),
  // reading zeros into the missing lanes. Every storage type, fp8 included, converts through the
  // scalar kf::to_float / kf::from_float.
  template <class T>
  static VecF load(const T* p) {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.lane[i] = to_float(p[i]);
    return r;
  }
  template <class T>
  static VecF load(const T* p, int64_t count) {
    if (count >= kWidth) return load(p);
    VecF r = zero();
    for (int64_t i = 0; i < count; ++i) r.lane[i] = to_float(p[i]);
    return r;
  }

  template <class T>
  void store(T* p) const {
    for (int i = 0; i < kWidth; ++i) p[i] = from_float<T>(lane[i]);
  }
  // No portable non-temporal store: a plain store.
  template <class T>
  void stream(T* p) const {
    store(p);
  }

  template <class T>
  void store(T* p, int64_t count) const {
    if (count >= kWidth) return store(p);
    for (int64_t i = 0; i < count; ++i) p[i] = from_float<T>(lane[i]);
  }
};

// All-ones or all-zeros per lane, so select is pure bit logic (vectorizes to and/andnot/or).
struct MaskF {
  uint32_t lane[VecF::kWidth];
};

namespace generic_detail {
template <class F>
inline VecF map(VecF a, F f) {
  for (float& x : a.lane) x = f(x);
  return a;
}
template <class F>
inline VecF zip(VecF a, VecF b, F f) {
  for (int i = 0; i < VecF::kWidth; ++i) a.lane[i] = f(a.lane[i], b.lane[i]);
  return a;
}
}  // namespace generic_detail

inline VecF operator+(VecF a, VecF b) {
  return generic_detail::zip(a, b, [](float x, float y) { return x + y; });
}
inline VecF operator-(VecF a, VecF b) {
  return generic_detail::zip(a, b, [](float x, float y) { return x - y; });
}
inline VecF operator*(VecF a, VecF b) {
  return generic_detail::zip(a, b, [](float x, float y) { return x * y; });
}
inline VecF operator/(VecF a, VecF b) {
  return generic_detail::zip(a, b, [](float x, float y) { return x / y; });
}
inline VecF operator-(VecF a) {
  return generic_detail::map(a, [](float x) { return -x; });
}
inline VecF& operator+=(VecF& a, VecF b) { return a = a + b; }
inline VecF& operator*=(VecF& a, VecF b) { return a = a * b; }

inline VecF max(VecF a, VecF b) {
  return generic_detail::zip(a, b, [](float x, float y) { return x > y ? x : y; });
}
inline float reduce_max(VecF a) {
  float m = a.lane[0];
  for (float x : a.lane) m = x > m ? x : m;
  return m;
}

// Ordered comparisons: false for NaN lanes.
inline MaskF operator<(VecF a, VecF b) {
  MaskF m;
  for (int i = 0; i < VecF::kWidth; ++i) m.lane[i] = a.lane[i] < b.lane[i] ? ~0u : 0u;
  return m;
}
inline MaskF operator>=(VecF a, VecF b) {
  MaskF m;
  for (int i = 0; i < VecF::kWidth; ++i) m.lane[i] = a.lane[i] >= b.lane[i] ? ~0u : 0u;
  return m;
}
// Bit i set where lane i is set.
inline uint32_t to_bits(MaskF m) {
  uint32_t bits = 0;
  for (int i = 0; i < VecF::kWidth; ++i) bits |= (m.lane[i] & 1u) << i;
  return bits;
}
inline VecF select(MaskF m, VecF if_true, VecF if_false) {
  for (int i = 0; i < VecF::kWidth; ++i) {
    const uint32_t t = bit_cast<uint32_t>(if_true.lane[i]), f = bit_cast<uint32_t>(if_false.lane[i]);
    if_true.lane[i] = bit_cast<float>((t & m.lane[i]) | (f & ~m.lane[i]));
  }
  return if_true;
}
// acc + (m ? v : 0).
inline VecF add_if(MaskF m, VecF acc, VecF v) { return acc + select(m, v, VecF::zero()); }
// Writes v's lanes where m is set, packed, at dst; returns how many. dst needs kWidth writable
// floats (the AVX-512 form stores a whole vector).
inline int compress_store(float* dst, MaskF m, VecF v) {
  int kept = 0;
  for (uint32_t bits = to_bits(m); bits; bits &= bits - 1) dst[kept++] = v.lane[__builtin_ctz(bits)];
  return kept;
}

// a * b + c. Without hardware FMA this rounds twice (std::fma in software would be far slower);
// the math functions below stay within their error budget either way.
inline VecF fma(VecF a, VecF b, VecF c) {
  for (int i = 0; i < VecF::kWidth; ++i) a.lane[i] = a.lane[i] * b.lane[i] + c.lane[i];
  return a;
}
inline VecF abs(VecF a) {
  return generic_detail::map(a, [](float x) { return bit_cast<float>(bit_cast<uint32_t>(x) & 0x7fffffffu); });
}
// |magnitude| with the sign bit of sign_source.
inline VecF copysign(VecF magnitude, VecF sign_source) {
  return generic_detail::zip(magnitude, sign_source, [](float m, float s) {
    return bit_cast<float>((bit_cast<uint32_t>(m) & 0x7fffffffu) | (bit_cast<uint32_t>(s) & 0x80000000u));
  });
}
// min(max(x, lo), hi), but a NaN x stays NaN (both comparisons are false for it).
inline VecF clamp(VecF x, VecF lo, VecF hi) {
  for (int i = 0; i < VecF::kWidth; ++i) {
    float& xi = x.lane[i];
    xi = xi < lo.lane[i] ? lo.lane[i] : xi;
    xi = xi > hi.lane[i] ? hi.lane[i] : xi;
  }
  return x;
}
// Round to the nearest integral value, ties to even. Adding and subtracting 2^23 makes the FPU
// round away the fraction (valid below 2^23, where floats still have one); larger floats are
// already integral.
inline VecF rint(VecF x) {
  const VecF two_23 = VecF::broadcast(8388608.0f);
  const VecF magnitude = abs(x);
  const VecF rounded = copysign((magnitude + two_23) - two_23, x);
  return select(magnitude < two_23, rounded, x);
}
// x * 2^n for integral-valued n in [-252, 254], as x * 2^(n - m) * 2^m with m = clamp(n, -126, 127):
// both factors are normal floats. The first is 1 unless n is outside [-126, 127], and then the
// first multiply is exact whenever the result is not 0 or Inf anyway, so results that overflow
// become Inf and results in the subnormal range are rounded once, by the last multiply.
inline VecF ldexp(VecF x, VecF n) {
  return generic_detail::zip(x, n, [](float xi, float ni) {
    const int32_t n_int = int32_t(ni);
    const int32_t last = n_int < -126 ? -126 : (n_int > 127 ? 127 : n_int);
    const int32_t first = n_int - last;
    const float scale_first = bit_cast<float>(uint32_t(first + 127) << 23);
    const float scale_last = bit_cast<float>(uint32_t(last + 127) << 23);
    return xi * scale_first * scale_last;
  });
}

// Pairwise tree, the same association order on every call.
inline float reduce_add(VecF a) {
  for (int width = VecF::kWidth / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) a.lane[i] += a.lane[i + width];
  return a.lane[0];
}

// ---- int32 lanes for the int8 kernels (the contract: vec.h), in arrays the compiler vectorizes

struct VecI32 {
  static constexpr int kWidth = 8;
  int32_t lane[kWidth];

  static VecI32 zero() { return VecI32{}; }
  static VecI32 load(const void* p) {
    VecI32 v;
    std::memcpy(v.lane, p, sizeof(v.lane));
    return v;
  }
  // Through a copy: storing the accumulators in place changes how gcc 12 vectorizes the int8
  // micro-kernel around it (different code, 8 KB less of it); the copy keeps the code it had.
  void store(int32_t* p) const {
    const VecI32 v = *this;
    std::memcpy(p, v.lane, sizeof(v.lane));
  }
};

struct U8Quad {
  int32_t byte[4];
  static U8Quad broadcast(uint32_t word) {
    U8Quad a;
    for (int i = 0; i < 4; ++i) a.byte[i] = int32_t((word >> (8 * i)) & 0xffu);
    return a;
  }
};
inline VecI32 dot4_u8s8(VecI32 acc, const U8Quad& a, VecI32 b) {
  for (int j = 0; j < VecI32::kWidth; ++j) {
    const uint32_t word = uint32_t(b.lane[j]);
    for (int i = 0; i < 4; ++i) acc.lane[j] += a.byte[i] * int32_t(int8_t(uint8_t(word >> (8 * i))));
  }
  return acc;
}

}  // namespace kf
