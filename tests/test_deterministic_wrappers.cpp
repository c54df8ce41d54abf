// FullyShardedDataParallel's deterministic mode with ranks as threads: each
// strategy at W = 1, 2, 3 and 4 gives the bits of DistributedDataParallel
// on one rank (Note [Sharded exact sums] in src/fsdp/deterministic.cpp), and
// so does DataParallel's; and each refusal of their own.

#include <lockstep/lockstep.h>

#include "support/deterministic_checks.h"
#include "support/errors.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace lockstep {
namespace {

using testing::DeterministicNet;
using testing::DeterministicRun;

class DeterministicSharded : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::set_num_threads(1); // Note [The same bits at any world size]
  }
};
using DeterministicDataParallel = DeterministicSharded;

TEST_F(DeterministicSharded, EveryStrategyGivesOneDdpRanksBitsAtOneToFourRanks) {
  for (const char* wrapper : {"full", "grad-op", "no-shard", "full-reordered"}) {
    DeterministicRun run;
    run.wrapper = wrapper;
    for (int world : {1, 2, 3, 4}) {
      testing::spawn(world, [&](ProcessGroup& group) { testing::check_same_bits_as_one_rank(group, run, testing::kCheck); });
    }
  }
}

TEST_F(DeterministicSharded, AdamWithClippingGivesOneDdpRanksBits) {
  DeterministicRun run;
  run.optimizer = "adam";
  run.clip = 0.05;
  for (const char* wrapper : {"full", "no-shard", "full-reordered"}) {
    run.wrapper = wrapper;
    for (int world : {2, 3}) {
      testing::spawn(world, [&](ProcessGroup& group) { testing::check_same_bits_as_one_rank(group, run, testing::kCheck); });
    }
  }
}

TEST_F(DeterministicSharded, BatchNormGivesOneDdpRanksBits) {
  DeterministicRun run;
  run.batch_norm = true;
  for (const char* wrapper : {"full", "grad-op"}) {
    run.wrapper = wrapper;
    for (int world : {2, 4}) {
      testing::spawn(world, [&](ProcessGroup& group) { testing::check_same_bits_as_one_rank(group, run, testing::kCheck); });
    }
  }
}

// DataParallel on two CPU replicas: DDP's bits, with BatchNorm, dropout and
// clipping under Adam (one process: the micro-batches run in turn on the
// caller's thread, so dropout's generator is its own).
TEST_F(DeterministicDataParallel, GivesOneDdpRanksBits) {
  DeterministicRun run;
  run.wrapper = "dp";
  run.dropout = 0.3;
  for (const char* optimizer : {"sgd", "adam"}) {
    run.optimizer = optimizer;
    run.batch_norm = run.optimizer == "adam";
    run.clip = run.optimizer == "adam" ? 0.05 : 0;
    testing::check_same_bits_as_one_rank(ProcessGroup(), run, testing::kCheck);
  }
}

