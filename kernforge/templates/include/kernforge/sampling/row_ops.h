// The per-row operations of the sampling driver other than the thresholds: softmax of a logit row,
// the fp32 view of a row, writing a renormalized or masked row, and the inverse-CDF draw of a token
// from the entries a threshold keeps. All passes run over row_stats.h's fixed chunks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernforge/core/loops.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"
#include "kernforge/sampling/row_stats.h"

namespace kf::sampling {

// probs = softmax(logits * inv_temperature): a max pass, an exp-and-sum pass, a scaling pass.
template <class T>
inline void softmax_row(const T* logits, float* probs, int64_t n, float inv_temperature, int64_t threads, Scratch& s) {
  s.chunk_max.assign(num_chunks(n), -kInf);
  parallel_for(num_chunks(n), threads, [&](int64_t c) {
    const ChunkSpan chunk = chunk_span(c, n);
    Chains top = Chains::of(-kInf);
    float tail = -kInf;
    for_each_vector(
        chunk.begin, chunk.end, [&](int chain, int64_t j) { top.v[chain] = max(top.v[chain], VecF::load(logits + j)); },
        [&](int64_t i) { tail = std::max(tail, to_float(logits[i])); });
    s.chunk_max[c] = std::max(reduce_max(top.max()), tail);
  });
  const float shift = *std::max_element(s.chunk_max.begin(), s.chunk_max.end()) * inv_temperature;
  const VecF scale = VecF::broadcast(inv_temperature), neg_shift = VecF::broadcast(-shift);
  s.chunk_sum.assign(num_chunks(n), 0.0);
  parallel_for(num_chunks(n), threads, [&](int64_t c) {
    const ChunkSpan chunk = chunk_span(c, n);
    VecF sum = VecF::zero();
    double tail = 0.0;
    // The tail goes through the same vector exp (a partial vector), so equal logits anywhere in the
    // row get bitwise equal probabilities and ties survive into the filters.
    for_each_vector(chunk.begin, chunk.end, [&](int, int64_t j, int64_t count) {
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
  parallel_for(num_chunks(n), threads, [&](int64_t c) {
    const ChunkSpan chunk = chunk_span(c, n);
    for_each_vector(chunk.begin, chunk.end, [&](int, int64_t j, int64_t count) {
      (VecF::load(probs + j, count) * inv_total).store(probs + j, count);
    });
  });
}

// The row as fp32: the input itself, or a converted copy in scratch.
inline const float* as_fp32(const float* row, int64_t, int64_t, Scratch&) { return row; }
template <class T>
inline const float* as_fp32(const T* row, int64_t n, int64_t threads, Scratch& s) {
  s.row.resize(size_t(n));
  float* dst = s.row.data();
  parallel_for(num_chunks(n), threads, [&](int64_t c) {
    const ChunkSpan chunk = chunk_span(c, n);
    for_each_vector(chunk.begin, chunk.end,
                    [&](int, int64_t j, int64_t count) { VecF::load(row + j, count).store(dst + j, count); });
  });
  return dst;
}

// out = x / total where x >= t, else 0 (top_k_renorm_probs, top_p_renorm_probs).
template <class T>
inline void write_renormed(const float* x, T* out, int64_t n, float t, double total, int64_t threads) {
  const VecF threshold = VecF::broadcast(t), denominator = VecF::broadcast(float(total)), zero = VecF::zero();
  parallel_for(num_chunks(n), threads, [&](int64_t c) {
    const ChunkSpan chunk = chunk_span(c, n);
    for_each_vector(chunk.begin, chunk.end, [&](int, int64_t j, int64_t count) {
      const VecF v = VecF::load(x + j, count);
      select(v >= threshold, v / denominator, zero).store(out + j, count);
    });
  });
}

// out = x where x >= t, else -inf (top_k_mask_logits).
template <class T>
inline void write_masked(const float* x, T* out, int64_t n, float t, int64_t threads) {
  const VecF threshold = VecF::broadcast(t), minus_inf = VecF::broadcast(-kInf);
  parallel_for(num_chunks(n), threads, [&](int64_t c) {
    const ChunkSpan chunk = chunk_span(c, n);
    for_each_vector(chunk.begin, chunk.end, [&](int, int64_t j, int64_t count) {
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
inline int64_t sample_index(const float* x, int64_t n, float t, const std::vector<double>& chunk_mass, double total,
                            double u) {
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
  const ChunkSpan chunk = chunk_span(c, n);
  const int64_t begin = chunk.begin, end = chunk.end;
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

}  // namespace kf::sampling
