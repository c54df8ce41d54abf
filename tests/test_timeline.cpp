// Timelines (Note [Timeline] in src/util/timeline.cpp): what lockstep records on
// each rank, and how lockstep-run merges the ranks' files.

#include "support/launch.h"
#include "support/processes.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

struct Event {
  int64_t start, end;
  int tid;
};

// Every event of rank `pid` named `name` (or, with `prefix`, whose name
// starts with it), with its thread.
std::vector<Event> spans_of(const nlohmann::json& events, int pid, const std::string& name, bool prefix = false) {
  std::vector<Event> out;
  for (const auto& e : events) {
    const std::string event = e.value("name", "");
    if (e.value("ph", "") == "X" && e.value("pid", -1) == pid && (prefix ? event.rfind(name, 0) == 0 : event == name)) {
      const int64_t start = e["ts"].get<int64_t>();
      out.push_back({start, start + e["dur"].get<int64_t>(), e["tid"].get<int>()});
    }
  }
  return out;
}

// The [start, end] of each event named `name` of rank `pid` in a merged timeline.
std::vector<std::pair<int64_t, int64_t>> intervals(const nlohmann::json& events, int pid, const std::string& name) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& e : spans_of(events, pid, name)) {
    out.emplace_back(e.start, e.end);
  }
  return out;
}

// Perfetto drops the "X" events of one track that overlap only partly: every
// two of a track's must be nested or apart.
void expect_nested_or_apart(const nlohmann::json& events) {
  std::map<std::pair<int, int>, std::vector<std::pair<int64_t, int64_t>>> tracks;
  for (const auto& e : events) {
    if (e.value("ph", "") == "X") {
      const int64_t start = e["ts"].get<int64_t>();
      tracks[{e["pid"].get<int>(), e["tid"].get<int>()}].emplace_back(start, start + e["dur"].get<int64_t>());
    }
  }
  for (auto& [track, spans] : tracks) {
    std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) { // outer first
      return a.first != b.first ? a.first < b.first : a.second > b.second;
    });
    for (size_t i = 0; i < spans.size(); ++i) {
      for (size_t j = i + 1; j < spans.size() && spans[j].first < spans[i].second; ++j) {
        EXPECT_LE(spans[j].second, spans[i].second) << "rank " << track.first << ", tid " << track.second << ": ["
                                                    << spans[i].first << ", " << spans[i].second << ") and ["
                                                    << spans[j].first << ", " << spans[j].second << ") overlap partly";
      }
    }
  }
}

bool within(const Event& inner, const Event& outer) {
  return inner.tid == outer.tid && inner.start >= outer.start && inner.end <= outer.end;
}

// Each launch of each bucket's allreduce on rank `rank` ("allreduce bucket
// b", from its launch to its wait) holds the allreduce as it ran on the
// group's own thread, named as in errors ("allreduce of bucket b (...)"),
// for which `holds` is true. In the first step the agreement check before
// it runs under the same name too.
void expect_each_bucket_ran_on_its_thread(const nlohmann::json& events, int rank, int buckets,
                                          const std::function<bool(const Event&)>& holds) {
  const int main_thread = spans_of(events, rank, "forward").at(0).tid;
  for (int b = 0; b < buckets; ++b) {
    const auto ran = spans_of(events, rank, "allreduce of bucket " + std::to_string(b) + " (", true);
    const auto launches = intervals(events, rank, "allreduce bucket " + std::to_string(b));
    EXPECT_EQ(launches.size(), 3u) << "rank " << rank << ", bucket " << b;
    for (const auto& [start, end] : launches) {
      EXPECT_TRUE(std::any_of(ran.begin(), ran.end(), [&, s = start, e = end](const Event& r) {
        return r.tid != main_thread && r.start >= s && r.end <= e && holds(r);
      })) << "rank " << rank << ": bucket " << b << "'s allreduce [" << start << ", " << end
          << ") holds no span of it as it ran on the group's thread, as expected";
    }
  }
}

