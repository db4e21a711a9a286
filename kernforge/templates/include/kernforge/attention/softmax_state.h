// Attention states and how they merge: FlashInfer's convention, stated once for every kernel that
// produces or combines partial attention (the cascade merge ops, split-KV decode's second phase).
//
// An attention state of one (token, head) over a set of keys is (v, s):
//   v = sum_i softmax(logit)_i * V_i   (the attention output over that set, head_dim values)
//   s = log2(sum_i exp(logit_i))       (its log-sum-exp, BASE 2), logit_i = sm_scale * q . k_i
// so s is the natural log-sum-exp times log2(e). An empty set is (0, -inf). FlashInfer's kernels
// compute softmax in base 2 (logits pre-scaled by log2(e), exp2/log2), and its merge kernels,
// attention LSE outputs and the Python references all use this s.
//
// Merging states of disjoint key sets gives the state of their union:
//   s = log2(sum_k 2^(s_k)),   v = sum_k 2^(s_k - s) v_k
// evaluated relative to max_k s_k so nothing overflows.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "kernforge/core/loops.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/rows.h"
#include "kernforge/core/vec.h"

namespace kf {

constexpr float kLog2e = 1.44269504088896341f;                        // log2(e): natural log-sum-exp -> s
constexpr float kEmptyLse = -std::numeric_limits<float>::infinity();  // s of an empty key set

// s of a segment from the running state of an online softmax over natural logits: max_logit is
// the largest logit, sum_exp = sum_i exp(logit_i - max_logit). No keys (sum_exp == 0) is empty.
inline float segment_lse(float max_logit, float sum_exp) {
  return sum_exp == 0.0f ? kEmptyLse : (max_logit + std::log(sum_exp)) * kLog2e;
}

namespace merge_detail {

// The states that contribute to one merge: their rows and normalized weights. Up to kInline live
// on the stack; a merge of more states (rare: each then reads kInline rows) allocates.
template <class In>
struct Terms {
  static constexpr int64_t kInline = 64;

  explicit Terms(int64_t capacity) {
    if (capacity > kInline) {
      heap_weights.reset(new float[capacity]);
      heap_rows.reset(new const In*[capacity]);
      weight = heap_weights.get();
      row = heap_rows.get();
    }
  }
  Terms(const Terms&) = delete;
  Terms& operator=(const Terms&) = delete;

  void add(const In* state_row, float state_weight) {
    row[count] = state_row;
    weight[count] = state_weight;
    ++count;
  }

