// lockstep-run's desync report, from the ranks' flight records: the first
// collective where the ranks part.

#include "support/errors.h"
#include "support/scratch.h"

#include <tools/desync_report.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {
namespace {

using testing::error_of;

nlohmann::json entry(int64_t seq, const std::string& op, int64_t numel, const std::string& state) {
  nlohmann::json c = {{"seq", seq}, {"op", op}, {"arg", op == "allreduce" ? "sum" : ""}, {"dtype", "Float"},
                      {"numel", numel}, {"what", op}, {"state", state}};
  c[state == "started" ? "waited_ms" : "duration_ms"] = 3000.0;
  return c;
}

nlohmann::json record(const std::vector<nlohmann::json>& collectives, int64_t issued) {
  return {{"groups", {{{"issued", issued}, {"collectives", collectives}}}}};
}

TEST(DesyncReport, OnlyAWaitThatEndedIsGivingUpWaiting) {
  using tools::gave_up_waiting;
  EXPECT_TRUE(gave_up_waiting({"x", "lockstep: rank 0 of 2: allreduce of bucket 0 (2 parameters, 0.0 MiB) failed or did "
                                    "not complete within the group's timeout of 5000 ms."}));
  EXPECT_TRUE(gave_up_waiting({"terminate called: [gloo/transport/tcp/pair.cc:598] Timed out waiting 5000ms for recv"}));
  EXPECT_TRUE(gave_up_waiting({"RuntimeError: Wait timeout after 30000 ms"}));
  EXPECT_TRUE(gave_up_waiting({"[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3)"}));
  EXPECT_TRUE(gave_up_waiting({"RuntimeError: Socket Timeout"}));
  EXPECT_TRUE(gave_up_waiting({"RuntimeError: Timeout waiting for key: rank1"}));
  // Usage errors that name a timeout waited for nobody.
  EXPECT_FALSE(gave_up_waiting({"lockstep-train: --timeout: 0 not in range [1 - 604800]"}));
  EXPECT_FALSE(gave_up_waiting({"lockstep: LOCKSTEP_TIMEOUT=\"5m\" is malformed; expected whole seconds from 1 to "
                                "604800 (a week)"}));
  EXPECT_FALSE(gave_up_waiting({}));
}

TEST(DesyncReport, NamesTheFirstCollectiveWhereRanksPart) {
  const auto agreed = entry(0, "allreduce", 8, "completed");
  // Rank 1 ran a barrier where rank 0 ran an allreduce.
  auto lines = tools::desync_report({{0, record({agreed, entry(1, "allreduce", 4, "failed")}, 2)},
                                     {1, record({agreed, entry(1, "barrier", 0, "failed")}, 2)}},
                                    {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "rank 0 ran allreduce (sum) of 4 Float as #1 where rank 1 ran barrier: the ranks issued "
                      "different collectives from here on.");
  // Rank 2 stopped issuing after #0; ranks 0 and 1 waited in #1.
  lines = tools::desync_report({{0, record({agreed, entry(1, "allreduce", 4, "started")}, 2)},
                                {1, record({agreed, entry(1, "allreduce", 4, "started")}, 2)},
                                {2, record({agreed}, 1)}},
                               {0, 1, 2});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "rank 2 never started collective #1 (allreduce (sum) of 4 Float); ranks 0 and 1 waited 3.0 s in it.");
  // Rank 1 wrote nothing: where rank 0 waited is what it never joined.
  lines = tools::desync_report({{0, record({agreed, entry(1, "allreduce", 4, "started")}, 2)}}, {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("rank 0 waited 3.0 s in collective #1 (allreduce (sum) of 4 Float), which rank 1 never joined"),
            std::string::npos) << lines[0];
  // Everyone there and agreeing, but stuck: the transport.
  lines = tools::desync_report({{0, record({agreed, entry(1, "allreduce", 4, "started")}, 2)},
                                {1, record({agreed, entry(1, "allreduce", 4, "started")}, 2)}},
                               {0, 1});
  EXPECT_NE(lines[0].find("every rank started collective #1"), std::string::npos) << lines[0];
  // The same number of values in another shape: no agreement, and the shapes told.
  auto flat = entry(1, "allreduce", 4, "failed"), square = flat;
  flat["shape"] = {4};
  square["shape"] = {2, 2};
  lines = tools::desync_report({{0, record({agreed, flat}, 2)}, {1, record({agreed, square}, 2)}}, {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "rank 0 ran allreduce (sum) of 4 Float shaped [4] as #1 where rank 1 ran allreduce (sum) of 4 "
                      "Float shaped [2,2]: the ranks issued different collectives from here on.");
  EXPECT_TRUE(tools::desync_report(std::map<int, nlohmann::json>{}, {0, 1}).empty());
}

// `c` started at `ms` (unix milliseconds) and lasted `duration_ms`.
nlohmann::json at(nlohmann::json c, int64_t ms, double duration_ms = 1.0) {
  c["started_unix_ms"] = ms;
  c.erase("waited_ms");
  c["duration_ms"] = duration_ms;
  return c;
}

// A disagreement refused at #0 and survived (the program caught it), then
// #1 agreed, then rank 1 skipped an allreduce: the report names #2, where
// the job died, not #0; also where rank 1's record is still the one it
// wrote at #0 (it was killed later, leaving no newer one).
TEST(DesyncReport, AFailureTheRanksSurvivedIsNotTheOneNamed) {
  const auto agreed = at(entry(1, "allreduce", 8, "completed"), 2000);
  const auto refused0 = at(entry(0, "allreduce", 4, "failed"), 1000), refused1 = at(entry(0, "allreduce", 5, "failed"), 1000);
  auto lines = tools::desync_report({{0, record({refused0, agreed, at(entry(2, "allreduce", 4, "failed"), 3000)}, 3)},
                                     {1, record({refused1, agreed, at(entry(2, "barrier", 0, "failed"), 3000)}, 3)}},
                                    {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "rank 0 ran allreduce (sum) of 4 Float as #2 where rank 1 ran barrier: the ranks issued "
                      "different collectives from here on.");
  auto written_at_the_refusal = record({refused1}, 1);
  written_at_the_refusal["dumped_unix_ms"] = 1001;
  lines = tools::desync_report({{0, record({refused0, agreed, at(entry(2, "allreduce", 4, "started"), 3000, 3000)}, 3)},
                                {1, written_at_the_refusal}},
                               {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("rank 0 waited 3.0 s in collective #2 (allreduce (sum) of 4 Float), which rank 1 never "
                          "joined"), std::string::npos) << lines[0];
}

// #1 refused, but #2, issued before #1's wait threw, completed on both: the
// job died of #1, which is named.
TEST(DesyncReport, ACollectiveIssuedBeforeTheFailureDoesNotMakeItSurvived) {
  const auto lines = tools::desync_report(
      {{0, record({at(entry(1, "allreduce", 4, "failed"), 1000, 50), at(entry(2, "allreduce", 8, "completed"), 1010)}, 3)},
       {1, record({at(entry(1, "allreduce", 5, "failed"), 1000, 50), at(entry(2, "allreduce", 8, "completed"), 1010)}, 3)}},
      {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("as #1 where rank 1 ran allreduce (sum) of 5 Float"), std::string::npos) << lines[0];
}

// Rank 1 ran out of batches and exited 0 while rank 0 waited in #1: said
// so, where the report said it was stopped or died.
TEST(DesyncReport, ARankThatExitedNormallyIsNamedAsSuch) {
  const auto agreed = entry(0, "allreduce", 8, "completed");
  const auto lines = tools::desync_report({{0, record({agreed, entry(1, "allreduce", 4, "started")}, 2)}}, {0, 1}, {},
                                          /*finished=*/{1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("which rank 1 never joined: rank 1 exited normally (code 0) without it, having issued fewer "
                          "collectives than the others"), std::string::npos) << lines[0];
}

// Rank 1 stopped at #5; rank 0 went on to #11, and its buffer of two kept
// only #10 and #11. The report named #10, the first collective both
// records could speak of, as the one rank 1 never started.
TEST(DesyncReport, ARankThatStoppedBeforeWhatTheOthersRememberIsNamedWithItsNumber) {
  const auto lines = tools::desync_report(
      {{0, record({entry(10, "allreduce", 4, "completed"), entry(11, "allreduce", 4, "started")}, 12)},
       {1, record({entry(3, "allreduce", 4, "completed"), entry(4, "allreduce", 4, "completed")}, 5)}},
      {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "rank 1 never started collective #5, which the other ranks' flight records no longer hold: "
                      "they went on past it. Run again with a larger LOCKSTEP_TRACE_BUFFER_SIZE to see which "
                      "collective it was.");
}

} // namespace
} // namespace lockstep
