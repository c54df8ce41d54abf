#pragma once

// Internal: the OpenMP threads around CPU replicas. src/dp/cpu_threads.cpp
// implements it over OpenMP; src/dp/no_openmp.cpp, compiled for a LibTorch
// without OpenMP, does nothing, since then no thread keeps a team. See Note
// [CPU replicas and threads] in src/dp/data_parallel.cpp.

namespace lockstep {
namespace detail {

/// Ends the calling thread's idle OpenMP team, if it has one: its threads
/// exit now instead of spinning for milliseconds on cores that other threads
/// need. The thread keeps its intra-op thread count; its next parallel region
/// starts a new team. Does nothing inside a parallel region.
void release_idle_openmp_team();

} // namespace detail
} // namespace lockstep
