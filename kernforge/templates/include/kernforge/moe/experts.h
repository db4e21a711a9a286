// Fused mixture-of-experts MLP: out[t] = sum_j w[t, j] * W2_e (silu(W1g_e x_t) * W1u_e x_t), e = ids[t, j],
// on the GEMM micro-kernels, in three steps and two parallel passes:
//
// 1. group_by_expert: the T x k (token, slot) pairs sorted by expert, tokens in order within each
//    expert (a counting sort), with their routing weights. Out-of-range ids are reported here,
//    before anything is written.
// 2. Gate/up pass: tasks of (expert, block of its rows, NR columns of I). A task gathers its rows
//    of x (once per thread for consecutive tasks of the same rows), multiplies them by the gate and
//    the up columns over H, and stores silu(gate) * up into the intermediate [T * k, I] (in sorted
//    order, so each expert's rows are contiguous for the next pass).
// 3. Down pass: tasks of (NR columns of H, a chunk of tokens). A task walks every expert with rows
//    in its chunk, multiplies them by the expert's NR columns of W2 and adds w * tile into an fp32
//    accumulator of its chunk x NR, then stores it: the k expert outputs of a token are summed in
//    registers and cache, never written out, and each output element is rounded once. Tasks own
//    disjoint output columns, so no two threads write the same element.
//
// Both passes split the weights' N across threads: the decode case (a few rows per expert) keeps
// every thread on its own weight panels; the prefill case (many rows per expert) reuses each panel
// over a whole block of rows from L1 (the K block) and L2.
//
// What multiplies a block of rows by a few packed columns is a Product policy, one per weight kind:
// * Bf16Weights: bf16 weights in gemm/linear.h's panels of VNNI-2 pairs, rows of x as they are
//   (gemm/micro_kernel.h; AMX tiles on the amx tier for blocks of 5 rows or more);
// * Fp8Weights: w8a16, e4m3 weights with block scales (DeepSeek-V3) in gemm/fp8_kernel.h's panels,
//   converted in registers;
// * Int8Weights: w8a8, sgl-kernel's int8 MoE: int8 weights with per-column scales in gemm/
//   int8_kernel.h's panels of VNNI-4 groups; x and the intermediate quantized per row (uint8 + 128,
//   fp32 scale) before each pass, exact int32 products dequantized into the fp32 tile.
// Weights are prepacked per expert by kernforge.ops.moe.pack_experts(_int8, _fp8) in the GEMMs'
// layouts: [E][parts][panels][K words][panel_width] (w1's gate and up halves as two parts, each padded
// to whole panels; one part where I is a multiple of the panel width: the same bytes).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernforge/activation.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"
#include "kernforge/gemm/amx_kernel.h"
#include "kernforge/gemm/fp8_kernel.h"
#include "kernforge/gemm/int8_kernel.h"
#include "kernforge/gemm/micro_kernel.h"
#include "kernforge/gemm/tasks.h"

namespace kf::moe {

// One stacked weight [E, n, k], packed per expert in `parts` parts of n / parts columns, each padded
// to whole panels of panel_width columns, K in words of per_word values; for int8 weights, the
// per-column zero-point compensation and scale, [E][parts][padded columns]; for fp8 weights, the
// block scales [E][ceil(n / block_n)][ceil(k / block_k)] (per_word 1: the words are K rows of bytes).
struct PackedExperts {
  const uint32_t* words;
  int64_t n, k, parts, panel_width, per_word;
  const int32_t* compensation = nullptr;
  const float* scale = nullptr;
  int64_t block_n = 0, block_k = 0;

