#pragma once

/// \file
/// A timeline of each training step, as Chrome trace events (Perfetto,
/// chrome://tracing): LOCKSTEP_TIMELINE=path turns it on. lockstep records
/// forward, backward, each bucket's copy-in, allreduce and copy-out,
/// DataParallel's per-replica forward and backward, and the collectives of
/// the mpi and gloo groups as they ran on the group's own thread; your code
/// can add spans (the trainer marks its optimizer step). See Note [Timeline] in
/// src/util/timeline.cpp, and `lockstep-run --timeline FILE`, which merges the
/// ranks' files into one.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace lockstep {
/// The timeline of each training step (LOCKSTEP_TIMELINE), and the spans your
/// code adds to it.
namespace timeline {

namespace detail {
extern const bool kEnabled; // LOCKSTEP_TIMELINE set, read once at start; inline below, so that off costs a branch
} // namespace detail

/// Whether LOCKSTEP_TIMELINE names a file: when not, spans cost one branch.
inline bool enabled() {
  return detail::kEnabled;
}

/// A span of the timeline, from construction to end() or destruction,
/// whichever comes first. Off, it records nothing and reads nothing.
class Span {
 public:
  /// A span that records nothing (as one moved from, or ended, does).
  Span() = default;

  /// Starts a span called `name`: a std::string (or what makes one), or a
  /// function returning one, called only when the timeline is on, for a
  /// name built at run time: `Span([&] { return "step " + std::to_string(i); })`.
  /// `bytes`, unless -1, is shown with it: the bytes the work it times moved.
  /// It goes on the calling thread's track, or on the track named `track`
  /// (not copied: it must outlive the span), whose spans may overlap.
  template <typename Name, typename = std::enable_if_t<!std::is_same<std::decay_t<Name>, Span>::value>>
  explicit Span(Name&& name, int64_t bytes = -1, const char* track = "") {
    if (enabled()) {
      if constexpr (std::is_invocable<Name>::value) {
        name_ = std::forward<Name>(name)();
      } else {
        name_ = std::forward<Name>(name);
      }
      bytes_ = bytes;
      track_ = track;
      start();
    }
  }

  /// Takes `other`'s place; `other` records nothing.
  Span(Span&& other) noexcept {
    *this = std::move(other);
  }
  /// Ends this span, then takes `other`'s place; `other` records nothing.
  Span& operator=(Span&& other) noexcept {
    if (this != &other) {
      end();
      name_ = std::move(other.name_);
      track_ = other.track_;
      bytes_ = other.bytes_;
      start_us_ = other.start_us_;
      running_ = std::exchange(other.running_, false);
    }
    return *this;
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  ~Span() {
    end();
  }

  /// The bytes shown with it, for work whose size is known once it started.
  void set_bytes(int64_t bytes) {
    bytes_ = bytes;
  }

  /// Records the span, ending now; a span ends once, so later calls, and
  /// its destruction, record nothing.
  void end() {
    if (running_) {
      finish();
    }
  }

 private:
  void start();
  void finish();

  std::string name_;
  const char* track_ = "";
  int64_t bytes_ = -1;
  int64_t start_us_ = 0;
  bool running_ = false;
};

/// Writes the events so far to $LOCKSTEP_TIMELINE (also done at exit).
void flush();

} // namespace timeline
} // namespace lockstep
