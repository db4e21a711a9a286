// Batch prefill attention (FlashInfer's BatchPrefillWith{Paged,Ragged}KVCacheWrapper semantics):
// every query token of a request attends to the request's keys under its mask, with an online
// softmax in fp32 over blocks of keys. kernforge/ops/prefill.py declares the module and documents
// the semantics (masks, scales, LSE); this header is the kernel.
//
// Work: one item is (request, KV head, query tile): kQueriesPerTile queries x the GQA group's
// query heads, `rows` query rows that share every K and V row they read. Row r of a tile is query
// r / group, head r % group (the group's heads of a token are adjacent in q and out). The plan
// orders items by cost, largest first, and threads take them dynamically (greedy balancing).
//
// Per item and block of kBlockN keys, both products run on the GEMM micro-kernels:
//   S = Q . K^T   (rows x kBlockN): K's block is transposed into B's layout, pairs of head_dim
//                  (bf16 path) or fp32 rows of head_dim (fp32 path);
//   softmax       row by row: scale, soft cap, mask, running max/sum, P (bf16 or fp32);
//   O += P . V    (rows x head_dim_vo): V's block as pairs of keys (bf16) or fp32 rows.
// Head dims are any in [1, 512]: the packed copies (Q, K^T, V, the accumulators) are zero-padded
// to what the micro-kernels take (kDepthQK, kVO below); q, k, v and out rows are read and written
// only up to their real length.
// The bf16 path (q bf16, KV bf16 or fp8: fp8 widens to bf16 exactly) multiplies with vdpbf16ps on
// AVX512-BF16, and in AMX tiles (gemm/amx_kernel.h, 32 x 32 blocks) on the amx tier; P is rounded to bf16 as
// FlashInfer's tensor-core kernels do. fp16/fp32 inputs take the fp32 path so that nothing is rounded below the input
// precision.
//
// MLA (kernforge/ops/mla/attention.py) runs here as one KV head whose K rows are the latent and
// rope parts [ckv | kpe] (head_dim_qk 576) and whose V rows are the latent (the first 512 of the
// same rows): every query head is a row of the group, so each latent row is read once for all heads.
// Where the rope parts live in tensors of their own (io.pe_dim > 0: q_pe, kpe_cache), q rows and K
// rows are assembled in scratch from both; adjacent views of one [.., 576] cache need no copy.
//
// Masks: a key block no query of the tile may see (causal, window) is never visited; a block that
// every query sees whole takes the unmasked softmax; the others (the diagonal, the window's edge, a
// custom mask, the request's last partial block) take the masked one. A row that sees no key at all
// (causal with qo_len > kv_len, a mask row of zeros) keeps l = 0 and stores zeros and LSE -inf;
// a split piece in which it sees none stores LSE -inf, which the merge weighs 0.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernforge/attention/fp8_dot.h"
#include "kernforge/attention/softmax_state.h"
#include "kernforge/core/isa_features.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/types.h"
#include "kernforge/core/vec.h"
#include "kernforge/gemm/amx_kernel.h"
#include "kernforge/gemm/f32_kernel.h"
#include "kernforge/gemm/micro_kernel.h"

