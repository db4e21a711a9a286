// fp8 block-scaled GEMM (DeepSeek-V3 style, sgl-kernel's CPU fp8_scaled_mm semantics):
//   out[m][n] = sum_kb scale[n / bn][kb] * sum_{k in block kb} x[m][k] * W[n][k]  (+ bias[n]),
// W e4m3fn [N, K], one fp32 scale per (bn x bk) block of W: each K block's sum is accumulated in fp32
// on its own and then added, times its block's scale, into the fp32 output tile.
//
// B layout: N in panels of panel_width columns; within a panel, K rows of panel_width bytes (row k
// holds W[n0 .. n0 + panel_width)[k]), so NR consecutive columns of one k are one contiguous load.
// N is padded with zero weights to whole panels. The block scales are read as given, [ceil(N / bn),
// ceil(K / bk)] fp32: a task gathers its columns' scales once per K block (any bn, not only multiples
// of NR).
//
// Two ways to the same sums, picked by M (the caller's convert_from_rows):
// * Few rows (decode): the weights are converted in registers where they are used (and prefetched
//   ahead), so each weight byte is read from memory once per call, half the bf16 GEMM's traffic.
// * Many rows (prefill): converting per use would cost more than the multiply, so a task converts
//   each K block of its columns once into a scratch of bf16 VNNI-2 pairs, the layout of the bf16
//   GEMM's packed weights, and runs the bf16 micro-kernel (vdpbf16ps where AVX512-BF16) over its row
//   tiles into a zeroed block tile, which is then added times the block's scales into the tile.
// Every fp8 value is exactly a bf16 (and an fp32), so both convert exactly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernforge/attention/fp8_dot.h"  // kf::fp8_dot: the VBMI e4m3 -> bf16 tables (KF_HAS_FP8_DOT)
#include "kernforge/core/isa_features.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"
#include "kernforge/gemm/micro_kernel.h"
#include "kernforge/gemm/tasks.h"

namespace kf::gemm::fp8 {

// ---------------------------------------------------------------------------------------------
// Conversions to bf16 pairs (kf::gemm::micro_kernel's B layout: the word for column j of pair p
// holds row 2p's bf16 in its low half and row 2p + 1's in its high half).

#if KF_HAS_FP8_DOT
// The byte order PairConverter interleaves two rows into. unpacklo_epi8 takes bytes 0..7 of each
// 128-bit lane L and unpackhi bytes 8..15; their word pairs must be columns 4L .. 4L + 3 and
// 16 + 4L .. 16 + 4L + 3, so byte 16L + 8h + 2i + s is row s's byte of column 16h + 4L + i (index bit
// 6 picks the second row).
struct InterleaveIndices {
  alignas(64) uint8_t bytes[64];
};
constexpr InterleaveIndices make_interleave_indices() {
  InterleaveIndices t{};
  for (int q = 0; q < 64; ++q) {
    const int lane = q / 16, half = q % 16 / 8, column = q % 8 / 2, row = q % 2;
    t.bytes[q] = uint8_t(row << 6 | (16 * half + 4 * lane + column));
  }
  return t;
}
inline constexpr InterleaveIndices kInterleaveIndices = make_interleave_indices();

// 32 columns x 2 rows of e4m3 -> 32 pair words, by table lookup (vpermt2b, see fp8_dot.h): one
// vpermt2b interleaves the two rows' bytes in the order that makes the final byte unpacks land the
// words in column order, two look up the low and high bytes of each bf16, one vpternlogd adds the
// sign, and unpacklo/hi_epi8 pair low with high bytes: 6 instructions for 32 words.
class PairConverter {
 public:
  PairConverter() : interleave_(_mm512_load_si512(kInterleaveIndices.bytes)) {}

