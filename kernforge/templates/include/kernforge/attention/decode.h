// Batch decode attention over a paged KV cache (flash-decoding on CPU).
//
// A work item is one request's KV heads (work_plan.h) against a range of its KV tokens, walked in
// blocks of kDecodeBlock tokens. For each KV head, the query heads of its GQA group are computed
// together, so each K and V row is read from memory once per KV head: the block's scores (kWidth
// dot products reduced together), an online-softmax update in fp32, then p.V into fp32
// accumulators. The dot products run on bf16 pairs (vdpbf16ps) where the CPU has AVX512-BF16 and
// q is bf16: bf16 KV as it is (bf16_dot.h), fp8 KV decoded to bf16 by table lookup with VBMI
// (fp8_dot.h); otherwise KV rows are widened to fp32 in registers for FMAs. KV is never copied.
// The next block's rows are prefetched while this one computes (BlockPrefetcher).
//
// Phase 1 runs the planner's lists, one per thread; phase 2 merges the partial states of the units
// the planner split across threads. The output and LSE follow FlashInfer: LSE is
// log2(sum(exp(logit))) of the final (scaled, soft-capped) logits, out = softmax . V * v_scale.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernforge/attention/bf16_dot.h"
#include "kernforge/attention/fp8_dot.h"
#include "kernforge/attention/paged_kv.h"
#include "kernforge/attention/softmax_state.h"
#include "kernforge/attention/work_plan.h"
#include "kernforge/core/isa_features.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/reduce_lanes.h"
#include "kernforge/core/vec.h"

namespace kf {
namespace attention {

constexpr int kDecodeBlock = 64;  // KV tokens per softmax block

// Heads per score tile: the group rounded up to a power of two, at most 8 and at most kWidth.
constexpr int decode_head_tile(int group) {
  const int cap = VecF::kWidth < 8 ? VecF::kWidth : 8;
  if (group == 0) return cap;  // runtime group: tiles of `cap` heads
  int tile = 1;
  while (tile < group && tile < cap) tile *= 2;
  return tile;
}

// head_dim rounded up to whole vectors: the row length of q and of the accumulators in scratch, so
// that their last partial vector is loaded and stored whole (q's padding lanes are zero).
constexpr int64_t decode_padded_dim(int64_t head_dim) {
  return (head_dim + VecF::kWidth - 1) / VecF::kWidth * VecF::kWidth;
}

// Per-thread scratch, in floats: for each KV head of a unit, its group's q and accumulators (padded
// to whole head tiles and whole vectors) and their softmax state; one block of scores shared by the
// heads.
inline int64_t decode_head_floats(int64_t group, int64_t head_dim, int64_t head_tile) {
  const int64_t padded = (group + head_tile - 1) / head_tile * head_tile;
  return padded * (2 * decode_padded_dim(head_dim) + 3);
}
inline int64_t decode_scratch_floats(int64_t heads, int64_t group, int64_t head_dim, int64_t head_tile) {
  const int64_t padded = (group + head_tile - 1) / head_tile * head_tile;
  return heads * decode_head_floats(group, head_dim, head_tile) + padded * kDecodeBlock;
}

template <class QT, class KVT, class OutT, int kHeadDim, int kGroup>
class DecodeKernel {
  static constexpr int kW = VecF::kWidth;
  static constexpr int kHeadTile = decode_head_tile(kGroup);
  static constexpr int kTokenTile = kW / kHeadTile;  // tokens per score tile: kHeadTile * kTokenTile = kW
  // K, V and output rows hold kHeadDim elements: kFullDim in whole vectors, then kTail (0: none) in a
  // partial one, read and written with the vector layer's partial loads and stores (a row may end
  // the allocation). q and the accumulators are padded to kPaddedDim in scratch.
  static constexpr int kPaddedDim = int(decode_padded_dim(kHeadDim));
  static constexpr int kFullDim = kHeadDim / kW * kW;
  static constexpr int kTail = kHeadDim - kFullDim;
  static_assert(kHeadDim >= 1, "head_dim must be positive");
  static_assert(kDecodeBlock % kTokenTile == 0 && kDecodeBlock % kW == 0, "whole tiles per block");
  // bf16 q and KV: dot products on bf16 pairs (bf16_dot.h), q kept unscaled in bf16.
  static constexpr bool kBf16Dot =
      KF_HAS_DPBF16 && std::is_same<QT, bf16>::value && std::is_same<KVT, bf16>::value && kHeadDim % 32 == 0;
  // bf16 q and fp8 KV: the rows converted to bf16 in registers for the same dot products (fp8_dot.h).
  static constexpr bool kFp8Dot = KF_HAS_FP8_DOT && std::is_same<QT, bf16>::value &&
                                  (std::is_same<KVT, fp8_e4m3>::value || std::is_same<KVT, fp8_e5m2>::value) &&
                                  kHeadDim % 64 == 0;
  static constexpr bool kBf16Operands = kBf16Dot || kFp8Dot;  // q and p in bf16, q unscaled
  // p.V's passes: kValueHeads heads by kValueChunks chunks of head_dim (bf16: 32-element chunks, two
  // at a time for up to 4 heads: with one, 4 heads ran 10 % slower on Zen 4 with 8 accumulators;
  // fp8: 64-element chunks of 4 vectors, at most 16 accumulators; otherwise vectors, four
  // independent FMA chains for small head tiles).
  static constexpr int kValueHeads = kFp8Dot && kHeadTile > 4 ? 4 : kHeadTile;
  static constexpr int kValueChunks = kBf16Dot  ? (kHeadTile <= 4 ? 2 : 1)
                                      : kFp8Dot ? std::min(4 / kValueHeads, kHeadDim / 64)
                                                : (kHeadTile >= 4 ? 1 : 4 / kHeadTile);
  // The vector multiply-adds of a score tile and of a step of p.V's first pass (a token pair on
  // the bf16 paths, a token otherwise): the prefetcher's pace, so that its fetches follow the
  // block's time. With every step fetching alike, a score tile (about 5x a p.V step's instructions)
  // fetched no more than one; weighted, bf16 decode from DRAM took 0.88-0.89x the time and fp8
  // 0.94-0.98x (docs/notes/2026-11-27-issue-22-pass-5-paced-prefetch.md, "The change").
  static constexpr int64_t kScoreStepWork = kW * (kBf16Operands ? kHeadDim / 32 : (kHeadDim + kW - 1) / kW);
  static constexpr int64_t kValueStepWork = kValueHeads * kValueChunks * (kBf16Dot ? 2 : kFp8Dot ? 4 : 1);

