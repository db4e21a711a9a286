// GEMM on llama.cpp's block-quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), as
// kernforge.ops.gemm.gguf repacks them without changing a value:
//   weight[n][k] = scale[g][n] * code[n][k] + offset[g][n]     (group g = k / kGroup, 16 or 32)
//   scale = d[s][n] * sub_scale[g][n], offset = base[s][n] * sub_offset[g][n]   (s = g / kSuperGroups)
// with d and base the file's fp16 values (d and m, or d and -dmin), the sub-scales and sub-offsets the
// K-quants' 6- or 8-bit integers per group (1 where a type has none): both products are exact in fp32.
// Codes are unsigned (4-bit codes as nibbles, 5- and 6-bit ones as nibbles and a plane of their two high
// bits, 8-bit ones as bytes); for the types whose offset
// is a whole number of scales (Q4_0: -8 d, Q8_0: -128 d, Q6_K: -32 d sc), offset = -zero * scale with
// the type's zero a constant (no offsets stored).
//
// Activations are quantized per block of 32 K elements to int8 (llama.cpp's q8_0: scale = amax / 127),
// with the sums of each 16 quantized values kept (the offsets' term). For each group the integer
// product sum_k q[m][k] code[n][k] is exact in int32; it leaves through
//   out[m][n] += a_scale[m][block] * (scale[g][n] * dot + offset[g][n] * sum_k q[m][k])
// or, with an integer zero, a_scale * scale * (dot - zero * sum_k q) (exact in int32 before scaling).
//
// Layout (kernforge.ops.gemm.gguf): N in panels of 64 columns, each panel K quad by K quad (4 K per
// column word). 4-bit: int4's chunk layout (gemm/int4_kernel.h), 128 bytes a quad; 5- and 6-bit: that,
// and a high plane of 64 bytes a quad whose byte 4 (j % 16) + i holds column j's K i at bits 2 (j / 16).
// 8-bit: 256 bytes a quad, column j's word at byte 4 j. d and base [panel][super-block][64], sub-scales and sub-offsets
// [panel][group][64]: a panel's contiguous. Codes go from memory straight into u8 x s8 dot products
// (int4's few-rows path, extended to every M in passes of MR rows: a panel's codes stay in L2 between
// passes).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernforge/core/isa_features.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"
#include "kernforge/gemm/int4_kernel.h"
#include "kernforge/gemm/tasks.h"

namespace kf::gemm::gguf {

constexpr int kPanelWidth = 64, kQuad = 4;
constexpr int64_t kActivationBlock = 32;  // K elements per activation scale (llama.cpp's q8_0 block)
constexpr int64_t kSumBlock = 16;         // K elements per stored activation sum (the smallest group)
constexpr int64_t kRowBlock = 64;         // rows per task
constexpr int64_t kMinMacsPerThread = int64_t(1) << 18;
constexpr int kFloatOffsets = -1;  // the zero parameter of types whose offsets are stored

enum Status : int64_t { kOk = 0, kBadShape = 2 };

// The block types (ggml-common.h), as kernforge.ops.gemm.gguf.BLOCK_TYPES stores them: the codes'
// storage bits, the integer zero (or kFloatOffsets), K per group, groups per super-block (a K-quant's
// 256 elements share d), the sub-scales' type (void: none) and whether sub-offsets are stored.
template <int kBits_, int kZero_, int kGroup_, int kSuperGroups_, class SubScale_, bool kSubOffsets_>
struct BlockType {
  static constexpr int kBits = kBits_, kZero = kZero_, kGroup = kGroup_, kSuperGroups = kSuperGroups_;
  static constexpr bool kSubScales = !std::is_void_v<SubScale_>, kSubOffsets = kSubOffsets_;
  using SubScale = SubScale_;
};
using Q4_0 = BlockType<4, 8, 32, 1, void, false>;
using Q4_1 = BlockType<4, kFloatOffsets, 32, 1, void, false>;
using Q8_0 = BlockType<8, 128, 32, 1, void, false>;
using Q4_K = BlockType<4, kFloatOffsets, 32, 8, uint8_t, true>;
using Q5_K = BlockType<6, kFloatOffsets, 32, 8, uint8_t, true>;
using Q6_K = BlockType<6, 32, 16, 16, int8_t, false>;

struct Problem {
  const uint8_t* packed;
  const uint8_t* high;         // 5- and 6-bit codes' high bits: [panel][quad][64], or null
  const fp16* scales;          // d: [panel][super-block][64]
  const fp16* offsets;         // base (m, or -dmin): [panel][super-block][64], or null with an integer zero
  const void* sub_scales;      // [panel][group][64] (uint8 or int8), or null
  const uint8_t* sub_offsets;  // [panel][group][64], or null
  int64_t m, n, k;