  // Words for columns [0, 16) (first) and [16, 32) (second) of rows `even` and `odd` (null: a zero row).
  void convert(const fp8_e4m3* even, const fp8_e4m3* odd, __m512i& first, __m512i& second) const {
    const __m512i even_bytes = _mm512_castsi256_si512(load_32_bytes(even));
    const __m512i odd_bytes = odd == nullptr ? _mm512_setzero_si512() : _mm512_castsi256_si512(load_32_bytes(odd));
    const __m512i x = _mm512_permutex2var_epi8(even_bytes, interleave_, odd_bytes);
    const __m512i low = _mm512_permutex2var_epi8(table_.low0, x, table_.low1);
    const __m512i high = _mm512_permutex2var_epi8(table_.high0, x, table_.high1);
    const __m512i signed_high = _mm512_ternarylogic_epi32(high, x, table_.sign, 0xF8);  // high | (x & sign)
    first = _mm512_unpacklo_epi8(low, signed_high);
    second = _mm512_unpackhi_epi8(low, signed_high);
  }

  void convert(const fp8_e4m3* even, const fp8_e4m3* odd, uint32_t* out) const {
    __m512i first, second;
    convert(even, odd, first, second);
    _mm512_storeu_si512(out, first);
    _mm512_storeu_si512(out + 16, second);
  }

 private:
  static __m256i load_32_bytes(const fp8_e4m3* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

  fp8_dot::Converter<fp8_e4m3> table_;
  __m512i interleave_;
};
#endif

// Pair words of two rows widened to fp32 (exactly): a bf16 is the top half of its fp32, and these
// fp32 are all bf16 values, so the word is (even bits >> 16) | (odd bits, whose low half is clear).
inline void store_pair_words(VecF even, VecF odd, uint32_t* out) {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  _mm512_storeu_si512(out,
                      _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even.v), 16), _mm512_castps_si512(odd.v)));
#elif defined(KF_TIER_AVX2)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(even.v), 16), _mm256_castps_si256(odd.v)));
#else
  for (int i = 0; i < VecF::kWidth; ++i)
    out[i] = bit_cast<uint32_t>(even.lane[i]) >> 16 | bit_cast<uint32_t>(odd.lane[i]);
#endif
}

// The depth x NR weights at b (rows ldb bytes apart) as ceil(depth / 2) rows of NR pair words at
// pairs (an odd depth's last pair has a zero high half). Exact and unscaled.
template <int NR>
inline void convert_to_pairs(const fp8_e4m3* b, int64_t ldb, int64_t depth, uint32_t* pairs) {
  const int64_t pair_count = (depth + 1) / 2;
#if KF_HAS_FP8_DOT
  static_assert(NR % 32 == 0, "the VBMI conversion takes 32 columns at a time");
  const PairConverter converter;
  for (int64_t p = 0; p < pair_count; ++p) {
    const fp8_e4m3* even = b + 2 * p * ldb;
    const fp8_e4m3* odd = 2 * p + 1 < depth ? even + ldb : nullptr;
    for (int c = 0; c < NR; c += 32)
      converter.convert(even + c, odd == nullptr ? nullptr : odd + c, pairs + p * NR + c);
  }
#else
  constexpr int kWidth = VecF::kWidth;  // VecF's fp8 loads widen exactly on every tier
  for (int64_t p = 0; p < pair_count; ++p) {
    const fp8_e4m3* even = b + 2 * p * ldb;
    const bool has_odd = 2 * p + 1 < depth;
    for (int c = 0; c < NR; c += kWidth) {
      store_pair_words(VecF::load(even + c), has_odd ? VecF::load(even + ldb + c) : VecF::zero(), pairs + p * NR + c);
    }
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Few rows: weights converted in registers.

// At few rows the weights stream from DRAM once. The hardware prefetcher alone left one core reading
// them at ~60% of the bf16 GEMM's byte rate; fetching the row kPrefetchRows ahead (8 KB) brings the
// fp8 GEMM at M = 1 from ~1.55x to ~1.9x the bf16 one (measured: 64 and 256 rows ahead do less).
constexpr int64_t kPrefetchRows = 128;

// Asks for B's row `row` (NR bytes at b + row * ldb) ahead of its use; a prefetch past the end of
// the panel is harmless (it never faults).
template <int NR>
inline void prefetch_row(const fp8_e4m3* b, int64_t ldb, int64_t row) {
  for (int i = 0; i < NR; i += 64) __builtin_prefetch(reinterpret_cast<const char*>(b + row * ldb + i), 0, 3);
}

// kWidth weights at p, widened to fp32 and divided by kWeightScale. With AVX2/AVX-512 (F16C) an e4m3
// byte becomes an fp16 in three integer ops: sign-extend to 16 bits and shift left by 7 puts the
// magnitude bits at fp16's exponent and mantissa (bits 13..7) and the sign at bits 15 and 14;
// clearing bit 14 leaves exactly value * 2^-8 (fp16's exponent bias is 8 more than e4m3's;
// subnormals map to subnormals), which vcvtph2ps widens. That is half the work of VecF's exact
// widening, at the price of NaN codes (S.1111.111) reading as +-480 / 2^8: the packer rejects NaN weights.
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
constexpr float kWeightScale = 256.0f;
inline VecF load_weights(const fp8_e4m3* p) {
  const __m256i halves = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(halves, 7), _mm256_set1_epi16(int16_t(0xbfff))))};
}
#elif defined(KF_TIER_AVX2)
constexpr float kWeightScale = 256.0f;
inline VecF load_weights(const fp8_e4m3* p) {
  const __m128i halves = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(halves, 7), _mm_set1_epi16(int16_t(0xbfff))))};
}
#else
constexpr float kWeightScale = 1.0f;
inline VecF load_weights(const fp8_e4m3* p) { return VecF::load(p); }
#endif

