// int4 GEMM, W4A8 and W4A16 (sgl-kernel's int4_scaled_mm_cpu and int4_w4a16_linear):
//   out[m][n] = sum_g scale[g][n] * sum_{k in g} a[m][k] * (code[n][k] - zero[g][n])  (+ bias[n])
// with `a` the int8 quantization of x per token (W4A8, times its scale at the end) or x itself (W4A16).
//
// Weight layout (kernforge.ops.gemm.int4): N in panels of 64 columns, each panel K quad by K quad, each
// quad 128 bytes = two chunks of 32 columns; byte b of a chunk holds column b / 4 at K 4q + b % 4 in
// its low nibble and column 16 + b / 4 in its high nibble. Zero points uint8 [G][N], scales fp32 [G][N].
//
// No new micro-kernel: a task (NR columns x up to RowBlock rows) walks K block by block; each block
// of the weight (at most kDepthBlock K of one group) is unpacked into a small buffer in the layout the
// existing micro-kernels read, int8 VNNI-4 words of (code - zero) (gemm/int8_kernel.h) or bf16 pairs
// of it (gemm/micro_kernel.h), and multiplied there for every row of the task, so one unpack serves
// many rows; the group's sums (exact int32 or fp32) are scaled into the task's fp32 tile once per group.
// Nibbles unpack with one mask and one shift per 64 bytes: the chunk layout puts a vector's worth of
// whole words in each nibble half.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernforge/core/isa_features.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"
#include "kernforge/gemm/int8_kernel.h"
#include "kernforge/gemm/micro_kernel.h"
#include "kernforge/gemm/tasks.h"

namespace kf::gemm::int4 {

constexpr int kPanelWidth = 64, kChunk = 32, kChunkBytes = 64, kQuadBytes = 128, kQuad = 4;
constexpr int64_t kDepthBlock = 128;  // K per unpacked block (a multiple of kQuad)
constexpr int64_t kMinMacsPerThread = int64_t(1) << 18;

enum Status : int64_t { kOk = 0, kBadGroupSize = 2 };

// The kernels' argument struct (kf_int4_gemm, declared in kernforge/ops/gemm/int4.py) as typed views.
struct Problem {
  const uint8_t* packed;
  const uint8_t* zeros;
  const float* scales;
  const float* bias;
  int64_t m, n, k, group_size;

  // Column n0's bytes of quad q (n0 a multiple of kChunk).
  const uint8_t* chunk(int64_t n0, int64_t q) const {
    return packed + ((n0 / kPanelWidth) * (k / kQuad) + q) * kQuadBytes + (n0 % kPanelWidth) / kChunk * kChunkBytes;
  }
};

namespace detail {

// One chunk's 64 bytes -> (low, high) nibble halves as 32 words, byte-wise minus offset[j] (a byte
// replicated over column j's word): words[j] for column j, j < 32.
inline void unpack_chunk(const uint8_t* bytes, const uint32_t* offset, uint32_t* words) {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  const __m512i v = _mm512_loadu_si512(bytes), mask = _mm512_set1_epi8(0x0f);
  const __m512i low = _mm512_and_si512(v, mask), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  _mm512_storeu_si512(words, _mm512_sub_epi8(low, _mm512_loadu_si512(offset)));
  _mm512_storeu_si512(words + 16, _mm512_sub_epi8(high, _mm512_loadu_si512(offset + 16)));
#elif defined(KF_TIER_AVX2)
  const __m256i mask = _mm256_set1_epi8(0x0f);
  for (int half = 0; half < 2; ++half) {  // bytes [32 half, 32 half + 32): columns 8 half.. and 16 + 8 half..
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * half));
    const __m256i low = _mm256_and_si256(v, mask), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    const auto at = [&](const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + 8 * half), _mm256_sub_epi8(low, at(offset + 8 * half)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + 16 + 8 * half),
                        _mm256_sub_epi8(high, at(offset + 16 + 8 * half)));
  }
#else
  uint8_t out[kChunk * kQuad];
  for (int b = 0; b < kChunkBytes; ++b) {
    const int column = b / kQuad, byte = b % kQuad;
    const uint8_t low_offset = uint8_t(offset[column] >> (8 * byte)), high_offset = uint8_t(offset[16 + column]);
    out[column * kQuad + byte] = uint8_t((bytes[b] & 0x0f) - low_offset);
    out[(16 + column) * kQuad + byte] = uint8_t((bytes[b] >> 4) - high_offset);
  }
  std::memcpy(words, out, sizeof(out));
#endif
}

inline uint32_t replicate(uint8_t byte) { return uint32_t(byte) * 0x01010101u; }

