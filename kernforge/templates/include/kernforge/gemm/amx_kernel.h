// AMX GEMM micro-kernels on kernforge's packed weights, read in place (no repacking):
//   bf16: C fp32 += x (bf16, row-major) . W, W in VNNI-2 pair words (kernforge/gemm/micro_kernel.h), tdpbf16ps;
//   int8: C int32 += a (u8, row-major) . W, W in VNNI-4 group words (kernforge/gemm/int8_kernel.h), tdpbusd,
//         so the int32 sums equal the vpdpbusd path's bit for bit (the same compensation is subtracted after).
//
// Both packings are what the tile unit reads as B: a tile row is 16 words (64 bytes) of one pair /
// group row of a panel, the next tile row panel_width words further on, so a 16-column B tile is a
// tileloadd with stride panel_width * 4. An A tile is 16 rows x 64 bytes (32 bf16 or 64 u8 of K).
// Either way one tile step covers 64 bytes of K: 32 (bf16) or 64 (int8) values, 16 B rows.
//
// A block is up to 32 rows x 32 columns as 2 x 2 C tiles (tiles 4-7), fed by 2 A tiles (0, 1) and
// 2 B tiles (2, 3): all eight tiles. Two drivers run it:
// * block(): one block over the whole of K, A read in place (attention's prefill, which owns its
//   loop nest: kernforge/attention/prefill.h);
// * gemm(): the whole product, blocked for the caches (see Blocking below): A copied a K block at a
//   time into tile order, the C tiles going to and from an fp32/int32 accumulator between K blocks.
// Tails:
// * M: a block of fewer than 32 rows runs with a configuration of that many rows (LDTILECFG zeroes
//   the tiles, so it changes only between blocks, and only when the row count does);
// * K: A's last K % step values are zero-padded to a whole step, the remaining B rows copied into
//   a zero-padded 16 x 32-word buffer (reading past them would leave the panel, and A past K may
//   not exist), and one more full step runs on the copies;
// * N: panels are zero-padded to whole panels, so a block computes 32 columns and the epilogue keeps
//   the ones that exist; blocks wholly past N are skipped.
//
// Tiles pay off from a few rows on; below kMinRows the callers keep their vector micro-kernels
// (sgl-kernel draws the same line: AMX from M > 4).
//
// Enabled on the amx tier (compiled with -mamx-tile -mamx-bf16 -mamx-int8), and wherever a test
// includes its kernforge/amx_emulation.h first (tests/templates/include: KF_AMX_EMULATION), which
// replaces the tile instructions with scalar code so the same kernels run on CPUs without AMX.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernforge/core/isa_features.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"

#if KF_HAS_AMX
#include "kernforge/core/amx.h"

