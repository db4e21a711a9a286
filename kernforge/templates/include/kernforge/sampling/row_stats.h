// What every sampling filter builds on: the fixed chunking of a row that makes results independent
// of the thread count, the per-thread Scratch memory, and the row passes shared by the filters and
// the driver: row_stats (sum, max and block maxima, from the pass that reads the row from memory)
// and mass_at_least (the mass a threshold keeps, per chunk for sample_index).
//
// Determinism: a row is cut into fixed chunks of kChunk elements, the unit of parallel work; every
// sum is a per-chunk vector sum, combined in chunk order in double, so the result is bitwise the
// same however the chunks are spread over threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernforge/core/loops.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"

namespace kf::sampling {

constexpr int64_t kChunk = 4096;  // elements; 16 KiB of fp32, a few hundred vectors per chunk
constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t num_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

// Chunk c of a row of n elements is [begin, end). A pass over the row runs
//   parallel_for(num_chunks(n), threads, [&](int64_t c) { const ChunkSpan s = chunk_span(c, n); ... })
struct ChunkSpan {
  int64_t begin, end;
};
inline ChunkSpan chunk_span(int64_t c, int64_t n) { return {c * kChunk, std::min(n, (c + 1) * kChunk)}; }

constexpr int kPivots = 7;  // pivots per top-p pass (top_p.h): the key range shrinks 8x per pass

// The masses of x >= pivot[i] for top_p.h's pivots (here because Scratch keeps them per chunk).
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

// The calling thread's Scratch.
inline Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

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
  parallel_for(num_chunks(n), threads, [&](int64_t c) {
    const ChunkSpan chunk = chunk_span(c, n);
    Chains sum = Chains::of(0.0f);
    float tail_sum = 0.0f;
    for (int64_t block = chunk.begin; block < chunk.end; block += kBlock) {
      Chains top = Chains::of(-kInf);
      float tail_max = -kInf;
      for_each_vector(
          block, std::min(chunk.end, block + kBlock),
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
  parallel_for(num_chunks(n), threads, [&](int64_t c) {
    const ChunkSpan chunk = chunk_span(c, n);
    Chains mass = Chains::of(0.0f);
    double tail = 0.0;
    for_each_vector(
        chunk.begin, chunk.end,
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

}  // namespace kf::sampling
