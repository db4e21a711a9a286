// Collectives among the ranks (processes) of one host through one shared-memory segment.
//
// The segment (mapped by every rank at its own address; laid out by SegmentLayout) holds a header,
// one RankFlags per rank, and two sets of slots, one slot of slot_bytes per rank and set. A
// collective is a sequence of calls, one per slot-sized chunk of the tensor, numbered 1, 2, ... on
// every rank alike; call n uses set n % 2:
//   1. a rank copies its chunk (what the others read of it) into its own slot, writes what it is
//      doing (Descriptor) and then `arrived` = n (a release store: the data is visible before the
//      flag);
//   2. it waits until every rank has arrived at n and checks their descriptors equal its own;
//   3. all_gather copies every slot out. all_reduce sums in rank order in fp32 (rounded once):
//      small chunks whole, by every rank from every slot; larger ones split in world parts, rank r
//      summing part r (its own elements from its chunk, the others' from their slots) into its
//      chunk and its slot, raising `reduced` = n, then copying the others' sums out of their slots
//      once all have: each element is copied in and out once (reduce_split). reduce_scatter is that
//      split's first half alone: a rank's slot holds its pieces of the other ranks' parts, and rank
//      r sums part r's pieces into its output (reduce_own_part, shared by both).
// A rank reuses a set (call n + 2) only after every rank arrived at n + 1, which each does after
// finishing call n: two sets need no further handshake. Every element's sum is computed in the same
// order (or by one rank), so the ranks' results are bitwise equal.
//
// Waits spin briefly, then yield the core (ranks may share cores), then sleep in short steps once a
// peer is late by more than kSleepAfterNs, checking the clock and whether each awaited peer process
// still exists: a dead peer or a timeout ends the wait with a status, never a hang.
#pragma once

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "kernforge/core/loops.h"
#include "kernforge/core/parallel.h"
#include "kernforge/core/vec.h"

namespace kf {
namespace comm {

constexpr uint64_t kMagic = 0x6b66636f6d6d3031ull;  // "kfcomm01"
constexpr int64_t kMaxRanks = 256;                  // ranks of one host in a group
constexpr int64_t kPage = 4096;
// all_reduce chunks up to this size are reduced whole by every rank (one wait); larger ones in parts.
constexpr int64_t kWholeReduceMaxBytes = 64 * 1024;
// Elements per thread task of a copy or a reduction: below this, one thread.
constexpr int64_t kMinElementsPerThread = 64 * 1024;

// Pause-loop iterations before a wait yields the core: long where every rank has a core of its own
// (a yield, a syscall, would add microseconds to each call), short where ranks share cores (the
// awaited rank may need this core). Measured with 2 ranks on 2 cores, all_reduce [1, 4096] bf16 p50:
// 4.0 us with 2048, 7.3 us with 256; 4 ranks on 2 cores: 120 us with 2048, 41 us with 256.
constexpr int64_t kSpinOwnCores = 2048;
constexpr int64_t kSpinSharedCores = 256;
constexpr int64_t kSleepAfterNs = 20'000'000;    // a peer this late is not on a latency-critical path
constexpr int64_t kSleepNs = 50'000;             // one sleep step then
constexpr int64_t kLivenessEveryNs = 5'000'000;  // how often a waiting rank checks its peer still exists

// What a rank does in a call: its peers check they all do the same.
struct Descriptor {
  int64_t kind;       // Kind * 16 + the reduction's element type (dtype_code; all_gather: 0)
  int64_t bytes;      // of the whole tensor
  int64_t row_bytes;  // all_gather: bytes per row of the gathered dimension; reductions: 0
};

// A reduction's element type in a Descriptor (the order of the module's dtype parameter).
template <class T>
constexpr int64_t dtype_code() {
  return std::is_same<T, fp32>::value ? 1 : std::is_same<T, bf16>::value ? 2 : 3;
}

struct Header {
  uint64_t magic;
  int64_t world;
  int64_t slot_bytes;
};

// One rank's flags: written by that rank only, read by all; `reduced` on a line of its own.
struct alignas(64) RankFlags {
  uint64_t arrived;              // the last call whose data this rank has put in its slot
  int64_t pid;                   // its process, for liveness checks (0: not checked)
  Descriptor desc[2];            // per set: the call in flight, as `arrived` says
  alignas(64) uint64_t reduced;  // the last call whose part this rank has reduced
};

struct SegmentLayout {
  int64_t world, slot_bytes;