namespace kf::gemm::amx {

constexpr int kTileRows = 16;   // rows of an A or C tile, and of a B tile (pair/group rows)
constexpr int kTileWords = 16;  // 32-bit words in every tile row: 16 columns of B or C
constexpr int kRowBytes = 4 * kTileWords;
constexpr int kBlockRows = 2 * kTileRows;  // a micro-kernel block: 2 x 2 C tiles
constexpr int kBlockColumns = 2 * kTileWords;
constexpr int64_t kMinRows = 5;
constexpr int64_t kMinMacsPerThread = int64_t(1) << 18;  // a fork/join (~1 us) buys this much tile work

// Tile numbers. gcc's tile intrinsics paste them into the asm text: they must be literal macros.
#define KF_AMX_A0 0
#define KF_AMX_A1 1
#define KF_AMX_B0 2
#define KF_AMX_B1 3
#define KF_AMX_C00 4
#define KF_AMX_C01 5
#define KF_AMX_C10 6
#define KF_AMX_C11 7

// The element types and the dot-product instruction of each kind of product.
struct Bf16Product {
  using A = bf16;
  using C = float;
  static constexpr int kPerWord = 2;  // K values per 32-bit word of packed B
  static void upper() {
    _tile_dpbf16ps(KF_AMX_C00, KF_AMX_A0, KF_AMX_B0);
    _tile_dpbf16ps(KF_AMX_C01, KF_AMX_A0, KF_AMX_B1);
  }
  static void lower() {
    _tile_dpbf16ps(KF_AMX_C10, KF_AMX_A1, KF_AMX_B0);
    _tile_dpbf16ps(KF_AMX_C11, KF_AMX_A1, KF_AMX_B1);
  }
};

struct U8S8Product {
  using A = uint8_t;
  using C = int32_t;
  static constexpr int kPerWord = 4;
  static void upper() {
    _tile_dpbusd(KF_AMX_C00, KF_AMX_A0, KF_AMX_B0);
    _tile_dpbusd(KF_AMX_C01, KF_AMX_A0, KF_AMX_B1);
  }
  static void lower() {
    _tile_dpbusd(KF_AMX_C10, KF_AMX_A1, KF_AMX_B0);
    _tile_dpbusd(KF_AMX_C11, KF_AMX_A1, KF_AMX_B1);
  }
};

// Whether this process may use tiles (Linux grants the tile state on request; the CPU probe asked
// already, and the answer is cached). Emulated tiles are always there.
inline bool tiles_permitted() {
#if defined(KF_AMX_EMULATION)
  return true;
#else
  return kf::amx::request_tile_permission();
#endif
}

// The configuration of a block of `rows` (1..32) rows: A0/C00/C01 take the first 16, A1/C10/C11 the
// rest (unconfigured when there is none), B0/B1 are always 16 rows of 16 words.
inline kf::amx::TileConfig block_config(int rows) {
  const int upper = std::min(rows, kTileRows), lower = rows - upper;
  kf::amx::TileConfig config;
  config.set(KF_AMX_A0, upper, kRowBytes).set(KF_AMX_C00, upper, kRowBytes).set(KF_AMX_C01, upper, kRowBytes);
  config.set(KF_AMX_B0, kTileRows, kRowBytes).set(KF_AMX_B1, kTileRows, kRowBytes);
  if (lower > 0)
    config.set(KF_AMX_A1, lower, kRowBytes).set(KF_AMX_C10, lower, kRowBytes).set(KF_AMX_C11, lower, kRowBytes);
  return config;
}

// A thread's tile state over one parallel region: the configuration for the current block height,
// loaded only when it changes, and released at the end so the thread carries no tile state.
class Tiles {
 public:
  Tiles() = default;
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  ~Tiles() {
    if (rows_ != 0) _tile_release();
  }

  void shape_for(int rows) {
    if (rows == rows_) return;
    config_ = block_config(rows);
    kf::amx::reads_all_of(config_);  // gcc 12's _tile_loadconfig declares an 8-byte read only
    _tile_loadconfig(&config_);
    rows_ = rows;
  }

 private:
  kf::amx::TileConfig config_;
  int rows_ = 0;
};

// The zero-padded copies one K tail step reads: A's last K % step values of each row, B's last rows.
template <class Product>
struct TailBuffers {
  using A = typename Product::A;
  static constexpr int kStep = kRowBytes / int(sizeof(A));  // K values per tile step
  alignas(64) A a[kBlockRows][kStep];
  alignas(64) uint32_t b[kTileRows][kBlockColumns];

  void fill(const A* a_tail, int64_t lda, int rows, int64_t k_tail, const uint32_t* b_tail, int64_t ldb) {
    std::memset(a, 0, sizeof(a));
    for (int r = 0; r < rows; ++r) std::memcpy(a[r], a_tail + r * lda, size_t(k_tail) * sizeof(A));
    fill_b(b_tail, ldb, k_tail);
  }

