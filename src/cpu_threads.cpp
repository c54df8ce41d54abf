// Compiled when LibTorch runs intra-op work on OpenMP; src/no_openmp.cpp otherwise.

#include "cpu_threads.h"

#include <omp.h>

namespace lockstep {
namespace detail {

// Only this thread's OpenMP setting: at::set_num_threads would also change
// the process-wide count that new threads start from.
CallerCoresYielded::CallerCoresYielded() {
  const int threads = omp_get_max_threads();
  if (threads > 1) {
    previous_ = threads;
    omp_set_num_threads(1);
  }
}

CallerCoresYielded::~CallerCoresYielded() {
  if (previous_ > 0) {
    omp_set_num_threads(previous_);
  }
}

} // namespace detail
} // namespace lockstep
