// Compiled when LibTorch does not run intra-op work on OpenMP: no thread
// keeps an idle team.

#include "dp/cpu_threads.h"

namespace lockstep {
namespace detail {

void release_idle_openmp_team() {}

} // namespace detail
} // namespace lockstep