 public:
  explicit DecodeKernel(const kf_decode_planned& p)
      : p_(p),
        group_(kGroup > 0 ? kGroup : int(p.group)),
        padded_group_((group_ + kHeadTile - 1) / kHeadTile * kHeadTile),
        plan_{reinterpret_cast<const int32_t*>(p.plan), p.units},
        slot_rows_(plan_.heads_per_unit() * group_) {}

  void run(const kf_decode_layer& io) const {
    // The lists were balanced for the threads at plan time; run on at most the threads allowed now.
    const int64_t lists = plan_.num_lists(), threads = std::min<int64_t>(lists, io.num_threads);
    parallel_blocks(lists, threads, [&](int64_t, int64_t begin, int64_t end) {
      for (int64_t list = begin; list < end; ++list) run_list(io, list);
    });
    if (plan_.num_merges() > 0) {
      parallel_for(plan_.num_merges(), threads, [&](int64_t m) { merge(io, plan_.merges()[m]); });
    }
  }

 private:
  // One KV head's state within a unit: its group's scaled q rows, output accumulators, running max
  // m, running sum l, and alpha, the factor this block rescales the accumulators by.
  struct HeadState {
    float *q, *acc, *m, *l, *alpha;
  };
  // Row addresses of a block's tokens for the unit's first KV head (head h: + h * head stride).
  struct Rows {
    const KVT* k[kDecodeBlock];
    const KVT* v[kDecodeBlock];
  };

