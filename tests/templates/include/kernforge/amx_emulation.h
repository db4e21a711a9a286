// Test-only: the AMX tile instructions kernforge uses, emulated in scalar C++, so that the AMX GEMM
// kernels (kernforge/gemm/amx_kernel.h) compile and run unchanged on a CPU without AMX.
//
// Include it first, before any kernforge header: it includes <immintrin.h> and then redefines
//   _tile_loadconfig, _tile_release, _tile_zero, _tile_loadd, _tile_stored, _tile_dpbf16ps, _tile_dpbusd
// as calls into kf::amx::emu, and defines KF_AMX_EMULATION, which turns the AMX kernels on for the
// tier being built (any tier but amx itself).
//
// Semantics follow the Intel SDM (Vol. 2, LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TILERELEASE,
// TDPBF16PS, TDPBUSD, and the AMX-E1..E4 exception classes), per thread, as the hardware keeps tile
// state per thread:
// * LDTILECFG: palette 0 returns to the INIT state; palette 1 needs zero reserved bytes, at most 16
//   rows and 64 bytes per row, and rows == 0 exactly when bytes_per_row == 0; it zeroes every tile.
//   A non-zero start_row (the restart point of an interrupted instruction) is not modelled and is
//   reported as a fault too.
// * TILELOADD / TILESTORED move rows x bytes_per_row bytes, `stride` bytes apart; a load zeroes the
//   rest of the tile. TILEZERO zeroes a tile. TILERELEASE returns to the INIT state.
// * TDPBF16PS: per row m and column n, two fp32 sums, one over the even and one over the odd bf16 of
//   each pair, each step an fp32 FMA (round to nearest even); then dest += (even + odd). Input
//   denormals are read as zero (DAZ), denormal results flushed to zero (FTZ), MXCSR is not used.
// * TDPBUSD: dest int32 += u8 x s8 products of each 4-byte group, wrapping modulo 2^32.
// * The #UD/#GP conditions (tile not configured, bytes_per_row not a multiple of 4, the same tile
//   twice, shapes that do not chain: C.rows == A.rows, C.colsb == B.colsb, A.colsb / 4 == B.rows)
//   are counted as faults instead of trapping; a faulting instruction changes
//   nothing. Tests read the counters through kf::amx::emu::take_counters().
#pragma once

#if defined(KF_TIER_AMX)
#error "kernforge/amx_emulation.h stands in for AMX on tiers without it; the amx tier runs the real instructions"
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernforge/core/intrinsics.h"  // the real intrinsics first: their names are redefined below

#define KF_AMX_EMULATION 1

