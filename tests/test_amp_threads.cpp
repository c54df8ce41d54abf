// Mixed precision where threads meet it: DataParallel's replicas under their
// caller's autocast, and GradScaler's agreement across ranks as threads over
// a HashStore (support/amp_checks.h; fsdp_worker.cpp runs it under mpirun).

#include <lockstep/lockstep.h>

#include "../src/dp/worker_pool.h"
#include "support/amp_checks.h"
#include "support/collective_contract.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace {

using testing::kCheck;

TEST(AutocastGuardThreads, IsTheCallingThreadsOnly) {
  auto a = torch::randn({4, 4});
  AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
  torch::ScalarType elsewhere = torch::kBFloat16;
  std::thread([&] { elsewhere = torch::mm(a, a).scalar_type(); }).join();
  EXPECT_EQ(elsewhere, torch::kFloat);
}

// Two optional guards reset in the order they were made: while the inner
// one lives, the thread stays under its autocast, and when it ends the
// thread is as it was before the outer one (not left under autocast).
TEST(AutocastGuardThreads, GuardsEndedOutOfOrderLeaveTheThreadAsItWas) {
  auto a = torch::randn({4, 4});
  std::optional<AutocastGuard> outer(std::in_place, torch::kCPU, torch::kBFloat16);
  std::optional<AutocastGuard> inner(std::in_place, torch::kCPU, torch::kBFloat16);
  outer.reset();
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16) << "the inner guard still lives";
  inner.reset();
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat) << "the thread stayed under autocast";
}

// Ended on another thread, a guard cannot restore its own thread's state:
// an error that says so, rather than leaving that thread under autocast
// without a word.
TEST(AutocastGuardThreads, AGuardEndedOnAnotherThreadIsAnError) {
  AutocastGuard* guard = nullptr; // not a unique_ptr: its reset() is noexcept, and this destructor throws
  std::thread([&] { guard = new AutocastGuard(torch::kCPU, torch::kBFloat16); }).join();
  std::string error;
  std::thread([&] { error = testing::message_of([&] { delete guard; }); }).join();
  EXPECT_NE(error.find("destroyed on another thread than the one that made it"), std::string::npos) << error;
}

// Under the caller's guard every replica computes in bfloat16, and after the
// weights change no replica reuses a low-precision copy of the old ones
// (Note [Mixed precision]): each guard's outputs match the bare module's.
TEST(DataParallel, ReplicasRunUnderTheCallersAutocastAndNeverReuseStaleCasts) {
  torch::manual_seed(0);
  torch::nn::Linear bare(16, 8);
  torch::nn::Linear wrapped(16, 8);
  {
    torch::NoGradGuard no_grad;
    wrapped->weight.copy_(bare->weight);
    wrapped->bias.copy_(bare->bias);
  }
  DataParallel<torch::nn::Linear> dp(wrapped, DataParallelOptions().devices(
      std::vector<torch::Device>(2, torch::Device(torch::kCPU))));
  const auto x = torch::randn({8, 16});
  for (int step = 0; step < 3; ++step) {
    torch::Tensor expected;
    torch::Tensor got;
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      expected = bare->forward(x);
      got = dp->forward(x);
    }
    ASSERT_EQ(got.scalar_type(), torch::kBFloat16) << "step " << step;
    EXPECT_TRUE(torch::allclose(got.to(torch::kFloat), expected.to(torch::kFloat), 1e-2, 1e-2))
        << "step " << step << ": a replica's output differs from the bare module's by "
        << (got.to(torch::kFloat) - expected.to(torch::kFloat)).abs().max().item<float>();
    torch::NoGradGuard no_grad; // an optimizer step, as large as the weights
    bare->weight.add_(1.0);
    wrapped->weight.add_(1.0);
  }
}

// The replica threads keep no cast from one step to the next: a weight that
// is a leaf tensor, updated between two steps, is cast afresh (ATen caches
// its casts per thread until the outermost autocast scope ends, and a worker
// thread has none of its own).
TEST(DataParallel, ReplicaThreadsDropTheirCastCacheAfterEachStep) {
  detail::WorkerPool pool({1, 1});
  const std::vector<torch::Device> devices(2, torch::Device(torch::kCPU));
  const auto x = torch::randn({4, 8});
  auto w = torch::randn({8, 8}, torch::requires_grad());
  for (int step = 0; step < 2; ++step) {
    std::vector<torch::Tensor> outputs(2);
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      detail::map_replicas(pool, {0, 1}, devices, "forward", [&](size_t r) { outputs[r] = torch::mm(x, w); });
    }
    const auto fresh = torch::mm(x.to(torch::kBFloat16), w.detach().to(torch::kBFloat16));
    for (size_t r = 0; r < 2; ++r) {
      ASSERT_EQ(outputs[r].scalar_type(), torch::kBFloat16) << "replica " << r;
      EXPECT_TRUE(torch::equal(outputs[r], fresh)) << "step " << step << ", replica " << r
                                                   << " computed with a cast of the weight before the update";
    }
    torch::NoGradGuard no_grad;
    w.add_(1.0);
  }
}

