// Rotary position embedding (RoPE) with FlashInfer's semantics, written once against kf::VecF.
//
// Every head of a token's q and k is rotated with the token's one table of cos/sin: a pair
// (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin). Pairs are (i, i + rot/2) in the neox
// style and (2i, 2i + 1) interleaved. Pair i turns by pos * freq_i, with freq_i =
// theta^(-2i/rot) / rope_scale (Llama 3.1 blends the scaled and unscaled frequency by
// wavelength), or its cos/sin come from a [max_pos, rot] fp32 cache (cos in the first half of a
// row, sin in the second). Elements past the rotary dims keep their values (copied when the
// output is another tensor). Arithmetic is fp32; in place is safe (each vector is read before
// it is written).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernforge/core/loops.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/rows.h"
#include "kernforge/core/vec.h"

namespace kf {
namespace rope {

// Errors come back as (kind << 32) | index, found before any element is written.
enum ErrorKind : int64_t { kPositionOutOfRange = 1, kBadIndptr = 2 };

inline int64_t error(ErrorKind kind, int64_t index) { return (int64_t(kind) << 32) | index; }

// An int32 or int64 index tensor.
struct Indices {
  const void* data;
  bool is_64;

  int64_t operator[](int64_t i) const {
    return is_64 ? static_cast<const int64_t*>(data)[i] : int64_t(static_cast<const int32_t*>(data)[i]);
  }
};

// A token's position: pos_ids[token] or, for a ragged batch (pos_ids.data null), offsets[b] plus
// the token's index within request b = [indptr[b], indptr[b + 1]).
struct TokenPositions {
  Indices pos_ids;
  Indices indptr, offsets;
  int64_t batch;

  bool ragged() const { return pos_ids.data == nullptr; }