namespace kf::attention {

// ---- planning -----------------------------------------------------------------------------------

// PrefillPlanError (kPrefillBadQoIndptr, kPrefillBadKvIndptr, kPrefillBadLastPage,
// kPrefillNegativePage; kPrefillTooManyItems: the item buffer the caller sized is too small, a bug)
// and PrefillInts (int32s per PrefillItem and PrefillMerge) are declared once in Python with the
// module (kernforge/ops/attention/prefill.py) and emitted ahead of this header by the prelude.
inline int64_t prefill_error(PrefillPlanError kind, int64_t index) { return (int64_t(kind) << 32) | index; }

// One work item: a tile's request, KV head and first query, and the keys [kv_begin, kv_end) it
// covers (int32s in the plan's item buffer). slot < 0: the item covers every key its queries see
// and writes the output; slot >= 0: one piece of a tile split along the KV, which writes a partial
// state to that workspace slot for the merge that follows.
struct PrefillItem {
  int32_t request, kv_head, query_begin, kv_begin, kv_end, slot;
};

// A split tile: its pieces' states lie in slots [first_slot, first_slot + parts).
struct PrefillMerge {
  int32_t request, kv_head, query_begin, first_slot, parts;
};
static_assert(sizeof(PrefillItem) == PrefillInts::kItemInts * sizeof(int32_t), "PrefillItem as declared in prefill.py");
static_assert(sizeof(PrefillMerge) == PrefillInts::kMergeInts * sizeof(int32_t),
              "PrefillMerge as declared in prefill.py");

struct PrefillPlanInput {
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;      // paged: pages per request (into indices); ragged: tokens
  const int32_t* last_page_len;  // paged only
  const int32_t* indices;        // paged only
  int64_t batch, num_indices, page_size, num_kv_heads, queries_per_tile, window_left;
  bool ragged, causal, custom_mask;                // a custom mask replaces the causal one (FlashInfer's mask modes)
  int64_t num_threads, block_n, min_split_blocks;  // split the KV when tiles are fewer than threads
};

// Keys [lo, hi) that query `q` (0-based within its request) may see under causal and window_left,
// before any custom mask. Causal is aligned bottom-right: the last query sees the last key, and
// with qo_len > kv_len the first qo_len - kv_len queries see none (hi <= 0: FlashInfer gives such
// rows zeros and LSE -inf, as for any row that its masks leave without a key).
inline void visible_keys(int64_t q, int64_t qo_len, int64_t kv_len, bool causal, int64_t window_left, int64_t& lo,
                         int64_t& hi) {
  const int64_t position = kv_len - qo_len + q;  // the query's position among the keys
  hi = causal ? std::min(kv_len, position + 1) : kv_len;
  lo = window_left >= 0 ? std::max<int64_t>(0, position - window_left) : 0;
}

// What plan_prefill hands back besides the items.
struct PrefillPlanCounts {
  int64_t items, merges, slots;
};

namespace prefill_detail {

// Keys [begin, end) of a whole tile: from the block holding its first query's first key to its last
// query's last key.
inline void tile_keys(const PrefillPlanInput& in, int64_t qo_len, int64_t kv_len, int64_t query_begin, int64_t& begin,
                      int64_t& end) {
  const bool causal = in.causal && !in.custom_mask;
  const int64_t last = std::min(qo_len, query_begin + in.queries_per_tile) - 1;
  int64_t lo, hi, lo_last, hi_last;
  visible_keys(query_begin, qo_len, kv_len, causal, in.window_left, lo, hi);
  visible_keys(last, qo_len, kv_len, causal, in.window_left, lo_last, hi_last);
  begin = lo / in.block_n * in.block_n;
  end = std::max(begin, hi_last);
}

// Checks request b's indices and returns its kv_len, or a negative prefill_error.
inline int64_t request_kv_len(const PrefillPlanInput& in, int64_t b) {
  const int64_t qo_len = int64_t(in.qo_indptr[b + 1]) - in.qo_indptr[b];
  const int64_t kv_span = int64_t(in.kv_indptr[b + 1]) - in.kv_indptr[b];
  if (qo_len < 0) return -prefill_error(kPrefillBadQoIndptr, b);
  if (kv_span < 0) return -prefill_error(kPrefillBadKvIndptr, b);
  int64_t kv_len = kv_span;
  if (!in.ragged) {
    if (in.kv_indptr[b + 1] > in.num_indices) return -prefill_error(kPrefillBadKvIndptr, b);
    for (int64_t i = in.kv_indptr[b]; i < in.kv_indptr[b + 1]; ++i)
      if (in.indices[i] < 0) return -prefill_error(kPrefillNegativePage, i);
    if (kv_span > 0 && (in.last_page_len[b] < 1 || in.last_page_len[b] > in.page_size))
      return -prefill_error(kPrefillBadLastPage, b);
    kv_len = kv_span == 0 ? 0 : (kv_span - 1) * in.page_size + in.last_page_len[b];
  }
  return kv_len;
}

}  // namespace prefill_detail

// Validates the batch, writes kv_len per request, the work items (largest first) and the merges of
// split tiles. A tile's keys are cut into pieces of at least min_split_blocks blocks: into
// ceil(threads / tiles) when the batch has fewer tiles than threads, and into ceil(cost / share)
// when the tile alone costs more than a thread's share of the batch (one long request among short
// ones, as decode's planner balances them). Returns 0 or prefill_error().
// Capacities: items >= 2 * (tiles + threads), merges >= tiles.
inline int64_t plan_prefill(const PrefillPlanInput& in, int32_t* kv_lens, PrefillItem* items, int64_t item_capacity,
                            PrefillMerge* merges, int64_t merge_capacity, PrefillPlanCounts* counts) {
  if (in.qo_indptr[0] != 0) return prefill_error(kPrefillBadQoIndptr, 0);
  if (in.kv_indptr[0] != 0) return prefill_error(kPrefillBadKvIndptr, 0);
  int64_t tiles = 0;
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t kv_len = prefill_detail::request_kv_len(in, b);
    if (kv_len < 0) return -kv_len;
    kv_lens[b] = int32_t(kv_len);
    const int64_t qo_len = int64_t(in.qo_indptr[b + 1]) - in.qo_indptr[b];
    tiles += (qo_len + in.queries_per_tile - 1) / in.queries_per_tile * in.num_kv_heads;
  }
  const int64_t wanted_parts = tiles == 0 ? 1 : std::max<int64_t>(1, (in.num_threads + tiles - 1) / tiles);
  // A tile's cost: query rows x keys it covers (plus a fixed overhead), as the items are ordered below.
  const auto tile_cost = [&](int64_t qo_len, int64_t q0, int64_t begin, int64_t end) {
    return std::min(qo_len - q0, in.queries_per_tile) * (end - begin + 16);
  };
  int64_t total_cost = 0;
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t qo_len = int64_t(in.qo_indptr[b + 1]) - in.qo_indptr[b];
    for (int64_t q0 = 0; q0 < qo_len; q0 += in.queries_per_tile) {
      int64_t begin, end;
      prefill_detail::tile_keys(in, qo_len, kv_lens[b], q0, begin, end);
      total_cost += tile_cost(qo_len, q0, begin, end) * in.num_kv_heads;
    }
  }
  const int64_t threads = std::max<int64_t>(in.num_threads, 1);
  const int64_t share = std::max<int64_t>(1, (total_cost + threads - 1) / threads);
  PrefillPlanCounts c{0, 0, 0};
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t qo_len = int64_t(in.qo_indptr[b + 1]) - in.qo_indptr[b];
    for (int64_t q0 = 0; q0 < qo_len; q0 += in.queries_per_tile) {
      int64_t begin, end;
      prefill_detail::tile_keys(in, qo_len, kv_lens[b], q0, begin, end);
      const int64_t blocks = (end - begin + in.block_n - 1) / in.block_n;
      const int64_t over_share = (tile_cost(qo_len, q0, begin, end) + share - 1) / share;
      const int64_t parts = std::max<int64_t>(
          1, std::min(std::max(wanted_parts, over_share), blocks / std::max<int64_t>(in.min_split_blocks, 1)));
      for (int64_t h = 0; h < in.num_kv_heads; ++h) {
        if (c.items + parts > item_capacity || (parts > 1 && c.merges == merge_capacity))
          return prefill_error(kPrefillTooManyItems, b);
        if (parts > 1) merges[c.merges++] = {int32_t(b), int32_t(h), int32_t(q0), int32_t(c.slots), int32_t(parts)};
        for (int64_t i = 0; i < parts; ++i) {  // near-equal runs of whole blocks
          const int64_t from = begin + blocks * i / parts * in.block_n;
          const int64_t to = i + 1 == parts ? end : begin + blocks * (i + 1) / parts * in.block_n;
          items[c.items++] = {int32_t(b),    int32_t(h),  int32_t(q0),
                              int32_t(from), int32_t(to), int32_t(parts > 1 ? c.slots++ : -1)};
        }
      }
    }
  }
  // Largest first, so dynamic scheduling ends with small items.
  const auto cost = [&](const PrefillItem& it) {
    const int64_t qo_len = int64_t(in.qo_indptr[it.request + 1]) - in.qo_indptr[it.request];
    return tile_cost(qo_len, it.query_begin, it.kv_begin, it.kv_end);
  };
  std::stable_sort(items, items + c.items,
                   [&](const PrefillItem& a, const PrefillItem& b) { return cost(a) > cost(b); });
  *counts = c;
  return 0;
}

