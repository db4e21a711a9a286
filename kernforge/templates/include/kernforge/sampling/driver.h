// The sampling kernels' batch driver: the entry point's arguments (params_from), their per-row
// validation, and run_row, which strings a row's passes together for each action (sample, renorm,
// mask logits, softmax); run spreads the rows, or the chunks of each row, over the threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernforge/core/parallel.h"
#include "kernforge/sampling/rng.h"
#include "kernforge/sampling/row_ops.h"
#include "kernforge/sampling/row_stats.h"
#include "kernforge/sampling/top_k.h"
#include "kernforge/sampling/top_p.h"

namespace kf::sampling {

// Action (kSample, kRenorm, kMaskLogits, kSoftmax) and ParamError (below) are declared once in
// Python with the module (kernforge/ops/sampling.py) and emitted ahead of this header by the prelude.

// One call's arguments. Per-row parameters come as an array (one value per output row) or a scalar.
struct Params {
  int64_t action;
  const void* input;
  int64_t input_stride, input_rows, vocab;
  bool from_logits;       // softmax the input row first (sampling_from_logits, softmax)
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

// The entry point's arguments (a plain struct with the fields, names and C types of the template's
// cdecl: int64_t addresses, counts and flags, double top_p / min_p / temperature) as Params. The
// one place where the C arguments get their types.
template <class Args>
inline Params params_from(const Args& a) {
  Params p;
  p.action = a.action;
  p.input = reinterpret_cast<const void*>(a.input);
  p.input_stride = a.input_stride, p.input_rows = a.input_rows, p.vocab = a.vocab;
  p.from_logits = a.from_logits != 0;
  p.row_index = reinterpret_cast<const void*>(a.row_index), p.row_index_64 = a.row_index_64 != 0;
  p.batch = a.batch;
  p.top_k_arr = reinterpret_cast<const int64_t*>(a.top_k_arr), p.top_k = a.top_k;
  p.top_p_arr = reinterpret_cast<const float*>(a.top_p_arr), p.top_p = float(a.top_p);
  p.min_p_arr = reinterpret_cast<const float*>(a.min_p_arr), p.min_p = float(a.min_p);
  p.temperature_arr = reinterpret_cast<const float*>(a.temperature_arr), p.temperature = float(a.temperature);
  p.top_k_first = a.top_k_first != 0;
  p.seed_arr = reinterpret_cast<const int64_t*>(a.seed_arr), p.seed_len = a.seed_len, p.seed = a.seed;
  p.offset_arr = reinterpret_cast<const int64_t*>(a.offset_arr), p.offset_len = a.offset_len, p.offset = a.offset;
  p.samples = reinterpret_cast<void*>(a.samples), p.samples_64 = a.samples_64 != 0;
  p.valid = reinterpret_cast<uint8_t*>(a.valid);
  p.out = reinterpret_cast<void*>(a.out), p.out_stride = a.out_stride;
  p.threads = a.num_threads;
  return p;
}

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

// Argument errors (ParamError: kBadTopK, kBadTopP, kBadMinP, kBadTemperature, kBadIndex), reported
// as (kind << 32) | row before any row is touched.

inline int64_t validate(const Params& p) {
  for (int64_t r = 0; r < p.batch; ++r) {
    const Filter f = filter_for(p, r);
    const int64_t row = input_row(p, r);
    int64_t error = 0;
    if (f.top_k < 1)
      error = kBadTopK;
    else if (!(f.top_p >= 0.0f))
      error = kBadTopP;  // 0: the top entry and its ties; >= 1: no top-p
    else if (!(f.min_p <= 1.0f))
      error = kBadMinP;  // <= 0: no min-p
    else if (!(f.temperature > 0.0f && f.temperature < kInf))
      error = kBadTemperature;
    else if (row < 0 || row >= p.input_rows)
      error = kBadIndex;
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
  if (p.samples_64)
    static_cast<int64_t*>(p.samples)[r] = token;
  else
    static_cast<int32_t*>(p.samples)[r] = int32_t(token);
  if (p.valid) p.valid[r] = valid && kept > 0.0;
}

// Rows run in parallel, one thread each, while there are enough of them; a smaller batch runs its
// rows one after another with every thread inside each row. Rows differ in cost (per-row filters,
// data-dependent top-p passes), so threads take whole rows one at a time. Returns 0, or the first
// ParamError as (kind << 32) | row, before any row is touched.
template <class T, class Args>
inline int64_t run(const Args& args) {
  const Params p = params_from(args);
  if (const int64_t error = validate(p)) return error;
  const int64_t threads = std::max<int64_t>(1, p.threads);
  if (p.batch >= threads || p.vocab < 2 * kChunk) {
    parallel_for<Schedule::kDynamic>(p.batch, threads, [&](int64_t r) { run_row<T>(p, r, 1, thread_scratch()); });
  } else {
    Scratch& scratch = thread_scratch();
    for (int64_t r = 0; r < p.batch; ++r) run_row<T>(p, r, threads, scratch);
  }
  return 0;
}

}  // namespace kf::sampling