  // Only B's rows for the last k_tail values (the blocked driver packs A's tail itself).
  void fill_b(const uint32_t* b_tail, int64_t ldb, int64_t k_tail) {
    std::memset(b, 0, sizeof(b));
    const int64_t b_rows = (k_tail + Product::kPerWord - 1) / Product::kPerWord;
    for (int64_t p = 0; p < b_rows; ++p) std::memcpy(b[p], b_tail + p * ldb, sizeof(b[p]));
    kf::amx::reads_all_of(*this);  // gcc 12's _tile_loadd declares no memory read: keep these stores
  }
  static constexpr int64_t kBStride = kBlockColumns * int64_t(sizeof(uint32_t));
};

// The C tiles of a 32 x 32 block (C10 C11 only when `lower`): zeroed, or to and from memory ldc
// elements per row.
template <class C>
inline void load_c(const C* c, int64_t ldc, bool lower) {
  kf::amx::compiler_barrier();  // gcc 12's _tile_loadd declares no read: any store to c lands first
  const int64_t stride = ldc * int64_t(sizeof(C));
  _tile_loadd(KF_AMX_C00, c, stride);
  _tile_loadd(KF_AMX_C01, c + kTileWords, stride);
  if (lower) {
    _tile_loadd(KF_AMX_C10, c + kTileRows * ldc, stride);
    _tile_loadd(KF_AMX_C11, c + kTileRows * ldc + kTileWords, stride);
  }
}

inline void zero_c(bool lower) {
  _tile_zero(KF_AMX_C00);
  _tile_zero(KF_AMX_C01);
  if (lower) {
    _tile_zero(KF_AMX_C10);
    _tile_zero(KF_AMX_C11);
  }
}

template <class C>
inline void store_c(C* c, int64_t ldc, bool lower) {
  const int64_t stride = ldc * int64_t(sizeof(C));
  _tile_stored(KF_AMX_C00, c, stride);
  _tile_stored(KF_AMX_C01, c + kTileWords, stride);
  if (lower) {
    _tile_stored(KF_AMX_C10, c + kTileRows * ldc, stride);
    _tile_stored(KF_AMX_C11, c + kTileRows * ldc + kTileWords, stride);
  }
}

// One tile step over 64 bytes of K: the configured rows of A (a_stride bytes apart) by 16 rows of
// 32 words of B (b_stride bytes apart), into C00 C01 (and C10 C11 when `lower`).
template <class Product>
inline void step(const void* a, int64_t a_stride, const void* b, int64_t b_stride, bool lower) {
  _tile_loadd(KF_AMX_B0, b, b_stride);
  _tile_loadd(KF_AMX_B1, static_cast<const uint32_t*>(b) + kTileWords, b_stride);
  _tile_loadd(KF_AMX_A0, a, a_stride);
  Product::upper();
  if (lower) {
    _tile_loadd(KF_AMX_A1, static_cast<const uint8_t*>(a) + kTileRows * a_stride, a_stride);
    Product::lower();
  }
}

// C[rows x 32] = A[rows x k] . B[k x 32] for 1 <= rows <= 32, block_config(rows) loaded. A row-major,
// lda elements apart; B packed, ldb words from one pair/group row to the next; C ldc elements apart.
template <class Product>
inline void block(const typename Product::A* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k, int rows,
                  typename Product::C* c, int64_t ldc, TailBuffers<Product>& tails) {
  using A = typename Product::A;
  constexpr int64_t kStep = TailBuffers<Product>::kStep;
  const bool lower = rows > kTileRows;
  zero_c(lower);
  const int64_t a_stride = lda * int64_t(sizeof(A)), b_stride = ldb * int64_t(sizeof(uint32_t));
  const int64_t whole = k / kStep * kStep;
  for (int64_t k0 = 0; k0 < whole; k0 += kStep)
    step<Product>(a + k0, a_stride, b + k0 / Product::kPerWord * ldb, b_stride, lower);
  if (whole < k) {
    tails.fill(a + whole, lda, rows, k - whole, b + whole / Product::kPerWord * ldb, ldb);
    step<Product>(tails.a, kRowBytes, tails.b, tails.kBStride, lower);
  }
  store_c(c, ldc, lower);
}

// Blocking of the whole product, GotoBLAS-style, so that each tile step reads one operand from L1
// and the rest from L2:
// * a task is a group of up to GroupRows rows by a chunk of up to ChunkColumns columns, its
//   fp32/int32 sums held in a per-thread accumulator (GroupRows x ChunkColumns x 4 bytes) over
//   the whole of K;
// * K goes in blocks of DepthSteps tile steps; per K block, each 32-row block's A is copied into
//   tile order (PackedA: 2 KB a step, 16 KB at 8 steps), stays in L1 while every 32-column block of
//   the chunk passes over it (B from L2: the chunk's B over one K block, 128 KB at 8 steps, is read
//   by every row block of the group), and the C tiles go to and from the accumulator between K
//   blocks.
// From L3 and DRAM, then, A is read once per chunk and B once per row group, whatever K is. Reading
// A in place instead costs a tile load per step from L2 at A's row stride, whose power-of-2 sizes
// put all 32 rows of a step in one L1 set; with both operands from L2 the tile unit waits.
template <int DepthSteps, int64_t GroupRows, int64_t ChunkColumns>
struct Blocking {
  static_assert(GroupRows % kBlockRows == 0 && ChunkColumns % kBlockColumns == 0, "whole 32 x 32 blocks");
  static constexpr int kDepthSteps = DepthSteps;
  static constexpr int64_t kGroupRows = GroupRows, kChunkColumns = ChunkColumns;
};
// Measured on a 2-core Xeon (docs/notes/2026-11-25-issue-18-amx-gemm-blocking.md): 8 steps
// keep A and the B tiles passing through within L1 (16 steps: 10-20 % slower); deep K favours
// taller row groups (B read from L3 fewer times), short K shorter ones. A product of one row block
// (a decode batch) reads each weight once: 32 steps per C reload stream it 7-22 % faster than 8.
using ShortKBlocking = Blocking<8, 4 * kBlockRows, 256>;
using DeepKBlocking = Blocking<8, 8 * kBlockRows, 256>;
using OneRowBlockBlocking = Blocking<32, kBlockRows, 256>;
constexpr int64_t kDeepRowBytes = 8192;  // K >= 4096 bf16 or 8192 int8

// One row block's A over one K block in tile order: the 64 bytes of row r for step s at rows[s][r],
// so a step's A tiles are 2 KB in one piece (stride 64 bytes). K past the end is zero.
template <class Product, int DepthSteps>
struct PackedA {
  using A = typename Product::A;
  static constexpr int kStep = kRowBytes / int(sizeof(A));
  alignas(64) uint8_t rows[DepthSteps][kBlockRows][kRowBytes];