// ---- the kernel ---------------------------------------------------------------------------------

// kf_prefill_planned / kf_prefill_layer are declared by kernforge/ops/prefill.py (module structs).
template <class QT, class KVT, class OutT, int kHeadQK, int kHeadVO, int kBlockM, int kBlockN>
class PrefillKernel {
  // bf16 q with bf16 or fp8 KV multiplies bf16 pairs; anything else multiplies in fp32.
  static constexpr bool kBf16 =
      std::is_same_v<QT, bf16> &&
      (std::is_same_v<KVT, bf16> || std::is_same_v<KVT, fp8_e4m3> || std::is_same_v<KVT, fp8_e5m2>);
  using Compute = std::conditional_t<kBf16, bf16, float>;
  using Tile = gemm::DefaultTile<Compute>;
  static constexpr int kMR = Tile::kMR;
  static constexpr int kNR = Tile::kNR;
  static constexpr int kWidth = VecF::kWidth;
#if KF_HAS_AMX
  // AMX blocks are 32 columns wide: keys per block and the (padded) value columns are whole blocks.
  static constexpr int kAmxColumns = kBf16 && kBlockN % gemm::amx::kBlockColumns == 0 ? gemm::amx::kBlockColumns : 0;
#else
  static constexpr int kAmxColumns = 0;
#endif
  // Any head dim runs on the micro-kernels through zero padding in the kernel's own packed copies
  // (never by reading past a q/k/v row): Q.K^T's depth to whole bf16 pairs, P.V's columns to whole
  // vectors, or to whole AMX blocks where tiles may run and head_dim_vo needs padding anyway.
  // Dims that are whole units already keep their layout, and their fast paths, unchanged.
  static constexpr int kDepthQK = kBf16 ? (kHeadQK + 1) / 2 * 2 : kHeadQK;
  static constexpr int kColumnUnit = kHeadVO % kWidth == 0 || kAmxColumns == 0 ? kWidth : kAmxColumns;
  static constexpr int kVO = (kHeadVO + kColumnUnit - 1) / kColumnUnit * kColumnUnit;  // accumulator columns
  static constexpr bool kAmx = kAmxColumns != 0 && kVO % kAmxColumns == 0;
  // Output columns per micro-kernel call: NR where the padded columns allow, else one vector.
  static constexpr int kNRV = kVO % kNR == 0 ? kNR : kWidth;
  // bf16 K rows are read in place as pair words, except an odd head_dim_qk's (its last pair would
  // read past the row): those, and fp8 rows, are copied (widened) into zero-padded scratch rows, as
  // are rows split across two tensors (io.pe_dim > 0), known at run time.
  static constexpr bool kCopiesKeys = kBf16 && (!std::is_same_v<KVT, bf16> || kHeadQK % 2 != 0);
  // Up to this many query rows per item, scores are computed as K . Q^T (scores_by_key_rows).
  static constexpr int64_t kFewRows = 32;
  static_assert(kBlockN % kNR == 0 && kBlockN % 2 == 0, "a key block is whole micro-tiles of keys");

 public:
  explicit PrefillKernel(const kf_prefill_planned& p) : p_(p) {}

  // Bytes of scratch one thread needs for tiles of `rows` query rows.
  static int64_t scratch_bytes(int64_t rows) { return Scratch::layout(rows, nullptr).bytes; }

  void run(const kf_prefill_layer& io) const {
    const auto* items = reinterpret_cast<const PrefillItem*>(p_.items);
    const auto* merges = reinterpret_cast<const PrefillMerge*>(p_.merges);
    char* workspace = reinterpret_cast<char*>(p_.workspace);
    const int64_t threads = std::min<int64_t>(io.num_threads, p_.max_threads);
    std::atomic<int64_t> blocks_visited{0};
    parallel_for<Schedule::kDynamic>(p_.num_items, threads, [&](int64_t i) {
      const Scratch s = Scratch::layout(p_.rows, workspace + thread_index() * p_.scratch_bytes);
      blocks_visited.fetch_add(run_item(io, items[i], s), std::memory_order_relaxed);
    });
    parallel_for(p_.num_merges, threads, [&](int64_t i) { merge(io, merges[i]); });
    if (p_.stats != 0) *reinterpret_cast<int64_t*>(p_.stats) = blocks_visited.load();
  }

 private:
  // A thread's scratch: the tile's Q, the transposed K block, scores, probabilities, the V block,
  // the output accumulators and the running max and sum, 64-byte aligned pieces of one buffer.
  struct Scratch {
    Compute *q, *k, *p, *v, *convert;
    float *s, *o, *pv, *m, *l, *st;
    int64_t bytes;

    static Scratch layout(int64_t rows, char* base) {
      Scratch s{};
      int64_t at = 0;
      const auto take = [&](int64_t bytes) {
        char* piece = base == nullptr ? nullptr : base + at;
        at += (bytes + 63) / 64 * 64;
        return piece;
      };
      s.q = reinterpret_cast<Compute*>(take(rows * kDepthQK * sizeof(Compute)));
      s.k = reinterpret_cast<Compute*>(take(kDepthQK * kBlockN * sizeof(Compute)));
      s.p = reinterpret_cast<Compute*>(take(rows * kBlockN * sizeof(Compute)));
      s.v = reinterpret_cast<Compute*>(take(kBlockN * kVO * sizeof(Compute)));
      // K rows copied before the transpose (kCopiesKeys, or rows split in two tensors)
      s.convert = reinterpret_cast<Compute*>(take(kBf16 ? kBlockN * kDepthQK * sizeof(Compute) : 0));
      s.s = reinterpret_cast<float*>(take(rows * kBlockN * sizeof(float)));
      s.o = reinterpret_cast<float*>(take(rows * kVO * sizeof(float)));
      s.pv = reinterpret_cast<float*>(take(kAmx ? rows * kVO * sizeof(float) : 0));           // P . V of one block
      s.st = reinterpret_cast<float*>(take(kBf16 ? kBlockN * kFewRows * sizeof(float) : 0));  // S^T, few rows
      s.m = reinterpret_cast<float*>(take(rows * sizeof(float)));
      s.l = reinterpret_cast<float*>(take(rows * sizeof(float)));
      s.bytes = at;
      return s;
    }
  };

