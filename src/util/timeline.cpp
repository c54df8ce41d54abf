#include <lockstep/timeline.h>

#include "util/timeline_detail.h"

#include <common/path_tag.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

namespace lockstep {
namespace timeline {

// Note [Timeline]
// ~~~~~~~~~~~~~~~
// With LOCKSTEP_TIMELINE=path, every span becomes a Chrome trace "X" event:
// name, start and duration in microseconds of wall-clock time (so that the
// ranks' files line up when lockstep-run merges them), pid = the rank, tid =
// the thread, or a named track. Events are kept in memory (at most
// kMaxEvents) and written once, at exit or by flush(), to a file written
// whole and renamed into place, so that no reader sees half of one. "%r" in
// the path becomes the rank, for ranks sharing a folder. Under a launcher
// every rank reads the same variable, so a path without "%r" in a job of
// several ranks gets ".rank<r>" before its extension: one path for all would
// leave one rank's file, the others' overwritten. A rank of a job that
// records nothing still writes its (empty) file, so that lockstep-run merges
// every rank that ended. Past kMaxEvents, events are left out: the file
// says how many, and the rank says so on stderr.
//
// What lockstep records, and where:
//   forward                 DistributedDataParallelImpl::forward
//   backward                the reducer: from the first gradient hook (the
//                           first parameter gradient backward produces) to
//                           the end of its end-of-backward callback
//   copy-in bucket k        each gradient's copy into its bucket (one event a
//                           parameter, on the thread that ran the hook)
//   allreduce bucket k      on the "collectives" track: from its launch to
//                           the end of its wait, at the end of backward. The
//                           end is when backward needed it, an upper bound on
//                           when the transfer finished.
//   copy-out bucket k       the copy of the reduced bucket back into .grad
//   <what>                  a collective as it ran on the group's own thread,
//                           named as in errors ("allreduce of bucket 1 (...)"):
//                           every one of the mpi group's, and the gloo
//                           group's through shared memory and its rings
//   allreduce through shared memory (reduce_scatter, all_gather, broadcast)
//                           inside it, between ranks of one host, with its
//                           "waiting for the other ranks": where the time
//                           between an allreduce bucket's launch and its end
//                           went
//   all_gather / reduce_scatter UNITS   FullyShardedDataParallel's
//                           collectives, on the "collectives" track too
//   replica r forward/backward  DataParallel's replicas, on the worker threads
// A track's spans overlap where buckets are launched one after another and
// waited for later, but a Chrome trace wants the "X" events of one thread
// nested or apart: Perfetto drops the ones that overlap partly, hiding the
// very overlap the timeline is read for. So at writing, each named track is
// cut into as few lanes as hold its spans apart ("collectives",
// "collectives 2", ...).
// Off, a span costs one branch on a constant. On CUDA, spans time the host:
// kernels launched, not run, and an NCCL wait returns once the stream waits.

namespace detail {
namespace {

constexpr size_t kMaxEvents = 1000000;
// Threads' tids count from 0 and stay below kFirstTrack (a thread is made
// for each DataParallel's workers, so a run may make thousands); lane k of
// named track t (tid kFirstTrack + t) is tid kFirstTrack + t + k * kLaneStride.
constexpr int kFirstTrack = 1 << 24;
constexpr int kLaneStride = 1 << 12; // more than any run's named tracks

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

// The first of the launchers' variables set, or `otherwise`. Slurm's count
// only inside a job step (srun), as in Note [MPI launchers]
// (src/comm/launch_env.cpp): a batch script's own process is no rank.
int from_env(std::initializer_list<const char*> names, int otherwise) {
  const bool in_step = !env("SLURM_STEP_ID").empty();
  for (const char* name : names) {
    if (!in_step && std::string(name).rfind("SLURM_", 0) == 0) {
      continue;
    }
    const std::string value = env(name);
    if (!value.empty()) {
      return std::atoi(value.c_str());
    }
  }
  return otherwise;
}

int rank_from_env() {
  return from_env({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}, 0);
}

int world_size_from_env() {
  return from_env({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}, 1);
}

struct Event {
  std::string name;
  int64_t start;
  int64_t end;
  int tid;
  int64_t bytes;
};

class Recorder {
 public:
  // A path the file cannot be written to is said at start, not after the
  // run it was to record.
  Recorder() {
    const std::string problem = rank_file_problem(env("LOCKSTEP_TIMELINE"), rank_from_env(), world_size_from_env());
    if (!problem.empty()) {
      std::fprintf(stderr, "lockstep: rank %d: LOCKSTEP_TIMELINE: %s as the rank starts; unless that changes by "
                   "the time it exits, its timeline will not be written. Give a file in a folder that exists.\n",
                   rank_from_env(), problem.c_str());
    }
  }
  ~Recorder() { // at exit: an exception here would abort a run that succeeded
    try {
      write();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "lockstep: the timeline (LOCKSTEP_TIMELINE) could not be written: %s\n", e.what());
    }
  }