  int64_t part_columns() const { return (n / parts + panel_width - 1) / panel_width * panel_width; }
  int64_t k_words() const { return (k + per_word - 1) / per_word; }
  int64_t part_index(int64_t expert, int64_t part) const { return expert * parts + part; }
  // The words of column n0 of a part: panel n0 / panel_width, offset n0 % panel_width in each K word row.
  const uint32_t* column(int64_t expert, int64_t part, int64_t n0) const {
    return words + part_index(expert, part) * part_columns() * k_words() +
           (n0 / panel_width) * k_words() * panel_width + n0 % panel_width;
  }
};

constexpr int64_t kRowBlock = 64;     // rows of a task's block: its fp32 tiles (2 x 64 x NR) stay in L1
constexpr int64_t kDepthBlock = 256;  // bf16 K per block: a micro-kernel call's B block (256 x NR) stays in L1
// Multiply-adds per thread before a second thread pays off (as gemm/linear.h).
constexpr int64_t kMinMacsPerThread = 1 << 17;

// Memory a call reuses from the previous one on the same thread (OpenMP's workers persist): a buffer
// allocated per call is fresh memory that page-faults as it is first written (the intermediate of
// 1024 tokens is 12 MB: 3000 faults), a reused one is mapped already. Each (type, slot) grows to the
// largest request its thread has seen.
template <class T, int kSlot>
T* reused_buffer(int64_t count) {
  struct Buffer {
    std::unique_ptr<T[]> data;
    int64_t size = 0;
  };
  static thread_local Buffer buffer;
  if (buffer.size < count) {
    buffer.data.reset();  // the old one first: the two need not fit at once
    buffer.data.reset(new T[count]);
    buffer.size = count;
  }
  return buffer.data.get();
}
enum BufferSlot { kIntermediate, kQuantized, kRowScales, kGathered, kAccumulator };

// Gathered rows are this many bytes longer than a row of x: at a row stride that is a multiple of
// 4 KB (H = 2048 bf16) every row of a block falls in the same L1 set, and the tile unit, which reads
// 16 rows per load, waits on the conflicts.
constexpr int64_t kRowPadBytes = 64;

// ----------------------------------------------------------------------------- products

#if KF_HAS_AMX
// c[r * ldc + j] = a[r] . B[:, j] for rows r < rows and columns j < columns (a multiple of 32) in AMX
// tiles, 32 x 32 blocks (gemm/amx_kernel.h): B packed as Product reads it, ldb words from one pair or
// group row to the next; the thread's tile state and tail buffers are the caller's.
template <class Product>
inline void tile_blocks(typename Product::C* c, int64_t ldc, int64_t rows, const typename Product::A* a, int64_t lda,
                        const uint32_t* b, int64_t ldb, int64_t k, int64_t columns, gemm::amx::Tiles& tiles,
                        gemm::amx::TailBuffers<Product>& tails) {
  for (int64_t r0 = 0; r0 < rows; r0 += gemm::amx::kBlockRows) {
    const int count = int(std::min<int64_t>(gemm::amx::kBlockRows, rows - r0));
    tiles.shape_for(count);
    for (int64_t j0 = 0; j0 < columns; j0 += gemm::amx::kBlockColumns)
      gemm::amx::block<Product>(a + r0 * lda, lda, b + j0, ldb, k, count, c + r0 * ldc + j0, ldc, tails);
  }
}
#endif

// tile[r * ldt + j] = a[r] . B[:, j] for rows r < rows and columns j < columns (a multiple of 32), B
// in bf16 pairs (gemm/micro_kernel.h's layout, ldb words from one pair to the next): in AMX tiles
// (gemm/amx_kernel.h) where this build has them, the OS granted them and the block has enough rows
// for them to pay off, else on the micro-kernels, K block by K block. The tile state lives as long as
// the object.
template <class T>
class PairProduct {
 public:
  bool tiles_for(int64_t rows) const {
#if KF_HAS_AMX
    return kTiles && tiles_permitted_ && rows >= gemm::amx::kMinRows;
#else
    return false;
#endif
  }

  void operator()(float* tile, int64_t ldt, int64_t rows, const T* a, int64_t lda, const uint32_t* b, int64_t ldb,
                  int64_t k, int64_t columns) {
#if KF_HAS_AMX
    if constexpr (kTiles) {
      if (tiles_for(rows)) {
        tile_blocks(tile, ldt, rows, a, lda, b, ldb, k, columns, tiles_, tails_);
        return;
      }
    }
#endif
    constexpr int MR = gemm::DefaultTile<T>::kMR, NR = gemm::DefaultTile<T>::kNR;
    for (int64_t r = 0; r < rows; ++r) std::fill_n(tile + r * ldt, columns, 0.0f);
    gemm::accumulate_tile<MR>(rows, k, kDepthBlock, [&](int64_t count, int64_t r0, int64_t k0, int64_t depth) {
      for (int64_t j0 = 0; j0 < columns; j0 += NR)
        gemm::micro_kernel_rows<MR, NR>(count, a + r0 * lda + k0, lda, b + k0 / 2 * ldb + j0, ldb, depth,
                                        tile + r0 * ldt + j0, ldt);
    });
  }