  void fill(const A* a, int64_t lda, int row_count, int64_t k_values) {
    const int64_t whole = k_values / kStep, tail = k_values % kStep;
    for (int r = 0; r < row_count; ++r) {
      const A* row = a + r * lda;
      for (int64_t s = 0; s < whole; ++s) std::memcpy(rows[s][r], row + s * kStep, kRowBytes);
      if (tail != 0) {
        std::memcpy(rows[whole][r], row + whole * kStep, size_t(tail) * sizeof(A));
        std::memset(rows[whole][r] + tail * int64_t(sizeof(A)), 0, size_t(kRowBytes - tail * int64_t(sizeof(A))));
      }
    }
    kf::amx::reads_all_of(*this);  // gcc 12's _tile_loadd declares no memory read: keep these stores
  }
  const void* step(int64_t s) const { return rows[s]; }
};

// A thread's buffer of type T, kept per thread rather than on the stack (up to 256 KB): a task's
// accumulator, a packed A block.
template <class T>
inline T& thread_buffer() {
  alignas(64) static thread_local T buffer;
  return buffer;
}

// Rows of A that the next PackedA::fill will copy, fetched into L2 a part at a time while the tile
// unit works on the current block, so that the copy does not wait on L3.
struct PrefetchRows {
  const void* first;
  int64_t stride_bytes, rows, bytes;

