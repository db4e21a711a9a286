// Sampling kernels (FlashInfer semantics): softmax, top-k / top-p / min-p filtering, renormalization,
// logit masking and inverse-CDF sampling, without sorting the vocabulary. Written once against kf::VecF.
//
// Every filter keeps the entries x >= t of a row for one threshold t:
//   top-k  t = the k-th largest value (ties at t are all kept);
//   top-p  t = the largest value v whose mass(x >= v) reaches p * mass, i.e. x is kept iff the mass
//          of strictly larger entries is < p * mass;
//   min-p  t = min_p * max(x).
// Filters combine by taking the largest threshold. The k-th value comes from a compare pass that
// buffers the few entries above a floor (the k-th largest block maximum); the top-p threshold from a
// bisection over the floats' bit patterns that sums the mass above several pivots per pass and
// shrinks to the surviving candidates. The first pass reads the row from memory; later passes find
// it in L2 (a 128K-entry fp32 row is 512 KiB), so a call costs about one read of its rows plus a few
// passes over L2.
//
// Determinism: rows are cut into fixed chunks; every sum is a per-chunk vector sum, combined in chunk
// order in double. Thresholds are exact, so they depend on the data only. Results are therefore
// bitwise the same for any thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "kernforge/rows.h"

namespace kf::sampling {

constexpr int64_t kChunk = 4096;  // elements; 16 KiB of fp32, a few hundred vectors per chunk
constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t num_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

// body(chunk, begin, end) for the chunks of [0, n), on up to `threads` threads.
template <class Body>
inline void for_chunks(int64_t n, int64_t threads, const Body& body) {
  const int64_t chunks = num_chunks(n);
  parallel_for(chunks, std::min(threads, chunks),
               [&](int64_t c) { body(c, c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

// op(chain, j) for the full vectors of [begin, end), then tail(i) for each element after them.
// Consecutive vectors take chains 0..kChains-1 in turn: a reduction keeps one accumulator per chain,
// and the independent dependency chains hide the add latency, which a single accumulator would pay
// on every vector (twice the time of a pass over L2). Tails are scalar so that no padding lane
// (loaded as 0) can pass a comparison with a threshold <= 0.
constexpr int kChains = 4;
template <class VecOp, class TailOp>
inline void for_full_vectors(int64_t begin, int64_t end, const VecOp& op, const TailOp& tail) {
  constexpr int64_t kWidth = VecF::kWidth;
  int64_t j = begin;
  for (; j + kChains * kWidth <= end; j += kChains * kWidth)
    for (int chain = 0; chain < kChains; ++chain) op(chain, j + chain * kWidth);
  for (; j + kWidth <= end; j += kWidth) op(0, j);
  for (; j < end; ++j) tail(j);
}

// Accumulators, one per chain, combined in a fixed order.
struct Chains {
  VecF v[kChains];
  static Chains of(float x) {
    Chains c;
    for (VecF& a : c.v) a = VecF::broadcast(x);
    return c;
  }
  VecF sum() const { return (v[0] + v[1]) + (v[2] + v[3]); }
  VecF max() const { return kf::max(kf::max(v[0], v[1]), kf::max(v[2], v[3])); }
};
static_assert(kChains == 4, "Chains::sum and Chains::max combine four chains");

// ------------------------------------------------------------------------------------ random numbers

// Philox4x32-10 (Salmon et al., SC'11): a counter-based generator, so every (seed, offset, row)
// gets its own stream no matter which thread draws it.
inline void philox4x32_10(uint32_t counter[4], const uint32_t key_in[2]) {
  uint32_t key[2] = {key_in[0], key_in[1]};
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * counter[0];
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * counter[2];
    const uint32_t next[4] = {uint32_t(p1 >> 32) ^ counter[1] ^ key[0], uint32_t(p1),
                              uint32_t(p0 >> 32) ^ counter[3] ^ key[1], uint32_t(p0)};
    std::memcpy(counter, next, sizeof(next));
    key[0] += 0x9E3779B9u;
    key[1] += 0xBB67AE85u;
  }
}

// A uniform double in [0, 1) with 53 random bits.
inline double uniform(uint64_t seed, uint64_t offset, uint64_t row) {
  uint32_t counter[4] = {uint32_t(row), uint32_t(row >> 32), uint32_t(offset), uint32_t(offset >> 32)};
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  philox4x32_10(counter, key);
  const uint64_t bits = (uint64_t(counter[0]) << 21) | (counter[1] >> 11);
  return double(bits) * 0x1p-53;
}

// ------------------------------------------------------------------------------------ row passes

constexpr int kPivots = 7;  // pivots per top-p pass: the key range shrinks 8x per pass

struct PivotMasses {
  double mass[kPivots];
};

// Per-thread working memory, kept between calls (thread_local), so rows allocate nothing.
struct Scratch {
  std::vector<float> row, candidates, sorted, block_max;
  std::vector<double> chunk_mass, chunk_sum;
  std::vector<float> chunk_max;
  std::vector<PivotMasses> pivot_chunks;
};

constexpr int64_t kBlock = 256;  // elements per block maximum (top-k's starting floor); divides kChunk

struct RowStats {
  float max;
  double sum;
};

// Sum and max of the row, and the max of every kBlock-element block (for top_k_threshold), in
// one pass: the one that reads the row from memory.
inline RowStats row_stats(const float* x, int64_t n, int64_t threads, Scratch& s) {
  std::vector<double>& sums = s.chunk_sum;
  std::vector<float>& maxes = s.chunk_max;
  sums.assign(num_chunks(n), 0.0);
  maxes.assign(num_chunks(n), -kInf);
  s.block_max.resize(size_t((n + kBlock - 1) / kBlock));
  for_chunks(n, threads, [&](int64_t c, int64_t begin, int64_t end) {
    Chains sum = Chains::of(0.0f);
    float tail_sum = 0.0f;
    for (int64_t block = begin; block < end; block += kBlock) {
      Chains top = Chains::of(-kInf);
      float tail_max = -kInf;
      for_full_vectors(
          block, std::min(end, block + kBlock),
          [&](int chain, int64_t j) {
            const VecF v = VecF::load(x + j);
            sum.v[chain] += v;
            top.v[chain] = max(top.v[chain], v);
          },
          [&](int64_t i) {
            tail_sum += x[i];
            tail_max = std::max(tail_max, x[i]);
          });
      const float block_max = std::max(reduce_max(top.max()), tail_max);
      s.block_max[size_t(block / kBlock)] = block_max;
      maxes[c] = std::max(maxes[c], block_max);
    }
    sums[c] = double(reduce_add(sum.sum())) + double(tail_sum);
  });
  RowStats stats{-kInf, 0.0};
  for (size_t c = 0; c < sums.size(); ++c) {
    stats.sum += sums[c];
    stats.max = std::max(stats.max, maxes[c]);
  }
  return stats;
}

// Mass of the entries >= t; the per-chunk masses are left in chunk_mass for sample_index.
inline double mass_at_least(const float* x, int64_t n, float t, int64_t threads, std::vector<double>& chunk_mass) {
  chunk_mass.assign(num_chunks(n), 0.0);
  const VecF threshold = VecF::broadcast(t);
  for_chunks(n, threads, [&](int64_t c, int64_t begin, int64_t end) {
    Chains mass = Chains::of(0.0f);
    double tail = 0.0;
    for_full_vectors(
        begin, end,
        [&](int chain, int64_t j) {
          const VecF v = VecF::load(x + j);
          mass.v[chain] = add_if(v >= threshold, mass.v[chain], v);
        },
        [&](int64_t i) {
          if (x[i] >= t) tail += x[i];
        });
    chunk_mass[c] = double(reduce_add(mass.sum())) + tail;
  });
  double total = 0.0;
  for (double chunk : chunk_mass) total += chunk;
  return total;
}

// ------------------------------------------------------------------------------------ top-k

// A floor under the k-th largest value: the k-th largest of the row's block maxima (left in
// s.block_max by row_stats). The k blocks whose maxima reach it hold k distinct entries >= it. On
// a row in no particular order the k largest entries mostly sit in different blocks, so few more
// than k entries reach the floor.
inline float top_k_floor(int64_t k, Scratch& s) {
  if (int64_t(s.block_max.size()) < k) return -kInf;
  for (float& m : s.block_max) m = std::isnan(m) ? -kInf : m;  // NaN would break nth_element's ordering
  std::nth_element(s.block_max.begin(), s.block_max.begin() + (k - 1), s.block_max.end(), std::greater<float>());
  return s.block_max[size_t(k - 1)];
}

// The k largest entries >= floor of x[begin, end) (all of them if fewer), in any order, appended to
// `out`. One pass: entries at or above the running floor go to a buffer; when it fills,
// nth_element keeps its k largest and the floor rises just above the k-th. Few entries pass the
// comparison after a good starting floor, so the pass runs at memory speed; the worst case (an
// ascending row, no floor) costs one nth_element per buffer of entries.
inline void k_largest(const float* x, int64_t begin, int64_t end, int64_t k, float floor, std::vector<float>& buffer,
                      std::vector<float>& out) {
  const size_t capacity = size_t(std::max<int64_t>(2 * k, 1024));
  buffer.clear();
  buffer.reserve(capacity + VecF::kWidth);
  VecF running = VecF::broadcast(floor);
  const auto shrink = [&] {
    std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), std::greater<float>());
    buffer.resize(size_t(k));
    floor = std::nextafter(*std::min_element(buffer.begin(), buffer.end()), kInf);  // x > k-th <=> x >= floor
    running = VecF::broadcast(floor);
  };
  for_full_vectors(
      begin, end,
      [&](int, int64_t j) {
        uint32_t passing = to_bits(VecF::load(x + j) >= running);
        if (!passing) return;
        for (; passing; passing &= passing - 1) buffer.push_back(x[j + __builtin_ctz(passing)]);
        if (buffer.size() >= capacity) shrink();
      },
      [&](int64_t i) {
        if (x[i] >= floor) buffer.push_back(x[i]);
      });
  if (int64_t(buffer.size()) > k) shrink();
  out.insert(out.end(), buffer.begin(), buffer.end());
}

// The k-th largest value of the row (k < n), or -inf when fewer than k entries are >= -inf; needs
// row_stats of the row first. Exact, so the same for any split of the row: with several threads
// each takes a slice, then the slices' k largest are merged.
inline float top_k_threshold(const float* x, int64_t n, int64_t k, int64_t threads, Scratch& s) {
  const float floor = top_k_floor(k, s);
  const int64_t parts = std::max<int64_t>(1, std::min(threads, n / kChunk));
  const int64_t slice = (n + parts - 1) / parts;
  std::vector<std::vector<float>> found(static_cast<size_t>(parts));
  parallel_for(parts, parts, [&](int64_t part) {
    thread_local std::vector<float> buffer;
    k_largest(x, part * slice, std::min(n, (part + 1) * slice), k, floor, buffer, found[size_t(part)]);
  });
  std::vector<float>& merged = s.sorted;
  merged.clear();
  for (const auto& values : found) merged.insert(merged.end(), values.begin(), values.end());
  if (int64_t(merged.size()) < k) return -kInf;
  std::nth_element(merged.begin(), merged.begin() + (k - 1), merged.end(), std::greater<float>());
  return merged[size_t(k - 1)];
}

// ------------------------------------------------------------------------------------ top-p

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
  for_chunks(n, threads, [&](int64_t c, int64_t begin, int64_t end) {
    VecF pivots[kPivots], mass[kPivots];
    for (int i = 0; i < kPivots; ++i) {
      pivots[i] = VecF::broadcast(pivot[i]);
      mass[i] = VecF::zero();
    }
    PivotMasses& out = per_chunk[size_t(c)];
    for_full_vectors(
        begin, end,
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
  for_full_vectors(
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

// ------------------------------------------------------------------------------------ per-row ops

// probs = softmax(logits * inv_temperature): a max pass, an exp-and-sum pass, a scaling pass.
template <class T>
inline void softmax_row(const T* logits, float* probs, int64_t n, float inv_temperature, int64_t threads,
                        Scratch& s) {
  s.chunk_max.assign(num_chunks(n), -kInf);
  for_chunks(n, threads, [&](int64_t c, int64_t begin, int64_t end) {
    Chains top = Chains::of(-kInf);
    float tail = -kInf;
    for_full_vectors(
        begin, end, [&](int chain, int64_t j) { top.v[chain] = max(top.v[chain], VecF::load(logits + j)); },
        [&](int64_t i) { tail = std::max(tail, to_float(logits[i])); });
    s.chunk_max[c] = std::max(reduce_max(top.max()), tail);
  });
  const float shift = *std::max_element(s.chunk_max.begin(), s.chunk_max.end()) * inv_temperature;
  const VecF scale = VecF::broadcast(inv_temperature), neg_shift = VecF::broadcast(-shift);
  s.chunk_sum.assign(num_chunks(n), 0.0);
  for_chunks(n, threads, [&](int64_t c, int64_t begin, int64_t end) {
    VecF sum = VecF::zero();
    double tail = 0.0;
    // The tail goes through the same vector exp (a partial vector), so equal logits anywhere in the
    // row get bitwise equal probabilities and ties survive into the filters.
    for_each_vector(begin, end, [&](int64_t j, int64_t count) {
      const VecF e = exp(fma(VecF::load(logits + j, count), scale, neg_shift));
      e.store(probs + j, count);
      if (count == VecF::kWidth) {
        sum += e;
      } else {
        for (int64_t i = j; i < j + count; ++i) tail += probs[i];
      }
    });
    s.chunk_sum[c] = double(reduce_add(sum)) + tail;
  });
  double total = 0.0;
  for (double chunk : s.chunk_sum) total += chunk;
  const VecF inv_total = VecF::broadcast(float(1.0 / total));
  for_chunks(n, threads, [&](int64_t, int64_t begin, int64_t end) {
    for_each_vector(begin, end, [&](int64_t j, int64_t count) { (VecF::load(probs + j, count) * inv_total).store(probs + j, count); });
  });
}

// The row as fp32: the input itself, or a converted copy in scratch.
inline const float* as_fp32(const float* row, int64_t, int64_t, Scratch&) { return row; }
template <class T>
inline const float* as_fp32(const T* row, int64_t n, int64_t threads, Scratch& s) {
  s.row.resize(size_t(n));
  float* dst = s.row.data();
  for_chunks(n, threads, [&](int64_t, int64_t begin, int64_t end) {
    for_each_vector(begin, end, [&](int64_t j, int64_t count) { VecF::load(row + j, count).store(dst + j, count); });
  });
  return dst;
}

// out = x / total where x >= t, else 0 (top_k_renorm_probs, top_p_renorm_probs).
template <class T>
inline void write_renormed(const float* x, T* out, int64_t n, float t, double total, int64_t threads) {
  const VecF threshold = VecF::broadcast(t), denominator = VecF::broadcast(float(total)), zero = VecF::zero();
  for_chunks(n, threads, [&](int64_t, int64_t begin, int64_t end) {
    for_each_vector(begin, end, [&](int64_t j, int64_t count) {
      const VecF v = VecF::load(x + j, count);
      select(v >= threshold, v / denominator, zero).store(out + j, count);
    });
  });
}

// out = x where x >= t, else -inf (top_k_mask_logits).
template <class T>
inline void write_masked(const float* x, T* out, int64_t n, float t, int64_t threads) {
  const VecF threshold = VecF::broadcast(t), minus_inf = VecF::broadcast(-kInf);
  for_chunks(n, threads, [&](int64_t, int64_t begin, int64_t end) {
    for_each_vector(begin, end, [&](int64_t j, int64_t count) {
      const VecF v = VecF::load(x + j, count);
      select(v >= threshold, v, minus_inf).store(out + j, count);
    });
  });
}

template <class T>
inline void fill_row(T* out, int64_t n, float value) {
  std::fill(out, out + n, from_float<T>(value));
}

// Inverse CDF over the kept entries (x >= t) in index order: the first i whose running mass exceeds
// u * total. The chunk comes from the per-chunk masses, the vector from vector sums, the entry from
// a scalar walk; a zero entry never exceeds, so tokens with probability 0 are never drawn.
inline int64_t sample_index(const float* x, int64_t n, float t, const std::vector<double>& chunk_mass,
                            double total, double u) {
  const double target = u * total;
  const int64_t chunks = int64_t(chunk_mass.size());
  double before = 0.0;
  int64_t c = 0;
  while (c < chunks && before + chunk_mass[size_t(c)] <= target) before += chunk_mass[size_t(c++)];
  if (c == chunks) {  // rounding put the target past the end: take the last kept entry
    for (int64_t i = n - 1; i >= 0; --i)
      if (x[i] >= t && x[i] > 0) return i;
    return 0;
  }
  const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
  const VecF threshold = VecF::broadcast(t), zero = VecF::zero();
  int64_t last_kept = -1;
  const auto walk = [&](int64_t from, int64_t to) -> int64_t {  // scalar walk over [from, to)
    for (int64_t i = from; i < to; ++i) {
      if (!(x[i] >= t && x[i] > 0)) continue;
      before += x[i];
      last_kept = i;
      if (before > target) return i;
    }
    return -1;
  };
  int64_t j = begin;
  for (; j + VecF::kWidth <= end; j += VecF::kWidth) {
    const VecF v = VecF::load(x + j);
    const double mass = reduce_add(select(v >= threshold, v, zero));
    if (before + mass <= target) {
      before += mass;
      continue;
    }
    const int64_t found = walk(j, j + VecF::kWidth);
    if (found >= 0) return found;
  }
  const int64_t found = walk(j, end);
  if (found >= 0) return found;
  if (last_kept >= 0) return last_kept;
  for (int64_t i = end - 1; i >= begin; --i)  // sums rounded differently than the chunk's: its last kept entry
    if (x[i] >= t && x[i] > 0) return i;
  return begin;
}

// ------------------------------------------------------------------------------------ batch driver

enum Action : int64_t { kSample = 0, kRenorm = 1, kMaskLogits = 2, kSoftmax = 3 };

// One call's arguments. Per-row parameters come as an array (one value per output row) or a scalar.
struct Params {
  int64_t action;
  const void* input;
  int64_t input_stride, input_rows, vocab;
  bool from_logits;  // softmax the input row first (sampling_from_logits, softmax)
  const void* row_index;  // output row -> input row, int32 or int64; null: the identity
  bool row_index_64;
  int64_t batch;  // output rows
  const int64_t* top_k_arr;
  int64_t top_k;  // >= vocab: no top-k
  const float* top_p_arr;
  float top_p;  // 1: no top-p
  const float* min_p_arr;
  float min_p;  // 0: no min-p
  const float* temperature_arr;
  float temperature;
  bool top_k_first;  // top-p over the top-k renormalized row; otherwise over the full row ("joint")
  const int64_t* seed_arr;
  int64_t seed_len, seed;
  const int64_t* offset_arr;
  int64_t offset_len, offset;
  void* samples;
  bool samples_64;
  uint8_t* valid;
  void* out;
  int64_t out_stride;
  int64_t threads;
};

struct Filter {
  int64_t top_k;
  float top_p, min_p, temperature;
};

inline Filter filter_for(const Params& p, int64_t r) {
  return {p.top_k_arr ? p.top_k_arr[r] : p.top_k, p.top_p_arr ? p.top_p_arr[r] : p.top_p,
          p.min_p_arr ? p.min_p_arr[r] : p.min_p, p.temperature_arr ? p.temperature_arr[r] : p.temperature};
}

inline int64_t input_row(const Params& p, int64_t r) {
  if (!p.row_index) return r;
  return p.row_index_64 ? static_cast<const int64_t*>(p.row_index)[r] : static_cast<const int32_t*>(p.row_index)[r];
}

// Argument errors, reported as (kind << 32) | row before any row is touched.
enum ParamError : int64_t { kBadTopK = 1, kBadTopP = 2, kBadMinP = 3, kBadTemperature = 4, kBadIndex = 5 };

inline int64_t validate(const Params& p) {
  for (int64_t r = 0; r < p.batch; ++r) {
    const Filter f = filter_for(p, r);
    const int64_t row = input_row(p, r);
    int64_t error = 0;
    if (f.top_k < 1) error = kBadTopK;
    else if (!(f.top_p > 0.0f && f.top_p <= 1.0f)) error = kBadTopP;
    else if (!(f.min_p >= 0.0f && f.min_p <= 1.0f)) error = kBadMinP;
    else if (!(f.temperature > 0.0f && f.temperature < kInf)) error = kBadTemperature;
    else if (row < 0 || row >= p.input_rows) error = kBadIndex;
    if (error) return (error << 32) | r;
  }
  return 0;
}

// The threshold that keeps a row's entries x >= t under every filter of f.
inline float keep_threshold(const float* x, int64_t n, RowStats stats, const Filter& f, bool top_k_first,
                            int64_t threads, Scratch& s) {
  float t = -kInf, top_k_t = -kInf;
  if (f.min_p > 0.0f) t = f.min_p * stats.max;
  if (f.top_k < n) top_k_t = top_k_threshold(x, n, f.top_k, threads, s), t = std::max(t, top_k_t);
  if (f.top_p < 1.0f) {
    // Bisection starts at a value known to keep p of the mass: the entries below (1 - p) * sum / n
    // hold less than (1 - p) of it. After a top-k, it starts at the k-th value.
    double total = stats.sum;
    float lo = float(0.5 * (1.0 - double(f.top_p)) * stats.sum / double(n));
    const bool after_top_k = top_k_first && top_k_t > -kInf;
    if (after_top_k) {
      total = mass_at_least(x, n, top_k_t, threads, s.chunk_mass);
      lo = top_k_t;
    }
    t = std::max(t, top_p_threshold(x, n, lo, stats.max, after_top_k, double(f.top_p) * total, threads, s));
  }
  return t;
}

template <class T>
T* out_row(const Params& p, int64_t r) {
  return static_cast<T*>(p.out) + r * p.out_stride;
}

template <class T>
inline void run_row(const Params& p, int64_t r, int64_t threads, Scratch& s) {
  const int64_t n = p.vocab;
  const T* src = static_cast<const T*>(p.input) + input_row(p, r) * p.input_stride;
  const Filter f = filter_for(p, r);
  const float* x;
  if (p.from_logits) {
    float* probs = p.action == kSoftmax ? out_row<float>(p, r) : (s.row.resize(size_t(n)), s.row.data());
    softmax_row(src, probs, n, 1.0f / f.temperature, threads, s);
    if (p.action == kSoftmax) return;
    x = probs;
  } else {
    x = as_fp32(src, n, threads, s);
  }
  const RowStats stats = row_stats(x, n, threads, s);
  if (p.action == kMaskLogits) {
    const float t = f.top_k < n ? top_k_threshold(x, n, f.top_k, threads, s) : -kInf;
    return write_masked(x, out_row<T>(p, r), n, t, threads);
  }
  const bool valid = std::isfinite(stats.sum) && stats.sum > 0.0;
  float t = -kInf;
  double kept = 0.0;  // the mass of the entries the filters keep
  if (valid) {
    t = keep_threshold(x, n, stats, f, p.top_k_first, threads, s);
    kept = mass_at_least(x, n, t, threads, s.chunk_mass);
  }
  if (p.action == kRenorm) {
    if (!valid) return fill_row(out_row<T>(p, r), n, std::isnan(stats.sum) || std::isinf(stats.sum) ? NAN : 0.0f);
    return write_renormed(x, out_row<T>(p, r), n, t, kept, threads);
  }
  int64_t token = 0;
  if (valid && kept > 0.0) {
    const int64_t seed = p.seed_arr ? p.seed_arr[p.seed_len == 1 ? 0 : r] : p.seed;
    const int64_t offset = p.offset_arr ? p.offset_arr[p.offset_len == 1 ? 0 : r] : p.offset;
    token = sample_index(x, n, t, s.chunk_mass, kept, uniform(uint64_t(seed), uint64_t(offset), uint64_t(r)));
  }
  if (p.samples_64) static_cast<int64_t*>(p.samples)[r] = token;
  else static_cast<int32_t*>(p.samples)[r] = int32_t(token);
  if (p.valid) p.valid[r] = valid && kept > 0.0;
}

// Rows run in parallel, one thread each, while there are enough of them; a smaller batch runs its
// rows one after another with every thread inside each row.
template <class T>
inline int64_t run(const Params& p) {
  if (const int64_t error = validate(p)) return error;
  const int64_t threads = std::max<int64_t>(1, p.threads);
  if (p.batch >= threads || p.vocab < 2 * kChunk) {
    const int64_t row_threads = std::min(threads, p.batch);
#pragma omp parallel for num_threads(int(row_threads)) schedule(dynamic, 1) if (row_threads > 1)
    for (int64_t r = 0; r < p.batch; ++r) {
      thread_local Scratch scratch;
      run_row<T>(p, r, 1, scratch);
    }
  } else {
    thread_local Scratch scratch;
    for (int64_t r = 0; r < p.batch; ++r) run_row<T>(p, r, threads, scratch);
  }
  return 0;
}

}  // namespace kf::sampling