  // Column n0's entry `index` of a [panel][count][64] array.
  static int64_t at(int64_t n0, int64_t index, int64_t count) {
    return ((n0 / kPanelWidth) * count + index) * kPanelWidth + n0 % kPanelWidth;
  }
};

// The activations, quantized: q[m][k] (int8 + 128), scale[m][k / 32], sums[m][k / 16] of the int8 values.
struct Activations {
  const uint8_t* q;
  const float* scale;
  const int32_t* sums;
  int64_t k;
};

// ---- activation quantization: per block of 32, scale = amax / 127, q = rint(x * (127 / amax))

template <class T>
inline void quantize_row(const T* x, int64_t k, uint8_t* q, float* scale, int32_t* sums) {
  constexpr int kWidth = VecF::kWidth;
  alignas(64) float rounded[kActivationBlock];
  for (int64_t b = 0; b < k / kActivationBlock; ++b) {
    const T* block = x + b * kActivationBlock;
    VecF amax = VecF::zero();
    for (int j = 0; j < kActivationBlock; j += kWidth) amax = max(amax, abs(VecF::load(block + j)));
    const float absmax = reduce_max(amax);
    const VecF inverse = VecF::broadcast(absmax > 0.0f ? 127.0f / absmax : 0.0f);
    for (int j = 0; j < kActivationBlock; j += kWidth) rint(VecF::load(block + j) * inverse).store(rounded + j);
    // NaN (or Inf: inf * 0 is NaN, as is inf * (127 / inf)) makes the block's scale NaN, and so the
    // row's output, as x @ W is in torch; its code is 0 (converting NaN to an int is undefined).
    bool finite = true;
    for (int j = 0; j < kActivationBlock; ++j) {
      if (rounded[j] != rounded[j]) {
        finite = false;
        rounded[j] = 0.0f;
      }
    }
    scale[b] = finite ? absmax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    for (int half = 0; half < kActivationBlock / kSumBlock; ++half) {
      int32_t sum = 0;
      for (int j = 0; j < kSumBlock; ++j) {
        const int32_t value = int32_t(rounded[half * kSumBlock + j]);
        sum += value;
        q[b * kActivationBlock + half * kSumBlock + j] = uint8_t(value + 128);
      }
      sums[b * 2 + half] = sum;
    }
  }
}

template <class T>
inline void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, uint8_t* q, float* scale, int32_t* sums,
                          int64_t num_threads) {
  const int64_t threads = useful_threads(num_threads, m, m * k, int64_t(1) << 16);
  parallel_for(m, threads, [&](int64_t r) {
    quantize_row(x + r * ldx, k, q + r * k, scale + r * (k / kActivationBlock), sums + r * (k / kSumBlock));
  });
}

namespace detail {

// codes | (bits [2 field, 2 field + 1] of each of `bytes`, moved to bits 4 and 5): a 6-bit code from its
// low nibble and the high plane, whose byte b holds 16-column group `field`'s byte b at bits 2 field.
inline VecI32 with_high_bits(VecI32 codes, const uint8_t* bytes, int field) {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  const __m512i v = _mm512_loadu_si512(bytes);  // per byte: no bit crosses a byte once masked below
  const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, unsigned(2 * field)), _mm512_set1_epi8(3));
  return {_mm512_or_si512(codes.v, _mm512_slli_epi16(high, 4))};
#elif defined(KF_TIER_AVX2)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m256i high = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * field)), _mm256_set1_epi8(3));
  return {_mm256_or_si256(codes.v, _mm256_slli_epi16(high, 4))};
#else
  for (int j = 0; j < VecI32::kWidth; ++j)
    for (int i = 0; i < kQuad; ++i)
      codes.lane[j] |= int32_t(uint32_t((bytes[j * kQuad + i] >> (2 * field)) & 3) << (8 * i + 4));
  return codes;
#endif
}