namespace kf::amx::emu {

constexpr int kTiles = 8, kMaxRows = 16, kMaxRowBytes = 64;

enum Fault : int64_t {
  kNoFault = 0,
  kBadConfig = 1,      // LDTILECFG #GP
  kNotConfigured = 2,  // #UD: no configuration loaded, or the tile has 0 rows
  kBadRowBytes = 3,    // #UD: bytes_per_row not a multiple of 4
  kSameTile = 4,       // #UD: a dot product names one tile twice
  kShapeMismatch = 5,  // #UD: C = A . B shapes do not chain
};

struct Tile {
  int rows = 0, row_bytes = 0;
  alignas(64) uint8_t data[kMaxRows][kMaxRowBytes] = {};
};

struct State {
  bool configured = false;
  Tile tile[kTiles];
};

inline State& state() {
  thread_local State tiles;
  return tiles;
}

struct Counters {
  std::atomic<int64_t> faults{0}, last_fault{kNoFault}, dot_products{0};
};

inline Counters& counters() {
  static Counters shared;
  return shared;
}

inline void fault(Fault what) {
  counters().faults.fetch_add(1, std::memory_order_relaxed);
  counters().last_fault.store(what, std::memory_order_relaxed);
}

// [faults, last fault code, dot-product instructions] since the last call; resets them.
inline void take_counters(int64_t* out) {
  out[0] = counters().faults.exchange(0);
  out[1] = counters().last_fault.exchange(kNoFault);
  out[2] = counters().dot_products.exchange(0);
}

// ---- configuration

inline bool any_nonzero(const uint8_t* bytes, int begin, int end) {
  for (int i = begin; i < end; ++i)
    if (bytes[i] != 0) return true;
  return false;
}

inline void load_config(const void* config) {
  const uint8_t* bytes = static_cast<const uint8_t*>(config);
  State& s = state();
  if (bytes[0] == 0) {  // palette 0: the INIT state
    s = State{};
    return;
  }
  bool bad = bytes[0] != 1 || bytes[1] != 0 || any_nonzero(bytes, 2, 16) || any_nonzero(bytes, 32, 48) ||
             any_nonzero(bytes, 56, 64);
  int rows[kTiles], row_bytes[kTiles];
  for (int t = 0; t < kTiles; ++t) {
    row_bytes[t] = bytes[16 + 2 * t] | (bytes[17 + 2 * t] << 8);
    rows[t] = bytes[48 + t];
    bad |= row_bytes[t] > kMaxRowBytes || rows[t] > kMaxRows || (rows[t] == 0) != (row_bytes[t] == 0);
  }
  if (bad) return fault(kBadConfig);
  s = State{};  // every tile zeroed
  s.configured = true;
  for (int t = 0; t < kTiles; ++t) {
    s.tile[t].rows = rows[t];
    s.tile[t].row_bytes = row_bytes[t];
  }
}

inline void release() { state() = State{}; }

// The tile if it may be used (configured, rows > 0, bytes_per_row a multiple of 4), else null.
inline Tile* usable(int t) {
  State& s = state();
  if (t < 0 || t >= kTiles || !s.configured || s.tile[t].rows == 0) return fault(kNotConfigured), nullptr;
  if (s.tile[t].row_bytes % 4 != 0) return fault(kBadRowBytes), nullptr;
  return &s.tile[t];
}

// ---- data movement

inline void zero(int t) {
  if (Tile* tile = usable(t)) std::memset(tile->data, 0, sizeof(tile->data));
}

inline void load(int t, const void* base, long stride) {
  Tile* tile = usable(t);
  if (tile == nullptr) return;
  std::memset(tile->data, 0, sizeof(tile->data));
  for (int r = 0; r < tile->rows; ++r)
    std::memcpy(tile->data[r], static_cast<const uint8_t*>(base) + r * stride, size_t(tile->row_bytes));
}

inline void store(int t, void* base, long stride) {
  const Tile* tile = usable(t);
  if (tile == nullptr) return;
  for (int r = 0; r < tile->rows; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tile->data[r], size_t(tile->row_bytes));
}

// ---- dot products: C (m x n dwords) += A (m x k dwords) . B (k x n dwords)

// The three tiles if they may be multiplied (AMX-E4), else false.
inline bool chained(int c, int a, int b, Tile*& tc, const Tile*& ta, const Tile*& tb) {
  if (c == a || c == b || a == b) return fault(kSameTile), false;
  tc = usable(c), ta = usable(a), tb = usable(b);
  if (tc == nullptr || ta == nullptr || tb == nullptr) return false;
  const int n = tc->row_bytes / 4, k = tb->rows;
  // (N and K are at most 16 too, which palette 1's 64-byte rows and 16 rows already ensure.)
  if (tc->rows != ta->rows || tb->row_bytes / 4 != n || ta->row_bytes / 4 != k) return fault(kShapeMismatch), false;
  counters().dot_products.fetch_add(1, std::memory_order_relaxed);
  return true;
}

template <class T>
inline T element(const uint8_t* row, int index) {
  T value;
  std::memcpy(&value, row + index * sizeof(T), sizeof(T));
  return value;
}

template <class T>
inline void set_element(uint8_t* row, int index, T value) {
  std::memcpy(row + index * sizeof(T), &value, sizeof(T));
}

// DAZ on the way in, FTZ on the way out: a denormal counts as a zero of its sign.
inline float flush_denormal(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }

inline float bf16_as_float(uint16_t bits) {
  float value;
  const uint32_t word = uint32_t(bits) << 16;
  std::memcpy(&value, &word, sizeof(value));
  return flush_denormal(value);
}

inline void dpbf16ps(int c, int a, int b) {
  Tile* tc;
  const Tile *ta, *tb;
  if (!chained(c, a, b, tc, ta, tb)) return;
  const int n_count = tc->row_bytes / 4, k_count = tb->rows;
  for (int m = 0; m < tc->rows; ++m) {
    float even[16] = {}, odd[16] = {};
    for (int k = 0; k < k_count; ++k) {
      const float a_even = bf16_as_float(element<uint16_t>(ta->data[m], 2 * k));
      const float a_odd = bf16_as_float(element<uint16_t>(ta->data[m], 2 * k + 1));
      for (int n = 0; n < n_count; ++n) {
        even[n] = flush_denormal(std::fma(a_even, bf16_as_float(element<uint16_t>(tb->data[k], 2 * n)), even[n]));
        odd[n] = flush_denormal(std::fma(a_odd, bf16_as_float(element<uint16_t>(tb->data[k], 2 * n + 1)), odd[n]));
      }
    }
    for (int n = 0; n < n_count; ++n) {
      const float pair_sum = flush_denormal(even[n] + odd[n]);
      const float dest = flush_denormal(element<float>(tc->data[m], n));
      set_element<float>(tc->data[m], n, flush_denormal(dest + pair_sum));
    }
  }
}

inline void dpbusd(int c, int a, int b) {
  Tile* tc;
  const Tile *ta, *tb;
  if (!chained(c, a, b, tc, ta, tb)) return;
  const int n_count = tc->row_bytes / 4, k_count = tb->rows;
  for (int m = 0; m < tc->rows; ++m) {
    for (int n = 0; n < n_count; ++n) {
      uint32_t sum = element<uint32_t>(tc->data[m], n);  // unsigned: the sum wraps modulo 2^32
      for (int k = 0; k < k_count; ++k)
        for (int i = 0; i < 4; ++i)
          sum += uint32_t(int32_t(ta->data[m][4 * k + i]) * int32_t(int8_t(tb->data[k][4 * n + i])));
      set_element<uint32_t>(tc->data[m], n, sum);
    }
  }
}

}  // namespace kf::amx::emu

// gcc and clang define some of these as macros and some as inline functions; a function-like macro
// defined after the function's declaration takes over every later use of the name.
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbusd
#define _tile_loadconfig(config) ::kf::amx::emu::load_config(config)
#define _tile_release() ::kf::amx::emu::release()
#define _tile_zero(tile) ::kf::amx::emu::zero(tile)
#define _tile_loadd(tile, base, stride) ::kf::amx::emu::load(tile, base, stride)
#define _tile_stored(tile, base, stride) ::kf::amx::emu::store(tile, base, stride)
#define _tile_dpbf16ps(c, a, b) ::kf::amx::emu::dpbf16ps(c, a, b)
#define _tile_dpbusd(c, a, b) ::kf::amx::emu::dpbusd(c, a, b)
