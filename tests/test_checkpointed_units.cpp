// ShardingOptions().activation_checkpointing(): each unit, a
// lockstep::Checkpointable, runs its forward as a checkpoint segment (its
// body runs again in backward), with the gradients of the run without it,
// to the bit; a unit that cannot, or no unit at all, is refused at
// construction.

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace lockstep {
namespace {

// A unit that counts how often its body runs.
struct CountingBlockImpl : torch::nn::Cloneable<CountingBlockImpl>, Checkpointable {
  CountingBlockImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed_call([this](const torch::Tensor& in) { return body(in); }, x);
  }
  torch::Tensor body(const torch::Tensor& x) {
    ++runs;
    return torch::tanh(fc(x)) + x;
  }
  int runs = 0;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(CountingBlock);

struct TwoBlocksImpl : torch::nn::Cloneable<TwoBlocksImpl> {
  TwoBlocksImpl() {
    reset();
  }
  void reset() override {
    a = register_module("a", CountingBlock());
    b = register_module("b", CountingBlock());
    head = register_module("head", torch::nn::Linear(8, 2));
    torch::NoGradGuard no_grad;
    int64_t i = 0;
    for (auto& p : parameters()) {
      p.copy_(torch::cos(torch::arange(p.numel(), torch::kFloat) * 0.41 + static_cast<double>(++i)).view_as(p) * 0.4);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(b(a(x)));
  }
  CountingBlock a{nullptr}, b{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TwoBlocks);

torch::Tensor shard_gradients(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> flat;
  for (const auto& p : params) {
    flat.push_back(p.grad().defined() ? p.grad().reshape({-1}) : torch::zeros({p.numel()}));
  }
  return torch::cat(flat);
}

TEST(ShardedCheckpointing, EachUnitRunsAgainInBackwardWithTheSameBits) {
  torch::set_num_threads(1);
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    testing::spawn(2, [&](ProcessGroup& group) {
      torch::Tensor grads[2];
      for (bool checkpointed : {false, true}) {
        TwoBlocks net;
        FullyShardedDataParallel<TwoBlocks> fsdp(
            net, group, ShardingOptions().strategy(strategy).units({"a", "b"}).activation_checkpointing(checkpointed));
        EXPECT_EQ(net->a->activation_checkpointing(), checkpointed);
        const auto x = torch::sin(torch::arange(5 * 8, torch::kFloat) * (0.2 + group.rank())).view({5, 8});
        fsdp(x).pow(2).mean().backward();
        EXPECT_EQ(net->a->runs, checkpointed ? 2 : 1) << "the body again in backward, only when checkpointed";
        EXPECT_EQ(net->b->runs, checkpointed ? 2 : 1);
        grads[checkpointed] = shard_gradients(fsdp->parameters());
      }
      EXPECT_TRUE(torch::equal(grads[0], grads[1])) << "rank " << group.rank();
    });
  }
}

// The wrapper switches checkpointing on in the units that had it off, and
// off again when it ends, leaving the module as the caller gave it; a unit
// the caller had switched on stays on.
TEST(ShardedCheckpointing, TheSwitchesAreTheCallersAgainOnceTheWrapperEnds) {
  testing::spawn(1, [](ProcessGroup& group) {
    TwoBlocks net;
    net->b->set_activation_checkpointing(true);
    {
      FullyShardedDataParallel<TwoBlocks> fsdp(net, group, ShardingOptions().units({"a", "b"}).activation_checkpointing(true));
      EXPECT_TRUE(net->a->activation_checkpointing());
      EXPECT_TRUE(net->b->activation_checkpointing());
    }
    EXPECT_FALSE(net->a->activation_checkpointing()) << "the wrapper's switch outlived it";
    EXPECT_TRUE(net->b->activation_checkpointing()) << "the caller's own switch was turned off";
  });
}

TEST(ShardedCheckpointing, AUnitThatCannotCheckpointIsNamed) {
  testing::spawn(1, [](ProcessGroup& group) {
    EXPECT_ERROR_SAYS((FullyShardedDataParallel<TwoBlocks>(TwoBlocks(), group,
                                                           ShardingOptions().units({"a", "head"}).activation_checkpointing(true))),
                      "ShardingOptions().activation_checkpointing(true): unit 'head' (torch::nn::LinearImpl) cannot run "
                      "as a checkpoint segment. LibTorch modules have no forward hooks");
    EXPECT_ERROR_SAYS((FullyShardedDataParallel<TwoBlocks>(TwoBlocks(), group,
                                                           ShardingOptions().units({""}).activation_checkpointing(true))),
                      "checkpoints each unit but the root, and there is none");
  });
}

} // namespace
} // namespace lockstep