  static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
  int64_t flags_offset() const { return kPage; }
  int64_t slots_offset() const { return kPage + round_up(world * int64_t(sizeof(RankFlags)), kPage); }
  int64_t total_bytes() const { return slots_offset() + 2 * world * slot_bytes; }
};

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Whether process `pid` still runs: its /proc entry exists and it is not a zombie (a killed child
// its parent has not reaped yet).
inline bool process_alive(int64_t pid) {
  if (pid <= 0) return true;  // not checked
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char line[512];
  const size_t n = std::fread(line, 1, sizeof(line) - 1, f);
  std::fclose(f);
  line[n] = '\0';
  const char* end_of_name = std::strrchr(line, ')');  // the state follows "pid (comm) "
  return end_of_name == nullptr || end_of_name[1] == '\0' || (end_of_name[2] != 'Z' && end_of_name[2] != 'X');
}

// Status (why a collective ended: kOk, kTimeout, kPeerExited, kMismatch) and Kind (kAllReduce,
// kAllGather, kReduceScatter) are the module's declared codes (kernforge/distributed/_kernels.py).
// Details of a failure go to a Report.
struct Report {
  int64_t peer;  // the rank that timed out, exited or disagreed
  Descriptor theirs;
};

class Group {
 public:
  Group(void* base, int64_t world, int64_t rank, int64_t timeout_ns, bool shared_cores, int64_t num_threads)
      : base_(static_cast<uint8_t*>(base)),
        header_(reinterpret_cast<Header*>(base)),
        layout_{header_->world, header_->slot_bytes},
        world_(world),
        rank_(rank),
        timeout_ns_(timeout_ns),
        spin_(shared_cores ? kSpinSharedCores : kSpinOwnCores),
        num_threads_(num_threads) {}

  int64_t slot_bytes() const { return layout_.slot_bytes; }
  RankFlags& flags(int64_t rank) const { return reinterpret_cast<RankFlags*>(base_ + layout_.flags_offset())[rank]; }

  // In place: data[i] = the sum over ranks of data[i], for count elements.
  template <class T>
  Status all_reduce(T* data, int64_t count, Report* report) const {
    constexpr int64_t kSize = sizeof(T);
    const int64_t per_call = slot_bytes() / kSize;
    const Descriptor desc{int64_t(Kind::kAllReduce) * 16 + dtype_code<T>(), count * kSize, 0};
    for (int64_t offset = 0; offset < count; offset += per_call) {
      const int64_t n = std::min(per_call, count - offset);
      const Status status = n * kSize <= kWholeReduceMaxBytes ? reduce_whole(data + offset, n, desc, report)
                                                              : reduce_split(data + offset, n, desc, report);
      if (status != Status::kOk) return status;
    }
    return Status::kOk;
  }

  // out[o, r, :] = rank r's src[o, :] for `rows` rows of row_bytes bytes: the gather along a
  // dimension, the dimensions before it being the rows (dim 0: one row).
  Status all_gather(const uint8_t* src, int64_t rows, int64_t row_bytes, uint8_t* out, Report* report) const {
    const int64_t total = rows * row_bytes;
    const Descriptor desc{int64_t(Kind::kAllGather) * 16, total, row_bytes};
    for (int64_t offset = 0; offset < total; offset += slot_bytes()) {
      const int64_t n = std::min(slot_bytes(), total - offset);
      const uint64_t call = arrive(src + offset, n, desc);
      const Status status = wait_all<&RankFlags::arrived>(call, &desc, report);
      if (status != Status::kOk) return status;
      parallel_for(world_, threads_for(world_, n * world_ / 4), [&](int64_t r) {
        const uint8_t* from = slot(call, r);
        for (int64_t p = offset; p < offset + n;) {  // row by row: out's rows interleave the ranks
          const int64_t row = p / row_bytes, column = p % row_bytes;
          const int64_t length = std::min(row_bytes - column, offset + n - p);
          std::memcpy(out + (row * world_ + r) * row_bytes + column, from + (p - offset), length);
          p += length;
        }
      });
    }
    return Status::kOk;
  }

  // out[i] = the sum over ranks of their data[rank_ * n + i], for i < n: data holds world parts
  // of n elements and rank r gets the sum of part r (torch.distributed.reduce_scatter_tensor). A
  // call takes a piece of every part at the same offset: one wait per call.
  template <class T>
  Status reduce_scatter(const T* data, int64_t n, T* out, Report* report) const {
    const int64_t per_call = piece_elements<T>();
    const Descriptor desc{int64_t(Kind::kReduceScatter) * 16 + dtype_code<T>(), world_ * n * int64_t(sizeof(T)), 0};
    for (int64_t offset = 0; offset < n; offset += per_call) {
      const int64_t m = std::min(per_call, n - offset);
      const auto piece = [&](int64_t r) { return Piece<T>{data + r * n + offset, r * m, (r + 1) * m}; };
      const Status status = reduce_own_part<T>(next_call(), piece, desc, out + offset, nullptr, report);
      if (status != Status::kOk) return status;
    }
    return Status::kOk;
  }

 private:
  // A rank's elements of part r of a reduction, and where they lie in its slot.
  template <class T>
  struct Piece {
    const T* from;
    int64_t begin, end;  // in the slot, in elements
  };

  uint8_t* slot(uint64_t call, int64_t rank) const {
    return base_ + layout_.slots_offset() + (int64_t(call % 2) * world_ + rank) * layout_.slot_bytes;
  }

  // The next call's number: one more than this rank's last.
  uint64_t next_call() const { return flags(rank_).arrived + 1; }

  // Tells the other ranks this rank's data for `call` is in its slot.
  void announce(uint64_t call, const Descriptor& desc) const {
    RankFlags& mine = flags(rank_);
    mine.desc[call % 2] = desc;
    store_release(&mine.arrived, call);
  }

  // Starts the next call: this rank's chunk of `bytes` is copied into its slot and announced.
  uint64_t arrive(const void* chunk, int64_t bytes, const Descriptor& desc) const {
    const uint64_t call = next_call();
    copy(slot(call, rank_), chunk, bytes);
    announce(call, desc);
    return call;
  }

  // A small chunk: every rank sums all of it from every rank's slot (one wait).
  template <class T>
  Status reduce_whole(T* chunk, int64_t n, const Descriptor& desc, Report* report) const {
    const uint64_t call = arrive(chunk, n * int64_t(sizeof(T)), desc);
    const Status status = wait_all<&RankFlags::arrived>(call, &desc, report);
    if (status == Status::kOk) reduce<T>(call, 0, n, chunk, chunk, nullptr);
    return status;
  }

  // A large chunk, reduce-scatter then all-gather: rank r sums part r, from its own chunk and the
  // others' slots, into its chunk and its slot; then every rank copies the others' parts from their
  // slots. A rank's slot needs only the parts the others sum (its own part's room takes the sum),
  // so each element is copied in once and out once.
  template <class T>
  Status reduce_split(T* chunk, int64_t n, const Descriptor& desc, Report* report) const {
    const uint64_t call = next_call();
    const auto piece = [&](int64_t r) {
      const Part p = part<T>(n, r);
      return Piece<T>{chunk + p.begin, p.begin, p.end};
    };
    const Piece<T> mine = piece(rank_);
    T* sum_in_slot = reinterpret_cast<T*>(slot(call, rank_)) + mine.begin;
    Status status = reduce_own_part<T>(call, piece, desc, chunk + mine.begin, sum_in_slot, report);
    if (status != Status::kOk) return status;
    store_release(&flags(rank_).reduced, call);
    status = wait_all<&RankFlags::reduced>(call, nullptr, report);
    if (status != Status::kOk) return status;
    for (int64_t r = 0; r < world_; ++r) {
      const Piece<T> p = piece(r);
      if (r != rank_) copy(chunk + p.begin, reinterpret_cast<const T*>(slot(call, r)) + p.begin, bytes_of(p));
    }
    return Status::kOk;
  }

  // The reduce-scatter step of reduce_split and reduce_scatter: this rank's pieces of the others'
  // parts (piece(r), r != rank_) go into its slot, announced; once every rank's are there, it sums
  // its own part, its elements from memory and the others' from their slots, into `out` (and
  // `also_to`, if given).
  template <class T, class Pieces>
  Status reduce_own_part(uint64_t call, const Pieces& piece, const Descriptor& desc, T* out, T* also_to,
                         Report* report) const {
    T* my_slot = reinterpret_cast<T*>(slot(call, rank_));
    for (int64_t r = 0; r < world_; ++r) {
      const Piece<T> p = piece(r);
      if (r != rank_) copy(my_slot + p.begin, p.from, bytes_of(p));
    }
    announce(call, desc);
    const Status status = wait_all<&RankFlags::arrived>(call, &desc, report);
    if (status != Status::kOk) return status;
    const Piece<T> mine = piece(rank_);
    // reduce reads element j of this rank's at own + j, as of the others' at slot + j
    reduce(call, mine.begin, mine.end, mine.from - mine.begin, out, also_to);
    return Status::kOk;
  }

  template <class T>
  static int64_t bytes_of(const Piece<T>& p) {
    return (p.end - p.begin) * int64_t(sizeof(T));
  }

  // Elements of one piece of a reduce_scatter call: the slot holds world of them, each whole cache
  // lines where the slot allows (slot_bytes is a multiple of 4096, world any number up to 256).
  template <class T>
  int64_t piece_elements() const {
    int64_t bytes = slot_bytes() / world_;
    if (bytes >= 64) bytes -= bytes % 64;
    return bytes / int64_t(sizeof(T));
  }

  // Waits until every rank's flag (arrived or reduced) reaches `call`; with `expected`, checks the
  // ranks' descriptors of that call equal it.
  template <uint64_t RankFlags::* kFlag>
  Status wait_all(uint64_t call, const Descriptor* expected, Report* report) const {
    for (int64_t r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      const Status status = wait_for(r, kFlag, call, report);
      if (status != Status::kOk) return status;
      if (expected != nullptr) {
        const Descriptor& theirs = flags(r).desc[call % 2];
        if (std::memcmp(&theirs, expected, sizeof(Descriptor)) != 0) {
          *report = {r, theirs};
          return Status::kMismatch;
        }
      }
    }
    return Status::kOk;
  }

  // dst = src, with the threads the size is worth.
  void copy(void* dst, const void* src, int64_t bytes) const {
    const int64_t block = kMinElementsPerThread * 4;
    const int64_t blocks = (bytes + block - 1) / block;
    parallel_for(blocks, threads_for(blocks, bytes / 4), [&](int64_t b) {
      const int64_t begin = b * block, n = std::min(block, bytes - begin);
      std::memcpy(static_cast<uint8_t*>(dst) + begin, static_cast<const uint8_t*>(src) + begin, n);
    });
  }

  // out[i - begin] (and also_to[i - begin], if given) = the sum over ranks r, in rank order, of
  // rank r's element i: this rank's from `own`, the others' from their slots; fp32 sums, rounded
  // once.
  template <class T>
  void reduce(uint64_t call, int64_t begin, int64_t end, const T* own, T* out, T* also_to) const {
    const T* sources[kMaxRanks];
    for (int64_t r = 0; r < world_; ++r) sources[r] = r == rank_ ? own : reinterpret_cast<const T*>(slot(call, r));
    const int64_t n = end - begin, block = kMinElementsPerThread;
    const int64_t blocks = (n + block - 1) / block;
    parallel_for(blocks, threads_for(blocks, n), [&](int64_t b) {
      const int64_t lo = begin + b * block, hi = std::min(end, lo + block);
      for_each_vector(lo, hi, [&](int, int64_t j, int64_t count) {
        VecF sum = VecF::load(sources[0] + j, count);
        for (int64_t r = 1; r < world_; ++r) sum += VecF::load(sources[r] + j, count);
        sum.store(out + (j - begin), count);
        if (also_to != nullptr) sum.store(also_to + (j - begin), count);
      });
    });
  }

  struct Part {
    int64_t begin, end;
  };
  // Rank r's part of a chunk of n elements split in world parts of whole cache lines.
  template <class T>
  Part part(int64_t n, int64_t r) const {
    const int64_t line = 64 / int64_t(sizeof(T));
    const int64_t size = (n + world_ * line - 1) / (world_ * line) * line;
    const int64_t begin = std::min(n, r * size);
    return {begin, std::min(n, begin + size)};
  }

  int64_t threads_for(int64_t tasks, int64_t elements) const {
    return useful_threads(num_threads_, tasks, elements, kMinElementsPerThread);
  }

  Status wait_for(int64_t peer, uint64_t RankFlags::* flag, uint64_t call, Report* report) const {
    const uint64_t* value = &(flags(peer).*flag);
    for (int64_t spin = 0; spin < spin_; ++spin) {
      if (load_acquire(value) >= call) return Status::kOk;
      cpu_relax();
    }
    const int64_t start = now_ns();
    int64_t next_liveness = start + kLivenessEveryNs;
    while (load_acquire(value) < call) {
      const int64_t now = now_ns();
      if (now - start > timeout_ns_) return failed(peer, Status::kTimeout, report);
      if (now >= next_liveness) {
        if (!process_alive(flags(peer).pid)) return failed(peer, Status::kPeerExited, report);
        next_liveness = now + kLivenessEveryNs;
      }
      if (now - start < kSleepAfterNs) {
        sched_yield();
      } else {
        const timespec step{0, kSleepNs};
        nanosleep(&step, nullptr);
      }
    }
    return Status::kOk;
  }

  static Status failed(int64_t peer, Status status, Report* report) {
    *report = {peer, {}};
    return status;
  }

  uint8_t* base_;
  Header* header_;
  SegmentLayout layout_;
  int64_t world_, rank_, timeout_ns_, spin_, num_threads_;
};

// Maps this rank into a segment: a fresh (zero-filled) one gets its header first (create); then the
// header must describe this group, and the rank's pid (0: not checked) is published for its peers'
// liveness checks.
inline Status attach(void* base, int64_t world, int64_t rank, int64_t slot_bytes, int64_t pid, bool create) {
  Header* header = static_cast<Header*>(base);
  if (create) *header = {kMagic, world, slot_bytes};
  if (header->magic != kMagic || header->world != world || header->slot_bytes != slot_bytes || rank < 0 ||
      rank >= world || world > kMaxRanks) {
    return Status::kBadSegment;
  }
  const Group group(base, world, rank, 0, false, 1);
  group.flags(rank).pid = pid;
  return Status::kOk;
}

}  // namespace comm
}  // namespace kf
