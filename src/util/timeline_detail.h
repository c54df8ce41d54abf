#pragma once

// The timeline's internals (Note [Timeline] in src/util/timeline.cpp): the
// clock, the recorder, and the paths and lanes of its files.

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
/// Why a timeline file could not be written at `path`: "" where its folder
/// exists and can be written, else what is wrong (a missing folder, a path
/// that is a folder, a folder without write permission).
std::string unwritable_because(const std::string& path);
/// Why rank `rank` of `world_size` cannot write its timeline for
/// LOCKSTEP_TIMELINE=`given`: "" where it can. A `given` that is a folder is
/// refused as such, not written beside as `given`.rank<R>.
std::string rank_file_problem(const std::string& given, int rank, int world_size);
/// A ProcessGroup of `world_size` ranks in which this process is `rank` was
/// made: the largest names the file and the process in it, over the
/// launchers' variables (ranks given by ProcessGroupOptions have none).
void note_group(int rank, int world_size);
/// For spans [start, end) of one track, in any order, the lane of each:
/// spans of one lane never overlap, and lanes are as few as can be.
std::vector<int> lanes_for(const std::vector<std::pair<int64_t, int64_t>>& spans);
} // namespace detail
} // namespace timeline
} // namespace lockstep