 private:
#if KF_HAS_AMX
  static constexpr bool kTiles = std::is_same_v<T, bf16> && gemm::DefaultTile<T>::kNR == gemm::amx::kBlockColumns;
  bool tiles_permitted_ = kTiles && gemm::amx::tiles_permitted();
  gemm::amx::Tiles tiles_;
  gemm::amx::TailBuffers<gemm::amx::Bf16Product> tails_;
#endif
};

// bf16 weights: tile[rows x NR] = a[rows x k] . the packed columns, a in the activations' type.
template <class T>
class Bf16Weights {
 public:
  using A = T;
  static constexpr int kMR = gemm::DefaultTile<T>::kMR, kNR = gemm::DefaultTile<T>::kNR;
  static constexpr bool kQuantized = false;

  void operator()(float* tile, int64_t rows, const A* a, int64_t lda, const float*, const PackedExperts& w,
                  int64_t expert, int64_t part, int64_t n0) {
    product_(tile, kNR, rows, a, lda, w.column(expert, part, n0), w.panel_width, w.k, kNR);
  }

 private:
  PairProduct<T> product_;
};

// int8 weights (w8a8): a is uint8 (int8 + 128) with per-row scales; the exact int32 product less the
// compensation, times the row's and the column's scales, into the fp32 tile.
class Int8Weights {
 public:
  using A = uint8_t;
  static constexpr int kMR = gemm::int8::DefaultTile::kMR, kNR = gemm::int8::DefaultTile::kNR;
  static constexpr bool kQuantized = true;

  void operator()(float* tile, int64_t rows, const A* a, int64_t lda, const float* a_scale, const PackedExperts& w,
                  int64_t expert, int64_t part, int64_t n0) {
    accumulate(rows, a, lda, w.column(expert, part, n0), w.panel_width, w.k);
    const int64_t column0 = w.part_index(expert, part) * w.part_columns() + n0;
    const int32_t* compensation = w.compensation + column0;
    const float* scale = w.scale + column0;
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < kNR; ++j)
        tile[r * kNR + j] = float(sums_[r * kNR + j] - compensation[j]) * a_scale[r] * scale[j];
  }

 private:
  void accumulate(int64_t rows, const A* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k) {
#if KF_HAS_AMX
    if constexpr (kNR % gemm::amx::kBlockColumns == 0) {
      if (tiles_permitted_ && rows >= gemm::amx::kMinRows) {
        tile_blocks(sums_, kNR, rows, a, lda, b, ldb, k, kNR, tiles_, tails_);
        return;
      }
    }
#endif
    std::fill_n(sums_, rows * kNR, 0);
    gemm::accumulate_tile<kMR>(
        rows, k, gemm::int8::kDepthBlock, [&](int64_t count, int64_t r0, int64_t k0, int64_t depth) {
          gemm::int8::micro_kernel_rows<kMR, kNR>(count, a + r0 * lda + k0, lda, b + k0 / gemm::int8::kGroup * ldb, ldb,
                                                  depth, sums_ + r0 * kNR, kNR);
        });
  }

  alignas(64) int32_t sums_[kRowBlock * kNR];  // one row block's int32 sums
#if KF_HAS_AMX
  bool tiles_permitted_ = gemm::amx::tiles_permitted();
  gemm::amx::Tiles tiles_;
  gemm::amx::TailBuffers<gemm::amx::U8S8Product> tails_;
#endif
};

// fp8 e4m3 weights with block scales (w8a16, DeepSeek-V3's checkpoints), each K block's sums times
// its columns' block scales added into the fp32 tile, two ways to the same sums (gemm/fp8_kernel.h):
// * few rows (decode): converted in registers where they are used, each weight byte read once per
//   row block: half bf16's traffic;
// * from kConvertFromRows rows on (or kMinRows where AMX tiles multiply), each K block of the task's
//   columns converted once to bf16 pairs, then multiplied as bf16 weights are (PairProduct), since
//   converting per use would cost more than the multiply.
template <class T>
class Fp8Weights {
 public:
  using A = T;
  static constexpr int kMR = gemm::fp8::DefaultTile::kMR, kNR = gemm::fp8::DefaultTile::kNR;
  static constexpr bool kQuantized = false;
  static constexpr int64_t kConvertFromRows = 32;  // the vector tiers: 4 x 64 in registers costs ~1.3x bf16