// bf16 bits of i - kOffset, i in [0, 32): what vpermw looks a small integer up in.
template <int kOffset>
struct Bf16Table {  // (a template only to keep the offset next to the table it shapes)
  uint16_t bits[32];
  constexpr Bf16Table() : bits() {
    for (int i = 0; i < 32; ++i) {
      const int v = i - kOffset, magnitude = v < 0 ? -v : v;
      if (magnitude == 0) continue;
      int exponent = 0;
      while ((magnitude >> (exponent + 1)) != 0) ++exponent;
      // |v| < 32 fits bf16's 8 significant bits: exact
      const uint16_t mantissa = uint16_t(((magnitude << (7 - exponent)) & 0x7f));
      bits[i] = uint16_t((v < 0 ? 0x8000 : 0) | ((127 + exponent) << 7) | mantissa);
    }
  }
};
inline constexpr Bf16Table<16> kBf16Table{};  // W4A16's block path unpacks code - zero + 16

#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
// 16 words of 4 small bytes (< 32) -> bf16 pair words through `table` (32 bf16): bytes 0, 1 of each
// word into `first`, bytes 2, 3 into `second` (vpshufb puts them in 16-bit halves, vpermw looks up).
inline void widen_words(__m512i words, __m512i table, __m512i& first, __m512i& second) {
  const __m512i low = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1));
  const __m512i high =
      _mm512_broadcast_i32x4(_mm_setr_epi8(2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1));
  first = _mm512_permutexvar_epi16(_mm512_shuffle_epi8(words, low), table);
  second = _mm512_permutexvar_epi16(_mm512_shuffle_epi8(words, high), table);
}
#endif

// Words of (code - zero + 16) bytes, one per column, -> bf16 pair words: the quad's K 0,1 into
// pairs[j] and K 2,3 into pairs[ldp + j], for `count` columns (a multiple of 16).
inline void widen_to_pairs(const uint32_t* words, int64_t count, uint32_t* pairs, int64_t ldp) {
#if (defined(KF_TIER_AVX512) || defined(KF_TIER_AMX))
  const __m512i table = _mm512_loadu_si512(kBf16Table.bits);
  for (int64_t j = 0; j < count; j += 16) {
    __m512i first, second;
    widen_words(_mm512_loadu_si512(words + j), table, first, second);
    _mm512_storeu_si512(pairs + j, first);
    _mm512_storeu_si512(pairs + ldp + j, second);
  }
#else
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t w = words[j];
    const auto bits = [&](int byte) { return uint32_t(kBf16Table.bits[(w >> (8 * byte)) & 31]); };
    pairs[j] = bits(0) | bits(1) << 16;
    pairs[ldp + j] = bits(2) | bits(3) << 16;
  }
#endif
}

}  // namespace detail

// The block [k0, k0 + depth) x [n0, n0 + NR) of the weight as VNNI-4 words of code - zero (W4A8), NR
// words per quad, and compensation[j] = 128 * sum_k (code - zero): the activations' zero point undone.
template <int NR>
inline void unpack_s8(const Problem& p, int64_t n0, int64_t k0, int64_t depth, const uint32_t* zero_words,
                      uint32_t* block, int32_t* compensation) {
  static_assert(NR % kChunk == 0, "int4 tiles are whole chunks");
  constexpr int kLanes = VecI32::kWidth;
  VecI32 sums[NR / kLanes];
  for (auto& s : sums) s = VecI32::zero();
  const U8Quad ones = U8Quad::broadcast(0x01010101u);
  for (int64_t q = 0; q < depth / kQuad; ++q) {
    uint32_t* words = block + q * NR;
    for (int c = 0; c < NR / kChunk; ++c)
      detail::unpack_chunk(p.chunk(n0 + c * kChunk, k0 / kQuad + q), zero_words + c * kChunk, words + c * kChunk);
    for (int v = 0; v < NR / kLanes; ++v) sums[v] = dot4_u8s8(sums[v], ones, VecI32::load(words + v * kLanes));
  }
  alignas(64) int32_t total[NR];
  for (int v = 0; v < NR / kLanes; ++v) sums[v].store(total + v * kLanes);
  for (int j = 0; j < NR; ++j) compensation[j] = total[j] * int8::kActivationZeroPoint;
}

// The same block as bf16 pairs (W4A16): K rows 2i, 2i + 1 in pair row i, NR words per pair row.
template <int NR>
inline void unpack_bf16(const Problem& p, int64_t n0, int64_t k0, int64_t depth, const uint32_t* zero_words,
                        uint32_t* block) {
  alignas(64) uint32_t words[NR];
  for (int64_t q = 0; q < depth / kQuad; ++q) {
    for (int c = 0; c < NR / kChunk; ++c)
      detail::unpack_chunk(p.chunk(n0 + c * kChunk, k0 / kQuad + q), zero_words + c * kChunk, words + c * kChunk);
    detail::widen_to_pairs(words, NR, block + 2 * q * NR, NR);
  }
}