  void note_group(int rank, int world_size) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (world_size > group_size_) {
      group_rank_ = rank;
      group_size_ = world_size;
    }
  }

  void add(const std::string& name, int64_t start, int64_t end, const std::string& track, int64_t bytes) {
    thread_local int thread_id = next_thread_.fetch_add(1) % kFirstTrack;
    std::lock_guard<std::mutex> lock(mutex_);
    int tid = thread_id;
    auto it = tracks_.find(track);
    if (!track.empty() && it == tracks_.end() && tracks_.size() + 1 < static_cast<size_t>(kLaneStride)) {
      it = tracks_.emplace(track, kFirstTrack + static_cast<int>(tracks_.size())).first;
    }
    if (it != tracks_.end()) { // past kLaneStride named tracks, a span stays on its thread's
      tid = it->second;
    }
    if (events_.size() >= kMaxEvents) {
      ++dropped_;
      return;
    }
    events_.push_back(Event{name, start, end, tid, bytes});
  }

  void write() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string path = env("LOCKSTEP_TIMELINE");
    if (path.empty() || ::getpid() != owner_) { // a fork()ed child (a data loader's) is not the rank
      return;
    }
    const int rank = group_size_ > 0 ? group_rank_ : rank_from_env();
    const int world_size = group_size_ > 0 ? group_size_ : world_size_from_env();
    struct stat status {};
    if (::stat(path.c_str(), &status) == 0 && S_ISDIR(status.st_mode)) {
      std::fprintf(stderr, "lockstep: rank %d: could not write the timeline (LOCKSTEP_TIMELINE): %s\n", rank,
                   rank_file_problem(path, rank, world_size).c_str());
      return;
    }
    path = rank_path(path, rank, world_size);
    nlohmann::json events = nlohmann::json::array();
    const std::vector<int> tids = lane_tids();
    for (size_t i = 0; i < events_.size(); ++i) {
      const Event& e = events_[i];
      nlohmann::json event = {{"name", e.name}, {"ph", "X"}, {"ts", e.start}, {"dur", e.end - e.start},
                              {"pid", rank}, {"tid", tids[i]}};
      if (e.bytes >= 0) {
        event["args"] = {{"bytes", e.bytes}};
      }
      events.push_back(std::move(event));
    }
    std::map<int, std::string> names; // a track's lanes, named
    for (const auto& [name, tid] : tracks_) {
      names[tid] = name;
    }
    for (int tid : std::set<int>(tids.begin(), tids.end())) {
      if (tid >= kFirstTrack) {
        const int lane = (tid - kFirstTrack) / kLaneStride;
        const std::string& track = names.at(tid - lane * kLaneStride);
        events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", tid},
                          {"args", {{"name", lane == 0 ? track : track + " " + std::to_string(lane + 1)}}}});
      }
    }
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
    nlohmann::json trace = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
    if (dropped_ > 0) {
      trace["lockstep_dropped_events"] = dropped_;
    }
    const std::string partial = path + ".partial";
    std::ofstream out(partial);
    out << trace.dump() << "\n";
    out.close();
    if (!out || std::rename(partial.c_str(), path.c_str()) != 0) {
      const std::string problem = unwritable_because(path);
      std::remove(partial.c_str());
      std::fprintf(stderr, "lockstep: rank %d: could not write the timeline to %s (LOCKSTEP_TIMELINE)%s%s\n", rank,
                   path.c_str(), problem.empty() ? "" : ": ", problem.c_str());
    } else if (dropped_ > 0) {
      std::fprintf(stderr, "lockstep: rank %d: the timeline in %s holds its first %zu events and leaves out the %zu "
                   "after them; set LOCKSTEP_TIMELINE only for a short run to see them all.\n", rank,
                   path.c_str(), kMaxEvents, dropped_);
    }
  }

 private:
  // Each event's tid: its thread's, or its track lane's (Note [Timeline]).
  std::vector<int> lane_tids() const {
    std::vector<int> tids(events_.size());
    std::map<int, std::vector<size_t>> on_track;
    for (size_t i = 0; i < events_.size(); ++i) {
      tids[i] = events_[i].tid;
      if (events_[i].tid >= kFirstTrack) {
        on_track[events_[i].tid].push_back(i);
      }
    }
    for (const auto& [tid, indices] : on_track) {
      std::vector<std::pair<int64_t, int64_t>> spans;
      for (size_t i : indices) {
        spans.emplace_back(events_[i].start, events_[i].end);
      }
      const std::vector<int> lanes = lanes_for(spans);
      for (size_t k = 0; k < indices.size(); ++k) {
        tids[indices[k]] = tid + lanes[k] * kLaneStride;
      }
    }
    return tids;
  }

  std::mutex mutex_;
  std::vector<Event> events_;
  std::map<std::string, int> tracks_;
  std::atomic<int> next_thread_{0};
  int group_rank_ = 0, group_size_ = 0; // note_group's; 0: none made
  size_t dropped_ = 0;
  const pid_t owner_ = ::getpid();
};