// C[MR x NR] += (A[MR x depth] . B[depth x NR]) * scale[0 .. NR), the weights widened to fp32 (any A).
// A row-major (lda elements between rows), B fp8 rows of ldb bytes, C fp32 (ldc between rows).
template <int MR, int NR, class T>
inline void micro_kernel_widening(const T* a, int64_t lda, const fp8_e4m3* b, int64_t ldb, const float* scale,
                                  int64_t depth, float* c, int64_t ldc) {
  constexpr int kWidth = VecF::kWidth, kVectors = NR / kWidth;
  static_assert(NR % kWidth == 0, "NR must be a multiple of the vector width");
  VecF acc[MR][kVectors];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = VecF::zero();
  for (int64_t k = 0; k < depth; ++k) {
    prefetch_row<NR>(b, ldb, k + kPrefetchRows);
    VecF b_vec[kVectors];
    for (int v = 0; v < kVectors; ++v) b_vec[v] = load_weights(b + k * ldb + v * kWidth);
    for (int r = 0; r < MR; ++r) {
      const VecF a_k = VecF::broadcast(to_float(a[r * lda + k]));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = fma(a_k, b_vec[v], acc[r][v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const VecF s = VecF::load(scale + v * kWidth) * VecF::broadcast(kWeightScale);
    for (int r = 0; r < MR; ++r) {
      float* out = c + r * ldc + v * kWidth;
      fma(acc[r][v], s, VecF::load(out)).store(out);
    }
  }
}

#if KF_HAS_FP8_DOT
// The same for bf16 A on AVX512-BF16 + VBMI: pairs of B rows converted to bf16 pair words by
// PairConverter (about a third of the widening's instructions per weight) and multiplied by vdpbf16ps.
template <int MR, int NR>
inline void micro_kernel_pairs(const bf16* a, int64_t lda, const fp8_e4m3* b, int64_t ldb, const float* scale,
                               int64_t depth, float* c, int64_t ldc) {
  constexpr int kVectors = NR / 16;
  static_assert(NR % 32 == 0, "whole conversions of 32 columns");
  const PairConverter converter;
  __m512 acc[MR][kVectors];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  const auto step = [&](const fp8_e4m3* even, const fp8_e4m3* odd, const uint32_t (&a_words)[MR]) {
    __m512i words[kVectors];
    for (int v = 0; v < kVectors; v += 2)
      converter.convert(even + 16 * v, odd == nullptr ? nullptr : odd + 16 * v, words[v], words[v + 1]);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a_pair = (__m512bh)_mm512_set1_epi32(int(a_words[r]));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a_pair, (__m512bh)words[v]);
    }
  };
  uint32_t a_words[MR];
  const int64_t pairs = depth / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    prefetch_row<NR>(b, ldb, 2 * p + kPrefetchRows);
    prefetch_row<NR>(b, ldb, 2 * p + 1 + kPrefetchRows);
    for (int r = 0; r < MR; ++r) a_words[r] = detail::load_word(a + r * lda + 2 * p);
    step(b + 2 * p * ldb, b + (2 * p + 1) * ldb, a_words);
  }
  if (depth & 1) {  // the last row alone: A's high half zero (A[depth] may not be read), B's odd row zero
    for (int r = 0; r < MR; ++r) a_words[r] = a[r * lda + depth - 1].bits;
    step(b + (depth - 1) * ldb, nullptr, a_words);
  }
  for (int v = 0; v < kVectors; ++v) {
    const __m512 s = _mm512_loadu_ps(scale + 16 * v);
    for (int r = 0; r < MR; ++r) {
      float* out = c + r * ldc + 16 * v;
      _mm512_storeu_ps(out, _mm512_fmadd_ps(acc[r][v], s, _mm512_loadu_ps(out)));
    }
  }
}
#endif

