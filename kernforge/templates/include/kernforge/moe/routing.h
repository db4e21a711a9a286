// MoE routing, sgl-kernel's CPU ops (topk_softmax, topk_sigmoid, grouped_topk, biased_grouped_topk):
// per token, score the E experts of a gating row, choose k of them, and write k (weight fp32, id
// int32) pairs, best first. Threads take contiguous blocks of tokens.
//
// The choice is made on a value that orders the experts as the rule's score does: the logit itself
// for softmax and sigmoid (both monotone, so the fp32 scores' rounding and underflow never merge
// two different logits into a tie), sigmoid + bias for the biased rule. Among equal values the
// experts come out as torch.topk (CPU) gives them: torch_topk below runs the same standard
// algorithms on the same sequence as ATen does. The kernel template defines kf::moe::RoutingRule
// (declared in kernforge/ops/moe/routing.py) before including this header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kernforge/core/loops.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"

namespace kf::moe {

constexpr int64_t kMaxTopK = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Gating elements per thread worth a second thread: a token costs ~0.3 us per 128 experts (the
// exps and the selection), an OpenMP fork/join ~1 us. Measured on an EPYC (Zen, 2 threads, bf16):
// 8 tokens of 256 experts (biased) take 13.6 us on one thread and 11.7 us on two, 16 of 128
// (softmax) 11.3 us and 9.5 us; 4 of 256 gain nothing.
constexpr int64_t kRoutingMinElementsPerThread = 1024;

// One call: the gating rows [num_tokens, num_experts] (rows gating_stride elements apart) and the
// outputs [num_tokens, topk], contiguous.
template <class T>
struct Routing {
  float* weights;
  int32_t* ids;
  const T* gating;
  int64_t gating_stride;
  int64_t num_tokens;
  int64_t num_experts;
  int64_t topk;
  int64_t rule;           // RoutingRule
  int64_t num_groups;     // grouped rules: experts num_groups equal contiguous groups
  int64_t topk_group;     // grouped rules: groups kept
  const float* bias;      // biased rule: [num_experts]
  bool renormalize;       // weights / (sum of the routed weights)
  int64_t num_shared;     // > 0: the last slot is a fused shared expert, id in [E, E + num_shared)
  double shared_divisor;  // > 0: that slot's weight is (sum of the routed weights) / shared_divisor
};

using Ranked = std::pair<float, int32_t>;  // (value, expert)

// ATen's topk comparator: larger first, NaN above everything.
struct Greater {
  bool operator()(const Ranked& a, const Ranked& b) const {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  }
};

// torch.topk(values[0, n), k, largest=True, sorted=True) on the CPU, into queue[0, k): ATen's
// topk_impl_loop, i.e. std::partial_sort when 64 k <= n, else std::nth_element and std::sort of the
// first k - 1, on the (value, index) pairs in index order. The same algorithms on the same sequence
// give the same result, the order among equal values included. queue holds n entries.
inline void torch_topk(const float* values, int64_t n, int64_t k, Ranked* queue) {
  for (int64_t i = 0; i < n; ++i) queue[i] = {values[i], int32_t(i)};
  if (k * 64 <= n) {
    std::partial_sort(queue, queue + k, queue + n, Greater());
  } else {
    std::nth_element(queue, queue + (k - 1), queue + n, Greater());
    std::sort(queue, queue + (k - 1), Greater());
  }
}

// Per-thread buffers, sized once per call.
struct RoutingScratch {
  std::vector<float> choice;       // the values the experts are chosen by; -inf past num_experts
  std::vector<float> scores;       // biased rule: sigmoid(logit)
  std::vector<float> group_score;  // grouped rules
  std::vector<uint8_t> group_kept;
  std::vector<Ranked> queue;

  RoutingScratch(int64_t num_experts, int64_t num_groups) {
    const int64_t padded = (num_experts + VecF::kWidth - 1) / VecF::kWidth * VecF::kWidth;
    choice.assign(size_t(padded), kNegInf);  // whole vectors: the padding lanes stay -inf
    scores.assign(size_t(padded), 0.0f);
    group_score.assign(size_t(num_groups), 0.0f);
    group_kept.assign(size_t(num_groups), 0);
    queue.resize(size_t(std::max(num_experts, num_groups)));
  }
};

// Group scores: the best choice value of each group (grouped softmax), or the sum of its two best
// (biased: torch's topk(2).sum()).
inline void score_groups(const float* choice, int64_t num_groups, int64_t group_size, bool top_two,
                         float* group_score) {
  for (int64_t g = 0; g < num_groups; ++g) {
    const float* x = choice + g * group_size;
    float first = kNegInf, second = kNegInf;
    for (int64_t e = 0; e < group_size; ++e) {
      if (x[e] > first) {
        second = first;
        first = x[e];
      } else if (x[e] > second) {
        second = x[e];
      }
    }
    group_score[g] = top_two ? first + second : first;
  }
}

// f over the `count` values v[0, count) (count <= kMaxTopK) as vectors, in place.
template <class F>
inline void map_small(float* v, int64_t count, const F& f) {
  for_each_vector(0, count, [&](int, int64_t j, int64_t n) { f(VecF::load(v + j, n)).store(v + j, n); });
}

template <class T>
void route_token(const Routing<T>& p, int64_t t, RoutingScratch& s) {
  const int64_t E = p.num_experts, k = p.topk, padded = int64_t(s.choice.size());
  const T* row = p.gating + t * p.gating_stride;
  float* choice = s.choice.data();
  const bool softmax = p.rule == kSoftmax || p.rule == kGroupedSoftmax;
  const bool biased = p.rule == kBiasedGroupedSigmoid;

  // 1. The choice values: the logits in fp32, or sigmoid(logit) + bias.
  if (biased) {
    float* scores = s.scores.data();
    for_each_vector(0, E, [&](int, int64_t j, int64_t n) {
      const VecF score = sigmoid(VecF::load(row + j, n));
      score.store(scores + j, n);
      (score + VecF::load(p.bias + j, n)).store(choice + j, n);
    });
  } else {
    for_each_vector(0, E, [&](int, int64_t j, int64_t n) { VecF::load(row + j, n).store(choice + j, n); });
  }

  // 2. Softmax's max and sum over the whole row (the padding is -inf: exp gives 0 there).
  float row_max = 0.0f, inv_sum = 0.0f;
  if (softmax) {
    Chains m = Chains::of(kNegInf);
    for_each_vector(0, padded, [&](int c, int64_t j, int64_t) { m.v[c] = max(m.v[c], VecF::load(choice + j)); });
    row_max = reduce_max(m.max());
    const VecF shift = VecF::broadcast(row_max);
    Chains sum = Chains::of(0.0f);
    for_each_vector(0, padded,
                    [&](int c, int64_t j, int64_t) { sum.v[c] = sum.v[c] + exp(VecF::load(choice + j) - shift); });
    inv_sum = 1.0f / reduce_add(sum.sum());
  }

  // 3. Grouped rules: keep the topk_group best groups (the set torch.topk picks), mask the others.
  if ((p.rule == kGroupedSoftmax || biased) && p.topk_group < p.num_groups) {
    const int64_t group_size = E / p.num_groups;
    score_groups(choice, p.num_groups, group_size, biased, s.group_score.data());
    torch_topk(s.group_score.data(), p.num_groups, p.topk_group, s.queue.data());
    std::fill(s.group_kept.begin(), s.group_kept.end(), 0);
    for (int64_t g = 0; g < p.topk_group; ++g) s.group_kept[size_t(s.queue[size_t(g)].second)] = 1;
    for (int64_t g = 0; g < p.num_groups; ++g) {
      if (!s.group_kept[size_t(g)]) std::fill(choice + g * group_size, choice + (g + 1) * group_size, kNegInf);
    }
  }

  // 4. The k best experts, best first.
  torch_topk(choice, E, k, s.queue.data());
  float* weights = p.weights + t * k;
  int32_t* ids = p.ids + t * k;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t id = s.queue[size_t(j)].second;
    ids[j] = id;
    weights[j] = biased ? s.scores[size_t(id)] : choice[id];
  }
  if (softmax) {
    const VecF shift = VecF::broadcast(row_max), scale = VecF::broadcast(inv_sum);
    map_small(weights, k, [&](VecF x) { return exp(x - shift) * scale; });
  } else if (!biased) {
    map_small(weights, k, [](VecF x) { return sigmoid(x); });
  }

  // 5. A fused shared expert takes the last slot (sglang's grouped_topk / biased_grouped_topk_impl);
  // renormalizing divides every weight by the sum of the routed ones.
  const int64_t routed = p.num_shared > 0 ? k - 1 : k;
  float routed_sum = 0.0f;
  for (int64_t j = 0; j < routed; ++j) routed_sum += weights[j];
  if (p.num_shared > 0) {
    ids[k - 1] = int32_t(E + t % p.num_shared);
    if (p.shared_divisor > 0) weights[k - 1] = routed_sum / float(p.shared_divisor);
  }
  if (p.renormalize) {
    for (int64_t j = 0; j < k; ++j) weights[j] = weights[j] / routed_sum;
  }
}

template <class T>
void route(const Routing<T>& p, int64_t num_threads) {
  if (p.num_tokens <= 0) return;
  const int64_t work = p.num_tokens * p.num_experts;
  const int64_t threads = useful_threads(num_threads, p.num_tokens, work, kRoutingMinElementsPerThread);
  parallel_blocks(p.num_tokens, threads, [&](int64_t, int64_t begin, int64_t end) {
    RoutingScratch scratch(p.num_experts, p.num_groups);
    for (int64_t t = begin; t < end; ++t) route_token(p, t, scratch);
  });
}

}  // namespace kf::moe
