#pragma once

// A timeline of each training step, as Chrome trace events (Perfetto,
// chrome://tracing): LOCKSTEP_TIMELINE=path turns it on. lockstep records
// forward, backward, each bucket's copy-in, allreduce and copy-out, and
// DataParallel's per-replica forward and backward; your code can add spans
// (the trainer marks its optimizer step). See Note [Timeline] in
// src/timeline.cpp, and `lockstep-run --timeline FILE`, which merges the
// ranks' files into one.

#include <chrono>
#include <cstdint>
#include <string>

namespace lockstep {
namespace timeline {

namespace detail {
extern const bool kEnabled; // LOCKSTEP_TIMELINE set, read once at start
int64_t now_us();
void record(const std::string& name, int64_t start_us, int64_t end_us, const std::string& track = "",
            int64_t bytes = -1);
} // namespace detail

/// Whether LOCKSTEP_TIMELINE names a file: when not, spans cost one branch.
inline bool enabled() {
  return detail::kEnabled;
}

/// A span on the calling thread's track, from construction to destruction.
/// `name` is only read when the timeline is on.
class Span {
 public:
  explicit Span(const char* name, int64_t bytes = -1) : name_(name), bytes_(bytes) {
    if (enabled()) {
      start_ = detail::now_us();
    }
  }
  ~Span() {
    if (enabled()) {
      detail::record(name_, start_, detail::now_us(), "", bytes_);
    }
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  int64_t bytes_;
  int64_t start_ = 0;
};

/// Writes the events so far to $LOCKSTEP_TIMELINE (also done at exit).
void flush();

} // namespace timeline
} // namespace lockstep
