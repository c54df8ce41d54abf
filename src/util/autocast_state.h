#pragma once

// Internal: a thread's autocast state, captured on one thread and put on
// another, so that DataParallel's replicas run under their caller's
// autocast (Note [Mixed precision] in src/amp.cpp).

#include <c10/core/ScalarType.h>

namespace lockstep {
namespace detail {

/// Autocast's thread-local state for the device types lockstep runs on.
struct AutocastState {
  bool cpu_enabled = false;
  bool cuda_enabled = false;
  c10::ScalarType cpu_dtype = c10::kBFloat16;
  c10::ScalarType cuda_dtype = c10::kHalf;
  bool cache_enabled = true;

  /// The calling thread's state.
  static AutocastState current();
  /// Makes it the calling thread's.
  void apply() const;
};

/// Runs a replica under its caller's autocast state, one nesting level deep
/// as an AutocastGuard would: at the end the thread's cast cache is cleared
/// when no guard of its own is open, and its own state comes back.
class ReplicaAutocast {
 public:
  explicit ReplicaAutocast(const AutocastState& caller);
  ~ReplicaAutocast();
  ReplicaAutocast(const ReplicaAutocast&) = delete;
  ReplicaAutocast& operator=(const ReplicaAutocast&) = delete;

 private:
  AutocastState previous_;
};

} // namespace detail
} // namespace lockstep
