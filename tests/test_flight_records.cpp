// The flight records that ranks under lockstep-run write when a collective
// fails, and the desync report lockstep-run prints from them.

#include "support/launch.h"
#include "support/processes.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include <regex>
#include <string>

namespace lockstep {
namespace {

using namespace testing::jobs;

TEST(Launcher, StalledRankIsNamedNotTheRankThatTimedOut) {
  // Rank 1 stalls, deaf to SIGTERM; rank 0 times out waiting for it and fails first.
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--timeout", "3", "--grace-period", "1"},
                  trainer("stall"), "stall", {"LOCKSTEP_FAULT=1:5:hang"});
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_LT(p.seconds, 30.0) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: rank 0 (local rank 0, pid "), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("within the group's timeout of 3000 ms"), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("had stopped responding: it ignored SIGTERM and was killed with SIGKILL after the 1.0 s grace "
                          "period. Rank 0 failed first only because it gave up waiting for it"),
            std::string::npos) << p.output;
  EXPECT_TRUE(testing::processes_with(temp("stall")).empty()) << "a rank outlived the launcher";
  // The flight records: rank 0's says where it waited; rank 1 left none.
  EXPECT_NE(p.output.find("lockstep-run: desync report, from the ranks' flight records in "), std::string::npos) << p.output;
  EXPECT_TRUE(std::regex_search(p.output, std::regex("rank 0 waited [0-9.]+ s in collective #[0-9]+ \\((allreduce|broadcast) .*\\), "
                                                     "which rank 1 never joined")))
      << p.output;
}

// LOCKSTEP_DEBUG=detail's check is what fails first there: its failure is
// the collective's, so the records are written and the report names it too.
TEST(Launcher, DesyncReportUnderLockstepDebugDetail) {
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, {LOCKSTEP_DDP_WORKER, "desync_skip"},
                  "desync_detail", {kOneThread, "LOCKSTEP_DEBUG=detail"});
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("LOCKSTEP_DEBUG=detail: ranks disagree on collective #"), std::string::npos) << p.output;
  EXPECT_TRUE(std::regex_search(p.output, std::regex("desync report, from the ranks' flight records[^\n]*\n  rank 0 "
                                                     "ran allreduce \\(sum\\) of 4 Float as #[0-9]+ where rank 1 "
                                                     "ran barrier")))
      << p.output;
}

// An Avg reaches the backend as a Sum: the records wrote "sum" for both, and
// the report called ranks that disagreed on it agreed, blaming the network.
TEST(Launcher, DesyncReportTellsAnAverageFromASum) {
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, {LOCKSTEP_DDP_WORKER, "desync_avg"}, "desync_avg",
                  {kOneThread});
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_TRUE(std::regex_search(p.output, std::regex("desync report, from the ranks' flight records[^\n]*\n  rank 0 "
                                                     "ran allreduce \\(avg\\) of 4 Float as #1 where rank 1 ran "
                                                     "allreduce \\(sum\\) of 4 Float")))
      << p.output;
}

TEST(Launcher, DesyncReportNamesTheRankThatSkippedACollectiveAndItsNumber) {
  // Rank 1 skips an allreduce and goes on to a barrier: from that collective
  // on the ranks disagree, both fail, and each writes its record.
  const std::string logs = temp("desync_logs");
  ::mkdir(logs.c_str(), 0755);
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--log-dir", logs}, {LOCKSTEP_DDP_WORKER, "desync_skip"},
                  "desync", {kOneThread});
  EXPECT_EQ(p.exit_code, 1) << p.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(p.output, m, std::regex("rank 0 ran allreduce \\(sum\\) of 4 Float as #([0-9]+) where rank 1 "
                                                        "ran barrier")))
      << p.output;
  const int64_t seq = std::stoll(m[1].str());
  for (int r = 0; r < 2; ++r) {
    const auto record = nlohmann::json::parse(read_text(logs + "/lockstep_trace_rank" + std::to_string(r) + ".json"),
                                              nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(record.is_object()) << "rank " << r << "'s flight record is missing or does not parse\n" << p.output;
    EXPECT_EQ(record["rank"], r);
    bool found = false;
    for (const auto& c : record["groups"][0]["collectives"]) {
      if (c["seq"] == seq) {
        found = true;
        EXPECT_EQ(c["op"], r == 0 ? "allreduce" : "barrier") << c.dump();
        EXPECT_NE(c["state"], "completed") << c.dump();
      }
    }
    EXPECT_TRUE(found) << "rank " << r << " recorded no collective #" << seq;
  }
  // The short summary on stderr, with the file it wrote.
  EXPECT_NE(p.output.find("flight recorder, the last collectives of this rank (whole record: " + logs), std::string::npos)
      << p.output;
}

