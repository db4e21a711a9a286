// AMX tile helpers: tile configuration, OS permission, and a bf16 micro-kernel
//   C[16x16] fp32 += A[16x32] bf16 . B,  B VNNI-packed.
// Included by vec.h for the amx tier; needs -mamx-tile -mamx-bf16.
//
// VNNI packing: TDPBF16PS multiplies bf16 *pairs*, so B[K=32][N=16] is stored as 16 rows of 32
// bf16 where row k/2 holds, for each column n, the pair (B[k][n], B[k+1][n]):
//   B_vnni[k / 2][2 * n + k % 2] = B[k][n].
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "kernforge/core/intrinsics.h"
#include "kernforge/core/types.h"

namespace kf {
namespace amx {

// Linux hands out the 8 KiB of tile state only on request; without it the first tile instruction
// raises SIGILL. The permission is process-wide, so asking once is enough.
inline bool request_tile_permission() {
  constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl(ARCH_REQ_XCOMP_PERM, feature)
  constexpr long kXFeatureXTileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXFeatureXTileData) == 0;
  return granted;
}

// The 64-byte operand of LDTILECFG (palette 1: eight tiles of up to 16 rows x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  TileConfig& set(int tile, int num_rows, int row_bytes) {
    rows[tile] = uint8_t(num_rows);
    bytes_per_row[tile] = uint16_t(row_bytes);
    return *this;
  }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads exactly 64 bytes");

// gcc 12's tile intrinsics are asm statements that under-declare their memory accesses:
// _tile_loadconfig claims to read only the first 8 bytes of the config, and _tile_loadd claims to
// read nothing. Without help the compiler may sink or even delete stores the tile unit depends on.
//   reads_all_of(x): an empty asm that reads all of x, so every store to x happens before it.
//   compiler_barrier(): all pending stores to memory reachable from outside happen before it.
template <class T>
inline void reads_all_of(const T& object) {
  __asm__ __volatile__("" : : "m"(object) : "memory");
}
inline void compiler_barrier() { __asm__ __volatile__("" ::: "memory"); }

// Loads a tile configuration for the lifetime of the scope and releases the tile state after it,
// so the thread does not keep AMX state live (which costs on every context switch).
//
// The configuration is per thread, and LDTILECFG also zeroes every tile: a parallel kernel loads it
// once per thread per parallel region, not once per task. kf::parallel_blocks (parallel.h) hands
// each thread its one block of tasks, so the scope goes around the thread's task loop:
//
//   kf::parallel_blocks(num_tiles, num_threads, [&](int64_t, int64_t begin, int64_t end) {
//     const kf::amx::TileScope tiles(kf::amx::bf16_16x16x32_config());
//     for (int64_t tile = begin; tile < end; ++tile)
//       kf::amx::dpbf16_16x16x32(c_of(tile), ldc, a_of(tile), lda, b_of(tile), ldb);
//   });
//
// (request_tile_permission() once before, on any thread: the permission is process-wide.)
class TileScope {
 public:
  explicit TileScope(const TileConfig& config) {
    reads_all_of(config);
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// Tile roles in the bf16 micro-kernel. gcc's tile intrinsics paste the tile number into the asm
// text, so they must be macros expanding to literals, not C++ constants.
#define KF_AMX_TILE_C 0
#define KF_AMX_TILE_A 1
#define KF_AMX_TILE_B 2

// C: 16 rows x 16 fp32; A: 16 rows x 32 bf16; B: 16 rows (k pairs) x 16 pairs of bf16.
inline TileConfig bf16_16x16x32_config() {
  TileConfig config;
  config.set(KF_AMX_TILE_C, 16, 16 * sizeof(float))
      .set(KF_AMX_TILE_A, 16, 32 * sizeof(bf16))
      .set(KF_AMX_TILE_B, 16, 32 * sizeof(bf16));
  return config;
}

// C[16x16] += A[16x32] . B, with leading dimensions in elements; b_vnni as described above (ldb
// counts bf16 elements per packed row, 32 when dense). Needs bf16_16x16x32_config() loaded.
inline void dpbf16_16x16x32(float* c, int64_t ldc, const bf16* a, int64_t lda, const bf16* b_vnni, int64_t ldb) {
  compiler_barrier();
  _tile_loadd(KF_AMX_TILE_C, c, ldc * int64_t(sizeof(float)));
  _tile_loadd(KF_AMX_TILE_A, a, lda * int64_t(sizeof(bf16)));
  _tile_loadd(KF_AMX_TILE_B, b_vnni, ldb * int64_t(sizeof(bf16)));
  _tile_dpbf16ps(KF_AMX_TILE_C, KF_AMX_TILE_A, KF_AMX_TILE_B);
  _tile_stored(KF_AMX_TILE_C, c, ldc * int64_t(sizeof(float)));
}

}  // namespace amx
}  // namespace kf
