// The ISA capabilities kernels test, each defined once, as 0 or 1, from the tier macro the
// template defines (KF_TIER_GENERIC / KF_TIER_AVX2 / KF_TIER_AVX512 / KF_TIER_AMX, _prelude.jinja)
// and the compiler's feature macros (the tier's flags: kernforge/jit/isa.py). A header that needs
// an instruction tests `#if KF_HAS_...` (or uses it in a constexpr), never the tier or the
// compiler macro itself, so each condition is written here only. Included by core/vec.h, which
// checks that a tier macro is defined.
//
//   KF_HAS_DPBF16   vdpbf16ps, bf16 pair dot products into fp32 (AVX512-BF16 on the avx512/amx tiers)
//   KF_HAS_VNNI     vpdpbusd, u8 x s8 dot products of 4 into int32 (AVX512-VNNI on the avx512/amx tiers)
//   KF_HAS_VBMI     vpermt2b / vpermb byte permutes (AVX512-VBMI on the avx512/amx tiers)
//   KF_HAS_AMX      the AMX tiles, bf16 and int8 (the amx tier), or their scalar emulation in tests
//                   (tests/templates/include/kernforge/amx_emulation.h defines KF_AMX_EMULATION and
//                   is included before any kernforge header, so before this one)
//   KF_HAS_FP8_DOT  KF_HAS_DPBF16 && KF_HAS_VBMI: what kf::fp8_dot (attention/fp8_dot.h) needs, fp8
//                   rows widened to bf16 by byte table lookups for the bf16 dot products
#pragma once

#if (defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)) && defined(__AVX512BF16__)
#define KF_HAS_DPBF16 1
#else
#define KF_HAS_DPBF16 0
#endif

#if (defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)) && defined(__AVX512VNNI__)
#define KF_HAS_VNNI 1
#else
#define KF_HAS_VNNI 0
#endif

#if (defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)) && defined(__AVX512VBMI__)
#define KF_HAS_VBMI 1
#else
#define KF_HAS_VBMI 0
#endif

#if defined(KF_AMX_EMULATION) || \
    (defined(KF_TIER_AMX) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__))
#define KF_HAS_AMX 1
#else
#define KF_HAS_AMX 0
#endif

#if KF_HAS_DPBF16 && KF_HAS_VBMI
#define KF_HAS_FP8_DOT 1
#else
#define KF_HAS_FP8_DOT 0
#endif