// A failure the program survived wrote the only record: the report then
// named it, not the collective where the job died.
TEST(Launcher, DesyncReportTellsOfTheLastFailureNotOneTheRanksSurvived) {
  const std::string logs = temp("desync_after_logs");
  ::mkdir(logs.c_str(), 0755);
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--log-dir", logs},
                  {LOCKSTEP_DDP_WORKER, "desync_after_caught"}, "desync_after", {kOneThread});
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_TRUE(std::regex_search(p.output, std::regex("desync report, from the ranks' flight records[^\n]*\n  rank 0 "
                                                     "ran allreduce \\(sum\\) of 4 Float as #[0-9]+ where rank 1 "
                                                     "ran barrier")))
      << p.output;
  const auto record = nlohmann::json::parse(read_text(logs + "/lockstep_trace_rank0.json"), nullptr, false);
  ASSERT_TRUE(record.is_object()) << p.output;
  EXPECT_EQ(record["reason"].get<std::string>().find("of 5 Float"), std::string::npos) << record["reason"];
}

// The summary showed the process's first group, not the one that failed,
// and the record was named after the first live group's rank: with the
// world's group gone, each rank's after its rank in the reversed group, so
// the desync report swapped the ranks.
TEST(Launcher, FlightRecordsNameTheProcessAndShowTheGroupThatFailed) {
  const std::string logs = temp("second_group_logs");
  ::mkdir(logs.c_str(), 0755);
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--log-dir", logs},
                  {LOCKSTEP_DDP_WORKER, "desync_second_group"}, "second_group", {kOneThread});
  EXPECT_EQ(p.exit_code, 1) << p.output;
  for (int r = 0; r < 2; ++r) {
    // Beside the world's group: its own rank, and the failed group's.
    const std::string first = "lockstep: rank " + std::to_string(r) + ": flight recorder, the last collectives of this "
        "rank in group 1 (its rank " + std::to_string(1 - r) + " of 2) (whole record: " + logs;
    const size_t at = p.output.find(first);
    ASSERT_NE(at, std::string::npos) << first << "\n" << p.output;
    const std::string summary = p.output.substr(at, p.output.find("lockstep: rank", at + 1) - at);
    EXPECT_TRUE(std::regex_search(summary, std::regex("#1 allreduce \\(sum\\) of [45] Float: failed"))) << summary;
    EXPECT_EQ(summary.find("#2"), std::string::npos) << summary;
    const auto record = nlohmann::json::parse(read_text(logs + "/lockstep_trace_rank" + std::to_string(r) + ".json"),
                                              nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(record.is_object()) << "rank " << r << "'s flight record is missing or does not parse\n" << p.output;
    EXPECT_EQ(record["rank"], r);
    ASSERT_EQ(record["groups"].size(), 1u) << "the world's group was gone at the last failure";
    EXPECT_EQ(record["groups"][0]["rank"], 1 - r);
  }
  EXPECT_TRUE(std::regex_search(p.output, std::regex("desync report, from the ranks' flight records[^\n]*\n  rank 0 "
                                                     "ran allreduce \\(sum\\) of 4 Float as #3 where rank 1 ran "
                                                     "allreduce \\(sum\\) of 5 Float")))
      << p.output;
}

} // namespace
} // namespace lockstep