// Group g's zero points for columns [n0, n0 + NR) as the bytes unpack_chunk subtracts: zero (W4A8) or
// zero - 16 (W4A16, whose table is indexed by code - zero + 16); columns past N get 0 (their codes are 0).
template <int NR>
inline void zero_words(const Problem& p, int64_t g, int64_t n0, uint8_t bias, uint32_t* words) {
  const int64_t columns = std::min<int64_t>(NR, p.n - n0);
  for (int64_t j = 0; j < NR; ++j)
    words[j] = detail::replicate(j < columns ? uint8_t(p.zeros[g * p.n + n0 + j] - bias) : uint8_t(0));
}

// Calls task(m0, n0, rows) for every output tile, with the problem's checks done.
// The blocking, a module parameter each (kernforge.ops.gemm.int4.INT4_CANDIDATES tunes them): rows per
// task (one unpacked block serves all of them) and the row count up to which (decode, small batches)
// the codes go from the nibbles to the products directly, in passes of at most MR rows over the tile's
// codes (which stay in L2 between passes: 64 columns of K = 8192 are 256 KiB).
template <int64_t kRowBlock_, int kFewRows_>
struct Blocking {
  static constexpr int64_t kRowBlock = kRowBlock_;
  static constexpr int kFewRows = kFewRows_;
};

// pass(r0, rows_in_pass) over `rows` rows in passes of at most kPass.
template <int kPass, class Pass>
inline void in_passes(int64_t rows, const Pass& pass) {
  for (int64_t r0 = 0; r0 < rows; r0 += kPass) pass(r0, std::min<int64_t>(kPass, rows - r0));
}

template <int NR, int64_t kRowBlock, class Task>
inline int64_t for_each_tile(const Problem& p, int64_t num_threads, const Task& task) {
  if (p.group_size <= 0 || p.group_size % kQuad || p.k % p.group_size) return kBadGroupSize;
  if (p.m <= 0 || p.n <= 0) return kOk;
  for_each_output_tile<NR>(p.m, p.n, p.k, kRowBlock, kMinMacsPerThread, num_threads, task);
  return kOk;
}

// Calls block(g, k0, depth) for each K block of the problem: groups, split into kDepthBlock pieces.
template <class Block>
inline void for_each_block(const Problem& p, const Block& block) {
  for (int64_t g = 0; g < p.k / p.group_size; ++g)
    for (int64_t k0 = g * p.group_size; k0 < (g + 1) * p.group_size; k0 += kDepthBlock)
      block(g, k0, std::min<int64_t>(kDepthBlock, (g + 1) * p.group_size - k0));
}

// tile[r][j] += sums[r][j] * scale[g][n0 + j] for a group's sums (int32 or fp32); columns past N get 0.
template <int NR, class Sum>
inline void scale_into(const Problem& p, int64_t g, int64_t n0, int64_t rows, const Sum* sums, float* tile) {
  const int64_t columns = std::min<int64_t>(NR, p.n - n0);
  alignas(64) float scale[NR] = {};
  std::copy_n(p.scales + g * p.n + n0, columns, scale);
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < NR; ++j) tile[r * NR + j] += float(sums[r * NR + j]) * scale[j];
}

// ---- the small-M path: codes multiplied straight from the nibbles, no buffer
//
// With a few rows, an unpacked block would serve too few of them to pay for its stores and loads. So
// the codes (0..15, unsigned) go straight from registers into u8 x s8 dot products with the rows' int8
// values (signed: the uint8 bytes with their top bit flipped), and the zero point comes out per group
// as zero * sum_k a: sum_k a (code - zero) = sum_k a code - zero sum_k a, all exact in int32.

namespace detail {

// Lanes of the code vectors of one quad, kNR columns: vector v holds columns [v W, v W + W).
template <int NR>
inline void load_codes(const Problem& p, int64_t n0, int64_t q, VecI32 (&codes)[NR / VecI32::kWidth]) {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  const __m512i mask = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < NR / kChunk; ++c) {
    const __m512i v = _mm512_loadu_si512(p.chunk(n0 + c * kChunk, q));
    codes[2 * c].v = _mm512_and_si512(v, mask);
    codes[2 * c + 1].v = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  }
#elif defined(KF_TIER_AVX2)
  const __m256i mask = _mm256_set1_epi8(0x0f);
  for (int c = 0; c < NR / kChunk; ++c)
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.chunk(n0 + c * kChunk, q) + 32 * half));
      codes[4 * c + half].v = _mm256_and_si256(v, mask);
      codes[4 * c + 2 + half].v = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    }