  float* scratch(int64_t list) const {
    return reinterpret_cast<float*>(p_.workspace) +
           list * decode_scratch_floats(plan_.heads_per_unit(), group_, kHeadDim, kHeadTile);
  }
  HeadState head_state(float* scratch, int64_t head) const {
    float* q = scratch + head * decode_head_floats(group_, kHeadDim, kHeadTile);
    const int64_t g = padded_group_;
    float* acc = q + g * kPaddedDim;
    float* m = acc + g * kPaddedDim;
    return {q, acc, m, m + g, m + 2 * g};
  }
  float* block_scores(float* scratch) const {
    return scratch + plan_.heads_per_unit() * decode_head_floats(group_, kHeadDim, kHeadTile);
  }
  float* partial_out(int64_t slot) const {
    return reinterpret_cast<float*>(p_.partials) + slot * slot_rows_ * kHeadDim;
  }
  float* partial_lse(int64_t slot) const {
    return reinterpret_cast<float*>(p_.partials) + plan_.num_slots() * slot_rows_ * kHeadDim + slot * slot_rows_;
  }

  void run_list(const kf_decode_layer& io, int64_t list) const {
    float* s = scratch(list);
    const int32_t* offsets = plan_.list_offsets();
    for (int64_t i = offsets[list]; i < offsets[list + 1]; ++i) {
      const WorkItem* following = i + 1 < offsets[list + 1] ? &plan_.items()[i + 1] : nullptr;
      run_item(io, plan_.items()[i], following, s);
    }
  }

  // The item's blocks in order; while one computes, the next streams in: the item's next block,
  // or after its last, the first block of the item that follows on this thread.
  void run_item(const kf_decode_layer& io, const WorkItem& w, const WorkItem* following, float* scratch) const {
    float* scores = block_scores(scratch);
    for (int64_t h = 0; h < w.num_heads; ++h) start_head(io, w, h, head_state(scratch, h));
    Rows rows[2];
    if (w.begin < w.end) resolve_rows(io, w, w.begin, rows[0]);
    for (int64_t t = w.begin, block = 0; t < w.end; t += kDecodeBlock, ++block) {
      const int64_t count = std::min<int64_t>(kDecodeBlock, w.end - t);
      const Rows& cur = rows[block & 1];
      Rows& next = rows[(block + 1) & 1];
      const bool last = t + kDecodeBlock >= w.end;
      const WorkItem& next_item = last && following ? *following : w;
      const int64_t next_begin = last ? next_item.begin : t + kDecodeBlock;
      const int64_t next_count = last && !following ? 0 : std::min<int64_t>(kDecodeBlock, next_item.end - next_begin);
      if (next_count > 0) resolve_rows(io, next_item, next_begin, next);
      // Prefetch steps: one per score tile, one per token (pair) of each head's first p.V pass,
      // each weighted by the vector multiply-adds it stands for.
      const int64_t score_tiles = (padded_group_ / kHeadTile) * ((count + kTokenTile - 1) / kTokenTile);
      const int64_t value_steps = kBf16Operands ? (count + 1) / 2 : count;
      const int64_t work = w.num_heads * (score_tiles * kScoreStepWork + value_steps * kValueStepWork);
      BlockPrefetcher prefetch(next, next_count, next_item.num_heads, io, work);
      for (int64_t h = 0; h < w.num_heads; ++h) {
        const HeadState st = head_state(scratch, h);
        const int64_t k_offset = h * io.k_stride_head, v_offset = h * io.v_stride_head;
        compute_scores(cur, k_offset, count, st, scores, prefetch, float(io.qk_scale));
        softmax_update(count, st, scores);
        accumulate_values(cur, v_offset, count, st, scores, prefetch);
      }
      prefetch.finish();
    }
    for (int64_t h = 0; h < w.num_heads; ++h) finish(io, w, h, head_state(scratch, h));
  }

  // The group's q rows, scaled so that q.k is the logit (with a soft cap: logit / cap); a fresh
  // softmax state.
  void start_head(const kf_decode_layer& io, const WorkItem& w, int64_t h, const HeadState& st) const {
    const VecF scale = VecF::broadcast(kBf16Operands ? 1.0f : float(io.qk_scale));  // bf16 q: scaled after q.k
    const QT* q = reinterpret_cast<const QT*>(io.q) + w.request * io.q_stride_token;
    for (int64_t g = 0; g < padded_group_; ++g) {
      const QT* src = q + ((w.kv_head + h) * group_ + g) * io.q_stride_head;
      for (int64_t d = 0; d < kPaddedDim; d += kW) {
        const VecF row = g < group_ ? load_row(src, d) * scale : VecF::zero();
        if constexpr (kBf16Operands) {
          row.store(reinterpret_cast<bf16*>(st.q) + g * kPaddedDim + d);
        } else {
          row.store(st.q + g * kPaddedDim + d);
        }
      }
#if KF_HAS_FP8_DOT
      if constexpr (kFp8Dot) fp8_dot::arrange_q<kHeadDim>(reinterpret_cast<bf16*>(st.q) + g * kPaddedDim);
#endif
      std::fill(st.acc + g * kPaddedDim, st.acc + (g + 1) * kPaddedDim, 0.0f);
      st.m[g] = -std::numeric_limits<float>::infinity();
      st.l[g] = 0.0f;
    }
  }