// C[MR x NR] += (A[MR x depth] . B[depth x NR]) * scale[0 .. NR): micro_kernel_pairs where it runs.
template <int MR, int NR, class T>
inline void micro_kernel(const T* a, int64_t lda, const fp8_e4m3* b, int64_t ldb, const float* scale, int64_t depth,
                         float* c, int64_t ldc) {
#if KF_HAS_FP8_DOT
  if constexpr (std::is_same_v<T, bf16>) return micro_kernel_pairs<MR, NR>(a, lda, b, ldb, scale, depth, c, ldc);
#endif
  micro_kernel_widening<MR, NR>(a, lda, b, ldb, scale, depth, c, ldc);
}

// The same for 1 <= rows <= MR: the M tail runs the kernel instantiated for its row count.
template <int MR, int NR, class T>
inline void micro_kernel_rows(int64_t rows, const T* a, int64_t lda, const fp8_e4m3* b, int64_t ldb, const float* scale,
                              int64_t depth, float* c, int64_t ldc) {
  if constexpr (MR > 1) {
    if (rows < MR) return micro_kernel_rows<MR - 1, NR>(rows, a, lda, b, ldb, scale, depth, c, ldc);
  }
  micro_kernel<MR, NR>(a, lda, b, ldb, scale, depth, c, ldc);
}

// MR x NR accumulators plus NR / width converted B vectors and one broadcast: AVX-512 4 x 64 is
// 16 + 4 + 1 of 32 zmm (with the VBMI conversion's 6 table and index registers and its temporaries,
// still no spill in the loop); AVX2 4 x 16 is 8 + 2 of 16 ymm (the widening needs a few
// temporaries); generic 4 x 16.
struct DefaultTile {
  static constexpr int kMR = 4;
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  static constexpr int kNR = 64;
#else
  static constexpr int kNR = 16;
#endif
};

// ---------------------------------------------------------------------------------------------
// The drivers.

constexpr int64_t kRowBlock = 64;             // rows per micro-kernel pass over a B block: a multiple of every MR
constexpr int64_t kConvertingRowBlock = 256;  // rows per task of the converting path, sharing its conversions
constexpr int64_t kConvertDepth = 512;        // K rows converted at a time: 32 KB of pairs at NR 32
constexpr int64_t kMinMacsPerThread = int64_t(1) << 16;  // a fork/join (~1 us) buys this much work

enum Status : int64_t { kOk = 0, kBadPanelWidth = 1, kBadBlockSize = 2 };

// Where a task's columns [n0, n0 + NR) find their block scales: column j's are the row of `scales`
// starting at row_start[j] (the divisions are done once per task, not once per K block). The
// columns past n read 0 (their weights are 0 too).
template <int NR>
class ColumnScales {
 public:
  ColumnScales(const float* scales, int64_t block_n, int64_t k_blocks, int64_t n0, int64_t columns)
      : scales_(scales), columns_(columns) {
    for (int64_t j = 0; j < columns; ++j) row_start_[j] = (n0 + j) / block_n * k_blocks;
    std::fill(current_ + columns, current_ + NR, 0.0f);
  }

  // The NR scales of K block `block`.
  const float* of_block(int64_t block) {
    for (int64_t j = 0; j < columns_; ++j) current_[j] = scales_[row_start_[j] + block];
    return current_;
  }

