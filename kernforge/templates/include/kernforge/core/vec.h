// One vector abstraction, kf::VecF (and kf::VecI32 for the int8 kernels), with the same interface on
// every tier. The kernel template defines exactly one of KF_TIER_GENERIC / KF_TIER_AVX2 /
// KF_TIER_AVX512 / KF_TIER_AMX first.
//
// Interface (T is kf::fp32, kf::bf16 or kf::fp16; arithmetic is always fp32):
//   VecF::kWidth                          lanes per vector (8 generic/avx2, 16 avx512)
//   VecF::zero(), VecF::broadcast(f)
//   VecF::load(const T*), VecF::load(const T*, count)      count >= kWidth means a full vector;
//   v.store(T*),          v.store(T*, count)               partial forms never touch lanes >= count
//   + - * / unary-, fma(a, b, c) = a*b+c, abs, copysign, clamp (NaN-preserving), rint, ldexp
//   max(a, b), reduce_add(v) / reduce_max(v) -> float
//   MaskF from a < b or a >= b (false on NaN); select(mask, if_true, if_false); to_bits(mask)
//   add_if(mask, acc, v) = acc + (mask ? v : 0); compress_store(dst, mask, v) -> lanes written
//   exp, erf, tanh, sigmoid                                 (vec_math.h, shared by all tiers)
//
// int32 lanes, for the int8 kernels (u8 x s8 products summed exactly in int32: the int8 GEMM, and
// whatever else multiplies int8 weights, such as fused MoE):
//   VecI32::kWidth                        int32 lanes (8 generic/avx2, 16 avx512)
//   VecI32::zero(), VecI32::load(const void*), v.store(int32_t*)     full vectors, unaligned
//   U8Quad::broadcast(uint32_t word)      the word's four bytes (the lowest first) as u8 a[0..3], for
//                                         every lane; prepared once, used against many B vectors
//   dot4_u8s8(acc, a, b)                  per lane j: acc[j] + sum_{i<4} a[i] * int8(byte i of b[j]),
//                                         computed exactly: no intermediate saturation (vpdpbusd, not
//                                         vpdpbusds; vpmaddwd on int16, not vpmaddubsw), so any result
//                                         that fits an int32 is exact. A sum outside int32 is outside
//                                         the contract (the vector tiers wrap it, generic's is UB).
//                                         Without VNNI (avx2, avx512 without it) a's and b's bytes are
//                                         widened to int16 (u8 zero-, s8 sign-extended) and multiplied
//                                         pairwise with vpmaddwd: exact, as |u8 * s8| < 2^15.
#pragma once

#include "kernforge/core/types.h"

#if defined(KF_TIER_GENERIC)
#include "kernforge/core/vec_generic.h"
#elif defined(KF_TIER_AVX2)
#include "kernforge/core/vec_avx2.h"
#elif defined(KF_TIER_AVX512)
#include "kernforge/core/vec_avx512.h"
#elif defined(KF_TIER_AMX)
#include "kernforge/core/amx.h"         // ... plus the tile helpers for matmul kernels
#include "kernforge/core/vec_avx512.h"  // AMX machines run the AVX-512 vector code ...
#else
#error "define one of KF_TIER_GENERIC, KF_TIER_AVX2, KF_TIER_AVX512, KF_TIER_AMX before kernforge/core/vec.h"
#endif

#include "kernforge/core/isa_features.h"  // KF_HAS_*: the capabilities, from the tier macro

#include "kernforge/core/vec_math.h"
