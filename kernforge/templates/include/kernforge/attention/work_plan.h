// The decode attention planner: cuts a batch's KV work into one near-equal list per thread.
//
// A unit of work is one request's KV heads [kv_head, kv_head + num_heads) against the request's
// visible KV tokens; it holds all the request's KV heads unless there are fewer requests than
// threads. Kernels walk a unit token block by token block, every head of the unit per block: in
// the NHD layout a token's heads are one contiguous row, so pages are read sequentially and each
// 4 KB memory page is translated once for all heads, not once per head. A unit's cost is
// num_heads * (its token count plus a fixed overhead for loading q and writing the output). The planner walks the
// units in order and closes a thread's list where the running cost crosses that thread's share of
// the total, splitting the unit that straddles the boundary along its KV tokens (if both pieces
// are worth a thread's time). The pieces of a split unit write partial states (output and LSE) to
// workspace slots, which a second phase merges. A batch mixing 16-token and 16K-token requests
// thus keeps every thread busy for the same time, and a batch of one long request uses them all.
//
// The plan lives in one int32 buffer (PlanLayout), written once per batch on the host and read by
// every layer's run(). It serves decode (decode.h), one query token per request; MLA decode will
// use it too. Prefill does not: its items are query tiles against key ranges, planned by
// plan_prefill in prefill.h.
#pragma once

#include <algorithm>
#include <cstdint>

namespace kf {
namespace attention {

// KV tokens [begin, end) of one request's KV heads [kv_head, kv_head + num_heads); slot >= 0: a
// piece of a split unit, whose partial state goes to workspace slot `slot`; slot < 0: the whole
// unit, written to the output.
struct WorkItem {
  int32_t request, kv_head, num_heads, begin, end, slot;
};
// The pieces of one split unit: slots [first_slot, first_slot + num_slots), merged into the output.
struct MergeItem {
  int32_t request, kv_head, num_heads, first_slot, num_slots;
};

// Declared once in Python with the module (kernforge/ops/attention/decode.py) and emitted ahead of
// this header by the template's prelude, so the two sides cannot disagree:
// * PlanError: plan errors, returned as (code << 32) | index, checked before anything is planned
//   (kIndptrStart, kIndptrDecreasing, kIndptrBeyond, kLastPageLen, kNegativePage; kCapacity: the
//   plan buffer is too small, a bug in the caller's sizing);
// * PlanHeader: the int32 slots of the plan buffer's header and its size;
// * PlanInts: int32s per WorkItem and per MergeItem.
inline int64_t plan_error(PlanError code, int64_t index) { return (int64_t(code) << 32) | index; }
static_assert(sizeof(WorkItem) == PlanInts::kItemInts * sizeof(int32_t), "WorkItem as declared in decode.py");
static_assert(sizeof(MergeItem) == PlanInts::kMergeInts * sizeof(int32_t), "MergeItem as declared in decode.py");

// int32 buffer: header, then list offsets (num_lists + 1), work items, merge items.
struct PlanLayout {
  static constexpr int64_t kHeaderSize = PlanHeader::kHeaderSize;
  static constexpr int64_t kItemInts = PlanInts::kItemInts;
  static constexpr int64_t kMergeInts = PlanInts::kMergeInts;

  // Each list boundary splits at most one unit: at most units + lists - 1 items and lists - 1 merges.
  static int64_t capacity(int64_t units, int64_t lists) {
    return kHeaderSize + (lists + 1) + kItemInts * (units + lists) + kMergeInts * lists;
  }
};

// Read access to a finished plan.
struct PlanView {
  const int32_t* base;
  int64_t units;  // the buffer was laid out for batch * num_kv_heads units