  int64_t operator()(int64_t token) const {
    if (!ragged()) return pos_ids[token];
    int64_t lo = 0, hi = batch;  // indptr[lo] <= token < indptr[hi] (indptr validated)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      (indptr[mid] <= token ? lo : hi) = mid;
    }
    return offsets[lo] + (token - indptr[lo]);
  }
};

// 0, or the first error: a ragged indptr that does not go 0 .. nnz without decreasing, or (with a
// cache of cache_rows rows) a position outside [0, cache_rows).
inline int64_t validate(const TokenPositions& positions, int64_t nnz, const float* cache, int64_t cache_rows) {
  if (positions.ragged()) {
    const Indices& indptr = positions.indptr;
    if (indptr[0] != 0) return error(kBadIndptr, 0);
    for (int64_t b = 1; b <= positions.batch; ++b) {
      if (indptr[b] < indptr[b - 1]) return error(kBadIndptr, b);
    }
    if (indptr[positions.batch] != nnz) return error(kBadIndptr, positions.batch);
  }
  if (cache != nullptr) {
    for (int64_t token = 0; token < nnz; ++token) {
      const int64_t pos = positions(token);
      if (pos < 0 || pos >= cache_rows) return error(kPositionOutOfRange, token);
    }
  }
  return 0;
}

// How the angles are found: rows of a cos/sin cache, or frequencies times the position.
struct Angles {
  const float* cache;  // [max_pos, rot] at cache_stride, or null
  int64_t cache_stride;
  const float* frequencies;  // [rot / 2], used without a cache
  int64_t half;              // rot / 2
};

// sin and cos of fp32 angles, within 2e-7 (libm's sincosf: 3e-8). Per lane, sincosf took 25 us of
// a 45 us bf16 decode step (64 tokens, 32 + 8 heads of 128, Zen 5); this takes about 1 us.
// The angle is reduced by k pi, k = rint(x / pi), in three fused multiply-adds with pi split over
// three floats: the first is exact (what it leaves fits a float), so the reduction holds for
// angles up to 2^24 (a position of millions at frequency 1). x / pi as an fp32 product is off by up
// to 0.45 there (its rounding and 1/pi's), so k can miss by one and leave r near +-pi: what is left
// is reduced once more, by rint(r / pi), which r's size makes exact. Taylor polynomials to x^13 /
// x^14 on [-pi/2, pi/2] (truncation below 1e-9) and (-1)^k finish it. The generic tier has no fused
// multiply-add to make the first step exact, so it calls the libm per lane.
inline VecF reduced_by_pi(VecF k, VecF x) {
  VecF r = fma(k, VecF::broadcast(-3.14159274101257324219f), x);  // -float(pi): an exact step
  r = fma(k, VecF::broadcast(8.74227765734758577310e-08f), r);    // -(pi - float(pi)), rounded
  return fma(k, VecF::broadcast(3.43024902e-15f), r);             // -(what that rounding left)
}

inline void sincos(VecF x, VecF& sin, VecF& cos) {
#if defined(KF_TIER_GENERIC)
  for (int i = 0; i < VecF::kWidth; ++i) ::sincosf(x.lane[i], &sin.lane[i], &cos.lane[i]);
#else
  const VecF inv_pi = VecF::broadcast(0.318309886183790671538f);
  VecF k = rint(x * inv_pi);
  VecF r = reduced_by_pi(k, x);
  const VecF again = rint(r * inv_pi);  // -1, 0 or 1
  r = reduced_by_pi(again, r);
  k = k + again;
  // (-1)^k: parity = k - 2 rint((k - 0.5) / 2), exact for integral k.
  const VecF half = VecF::broadcast(0.5f);
  const VecF parity = k - VecF::broadcast(2.0f) * rint((k - half) * half);
  const VecF sign = VecF::broadcast(1.0f) - VecF::broadcast(2.0f) * parity;
  const VecF r2 = r * r;
  const auto c = [](float v) { return VecF::broadcast(v); };
  VecF s = fma(r2, c(1.0f / 6227020800.0f), c(-1.0f / 39916800.0f));
  s = fma(r2, s, c(1.0f / 362880.0f));
  s = fma(r2, s, c(-1.0f / 5040.0f));
  s = fma(r2, s, c(1.0f / 120.0f));
  s = fma(r2, s, c(-1.0f / 6.0f));
  s = fma(r2 * r, s, r);
  VecF co = fma(r2, c(-1.0f / 87178291200.0f), c(1.0f / 479001600.0f));
  co = fma(r2, co, c(-1.0f / 3628800.0f));
  co = fma(r2, co, c(1.0f / 40320.0f));
  co = fma(r2, co, c(-1.0f / 720.0f));
  co = fma(r2, co, c(1.0f / 24.0f));
  co = fma(r2, co, c(-0.5f));
  co = fma(r2, co, c(1.0f));
  sin = s * sign;
  cos = co * sign;
#endif
}

// The rotation table of one token, one cos and one sin per lane. Neox: a lane per pair (rot / 2;
// a cache row is used where it lies). Interleaved: a lane per element, the pair's cos on both and
// its sin negated on the even one, so a vector of pairs rotates as x * cos + swap_pairs(x) * sin.
template <bool kInterleave>
class AngleTable {
 public:
  explicit AngleTable(const Angles& angles)
      : angles_(angles),
        lanes_((kInterleave ? 2 : 1) * angles.half),
        storage_(kInterleave || angles.cache == nullptr ? 2 * lanes_ : 0) {  // neox reads cache rows in place
    frequencies_ = angles.frequencies;
    if (kInterleave && angles.cache == nullptr) {  // one frequency per element
      element_frequencies_.resize(lanes_);
      for (int64_t i = 0; i < lanes_; ++i) element_frequencies_[i] = angles.frequencies[i / 2];
      frequencies_ = element_frequencies_.data();
    }
  }