// The codes of quad q for columns [n0, n0 + NR): vector v holds columns [v W, v W + W) as words.
template <int kBits, int NR>
inline void load_codes(const Problem& p, int64_t n0, int64_t q, VecI32 (&codes)[NR / VecI32::kWidth]) {
  if constexpr (kBits == 4) {
    const int4::Problem nibbles{p.packed, nullptr, nullptr, nullptr, p.m, p.n, p.k, kQuad};
    int4::detail::load_codes<NR>(nibbles, n0, q, codes);
  } else if constexpr (kBits == 6) {  // the low nibbles, then each byte's two high bits from the high plane
    load_codes<4, NR>(p, n0, q, codes);
    const uint8_t* plane = p.high + ((n0 / kPanelWidth) * (p.k / kQuad) + q) * kPanelWidth;
    for (int v = 0; v < NR / VecI32::kWidth; ++v) {
      const int64_t column = n0 % kPanelWidth + v * VecI32::kWidth;  // the vector's first column in the panel
      codes[v] = with_high_bits(codes[v], plane + (column % 16) * kQuad, int(column / 16));
    }
  } else {
    const uint8_t* words =
        p.packed + ((n0 / kPanelWidth) * (p.k / kQuad) + q) * kPanelWidth * kQuad + (n0 % kPanelWidth) * kQuad;
    for (int v = 0; v < NR / VecI32::kWidth; ++v) codes[v] = VecI32::load(words + v * VecI32::kWidth * kQuad);
  }
}

// acc + per lane: sum_i byte_i(codes) * int8(byte_i(a_word)). Codes below 64 (and any byte with
// vpdpbusd) in one step; 8-bit codes without VNNI as two nibble halves, so that vpmaddubsw's int16
// pairs cannot saturate: low + 16 * high.
template <int kBits>
inline VecI32 dot4(VecI32 acc, VecI32 codes, uint32_t a_word) {
#if KF_HAS_VNNI
  return int4::detail::dot4_codes(acc, codes, a_word);
#else
  if constexpr (kBits <= 6) {  // |2 * 63 * 127| fits vpmaddubsw's int16 pairs
    return int4::detail::dot4_codes(acc, codes, a_word);
  } else {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const VecI32 low{_mm512_and_si512(codes.v, mask)}, high{_mm512_and_si512(_mm512_srli_epi16(codes.v, 4), mask)};
    const VecI32 upper = int4::detail::dot4_codes(VecI32::zero(), high, a_word);
    return {_mm512_add_epi32(int4::detail::dot4_codes(acc, low, a_word).v, _mm512_slli_epi32(upper.v, 4))};
#elif defined(KF_TIER_AVX2)
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const VecI32 low{_mm256_and_si256(codes.v, mask)}, high{_mm256_and_si256(_mm256_srli_epi16(codes.v, 4), mask)};
    const VecI32 upper = int4::detail::dot4_codes(VecI32::zero(), high, a_word);
    return {_mm256_add_epi32(int4::detail::dot4_codes(acc, low, a_word).v, _mm256_slli_epi32(upper.v, 4))};
#else
    return int4::detail::dot4_codes(acc, codes, a_word);  // scalar: no saturation
#endif
  }
#endif
}

inline VecF to_float(VecI32 v) { return int4::detail::float_of_difference(v, VecI32::zero()); }

// A vector's worth of small integers (uint8 or int8) as floats.
template <class T>
inline VecF bytes_as_float(const T* p) {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_signed_v<T>) return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))};
#elif defined(KF_TIER_AVX2)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_signed_v<T>) return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))};
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))};
#else
  VecF out;
  for (int i = 0; i < VecF::kWidth; ++i) out.lane[i] = float(p[i]);
  return out;
#endif
}

// Group g's scales and offsets for columns [n0, n0 + NR), exact in fp32 (a product of an fp16 and a
// small integer).
template <class Type, int NR>
inline void group_factors(const Problem& p, int64_t n0, int64_t g, VecF (&scale)[NR / VecF::kWidth],
                          VecF (&offset)[NR / VecF::kWidth]) {
  constexpr int kLanes = VecF::kWidth;
  const int64_t groups = p.k / Type::kGroup, supers = groups / Type::kSuperGroups;
  const int64_t super_at = Problem::at(n0, g / Type::kSuperGroups, supers), group_at = Problem::at(n0, g, groups);
  for (int v = 0; v < NR / kLanes; ++v) {
    scale[v] = VecF::load(p.scales + super_at + v * kLanes);
    if constexpr (Type::kSubScales)
      scale[v] *= bytes_as_float(static_cast<const typename Type::SubScale*>(p.sub_scales) + group_at + v * kLanes);
    if constexpr (Type::kZero == kFloatOffsets) {
      offset[v] = VecF::load(p.offsets + super_at + v * kLanes);
      if constexpr (Type::kSubOffsets) offset[v] *= bytes_as_float(p.sub_offsets + group_at + v * kLanes);
    }
  }
}

}  // namespace detail