  // Row addresses of the tokens [t, t + kDecodeBlock) that the item covers, for its first KV head.
  void resolve_rows(const kf_decode_layer& io, const WorkItem& w, int64_t t, Rows& rows) const {
    const int64_t count = std::min<int64_t>(kDecodeBlock, w.end - t);
    const int32_t* pages =
        reinterpret_cast<const int32_t*>(p_.indices) + reinterpret_cast<const int32_t*>(p_.indptr)[w.request];
    const auto k = page_plane_at<const KVT>(io.k, io.k_stride_page, io.k_stride_token, io.k_stride_head);
    const auto v = page_plane_at<const KVT>(io.v, io.v_stride_page, io.v_stride_token, io.v_stride_head);
    int64_t page_iter = t / p_.page_size, offset = t % p_.page_size;  // stepped, not divided, per token
    for (int64_t j = 0; j < count; ++j) {
      const int64_t page = pages[page_iter];
      rows.k[j] = k.row(page, offset, w.kv_head);
      rows.v[j] = v.row(page, offset, w.kv_head);
      if (++offset == p_.page_size) offset = 0, ++page_iter;
    }
  }

  // Fetches the next block's K and V rows while this block computes, a few rows at every score
  // tile and token pair of the first p.V pass, in the order the next block will read them: head by
  // head, each head's tokens in order, K and V of a row together. The page table hides the next
  // rows from the hardware prefetcher; without these fetches the kernel reads its KV at half the
  // rate. Spread out, they overlap the arithmetic: issued as one burst per block, or fetching every
  // other line and leaving the rest to the hardware, measured 20-25 % slower (docs/notes/2026-11-23-issue-8-decode.md).
  // They go to L2 only (prefetcht1): into L1, a load-only walk of NHD pages head by head read
  // 1.5-1.7x slower on Zen 4 and this kernel 1.4x slower (benchmarks/investigations/bench_paged_read.py,
  // docs/notes/2026-11-26-issue-22-pass-1-paged-read.md); presumably each L1 prefetch holds one of the core's
  // few L1 miss buffers (not counted: no PMU in that guest). Whole rows a step, their lines unrolled: the walk line by
  // line it replaces cost 4-16 % of the kernel's time with the KV in the caches.
  class BlockPrefetcher {
   public:
    BlockPrefetcher(const Rows& rows, int64_t count, int64_t heads, const kf_decode_layer& io, int64_t work)
        : rows_(rows),
          k_head_(io.k_stride_head),
          v_head_(io.v_stride_head),
          count_(count),
          total_(count * heads),
          work_(std::max<int64_t>(1, work)) {}

    // total * done / work of the rows (K and V of one token and head) for `done` of the block's
    // `work`, evenly: each step adds total * done to a credit that every row fetched spends `work`
    // of (no division per step).
    void step(int64_t done) {
      for (credit_ += total_ * done; credit_ >= work_ && fetched_ < total_; credit_ -= work_) fetch_row();
    }
    // Whatever the steps did not reach.
    void finish() {
      while (fetched_ < total_) fetch_row();
    }

