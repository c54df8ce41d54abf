// Compiled when LibTorch runs intra-op work on OpenMP; src/dp/no_openmp.cpp otherwise.

#include "dp/cpu_threads.h"

#include <omp.h>

namespace lockstep {
namespace detail {

// OpenMP 5.0's omp_pause_resource_all, which libgomp implements for the host
// by ending the calling thread's pool: its idle threads leave their dock and
// exit, and are joined before it returns. Only this thread's pool: other
// threads' teams are theirs. It returns nonzero inside a parallel region,
// where there is nothing to release.
void release_idle_openmp_team() {
  omp_pause_resource_all(omp_pause_soft);
}

} // namespace detail
} // namespace lockstep