  void set_position(int64_t position) {
    float* cos = storage_.data();
    float* sin = cos + lanes_;
    cos_ = cos, sin_ = sin;
    if (angles_.cache != nullptr) {
      const float* row = angles_.cache + position * angles_.cache_stride;
      const int64_t half = angles_.half;
      if constexpr (kInterleave) {
        for (int64_t i = 0; i < half; ++i) {
          cos[2 * i] = cos[2 * i + 1] = row[i];
          sin[2 * i] = -row[half + i];
          sin[2 * i + 1] = row[half + i];
        }
      } else {
        cos_ = row, sin_ = row + half;
      }
      return;
    }
    const VecF pos = VecF::broadcast(float(position));  // fp32 angle, as FlashInfer: float(pos) * freq
    for_each_vector(0, lanes_, [&](int, int64_t j, int64_t n) {
      VecF s, c;
      sincos(pos * VecF::load(frequencies_ + j, n), s, c);
      if constexpr (kInterleave) s = s * VecF::load(kEvenLanesNegative);  // j is even: lanes keep parity
      c.store(cos + j, n);
      s.store(sin + j, n);
    });
  }

  const float* cos() const { return cos_; }
  const float* sin() const { return sin_; }

 private:
  static constexpr float kEvenLanesNegative[16] = {-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1};
  static_assert(VecF::kWidth <= 16, "kEvenLanesNegative covers a vector");

  Angles angles_;
  int64_t lanes_;
  std::vector<float> storage_;
  std::vector<float> element_frequencies_;
  const float* frequencies_;
  const float* cos_ = nullptr;
  const float* sin_ = nullptr;
};

// Lanes (0 1)(2 3)... exchanged: each element next to its partner in its rotation pair.
inline VecF swap_pairs(VecF x) {
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  return {_mm512_permute_ps(x.v, 0xB1)};
#elif defined(KF_TIER_AVX2)
  return {_mm256_permute_ps(x.v, 0xB1)};
#else
  for (int i = 0; i < VecF::kWidth; i += 2) std::swap(x.lane[i], x.lane[i + 1]);
  return x;
#endif
}

// Neox: x[i] and x[i + half] are a pair.
template <class T>
inline void rotate_halves(T* out, const T* in, const float* cos, const float* sin, int64_t half) {
  for_each_vector(0, half, [&](int, int64_t j, int64_t n) {
    const VecF x1 = VecF::load(in + j, n), x2 = VecF::load(in + half + j, n);
    const VecF c = VecF::load(cos + j, n), s = VecF::load(sin + j, n);
    (x1 * c - x2 * s).store(out + j, n);
    (x2 * c + x1 * s).store(out + half + j, n);
  });
}

// Interleaved: x[2i] and x[2i + 1] are a pair; rot is even, so no vector splits a pair.
template <class T>
inline void rotate_pairs(T* out, const T* in, const float* cos, const float* signed_sin, int64_t rot) {
  for_each_vector(0, rot, [&](int, int64_t j, int64_t n) {
    const VecF x = VecF::load(in + j, n);
    (x * VecF::load(cos + j, n) + swap_pairs(x) * VecF::load(signed_sin + j, n)).store(out + j, n);
  });
}

// The heads of q or of k: rows of head_dim elements at (token, head), read from `in` and written
// to `out` (the same rows when in place).
template <class T>
struct Heads {
  StridedRows<const T> in;
  StridedRows<T> out;
  int64_t count;
};

template <bool kInterleave, class T>
inline void rotate_token(const Heads<T>& heads, int64_t token, const AngleTable<kInterleave>& table, int64_t rot,
                         int64_t head_dim) {
  for (int64_t h = 0; h < heads.count; ++h) {
    const T* in = heads.in.row(token, h);
    T* out = heads.out.row(token, h);
    if constexpr (kInterleave) {
      rotate_pairs(out, in, table.cos(), table.sin(), rot);
    } else {
      rotate_halves(out, in, table.cos(), table.sin(), rot / 2);
    }
    if (out != in) std::memcpy(out + rot, in + rot, size_t(head_dim - rot) * sizeof(T));
  }
}

// Tokens are split across threads only above this many elements per thread, as for the norms
// (a fork/join costs ~1 us; one thread rotates a decode step of a few tokens faster alone).
constexpr int64_t kMinElementsPerThread = 32 * 1024;

template <bool kInterleave, class T>
void rotate(const Heads<T>& q, const Heads<T>& k, const TokenPositions& positions, const Angles& angles, int64_t nnz,
            int64_t head_dim, int64_t rot, int64_t num_threads) {
  const int64_t elements = nnz * (q.count + k.count) * head_dim;
  const int64_t threads = useful_threads(num_threads, nnz, elements, kMinElementsPerThread);
  parallel_blocks(nnz, threads, [&](int64_t, int64_t begin, int64_t end) {
    AngleTable<kInterleave> table(angles);
    for (int64_t token = begin; token < end; ++token) {
      table.set_position(positions(token));
      rotate_token(q, token, table, rot, head_dim);
      rotate_token(k, token, table, rot, head_dim);
    }
  });
}

// What decides the frequencies. llama31: Llama 3.1's smoothing between old_context_len /
// high_freq_factor and old_context_len / low_freq_factor wavelengths.
struct FrequencyParams {
  int64_t rot;
  double rope_scale, rope_theta;
  bool llama31;
  double low_freq_factor, high_freq_factor, old_context_len;