  void operator()(float* tile, int64_t rows, const A* a, int64_t lda, const float*, const PackedExperts& w,
                  int64_t expert, int64_t part, int64_t n0) {
    const int64_t k = w.k, width = w.panel_width, part_n = w.n / w.parts;
    const auto* part_bytes =
        reinterpret_cast<const fp8_e4m3*>(w.words) + w.part_index(expert, part) * w.part_columns() * k;
    const fp8_e4m3* b = part_bytes + (n0 / width) * k * width + n0 % width;  // K rows of `width` bytes
    const int64_t k_blocks = (k + w.block_k - 1) / w.block_k, n_blocks = (w.n + w.block_n - 1) / w.block_n;
    // The columns' rows of the whole [n, k] weight, which the block scales are indexed by.
    gemm::fp8::ColumnScales<kNR> scales(w.scale + expert * n_blocks * k_blocks, w.block_n, k_blocks, part * part_n + n0,
                                        std::min<int64_t>(kNR, part_n - n0));
    std::fill_n(tile, rows * kNR, 0.0f);
    if (rows >= (product_.tiles_for(rows) ? 1 : kConvertFromRows)) {
      converting(tile, rows, a, lda, b, width, k, w.block_k, scales);
      return;
    }
    const float* block_scale = nullptr;
    int64_t block = -1;
    gemm::accumulate_tile<kMR>(rows, k, w.block_k, [&](int64_t count, int64_t r0, int64_t k0, int64_t depth) {
      if (k0 / w.block_k != block) block_scale = scales.of_block(block = k0 / w.block_k);
      gemm::fp8::micro_kernel_rows<kMR, kNR>(count, a + r0 * lda + k0, lda, b + k0 * width, width, block_scale, depth,
                                             tile + r0 * kNR, kNR);
    });
  }

 private:
  void converting(float* tile, int64_t rows, const A* a, int64_t lda, const fp8_e4m3* b, int64_t width, int64_t k,
                  int64_t block_k, gemm::fp8::ColumnScales<kNR>& scales) {
    const int64_t pair_rows = (block_k + 1) / 2;
    if (int64_t(pairs_.size()) < pair_rows * kNR) pairs_.resize(size_t(pair_rows * kNR));
    for (int64_t k0 = 0; k0 < k; k0 += block_k) {
      const int64_t depth = std::min(block_k, k - k0);
      gemm::fp8::convert_to_pairs<kNR>(b + k0 * width, width, depth, pairs_.data());
      product_(block_tile_, kNR, rows, a + k0, lda, pairs_.data(), kNR, depth, kNR);
      gemm::fp8::add_scaled_rows<kNR>(tile, block_tile_, scales.of_block(k0 / block_k), rows);
    }
  }

  PairProduct<T> product_;
  std::vector<uint32_t> pairs_;  // one K block of the task's columns as bf16 pairs
  alignas(64) float block_tile_[kRowBlock * kNR];
};

// ----------------------------------------------------------------------------- routing plan

// The routed (token, slot) pairs grouped by expert: expert e's rows are [begin[e], begin[e + 1]),
// in token order; row r is token[r]'s pair of weight weight[r].
struct ExpertRows {
  std::vector<int64_t> begin;
  std::vector<int32_t> token;
  std::vector<float> weight;
  std::vector<int32_t> active;  // the experts with rows, in order
};