   private:
    // The lines of the next row, K and V; prefetcht1: (address, read, locality 2).
    void fetch_row() {
      const char* k = reinterpret_cast<const char*>(rows_.k[token_] + head_ * k_head_);
      const char* v = reinterpret_cast<const char*>(rows_.v[token_] + head_ * v_head_);
      for (int64_t line = 0; line < kRowLines; ++line) {
        __builtin_prefetch(k + line_offset(line), 0, 2);
        __builtin_prefetch(v + line_offset(line), 0, 2);
      }
      ++fetched_;
      if (++token_ == count_) token_ = 0, ++head_;
    }
    // Rows of a head_dim that is a multiple of 16 start on a multiple of their size (up to a line),
    // so they span ceil(bytes / 64) lines. Others start anywhere in a line and may touch one line
    // more: the last fetch is of the row's last byte (no fetch lands past the row).
    static constexpr bool kMisaligned = kHeadDim % 16 != 0;
    static constexpr int64_t kRowBytes = kHeadDim * int64_t(sizeof(KVT));
    static constexpr int64_t kRowLines = (kRowBytes + 63) / 64 + (kMisaligned ? 1 : 0);
    static constexpr int64_t line_offset(int64_t line) {
      if constexpr (kMisaligned) return std::min<int64_t>(64 * line, kRowBytes - 1);
      return 64 * line;
    }
    const Rows& rows_;
    const int64_t k_head_, v_head_;
    const int64_t count_, total_, work_;
    int64_t credit_ = 0, fetched_ = 0, token_ = 0, head_ = 0;
  };

  // scores[g][j] = logit of group head g against token j, for j < count (tiles past count read
  // token 0 again; their scores are never used). Kept out of run_item, so that its registers are
  // allocated on their own (inlined, GCC 12 stored and reloaded q around every dot product of
  // group 8's tiles: 1.09x the time), with what it calls inlined into it (flatten: GCC then left
  // score_tile a call per tile).
  __attribute__((noinline, flatten)) void compute_scores(const Rows& rows, int64_t head_offset, int64_t count,
                                                         const HeadState& st, float* scores, BlockPrefetcher& prefetch,
                                                         float qk_scale) const {
    const bool capped = p_.soft_cap > 0.0;
    const VecF cap = VecF::broadcast(float(p_.soft_cap)), scale = VecF::broadcast(qk_scale);
    for (int64_t g0 = 0; g0 < padded_group_; g0 += kHeadTile) {
      for (int64_t j0 = 0; j0 < count; j0 += kTokenTile) {
        prefetch.step(kScoreStepWork);
        const KVT* k[kTokenTile];
        for (int jj = 0; jj < kTokenTile; ++jj) k[jj] = rows.k[j0 + jj < count ? j0 + jj : 0] + head_offset;
        VecF tile = score_tile(st, g0, k, scale);
        if (capped) tile = cap * tanh(tile);
        alignas(64) float lanes[kW];
        tile.store(lanes);
        for (int gg = 0; gg < kHeadTile; ++gg) {  // a head's kTokenTile scores are adjacent lanes
          std::memcpy(scores + (g0 + gg) * kDecodeBlock + j0, lanes + gg * kTokenTile, kTokenTile * sizeof(float));
        }
      }
    }
  }

  // kHeadTile x kTokenTile logits (heads g0.., tokens k), lane gg * kTokenTile + jj.
  static VecF score_tile(const HeadState& st, int64_t g0, const KVT* const (&k)[kTokenTile], const VecF& scale) {
#if KF_HAS_DPBF16
    if constexpr (kBf16Dot) {
      return bf16_dot::score_tile<kHeadTile, kTokenTile, kHeadDim>(
                 reinterpret_cast<const bf16*>(st.q) + g0 * kPaddedDim, k) *
             scale;
    }
#endif
#if KF_HAS_FP8_DOT
    if constexpr (kFp8Dot) {
      return fp8_dot::score_tile<kHeadTile, kTokenTile, kHeadDim>(reinterpret_cast<const bf16*>(st.q) + g0 * kPaddedDim,
                                                                  k) *
             scale;
    }
#endif
    (void)scale;  // q is pre-scaled on this path
    const float* q = st.q + g0 * kPaddedDim;
    VecF acc[kW];
    for (int i = 0; i < kW; ++i) acc[i] = VecF::zero();
    for (int64_t d = 0; d < kFullDim; d += kW) score_step<kW>(q, k, d, acc);
    if constexpr (kTail > 0) score_step<kTail>(q, k, kFullDim, acc);  // the K rows' last partial vector
    return reduce_lanes(acc);
  }

