#pragma once

// The timeline's internals (Note [Timeline] in src/util/timeline.cpp): the
// clock, the recorder, and the paths and lanes of its files. lockstep-run,
// which has no LibTorch, shares with_tag.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace timeline {
namespace detail {

/// Wall-clock microseconds, so that the ranks' files line up.
int64_t now_us();
/// Adds the span [start_us, end_us) called `name` on the calling thread's
/// track, or on `track`; `bytes`, unless -1, is shown with it.
void record(const std::string& name, int64_t start_us, int64_t end_us, const std::string& track = "",
            int64_t bytes = -1);
/// The file rank `rank` of `world_size` writes for LOCKSTEP_TIMELINE=`path`
/// (Note [Timeline]).
std::string rank_path(std::string path, int rank, int world_size);
/// For spans [start, end) of one track, in any order, the lane of each:
/// spans of one lane never overlap, and lanes are as few as can be.
std::vector<int> lanes_for(const std::vector<std::pair<int64_t, int64_t>>& spans);
/// `path` with `tag` before its file name's extension: ("t.json", ".rank1")
/// gives "t.rank1.json".
inline std::string with_tag(std::string path, const std::string& tag) {
  const size_t name = path.find_last_of('/') + 1; // 0 without a folder
  const size_t dot = path.find_last_of('.');
  return path.insert(dot != std::string::npos && dot > name ? dot : path.size(), tag);
}

} // namespace detail
} // namespace timeline
} // namespace lockstep
