// Compiled when LibTorch does not run intra-op work on OpenMP: there is no
// per-thread team to yield.

#include "cpu_threads.h"

namespace lockstep {
namespace detail {

CallerCoresYielded::CallerCoresYielded() = default;
CallerCoresYielded::~CallerCoresYielded() = default;

} // namespace detail
} // namespace lockstep
