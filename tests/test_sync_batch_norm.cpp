// SyncBatchNorm over the group of one: exactly BatchNorm, and its conversion
// of a model's BatchNorms.

#include <lockstep/sync_batch_norm.h>
#include <lockstep/process_group.h>

#include "support/errors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

namespace lockstep {
namespace {

using testing::error_of;

TEST(SyncBatchNorm, GroupOfOneIsBatchNormExactly) {
  torch::manual_seed(1);
  torch::nn::BatchNorm2d bn(torch::nn::BatchNormOptions(3).momentum(0.2));
  SyncBatchNorm sync(torch::nn::BatchNormOptions(3).momentum(0.2));
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({4, 3, 2, 5}) * 3 + 1;
    auto a = x.clone().requires_grad_(true);
    auto b = x.clone().requires_grad_(true);
    auto ya = bn(a);
    auto yb = sync(b);
    EXPECT_TRUE(torch::equal(ya, yb));
    (ya * ya).sum().backward();
    (yb * yb).sum().backward();
    EXPECT_TRUE(torch::equal(a.grad(), b.grad()));
    EXPECT_TRUE(torch::equal(bn->weight.grad(), sync->weight.grad()));
  }
  EXPECT_TRUE(torch::equal(bn->running_mean, sync->running_mean));
  EXPECT_TRUE(torch::equal(bn->running_var, sync->running_var));
  bn->eval();
  sync->eval();
  auto x = torch::randn({2, 3, 4, 4});
  EXPECT_TRUE(torch::equal(bn(x), sync(x)));
}

TEST(SyncBatchNorm, CheckpointsMoveToAndFromBatchNorm2d) {
  torch::manual_seed(2);
  SyncBatchNorm sync(torch::nn::BatchNormOptions(4));
  sync(torch::randn({6, 4, 3, 3}) + 2); // running statistics away from 0 and 1
  {
    torch::NoGradGuard no_grad;
    sync->weight.uniform_();
  }
  std::stringstream file;
  torch::save(sync, file);
  torch::nn::BatchNorm2d bn(4);
  torch::load(bn, file);
  for (const auto& name : {"weight", "bias"}) {
    EXPECT_TRUE(torch::equal(bn->named_parameters()[name], sync->named_parameters()[name])) << name;
  }
  for (const auto& name : {"running_mean", "running_var", "num_batches_tracked"}) {
    EXPECT_TRUE(torch::equal(bn->named_buffers()[name], sync->named_buffers()[name])) << name;
  }
  std::stringstream back;
  torch::save(bn, back);
  SyncBatchNorm again(torch::nn::BatchNormOptions(4));
  torch::load(again, back);
  EXPECT_TRUE(torch::equal(again->running_mean, sync->running_mean));
}

TEST(SyncBatchNorm, WrongInputShapeIsAClearError) {
  SyncBatchNorm sync(torch::nn::BatchNormOptions(4));
  EXPECT_ERROR_SAYS(sync(torch::randn({2, 3, 5})), "expected input of shape (N, 4, *), but got [2, 3, 5]");
  EXPECT_ERROR_SAYS(sync(torch::randn({4})), "expected input of shape (N, 4, *)");
  // Across ranks, an integer input's statistics truncated to zeros.
  EXPECT_ERROR_SAYS(sync(torch::ones({2, 4, 5}, torch::kLong)), "expected a floating-point input, but got Long");
}

// Each gave NaN outputs or running statistics without an error.
TEST(SyncBatchNorm, AnEpsOrMomentumThatCannotWorkIsRefused) {
  EXPECT_ERROR_SAYS(SyncBatchNorm(torch::nn::BatchNormOptions(4).eps(-1e-5)), "eps must be a finite number >= 0");
  EXPECT_ERROR_SAYS(SyncBatchNorm(torch::nn::BatchNormOptions(4).eps(std::nan(""))), "but got nan");
  EXPECT_ERROR_SAYS(SyncBatchNorm(torch::nn::BatchNormOptions(4).momentum(1.5)), "momentum must be from 0 to 1");
  EXPECT_ERROR_SAYS(SyncBatchNorm(torch::nn::BatchNormOptions(4).momentum(std::nan(""))), "but got nan");
  SyncBatchNorm cumulative(torch::nn::BatchNormOptions(4).momentum(c10::nullopt).eps(0));
  EXPECT_FALSE(cumulative->options.momentum().has_value());
}

struct MemberNetImpl : torch::nn::Module {
  MemberNetImpl() {
    body = register_module("body", torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4)));
    norm = register_module("norm", torch::nn::BatchNorm1d(4));
  }
  torch::nn::Sequential body{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(MemberNet);

struct ContainersNetImpl : torch::nn::Module {
  ContainersNetImpl() {
    seq = register_module("seq", torch::nn::Sequential(torch::nn::Linear(3, 2), torch::nn::BatchNorm1d(2)));
    list = register_module("list", torch::nn::ModuleList(torch::nn::BatchNorm2d(2), torch::nn::Linear(2, 2)));
    dict = register_module("dict", torch::nn::ModuleDict(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
                                       {"bn", torch::nn::BatchNorm3d(2).ptr()}}));
  }
  torch::nn::Sequential seq{nullptr};
  torch::nn::ModuleList list{nullptr};
  torch::nn::ModuleDict dict{nullptr};
};
TORCH_MODULE(ContainersNet);