TEST(Launcher, TimelineHasEveryBucketOnEveryRankAndAllreducesOverlapBackward) {
  const std::string file = temp("timeline.json");
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--timeline", file}, {LOCKSTEP_DDP_WORKER, "timeline"},
                  "timeline", {kOneThread});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(p.output, m, std::regex("buckets: ([0-9]+)"))) << p.output;
  const int buckets = std::stoi(m[1].str());
  EXPECT_GT(buckets, 3) << p.output;
  const auto trace = nlohmann::json::parse(read_text(file), nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(trace.is_object()) << "the timeline does not parse as JSON";
  const auto& events = trace["traceEvents"];
  expect_nested_or_apart(events);
  // The tracks are named: the first lane of the collectives "collectives", the others after it.
  std::map<std::pair<int, int>, std::string> track_names;
  for (const auto& e : events) {
    if (e.value("name", "") == "thread_name") {
      track_names[{e["pid"].get<int>(), e["tid"].get<int>()}] = e["args"].value("name", "");
    }
  }
  for (const auto& e : events) {
    if (e.value("ph", "") == "X" && e.value("name", "").rfind("allreduce bucket", 0) == 0) {
      const auto name = track_names.find({e["pid"].get<int>(), e["tid"].get<int>()});
      ASSERT_NE(name, track_names.end()) << e.dump();
      EXPECT_TRUE(std::regex_match(name->second, std::regex("collectives( [0-9]+)?"))) << name->second;
    }
  }
  for (int rank = 0; rank < 2; ++rank) {
    bool first_lane = false;
    for (const auto& [track, name] : track_names) {
      first_lane = first_lane || (track.first == rank && name == "collectives");
    }
    EXPECT_TRUE(first_lane) << "rank " << rank << " has no track named \"collectives\"";
  }
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(intervals(events, rank, "forward").size(), 3u) << "rank " << rank;
    const auto backward = intervals(events, rank, "backward");
    ASSERT_EQ(backward.size(), 3u) << "rank " << rank;
    for (int b = 0; b < buckets; ++b) {
      for (const char* stage : {"copy-in", "allreduce", "copy-out"}) {
        EXPECT_FALSE(intervals(events, rank, std::string(stage) + " bucket " + std::to_string(b)).empty())
            << "rank " << rank << " has no " << stage << " of bucket " << b;
      }
    }
    // Overlap: some bucket's allreduce starts while its step's backward still runs.
    bool overlapped = false;
    for (int b = 0; b < buckets; ++b) {
      for (const auto& [start, end] : intervals(events, rank, "allreduce bucket " + std::to_string(b))) {
        for (const auto& [bstart, bend] : backward) {
          overlapped = overlapped || (start >= bstart && start < bend && end > start);
        }
      }
    }
    EXPECT_TRUE(overlapped) << "no allreduce of rank " << rank << " started during a backward";
    // Through shared memory, with waits for the other ranks inside.
    const auto through = spans_of(events, rank, "allreduce through shared memory");
    const auto waiting = spans_of(events, rank, "waiting for the other ranks");
    expect_each_bucket_ran_on_its_thread(events, rank, buckets, [&](const Event& ran) {
      return std::any_of(through.begin(), through.end(), [&](const Event& t) {
        return within(t, ran) &&
               std::any_of(waiting.begin(), waiting.end(), [&](const Event& w) { return within(w, t); });
      });
    });
  }
}

