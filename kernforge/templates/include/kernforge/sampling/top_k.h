// The top-k threshold (the k-th largest value of a row) without sorting the row: a floor from the
// block maxima that row_stats leaves in Scratch, then one compare pass that buffers the few entries
// at or above a rising floor. Exact, so the same for any split of the row over threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "kernforge/core/loops.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"
#include "kernforge/sampling/row_stats.h"

namespace kf::sampling {

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
  for_each_vector(
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

}  // namespace kf::sampling