TEST(SyncBatchNorm, ConvertReplacesContainerEntriesSharingTheirTensors) {
  ContainersNet net;
  auto old_weight = net->seq[1]->as<torch::nn::BatchNorm1dImpl>()->weight;
  torch::optim::SGD opt(net->parameters(), 1.0); // made before: must keep working
  EXPECT_EQ(convert_sync_batchnorm(net, ProcessGroup()), 3u);
  auto* sync = net->seq[1]->as<SyncBatchNormImpl>();
  ASSERT_NE(sync, nullptr);
  EXPECT_TRUE(sync->weight.is_same(old_weight));
  EXPECT_NE(net->list[0]->as<SyncBatchNormImpl>(), nullptr);
  EXPECT_NE(net->dict["bn"]->as<SyncBatchNormImpl>(), nullptr);
  size_t sync_children = 0;
  for (const auto& m : net->modules()) {
    sync_children += m->as<SyncBatchNormImpl>() != nullptr ? 1 : 0;
    EXPECT_EQ(m->as<torch::nn::BatchNorm1dImpl>(), nullptr);
  }
  EXPECT_EQ(sync_children, 3u);
  EXPECT_EQ(net->named_parameters().size(), 2u + 2u + 2u + 2u + 2u); // linear, bn, bn, linear, bn
  // The Sequential's forward runs the new layer, and the optimizer reaches it.
  auto y = net->seq->forward(torch::randn({5, 3}));
  (y * y).sum().backward();
  ASSERT_TRUE(sync->weight.grad().defined());
  const auto before = sync->weight.clone();
  opt.step();
  EXPECT_FALSE(torch::equal(before, sync->weight));
}

// A frozen BatchNorm (a fine-tuned backbone's) stays frozen once converted,
// as with PyTorch's convert_sync_batchnorm; a trained one still trains.
TEST(SyncBatchNorm, ConvertKeepsFrozenParametersFrozen) {
  ContainersNet net;
  auto* frozen = net->seq[1]->as<torch::nn::BatchNorm1dImpl>();
  frozen->weight.set_requires_grad(false);
  frozen->bias.set_requires_grad(false);
  EXPECT_EQ(convert_sync_batchnorm(net, ProcessGroup()), 3u);
  auto* sync = net->seq[1]->as<SyncBatchNormImpl>();
  ASSERT_NE(sync, nullptr);
  EXPECT_FALSE(sync->weight.requires_grad());
  EXPECT_FALSE(sync->bias.requires_grad());
  EXPECT_TRUE(net->list[0]->as<SyncBatchNormImpl>()->weight.requires_grad());
  EXPECT_TRUE(net->list[0]->as<SyncBatchNormImpl>()->bias.requires_grad());
}

struct OuterNetImpl : torch::nn::Module {
  OuterNetImpl() {
    inner = register_module("inner", MemberNet());
  }
  MemberNet inner{nullptr};
};
TORCH_MODULE(OuterNet);

TEST(SyncBatchNorm, ConvertRefusesMemberFieldsNamingThePathAndChangesNothing) {
  MemberNet net;
  EXPECT_ERROR_SAYS(convert_sync_batchnorm(net, ProcessGroup()),
                    "cannot replace 'norm' (torch::nn::BatchNorm1dImpl), a member of the model",
                    "Declare this one as lockstep::SyncBatchNorm", "Nothing was converted");
  EXPECT_NE(net->body[1]->as<torch::nn::BatchNorm1dImpl>(), nullptr); // the convertible one is untouched too
  OuterNet outer;
  EXPECT_ERROR_SAYS(convert_sync_batchnorm(outer, ProcessGroup()), "cannot replace 'inner.norm'", "a member of 'inner'");
  torch::nn::BatchNorm2d alone(3);
  EXPECT_ERROR_SAYS(convert_sync_batchnorm(alone, ProcessGroup()), "the model itself is a torch::nn::BatchNorm2dImpl");
}

} // namespace
} // namespace lockstep