  // Where one tile's queries and keys are.
  struct TileView {
    int64_t request, kv_head, query_begin, queries, rows, qo_begin, qo_len, kv_len;
  };

  // Where key `token` of `request` lies in a plane of these strides, in elements.
  int64_t token_offset(int64_t request, int64_t token, int64_t page_stride, int64_t token_stride) const {
    const auto* indptr = reinterpret_cast<const int32_t*>(p_.kv_indptr);
    if (p_.ragged) return (indptr[request] + token) * token_stride;
    const auto* indices = reinterpret_cast<const int32_t*>(p_.indices);
    const int64_t page = indices[indptr[request] + token / p_.page_size];
    return page * page_stride + token % p_.page_size * token_stride;
  }

  const KVT* key_row(const kf_prefill_layer& io, int64_t request, int64_t token, int64_t head, bool value) const {
    const int64_t base = value ? io.v : io.k;
    const int64_t offset = value ? token_offset(request, token, io.v_stride_page, io.v_stride_token)
                                 : token_offset(request, token, io.k_stride_page, io.k_stride_token);
    return reinterpret_cast<const KVT*>(base) + offset + head * (value ? io.v_stride_head : io.k_stride_head);
  }

  // The last io.pe_dim elements of key `token`'s K row, where they live in a tensor of their own.
  const KVT* key_pe_row(const kf_prefill_layer& io, int64_t request, int64_t token) const {
    return reinterpret_cast<const KVT*>(io.k_pe) +
           token_offset(request, token, io.k_pe_stride_page, io.k_pe_stride_token);
  }

  // dst[0, n) = src[0, n), converted (exactly, for every widening this kernel does): fp8 to bf16
  // by table lookup 64 at a time where the CPU has it (fp8_dot.h), else through fp32 lanes.
  template <class From, class To>
  static void copy_converted(const From* src, int64_t n, To* dst) {
    if constexpr (std::is_same_v<From, To>) {
      std::memcpy(dst, src, n * sizeof(To));
      return;
    }
    int64_t d = 0;
#if KF_HAS_FP8_DOT
    if constexpr (std::is_same_v<To, bf16> && (std::is_same_v<From, fp8_e4m3> || std::is_same_v<From, fp8_e5m2>)) {
      const fp8_dot::Converter<From> table;
      for (; d + fp8_dot::kChunk <= n; d += fp8_dot::kChunk) fp8_dot::convert_chunk(table, src + d, dst + d);
    }
#endif
    for (; d < n; d += kWidth) VecF::load(src + d, n - d).store(dst + d, n - d);
  }

  // The AMX products of an item, where the tier has tiles and the OS granted them: the thread's tile
  // configuration lives as long as the item. scores()/accumulate() return false where they did not
  // run, and the vector micro-kernels take over.
  struct Tiles {
#if KF_HAS_AMX
    bool enabled = kAmx && gemm::amx::tiles_permitted();
    gemm::amx::Tiles state;

    bool active() const { return enabled; }
    gemm::amx::TailBuffers<gemm::amx::Bf16Product> tails;

    // s.s[rows x kBlockN] = Q . K^T, 32 x 32 blocks.
    bool scores(const TileView& t, const Scratch& s) {
      if (!enabled) return false;
      if constexpr (kAmx) {
        const auto* k = reinterpret_cast<const uint32_t*>(s.k);
        for (int64_t r0 = 0; r0 < t.rows; r0 += gemm::amx::kBlockRows) {
          const int rows = int(std::min<int64_t>(gemm::amx::kBlockRows, t.rows - r0));
          state.shape_for(rows);
          for (int64_t j0 = 0; j0 < kBlockN; j0 += gemm::amx::kBlockColumns)
            gemm::amx::block<gemm::amx::Bf16Product>(s.q + r0 * kDepthQK, kDepthQK, k + j0, kBlockN, kDepthQK, rows,
                                                     s.s + r0 * kBlockN + j0, kBlockN, tails);
        }
      }
      return true;
    }

    // s.o += P . V: the block's product in tiles, added to the (already rescaled) accumulators.
    bool accumulate(const TileView& t, const Scratch& s) {
      if (!enabled) return false;
      if constexpr (kAmx) {
        const auto* v = reinterpret_cast<const uint32_t*>(s.v);
        for (int64_t r0 = 0; r0 < t.rows; r0 += gemm::amx::kBlockRows) {
          const int rows = int(std::min<int64_t>(gemm::amx::kBlockRows, t.rows - r0));
          state.shape_for(rows);
          for (int64_t d0 = 0; d0 < kVO; d0 += gemm::amx::kBlockColumns)
            gemm::amx::block<gemm::amx::Bf16Product>(s.p + r0 * kBlockN, kBlockN, v + d0, kVO, kBlockN, rows,
                                                     s.pv + r0 * kVO + d0, kVO, tails);
        }
        for (int64_t i = 0; i < t.rows * kVO; i += kWidth) (VecF::load(s.o + i) + VecF::load(s.pv + i)).store(s.o + i);
      }
      return true;
    }
#else
    bool active() const { return false; }
    bool scores(const TileView&, const Scratch&) { return false; }
    bool accumulate(const TileView&, const Scratch&) { return false; }
#endif
  };

