// PowerSGD with ranks as threads over a HashStore (support/powersgd_checks.h;
// ddp_worker.cpp runs the same checks under mpirun).

#include <lockstep/lockstep.h>

#include "support/powersgd_checks.h"
#include "support/threads.h"

#include <gtest/gtest.h>

namespace lockstep {
namespace {

const testing::Check kCheck = [](bool ok, const std::string& what) {
  if (!ok) {
    ADD_FAILURE() << what;
  }
};

TEST(PowerSGDThreads, TheAverageOfRankRMatricesIsExactAtRankR) {
  for (int world : {2, 3}) {
    testing::spawn(world, [](ProcessGroup& group) { testing::check_powersgd_averages_exactly_at_the_rank(group, kCheck); });
  }
}

TEST(PowerSGDThreads, RanksHoldTheSameParametersWithNoSyncAndStaticGraph) {
  for (bool static_graph : {false, true}) {
    testing::spawn(2, [static_graph](ProcessGroup& group) {
      testing::check_powersgd_ranks_agree(group, static_graph, kCheck);
    });
  }
}

} // namespace
} // namespace lockstep
