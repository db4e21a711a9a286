// Storage types shared by every tier: kf::fp32, kf::bf16, kf::fp16 and their scalar conversions.
//
// Arithmetic is always done in fp32; bf16/fp16 are 16-bit storage formats only. Narrowing rounds to
// nearest-even and keeps NaN a NaN (quieted), matching torch's `.to(dtype)`.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include "kernforge/intrinsics.h"
#endif

namespace kf {

using fp32 = float;
struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

// C++17 stand-in for std::bit_cast.
template <class To, class From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// ---- bf16: the top half of an fp32 ------------------------------------------------------------

inline float bf16_bits_to_float(uint16_t h) { return bit_cast<float>(uint32_t{h} << 16); }

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = bit_cast<uint32_t>(f);
  // Adding 0x7fff plus the kept LSB rounds half-way cases to the even neighbour; a carry into the
  // exponent is the correct result (up to and including Inf).
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (x >> 16) | 0x0040u;
  // A select rather than an early return, so loops over this function vectorize.
  return uint16_t((x & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// ---- fp16: IEEE binary16 ----------------------------------------------------------------------

inline float fp16_bits_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // Inf/NaN
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
    return bit_cast<float>(sign | bit_cast<uint32_t>(magnitude));
  }
  return bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));  // rebias 15 -> 127
#endif
}

inline uint16_t float_to_fp16_bits(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const uint32_t x = bit_cast<uint32_t>(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t abs_bits = x & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u;    // NaN -> quiet NaN
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;   // >= 65520 rounds to Inf
  if (abs_bits < 0x38800000u) {                          // below 2^-14: fp16 subnormal (or zero)
    // Adding 0.5 puts the value's 2^-24 units into the low mantissa bits of a float whose ulp is
    // 2^-24, so the FPU does the round-to-nearest-even for us.
    const float shifted = bit_cast<float>(abs_bits) + 0.5f;
    return sign | uint16_t(bit_cast<uint32_t>(shifted) - bit_cast<uint32_t>(0.5f));
  }
  const uint32_t round_bias = 0xfffu + ((abs_bits >> 13) & 1u);  // RNE on the 13 dropped bits
  return sign | uint16_t(((abs_bits + round_bias) >> 13) - (112u << 10));
#endif
}

// ---- uniform scalar interface -------------------------------------------------------------------

inline float to_float(fp32 x) { return x; }
inline float to_float(bf16 x) { return bf16_bits_to_float(x.bits); }
inline float to_float(fp16 x) { return fp16_bits_to_float(x.bits); }

template <class T> inline T from_float(float x);
template <> inline fp32 from_float<fp32>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) { return bf16{float_to_bf16_bits(x)}; }
template <> inline fp16 from_float<fp16>(float x) { return fp16{float_to_fp16_bits(x)}; }

}  // namespace kf