#else
  alignas(64) uint32_t words[NR];
  const uint32_t no_offset[kChunk] = {};
  for (int c = 0; c < NR / kChunk; ++c) unpack_chunk(p.chunk(n0 + c * kChunk, q), no_offset, words + c * kChunk);
  for (int v = 0; v < NR / VecI32::kWidth; ++v) codes[v] = VecI32::load(words + v * VecI32::kWidth);
#endif
}

// acc + per lane j: sum_i code.byte_i[j] * int8(a.byte_i), codes < 16: vpdpbusd, or vpmaddubsw
// (|2 * 15 * 128| fits its int16 pairs: no saturation) and vpmaddwd by ones.
inline VecI32 dot4_codes(VecI32 acc, VecI32 codes, uint32_t a_word) {
#if (defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)) && KF_HAS_VNNI
  return {_mm512_dpbusd_epi32(acc.v, codes.v, _mm512_set1_epi32(int(a_word)))};
#elif defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  const __m512i pairs = _mm512_maddubs_epi16(codes.v, _mm512_set1_epi32(int(a_word)));
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
#elif defined(KF_TIER_AVX2)
  const __m256i pairs = _mm256_maddubs_epi16(codes.v, _mm256_set1_epi32(int(a_word)));
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
#else
  for (int j = 0; j < VecI32::kWidth; ++j)
    for (int i = 0; i < 4; ++i)
      acc.lane[j] += int32_t((uint32_t(codes.lane[j]) >> (8 * i)) & 0xffu) * int32_t(int8_t(a_word >> (8 * i)));
  return acc;
#endif
}

}  // namespace detail

// Rows [m0, m0 + ROWS) (uint8 a, int8 + 128) by columns [n0, n0 + NR): each group's exact int32 sums
// to on_group(g, sums [ROWS][NR]).
template <int ROWS, int NR, class OnGroup>
inline void w4a8_few_rows(const Problem& p, int64_t n0, const uint8_t* a, int64_t lda, const OnGroup& on_group) {
  constexpr int kVectors = NR / VecI32::kWidth;
  constexpr uint32_t kSignFlip = 0x80808080u;  // uint8 (int8 + 128) -> int8
  const int64_t columns = std::min<int64_t>(NR, p.n - n0);
  for (int64_t g = 0; g < p.k / p.group_size; ++g) {
    VecI32 acc[ROWS][kVectors];
    for (auto& row : acc)
      for (auto& v : row) v = VecI32::zero();
    int32_t row_sums[ROWS] = {};
    for (int64_t q = g * p.group_size / kQuad; q < (g + 1) * p.group_size / kQuad; ++q) {
      VecI32 codes[kVectors];
      detail::load_codes<NR>(p, n0, q, codes);
      for (int r = 0; r < ROWS; ++r) {
        uint32_t word;
        std::memcpy(&word, a + r * lda + q * kQuad, sizeof(word));
        word ^= kSignFlip;
        for (int v = 0; v < kVectors; ++v) acc[r][v] = detail::dot4_codes(acc[r][v], codes[v], word);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int64_t k = g * p.group_size; k < (g + 1) * p.group_size; ++k)
        row_sums[r] += int32_t(a[r * lda + k]) - int8::kActivationZeroPoint;
    alignas(64) int32_t sums[ROWS * NR];
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < kVectors; ++v) acc[r][v].store(sums + r * NR + v * VecI32::kWidth);
    for (int r = 0; r < ROWS; ++r)
      for (int64_t j = 0; j < columns; ++j) sums[r * NR + j] -= int32_t(p.zeros[g * p.n + n0 + j]) * row_sums[r];
    on_group(g, static_cast<const int32_t*>(sums));
  }
}

template <int MR, int NR, class OnGroup>
inline void w4a8_few_rows(int64_t rows, const Problem& p, int64_t n0, const uint8_t* a, int64_t lda,
                          const OnGroup& on_group) {
  if constexpr (MR > 1) {
    if (rows < MR) return w4a8_few_rows<MR - 1, NR>(rows, p, n0, a, lda, on_group);
  }
  w4a8_few_rows<MR, NR>(p, n0, a, lda, on_group);
}

