// Storage types shared by every tier: kf::fp32, kf::bf16, kf::fp16, kf::fp8_e4m3, kf::fp8_e5m2 and
// their scalar conversions.
//
// Arithmetic is always done in fp32; bf16/fp16/fp8 are storage formats only. Narrowing rounds to
// nearest-even and keeps NaN a NaN (quieted), matching torch's `.to(dtype)` bit for bit; fp8 follows
// torch's own rules for out-of-range values (see the fp8 section).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include "kernforge/core/intrinsics.h"
#endif

namespace kf {

using fp32 = float;
struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};
// torch.float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111
// (0x7f, 0xff) is NaN, largest finite 448, smallest subnormal 2^-9.
struct fp8_e4m3 {
  uint8_t bits;
};
// torch.float8_e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like (Inf, NaN), the top
// byte of an fp16. Largest finite 57344, smallest subnormal 2^-16.
struct fp8_e5m2 {
  uint8_t bits;
};

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
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u;   // NaN -> quiet NaN
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to Inf
  if (abs_bits < 0x38800000u) {                        // below 2^-14: fp16 subnormal (or zero)
    // Adding 0.5 puts the value's 2^-24 units into the low mantissa bits of a float whose ulp is
    // 2^-24, so the FPU does the round-to-nearest-even for us.
    const float shifted = bit_cast<float>(abs_bits) + 0.5f;
    return sign | uint16_t(bit_cast<uint32_t>(shifted) - bit_cast<uint32_t>(0.5f));
  }
  const uint32_t round_bias = 0xfffu + ((abs_bits >> 13) & 1u);  // RNE on the 13 dropped bits
  return sign | uint16_t(((abs_bits + round_bias) >> 13) - (112u << 10));
#endif
}

// ---- fp8 ----------------------------------------------------------------------------------------
//
// Widening is exact and bit-identical to torch's `.to(torch.float32)`, NaN payloads included. It uses
// integers and int->float conversion only, so it is exact whatever MXCSR's FTZ/DAZ say.

inline float fp8_e4m3_bits_to_float(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t magnitude = b & 0x7fu;
  // Normal: the 7 bits sit right below fp32's sign, exponent rebiased 7 -> 127. Subnormal
  // (exponent 0): mantissa * 2^-9, exact in fp32. The NaN pattern 0x7f rebiases to 480 (0x43f00000);
  // setting the exponent bits turns that into torch's NaN, 0x7ff00000.
  const uint32_t normal = (magnitude << 20) + (120u << 23);
  const uint32_t subnormal = bit_cast<uint32_t>(float(magnitude) * 0x1p-9f);
  const uint32_t value = magnitude < 8 ? subnormal : normal;
  return bit_cast<float>(sign | value | (magnitude == 0x7fu ? 0x7f800000u : 0u));
}

inline float fp8_e5m2_bits_to_float(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t magnitude = b & 0x7fu;
  const uint32_t normal = (magnitude << 21) + (112u << 23);                    // rebias 15 -> 127
  const uint32_t subnormal = bit_cast<uint32_t>(float(magnitude) * 0x1p-16f);  // mantissa * 2^-16
  // Inf (0x7c) keeps a zero mantissa; NaNs come out quieted with their payload, as F16C's
  // vcvtph2ps (and torch) give them.
  const uint32_t special = 0x7f800000u | (magnitude & 3u) << 21 | (magnitude > 0x7cu ? 0x00400000u : 0u);
  const uint32_t value = magnitude < 4 ? subnormal : (magnitude >= 0x7cu ? special : normal);
  return bit_cast<float>(sign | value);
}

// Narrowing, as torch 2.13 does it (c10's fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value):
// round to nearest even; NaN -> S.1111111 (0x7f with the sign); e4m3 saturates everything finite
// or infinite beyond 448 to +-448 (torch 2.11 gave NaN there: pytorch#178817), e5m2 rounds to
// +-Inf from 61440 up (Inf stays Inf).
inline uint8_t float_to_fp8_e4m3_bits(float f) {
  const uint32_t x = bit_cast<uint32_t>(f);
  const uint8_t sign = uint8_t((x >> 24) & 0x80u);
  const uint32_t abs_bits = x & 0x7fffffffu;
  const uint32_t clamped = abs_bits < 0x43e00000u ? abs_bits : 0x43e00000u;  // min(|f|, 448): saturate
  // Below 2^-6 (subnormal): adding 2^14, whose ulp is e4m3's 2^-9 subnormal step, makes the FPU
  // round to nearest even; the integer difference is the fp8 code (up to 8, the smallest normal).
  const uint32_t subnormal = bit_cast<uint32_t>(bit_cast<float>(clamped) + 0x1p14f) - bit_cast<uint32_t>(0x1p14f);
  // Normal: RNE on the 20 dropped bits, then rebias 127 -> 7.
  const uint32_t normal = ((clamped + 0x7ffffu + ((clamped >> 20) & 1u)) >> 20) - (120u << 3);
  const uint32_t magnitude = clamped < 0x3c800000u ? subnormal : normal;
  return uint8_t(sign | (abs_bits > 0x7f800000u ? 0x7fu : magnitude));
}

inline uint8_t float_to_fp8_e5m2_bits(float f) {
  const uint32_t x = bit_cast<uint32_t>(f);
  const uint8_t sign = uint8_t((x >> 24) & 0x80u);
  const uint32_t abs_bits = x & 0x7fffffffu;
  const uint32_t clamped = abs_bits < 0x47800000u ? abs_bits : 0x47800000u;  // min(|f|, 2^16) -> Inf
  // Below 2^-14 (subnormal): 2^7 has e5m2's 2^-16 subnormal step as its ulp.
  const uint32_t subnormal = bit_cast<uint32_t>(bit_cast<float>(clamped) + 0x1p7f) - bit_cast<uint32_t>(0x1p7f);
  // Normal: RNE on the 21 dropped bits (a carry out of 57344 gives Inf, 0x7c), rebias 127 -> 15.
  const uint32_t normal = ((clamped + 0xfffffu + ((clamped >> 21) & 1u)) >> 21) - (112u << 2);
  const uint32_t magnitude = clamped < 0x38800000u ? subnormal : normal;
  return uint8_t(sign | (abs_bits > 0x7f800000u ? 0x7fu : magnitude));
}

// ---- uniform scalar interface -------------------------------------------------------------------

inline float to_float(fp32 x) { return x; }
inline float to_float(bf16 x) { return bf16_bits_to_float(x.bits); }
inline float to_float(fp16 x) { return fp16_bits_to_float(x.bits); }
inline float to_float(fp8_e4m3 x) { return fp8_e4m3_bits_to_float(x.bits); }
inline float to_float(fp8_e5m2 x) { return fp8_e5m2_bits_to_float(x.bits); }

template <class T>
inline T from_float(float x);
template <>
inline fp32 from_float<fp32>(float x) {
  return x;
}
template <>
inline bf16 from_float<bf16>(float x) {
  return bf16{float_to_bf16_bits(x)};
}
template <>
inline fp16 from_float<fp16>(float x) {
  return fp16{float_to_fp16_bits(x)};
}
template <>
inline fp8_e4m3 from_float<fp8_e4m3>(float x) {
  return fp8_e4m3{float_to_fp8_e4m3_bits(x)};
}
template <>
inline fp8_e5m2 from_float<fp8_e5m2>(float x) {
  return fp8_e5m2{float_to_fp8_e5m2_bits(x)};
}

}  // namespace kf