  // acc += q[gg][d..] * k[jj][d..] on kCount elements (kCount < kW: q's zero padding meets the
  // zeros of K's partial load).
  template <int kCount>
  static void score_step(const float* q, const KVT* const (&k)[kTokenTile], int64_t d, VecF (&acc)[kW]) {
    VecF kv[kTokenTile];
    for (int jj = 0; jj < kTokenTile; ++jj) kv[jj] = load_part<kCount>(k[jj] + d);
    for (int gg = 0; gg < kHeadTile; ++gg) {
      const VecF qv = VecF::load(q + gg * kPaddedDim + d);
      for (int jj = 0; jj < kTokenTile; ++jj) acc[gg * kTokenTile + jj] = fma(qv, kv[jj], acc[gg * kTokenTile + jj]);
    }
  }

  // Online softmax: scores become probabilities relative to the new running max; alpha is what
  // the accumulators must be rescaled by. Only the vectors that hold the block's `count` tokens
  // are computed (whole pairs of vectors where p.V reads the probabilities as bf16 pairs).
  void softmax_update(int64_t count, const HeadState& st, float* scores) const {
    constexpr int64_t kStep = kBf16Operands ? 2 * kW : kW;
    const int64_t span = (count + kStep - 1) / kStep * kStep;
    for (int64_t g = 0; g < padded_group_; ++g) {
      float* row = scores + g * kDecodeBlock;
      for (int64_t j = count; j < span; ++j) row[j] = -std::numeric_limits<float>::infinity();
      VecF block_max = VecF::load(row);
      for (int64_t j = kW; j < span; j += kW) block_max = max(block_max, VecF::load(row + j));
      const float m_new = std::max(st.m[g], reduce_max(block_max));
      const VecF shift = VecF::broadcast(m_new);
      VecF sum = VecF::zero();
      for (int64_t j = 0; j < span; j += kW) {
        const VecF p = exp(VecF::load(row + j) - shift);
        p.store(row + j);
        if (j + kW <= count) sum += p;
      }
      for (int64_t j = count; j < span; ++j) row[j] = 0.0f;  // exp's floor is not exactly 0
      float block_sum = reduce_add(sum);
      for (int64_t j = count / kW * kW; j < count; ++j) block_sum += row[j];
#if KF_HAS_DPBF16
      if constexpr (kBf16Operands) bf16_dot::pack_probabilities(row, span);
#endif
      st.alpha[g] = std::exp(st.m[g] - m_new);  // 0 on the first block (m = -inf)
      st.l[g] = st.l[g] * st.alpha[g] + block_sum;
      st.m[g] = m_new;
    }
  }

  // Head g's block of probabilities, packed as bf16 pairs in place by softmax_update.
  static const uint32_t* probability_pairs(const float* scores, int64_t g) {
    return reinterpret_cast<const uint32_t*>(scores + g * kDecodeBlock);
  }

  // Calls pass(between) with the prefetcher's step for the first pass over a block's tokens (one
  // step per token or token pair), with nothing for the others.
  template <class Pass>
  static void paced(bool first, BlockPrefetcher& prefetch, const Pass& pass) {
    if (first) {
      pass([&] { prefetch.step(kValueStepWork); });
    } else {
      pass([] {});
    }
  }