  bool operator==(const FrequencyParams& o) const {
    return rot == o.rot && rope_scale == o.rope_scale && rope_theta == o.rope_theta && llama31 == o.llama31 &&
           low_freq_factor == o.low_freq_factor && high_freq_factor == o.high_freq_factor &&
           old_context_len == o.old_context_len;
  }
};

// freq_i = theta^(-2i/rot) / rope_scale, with Llama 3.1's blend
//   smooth = clamp(freq * old_context_len / (2 pi (high - low)) - 1 / (high / low - 1), 0, 1)
//   freq   = (1 - smooth) * freq / rope_scale + smooth * freq
// (FlashInfer's formula), formed in double and rounded to fp32 once.
inline void compute_frequencies(const FrequencyParams& p, float* freq) {
  constexpr double two_pi = 2.0 * 3.14159265358979323846;
  const double high = p.high_freq_factor, low = p.low_freq_factor;
  const double smooth_a = p.llama31 ? p.old_context_len / (two_pi * high - two_pi * low) : 0.0;
  const double smooth_b = p.llama31 ? -1.0 / (high / low - 1.0) : 0.0;
  for (int64_t i = 0; i < p.rot / 2; ++i) {
    const double base = std::pow(p.rope_theta, -double(2 * i) / double(p.rot));
    const double smooth = std::min(1.0, std::max(0.0, base * smooth_a + smooth_b));
    freq[i] = float((1.0 - smooth) * (base / p.rope_scale) + smooth * base);
  }
}

// The calling thread's table for `p`, recomputed only when the parameters change: a model calls
// RoPE once per layer with the same ones, and rot / 2 pow() calls cost about a microsecond.
inline const float* frequencies(const FrequencyParams& p) {
  thread_local FrequencyParams last{};
  thread_local std::vector<float> table;
  if (!(p == last) || table.size() != size_t(p.rot / 2)) {
    table.resize(p.rot / 2);
    compute_frequencies(p, table.data());
    last = p;
  }
  return table.data();
}

// Validates, then rotates; returns 0 or an error (see ErrorKind) with nothing written.
template <class T>
int64_t apply(const Heads<T>& q, const Heads<T>& k, const TokenPositions& positions, Angles angles, int64_t cache_rows,
              const FrequencyParams& freq, bool interleave, int64_t nnz, int64_t head_dim, int64_t num_threads) {
  if (nnz <= 0) return 0;
  if (const int64_t err = validate(positions, nnz, angles.cache, cache_rows)) return err;
  if (angles.cache == nullptr) angles.frequencies = frequencies(freq);
  if (interleave) {
    rotate<true>(q, k, positions, angles, nnz, head_dim, freq.rot, num_threads);
  } else {
    rotate<false>(q, k, positions, angles, nnz, head_dim, freq.rot, num_threads);
  }
  return 0;
}

}  // namespace rope
}  // namespace kf