 private:
  const float* scales_;
  int64_t columns_;
  int64_t row_start_[NR];
  alignas(64) float current_[NR];
};

// tile[r][0 .. NR) += block[r][0 .. NR) * scale[0 .. NR) for rows r < rows.
template <int NR>
inline void add_scaled_rows(float* tile, const float* block, const float* scale, int64_t rows) {
  constexpr int kWidth = VecF::kWidth;
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < NR; j += kWidth) {
      float* t = tile + r * NR + j;
      fma(VecF::load(block + r * NR + j), VecF::load(scale + j), VecF::load(t)).store(t);
    }
}

// Few rows: fp8 weights converted in registers.
template <int MR, int NR, class T, class Out>
void scaled_mm_in_registers(const T* x, int64_t lda, const fp8_e4m3* packed, int64_t panel_width, const float* scales,
                            int64_t block_n, int64_t block_k, const float* bias, Out* out, int64_t ldo, int64_t m,
                            int64_t n, int64_t k, int64_t num_threads) {
  static_assert(kRowBlock % MR == 0, "a row block holds whole tiles");
  const int64_t k_blocks = (k + block_k - 1) / block_k;
  for_each_output_tile<NR>(
      m, n, k, kRowBlock, kMinMacsPerThread, num_threads, [&](int64_t m0, int64_t n0, int64_t rows) {
        // Column n0 of row k: panel n0 / panel_width, offset n0 % panel_width within each row.
        const fp8_e4m3* b = packed + (n0 / panel_width) * k * panel_width + n0 % panel_width;
        alignas(64) float tile[kRowBlock * NR];
        std::fill_n(tile, rows * NR, 0.0f);
        const int64_t columns = std::min<int64_t>(NR, n - n0);
        ColumnScales<NR> column_scales(scales, block_n, k_blocks, n0, columns);
        const float* column_scale = nullptr;
        int64_t scale_block = -1;
        accumulate_tile<MR>(rows, k, block_k, [&](int64_t row_count, int64_t r0, int64_t k0, int64_t depth) {
          if (k0 / block_k != scale_block) {
            scale_block = k0 / block_k;
            column_scale = column_scales.of_block(scale_block);
          }
          micro_kernel_rows<MR, NR>(row_count, x + (m0 + r0) * lda + k0, lda, b + k0 * panel_width, panel_width,
                                    column_scale, depth, tile + r0 * NR, NR);
        });
        store_tile<NR>(out + m0 * ldo + n0, ldo, tile, bias == nullptr ? nullptr : bias + n0, rows, columns);
      });
}

// A converting task's scratch. The pads keep the arrays from starting at the same offset within a
// 4 KB page: a load from one shortly after a store to the other at the same page offset waits for
// the store (4K aliasing), which made the pass that adds the block tile into the tile twice as slow.
template <int NR>
struct ConvertingScratch {
  alignas(64) float tile[kConvertingRowBlock * NR];
  float pad0[16];
  float block_tile[kConvertingRowBlock * NR];
  float pad1[32];
  uint32_t pairs[kConvertDepth / 2 * NR];
};