  int64_t num_lists() const { return base[PlanHeader::kNumLists]; }
  int64_t num_merges() const { return base[PlanHeader::kNumMerges]; }
  int64_t num_slots() const { return base[PlanHeader::kNumSlots]; }
  int64_t heads_per_unit() const { return base[PlanHeader::kHeadsPerUnit]; }
  const int32_t* list_offsets() const { return base + PlanLayout::kHeaderSize; }
  const WorkItem* items() const { return reinterpret_cast<const WorkItem*>(list_offsets() + num_lists() + 1); }
  const MergeItem* merges() const { return reinterpret_cast<const MergeItem*>(items() + units + num_lists()); }
};

struct PlanInput {
  const int32_t* indptr;         // [batch + 1] pages of request b: indices[indptr[b] .. indptr[b + 1])
  const int32_t* last_page_len;  // [batch]
  const int32_t* indices;        // [num_indices]
  int64_t batch, num_indices, page_size, num_kv_heads;
  int64_t window_left;    // < 0: no window; else keys at positions >= kv_len - 1 - window_left
  int64_t num_lists;      // threads to plan for
  int64_t unit_overhead;  // a unit's fixed cost, in KV tokens
  int64_t min_split;      // smallest piece worth splitting off, in KV tokens
};

// KV length of request b (validated input).
inline int64_t kv_length(const PlanInput& in, int64_t b) {
  const int64_t pages = in.indptr[b + 1] - in.indptr[b];
  return pages == 0 ? 0 : (pages - 1) * in.page_size + in.last_page_len[b];
}

// The visible KV tokens [first, kv_len) of request b for a decode query at position kv_len - 1.
inline int64_t first_visible(const PlanInput& in, int64_t kv_len) {
  return in.window_left < 0 ? 0 : std::max<int64_t>(0, kv_len - 1 - in.window_left);
}

inline int64_t validate(const PlanInput& in, int32_t* max_page) {
  if (in.indptr[0] != 0) return plan_error(kIndptrStart, 0);
  for (int64_t b = 0; b < in.batch; ++b) {
    if (in.indptr[b + 1] < in.indptr[b]) return plan_error(kIndptrDecreasing, b);
    const bool empty = in.indptr[b + 1] == in.indptr[b];
    if (!empty && (in.last_page_len[b] < 1 || in.last_page_len[b] > in.page_size)) {
      return plan_error(kLastPageLen, b);
    }
  }
  if (in.indptr[in.batch] > in.num_indices) return plan_error(kIndptrBeyond, in.batch);
  int32_t top = -1;
  for (int64_t i = 0; i < in.indptr[in.batch]; ++i) {
    if (in.indices[i] < 0) return plan_error(kNegativePage, i);
    top = std::max(top, in.indices[i]);
  }
  *max_page = top;
  return kPlanOk;
}

// KV heads per unit: all of them, so that a thread reads whole token rows (NHD) and whole pages.
// Only when there are fewer requests than lists and they are short (under kShortUnit tokens a
// list) are a request's heads divided, in the fewest parts that give every list a unit: a short
// request then needs no split along its KV and no merge.
constexpr int64_t kShortUnit = 1024;

inline int64_t heads_per_unit(const PlanInput& in, int64_t visible_tokens) {
  if (in.batch >= in.num_lists || visible_tokens >= kShortUnit * in.num_lists) return in.num_kv_heads;
  int64_t parts = 1;
  while (in.batch * parts < in.num_lists && parts < in.num_kv_heads) {
    do ++parts;
    while (in.num_kv_heads % parts);
  }
  return in.num_kv_heads / parts;
}

// Writes items list by list; tracks the running cost against the list boundaries.
class PlanWriter {
 public:
  PlanWriter(int32_t* base, int64_t units, int64_t num_lists, int64_t total_cost)
      : base_(base), units_(units), num_lists_(num_lists), total_cost_(total_cost) {
    offsets()[0] = 0;
  }

  int64_t room() const { return boundary(list_) - consumed_; }
  bool last_list() const { return list_ == num_lists_ - 1; }

  void emit(const WorkItem& item, int64_t cost) {
    items()[num_items_++] = item;
    consumed_ += cost;
  }
  void next_list() { offsets()[++list_] = int32_t(num_items_); }
  int32_t new_slot() { return num_slots_++; }
  void merge(const MergeItem& item) { merges()[num_merges_++] = item; }

