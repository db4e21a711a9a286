// MoE routing, sgl-kernel's CPU ops (topk_softmax, topk_sigmoid, grouped_topk, biased_grouped_topk):
// per token, score the E experts of a gating row, choose k of them, and write k (weight fp32, id
// int32) pairs, best first. Threads take contiguous blocks of tokens.
//
// The choice is made on a value that orders the experts as the rule's score does: the logit itself
// for softmax and sigmoid (both monotone, so the fp32 scores' rounding and underflow never merge
// two different logits into a tie), sigmoid + bias for the biased rule. The experts are chosen as
// sgl-kernel's kernels choose them (python/sglang/kernels/aot/csrc/cpu/topk.cpp), ties included:
// std::partial_sort by value alone over the same candidate sequence (best_first below). The kernel
// template defines kf::moe::RoutingRule (declared in kernforge/ops/moe/routing.py) before including
// this header.
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
  int64_t rule;                  // RoutingRule
  int64_t num_groups;            // the experts in num_groups equal contiguous groups (1: ungrouped)
  int64_t topk_group;            // grouped rules: groups kept
  const float* bias;             // biased rule: [num_experts]
  bool renormalize;              // divide the weights by the sum of the routed ones
  int64_t num_shared;            // > 0: the last slot is a fused shared expert, id in [E, E + num_shared)
  double routed_scaling_factor;  // > 0: scales every weight; a shared slot's weight is (routed sum) / it
  int64_t ties;                  // TieOrder: whose order equal values come in
};

using Ranked = std::pair<float, int32_t>;  // (value, expert or group)

// ATen's topk comparator: larger first, NaN above everything.
struct TorchGreater {
  bool operator()(const Ranked& a, const Ranked& b) const {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  }
};

// torch.topk(largest=True, sorted=True) on the CPU over queue[0, n) (its entries in index order):
// ATen's topk_impl_loop, i.e. std::partial_sort when 64 k <= n, else std::nth_element and std::sort
// of the first k - 1. The same algorithms on the same sequence give the same order among equal
// values: what vLLM's CPU router (torch.topk) chooses.
inline void torch_topk(Ranked* queue, int64_t n, int64_t k) {
  if (k * 64 <= n) {
    std::partial_sort(queue, queue + k, queue + n, TorchGreater());
  } else {
    std::nth_element(queue, queue + (k - 1), queue + n, TorchGreater());
    std::sort(queue, queue + (k - 1), TorchGreater());
  }
}

// sgl-kernel's selection: std::partial_sort of queue[0, n) by value alone, larger first, so that its
// k best come first. Equal values are ordered, and cut at k, as libstdc++'s heap selection leaves
// them (the first max for k = 1); the same algorithm on the same sequence gives sgl-kernel's result.
inline void best_first(Ranked* queue, int64_t n, int64_t k) {
  std::partial_sort(queue, queue + k, queue + n, [](const Ranked& a, const Ranked& b) { return a.first > b.first; });
}

// Per-thread buffers, sized once per call.
struct RoutingScratch {
  std::vector<float> choice;       // the values the experts are chosen by; -inf past num_experts
  std::vector<float> scores;       // biased rule: sigmoid(logit)
  std::vector<float> group_score;  // grouped rules
  std::vector<Ranked> groups;      // grouped rules: the groups, best first
  std::vector<Ranked> queue;       // the candidate experts

  RoutingScratch(int64_t num_experts, int64_t num_groups) {
    const int64_t padded = (num_experts + VecF::kWidth - 1) / VecF::kWidth * VecF::kWidth;
    choice.assign(size_t(padded), kNegInf);  // whole vectors: the padding lanes stay -inf
    scores.assign(size_t(padded), 0.0f);
    group_score.assign(size_t(num_groups), 0.0f);
    groups.resize(size_t(num_groups));
    queue.resize(size_t(num_experts));
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

// The k best of queue[0, n), best first, equal values in `ties`' order.
inline void select(Ranked* queue, int64_t n, int64_t k, int64_t ties) {
  if (ties == kTorchTopk) {
    torch_topk(queue, n, k);
  } else {
    best_first(queue, n, k);
  }
}

// The candidate experts into queue; returns their count. One group (every ungrouped rule): every
// expert, in index order. Several groups, the topk_group best of them selected as `ties` says:
// sgl-kernel's order takes their experts group by group, best group first (groups ranked even when
// all are kept); torch.topk's (vLLM's rule: the other groups' scores masked) takes every expert in
// index order, the other groups' at -inf.
inline int64_t candidates(const float* choice, int64_t num_experts, int64_t num_groups, int64_t topk_group,
                          bool top_two, int64_t ties, RoutingScratch& s) {
  Ranked* queue = s.queue.data();
  if (num_groups == 1) {
    for (int64_t e = 0; e < num_experts; ++e) queue[e] = {choice[e], int32_t(e)};
    return num_experts;
  }
  const int64_t group_size = num_experts / num_groups;
  score_groups(choice, num_groups, group_size, top_two, s.group_score.data());
  for (int64_t g = 0; g < num_groups; ++g) s.groups[size_t(g)] = {s.group_score[size_t(g)], int32_t(g)};
  select(s.groups.data(), num_groups, topk_group, ties);
  if (ties == kTorchTopk) {
    for (int64_t e = 0; e < num_experts; ++e) queue[e] = {kNegInf, int32_t(e)};
    for (int64_t g = 0; g < topk_group; ++g) {
      const int64_t first = s.groups[size_t(g)].second * group_size;
      for (int64_t e = first; e < first + group_size; ++e) queue[e].first = choice[e];
    }
    return num_experts;
  }
  int64_t n = 0;
  for (int64_t g = 0; g < topk_group; ++g) {
    const int64_t first = s.groups[size_t(g)].second * group_size;
    for (int64_t e = first; e < first + group_size; ++e) queue[n++] = {choice[e], int32_t(e)};
  }
  return n;
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

  // 3. The k best candidates, best first.
  const int64_t n = candidates(choice, E, p.num_groups, p.topk_group, biased, p.ties, s);
  select(s.queue.data(), n, k, p.ties);
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

  // 4. A fused shared expert takes the last slot (sglang's grouped_topk / biased_grouped_topk_impl).
  const int64_t routed = p.num_shared > 0 ? k - 1 : k;
  float routed_sum = 0.0f;
  for (int64_t j = 0; j < routed; ++j) routed_sum += weights[j];
  const bool scaled = p.routed_scaling_factor > 0;
  if (p.num_shared > 0) {
    ids[k - 1] = int32_t(E + t % p.num_shared);
    if (scaled) weights[k - 1] = routed_sum / float(p.routed_scaling_factor);
  }

  // 5. One factor for every weight, as sgl-kernel's biased_grouped_topk_cpu: routed_scaling_factor
  // (1 without one), divided by the routed sum when renormalizing.
  const float scale = scaled ? float(p.routed_scaling_factor) : 1.0f;
  const float factor = p.renormalize ? scale / routed_sum : scale;
  for (int64_t j = 0; j < k; ++j) weights[j] *= factor;
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