// tile[r][j] += the product of rows [r0, r0 + ROWS) of the activations by columns [n0, n0 + NR)
// (columns past N: their codes are 0 and their scales 0).
template <class Type, int ROWS, int NR>
inline void rows_by_columns(const Problem& p, const Activations& a, int64_t r0, int64_t n0, float* tile) {
  constexpr int kLanes = VecI32::kWidth, kVectors = NR / kLanes, kGroup = Type::kGroup;
  constexpr uint32_t kSignFlip = 0x80808080u;  // uint8 (int8 + 128) -> int8
  const int64_t scales_per_row = a.k / kActivationBlock, sums_per_row = a.k / kSumBlock;
  for (int64_t g = 0; g < p.k / kGroup; ++g) {
    VecI32 acc[ROWS][kVectors];
    for (auto& row : acc)
      for (auto& v : row) v = VecI32::zero();
    for (int64_t q = g * kGroup / kQuad; q < (g + 1) * kGroup / kQuad; ++q) {
      VecI32 codes[kVectors];
      detail::load_codes<Type::kBits, NR>(p, n0, q, codes);
      for (int r = 0; r < ROWS; ++r) {
        uint32_t word;
        std::memcpy(&word, a.q + (r0 + r) * a.k + q * kQuad, sizeof(word));
        word ^= kSignFlip;
        for (int v = 0; v < kVectors; ++v) acc[r][v] = detail::dot4<Type::kBits>(acc[r][v], codes[v], word);
      }
    }
    VecF scale[kVectors], offset[kVectors];
    detail::group_factors<Type, NR>(p, n0, g, scale, offset);
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = r0 + r;
      int32_t sum = 0;
      for (int64_t s = 0; s < kGroup / kSumBlock; ++s) sum += a.sums[row * sums_per_row + g * kGroup / kSumBlock + s];
      const VecF a_scale = VecF::broadcast(a.scale[row * scales_per_row + g * kGroup / kActivationBlock]);
      for (int v = 0; v < kVectors; ++v) {
        float* out = tile + r * NR + v * kLanes;
        if constexpr (Type::kZero == kFloatOffsets) {
          const VecF sum_term = offset[v] * VecF::broadcast(float(sum));
          fma(fma(detail::to_float(acc[r][v]), scale[v], sum_term), a_scale, VecF::load(out)).store(out);
        } else {
          const VecF exact = detail::to_float(acc[r][v]) - VecF::broadcast(float(Type::kZero * sum));
          fma(exact * scale[v], a_scale, VecF::load(out)).store(out);
        }
      }
    }
  }
}

template <class Type, int MR, int NR>
inline void rows_by_columns(int64_t rows, const Problem& p, const Activations& a, int64_t r0, int64_t n0, float* tile) {
  if constexpr (MR > 1) {
    if (rows < MR) return rows_by_columns<Type, MR - 1, NR>(rows, p, a, r0, n0, tile);
  }
  rows_by_columns<Type, MR, NR>(p, a, r0, n0, tile);
}

// The whole problem: on_task(m0, n0, rows, tile [rows][NR]) per task of up to kRowBlock rows.
template <class Type, int MR, int NR, class OnTask>
int64_t gemm(const Problem& p, const Activations& a, int64_t num_threads, const OnTask& on_task) {
  static_assert(kPanelWidth % NR == 0, "a tile lies within a panel");
  if (p.k % (Type::kGroup * Type::kSuperGroups) || p.k % kActivationBlock) return kBadShape;
  if (p.m <= 0 || p.n <= 0) return kOk;
  for_each_output_tile<NR>(
      p.m, p.n, p.k, kRowBlock, kMinMacsPerThread, num_threads, [&](int64_t m0, int64_t n0, int64_t rows) {
        alignas(64) float tile[kRowBlock * NR];
        std::fill_n(tile, rows * NR, 0.0f);
        for (int64_t r = 0; r < rows; r += MR)
          rows_by_columns<Type, MR, NR>(std::min<int64_t>(MR, rows - r), p, a, m0 + r, n0, tile + r * NR);
        on_task(m0, n0, rows, static_cast<const float*>(tile));
      });
  return kOk;
}

// Tiles per tier (the accumulators, ROWS x NR int32, and the codes in registers): as int4's W4A8.
struct Tile {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  static constexpr int kMR = 4, kNR = 64;
#else
  static constexpr int kMR = 2, kNR = 32;
#endif
};

}  // namespace kf::gemm::gguf