  void part(int64_t index, int64_t parts) const {
    const char* base = static_cast<const char*>(first);
    for (int64_t r = index * rows / parts; r < (index + 1) * rows / parts; ++r)
      for (int64_t byte = 0; byte < bytes; byte += 64) _mm_prefetch(base + r * stride_bytes + byte, _MM_HINT_T1);
  }
};

// Columns per chunk: up to B::kChunkColumns, but no more than a fair share of the column groups per
// thread where the rows alone do not make enough tasks.
template <int NR, class B>
inline int64_t chunk_columns(int64_t m, int64_t n, int64_t num_threads) {
  const int64_t groups = (n + NR - 1) / NR, row_groups = (m + B::kGroupRows - 1) / B::kGroupRows;
  const int64_t threads_per_row_group = std::max<int64_t>(1, num_threads / row_groups);
  const int64_t fair = std::max<int64_t>(1, groups / threads_per_row_group);
  return std::min<int64_t>(B::kChunkColumns / NR, fair) * NR;
}

// One K block of one row block (packed in a_block) against the 32-column blocks of a chunk, B from
// `b` (the chunk's first column at this K block): C from acc (zeros on the first K block), the
// block's steps, C back to acc, whose NR-column groups are 32 x NR tiles.
template <class Product, int NR, int DepthSteps>
inline void pass_over_chunk(const PackedA<Product, DepthSteps>& a_block, int64_t depth, const uint32_t* b,
                            int64_t column_block_words, int64_t panel_width, int64_t columns, bool first, bool lower,
                            typename Product::C (*acc)[kBlockRows][NR], TailBuffers<Product>& tails,
                            const PrefetchRows& next_a) {
  constexpr int64_t kStep = PackedA<Product, DepthSteps>::kStep;
  const int64_t whole = depth / kStep, b_stride = panel_width * int64_t(sizeof(uint32_t));
  const int64_t blocks = (columns + kBlockColumns - 1) / kBlockColumns;
  for (int64_t block = 0; block < blocks; ++block) {
    next_a.part(block, blocks);
    const int64_t j = block * kBlockColumns;
    const uint32_t* b_block = b + (j / panel_width) * column_block_words + j % panel_width;
    auto* c = &acc[j / NR][0][j % NR];
    if (first)
      zero_c(lower);
    else
      load_c(c, NR, lower);
    for (int64_t s = 0; s < whole; ++s)
      step<Product>(a_block.step(s), kRowBytes, b_block + s * kTileRows * panel_width, b_stride, lower);
    if (whole * kStep < depth) {
      tails.fill_b(b_block + whole * kTileRows * panel_width, panel_width, depth - whole * kStep);
      step<Product>(a_block.step(whole), kRowBytes, tails.b, tails.kBStride, lower);
    }
    store_c(c, NR, lower);
  }
}

// The whole product A[m x k] . W^T, handing each finished tile to epilogue(m0, n0, rows, columns, tile)
// with rows <= 32, columns <= NR and tile[r * NR + j] the sum for row m0 + r and column n0 + j.
// Tasks are a row group by a column chunk, chunk first, one contiguous run of tasks per thread
// (parallel_blocks), so a thread's columns, and its part of the packed weight, are one slice.
// NR and panel_width are multiples of 32.
template <class Product, int NR, class B, class Epilogue>
inline void gemm(const typename Product::A* a, int64_t lda, const uint32_t* packed, int64_t panel_width, int64_t m,
                 int64_t n, int64_t k, int64_t num_threads, const Epilogue& epilogue) {
  static_assert(NR % kBlockColumns == 0 && B::kChunkColumns % NR == 0, "chunks are whole NR groups");
  using A = typename Product::A;
  using Accumulator = typename Product::C[B::kGroupRows / kBlockRows][B::kChunkColumns / NR][kBlockRows][NR];
  constexpr int64_t kDepth = B::kDepthSteps * PackedA<Product, B::kDepthSteps>::kStep;
  const int64_t column_block_words = (k + Product::kPerWord - 1) / Product::kPerWord * panel_width;  // a panel
  const int64_t threads = useful_threads(num_threads, (n + NR - 1) / NR * ((m + kBlockRows - 1) / kBlockRows),
                                         m * n * std::max<int64_t>(k, 1), kMinMacsPerThread);
  const int64_t chunk = chunk_columns<NR, B>(m, n, threads);
  const int64_t row_groups = (m + B::kGroupRows - 1) / B::kGroupRows;
  parallel_blocks((n + chunk - 1) / chunk * row_groups, threads, [&](int64_t, int64_t begin, int64_t end) {
    Tiles tiles;
    auto& a_block = thread_buffer<PackedA<Product, B::kDepthSteps>>();
    TailBuffers<Product> tails;
    // acc[row block][NR group] is one NR-wide tile of 32 rows, as the epilogue reads it.
    auto& acc = thread_buffer<Accumulator>();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t chunk0 = t / row_groups * chunk, group0 = t % row_groups * B::kGroupRows;
      const int64_t columns = std::min(chunk, n - chunk0), group_rows = std::min(B::kGroupRows, m - group0);
      const uint32_t* b_chunk = packed + (chunk0 / panel_width) * column_block_words + chunk0 % panel_width;
      for (int64_t k0 = 0; k0 == 0 || k0 < k; k0 += kDepth) {  // once at least: k = 0 stores zeros
        const int64_t depth = std::min(kDepth, k - k0);
        for (int64_t r0 = 0; r0 < group_rows; r0 += kBlockRows) {
          const int rows = int(std::min<int64_t>(kBlockRows, group_rows - r0));
          tiles.shape_for(rows);
          a_block.fill(a + (group0 + r0) * lda + k0, lda, rows, depth);
          // The block packed next: the group's next row block, or its first at the next K block.
          const bool wrap = r0 + kBlockRows >= group_rows;
          const int64_t next_k0 = wrap ? k0 + kDepth : k0, next_r0 = wrap ? 0 : r0 + kBlockRows;
          const PrefetchRows next_a{a + (group0 + next_r0) * lda + next_k0, lda * int64_t(sizeof(A)),
                                    next_k0 < k ? std::min<int64_t>(kBlockRows, group_rows - next_r0) : 0,
                                    std::min(kDepth, k - next_k0) * int64_t(sizeof(A))};
          pass_over_chunk<Product, NR>(a_block, depth, b_chunk + k0 / Product::kPerWord * panel_width,
                                       column_block_words, panel_width, columns, k0 == 0, rows > kTileRows,
                                       acc[r0 / kBlockRows], tails, next_a);
        }
      }
      for (int64_t r0 = 0; r0 < group_rows; r0 += kBlockRows)
        for (int64_t g = 0; g < columns; g += NR)
          epilogue(group0 + r0, chunk0 + g, std::min<int64_t>(kBlockRows, group_rows - r0),
                   std::min<int64_t>(NR, columns - g), &acc[r0 / kBlockRows][g / NR][0][0]);
    }
  });
}

