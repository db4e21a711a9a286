// Pins the threads of this library's OpenMP pool one to a CPU: thread i of a team of `count` runs on
// cpus[i] from now on (the pool keeps its threads and their numbering across regions of up to that
// size). What sgl-kernel's init_cpu_threads_env does for its own pool; torch's threads are bound to
// the rank's CPU set by the caller.
#pragma once

#include <sched.h>

#include <cerrno>
#include <cstdint>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kf {
namespace comm {

inline bool pin_to(int32_t cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return sched_setaffinity(0, sizeof(set), &set) == 0;
}

// The number of threads pinned (count on success), or -errno of the first failure.
inline int64_t pin_threads(const int32_t* cpus, int64_t count) {
  int64_t pinned = 0, error = 0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(int(count)) reduction(+ : pinned) reduction(max : error)
  {
    const int i = omp_get_thread_num();
    if (pin_to(cpus[i])) {
      pinned += 1;
    } else {
      error = errno;
    }
  }
#else
  if (count > 0 && pin_to(cpus[0])) {
    pinned = 1;
  } else if (count > 0) {
    error = errno;
  }
#endif
  return error != 0 ? -error : pinned;
}

}  // namespace comm
}  // namespace kf