  float inline_weights[kInline];
  const In* inline_rows[kInline];
  std::unique_ptr<float[]> heap_weights;
  std::unique_ptr<const In*[]> heap_rows;
  float* weight = inline_weights;
  const In** row = inline_rows;
  int64_t count = 0;
};

// out[j, j + kVectors * width) = sum_k weight[k] * row[k][...]; the last vector covers last_count
// lanes. The kVectors accumulators advance together through the states: one accumulator per
// vector would wait on its FMA latency at every state (for_each_vector hands out one vector per
// call, so it cannot interleave them). Each vector is read from every state before `out` is
// written, so `out` may be one of the rows.
template <int kVectors, class In, class Out>
inline void weighted_sum_panel(const Terms<In>& terms, int64_t j, int64_t last_count, Out* out) {
  constexpr int64_t kWidth = VecF::kWidth;
  VecF acc[kVectors];
  for (VecF& a : acc) a = VecF::zero();
  for (int64_t k = 0; k < terms.count; ++k) {
    const VecF w = VecF::broadcast(terms.weight[k]);
    const In* row = terms.row[k] + j;
    for (int c = 0; c < kVectors; ++c) {
      acc[c] = fma(w, VecF::load(row + c * kWidth, c + 1 < kVectors ? kWidth : last_count), acc[c]);
    }
  }
  for (int c = 0; c < kVectors; ++c) acc[c].store(out + j + c * kWidth, c + 1 < kVectors ? kWidth : last_count);
}

template <class In, class Out>
inline void weighted_sum(const Terms<In>& terms, int64_t head_dim, Out* out) {
  constexpr int64_t kWidth = VecF::kWidth;
  int64_t j = 0;
  for (; j + kChains * kWidth <= head_dim; j += kChains * kWidth) weighted_sum_panel<kChains>(terms, j, kWidth, out);
  for (; j + kWidth <= head_dim; j += kWidth) weighted_sum_panel<1>(terms, j, kWidth, out);
  if (j < head_dim) weighted_sum_panel<1>(terms, j, head_dim - j, out);
}

template <class Out>
inline void store_empty(int64_t head_dim, Out* out, float* lse_out) {
  for_each_vector(0, head_dim, [&](int, int64_t j, int64_t count) { VecF::zero().store(out + j, count); });
  if (lse_out != nullptr) *lse_out = kEmptyLse;
}

// Merges num_states states, state i being (row_at(i), score_at(i)). States with s = -inf (empty
// segments) get weight 0 and their rows are never read, so whatever they hold cannot leak into the
// result; when every state is empty (or there are none) the result is empty: (0, -inf). A NaN s
// makes the result NaN.
template <class In, class Out, class RowAt, class ScoreAt>
inline void merge_states(int64_t num_states, const RowAt& row_at, const ScoreAt& score_at, int64_t head_dim, Out* out,
                         float* lse_out) {
  float s_max = kEmptyLse;
  for (int64_t i = 0; i < num_states; ++i) {
    const float s = score_at(i);
    if (s > s_max || s != s) s_max = s;  // once NaN, s_max stays NaN: no s compares greater
  }
  if (s_max == kEmptyLse) return store_empty(head_dim, out, lse_out);

  Terms<In> terms(num_states);
  float sum = 0.0f;  // >= 1: the largest state contributes 2^0
  for (int64_t i = 0; i < num_states; ++i) {
    const float w = std::exp2(score_at(i) - s_max);
    if (w != 0.0f) {  // true for NaN, which must propagate
      terms.add(row_at(i), w);
      sum += w;
    }
  }
  const float inv_sum = 1.0f / sum;
  for (int64_t k = 0; k < terms.count; ++k) terms.weight[k] *= inv_sum;
  weighted_sum(terms, head_dim, out);
  if (lse_out != nullptr) *lse_out = s_max + std::log2(sum);
}

}  // namespace merge_detail

// Merges the states of one (token, head): state i is v[i * v_state_stride, + head_dim) with score
// s[i * s_state_stride]. Writes the merged v to out[0, head_dim) and its s to *lse_out (unless
// null). Accumulates in fp32; In/Out are fp32, bf16 or fp16 (the split-KV decode merges fp32
// partials into its output dtype). `out` may alias a state's row and lse_out a state's score.
template <class In, class Out>
void merge_state_row(int64_t num_states, const In* v, int64_t v_state_stride, const float* s, int64_t s_state_stride,
                     int64_t head_dim, Out* out, float* lse_out) {
  merge_detail::merge_states<In>(
      num_states, [&](int64_t i) { return v + i * v_state_stride; }, [&](int64_t i) { return s[i * s_state_stride]; },
      head_dim, out, lse_out);
}

// The same for two states held anywhere: (v_a, s_a) and (v_b, s_b).
template <class In, class Out>
void merge_state_pair(const In* v_a, float s_a, const In* v_b, float s_b, int64_t head_dim, Out* out, float* lse_out) {
  merge_detail::merge_states<In>(
      2, [&](int64_t i) { return i == 0 ? v_a : v_b; }, [&](int64_t i) { return i == 0 ? s_a : s_b; }, head_dim, out,
      lse_out);
}

// ---- batched merges over seq_len x num_heads (token, head) pairs: the cascade ops ------------------

// Pairs are split across threads only above this many v elements read per thread: below it a
// fork/join (~1 us) costs more than the merges (the same memory-bound regime as the norms).
constexpr int64_t kMergeMinElementsPerThread = 32 * 1024;

inline int64_t merge_threads(int64_t num_threads, int64_t pairs, int64_t elements_per_pair) {
  return useful_threads(num_threads, pairs, pairs * (elements_per_pair > 0 ? elements_per_pair : 1),
                        kMergeMinElementsPerThread);
}

// merge_states: v [seq_len, num_states, num_heads, head_dim] at (token, head) strides plus a state
// stride, s likewise; out [seq_len, num_heads, head_dim], lse [seq_len, num_heads] (base may be null).
template <class In, class Out>
void merge_states_batch(StridedRows<const In> v, int64_t v_state_stride, StridedRows<const float> s,
                        int64_t s_state_stride, StridedRows<Out> out, StridedRows<float> lse, int64_t seq_len,
                        int64_t num_states, int64_t num_heads, int64_t head_dim, int64_t num_threads) {
  const int64_t pairs = seq_len * num_heads;
  parallel_for(pairs, merge_threads(num_threads, pairs, num_states * head_dim), [&](int64_t p) {
    const int64_t t = p / num_heads, h = p % num_heads;
    merge_state_row(num_states, v.row(t, h), v_state_stride, s.row(t, h), s_state_stride, head_dim, out.row(t, h),
                    lse.base != nullptr ? lse.row(t, h) : nullptr);
  });
}

// merge_state / merge_state_in_place: out = merge(a, b) for every token whose mask byte is nonzero
// (every token without a mask); other tokens' out and lse are not touched. out may be a (in place).
template <class In, class Out>
void merge_state_pairs(StridedRows<const In> v_a, StridedRows<const float> s_a, StridedRows<const In> v_b,
                       StridedRows<const float> s_b, StridedRows<Out> out, StridedRows<float> lse, const uint8_t* mask,
                       int64_t mask_stride, int64_t seq_len, int64_t num_heads, int64_t head_dim, int64_t num_threads) {
  const int64_t pairs = seq_len * num_heads;
  parallel_for(pairs, merge_threads(num_threads, pairs, 2 * head_dim), [&](int64_t p) {
    const int64_t t = p / num_heads, h = p % num_heads;
    if (mask != nullptr && mask[t * mask_stride] == 0) return;
    merge_state_pair(v_a.row(t, h), *s_a.row(t, h), v_b.row(t, h), *s_b.row(t, h), head_dim, out.row(t, h),
                     lse.base != nullptr ? lse.row(t, h) : nullptr);
  });
}

}  // namespace kf