// Groups ids [tokens x k] (weights alongside) by expert. Returns the index of the first id outside
// [0, experts), or -1.
inline int64_t group_by_expert(const int32_t* ids, const float* weights, int64_t tokens, int64_t k, int64_t experts,
                               ExpertRows& rows) {
  const int64_t pairs = tokens * k;
  rows.begin.assign(experts + 1, 0);
  rows.active.clear();
  for (int64_t i = 0; i < pairs; ++i) {
    if (ids[i] < 0 || ids[i] >= experts) return i;
    ++rows.begin[ids[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) {
    if (rows.begin[e + 1] > 0) rows.active.push_back(int32_t(e));
    rows.begin[e + 1] += rows.begin[e];
  }
  rows.token.resize(pairs);
  rows.weight.resize(pairs);
  std::vector<int64_t> next(rows.begin.begin(), rows.begin.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) {  // stable: tokens in order within each expert
    const int64_t r = next[ids[i]]++;
    rows.token[r] = int32_t(i / k);
    rows.weight[r] = weights[i];
  }
  return -1;
}

// ----------------------------------------------------------------------------- the passes

// Rows of A the way a Product reads them: `a` lda elements apart, with per-row scales where quantized.
template <class A>
struct Rows {
  const A* a;
  int64_t lda;
  const float* scale;  // null unless quantized
};

// Pass 2: act[r, :] = silu(x[token[r]] . W1g^T) * (x[token[r]] . W1u^T) for every sorted row r.
template <class Product, class T>
void gate_up_pass(T* act, Rows<typename Product::A> x, int64_t hidden, int64_t inter, const PackedExperts& w1,
                  const ExpertRows& rows, int64_t num_threads) {
  using A = typename Product::A;
  constexpr int kNR = Product::kNR;
  struct RowBlock {
    int32_t expert;
    int64_t row0, rows;
  };
  std::vector<RowBlock> blocks;
  for (const int32_t e : rows.active)
    for (int64_t r = rows.begin[e]; r < rows.begin[e + 1]; r += kRowBlock)
      blocks.push_back({e, r, std::min(kRowBlock, rows.begin[e + 1] - r)});
  const int64_t column_blocks = (inter + kNR - 1) / kNR, tasks = int64_t(blocks.size()) * column_blocks;
  const int64_t macs = int64_t(rows.token.size()) * 2 * inter * hidden;
  const int64_t threads = useful_threads(num_threads, tasks, macs, kMinMacsPerThread);
  // the gate and up halves: parts 0 and 1, or columns [0, I) and [I, 2I) of one part
  const bool one_part = w1.parts == 1;
  parallel_blocks(tasks, threads, [&](int64_t, int64_t begin, int64_t end) {
    const int64_t lda = hidden + kRowPadBytes / int64_t(sizeof(A));
    A* a = reused_buffer<A, kGathered>(kRowBlock * lda);  // this thread's gathered rows of x
    alignas(64) float a_scale[kRowBlock];
    int64_t gathered = -1;
    alignas(64) float gate[kRowBlock * kNR], up[kRowBlock * kNR];
    std::unique_ptr<Product> product(new Product());  // its tile state and scratch, per thread
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block_index = task / column_blocks, n0 = task % column_blocks * kNR;
      const RowBlock& block = blocks[block_index];
      if (gathered != block_index) {  // consecutive tasks share a row block: gather it once
        for (int64_t r = 0; r < block.rows; ++r) {
          const int64_t token = rows.token[block.row0 + r];
          std::copy_n(x.a + token * x.lda, hidden, a + r * lda);
          if constexpr (Product::kQuantized) a_scale[r] = x.scale[token];
        }
        gathered = block_index;
      }
      (*product)(gate, block.rows, a, lda, a_scale, w1, block.expert, 0, n0);
      (*product)(up, block.rows, a, lda, a_scale, w1, block.expert, one_part ? 0 : 1, one_part ? inter + n0 : n0);
      const int64_t columns = std::min<int64_t>(kNR, inter - n0);
      for (int64_t r = 0; r < block.rows; ++r) {
        T* out = act + (block.row0 + r) * inter + n0;
        for (int64_t j = 0; j < columns; j += VecF::kWidth) {
          const VecF g = VecF::load(gate + r * kNR + j), u = VecF::load(up + r * kNR + j);
          (Silu::apply(g) * u).store(out + j, columns - j);
        }
      }
    }
  });
}

// What the down pass's sums start from: zero, or scale * values[t, :] (the shared expert adds the
// routed experts' output, scaled, in the same pass: sgl-kernel's shared_expert_cpu).
template <class T>
struct Residual {
  const T* values = nullptr;
  int64_t ld = 0;
  float scale = 0.0f;

  // acc[t - t0][0 .. NR) for tokens [t0, t1), columns [n0, n0 + columns) (the rest 0).
  void start(float* acc, int NR, int64_t t0, int64_t t1, int64_t n0, int64_t columns) const {
    std::fill_n(acc, (t1 - t0) * NR, 0.0f);
    if (values == nullptr) return;
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < columns; j += VecF::kWidth)
        (VecF::load(values + t * ld + n0 + j, columns - j) * VecF::broadcast(scale)).store(acc + (t - t0) * NR + j);
  }
};