  // Returns the number of key blocks the item computed.
  int64_t run_item(const kf_prefill_layer& io, const PrefillItem& item, const Scratch& s) const {
    const auto* qo_indptr = reinterpret_cast<const int32_t*>(p_.qo_indptr);
    const auto* kv_lens = reinterpret_cast<const int32_t*>(p_.kv_lens);
    TileView t;
    t.request = item.request;
    t.kv_head = item.kv_head;
    t.query_begin = item.query_begin;
    t.qo_begin = qo_indptr[t.request];
    t.qo_len = qo_indptr[t.request + 1] - t.qo_begin;
    t.kv_len = kv_lens[t.request];
    t.queries = std::min<int64_t>(p_.queries_per_tile, t.qo_len - t.query_begin);
    t.rows = t.queries * p_.group;
    load_queries(io, t, s);
    std::fill_n(s.o, t.rows * kVO, 0.0f);
    std::fill_n(s.m, t.rows, -std::numeric_limits<float>::infinity());
    std::fill_n(s.l, t.rows, 0.0f);

    const bool causal = p_.causal != 0 && p_.mask == 0;
    int64_t lo_first, hi_first, lo_last, hi_last;
    visible_keys(t.query_begin, t.qo_len, t.kv_len, causal, p_.window_left, lo_first, hi_first);
    visible_keys(t.query_begin + t.queries - 1, t.qo_len, t.kv_len, causal, p_.window_left, lo_last, hi_last);
    int64_t visited = 0;
    Tiles tiles;
    const bool by_key_rows = kBf16 && t.rows <= kFewRows && !tiles.active();
    if (by_key_rows) pack_query_columns(t, s);
    const int64_t kv_end = std::min<int64_t>(item.kv_end, hi_last);
    for (int64_t k0 = std::max<int64_t>(item.kv_begin, lo_first / kBlockN * kBlockN); k0 < kv_end; k0 += kBlockN) {
      const int64_t count = std::min<int64_t>(kBlockN, t.kv_len - k0);
      // Every row sees all of [k0, k0 + kBlockN) only inside the first row's upper bound and the
      // last row's lower bound, and only for a whole block.
      const bool whole = p_.mask == 0 && count == kBlockN && k0 >= lo_last && k0 + kBlockN <= hi_first;
      if (by_key_rows) {
        scores_by_key_rows(io, t, k0, count, s);
      } else {
        load_keys(io, t, k0, count, s);
        if (!tiles.scores(t, s)) scores(t, s);
      }
      softmax(t, k0, count, whole, float(io.qk_scale), s);
      load_values(io, t, k0, count, s);
      if (!tiles.accumulate(t, s)) accumulate(t, s);
      ++visited;
    }
    if (item.slot < 0) {
      store(io, t, s);
    } else {
      store_partial(io, t, item.slot, s);
    }
    return visited;
  }

  void load_queries(const kf_prefill_layer& io, const TileView& t, const Scratch& s) const {
    const QT* q = reinterpret_cast<const QT*>(io.q);
    for (int64_t r = 0; r < t.rows; ++r) {
      const int64_t token = t.qo_begin + t.query_begin + r / p_.group;
      const int64_t head = t.kv_head * p_.group + r % p_.group;
      const QT* src = q + token * io.q_stride_token + head * io.q_stride_head;
      Compute* dst = s.q + r * kDepthQK;
      const int64_t split = kHeadQK - io.pe_dim;  // MLA: q_nope here, q_pe from its own tensor
      copy_converted(src, split, dst);
      if (io.pe_dim > 0) {
        const QT* pe = reinterpret_cast<const QT*>(io.q_pe) + token * io.q_pe_stride_token + head * io.q_pe_stride_head;
        copy_converted(pe, io.pe_dim, dst + split);
      }
      if constexpr (kDepthQK > kHeadQK) dst[kHeadQK] = Compute{};  // the odd dim's pair: times K's zero
    }
  }

  // K block -> B of S = Q . K^T: bf16 path, word (pair p, key j) = (K[j][2p], K[j][2p + 1]) at
  // k[p * kBlockN + j], i.e. the block's rows of pair words transposed; fp32 path, k[d * kBlockN + j]
  // = K[j][d]. Keys past `count` are zero.
  void load_keys(const kf_prefill_layer& io, const TileView& t, int64_t k0, int64_t count, const Scratch& s) const {
    if constexpr (kBf16) {
      auto* words = reinterpret_cast<uint32_t*>(s.k);
      const uint32_t* rows[kBlockN];
      for (int64_t j = 0; j < kBlockN; ++j) rows[j] = j < count ? key_words(io, t, k0 + j, s, j) : nullptr;
      transpose_words(rows, words);
    } else {
      for (int64_t j = 0; j < kBlockN; ++j) {
        if (j >= count) {
          for (int64_t d = 0; d < kHeadQK; ++d) s.k[d * kBlockN + j] = 0.0f;
          continue;
        }
        const KVT* row = key_row(io, t.request, k0 + j, t.kv_head, false);
        const int64_t split = kHeadQK - io.pe_dim;
        for (int64_t d = 0; d < split; ++d) s.k[d * kBlockN + j] = to_float(row[d]);
        if (io.pe_dim > 0) {
          const KVT* pe = key_pe_row(io, t.request, k0 + j);
          for (int64_t d = split; d < kHeadQK; ++d) s.k[d * kBlockN + j] = to_float(pe[d - split]);
        }
      }
    }
  }

  // Key `token`'s row as kDepthQK / 2 pair words: the cache row itself for bf16 KV of an even
  // head_dim_qk; else the row widened (exactly) into row j of the conversion scratch, zero-padded.
  const uint32_t* key_words(const kf_prefill_layer& io, const TileView& t, int64_t token, const Scratch& s,
                            int64_t j) const {
    const KVT* row = key_row(io, t.request, token, t.kv_head, false);
    if constexpr (!kCopiesKeys) {
      if (io.pe_dim == 0) return reinterpret_cast<const uint32_t*>(row);
    }
    bf16* widened = reinterpret_cast<bf16*>(s.convert) + j * kDepthQK;
    const int64_t split = kHeadQK - io.pe_dim;
    copy_converted(row, split, widened);
    if (io.pe_dim > 0) copy_converted(key_pe_row(io, t.request, token), io.pe_dim, widened + split);
    if constexpr (kDepthQK > kHeadQK) widened[kHeadQK] = bf16{};
    return reinterpret_cast<const uint32_t*>(widened);
  }

  // words[p * kBlockN + j] = rows[j][p] for p < kDepthQK / 2, j < kBlockN (a null row reads as zeros):
  // whole 16 x 16 blocks in registers where the tier has them, the remaining pairs one by one.
  static void transpose_words(const uint32_t* const* rows, uint32_t* words) {
    constexpr int64_t kPairs = kDepthQK / 2;
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
    constexpr int64_t kBlocked = kBlockN % 16 == 0 ? kPairs / 16 * 16 : 0;
    for (int64_t j0 = 0; j0 < kBlockN && kBlocked > 0; j0 += 16)
      for (int64_t p0 = 0; p0 < kBlocked; p0 += 16) transpose_16x16(rows + j0, p0, words + p0 * kBlockN + j0);
#else
    constexpr int64_t kBlocked = 0;
#endif
    if constexpr (kBlocked < kPairs) {
      for (int64_t j = 0; j < kBlockN; ++j)
        for (int64_t p = kBlocked; p < kPairs; ++p) words[p * kBlockN + j] = rows[j] ? load_word(rows[j] + p) : 0u;
    }
  }