TEST_F(DeterministicDataParallel, RefusesAMisusedStep) {
  const auto options = DataParallelOptions().devices({torch::kCPU, torch::kCPU}).deterministic(true).micro_batches(4)
                           .micro_batch_size(3);
  EXPECT_ERROR_SAYS(DataParallel<DeterministicNet>(DeterministicNet(), DataParallelOptions().deterministic(true)),
                    "lockstep::DataParallel (deterministic)", "needs micro_batches(V)");
  DataParallel<DeterministicNet> dp(DeterministicNet(), options);
  const auto x = torch::ones({3, 7});
  EXPECT_ERROR_SAYS(dp->forward(x), "outside backward_micro_batches");
  EXPECT_ERROR_SAYS(dp->backward_micro_batches(0, [&](int64_t) { return dp->forward(torch::ones({2, 7})).sum(); }),
                    "micro-batch 0's forward got a batch of 2");
  {
    torch::NoGradGuard no_grad;
    EXPECT_EQ(dp->forward(torch::ones({6, 7})).size(0), 6); // evaluation, on the replicas
  }
  dp->backward_micro_batches(0, [&](int64_t) { return dp->forward(x).sum(); });
  for (const auto& p : dp->parameters()) {
    EXPECT_TRUE(p.grad().defined());
  }
  DataParallel<DeterministicNet> plain(DeterministicNet(), DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  EXPECT_ERROR_SAYS(plain->backward_micro_batches(0, [&](int64_t) { return plain->forward(x).sum(); }),
                    "needs DataParallelOptions().deterministic(true)");
}

// A step of `dp` on fixed micro-batches of `net`'s inputs.
void dp_step(DataParallel<DeterministicNet>& dp, int64_t step) {
  const auto batch = testing::global_batch(12, step);
  dp->backward_micro_batches(step, [&](int64_t v) {
    return torch::mse_loss(dp->forward(batch.first.narrow(0, 3 * v, 3)), batch.second.narrow(0, 3 * v, 3));
  });
}

DataParallelOptions dp_deterministic() {
  return DataParallelOptions().devices({torch::kCPU, torch::kCPU}).deterministic(true).micro_batches(4);
}

// DeterministicNet with fc1's weight registered under a second name too.
struct TiedNetImpl : torch::nn::Cloneable<TiedNetImpl> {
  TiedNetImpl() {
    reset();
  }
  void reset() override {
    net = register_module("net", DeterministicNet());
    register_parameter("tied", net->fc1->weight);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return net->forward(x);
  }
  DeterministicNet net{nullptr};
};
TORCH_MODULE(TiedNet);

// A tied weight is one parameter: its gradient is the mean over the
// micro-batches, as DistributedDataParallel gives it, not the zeros of its
// second name.
TEST_F(DeterministicDataParallel, ATiedWeightGetsItsGradientOnce) {
  TiedNet tied, reference;
  DataParallel<TiedNet> dp(tied, dp_deterministic());
  DistributedDataParallel<TiedNet> ddp(reference, ProcessGroup(),
                                       DistributedOptions().deterministic(true).micro_batches(4));
  const auto batch = testing::global_batch(12, 0);
  dp->backward_micro_batches(0, [&](int64_t v) {
    return torch::mse_loss(dp->forward(batch.first.narrow(0, 3 * v, 3)), batch.second.narrow(0, 3 * v, 3));
  });
  ddp->backward_micro_batches(0, [&](int64_t v) {
    return torch::mse_loss(ddp->forward(batch.first.narrow(0, 3 * v, 3)), batch.second.narrow(0, 3 * v, 3));
  });
  const auto& grad = tied->net->fc1->weight.grad();
  ASSERT_TRUE(grad.defined());
  EXPECT_GT(grad.abs().max().item<double>(), 0);
  EXPECT_TRUE(torch::equal(grad, reference->net->fc1->weight.grad()));
}

// A parameter frozen when DataParallel wrapped the module and unfrozen later
// gets the mean over the micro-batches, as the others, not their sum; one
// no micro-batch gives a gradient keeps none, so the optimizer skips it.
TEST_F(DeterministicDataParallel, AParameterUnfrozenLaterGetsTheMeanAndAnUnusedOneNone) {
  DeterministicNet unfrozen, trained;
  unfrozen->fc1->weight.requires_grad_(false);
  DataParallel<DeterministicNet> dp(unfrozen, dp_deterministic());
  DataParallel<DeterministicNet> reference(trained, dp_deterministic());
  dp_step(dp, 0);
  EXPECT_FALSE(unfrozen->fc1->weight.grad().defined());
  unfrozen->fc1->weight.requires_grad_(true);
  dp_step(dp, 1);
  dp_step(reference, 1);
  ASSERT_TRUE(unfrozen->fc1->weight.grad().defined());
  EXPECT_TRUE(torch::equal(unfrozen->fc1->weight.grad(), trained->fc1->weight.grad()));
}

ShardingOptions sharded_deterministic() {
  return ShardingOptions().deterministic(true).micro_batches(4).micro_batch_size(3);
}

TEST_F(DeterministicSharded, RefusesAMisusedStep) {
  EXPECT_ERROR_SAYS(FullyShardedDataParallel<DeterministicNet>(DeterministicNet(), ProcessGroup(),
                                                               ShardingOptions().deterministic(true)),
                    "lockstep::FullyShardedDataParallel (deterministic, rank 0 of 1)", "needs micro_batches(V)");
  testing::spawn(3, [](ProcessGroup& group) {
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<DeterministicNet>(DeterministicNet(), group, sharded_deterministic()),
                      "micro_batches(4) is not a multiple of the world size 3");
  });
  DeterministicNet net;
  FullyShardedDataParallel<DeterministicNet> fsdp(net, ProcessGroup(), sharded_deterministic());
  const auto x = torch::ones({3, 7});
  auto loss_of = [&](int64_t) { return fsdp->forward(x).sum(); };
  EXPECT_ERROR_SAYS(fsdp->forward(x), "outside backward_micro_batches", "NoGradGuard");
  EXPECT_ERROR_SAYS(fsdp->backward_micro_batches(0, [&](int64_t) { return fsdp->forward(torch::ones({2, 7})).sum(); }),
                    "micro-batch 0's forward got a batch of 2", "micro_batch_size is 3");
  EXPECT_ERROR_SAYS(fsdp->backward_micro_batches(0, [&](int64_t) { return fsdp->forward(x); }),
                    "loss_of(0) must return the micro-batch's loss", "9 elements");
  EXPECT_ERROR_SAYS([&] {
    auto guard = fsdp->no_sync();
    fsdp->backward_micro_batches(0, loss_of);
  }(), "no_sync() has no use");
  EXPECT_ERROR_SAYS([&] {
    auto full = fsdp->summon_full_params();
    fsdp->backward_micro_batches(0, loss_of);
  }(), "inside summon_full_params()");
  EXPECT_ERROR_SAYS(fsdp->clip_grad_norm_(1.0), "clip_grad_norm_ before backward_micro_batches");
  {
    torch::NoGradGuard no_grad;
    EXPECT_EQ(fsdp->forward(x).size(0), 3); // evaluation
  }
  // Each refusal left the wrapper usable: a step gives every shard a gradient.
  fsdp->backward_micro_batches(1, loss_of);
  for (const auto& shard : fsdp->parameters()) {
    EXPECT_TRUE(shard.grad().defined());
  }
  DeterministicNet other;
  FullyShardedDataParallel<DeterministicNet> plain(other, ProcessGroup());
  EXPECT_ERROR_SAYS(plain->backward_micro_batches(0, loss_of), "needs ShardingOptions().deterministic(true)");
}