// Pass 3: out[t, :] = sum over t's sorted rows r of weight[r] * (act[r] . W2_e^T), e the row's expert,
// plus the residual.
template <class Product, class T>
void down_pass(T* out, int64_t ldo, Rows<typename Product::A> act, int64_t tokens, int64_t hidden, int64_t inter,
               const PackedExperts& w2, const ExpertRows& rows, const Residual<T>& residual, int64_t num_threads) {
  constexpr int kNR = Product::kNR;
  const int64_t column_blocks = (hidden + kNR - 1) / kNR;
  const int64_t macs = int64_t(rows.token.size()) * inter * hidden;
  // Tokens are split too only where column blocks run short of threads: each chunk reads W2 again.
  const int64_t want = useful_threads(num_threads, column_blocks * tokens, macs, kMinMacsPerThread);
  const int64_t chunks = std::min(tokens, (2 * want + column_blocks - 1) / column_blocks);
  const int64_t chunk_tokens = (tokens + chunks - 1) / chunks;
  const int64_t tasks = column_blocks * chunks;
  parallel_blocks(tasks, std::min(want, tasks), [&](int64_t, int64_t begin, int64_t end) {
    float* acc = reused_buffer<float, kAccumulator>(chunk_tokens * kNR);
    alignas(64) float tile[kRowBlock * kNR];
    std::unique_ptr<Product> product(new Product());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task % column_blocks * kNR, t0 = task / column_blocks * chunk_tokens;
      const int64_t t1 = std::min(tokens, t0 + chunk_tokens);
      residual.start(acc, kNR, t0, t1, n0, std::min<int64_t>(kNR, hidden - n0));
      for (const int32_t e : rows.active) {
        // e's rows of tokens [t0, t1): contiguous, since each expert's rows are in token order
        const int32_t* first = rows.token.data() + rows.begin[e];
        const int32_t* last = rows.token.data() + rows.begin[e + 1];
        const int64_t lo = std::lower_bound(first, last, int32_t(t0)) - rows.token.data();
        const int64_t hi = std::lower_bound(first, last, int32_t(t1)) - rows.token.data();
        for (int64_t r0 = lo; r0 < hi; r0 += kRowBlock) {
          const int64_t count = std::min(kRowBlock, hi - r0);
          (*product)(tile, count, act.a + r0 * act.lda, act.lda, act.scale == nullptr ? nullptr : act.scale + r0, w2, e,
                     0, n0);
          for (int64_t r = 0; r < count; ++r) {
            float* sum = acc + (rows.token[r0 + r] - t0) * kNR;
            const VecF weight = VecF::broadcast(rows.weight[r0 + r]);
            for (int j = 0; j < kNR; j += VecF::kWidth)
              fma(weight, VecF::load(tile + r * kNR + j), VecF::load(sum + j)).store(sum + j);
          }
        }
      }
      gemm::store_tile<kNR>(out + t0 * ldo + n0, ldo, acc, static_cast<const float*>(nullptr), t1 - t0,
                            std::min<int64_t>(kNR, hidden - n0));
    }
  });
}

// ----------------------------------------------------------------------------- the op

enum Status : int64_t { kOk = 0 };  // else 1 + the index of the first expert id out of range

// Rows of `source` as the Product reads them: as they are, or quantized per row into q and scale.
template <class Product, class T>
Rows<typename Product::A> product_rows(const T* source, int64_t ld, int64_t rows, int64_t k, int64_t num_threads) {
  if constexpr (Product::kQuantized) {  // (the calling thread's buffers: x's, then the intermediate's)
    uint8_t* q = reused_buffer<uint8_t, kQuantized>(std::max<int64_t>(1, rows * k));
    float* scale = reused_buffer<float, kRowScales>(std::max<int64_t>(1, rows));
    gemm::int8::quantize_rows(q, k, scale, source, ld, rows, k, num_threads);
    return {q, k, scale};
  } else {
    return {source, ld, nullptr};
  }
}

template <class Product, class T>
int64_t fused_experts(T* out, int64_t ldo, const T* x, int64_t ldx, int64_t tokens, int64_t hidden, int64_t inter,
                      const PackedExperts& w1, const PackedExperts& w2, int64_t experts, const float* topk_weights,
                      const int32_t* topk_ids, int64_t k, const Residual<T>& residual, int64_t num_threads) {
  static thread_local ExpertRows rows;  // (its vectors keep their memory from call to call)
  const int64_t bad = group_by_expert(topk_ids, topk_weights, tokens, k, experts, rows);
  if (bad >= 0) return 1 + bad;
  if (tokens == 0 || hidden == 0) return kOk;
  const int64_t routed = tokens * k;
  T* act = reused_buffer<T, kIntermediate>(std::max<int64_t>(1, routed * inter));
  gate_up_pass<Product>(act, product_rows<Product>(x, ldx, tokens, hidden, num_threads), hidden, inter, w1, rows,
                        num_threads);
  down_pass<Product>(out, ldo, product_rows<Product>(act, inter, routed, inter, num_threads), tokens, hidden, inter, w2,
                     rows, residual, num_threads);
  return kOk;
}

}  // namespace kf::moe