  // A cache row's pair word: rows start wherever the cache's strides put them (2-byte aligned for bf16).
  static uint32_t load_word(const uint32_t* at) {
    uint32_t word;
    std::memcpy(&word, at, sizeof(word));
    return word;
  }

#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
  // out[c * kBlockN + i] = rows[i][p0 + c] for a 16 x 16 block of 32-bit words.
  static void transpose_16x16(const uint32_t* const* rows, int64_t p0, uint32_t* out) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = rows[i] ? _mm512_loadu_si512(rows[i] + p0) : _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved: columns (0, 1) (4, 5) ... | (2, 3) ...
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + c] = rows 4i..4i+3 of columns c, c + 4, c + 8, c + 12
      r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {  // gather the 128-bit lanes of the four row groups
      const __m512i even_a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88),
                    odd_a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
      const __m512i even_b = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
      const __m512i odd_b = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
      _mm512_storeu_si512(out + (c + 0) * kBlockN, _mm512_shuffle_i32x4(even_a, even_b, 0x88));
      _mm512_storeu_si512(out + (c + 8) * kBlockN, _mm512_shuffle_i32x4(even_a, even_b, 0xdd));
      _mm512_storeu_si512(out + (c + 4) * kBlockN, _mm512_shuffle_i32x4(odd_a, odd_b, 0x88));
      _mm512_storeu_si512(out + (c + 12) * kBlockN, _mm512_shuffle_i32x4(odd_a, odd_b, 0xdd));
    }
  }
#endif

  // V block -> B of O += P . V: bf16 path, word (key pair p, column d) = (V[2p][d], V[2p + 1][d]) at
  // v[p * kVO + d]; fp32 path, v[j * kVO + d] = V[j][d]. Keys past `count` and columns past
  // head_dim_vo are zero.
  // MLA's values are the leading head_dim_vo elements of its key rows (io.v is io.k): where load_keys
  // converted the block's key rows to bf16, the values are read from there rather than converted
  // again.
  bool values_in_converted_keys(const kf_prefill_layer& io) const {
    if constexpr (!kBf16 || kHeadVO > kHeadQK) {
      return false;
    } else {
      const bool copied = kCopiesKeys || io.pe_dim > 0;
      return copied && io.v == io.k && io.v_stride_page == io.k_stride_page && io.v_stride_token == io.k_stride_token &&
             io.v_stride_head == io.k_stride_head;
    }
  }

  void load_values(const kf_prefill_layer& io, const TileView& t, int64_t k0, int64_t count, const Scratch& s) const {
    if constexpr (kBf16) {
      auto* words = reinterpret_cast<uint32_t*>(s.v);
      if (values_in_converted_keys(io)) {
        const bf16* rows = reinterpret_cast<const bf16*>(s.convert);
        for (int64_t j = 0; j < kBlockN; j += 2) {
          const bf16* even = j < count ? rows + j * kDepthQK : nullptr;
          const bf16* odd = j + 1 < count ? rows + (j + 1) * kDepthQK : nullptr;
          interleave_row(even, odd, words + j / 2 * kVO);
        }
        return;
      }
      for (int64_t j = 0; j < kBlockN; j += 2) {
        const KVT* even = j < count ? key_row(io, t.request, k0 + j, t.kv_head, true) : nullptr;
        const KVT* odd = j + 1 < count ? key_row(io, t.request, k0 + j + 1, t.kv_head, true) : nullptr;
        interleave_row(even, odd, words + j / 2 * kVO);
      }
    } else {
      for (int64_t j = 0; j < kBlockN; ++j) {
        float* dst = s.v + j * kVO;
        if (j >= count) {
          std::fill_n(dst, kVO, 0.0f);
          continue;
        }
        const KVT* row = key_row(io, t.request, k0 + j, t.kv_head, true);
        for (int64_t d = 0; d < kVO; d += kWidth) value_lanes(row, d).store(dst + d);
      }
    }
  }

  // Columns [d, d + kWidth) of a V row: those at or past head_dim_vo are zero and not read.
  template <class T>
  static VecF value_lanes(const T* row, int64_t d) {
    if constexpr (kHeadVO % kWidth == 0) {
      return VecF::load(row + d);
    } else {
      return d < kHeadVO ? VecF::load(row + d, kHeadVO - d) : VecF::zero();
    }
  }

  // Stores columns [d, d + kWidth) of an output row of head_dim_vo values, not one past its end.
  template <class T>
  static void store_columns(VecF x, T* row, int64_t d) {
    if constexpr (kHeadVO % kWidth == 0) {
      x.store(row + d);
    } else {
      x.store(row + d, kHeadVO - d);
    }
  }

  // dst[d] = (even[d], odd[d]) as bf16 pair words for the kVO columns of a value row pair; a null
  // row is zeros. bf16 rows of whole 32-element chunks pair in registers (two word permutes per
  // 32 columns); others widen through fp32 lanes.
  template <class T>
  static void interleave_row(const T* even, const T* odd, uint32_t* dst) {
    int64_t d = 0;
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
    if constexpr (std::is_same_v<T, bf16> && kHeadVO % 32 == 0) {
      const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
      for (; d < kHeadVO; d += 32) {
        const __m512i a = even ? _mm512_loadu_si512(even + d) : _mm512_setzero_si512();
        const __m512i b = odd ? _mm512_loadu_si512(odd + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(a, low, b));
        _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(a, high, b));
      }
    }
#endif
    for (; d < kVO; d += kWidth) interleave_pairs(even, odd, d, dst + d);
  }

  // dst[i] = (even[d + i], odd[d + i]) as bf16 pair words, kWidth of them; a null row is zeros.
  // Every bf16 and fp8 value widens to an fp32 whose top half is its bf16.
  template <class T>
  static void interleave_pairs(const T* even, const T* odd, int64_t d, uint32_t* dst) {
    const VecF low = even ? value_lanes(even, d) : VecF::zero(), high = odd ? value_lanes(odd, d) : VecF::zero();
#if defined(KF_TIER_AVX512) || defined(KF_TIER_AMX)
    const __m512i words = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(low.v), 16),
                                          _mm512_andnot_si512(_mm512_set1_epi32(0xffff), _mm512_castps_si512(high.v)));
    _mm512_storeu_si512(dst, words);
