// The top-p threshold without sorting the row: the largest value v whose mass(x >= v) reaches
// p * mass, found by bisecting the floats' bit patterns (order-preserving keys). Each pass sums the
// mass above kPivots pivots at once (placed from a strided sample on the first pass), the
// candidates shrink to the entries above the new lower bound, and the last few are sorted.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "kernforge/core/loops.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"
#include "kernforge/sampling/row_stats.h"

namespace kf::sampling {

constexpr int64_t kExactMax = 256;  // candidates few enough to sort

// Order-preserving map between floats and uint32: a < b as floats iff key(a) < key(b). Every key
// between two finite floats' keys is a finite float, so bisecting keys bisects values.
inline uint32_t float_key(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
inline float key_float(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Mass of x >= pivot[i] for every pivot, in one pass. (Counting too would cost a third more; the
// compaction that follows a pass counts the survivors instead.)
inline PivotMasses pivot_masses(const float* x, int64_t n, const float (&pivot)[kPivots], int64_t threads,
                                std::vector<PivotMasses>& per_chunk) {
  per_chunk.assign(num_chunks(n), PivotMasses{});
  parallel_for(num_chunks(n), threads, [&](int64_t c) {
    const ChunkSpan chunk = chunk_span(c, n);
    VecF pivots[kPivots], mass[kPivots];
    for (int i = 0; i < kPivots; ++i) {
      pivots[i] = VecF::broadcast(pivot[i]);
      mass[i] = VecF::zero();
    }
    PivotMasses& out = per_chunk[size_t(c)];
    for_each_vector(
        chunk.begin, chunk.end,
        [&](int, int64_t j) {  // kPivots accumulators already make independent chains
          const VecF v = VecF::load(x + j);
          for (int i = 0; i < kPivots; ++i) mass[i] = add_if(v >= pivots[i], mass[i], v);
        },
        [&](int64_t j) {
          for (int i = 0; i < kPivots; ++i)
            if (x[j] >= pivot[i]) out.mass[i] += x[j];
        });
    for (int i = 0; i < kPivots; ++i) out.mass[i] += double(reduce_add(mass[i]));
  });
  PivotMasses total{};
  for (const PivotMasses& chunk : per_chunk)
    for (int i = 0; i < kPivots; ++i) total.mass[i] += chunk.mass[i];
  return total;
}

// Keeps the entries >= t of x[0, n) in dst, in order; returns their number. dst may be x itself
// (writes never pass the vector being read) and needs VecF::kWidth floats of room past the result.
inline int64_t compact_at_least(const float* x, int64_t n, float t, float* dst) {
  const VecF threshold = VecF::broadcast(t);
  int64_t kept = 0;
  for_each_vector(
      0, n,
      [&](int, int64_t j) {
        const VecF v = VecF::load(x + j);
        const MaskF passing = v >= threshold;
        if (to_bits(passing)) kept += compress_store(dst + kept, passing, v);  // usually none pass
      },
      [&](int64_t i) {
        if (x[i] >= t) dst[kept++] = x[i];
      });
  return kept;
}

// The largest v among x[0, n) with mass(x >= v) >= target, found by sorting the entries >= lo.
inline float exact_top_p(const float* x, int64_t n, float lo, double target, std::vector<float>& sorted) {
  sorted.clear();
  for (int64_t i = 0; i < n; ++i)
    if (x[i] >= lo) sorted.push_back(x[i]);
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  double mass = 0.0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    mass += sorted[i];
    const bool last_of_ties = i + 1 == sorted.size() || sorted[i + 1] != sorted[i];
    if (last_of_ties && mass >= target) return sorted[i];
  }
  return lo;  // rounding kept the sum just under the target: keep every candidate
}

// Pivots spread evenly over the keys in (lo, hi], ascending.
inline void even_pivots(uint32_t lo_key, uint32_t hi_key, uint32_t (&pivot_key)[kPivots]) {
  const uint64_t span = uint64_t(hi_key) - lo_key;
  for (int i = 0; i < kPivots; ++i) {
    const uint64_t step = std::max<uint64_t>(span * uint64_t(i + 1) / (kPivots + 1), uint64_t(i + 1));
    pivot_key[i] = uint32_t(std::min<uint64_t>(uint64_t(lo_key) + step, hi_key));
  }
}

// Pivots around the threshold that a strided sample of the row predicts: its entries sorted
// descending, each standing for n / samples entries, give an estimate of mass(x >= v). A wrong
// estimate costs a pass, never the result: the bisection checks every pivot on the whole row.
inline void sample_pivots(const float* x, int64_t n, double target, uint32_t lo_key, uint32_t hi_key,
                          uint32_t (&pivot_key)[kPivots], std::vector<float>& sample) {
  const int64_t samples = std::min<int64_t>(n, 256), stride = n / samples;
  sample.resize(size_t(samples));
  for (int64_t i = 0; i < samples; ++i) sample[size_t(i)] = x[i * stride];
  std::sort(sample.begin(), sample.end(), std::greater<float>());
  int64_t at = samples - 1;
  double estimate = 0.0;
  for (int64_t i = 0; i < samples; ++i) {
    estimate += double(sample[size_t(i)]) * double(stride);
    if (estimate >= target) {
      at = i;
      break;
    }
  }
  static constexpr int64_t kRankOffsets[kPivots] = {16, 8, 4, 2, 1, 0, -1};  // deeper ranks: lower values
  int distinct = 0;
  for (int i = 0; i < kPivots; ++i) {
    const int64_t rank = std::clamp<int64_t>(at + kRankOffsets[i], 0, samples - 1);
    pivot_key[i] = std::clamp(float_key(sample[size_t(rank)]), lo_key + 1, hi_key);
    distinct += i == 0 || pivot_key[i] != pivot_key[i - 1];
  }
  if (distinct < kPivots / 2) even_pivots(lo_key, hi_key, pivot_key);  // the sample says little here
}

// The top-p threshold: the largest value v of the row with mass(x >= v) >= target, given that lo
// reaches the target and hi >= every entry. Each pass counts kPivots pivots between them; after a
// pass that raised lo the candidates shrink to the entries >= lo, and once few remain they are
// sorted. `compact_first`: the caller knows few entries reach lo (after a top-k).
inline float top_p_threshold(const float* x, int64_t n, float lo, float hi, bool compact_first, double target,
                             int64_t threads, Scratch& s) {
  uint32_t lo_key = float_key(lo), hi_key = float_key(hi);
  const float* candidates = x;  // every entry >= key_float(lo_key) lies in candidates[0, m)
  int64_t m = n;
  bool lo_rose = compact_first;
  for (bool first_pass = !compact_first; lo_key < hi_key; first_pass = false) {
    if (lo_rose) {  // keep the survivors only
      if (candidates == x) s.candidates.resize(size_t(n + VecF::kWidth));
      m = compact_at_least(candidates, m, key_float(lo_key), s.candidates.data());
      candidates = s.candidates.data();
    }
    if (m <= kExactMax) return exact_top_p(candidates, m, key_float(lo_key), target, s.sorted);
    uint32_t pivot_key[kPivots];
    if (first_pass) {  // nothing known yet but the bounds
      sample_pivots(x, n, target, lo_key, hi_key, pivot_key, s.sorted);
    } else {
      even_pivots(lo_key, hi_key, pivot_key);
    }
    float pivot[kPivots];
    for (int i = 0; i < kPivots; ++i) pivot[i] = key_float(pivot_key[i]);
    const PivotMasses at = pivot_masses(candidates, m, pivot, threads, s.pivot_chunks);
    uint32_t new_hi = hi_key;
    lo_rose = false;
    for (int i = kPivots - 1; i >= 0; --i) {
      if (at.mass[i] >= target) {
        lo_rose = pivot_key[i] > lo_key;
        lo_key = pivot_key[i];
        break;
      }
      new_hi = pivot_key[i] - 1;
    }
    hi_key = std::max(new_hi, lo_key);
  }
  return key_float(lo_key);
}

}  // namespace kf::sampling