#if KF_HAS_DPBF16
// W4A16's few-rows path on vdpbf16ps (bf16 x only), no shuffles: a 16-bit lane of a chunk holds two
// bytes of one column's word, K 0 and 1 or K 2 and 3, so masking its nibbles out in place and or-ing
// in 0x4300 (bf16 128.0, whose last mantissa bit is 1) makes bf16 pairs of 128 + code for (K 0, K 2)
// and (K 1, K 3) of every column. x's pairs are taken the same way; sum_k (128 + code) x loses 128 +
// zero times the group's sum of x per column (fp32), and each group's sums go to on_group(g, sums).
template <int ROWS, int NR, class OnGroup>
inline void w4a16_few_rows(const Problem& p, int64_t n0, const bf16* x, int64_t ldx, const OnGroup& on_group) {
  constexpr int kVectors = NR / 16;
  constexpr float kBias = 128.0f;
  const int64_t columns = std::min<int64_t>(NR, p.n - n0);
  const __m512i nibble = _mm512_set1_epi16(0x000f), one_two_eight = _mm512_set1_epi16(0x4300);
  // (v & 0x000f) | 0x4300 per 16-bit lane, in one vpternlogd: a | (b & c) is 0xf8
  const auto as_bf16 = [&](__m512i v) { return (__m512bh)_mm512_ternarylogic_epi32(one_two_eight, v, nibble, 0xf8); };
  for (int64_t g = 0; g < p.k / p.group_size; ++g) {
    __m512 acc[ROWS][2][kVectors];  // the even and the odd pairs apart: twice the independent chains
    for (auto& row : acc)
      for (auto& half : row)
        for (auto& v : half) v = _mm512_setzero_ps();
    for (int64_t q = g * p.group_size / kQuad; q < (g + 1) * p.group_size / kQuad; ++q) {
      __m512bh even[kVectors], odd[kVectors];  // (K 0, K 2) and (K 1, K 3) of 16 columns each
      for (int c = 0; c < NR / kChunk; ++c) {
        const __m512i v = _mm512_loadu_si512(p.chunk(n0 + c * kChunk, q));
        even[2 * c] = as_bf16(v);
        odd[2 * c] = as_bf16(_mm512_srli_epi16(v, 8));
        even[2 * c + 1] = as_bf16(_mm512_srli_epi16(v, 4));
        odd[2 * c + 1] = as_bf16(_mm512_srli_epi16(v, 12));
      }
      for (int r = 0; r < ROWS; ++r) {
        const bf16* row = x + r * ldx + q * kQuad;
        const __m512bh x02 = (__m512bh)_mm512_set1_epi32(int(uint32_t(row[0].bits) | uint32_t(row[2].bits) << 16));
        const __m512bh x13 = (__m512bh)_mm512_set1_epi32(int(uint32_t(row[1].bits) | uint32_t(row[3].bits) << 16));
        for (int v = 0; v < kVectors; ++v) {
          acc[r][0][v] = _mm512_dpbf16_ps(acc[r][0][v], even[v], x02);
          acc[r][1][v] = _mm512_dpbf16_ps(acc[r][1][v], odd[v], x13);
        }
      }
    }
    alignas(64) float sums[ROWS * NR];
    for (int r = 0; r < ROWS; ++r) {
      VecF lanes = VecF::zero();  // a group's K is a multiple of 4, not of 16: partial loads at its end
      for (int64_t k = g * p.group_size; k < (g + 1) * p.group_size; k += VecF::kWidth)
        lanes += VecF::load(x + r * ldx + k, (g + 1) * p.group_size - k);
      const float row_sum = reduce_add(lanes);
      for (int v = 0; v < kVectors; ++v)
        _mm512_storeu_ps(sums + r * NR + v * 16, _mm512_add_ps(acc[r][0][v], acc[r][1][v]));
      for (int64_t j = 0; j < columns; ++j) sums[r * NR + j] -= (kBias + float(p.zeros[g * p.n + n0 + j])) * row_sum;
    }
    on_group(g, static_cast<const float*>(sums));
  }
}

template <int MR, int NR, class OnGroup>
inline void w4a16_few_rows(int64_t rows, const Problem& p, int64_t n0, const bf16* x, int64_t ldx,
                           const OnGroup& on_group) {
  if constexpr (MR > 1) {
    if (rows < MR) return w4a16_few_rows<MR - 1, NR>(rows, p, n0, x, ldx, on_group);
  }
  w4a16_few_rows<MR, NR>(p, n0, x, ldx, on_group);
}
#endif

// ---- the many-rows path: an unpacked block, scaled in registers
//
// tile[r][j] += float(sum_{quads} (a + 128) . w - compensation[j]) * scale[j] for MR rows: the int8
// micro-kernel's loop (gemm/int8_kernel.h), but its int32 sums start at zero and leave through the
// group's scale into the fp32 tile, with no int32 tile in memory between the two.
namespace detail {

inline VecF float_of_difference(VecI32 a, VecI32 b) {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  return {_mm512_cvtepi32_ps(_mm512_sub_epi32(a.v, b.v))};
#elif defined(KF_TIER_AVX2)
  return {_mm256_cvtepi32_ps(_mm256_sub_epi32(a.v, b.v))};
#else
  VecF out;
  for (int i = 0; i < VecF::kWidth; ++i) out.lane[i] = float(a.lane[i] - b.lane[i]);
  return out;
#endif
}

}  // namespace detail