#else
    alignas(64) float lo[kWidth], hi[kWidth];
    low.store(lo);
    high.store(hi);
    for (int i = 0; i < kWidth; ++i)
      dst[i] = bit_cast<uint32_t>(lo[i]) >> 16 | (bit_cast<uint32_t>(hi[i]) & 0xffff0000u);
#endif
  }

  // Few query rows (a decode step's heads, MLA's 16): S^T = K . Q^T instead, the block's key rows
  // the micro-kernel's A as they are (in place, or as load_keys converts them) and Q^T packed once
  // per item; at 16 rows, transposing every key block would cost as much as the product. The small
  // S^T is transposed into s.s for the softmax.
  static int64_t query_columns(int64_t rows) { return rows <= 16 ? 16 : kFewRows; }

  // Q^T as pair words: word (pair p, row c) at s.k[p * columns + c], rows past t.rows zero.
  void pack_query_columns(const TileView& t, const Scratch& s) const {
    const int64_t columns = query_columns(t.rows);
    auto* words = reinterpret_cast<uint32_t*>(s.k);
    const auto* q = reinterpret_cast<const uint32_t*>(s.q);
    for (int64_t p = 0; p < kDepthQK / 2; ++p)
      for (int64_t c = 0; c < columns; ++c) words[p * columns + c] = c < t.rows ? q[c * (kDepthQK / 2) + p] : 0u;
  }

  void scores_by_key_rows(const kf_prefill_layer& io, const TileView& t, int64_t k0, int64_t count,
                          const Scratch& s) const {
    const int64_t columns = query_columns(t.rows);
    const auto* q_columns = reinterpret_cast<const uint32_t*>(s.k);
    std::fill_n(s.st, kBlockN * columns, 0.0f);
    const uint32_t* rows[kBlockN];
    for (int64_t j = 0; j < count; ++j) rows[j] = key_words(io, t, k0 + j, s, j);
    for (int64_t j = 0; j < count;) {  // runs of up to kMR keys whose rows are equally spaced (a page)
      const intptr_t step = j + 1 < count ? reinterpret_cast<intptr_t>(rows[j + 1]) - intptr_t(rows[j]) : 0;
      int64_t run = 1;
      while (run < kMR && j + run < count &&
             reinterpret_cast<intptr_t>(rows[j + run]) - intptr_t(rows[j + run - 1]) == step)
        ++run;
      const auto* a = reinterpret_cast<const bf16*>(rows[j]);
      const int64_t lda = step / intptr_t(sizeof(bf16));
      float* c = s.st + j * columns;
      if (columns == 16) {
        gemm::micro_kernel_rows<kMR, 16>(run, a, lda, q_columns, columns, kDepthQK, c, columns);
      } else {
        gemm::micro_kernel_rows<kMR, kFewRows>(run, a, lda, q_columns, columns, kDepthQK, c, columns);
      }
      j += run;
    }
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t j = 0; j < kBlockN; ++j) s.s[r * kBlockN + j] = s.st[j * columns + r];
  }

  // s.s[rows x kBlockN] = Q . K^T.
  void scores(const TileView& t, const Scratch& s) const {
    std::fill_n(s.s, t.rows * kBlockN, 0.0f);
    multiply<kNR>(t.rows, s.q, kDepthQK, s.k, kBlockN, kDepthQK, kBlockN, s.s);
  }

  // s.o[rows x kVO] += P . V.
  void accumulate(const TileView& t, const Scratch& s) const {
    multiply<kNRV>(t.rows, s.p, kBlockN, s.v, kVO, kBlockN, kVO, s.o);
  }

  // c[rows x columns] (`columns` floats apart) += a[rows x depth] . b on the micro-kernels, NR
  // columns at a time; b is pair words (bf16 path) or fp32 rows (fp32 path), ldb of them apart.
  template <int NR>
  static void multiply(int64_t rows, const Compute* a, int64_t lda, const Compute* b, int64_t ldb, int64_t depth,
                       int64_t columns, float* c) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
      const int64_t tile_rows = std::min<int64_t>(kMR, rows - r0);
      for (int64_t j0 = 0; j0 < columns; j0 += NR) {
        float* tile = c + r0 * columns + j0;
        if constexpr (kBf16) {
          gemm::micro_kernel_rows<kMR, NR>(tile_rows, a + r0 * lda, lda, reinterpret_cast<const uint32_t*>(b) + j0, ldb,
                                           depth, tile, columns);
        } else {
          gemm::micro_kernel_f32_rows<kMR, NR>(tile_rows, a + r0 * lda, lda, b + j0, ldb, depth, tile, columns);
        }
      }
    }
  }

  // Scores -> probabilities of the online softmax, row by row; rescales the row's accumulators.
  // Without a soft cap the scale is folded into the exponent, exp(scale * s - m), and the row max is
  // taken on the raw scores (scale > 0 keeps their order), which saves a pass over the row.
  void softmax(const TileView& t, int64_t k0, int64_t count, bool whole, float qk_scale, const Scratch& s) const {
    constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
    const bool capped = p_.soft_cap > 0.0, folded = !capped && qk_scale > 0.0f;
    const VecF scale = VecF::broadcast(qk_scale), cap = VecF::broadcast(float(p_.soft_cap));
    const VecF multiplier = VecF::broadcast(folded ? qk_scale : 1.0f);
    const VecF lowest = VecF::broadcast(std::numeric_limits<float>::lowest());
    const bool causal = p_.causal != 0 && p_.mask == 0;
    for (int64_t r = 0; r < t.rows; ++r) {
      float* row = s.s + r * kBlockN;
      if (!folded) {
        for (int64_t j = 0; j < kBlockN; j += kWidth) {
          VecF x = VecF::load(row + j) * scale;
          if (capped) x = cap * tanh(x);
          x.store(row + j);
        }
      }
      if (!whole) mask_row(t, r / p_.group, k0, count, causal, row);
      VecF row_max = VecF::load(row);
      for (int64_t j = kWidth; j < kBlockN; j += kWidth) row_max = max(row_max, VecF::load(row + j));
      const float m_old = s.m[r], m_new = std::max(m_old, reduce_max(row_max) * (folded ? qk_scale : 1.0f));
      Compute* probabilities = s.p + r * kBlockN;
      if (m_new == kMinusInf) {  // nothing visible yet: p = 0, state unchanged
        for (int64_t j = 0; j < kBlockN; j += kWidth) VecF::zero().store(probabilities + j);
        // unless a visible logit is NaN (max skips NaN): the row's result is NaN, as in FlashInfer
        for (int64_t j = 0; j < kBlockN; ++j) {
          if (row[j] != row[j]) s.l[r] = std::numeric_limits<float>::quiet_NaN();
        }
        continue;
      }
      const VecF shift = VecF::broadcast(-m_new);
      VecF sum = VecF::zero();
      for (int64_t j = 0; j < kBlockN; j += kWidth) {
        const VecF x = VecF::load(row + j);
        // exp of -inf is not exactly 0 in vec_math's exp: masked keys must weigh nothing. A NaN
        // logit is not masked (x < lowest is false for it): its NaN reaches the row's sum and output.
        const VecF p = select(x < lowest, VecF::zero(), exp(fma(x, multiplier, shift)));
        sum += p;
        p.store(probabilities + j);
      }
      const float alpha = std::exp(m_old - m_new);  // 0 on the first visible block (m_old = -inf)
      s.l[r] = s.l[r] * alpha + reduce_add(sum);
      s.m[r] = m_new;
      if (alpha != 1.0f) {
        float* o = s.o + r * kVO;
        const VecF a = VecF::broadcast(alpha);
        for (int64_t d = 0; d < kVO; d += kWidth) (VecF::load(o + d) * a).store(o + d);
      }
    }
  }

  // Sets the logits of keys query `q` may not see to -inf.
  void mask_row(const TileView& t, int64_t q, int64_t k0, int64_t count, bool causal, float* row) const {
    constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
    int64_t lo, hi;
    visible_keys(t.query_begin + q, t.qo_len, t.kv_len, causal, p_.window_left, lo, hi);
    const int64_t begin = std::clamp<int64_t>(lo - k0, 0, kBlockN);
    const int64_t end = std::clamp<int64_t>(std::min(hi, k0 + count) - k0, begin, kBlockN);
    std::fill(row, row + begin, kMinusInf);
    std::fill(row + end, row + kBlockN, kMinusInf);
    if (p_.mask != 0) {  // bit (q, key) of the request's row-major [qo_len, kv_len] mask
      const auto* bits = reinterpret_cast<const uint8_t*>(p_.mask);
      const auto* offsets = reinterpret_cast<const int64_t*>(p_.mask_offsets);
      const int64_t first = offsets[t.request] + (t.query_begin + q) * t.kv_len + k0;
      for (int64_t j = begin; j < end; ++j) {
        const int64_t bit = first + j;
        if (!((bits[bit >> 3] >> (bit & 7)) & 1)) row[j] = kMinusInf;
      }
    }
  }

  // out = O / l * v_scale; lse = log2 of the row's sum of exp (FlashInfer's base-2 convention).
  void store(const kf_prefill_layer& io, const TileView& t, const Scratch& s) const {
    OutT* out = reinterpret_cast<OutT*>(io.out);
    float* lse = reinterpret_cast<float*>(io.lse);
    for (int64_t r = 0; r < t.rows; ++r) {
      const int64_t token = t.qo_begin + t.query_begin + r / p_.group;
      const int64_t head = t.kv_head * p_.group + r % p_.group;
      const float l = s.l[r];
      const VecF factor = VecF::broadcast(l == 0.0f ? 0.0f : float(io.v_scale) / l);  // NaN l stays NaN
      OutT* dst = out + token * io.out_stride_token + head * io.out_stride_head;
      const float* o = s.o + r * kVO;
      for (int64_t d = 0; d < kHeadVO; d += kWidth) store_columns(VecF::load(o + d) * factor, dst, d);
      if (lse != nullptr) lse[token * io.lse_stride_token + head * io.lse_stride_head] = segment_lse(s.m[r], l);
    }
  }

  // A piece of a split tile: its rows' normalized output (times v_scale) and LSE, in its slot
  // ([rows][head_dim_vo] floats, then [rows] LSEs).
  void store_partial(const kf_prefill_layer& io, const TileView& t, int64_t slot, const Scratch& s) const {
    float* state = partial(slot);
    for (int64_t r = 0; r < t.rows; ++r) {
      const float l = s.l[r];
      const VecF factor = VecF::broadcast(l == 0.0f ? 0.0f : float(io.v_scale) / l);  // NaN l stays NaN
      for (int64_t d = 0; d < kHeadVO; d += kWidth)
        store_columns(VecF::load(s.o + r * kVO + d) * factor, state + r * kHeadVO, d);
      state[p_.rows * kHeadVO + r] = segment_lse(s.m[r], l);
    }
  }

  float* partial(int64_t slot) const { return reinterpret_cast<float*>(p_.partials) + slot * p_.rows * (kHeadVO + 1); }

  // A split tile's output: its pieces' states merged by LSE (softmax_state.h), row by row.
  void merge(const kf_prefill_layer& io, const PrefillMerge& m) const {
    const auto* qo_indptr = reinterpret_cast<const int32_t*>(p_.qo_indptr);
    const int64_t qo_begin = qo_indptr[m.request], qo_len = qo_indptr[m.request + 1] - qo_begin;
    const int64_t rows = std::min<int64_t>(p_.queries_per_tile, qo_len - m.query_begin) * p_.group;
    const float* first = partial(m.first_slot);
    const int64_t slot_floats = p_.rows * (kHeadVO + 1);
    OutT* out = reinterpret_cast<OutT*>(io.out);
    float* lse = reinterpret_cast<float*>(io.lse);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = qo_begin + m.query_begin + r / p_.group;
      const int64_t head = m.kv_head * p_.group + r % p_.group;
      merge_state_row<float, OutT>(
          m.parts, first + r * kHeadVO, slot_floats, first + p_.rows * kHeadVO + r, slot_floats, kHeadVO,
          out + token * io.out_stride_token + head * io.out_stride_head,
          lse == nullptr ? nullptr : lse + token * io.lse_stride_token + head * io.lse_stride_head);
    }
  }

  const kf_prefill_planned& p_;
};

}  // namespace kf::attention