TEST(GradScalerThreads, UnderDdpAnInfOnOneRankSkipsOnEveryRank) {
  testing::spawn(2, [](ProcessGroup& group) { testing::check_ddp_scaler_skips_together(group, kCheck); });
}

TEST(GradScalerThreads, UnderFsdpTheGroupMakesEveryRankSkipAnInfInOneShard) {
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    testing::spawn(2, [&](ProcessGroup& group) { testing::check_fsdp_scaler_skips_together(group, strategy, kCheck); });
  }
  testing::spawn(2, [](ProcessGroup& group) { testing::check_fsdp_scaler_without_group_is_refused(group, kCheck); });
}

// The scaler's agreement on found-inf is a collective of its own: where
// the ranks' collectives part (one rank steps, the other reduces something
// else), the error of the rank that unscales names it, as DDP's and FSDP's
// name theirs, instead of an unnamed "allreduce (max) of 4 Float".
TEST(GradScalerThreads, ItsFoundInfAgreementIsNamedInErrors) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        auto w = torch::ones({4}, torch::requires_grad());
        torch::optim::SGD sgd({w}, 0.1);
        GradScaler scaler(GradScalerOptions().group(group));
        scaler.scale(w.sum()).backward();
        const std::string message = testing::message_of([&] {
          if (group.rank() == 0) {
            scaler.unscale_(sgd);
          } else {
            group.allreduce_async({torch::ones({3})}, ReduceOp::Max)->wait();
          }
        });
        std::lock_guard<std::mutex> lock(mutex);
        errors[group.rank()] = message;
      },
      std::chrono::seconds(20));
  EXPECT_NE(errors[0].find("GradScaler's found-inf agreement (unscale_): ranks disagree on this collective"),
            std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0 runs allreduce (max) of 4 Float elements for the optimizer whose parameters' "
                           "shapes hash to"),
            std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("but rank 1 runs allreduce (max) of 3 Float elements."), std::string::npos) << errors[1];
}

// A scaler whose state one rank alone loaded scaled that rank's loss by
// another factor; each rank divided the averaged gradients by its own, and
// the ranks stepped apart without a word.
TEST(GradScalerThreads, RanksWhoseScalesDifferAreAnErrorOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        auto w = torch::ones({4}, torch::requires_grad());
        torch::optim::SGD sgd({w}, 0.1);
        GradScaler scaler(GradScalerOptions().group(group).init_scale(group.rank() == 0 ? 65536.0 : 1024.0));
        scaler.scale(w.sum()).backward();
        const std::string message = testing::message_of([&] { scaler.unscale_(sgd); });
        std::lock_guard<std::mutex> lock(mutex);
        errors[group.rank()] = message;
      },
      std::chrono::seconds(20));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + " of the scaler's group scaled its loss by " +
                             (r == 0 ? "65536" : "1024") + ", and the ranks' scales range from 1024 to 65536"),
              std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// Each optimizer's found-inf agreement is one allreduce of four floats. Two
// optimizers unscaled in another order on one rank (a GAN's two networks
// behind a branch on the rank) would swap their verdicts, and a rank would
// take the step whose gradient overflowed on another: an error on every
// rank instead, naming the cause (Note [Collective tags]).
TEST(GradScalerThreads, OptimizersUnscaledInAnotherOrderOnOneRankAreAnErrorOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        auto generator = torch::ones({4}, torch::requires_grad());
        auto critic = torch::ones({6}, torch::requires_grad());
        torch::optim::SGD generator_sgd({generator}, 0.1), critic_sgd({critic}, 0.1);
        GradScaler scaler(GradScalerOptions().group(group));
        scaler.scale(generator.sum() + critic.sum()).backward();
        const std::string message = testing::message_of([&] {
          auto& first = group.rank() == 0 ? generator_sgd : critic_sgd;
          auto& second = group.rank() == 0 ? critic_sgd : generator_sgd;
          scaler.unscale_(first);
          scaler.unscale_(second);
        });
        std::lock_guard<std::mutex> lock(mutex);
        errors[group.rank()] = message;
      },
      std::chrono::seconds(20));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("GradScaler's found-inf agreement (unscale_): ranks disagree on this collective"),
              std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("for the optimizer whose parameters' shapes hash to"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("optimizers unscaled in another order on some rank"), std::string::npos) << errors[r];
  }
}

} // namespace
} // namespace lockstep