  void finish(int32_t max_page, int64_t heads_per_unit) {
    while (list_ < num_lists_) next_list();  // trailing lists stay empty
    base_[PlanHeader::kNumLists] = int32_t(num_lists_);
    base_[PlanHeader::kNumItems] = int32_t(num_items_);
    base_[PlanHeader::kNumMerges] = int32_t(num_merges_);
    base_[PlanHeader::kNumSlots] = int32_t(num_slots_);
    base_[PlanHeader::kMaxPage] = max_page;
    base_[PlanHeader::kHeadsPerUnit] = int32_t(heads_per_unit);
  }

 private:
  int64_t boundary(int64_t list) const { return (list + 1) * total_cost_ / num_lists_; }
  int32_t* offsets() { return base_ + PlanLayout::kHeaderSize; }
  WorkItem* items() { return reinterpret_cast<WorkItem*>(offsets() + num_lists_ + 1); }
  MergeItem* merges() { return reinterpret_cast<MergeItem*>(items() + units_ + num_lists_); }

  int32_t* base_;
  int64_t units_, num_lists_, total_cost_;
  int64_t list_ = 0, consumed_ = 0, num_items_ = 0, num_merges_ = 0;
  int32_t num_slots_ = 0;
};

// Places the tokens [begin, end) of one unit, splitting it across list boundaries where worth it.
inline void place_unit(PlanWriter& w, const PlanInput& in, int32_t b, int32_t h, int32_t heads, int64_t begin,
                       int64_t end) {
  int32_t first_slot = -1, pieces = 0;
  int64_t pos = begin;
  const auto piece = [&](int64_t from, int64_t to, int32_t slot) {
    w.emit(WorkItem{b, h, heads, int32_t(from), int32_t(to), slot}, heads * (to - from + in.unit_overhead));
  };
  for (;;) {
    const int64_t rest = end - pos, rest_cost = heads * (rest + in.unit_overhead), room = w.room();
    const int64_t take = room / heads - in.unit_overhead;  // tokens of this unit the current list can take
    if (rest_cost <= room || w.last_list()) {
      piece(pos, end, pieces ? w.new_slot() : -1);
      break;
    }
    if (take >= in.min_split && rest - take >= in.min_split) {  // split at the boundary
      const int32_t slot = w.new_slot();
      if (pieces++ == 0) first_slot = slot;
      piece(pos, pos + take, slot);
      pos += take;
      w.next_list();
      continue;
    }
    if (2 * room >= rest_cost) {  // most of it fits: overfill this list (the next one gets less)
      piece(pos, end, pieces ? w.new_slot() : -1);
      break;
    }
    w.next_list();  // most of it does not: start it in the next list
  }
  if (pieces) w.merge(MergeItem{b, h, heads, first_slot, pieces + 1});
}

// Validates the page table and writes the plan. Returns 0 or a PlanError code. The buffer is laid
// out for units = batch * num_kv_heads (PlanLayout::capacity), whatever the heads per unit.
inline int64_t plan_decode(const PlanInput& in, int32_t* plan, int64_t capacity) {
  const int64_t units = in.batch * in.num_kv_heads;
  if (capacity < PlanLayout::capacity(units, in.num_lists)) return plan_error(kCapacity, 0);
  int32_t max_page = -1;
  if (const int64_t error = validate(in, &max_page)) return error;

  int64_t visible_tokens = 0;
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t kv_len = kv_length(in, b);
    visible_tokens += kv_len - first_visible(in, kv_len);
  }
  const int64_t heads = heads_per_unit(in, visible_tokens);
  const int64_t total_cost = in.num_kv_heads * (visible_tokens + in.batch * in.unit_overhead);
  PlanWriter writer(plan, units, in.num_lists, std::max<int64_t>(total_cost, 1));
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t kv_len = kv_length(in, b), first = first_visible(in, kv_len);
    for (int64_t h = 0; h < in.num_kv_heads; h += heads) {
      place_unit(writer, in, int32_t(b), int32_t(h), int32_t(heads), first, kv_len);
    }
  }
  writer.finish(max_page, heads);
  return kPlanOk;
}

}  // namespace attention
}  // namespace kf