// Not inlined: inside the task's lambda gcc ran out of registers for the accumulators and moved them
// through the stack on every quad (half the speed); a call per block and row tile costs nothing.
template <int MR, int NR>
[[gnu::noinline]] void scaled_block_kernel(const uint8_t* a, int64_t lda, const uint32_t* block, int64_t quads,
                                           const int32_t* compensation, const float* scale, float* tile) {
  constexpr int kLanes = VecI32::kWidth, kVectors = NR / kLanes;
  static_assert(VecF::kWidth == kLanes, "one fp32 lane per int32 lane");
  VecI32 acc[MR][kVectors];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = VecI32::zero();
  uint32_t a_words[MR];
  for (int64_t q = 0; q < quads; ++q) {
    VecI32 b[kVectors];
    for (int v = 0; v < kVectors; ++v) b[v] = VecI32::load(block + q * NR + v * kLanes);
    for (int r = 0; r < MR; ++r) std::memcpy(&a_words[r], a + r * lda + q * kQuad, sizeof(uint32_t));
    for (int r = 0; r < MR; ++r) {
      const U8Quad a_op = U8Quad::broadcast(a_words[r]);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = dot4_u8s8(acc[r][v], a_op, b[v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const VecI32 c = VecI32::load(compensation + v * kLanes);
    const VecF s = VecF::load(scale + v * kLanes);
    for (int r = 0; r < MR; ++r) {
      float* out = tile + r * NR + v * kLanes;
      fma(detail::float_of_difference(acc[r][v], c), s, VecF::load(out)).store(out);
    }
  }
}

template <int MR, int NR>
inline void scaled_block_kernel_rows(int64_t rows, const uint8_t* a, int64_t lda, const uint32_t* block, int64_t quads,
                                     const int32_t* compensation, const float* scale, float* tile) {
  if constexpr (MR > 1) {
    if (rows < MR) return scaled_block_kernel_rows<MR - 1, NR>(rows, a, lda, block, quads, compensation, scale, tile);
  }
  scaled_block_kernel<MR, NR>(a, lda, block, quads, compensation, scale, tile);
}

#if KF_HAS_AMX
// ---- the many-rows path on AMX tiles: an unpacked block is what the tiles read as B (the int8 or bf16
// micro-kernels' layout), so each block goes through amx::block by 32 rows x 32 columns, into a small
// C (int32 or fp32) that is scaled into the task's tile as in scaled_block_kernel.
template <class Product, int NR>
inline void amx_scaled_block(const typename Product::A* a, int64_t lda, const uint32_t* block, int64_t depth,
                             int64_t rows, const int32_t* compensation, const float* scale, float* tile,
                             amx::Tiles& tiles, amx::TailBuffers<Product>& tails) {
  using C = typename Product::C;
  constexpr int kColumns = amx::kBlockColumns;
  alignas(64) C c[amx::kBlockRows * kColumns];
  for (int64_t r0 = 0; r0 < rows; r0 += amx::kBlockRows) {
    const int chunk = int(std::min<int64_t>(amx::kBlockRows, rows - r0));
    tiles.shape_for(chunk);
    for (int c0 = 0; c0 < NR; c0 += kColumns) {
      amx::block<Product>(a + r0 * lda, lda, block + c0, NR, depth, chunk, c, kColumns, tails);
      for (int r = 0; r < chunk; ++r)
        for (int j = 0; j < kColumns; ++j) {
          const float sum =
              compensation != nullptr ? float(c[r * kColumns + j] - compensation[c0 + j]) : float(c[r * kColumns + j]);
          tile[(r0 + r) * NR + c0 + j] += sum * scale[c0 + j];
        }
    }
  }
}

// Whether a task of `rows` rows runs on tiles.
inline bool amx_rows(int64_t rows) { return rows >= amx::kMinRows && amx::tiles_permitted(); }
#endif

// One task of W4A8: tile[r][j] (r < rows <= Block::kRowBlock, j < NR) = sum_g scale[g][n0 + j] *
// sum_{k in g} (a[r][k] - 128) (code - zero), for rows `a` (uint8: int8 + 128, lda bytes apart) from the
// task's first; columns past N give 0; no bias, no row scale. The GEMM driver below runs one per task;
// fused MoE runs them from its own parallel loop (so AMX tile state lives in the task).
template <int MR, int NR, class Block>
void w4a8_task(const Problem& p, const uint8_t* a, int64_t lda, int64_t rows, int64_t n0, float* tile) {
  constexpr int kPass = Block::kFewRows < MR ? Block::kFewRows : MR;  // the tile's registers bound a pass
  std::fill_n(tile, rows * NR, 0.0f);
  if (rows <= Block::kFewRows) {  // decode: straight from the nibbles
    return in_passes<kPass>(rows, [&](int64_t r0, int64_t pass_rows) {
      w4a8_few_rows<kPass, NR>(pass_rows, p, n0, a + r0 * lda, lda, [&](int64_t g, const int32_t* sums) {
        scale_into<NR>(p, g, n0, pass_rows, sums, tile + r0 * NR);
      });
    });
  }
  alignas(64) uint32_t block[kDepthBlock / kQuad * NR];
  alignas(64) uint32_t zeros[NR];
  alignas(64) int32_t compensation[NR];
  alignas(64) float scale[NR] = {};
  const auto unpack = [&](int64_t g, int64_t k0, int64_t depth) {
    zero_words<NR>(p, g, n0, 0, zeros);
    std::copy_n(p.scales + g * p.n + n0, std::min<int64_t>(NR, p.n - n0), scale);  // past N: 0, codes 0
    unpack_s8<NR>(p, n0, k0, depth, zeros, block, compensation);
  };
#if KF_HAS_AMX
  if (amx_rows(rows)) {
    amx::Tiles tiles;
    amx::TailBuffers<amx::U8S8Product> tails;
    return for_each_block(p, [&](int64_t g, int64_t k0, int64_t depth) {
      unpack(g, k0, depth);
      amx_scaled_block<amx::U8S8Product, NR>(a + k0, lda, block, depth, rows, compensation, scale, tile, tiles, tails);
    });
  }
#endif
  for_each_block(p, [&](int64_t g, int64_t k0, int64_t depth) {
    unpack(g, k0, depth);
    for (int64_t r0 = 0; r0 < rows; r0 += MR)
      scaled_block_kernel_rows<MR, NR>(std::min<int64_t>(MR, rows - r0), a + r0 * lda + k0, lda, block, depth / kQuad,
                                       compensation, scale, tile + r0 * NR);
  });
}

// W4A8 of the whole problem: on_task(m0, n0, rows, tile) per task, tile as w4a8_task fills it.
template <int MR, int NR, class Block, class OnTask>
int64_t w4a8(const Problem& p, const uint8_t* a, int64_t lda, int64_t num_threads, const OnTask& on_task) {
  return for_each_tile<NR, Block::kRowBlock>(p, num_threads, [&](int64_t m0, int64_t n0, int64_t rows) {
    alignas(64) float tile[Block::kRowBlock * NR];
    w4a8_task<MR, NR, Block>(p, a + m0 * lda, lda, rows, n0, tile);
    on_task(m0, n0, rows, static_cast<const float*>(tile));
  });
}

// W4A8's exact int32 sums, for tests and callers that scale themselves: on_group(m0, n0, rows, g,
// sums [rows][NR]) = sum_{k in g} (a - 128) (code - zero), through the same two paths (nibbles for a few
// rows, unpacked blocks on the int8 micro-kernel for more).
template <int MR, int NR, class Block, class OnGroup>
int64_t w4a8_group_sums(const Problem& p, const uint8_t* a, int64_t lda, int64_t num_threads, const OnGroup& on_group) {
  constexpr int kPass = Block::kFewRows < MR ? Block::kFewRows : MR;
  return for_each_tile<NR, Block::kRowBlock>(p, num_threads, [&](int64_t m0, int64_t n0, int64_t rows) {
    if (rows <= Block::kFewRows) {
      return in_passes<kPass>(rows, [&](int64_t r0, int64_t pass_rows) {
        w4a8_few_rows<kPass, NR>(pass_rows, p, n0, a + (m0 + r0) * lda, lda,
                                 [&](int64_t g, const int32_t* sums) { on_group(m0 + r0, n0, pass_rows, g, sums); });
      });
    }
    alignas(64) uint32_t block[kDepthBlock / kQuad * NR];
    alignas(64) uint32_t zeros[NR];
    alignas(64) int32_t compensation[NR];
    alignas(64) int32_t sums[Block::kRowBlock * NR];
    int64_t group = -1;
    for_each_block(p, [&](int64_t g, int64_t k0, int64_t depth) {
      if (g != group) {
        if (group >= 0) on_group(m0, n0, rows, group, static_cast<const int32_t*>(sums));
        group = g;
        std::fill_n(sums, rows * NR, 0);
        zero_words<NR>(p, g, n0, 0, zeros);
      }
      unpack_s8<NR>(p, n0, k0, depth, zeros, block, compensation);
      for (int64_t r0 = 0; r0 < rows; r0 += MR)
        int8::micro_kernel_rows<MR, NR>(std::min<int64_t>(MR, rows - r0), a + (m0 + r0) * lda + k0, lda, block, NR,
                                        depth, sums + r0 * NR, NR);
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < NR; ++j) sums[r * NR + j] -= compensation[j];
    });
    on_group(m0, n0, rows, group, static_cast<const int32_t*>(sums));
  });
}

// One task of W4A16 on rows x (any storage type, ldx apart, from the task's first): the tile as
// w4a8_task's, with x as it is.
template <int MR, int NR, class Block, class T>
void w4a16_task(const Problem& p, const T* x, int64_t ldx, int64_t rows, int64_t n0, float* tile) {
  std::fill_n(tile, rows * NR, 0.0f);
#if KF_HAS_DPBF16
  if constexpr (kUsesDpbf16<T>) {
    constexpr int kPass = Block::kFewRows < MR ? Block::kFewRows : MR;
    if (rows <= Block::kFewRows) {  // decode: straight from the nibbles
      return in_passes<kPass>(rows, [&](int64_t r0, int64_t pass_rows) {
        w4a16_few_rows<kPass, NR>(pass_rows, p, n0, x + r0 * ldx, ldx, [&](int64_t g, const float* sums) {
          scale_into<NR>(p, g, n0, pass_rows, sums, tile + r0 * NR);
        });
      });
    }
  }
#endif
  alignas(64) uint32_t block[kDepthBlock / 2 * NR];
  alignas(64) uint32_t zeros[NR];
#if KF_HAS_AMX
  if constexpr (std::is_same_v<T, bf16>) {
    if (amx_rows(rows)) {
      amx::Tiles tiles;
      amx::TailBuffers<amx::Bf16Product> tails;
      alignas(64) float scale[NR] = {};
      return for_each_block(p, [&](int64_t g, int64_t k0, int64_t depth) {
        zero_words<NR>(p, g, n0, 16, zeros);
        std::copy_n(p.scales + g * p.n + n0, std::min<int64_t>(NR, p.n - n0), scale);
        unpack_bf16<NR>(p, n0, k0, depth, zeros, block);
        amx_scaled_block<amx::Bf16Product, NR>(x + k0, ldx, block, depth, rows, nullptr, scale, tile, tiles, tails);
      });
    }
  }
#endif
  alignas(64) float sums[Block::kRowBlock * NR];
  int64_t group = -1;
  for_each_block(p, [&](int64_t g, int64_t k0, int64_t depth) {
    if (g != group) {
      if (group >= 0) scale_into<NR>(p, group, n0, rows, static_cast<const float*>(sums), tile);
      group = g;
      std::fill_n(sums, rows * NR, 0.0f);
      zero_words<NR>(p, g, n0, 16, zeros);
    }
    unpack_bf16<NR>(p, n0, k0, depth, zeros, block);
    for (int64_t r0 = 0; r0 < rows; r0 += MR)
      micro_kernel_rows<MR, NR>(std::min<int64_t>(MR, rows - r0), x + r0 * ldx + k0, ldx, block, NR, depth,
                                sums + r0 * NR, NR);
  });
  scale_into<NR>(p, group, n0, rows, static_cast<const float*>(sums), tile);
}

// W4A16 of the whole problem: on_task(m0, n0, rows, tile) per task.
template <int MR, int NR, class Block, class T, class OnTask>
int64_t w4a16(const Problem& p, const T* x, int64_t ldx, int64_t num_threads, const OnTask& on_task) {
  return for_each_tile<NR, Block::kRowBlock>(p, num_threads, [&](int64_t m0, int64_t n0, int64_t rows) {
    alignas(64) float tile[Block::kRowBlock * NR];
    w4a16_task<MR, NR, Block>(p, x + m0 * ldx, ldx, rows, n0, tile);
    on_task(m0, n0, rows, static_cast<const float*>(tile));
  });
}

// Tiles per tier, sized to the register file as in gemm/int8_kernel.h and gemm/micro_kernel.h; the
// width is a whole number of 32-column chunks. Without AVX-512, 2 rows: the 32-column int8 kernel's
// widening temporaries and the accumulators then fit 16 ymm registers.
struct W4A8Tile {
#if KF_HAS_VNNI
  static constexpr int kMR = 4, kNR = 64;
#elif defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  static constexpr int kMR = 4, kNR = 32;
#else
  static constexpr int kMR = 2, kNR = 32;
#endif
};

template <class T>
struct W4A16Tile {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)  // vdpbf16ps: 64 columns feed decode 8 chains
  static constexpr int kMR = 4, kNR = kUsesDpbf16<T> ? 64 : 32;
#else
  static constexpr int kMR = 2, kNR = 32;
#endif
};

}  // namespace kf::gemm::int4