// Many rows: each K block of a task's columns converted to bf16 pairs once, then the bf16
// micro-kernel (kf::gemm::micro_kernel, tile kf::gemm::DefaultTile<T>) over the task's rows into a
// zeroed block tile, kRowBlock rows at a time (so their part of the block tile, and the pairs, stay
// in L1), which is then added times the block's scales into the tile. A task of up to
// kConvertingRowBlock rows shares one conversion between its row blocks.
template <class T, class Out>
void scaled_mm_converting(const T* x, int64_t lda, const fp8_e4m3* packed, int64_t panel_width, const float* scales,
                          int64_t block_n, int64_t block_k, const float* bias, Out* out, int64_t ldo, int64_t m,
                          int64_t n, int64_t k, int64_t num_threads) {
  constexpr int MR = gemm::DefaultTile<T>::kMR, NR = gemm::DefaultTile<T>::kNR;
  static_assert(kRowBlock % MR == 0 && kConvertingRowBlock % kRowBlock == 0, "blocks of whole tiles");
  const int64_t k_blocks = (k + block_k - 1) / block_k;
  for_each_output_tile<NR>(
      m, n, k, kConvertingRowBlock, kMinMacsPerThread, num_threads, [&](int64_t m0, int64_t n0, int64_t rows) {
        const fp8_e4m3* b = packed + (n0 / panel_width) * k * panel_width + n0 % panel_width;
        ConvertingScratch<NR> s;
        const int64_t columns = std::min<int64_t>(NR, n - n0);
        ColumnScales<NR> column_scales(scales, block_n, k_blocks, n0, columns);
        std::fill_n(s.tile, rows * NR, 0.0f);
        // Chunks of whole scale blocks up to kConvertDepth deep (a block deeper than that in pieces): a
        // row block's visit then reads a chunk's worth of each x row contiguously, not one scale block's.
        const int64_t blocks_per_chunk = block_k % 2 == 0 && block_k < kConvertDepth ? kConvertDepth / block_k : 1;
        for (int64_t first = 0; first < k_blocks; first += blocks_per_chunk) {
          const int64_t chunk_begin = first * block_k, chunk_end = std::min(k, (first + blocks_per_chunk) * block_k);
          for (int64_t c0 = chunk_begin; c0 < chunk_end; c0 += kConvertDepth) {
            const int64_t c1 = std::min(chunk_end, c0 + kConvertDepth);
            convert_to_pairs<NR>(b + c0 * panel_width, panel_width, c1 - c0, s.pairs);
            for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
              const int64_t block_rows = std::min(kRowBlock, rows - r0);
              float* block_tile = s.block_tile + r0 * NR;
              for (int64_t k0 = c0; k0 < c1;) {  // the scale blocks (or the piece of one) in [c0, c1)
                const int64_t block = k0 / block_k, block_begin = block * block_k;
                const int64_t block_end = std::min(k, block_begin + block_k), depth = std::min(block_end, c1) - k0;
                if (k0 == block_begin) std::fill_n(block_tile, block_rows * NR, 0.0f);
                for (int64_t r = 0; r < block_rows; r += MR) {
                  gemm::micro_kernel_rows<MR, NR>(std::min<int64_t>(MR, block_rows - r), x + (m0 + r0 + r) * lda + k0,
                                                  lda, s.pairs + (k0 - c0) / 2 * NR, NR, depth, block_tile + r * NR,
                                                  NR);
                }
                if (k0 + depth == block_end)
                  add_scaled_rows<NR>(s.tile + r0 * NR, block_tile, column_scales.of_block(block), block_rows);
                k0 += depth;
              }
            }
          }
        }
        store_tile<NR>(out + m0 * ldo + n0, ldo, s.tile, bias == nullptr ? nullptr : bias + n0, rows, columns);
      });
}

// out = x . dequant(W)^T (+ bias): x [m x k] (lda), packed as above, scales [ceil(n / block_n) x
// ceil(k / block_k)] fp32 contiguous, bias fp32 [n] or null, out [m x n] (ldo). m >= convert_from_rows
// takes the converting path, else the in-register one (MR x NR its tile).
template <int MR, int NR, class T, class Out>
int64_t scaled_mm(const T* x, int64_t lda, const fp8_e4m3* packed, int64_t panel_width, const float* scales,
                  int64_t block_n, int64_t block_k, const float* bias, Out* out, int64_t ldo, int64_t m, int64_t n,
                  int64_t k, int64_t convert_from_rows, int64_t num_threads) {
  constexpr int64_t kConvertingNR = gemm::DefaultTile<T>::kNR;
  if (panel_width <= 0 || panel_width % NR != 0 || panel_width % kConvertingNR != 0) return kBadPanelWidth;
  if (block_n <= 0 || block_k <= 0) return kBadBlockSize;
  if (m <= 0 || n <= 0) return kOk;
  if (m >= convert_from_rows) {
    scaled_mm_converting(x, lda, packed, panel_width, scales, block_n, block_k, bias, out, ldo, m, n, k, num_threads);
  } else {
    scaled_mm_in_registers<MR, NR>(x, lda, packed, panel_width, scales, block_n, block_k, bias, out, ldo, m, n, k,
                                   num_threads);
  }
  return kOk;
}

}  // namespace kf::gemm::fp8
