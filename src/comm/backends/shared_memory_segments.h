#pragma once

// Internal: segments in /dev/shm for the collectives between ranks of one
// host (Note [Collectives through shared memory] in
// shared_memory_collectives.cpp).

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// A name for a new segment: this process's id and random digits.
std::string new_segment_name();

/// Segment `name` of `bytes`, mapped: made (and its pages reserved, so that a
/// full /dev/shm fails here) with `create`, else opened. nullptr where it
/// cannot be.
void* map_segment(const std::string& name, int64_t bytes, bool create);

/// The segments of a group that is joining: unlinked when this goes, and by
/// unlink_joining_segments() until then (Note [Segments of a group that is
/// joining] in shared_memory_segments.cpp).
class JoiningSegments {
 public:
  JoiningSegments() = default;
  JoiningSegments(const JoiningSegments&) = delete;
  JoiningSegments& operator=(const JoiningSegments&) = delete;
  ~JoiningSegments();
  void add(const std::string& name);

 private:
  std::vector<std::string> names_;
};

/// Unlinks the segments of groups this process is joining: what a process
/// ended by the join's deadline calls first.
void unlink_joining_segments();

} // namespace detail
} // namespace lockstep
