// PowerSGD with ranks as threads over a HashStore (support/powersgd_checks.h;
// ddp_worker.cpp runs the same checks under mpirun).

#include <lockstep/lockstep.h>

#include "support/powersgd_checks.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

namespace lockstep {
namespace {

using testing::kCheck;

TEST(PowerSGDThreads, TheAverageOfRankRMatricesIsExactAtRankR) {
  for (int world : {2, 3}) {
    testing::spawn(world, [](ProcessGroup& group) { testing::check_powersgd_averages_exactly_at_the_rank(group, kCheck); });
  }
}

TEST(PowerSGDThreads, AZeroGradientAndAnOverflowDoNotBecomeTheState) {
  for (int world : {2, 3}) {
    testing::spawn(world, [](ProcessGroup& group) { testing::check_powersgd_recovers_from_zero_and_inf(group, kCheck); });
  }
}

TEST(PowerSGDThreads, RanksHoldTheSameParametersWithNoSyncAndStaticGraph) {
  for (bool static_graph : {false, true}) {
    testing::spawn(2, [static_graph](ProcessGroup& group) {
      testing::check_powersgd_ranks_agree(group, static_graph, kCheck);
    });
  }
}

TEST(PowerSGDThreads, UnderJoinARankThatRanOutShadowsTheHookWithZeros) {
  for (int world : {2, 3}) {
    testing::spawn(world, [](ProcessGroup& group) { testing::check_powersgd_under_join(group, kCheck); });
  }
}

// NCCL refuses two ranks on one GPU: a group of one checks the hook's
// collectives and arithmetic on the device.
TEST(PowerSGDThreads, OneGpuOverNcclIsExactAtTheMatrixRank_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  auto group = new_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, "nccl");
  auto generator = at::detail::createCPUGenerator(3);
  auto m = torch::matmul(torch::randn({64, 2}, generator, torch::kFloat), torch::randn({2, 32}, generator, torch::kFloat));
  auto bucket = testing::bucket_of({m.cuda(), torch::ones({7}).cuda()}, 0, torch::kCUDA);
  PowerSGD powersgd(PowerSGDOptions().rank(2).start_iteration(0).error_feedback(false).warm_start(false));
  auto result = powersgd(group, bucket)->wait();
  EXPECT_TRUE(result.is_cuda());
  EXPECT_LT((bucket.gradients[0].cpu() - m).abs().max().item<double>(), 1e-3);
  EXPECT_TRUE(torch::equal(bucket.gradients[1].cpu(), torch::ones({7})));
}

} // namespace
} // namespace lockstep