  // acc[g] = acc[g] * alpha[g] + sum_j p[g][j] * V[j], in passes of kValueHeads heads by
  // kValueChunks chunks of head_dim.
  void accumulate_values(const Rows& rows, int64_t head_offset, int64_t count, const HeadState& st, const float* scores,
                         BlockPrefetcher& prefetch) const {
#if KF_HAS_DPBF16
    if constexpr (kBf16Dot) {
      return accumulate_pairs<Bf16Pairs, kValueHeads, kValueChunks>(rows, head_offset, count, st, scores, prefetch);
    }
#endif
#if KF_HAS_FP8_DOT
    if constexpr (kFp8Dot) {
      return accumulate_pairs<Fp8Pairs, kValueHeads, kValueChunks>(rows, head_offset, count, st, scores, prefetch);
    }
#endif
    for (int64_t g0 = 0; g0 < padded_group_; g0 += kHeadTile) {
      int64_t d = 0;
      for (; d + kValueChunks * kW <= kHeadDim; d += kValueChunks * kW) {
        paced(g0 == 0 && d == 0, prefetch, [&](const auto& between) {
          value_step<kValueChunks>(rows, head_offset, count, st, scores, g0, d, between);
        });
      }
      for (; d < kFullDim; d += kW) value_step<1>(rows, head_offset, count, st, scores, g0, d, [] {});
      if constexpr (kTail > 0) {  // the rows' last partial vector (all of them when head_dim < kW)
        paced(g0 == 0 && kFullDim == 0, prefetch, [&](const auto& between) {
          value_step<1, kTail>(rows, head_offset, count, st, scores, g0, kFullDim, between);
        });
      }
    }
  }

#if KF_HAS_DPBF16
  struct Bf16Pairs {  // p.V on pairs of bf16 V rows (bf16_dot.h)
    static constexpr int kChunk = bf16_dot::kChunk;
    template <int kHeads, int kChunks, class... Args>
    static void accumulate(Args&&... args) {
      bf16_dot::accumulate_values<kHeads, kChunks>(args...);
    }
  };
#endif
#if KF_HAS_FP8_DOT
  struct Fp8Pairs {  // p.V on pairs of fp8 V rows decoded to bf16 (fp8_dot.h)
    static constexpr int kChunk = fp8_dot::kChunk;
    template <int kHeads, int kChunks, class... Args>
    static void accumulate(Args&&... args) {
      fp8_dot::accumulate_values<kHeads, kChunks>(args...);
    }
  };
#endif

  // p.V on pairs of tokens with bf16 dot products: kHeads heads and kChunks chunks of head_dim a
  // call, the accumulators kept in the dot path's scrambled order (unscrambled in finish).
  template <class Pairs, int kHeads, int kChunks>
  void accumulate_pairs(const Rows& rows, int64_t head_offset, int64_t count, const HeadState& st, const float* scores,
                        BlockPrefetcher& prefetch) const {
    alignas(64) static const KVT kZeros[kChunks * Pairs::kChunk] = {};  // the partner of an odd last token
    for (int64_t g0 = 0; g0 < padded_group_; g0 += kHeads) {
      const uint32_t* pairs[kHeads];
      float* acc[kHeads];
      for (int gg = 0; gg < kHeads; ++gg) pairs[gg] = probability_pairs(scores, g0 + gg);
      const auto call = [&](auto chunks, int64_t d, const auto& between) {
        for (int gg = 0; gg < kHeads; ++gg) acc[gg] = st.acc + (g0 + gg) * kPaddedDim + d;
        Pairs::template accumulate<kHeads, decltype(chunks)::value>(rows.v, head_offset + d, kZeros, count, pairs,
                                                                    st.alpha + g0, acc, between);
      };
      int64_t d = 0;
      for (; d + kChunks * Pairs::kChunk <= kHeadDim; d += kChunks * Pairs::kChunk) {
        paced(g0 == 0 && d == 0, prefetch,
              [&](const auto& between) { call(std::integral_constant<int, kChunks>(), d, between); });
      }
      for (; d < kHeadDim; d += Pairs::kChunk) call(std::integral_constant<int, 1>(), d, [] {});
    }
  }

  // kChunks vectors of kCount elements (kCount < kW: the rows' last partial vector, one chunk).
  template <int kChunks, int kCount = kW, class Between>
  static void value_step(const Rows& rows, int64_t head_offset, int64_t count, const HeadState& st, const float* scores,
                         int64_t g0, int64_t d, const Between& between) {
    static_assert(kCount == kW || kChunks == 1, "only the last vector is partial");
    VecF acc[kHeadTile][kChunks];
    for (int gg = 0; gg < kHeadTile; ++gg) {
      const VecF alpha = VecF::broadcast(st.alpha[g0 + gg]);
      for (int c = 0; c < kChunks; ++c) acc[gg][c] = VecF::load(st.acc + (g0 + gg) * kPaddedDim + d + c * kW) * alpha;
    }
    for (int64_t j = 0; j < count; ++j) {
      between();
      const KVT* v_row = rows.v[j] + head_offset + d;
      VecF v[kChunks];
      for (int c = 0; c < kChunks; ++c) v[c] = load_part<kCount>(v_row + c * kW);
      for (int gg = 0; gg < kHeadTile; ++gg) {
        const VecF p = VecF::broadcast(scores[(g0 + gg) * kDecodeBlock + j]);
        for (int c = 0; c < kChunks; ++c) acc[gg][c] = fma(p, v[c], acc[gg][c]);
      }
    }
    for (int gg = 0; gg < kHeadTile; ++gg) {
      for (int c = 0; c < kChunks; ++c) acc[gg][c].store(st.acc + (g0 + gg) * kPaddedDim + d + c * kW);
    }
  }

