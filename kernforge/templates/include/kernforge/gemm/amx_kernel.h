// AMX GEMM micro-kernels on kernforge's packed weights, read in place (no repacking):
//   bf16: C fp32 += x (bf16, row-major) . W, W in VNNI-2 pair words (kernforge/gemm/micro_kernel.h), tdpbf16ps;
//   int8: C int32 += a (u8, row-major) . W, W in VNNI-4 group words (kernforge/gemm/int8_kernel.h), tdpbusd,
//         so the int32 sums equal the vpdpbusd path's bit for bit (the same compensation is subtracted after).
//
// Both packings are what the tile unit reads as B: a tile row is 16 words (64 bytes) of one pair /
// group row of a panel, the next tile row panel_width words further on, so a 16-column B tile is a
// tileloadd with stride panel_width * 4. An A tile is 16 rows x 64 bytes (32 bf16 or 64 u8 of K)
// straight from the activation, stride lda * sizeof(element). Either way one tile step covers 64
// bytes of K: 32 (bf16) or 64 (int8) values, 16 B rows.
//
// The micro-kernel computes a block of up to 32 rows x 32 columns as 2 x 2 C tiles (tiles 4-7), fed
// by 2 A tiles (0, 1) and 2 B tiles (2, 3): all eight tiles. The C tiles stay in the tile unit over
// the whole of K, then go to the caller's fp32/int32 tile through tilestored. Tails:
// * M: a block of fewer than 32 rows runs with a configuration of that many rows (LDTILECFG zeroes
//   the tiles, so it changes only between blocks, and only when the row count does);
// * K: the last K % step values of A are copied into a zero-padded 32 x 64-byte buffer, the
//   remaining B rows into a zero-padded 16 x 32-word one (reading past them would leave the panel,
//   and A past K may not exist), and one more full step runs on the copies;
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
constexpr int64_t kTaskRows = 2 * kBlockRows;
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
    std::memset(b, 0, sizeof(b));
    for (int r = 0; r < rows; ++r) std::memcpy(a[r], a_tail + r * lda, size_t(k_tail) * sizeof(A));
    const int64_t b_rows = (k_tail + Product::kPerWord - 1) / Product::kPerWord;
    for (int64_t p = 0; p < b_rows; ++p) std::memcpy(b[p], b_tail + p * ldb, sizeof(b[p]));
    kf::amx::reads_all_of(*this);  // gcc 12's _tile_loadd declares no memory read: keep these stores
  }
};

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
  _tile_zero(KF_AMX_C00);
  _tile_zero(KF_AMX_C01);
  if (lower) {
    _tile_zero(KF_AMX_C10);
    _tile_zero(KF_AMX_C11);
  }
  const int64_t a_stride = lda * int64_t(sizeof(A)), b_stride = ldb * int64_t(sizeof(uint32_t));
  const int64_t whole = k / kStep * kStep;
  for (int64_t k0 = 0; k0 < whole; k0 += kStep)
    step<Product>(a + k0, a_stride, b + k0 / Product::kPerWord * ldb, b_stride, lower);
  if (whole < k) {
    tails.fill(a + whole, lda, rows, k - whole, b + whole / Product::kPerWord * ldb, ldb);
    step<Product>(tails.a, kRowBytes, tails.b, kBlockColumns * int64_t(sizeof(uint32_t)), lower);
  }
  const int64_t c_stride = ldc * int64_t(sizeof(*c));
  _tile_stored(KF_AMX_C00, c, c_stride);
  _tile_stored(KF_AMX_C01, c + kTileWords, c_stride);
  if (lower) {
    _tile_stored(KF_AMX_C10, c + kTileRows * ldc, c_stride);
    _tile_stored(KF_AMX_C11, c + kTileRows * ldc + kTileWords, c_stride);
  }
}

// The whole product A[m x k] . W^T, handing each finished tile to epilogue(m0, n0, rows, columns, tile)
// with tile[r * NR + j] the sum for row m0 + r and column n0 + j. Tasks are NR columns by kTaskRows
// rows, column block first, one contiguous run of tasks per thread (the thread's slice of the packed
// weight is contiguous) as in kernforge/gemm/tasks.h; a thread configures its tiles once per block
// height, not per task. NR and panel_width are multiples of 32.
template <class Product, int NR, class Epilogue>
inline void gemm(const typename Product::A* a, int64_t lda, const uint32_t* packed, int64_t panel_width, int64_t m,
                 int64_t n, int64_t k, int64_t num_threads, const Epilogue& epilogue) {
  static_assert(NR % kBlockColumns == 0, "a task is whole 32-column blocks");
  const int64_t panel_rows = (k + Product::kPerWord - 1) / Product::kPerWord;
  const int64_t column_blocks = (n + NR - 1) / NR, row_blocks = (m + kTaskRows - 1) / kTaskRows;
  const int64_t tasks = column_blocks * row_blocks;
  const int64_t threads = useful_threads(num_threads, tasks, m * n * std::max<int64_t>(k, 1), kMinMacsPerThread);
  parallel_blocks(tasks, threads, [&](int64_t, int64_t begin, int64_t end) {
    Tiles tiles;
    TailBuffers<Product> tails;
    alignas(64) typename Product::C tile[kTaskRows * NR];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t / row_blocks * NR, m0 = t % row_blocks * kTaskRows;
      const int64_t rows = std::min(kTaskRows, m - m0), columns = std::min<int64_t>(NR, n - n0);
      const uint32_t* b = packed + (n0 / panel_width) * panel_rows * panel_width + n0 % panel_width;
      for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
        const int block_rows = int(std::min<int64_t>(kBlockRows, rows - r0));
        tiles.shape_for(block_rows);
        for (int64_t j = 0; j < columns; j += kBlockColumns)
          block<Product>(a + (m0 + r0) * lda, lda, b + j, panel_width, k, block_rows, tile + r0 * NR + j, NR, tails);
      }
      epilogue(m0, n0, rows, columns, static_cast<const typename Product::C*>(tile));
    }
  });
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
  gemm<Bf16Product, kBlockColumns>(x, ldx, packed, panel_width, m, n, k, num_threads, store);
  return true;
}

// u8 a . s8 W (VNNI-4 panels) in tiles, for the int8 driver's epilogue (int32 tiles NR columns wide,
// before compensation). Returns false as linear_bf16 does.
template <int NR, class Epilogue>
inline bool gemm_u8s8(const uint8_t* a, int64_t lda, const uint32_t* packed, int64_t panel_width, int64_t m, int64_t n,
                      int64_t k, int64_t num_threads, const Epilogue& epilogue) {
  if constexpr (NR % kBlockColumns != 0) {
    return false;
  } else {
    if (!takes(m, panel_width)) return false;
    gemm<U8S8Product, NR>(a, lda, packed, panel_width, m, n, k, num_threads, epilogue);
    return true;
  }
}

}  // namespace kf::gemm::amx

#endif  // KF_HAS_AMX
