#pragma once

/// \file
/// A timeline of each training step, as Chrome trace events (Perfetto,
/// chrome://tracing): LOCKSTEP_TIMELINE=path turns it on. lockstep records
/// forward, backward, each bucket's copy-in, allreduce and copy-out, and
/// DataParallel's per-replica forward and backward; your code can add spans
/// (the trainer marks its optimizer step). See Note [Timeline] in
/// src/util/timeline.cpp, and `lockstep-run --timeline FILE`, which merges the
/// ranks' files into one.

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
/// The timeline of each training step (LOCKSTEP_TIMELINE), and the spans your
/// code adds to it.
namespace timeline {

namespace detail {
extern const bool kEnabled; // LOCKSTEP_TIMELINE set, read once at start
int64_t now_us();
void record(const std::string& name, int64_t start_us, int64_t end_us, const std::string& track = "",
            int64_t bytes = -1);
/// The file rank `rank` of `world_size` writes for LOCKSTEP_TIMELINE=`path`
/// (Note [Timeline]).
std::string rank_path(std::string path, int rank, int world_size);
/// For spans [start, end) of one track, in any order, the lane of each:
/// spans of one lane never overlap, and lanes are as few as can be.
std::vector<int> lanes_for(const std::vector<std::pair<int64_t, int64_t>>& spans);
/// `path` with `tag` before its file name's extension: ("t.json", ".rank1")
/// gives "t.rank1.json". Also lockstep-run's, which has no LibTorch.
inline std::string with_tag(std::string path, const std::string& tag) {
  const size_t name = path.find_last_of('/') + 1; // 0 without a folder
  const size_t dot = path.find_last_of('.');
  return path.insert(dot != std::string::npos && dot > name ? dot : path.size(), tag);
}
} // namespace detail

/// Whether LOCKSTEP_TIMELINE names a file: when not, spans cost one branch.
inline bool enabled() {
  return detail::kEnabled;
}

/// A span on the calling thread's track, from construction to destruction.
/// `name` is only read when the timeline is on.
class Span {
 public:
  /// Starts a span called `name` (not copied: it must outlive the span).
  /// `bytes`, unless -1, is shown with it: the bytes the work it times moved.
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