// Over MPI, through Open MPI's own collectives (as between hosts), each
// bucket's allreduce shows on the communication thread as it ran, within
// the span from its launch to its wait. Named Mpi.*, as the MPI worker
// tests are, for the stages of .ci/run that leave those out.
TEST(Mpi, TimelineShowsEachCollectiveOnTheCommunicationThread) {
  if (std::string(LOCKSTEP_MPIRUN).empty()) {
    GTEST_SKIP() << "lockstep was built without MPI";
  }
  const std::string path = temp("mpi_timeline.json");
  for (int rank = 0; rank < 2; ++rank) {
    std::remove(temp("mpi_timeline.rank" + std::to_string(rank) + ".json").c_str());
  }
  std::vector<std::string> env{kOneThread, "LOCKSTEP_TIMELINE=" + path, "LOCKSTEP_TEST_BACKEND=mpi", "LOCKSTEP_MPI_SHM=0",
                               "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                               "OMPI_MCA_rmaps_base_oversubscribe=1"};
  if (const char* asan = std::getenv("ASAN_OPTIONS")) { // Open MPI keeps its state until exit, as tests/CMakeLists.txt says
    env.push_back(std::string("ASAN_OPTIONS=") + asan + ":detect_leaks=0");
  }
  auto p = testing::run({LOCKSTEP_MPIRUN, "-np", "2", "--bind-to", "none", LOCKSTEP_DDP_WORKER, "timeline"}, env,
                        temp("mpi_timeline.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(p.output, m, std::regex("buckets: ([0-9]+)"))) << p.output;
  for (int rank = 0; rank < 2; ++rank) {
    const auto trace = nlohmann::json::parse(read_text(temp("mpi_timeline.rank" + std::to_string(rank) + ".json")),
                                             nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(trace.is_object()) << "rank " << rank << "'s timeline does not parse as JSON";
    const auto& events = trace["traceEvents"];
    EXPECT_TRUE(spans_of(events, rank, "allreduce through shared memory").empty())
        << "rank " << rank << ": LOCKSTEP_MPI_SHM=0 went through shared memory";
    expect_each_bucket_ran_on_its_thread(events, rank, std::stoi(m[1].str()), [](const Event&) { return true; });
  }
}

TEST(Timeline, DataParallelRecordsEachReplicasForwardAndBackward) {
  const std::string file = temp("dp_timeline.json");
  auto args = with_flag(trainer("dp_timeline"), "--epochs", "1");
  args.insert(args.end(), {"--replicas", "2"});
  auto p = testing::run(args, {kOneThread, "LOCKSTEP_TIMELINE=" + file}, temp("dp_timeline.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  const auto trace = nlohmann::json::parse(read_text(file), nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(trace.is_object()) << "the timeline does not parse as JSON";
  for (const char* name : {"replica 0 forward", "replica 1 forward", "replica 0 backward", "replica 1 backward",
                           "optimizer step"}) {
    EXPECT_FALSE(intervals(trace["traceEvents"], 0, name).empty()) << "no '" << name << "' event";
  }
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The rank's own file: "rank N" as its process's name.
void expect_rank_file(const std::string& path, int rank) {
  ASSERT_TRUE(file_exists(path)) << "no " << path;
  const auto trace = nlohmann::json::parse(read_text(path), nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(trace.is_object()) << path << " does not parse as JSON";
  bool named = false;
  for (const auto& e : trace["traceEvents"]) {
    named = named || (e.value("name", "") == "process_name" && e["args"].value("name", "") == "rank " + std::to_string(rank));
  }
  EXPECT_TRUE(named) << path << " is not rank " << rank << "'s";
}

// Every rank reads the same LOCKSTEP_TIMELINE: a path without "%r" must
// still give each rank a file of its own. These ranks record nothing
// (collectives alone), and still write their files.
TEST(Timeline, APathWithoutTheRankGivesEachRankItsOwnFile) {
  const std::string path = temp("own_timeline.json");
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, {LOCKSTEP_DDP_WORKER, "collectives"},
                  "own_timeline", {kOneThread, "LOCKSTEP_TIMELINE=" + path});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  expect_rank_file(temp("own_timeline.rank0.json"), 0);
  expect_rank_file(temp("own_timeline.rank1.json"), 1);
  EXPECT_FALSE(file_exists(path)) << "both ranks wrote " << path;
}

// A folder named by LOCKSTEP_TIMELINE, with two ranks: each wrote
// <folder>.rankN.json beside it. Each rank says so at start and at exit,
// and writes nothing.
TEST(Timeline, AFolderIsSaidAtExitAndNothingIsWrittenBesideIt) {
  const std::string folder = temp("timeline_folder");
  ::mkdir(folder.c_str(), 0755);
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, {LOCKSTEP_DDP_WORKER, "collectives"},
                  "timeline_folder", {kOneThread, "LOCKSTEP_TIMELINE=" + folder});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  for (const std::string rank : {"0", "1"}) {
    EXPECT_NE(p.output.find("lockstep: rank " + rank + ": could not write the timeline (LOCKSTEP_TIMELINE): " + folder +
                            " is a folder"), std::string::npos) << p.output;
    EXPECT_FALSE(file_exists(folder + ".rank" + rank)) << p.output;
    EXPECT_FALSE(file_exists(folder + ".rank" + rank + ".json")) << p.output;
  }
}

// Ranks given by ProcessGroupOptions, with no launcher's variables: each
// file is named by its group's rank, where both ranks wrote one file as
// rank 0 and one was lost.
TEST(Timeline, RanksGivenByOptionsEachWriteTheirOwnFile) {
  const std::string path = temp("given_timeline.json");
  const std::string master_port = port();
  std::vector<Process> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    std::remove(temp("given_timeline.rank" + std::to_string(rank) + ".json").c_str());
    ranks.push_back(testing::start({LOCKSTEP_DDP_WORKER, "given_ranks"},
                                   {kOneThread, "LOCKSTEP_TIMELINE=" + path, "LOCKSTEP_TEST_RANK=" + std::to_string(rank),
                                    "LOCKSTEP_TEST_PORT=" + master_port},
                                   temp("given_timeline" + std::to_string(rank) + ".log")));
  }
  testing::wait_all(ranks, kDeadline);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(ranks[rank].exit_code, 0) << ranks[rank].output;
    expect_rank_file(temp("given_timeline.rank" + std::to_string(rank) + ".json"), rank);
  }
  EXPECT_FALSE(file_exists(path)) << "a rank wrote " << path;
}

// A thousand threads' spans and a named track's: the threads' track numbers
// ran into the named tracks' at 1000, and writing the file at exit aborted
// the process (exit 134), losing the timeline.
TEST(Timeline, SpansOnThousandsOfThreadsAreWrittenAtExit) {
  const std::string path = temp("many_threads_timeline.json");
  std::remove(path.c_str());
  auto p = testing::run({LOCKSTEP_DDP_WORKER, "many_threads"}, {kOneThread, "LOCKSTEP_TIMELINE=" + path},
                        temp("many_threads_timeline.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  const auto trace = nlohmann::json::parse(read_text(path), nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(trace.is_object()) << path << " does not parse as JSON";
  std::set<int> threads;
  std::string collectives_track;
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("name", "") == "work") {
      threads.insert(e["tid"].get<int>());
    }
    if (e.value("name", "") == "thread_name") {
      collectives_track = e["args"].value("name", "");
    }
  }
  EXPECT_EQ(threads.size(), 1100u);
  EXPECT_EQ(collectives_track, "collectives");
}

// A rank that records nothing is merged (an empty track), not reported as a
// rank that wrote no timeline.
TEST(Timeline, RanksThatRecordNothingAreMergedNotReportedMissing) {
  const std::string file = temp("quiet_timeline.json");
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--timeline", file},
                  {LOCKSTEP_DDP_WORKER, "collectives"}, "quiet_timeline", {kOneThread});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: timeline of 2 rank(s) in " + file), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("no timeline from rank"), std::string::npos) << p.output;
}

// After a restart FILE is the last attempt's, and the failed attempt's
// timeline, the one worth reading, is kept beside it.
TEST(Timeline, ARestartKeepsTheFailedAttemptsTimelineBesideTheLast) {
  const std::string file = temp("restart_timeline.json");
  const std::string kept = temp("restart_timeline.attempt0.json");
  const std::string script = "if [ -e \"$1\" ]; then exit 0; fi; touch \"$1\"; exit 1";
  auto p = launch({"--master-port", port(), "--max-restarts", "1", "--restart-delay", "0", "--timeline", file},
                  {"/bin/sh", "-c", script, "sh", temp("restart_timeline_marker")}, "restart_timeline");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: the timeline of attempt 0 is now " + kept), std::string::npos) << p.output;
  for (const auto& path : {file, kept}) {
    EXPECT_TRUE(nlohmann::json::parse(read_text(path), nullptr, /*allow_exceptions=*/false).is_object()) << path;
  }
}

} // namespace
} // namespace lockstep
