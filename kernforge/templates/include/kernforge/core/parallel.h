// Thread parallelism for every kernel: how many threads a job is worth (useful_threads), one
// contiguous block of tasks per thread (parallel_blocks, for per-thread setup such as an AMX tile
// config), and a loop over tasks (parallel_for) scheduled statically or dynamically. Each runs on
// the calling thread, without touching OpenMP, when it gets one thread: a fork/join costs ~1 us.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kf {

// Threads worth using: at most `requested` (<= 0 means OpenMP's default), at most one per task,
// and at most one per `min_elements_per_thread` elements of work. An OpenMP fork/join costs ~1 us
// here, so small jobs must stay on the calling thread; each kernel measures its own break-even.
inline int64_t useful_threads(int64_t requested, int64_t num_tasks, int64_t total_elements,
                              int64_t min_elements_per_thread) {
#if defined(_OPENMP)
  if (requested <= 0) requested = omp_get_max_threads();
#else
  requested = 1;
#endif
  const int64_t by_work = std::max<int64_t>(1, total_elements / min_elements_per_thread);
  return std::min({requested, num_tasks, by_work});
}

// Runs body(thread, begin, end) once per thread of a parallel region of up to num_threads threads
// (never more than num_tasks), where [begin, end) is that thread's one contiguous block of
// [0, num_tasks): blocks differ in size by at most one task, the larger ones first (OpenMP's
// schedule(static) split). `thread` numbers the blocks 0, 1, ... in task order. Setup placed in the
// body before the task loop thus runs once per thread, not once per task. Threads that would get
// no task are not started; with one thread the body runs inline as body(0, 0, num_tasks).
template <class Body>
inline void parallel_blocks(int64_t num_tasks, int64_t num_threads, const Body& body) {
  if (num_tasks <= 0) return;
  num_threads = std::min(num_threads, num_tasks);
#if defined(_OPENMP)
  if (num_threads > 1) {
#pragma omp parallel num_threads(int(num_threads))
    {
      const int64_t team = omp_get_num_threads(), thread = omp_get_thread_num();  // team may be smaller
      const int64_t base = num_tasks / team, extra = num_tasks % team;
      const int64_t begin = thread * base + std::min(thread, extra);
      const int64_t end = begin + base + (thread < extra ? 1 : 0);
      if (begin < end) body(thread, begin, end);
    }
    return;
  }
#endif
  body(int64_t(0), int64_t(0), num_tasks);
}

// The calling thread's number in the parallel region it runs in, 0 .. threads - 1 (0 outside
// one, and in the bodies parallel_blocks and parallel_for run inline): an index into per-thread
// state allocated for one call.
inline int64_t thread_index() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

enum class Schedule {
  kStatic,   // one contiguous block of tasks per thread (parallel_blocks): for tasks of equal cost
  kDynamic,  // each thread takes the next task when it finishes one: for tasks of uneven cost
};

// Runs body(task) for every task in [0, num_tasks) on up to num_threads threads (never more than
// num_tasks); inline, in task order, when that is one thread.
template <Schedule kSchedule = Schedule::kStatic, class Body>
inline void parallel_for(int64_t num_tasks, int64_t num_threads, const Body& body) {
  if (num_threads <= 1 || num_tasks <= 1) {
    for (int64_t task = 0; task < num_tasks; ++task) body(task);
    return;
  }
  if constexpr (kSchedule == Schedule::kStatic) {
    parallel_blocks(num_tasks, num_threads, [&](int64_t, int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) body(task);
    });
  } else {
#pragma omp parallel for num_threads(int(std::min(num_threads, num_tasks))) schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) body(task);
  }
}

}  // namespace kf
