// DistributedDataParallel's join: what it refuses before any rank joins.

#include <lockstep/distributed_data_parallel.h>
#include <lockstep/sync_batch_norm.h>

#include "support/errors.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <string>

namespace lockstep {
namespace {

using testing::error_of;

TEST(Join, RefusedWithSyncBatchNormAndWithAHookDividingByTheTrainingRanks) {
  torch::nn::Sequential net(torch::nn::Linear(3, 2), SyncBatchNorm(torch::nn::BatchNormOptions(2)));
  DistributedDataParallel<torch::nn::Sequential> ddp(net, ProcessGroup());
  EXPECT_ERROR_SAYS(ddp->join(), "'1' is a lockstep::SyncBatchNorm", "cannot take part in them");
  torch::nn::Sequential plain(torch::nn::Linear(3, 2));
  DistributedDataParallel<torch::nn::Sequential> hooked(plain, ProcessGroup(), DistributedOptions().comm_hook(comm_hooks::allreduce));
  EXPECT_ERROR_SAYS(hooked->join(JoinOptions().divide_by_initial_world_size(false)), "a comm hook is set");
  {
    auto unwound = hooked->join(); // destroyed without finish(): only leaves join mode
  }
  auto guard = hooked->join(); // the default divisor is fine with a hook
  EXPECT_ERROR_SAYS(hooked->join(), "already joined");
  guard.finish();
  EXPECT_ERROR_SAYS(guard.finish(), "already finished");
}

// A GAN's two wrappers joined together: a rank that ran out sits in one
// guard's finish(), shadowing that model's collectives only, and the ranks
// still training would meet it with the other's. Refused at the second
// join(); after the first guard finishes, the other model may join.
TEST(Join, ASecondWrapperJoinedOnTheSameThreadIsRefused) {
  torch::nn::Sequential generator(torch::nn::Linear(3, 2));
  torch::nn::Sequential discriminator(torch::nn::Linear(2, 1));
  DistributedDataParallel<torch::nn::Sequential> g(generator, ProcessGroup());
  DistributedDataParallel<torch::nn::Sequential> d(discriminator, ProcessGroup());
  {
    auto first = g->join();
    EXPECT_ERROR_SAYS(d->join(), "another DistributedDataParallel is joined on this thread", "Join one model");
    first.finish();
  }
  auto second = d->join();
  second.finish();
  { auto unwound = g->join(); } // leaves join mode without finish()
  auto again = d->join();
  again.finish();
}

} // namespace
} // namespace lockstep