Recorder& recorder() {
  static Recorder instance; // its destructor writes the file at exit
  return instance;
}

} // namespace

const bool kEnabled = !env("LOCKSTEP_TIMELINE").empty();

namespace {
// Made at start in a rank of a job, so that its destructor writes a file at
// exit even when it records nothing (Note [Timeline]); a lone process that
// records nothing writes nothing, as it would leave only an empty file.
[[maybe_unused]] const bool kRecorderMade = kEnabled && world_size_from_env() > 1 && (recorder(), true);
} // namespace

std::vector<int> lanes_for(const std::vector<std::pair<int64_t, int64_t>>& spans) {
  std::vector<size_t> order(spans.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spans[a].first < spans[b].first; });
  std::vector<int> lanes(spans.size());
  std::vector<int64_t> free_from; // each lane's last end
  for (size_t i : order) {
    auto lane = std::find_if(free_from.begin(), free_from.end(), [&](int64_t end) { return end <= spans[i].first; });
    if (lane == free_from.end()) {
      lane = free_from.insert(free_from.end(), 0);
    }
    *lane = spans[i].second;
    lanes[i] = static_cast<int>(lane - free_from.begin());
  }
  return lanes;
}

std::string rank_path(std::string path, int rank, int world_size) {
  const bool has_rank = path.find("%r") != std::string::npos;
  for (size_t at; (at = path.find("%r")) != std::string::npos;) {
    path.replace(at, 2, std::to_string(rank));
  }
  return has_rank || world_size <= 1 ? path : common::with_tag(path, ".rank" + std::to_string(rank));
}

std::string rank_file_problem(const std::string& given, int rank, int world_size) {
  struct stat status {};
  if (::stat(given.c_str(), &status) == 0 && S_ISDIR(status.st_mode)) {
    return given + " is a folder; name a file in it, e.g. " + given + "/timeline.json";
  }
  return unwritable_because(rank_path(given, rank, world_size));
}

std::string unwritable_because(const std::string& path) {
  struct stat status {};
  if (::stat(path.c_str(), &status) == 0 && S_ISDIR(status.st_mode)) {
    return path + " is a folder";
  }
  const auto slash = path.find_last_of('/');
  const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  if (::stat(folder.c_str(), &status) != 0 || !S_ISDIR(status.st_mode)) {
    return "the folder " + folder + " of " + path + " does not exist";
  }
  if (::access(folder.c_str(), W_OK) != 0) {
    return "the folder " + folder + " of " + path + " cannot be written (" + std::strerror(errno) + ")";
  }
  return "";
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void record(const std::string& name, int64_t start_us, int64_t end_us, const std::string& track, int64_t bytes) {
  recorder().add(name, start_us, end_us, track, bytes);
}

// The launchers' variables name the file where they are set: they give the
// job's rank, where a program's first group may be a node's subgroup. Ranks
// as threads of one process make groups of one size: the first names it.
void note_group(int rank, int world_size) {
  if (kEnabled && world_size > 1 && world_size_from_env() == 1) {
    recorder().note_group(rank, world_size);
  }
}

} // namespace detail

void Span::start() {
  start_us_ = detail::now_us();
  running_ = true;
}

void Span::finish() {
  running_ = false;
  detail::record(name_, start_us_, detail::now_us(), track_, bytes_);
}

void flush() {
  if (enabled()) {
    detail::recorder().write();
  }
}

} // namespace timeline
} // namespace lockstep
