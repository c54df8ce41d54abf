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

// PyTorch's powerSGD_hook: the error of a gradient sent whole is what this
// rank had (its gradient plus its error) minus the average that came back,
// as for the compressed ones; at one rank it is always 0.
TEST(PowerSGDThreads, AWholeGradientsErrorIsWhatTheRankHadMinusTheAverage) {
  testing::spawn(2, [](ProcessGroup& group) {
    PowerSGD powersgd(PowerSGDOptions().rank(1).start_iteration(0));
    const double mine = 1.0 + group.rank(); // the average is 1.5
    double error = 0;
    for (int i = 0; i < 3; ++i) {
      auto bucket = testing::bucket_of({torch::ones({16, 8}), torch::full({8}, mine)});
      powersgd(group, bucket)->wait();
      const double average = 1.5; // the ranks' errors, +e and -e, average to 0
      EXPECT_TRUE(torch::allclose(bucket.gradients[1], torch::full({8}, average))) << "iteration " << i;
      error = mine + error - average;
      EXPECT_TRUE(torch::allclose(testing::saved(powersgd, "parameter.1.error"), torch::full({8}, error)))
          << "iteration " << i << " on rank " << group.rank();
    }
  });
}

// Note [Average]: float16 is divided before it is summed. PowerSGD's
// allreduces summed and divided after, so two ranks' 40000 (and Q's of
// 42426, from an 8 x 8 gradient of 15000) came back inf where DDP's own
// allreduce returns them.
TEST(PowerSGDThreads, Float16GradientsAreAveragedWithoutOverflow) {
  const bool cpu_half_matmul = [] { // LibTorch 1.13 has no float16 matmul on the CPU
    try {
      torch::matmul(torch::ones({2, 2}, torch::kHalf), torch::ones({2, 2}, torch::kHalf));
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  testing::spawn(2, [&](ProcessGroup& group) {
    PowerSGD powersgd(PowerSGDOptions().rank(1).start_iteration(0).error_feedback(false));
    std::vector<torch::Tensor> gradients{torch::full({5}, 40000.0, torch::kHalf)};
    if (cpu_half_matmul) {
      gradients.push_back(torch::full({8, 8}, 15000.0, torch::kHalf));
    }
    auto bucket = testing::bucket_of(gradients);
    ASSERT_EQ(bucket.buffer.scalar_type(), torch::kHalf);
    powersgd(group, bucket)->wait();
    EXPECT_TRUE(torch::equal(bucket.gradients[0], gradients[0])) << bucket.gradients[0];
    if (cpu_half_matmul) {
      EXPECT_TRUE(torch::allclose(bucket.gradients[1].to(torch::kFloat), torch::full({8, 8}, 15000.0), 2e-3))
          << bucket.gradients[1];
      EXPECT_GT(powersgd.compression_rate(), 1.0);
    }
  });
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

// A channels-last gradient (DDP's slot for such a weight takes its strides)
// is compressed as the rows its memory holds: the ranks' rank-1 matrices
// average to one of rank 2, which PowerSGD at rank 2 gives back exactly,
// in the gradient's layout. It was refused as not contiguous.
TEST(PowerSGDThreads, AChannelsLastGradientIsAveragedInItsLayout) {
  const auto matrix_of = [](int r) { // output channel x the rest, rank 1
    return torch::arange(1, 17, torch::kFloat).mul(r + 1).view({16, 1, 1, 1}) *
        torch::linspace(-1, 1, 72).add(r).view({1, 8, 3, 3});
  };
  const auto expected = (matrix_of(0) + matrix_of(1)) / 2;
  testing::spawn(2, [&](ProcessGroup& group) {
    auto bucket = testing::bucket_of({torch::zeros({16 * 72})});
    auto grad = bucket.buffer.view({16, 3, 3, 8}).permute({0, 3, 1, 2});
    bucket.gradients[0] = grad;
    grad.copy_(matrix_of(group.rank()));
    PowerSGD powersgd(PowerSGDOptions().rank(2).start_iteration(0).error_feedback(false).warm_start(false));
    powersgd(group, bucket)->wait();
    EXPECT_TRUE(bucket.gradients[0].is_contiguous(torch::MemoryFormat::ChannelsLast));
    EXPECT_LT((bucket.gradients[0] - expected).abs().max().item<double>(), 1e-4 * expected.abs().max().item<double>());
    EXPECT_GT(powersgd.compression_rate(), 1);
  });
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