  // Normalizes and writes one KV head's group: to the output (whole unit) or to its partial slot.
  void finish(const kf_decode_layer& io, const WorkItem& w, int64_t h, const HeadState& st) const {
    for (int64_t g = 0; g < group_; ++g) {
      const float l = st.l[g], lse = segment_lse(st.m[g], l);
      const VecF scale = VecF::broadcast(l > 0.0f ? float(io.v_scale) / l : 0.0f);
      const float* acc = st.acc + g * kPaddedDim;
#if KF_HAS_DPBF16
      alignas(64) float ordered[kPaddedDim];
      if constexpr (kBf16Dot) {
        for (int64_t d = 0; d < kHeadDim; d += bf16_dot::kChunk) bf16_dot::unscramble_chunk(acc + d, ordered + d);
        acc = ordered;
      }
#endif
#if KF_HAS_FP8_DOT
      if constexpr (kFp8Dot) {
        for (int64_t d = 0; d < kHeadDim; d += fp8_dot::kChunk) fp8_dot::unscramble_chunk(acc + d, ordered + d);
        acc = ordered;
      }
#endif
      if (w.slot >= 0) {
        const int64_t row = h * group_ + g;
        write_row(acc, scale, partial_out(w.slot) + row * kHeadDim);
        partial_lse(w.slot)[row] = lse;
        continue;
      }
      const int64_t head = (w.kv_head + h) * group_ + g;
      OutT* out = reinterpret_cast<OutT*>(io.out) + w.request * io.out_stride_token + head * io.out_stride_head;
      write_row(acc, scale, out);
      if (io.lse) reinterpret_cast<float*>(io.lse)[w.request * io.lse_stride_token + head * io.lse_stride_head] = lse;
    }
  }

  // out[0, kHeadDim) = acc * scale (acc padded to whole vectors; out is not).
  template <class T>
  static void write_row(const float* acc, const VecF& scale, T* out) {
    for (int64_t d = 0; d < kFullDim; d += kW) (VecF::load(acc + d) * scale).store(out + d);
    if constexpr (kTail > 0) (VecF::load(acc + kFullDim) * scale).store(out + kFullDim, kTail);
  }

  // Elements [d, d + kW) of a row of kHeadDim; in the last partial vector, those before kHeadDim
  // (zeros after it: nothing past the row is read).
  template <class T>
  static VecF load_row(const T* row, int64_t d) {
    if constexpr (kTail == 0) return VecF::load(row + d);
    return VecF::load(row + d, kHeadDim - d);
  }
  // kCount elements from p: a full load, or a partial one (zeros after kCount, nothing past it read).
  template <int kCount, class T>
  static VecF load_part(const T* p) {
    if constexpr (kCount == kW) return VecF::load(p);
    return VecF::load(p, kCount);
  }

  void merge(const kf_decode_layer& io, const MergeItem& m) const {
    for (int64_t row = 0; row < m.num_heads * group_; ++row) {
      const int64_t head = m.kv_head * group_ + row;
      OutT* out = reinterpret_cast<OutT*>(io.out) + m.request * io.out_stride_token + head * io.out_stride_head;
      float* lse = io.lse
                       ? reinterpret_cast<float*>(io.lse) + m.request * io.lse_stride_token + head * io.lse_stride_head
                       : nullptr;
      merge_state_row<float, OutT>(m.num_slots, partial_out(m.first_slot) + row * kHeadDim, slot_rows_ * kHeadDim,
                                   partial_lse(m.first_slot) + row, slot_rows_, kHeadDim, out, lse);
    }
  }

  const kf_decode_planned& p_;
  const int64_t group_, padded_group_;
  const PlanView plan_;
  const int64_t slot_rows_;  // output rows of one partial slot: a unit's KV heads x group
};

}  // namespace attention
}  // namespace kf
