#pragma once

// Internal: the calling thread's OpenMP threads while CPU replicas run.
// src/cpu_threads.cpp implements it over OpenMP; src/no_openmp.cpp, compiled
// for a LibTorch without OpenMP, does nothing, since then there is no
// per-thread team to yield. See Note [CPU replicas and threads] in
// src/data_parallel.cpp.

namespace lockstep {
namespace detail {

/// While alive, the calling thread runs intra-op work on one OpenMP thread, so
/// that its team does not spin on cores the replicas' workers need. The
/// caller's own count comes back when it ends.
class CallerCoresYielded {
 public:
  CallerCoresYielded();
  ~CallerCoresYielded();
  CallerCoresYielded(const CallerCoresYielded&) = delete;
  CallerCoresYielded& operator=(const CallerCoresYielded&) = delete;

 private:
  int previous_ = 0; // 0: nothing to give back
};

} // namespace detail
} // namespace lockstep