// The shards' gradient is the mean over the global batch, as the whole
// batch's backward through the bare module gives it, to float rounding.
TEST_F(DeterministicSharded, TheGradientIsTheMeanOverTheGlobalBatch) {
  const auto batch = testing::global_batch(12, 0);
  DeterministicNet bare;
  torch::mse_loss(bare->forward(batch.first), batch.second).backward();
  testing::spawn(2, [&](ProcessGroup& group) {
    DeterministicNet net;
    FullyShardedDataParallel<DeterministicNet> fsdp(net, group, sharded_deterministic());
    fsdp->backward_micro_batches(0, [&](int64_t v) {
      return torch::mse_loss(fsdp->forward(batch.first.narrow(0, v * 3, 3)), batch.second.narrow(0, v * 3, 3));
    });
    std::vector<torch::Tensor> expected;
    for (const auto& p : bare->parameters()) {
      expected.push_back(p.grad().reshape({-1}));
    }
    const auto whole = torch::cat(expected);
    int64_t at = 0; // the flats hold fc1's then fc2's parameters, in order, each padded to a multiple of 2
    const auto infos = fsdp->flat_params();
    const auto shards = fsdp->parameters();
    ASSERT_EQ(infos.size(), shards.size());
    for (size_t i = 0; i < infos.size(); ++i) {
      const auto& info = infos[i];
      const auto shard = shards[i].grad();
      const auto mine = shard.narrow(0, 0, std::min(info.shard_numel, info.numel - group.rank() * info.shard_numel));
      EXPECT_TRUE(torch::allclose(mine, whole.narrow(0, at + group.rank() * info.shard_numel, mine.numel()), 1e-5, 1e-6))
          << info.unit;
      at += info.numel;
    }
  });
}

} // namespace
} // namespace lockstep