// gemm() with the blocking measured best for the depth of the product.
template <class Product, int NR, class Epilogue>
inline void blocked_gemm(const typename Product::A* a, int64_t lda, const uint32_t* packed, int64_t panel_width,
                         int64_t m, int64_t n, int64_t k, int64_t num_threads, const Epilogue& epilogue) {
  if (m <= kBlockRows)
    gemm<Product, NR, OneRowBlockBlocking>(a, lda, packed, panel_width, m, n, k, num_threads, epilogue);
  else if (k * int64_t(sizeof(typename Product::A)) >= kDeepRowBytes)
    gemm<Product, NR, DeepKBlocking>(a, lda, packed, panel_width, m, n, k, num_threads, epilogue);
  else
    gemm<Product, NR, ShortKBlocking>(a, lda, packed, panel_width, m, n, k, num_threads, epilogue);
}

// Whether the tile path takes a product of m rows on panels panel_width wide.
inline bool takes(int64_t m, int64_t panel_width) {
  return m >= kMinRows && panel_width % kBlockColumns == 0 && tiles_permitted();
}

// bf16 x . W (VNNI-2 panels) in tiles, handing store(m0, n0, rows, columns, tile) fp32 tiles of 32
// columns (tile[r * 32 + j]). Returns false, having done nothing, where tiles do not pay or cannot
// be used: the caller runs its vector path.
template <class Store>
inline bool linear_bf16(const bf16* x, int64_t ldx, const uint32_t* packed, int64_t panel_width, int64_t m, int64_t n,
                        int64_t k, int64_t num_threads, const Store& store) {
  if (!takes(m, panel_width)) return false;
  blocked_gemm<Bf16Product, kBlockColumns>(x, ldx, packed, panel_width, m, n, k, num_threads, store);
  return true;
}

// u8 a . s8 W (VNNI-4 panels) in tiles, for the int8 driver's epilogue (int32 tiles NR columns wide,
// before compensation). Returns false as linear_bf16 does.
template <int NR, class Epilogue>
inline bool gemm_u8s8(const uint8_t* a, int64_t lda, const uint32_t* packed, int64_t panel_width, int64_t m, int64_t n,
                      int64_t k, int64_t num_threads, const Epilogue& epilogue) {
  if constexpr (NR % kBlockColumns != 0 || ShortKBlocking::kChunkColumns % NR != 0 ||
                DeepKBlocking::kChunkColumns % NR != 0) {
    return false;
  } else {
    if (!takes(m, panel_width)) return false;
    blocked_gemm<U8S8Product, NR>(a, lda, packed, panel_width, m, n, k, num_threads, epilogue);
    return true;
  }
}

}  // namespace kf::gemm::amx

#endif  // KF_HAS_AMX
