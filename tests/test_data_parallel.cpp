// lockstep::DataParallel against the bare module: same outputs, same
// gradients, same parameters after several optimizer steps.

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/dp_models.h"
#include "support/modules.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <numeric>
#include <optional>
#include <thread>

namespace lockstep {
namespace {

using namespace testing::dp_models;

using testing::deep_copy;
using testing::expect_buffers_close;
using testing::expect_params_close;
using testing::error_of;
using testing::same_answer;

// --- numerical equivalence ------------------------------------------------

TEST(DataParallel, MlpMatchesBareModule) {
  torch::manual_seed(1);
  auto x = torch::randn({10, 16});
  auto y = torch::randn({10, 4});
  // 10 rows over 3 replicas: uneven chunks 4, 3, 3.
  expect_same_training(Mlp(), DataParallelOptions().devices(cpus(3)), 6, [&](int s, auto&& run) {
    return torch::mse_loss(run(x + s), y);
  });
}

TEST(DataParallel, WeightedChunksMatchBareModule) {
  torch::manual_seed(2);
  auto x = torch::randn({12, 16});
  auto y = torch::randn({12, 4});
  expect_same_training(Mlp(), DataParallelOptions().devices(cpus(2)).weights({3, 1}), 4, [&](int, auto&& run) {
    return torch::mse_loss(run(x), y);
  });
}

TEST(DataParallel, TwoInputsOneBroadcastMatchBareModule) {
  torch::manual_seed(3);
  auto x = torch::randn({9, 8});
  auto y = torch::randn({9, 2});
  auto table = torch::randn({1, 8});
  expect_same_training(TwoInput(), DataParallelOptions().devices(cpus(2)), 4, [&](int, auto&& run) {
    return torch::mse_loss(run(x, broadcast(table)), y);
  });
}

TEST(DataParallel, BroadcastInputGetsSummedGradient) {
  TwoInput bare;
  DataParallel<TwoInput> dp(deep_copy(bare), DataParallelOptions().devices(cpus(3)));
  auto x = torch::randn({7, 8});
  auto t1 = torch::randn({1, 8}, torch::requires_grad());
  auto t2 = t1.detach().clone().requires_grad_(true);
  bare(x, t1).pow(2).sum().backward();
  dp(x, broadcast(t2)).pow(2).sum().backward();
  ASSERT_TRUE(t2.grad().defined());
  EXPECT_TRUE(torch::allclose(t1.grad(), t2.grad(), 1e-5, 1e-6));
}

TEST(DataParallel, SplitInputGetsGradient) {
  Mlp bare;
  DataParallel<Mlp> dp(deep_copy(bare), DataParallelOptions().devices(cpus(2)));
  auto x1 = torch::randn({5, 16}, torch::requires_grad());
  auto x2 = x1.detach().clone().requires_grad_(true);
  bare(x1 * 2).sum().backward();
  dp(x2 * 2).sum().backward(); // x2 * 2 is not a leaf: the gradient flows on through it
  ASSERT_TRUE(x2.grad().defined());
  EXPECT_TRUE(torch::allclose(x1.grad(), x2.grad(), 1e-5, 1e-6));
}

TEST(DataParallel, TupleOutputMatchesBareModule) {
  torch::manual_seed(4);
  auto x = torch::randn({8, 6});
  auto y = torch::randn({8, 3});
  expect_same_training(TupleOut(), DataParallelOptions().devices(cpus(2)), 4, [&](int, auto&& run) {
    std::tuple<torch::Tensor, torch::Tensor> out = run(x);
    return torch::mse_loss(std::get<0>(out), y) + std::get<1>(out).pow(2).mean();
  });
}

TEST(DataParallel, VectorAndMapInputsMatchBareModule) {
  torch::manual_seed(5);
  std::vector<torch::Tensor> xs{torch::randn({6, 5}), torch::randn({6, 5})};
  std::map<std::string, torch::Tensor> extra{{"w", torch::randn({6, 1})}};
  auto y = torch::randn({6, 2});
  expect_same_training(ContainerIn(), DataParallelOptions().devices(cpus(3)), 4, [&](int, auto&& run) {
    return torch::mse_loss(run(xs, extra, 0.5), y);
  });
}

TEST(DataParallel, PairOptionalAndArrayAreSplitGatheredAndGetGradients) {
  torch::manual_seed(6);
  AllContainers bare;
  AllContainers copy = deep_copy(bare);
  DataParallel<AllContainers> dp(copy, DataParallelOptions().devices(cpus(3)));
  // Inputs needing a gradient, one set per side, inside each kind of container.
  auto make = [] {
    torch::manual_seed(7);
    return std::make_tuple(torch::randn({7, 4}, torch::requires_grad()), torch::randn({7, 4}),
                           torch::randn({7, 3}, torch::requires_grad()), torch::randn({7, 4}),
                           torch::randn({7, 4}, torch::requires_grad()));
  };
  auto [x1, y1, m1, a1, b1] = make();
  auto [x2, y2, m2, a2, b2] = make();
  auto run = [](auto& net, auto x, auto y, auto m, auto a, auto b) {
    return net(std::make_pair(x, y), c10::optional<torch::Tensor>(m), std::array<torch::Tensor, 2>{a, b},
               std::optional<torch::Tensor>());
  };
  auto out_bare = run(bare, x1, y1, m1, a1, b1);
  auto out_dp = run(dp, x2, y2, m2, a2, b2);
  // Gathered: all 7 rows, not 3 whole copies of them.
  ASSERT_EQ(out_dp.first.sizes(), out_bare.first.sizes());
  EXPECT_TRUE(torch::allclose(out_dp.first, out_bare.first, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(out_dp.second[0], out_bare.second[0], 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(out_dp.second[1], out_bare.second[1], 1e-5, 1e-6));
  (out_bare.second[0].pow(2).sum() + out_bare.second[1].sum()).backward();
  (out_dp.second[0].pow(2).sum() + out_dp.second[1].sum()).backward();
  // The gradient reaches each input through its container.
  for (const auto& [bare_input, dp_input] : {std::make_pair(x1, x2), std::make_pair(m1, m2), std::make_pair(b1, b2)}) {
    ASSERT_TRUE(dp_input.grad().defined());
    EXPECT_TRUE(torch::allclose(dp_input.grad(), bare_input.grad(), 1e-5, 1e-6));
  }
  auto bare_params = bare->parameters();
  auto dp_params = copy->parameters();
  for (size_t i = 0; i < bare_params.size(); ++i) {
    ASSERT_TRUE(dp_params[i].grad().defined());
    EXPECT_TRUE(torch::allclose(dp_params[i].grad(), bare_params[i].grad(), 1e-5, 1e-6));
  }
}

// Elementwise, so that splitting along dim 1 is meaningful.
struct ScaleImpl : torch::nn::Cloneable<ScaleImpl> {
  ScaleImpl() {
    reset();
  }
  void reset() override {
    w = register_parameter("w", torch::ones({3, 1}) * 2);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x * w;
  }
  torch::Tensor w;
};
TORCH_MODULE(Scale);

TEST(DataParallel, SplitAndGatherAlongAnotherDimension) {
  Scale bare;
  Scale net = deep_copy(bare);
  DataParallel<Scale> dp(net, DataParallelOptions().devices(cpus(2)).dim(1));
  auto z = torch::randn({3, 8});
  auto out = dp(z);
  EXPECT_EQ(out.sizes(), z.sizes());
  EXPECT_TRUE(same_answer(out, bare(z)));
  out.pow(2).sum().backward();
  bare(z).pow(2).sum().backward();
  EXPECT_TRUE(torch::allclose(net->w.grad(), bare->w.grad(), 1e-5, 1e-6));
  // lockstep::split overrides the dimension for one argument.
  DataParallel<Scale> rows(deep_copy(bare), DataParallelOptions().devices(cpus(2)));
  EXPECT_THROW(rows(z), c10::Error); // 3 rows, but w has 3 rows for the full batch
  // Outputs are still gathered along the DataParallel's dim 0.
  auto expected = torch::cat({bare(z.narrow(1, 0, 4)), bare(z.narrow(1, 4, 4))}, 0);
  EXPECT_TRUE(same_answer(rows(lockstep::split(z, 1)), expected));
}

TEST(DataParallel, GradientAccumulationOverSeveralPasses) {
  Mlp bare;
  Mlp copy = deep_copy(bare);
  DataParallel<Mlp> dp(copy, DataParallelOptions().devices(cpus(2)));
  for (int i = 0; i < 3; ++i) {
    auto x = torch::randn({6, 16});
    bare(x).sum().backward();
    dp(x).sum().backward();
  }
  auto pb = bare->parameters();
  auto pd = copy->parameters();
  for (size_t i = 0; i < pb.size(); ++i) {
    EXPECT_TRUE(torch::allclose(pb[i].grad(), pd[i].grad(), 1e-5, 1e-6));
  }
}

TEST(DataParallel, ParameterHooksSeeTheBareGradient) {
  Mlp bare;
  Mlp net = deep_copy(bare);
  DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2)));
  std::vector<torch::Tensor> seen_bare, seen_dp;
  bare->fc1->weight.register_hook([&](torch::Tensor g) { seen_bare.push_back(g.clone()); });
  net->fc1->weight.register_hook([&](torch::Tensor g) { seen_dp.push_back(g.clone()); });
  for (int i = 0; i < 2; ++i) { // the second pass adds into a defined .grad
    auto x = torch::randn({6, 16});
    bare(x).sum().backward();
    dp(x).sum().backward();
  }
  ASSERT_EQ(seen_dp.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(seen_dp[i].defined());
    EXPECT_TRUE(torch::allclose(seen_bare[i], seen_dp[i], 1e-5, 1e-6));
  }
}

TEST(DataParallel, ParameterHookThatChangesTheGradientAppliesOnce) {
  Mlp bare;
  Mlp net = deep_copy(bare);
  DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2)));
  int calls = 0;
  for (auto* m : {&bare, &net}) {
    (*m)->fc2->bias.register_hook([&calls](torch::Tensor g) {
      ++calls;
      return g * 3;
    });
  }
  auto x = torch::randn({6, 16});
  bare(x).sum().backward();
  dp(x).sum().backward();
  EXPECT_EQ(calls, 2); // once for the bare module, once for DataParallel
  EXPECT_TRUE(torch::allclose(bare->fc2->bias.grad(), net->fc2->bias.grad(), 1e-5, 1e-6));
}

TEST(DataParallel, RetainGraphAllowsSecondBackward) {
  Mlp bare;
  Mlp copy = deep_copy(bare);
  DataParallel<Mlp> dp(copy, DataParallelOptions().devices(cpus(2)));
  auto x = torch::randn({4, 16});
  auto lb = bare(x).sum();
  auto ld = dp(x).sum();
  lb.backward({}, /*retain_graph=*/true);
  lb.backward();
  ld.backward({}, /*retain_graph=*/true);
  ld.backward();
  EXPECT_TRUE(torch::allclose(bare->fc1->weight.grad(), copy->fc1->weight.grad(), 1e-5, 1e-6));
  auto again = error_of([&] { ld.backward(); });
  EXPECT_NE(again.find("second time"), std::string::npos) << again;
}

// The bare module's forward on DataParallel's chunks of `x` (`sizes` rows
// each, from the same buffers), leaving its buffers as DataParallel keeps
// them: chunk 0's (Broadcast) or the average weighted by rows (Average).
torch::Tensor forward_as_replicas(Cnn& bare, const torch::Tensor& x, const std::vector<int64_t>& sizes,
                                  BufferSync sync) {
  std::vector<torch::Tensor> initial, after0, sum;
  for (auto& b : bare->named_buffers()) {
    initial.push_back(b.value().clone());
  }
  std::vector<torch::Tensor> outs;
  int64_t offset = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    outs.push_back(bare(x.narrow(0, offset, sizes[k])));
    offset += sizes[k];
    auto now = bare->named_buffers();
    for (size_t i = 0; i < now.size(); ++i) {
      torch::NoGradGuard g;
      auto v = now[i].value().clone();
      if (k == 0) {
        after0.push_back(v);
        sum.push_back(v.is_floating_point() ? v * (5.0 / 8) : v);
      } else if (v.is_floating_point()) {
        sum[i] = sum[i] + v * (3.0 / 8);
      }
      now[i].value().data().copy_(initial[i]); // .data(): as DataParallel, see average_buffers
    }
  }
  {
    torch::NoGradGuard g;
    auto now = bare->named_buffers();
    for (size_t i = 0; i < now.size(); ++i) {
      now[i].value().data().copy_(sync == BufferSync::Average ? sum[i] : after0[i]);
    }
  }
  return torch::cat(outs);
}

// BatchNorm in training mode normalises each replica's chunk with that chunk's
// statistics (as PyTorch's DataParallel does); the reference is therefore the
// bare module run on the same chunks, with buffers kept as BufferSync says.
void cnn_equivalence(BufferSync sync) {
  torch::manual_seed(7);
  const std::vector<int64_t> sizes{5, 3};
  Cnn bare;
  Cnn copy = deep_copy(bare);
  DataParallel<Cnn> dp(copy, DataParallelOptions().devices(cpus(2)).weights({5, 3}).buffers(sync));
  torch::optim::SGD opt_bare(bare->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt_dp(dp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto y = torch::randint(0, 3, {8});
  for (int step = 0; step < 4; ++step) {
    auto x = torch::randn({8, 1, 6, 6});
    opt_bare.zero_grad();
    opt_dp.zero_grad();
    auto loss_bare = torch::cross_entropy_loss(forward_as_replicas(bare, x, sizes, sync), y);
    auto loss_dp = torch::cross_entropy_loss(dp(x), y);
    EXPECT_TRUE(torch::allclose(loss_bare, loss_dp, 1e-5, 1e-6));
    loss_bare.backward();
    loss_dp.backward();
    opt_bare.step();
    opt_dp.step();
  }
  expect_params_close(*bare, *copy);
  expect_buffers_close(*bare, *copy);

  // In eval mode BatchNorm uses the running statistics: DataParallel equals
  // the bare module on the whole batch.
  bare->eval();
  dp->eval();
  auto x = torch::randn({8, 1, 6, 6});
  EXPECT_TRUE(torch::allclose(bare(x), dp(x), 1e-5, 1e-6));
}

TEST(DataParallel, CnnWithBatchNormBroadcastBuffers) {
  cnn_equivalence(BufferSync::Broadcast);
}

TEST(DataParallel, CnnWithBatchNormAverageBuffers) {
  cnn_equivalence(BufferSync::Average);
}

TEST(DataParallel, AveragedRunningMeanEqualsFullBatchRunningMean) {
  Cnn bare;
  Cnn copy = deep_copy(bare);
  DataParallel<Cnn> dp(copy, DataParallelOptions().devices(cpus(3)).buffers(BufferSync::Average));
  auto x = torch::randn({9, 1, 6, 6});
  bare(x);
  dp(x);
  EXPECT_TRUE(torch::allclose(bare->bn->running_mean, copy->bn->running_mean, 1e-5, 1e-6));
  EXPECT_EQ(copy->bn->num_batches_tracked.item<int64_t>(), 1);
}

TEST(DataParallel, BufferSyncOffKeepsReplicaBuffers) {
  Cnn net;
  DataParallel<Cnn> dp(net, DataParallelOptions().devices(cpus(2)).buffers(BufferSync::Off));
  dp(torch::randn({4, 1, 6, 6}) + 5); // replica 1 sees rows with mean ~5
  auto replicas = dp->replicas();
  EXPECT_FALSE(torch::allclose(replicas[0]->bn->running_mean, replicas[1]->bn->running_mean));
  EXPECT_EQ(replicas[1]->bn->num_batches_tracked.item<int64_t>(), 1);
}

// Off keeps each replica's buffers in training only: an evaluation is the
// wrapped module's, every row answered with its running statistics (Note
// [BufferSync::Off in eval mode]), the whole model's eval() or a BatchNorm
// frozen alone, and also after the module's statistics were loaded anew.
TEST(DataParallel, BufferSyncOffEvaluatesWithTheWrappedModulesBuffers) {
  torch::manual_seed(5);
  Cnn net;
  DataParallel<Cnn> dp(net, DataParallelOptions().devices(cpus(2)).buffers(BufferSync::Off));
  dp(torch::randn({4, 1, 6, 6}) + torch::arange(4).view({4, 1, 1, 1}) * 3); // the replicas' statistics part
  ASSERT_FALSE(torch::allclose(dp->replicas()[0]->bn->running_mean, dp->replicas()[1]->bn->running_mean));
  const auto x = torch::randn({6, 1, 6, 6});
  torch::NoGradGuard no_grad;
  net->eval();
  EXPECT_TRUE(torch::allclose(dp(x), net(x), 1e-5, 1e-6)) << "the whole model in eval mode";
  net->bn->running_var.fill_(4); // as a loaded checkpoint does, in place
  EXPECT_TRUE(torch::allclose(dp(x), net(x), 1e-5, 1e-6)) << "statistics changed after wrapping";
  net->train();
  net->bn->eval();
  EXPECT_TRUE(torch::allclose(dp(x), net(x), 1e-5, 1e-6)) << "a BatchNorm frozen alone";
}

// A BatchNorm frozen alone for fine-tuning (net->bn->eval() in a model in
// training mode) keeps its mode in every replica: with running statistics
// and no dropout, DataParallel equals the bare module on the whole batch,
// and the running statistics stay as they were, bit for bit, also under
// BufferSync::Average (whose average of equal copies by shares 4/7 and 3/7
// moved them by a rounding each step).
TEST(DataParallel, ASubmoduleSwitchedAloneKeepsItsModeInTheReplicas) {
  for (auto sync : {BufferSync::Broadcast, BufferSync::Average}) {
    torch::manual_seed(4);
    Cnn bare;
    {
      torch::NoGradGuard no_grad;
      bare->bn->running_mean.uniform_(-1, 1);
      bare->bn->running_var.uniform_(0.5, 2);
    }
    Cnn copy = deep_copy(bare);
    DataParallel<Cnn> dp(copy, DataParallelOptions().devices(cpus(2)).buffers(sync));
    for (Cnn* net : {&bare, &copy}) {
      (*net)->train();
      (*net)->bn->eval();
    }
    const auto mean = copy->bn->running_mean.clone();
    const auto var = copy->bn->running_var.clone();
    auto x = torch::randn({7, 1, 6, 6});
    EXPECT_TRUE(torch::allclose(bare(x), dp(x), 1e-5, 1e-6));
    for (int step = 0; step < 20; ++step) {
      dp(x);
    }
    EXPECT_TRUE(torch::equal(copy->bn->running_mean, mean)) << static_cast<int>(sync);
    EXPECT_TRUE(torch::equal(copy->bn->running_var, var)) << static_cast<int>(sync);
    copy->bn->train(); // and back
    bare->bn->train();
    dp(x);
    EXPECT_FALSE(torch::equal(copy->bn->running_mean, mean));
  }
}

// Two forwards, then one backward through both (a siamese or contrastive
// loss), with BatchNorm: copying the buffers into the replicas before the
// second forward must not count as an in-place change of what the first
// forward saved.
TEST(DataParallel, TwoForwardsThenOneBackwardWithBatchNorm) {
  for (auto sync : {BufferSync::Broadcast, BufferSync::Average}) {
    torch::manual_seed(6);
    Cnn bare;
    Cnn copy = deep_copy(bare);
    DataParallel<Cnn> dp(copy, DataParallelOptions().devices(cpus(2)).buffers(sync));
    bare->eval(); // running statistics: the bare module on the whole batch is the reference
    dp->eval();
    auto x1 = torch::randn({6, 1, 6, 6});
    auto x2 = torch::randn({6, 1, 6, 6});
    (bare(x1).pow(2).sum() + bare(x2).sum()).backward();
    (dp(x1).pow(2).sum() + dp(x2).sum()).backward();
    testing::expect_grads_close(*bare, *copy);
    dp->train();
    EXPECT_NO_THROW((dp(x1).pow(2).sum() + dp(x2).sum()).backward());
  }
}

// A block registered twice (shared weights): its gradient is the sum over
// both uses, and the two entries of one tensor never touch its .grad from
// two workers at once (zero_grad(false) keeps zeros, which backward resets).
struct SharedBlockImpl : torch::nn::Cloneable<SharedBlockImpl> {
  SharedBlockImpl() {
    reset();
  }
  void reset() override {
    block = torch::nn::Linear(6, 6);
    register_module("first", block);
    register_module("second", block);
    head = register_module("head", torch::nn::Linear(6, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(block(torch::tanh(block(x))));
  }
  torch::nn::Linear block{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(SharedBlock);

TEST(DataParallel, ABlockRegisteredTwiceGetsTheSumOfItsGradients) {
  torch::manual_seed(9);
  SharedBlock bare;
  SharedBlock copy = deep_copy(bare);
  ASSERT_EQ(copy->named_parameters().size(), 6u) << "the shared block's parameters appear under both names";
  DataParallel<SharedBlock> dp(copy, DataParallelOptions().devices(cpus(2)));
  for (int step = 0; step < 3; ++step) {
    bare->zero_grad(false);
    copy->zero_grad(false);
    auto x = torch::randn({8, 6});
    bare(x).pow(2).sum().backward();
    dp(x).pow(2).sum().backward();
    testing::expect_grads_close(*bare, *copy);
  }
}

// Sequential (as ModuleList and ModuleDict) clones each entry on its own, so
// in a replica the block used twice is two blocks, each with its own use's
// gradient: the module's block takes the sum of both (it took the first's).
TEST(DataParallel, ABlockUsedTwiceInASequentialGetsTheSumOfItsGradients) {
  auto make = [] {
    torch::manual_seed(4);
    torch::nn::Linear block(6, 6);
    return torch::nn::Sequential(block, torch::nn::Tanh(), block);
  };
  auto bare = make();
  auto copy = make();
  ASSERT_TRUE(copy[0]->parameters()[0].is_same(copy[2]->parameters()[0]));
  DataParallel<torch::nn::Sequential> dp(copy, DataParallelOptions().devices(cpus(2)));
  for (int step = 0; step < 2; ++step) {
    bare->zero_grad(false);
    copy->zero_grad(false);
    auto x = torch::randn({8, 6});
    bare->forward(x).pow(2).sum().backward();
    dp(x).pow(2).sum().backward();
    testing::expect_grads_close(*bare, *copy);
  }
}

// A backward that does not add to a parameter's .grad (autograd::grad, or
// backward(inputs) without it) leaves a zeroed .grad defined: it came back
// undefined, and LibTorch's optimizers skip a parameter without a gradient
// (no momentum, no weight decay). A plain backward still replaces it.
TEST(DataParallel, ABackwardThatDoesNotAccumulateLeavesAZeroGradDefined) {
  torch::nn::Sequential net(torch::nn::Linear(4, 2));
  DataParallel<torch::nn::Sequential> dp(net, DataParallelOptions().devices(cpus(2)));
  auto x = torch::randn({6, 4}, torch::requires_grad());
  const auto weight = net[0]->parameters()[0];
  dp(x).sum().backward();
  const auto full = weight.grad().clone();
  for (int way = 0; way < 2; ++way) {
    net->zero_grad(/*set_to_none=*/false);
    if (way == 0) {
      torch::autograd::grad({dp(x).sum()}, {x});
    } else {
      dp(x).sum().backward({}, false, false, {x});
    }
    ASSERT_TRUE(weight.grad().defined()) << "way " << way;
    EXPECT_TRUE(torch::equal(weight.grad(), torch::zeros_like(weight))) << "way " << way;
  }
  dp(x).sum().backward();
  EXPECT_TRUE(torch::allclose(weight.grad(), full));
}

// The replicas hold one step at a time: a forward that starts while another
// runs (here from inside the module's own forward; from a second thread
// alike) is an error, and the DataParallel works again afterwards.
struct ReentrantImpl : torch::nn::Cloneable<ReentrantImpl> {
  ReentrantImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(3, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (inner) {
      inner();
    }
    return fc(x);
  }
  std::function<void()> inner;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Reentrant);

TEST(DataParallel, AForwardWhileAnotherRunsIsAnError) {
  Reentrant net;
  auto calls = std::make_shared<std::function<void()>>();
  net->inner = [calls] {
    if (*calls) {
      (*calls)();
    }
  };
  DataParallel<Reentrant> dp(net, DataParallelOptions().devices(cpus(2)));
  const auto x = torch::randn({4, 3});
  *calls = [&] { dp(x); };
  EXPECT_ERROR_SAYS(dp(x), "forward was called while another forward of this DataParallel runs");
  *calls = nullptr;
  EXPECT_TRUE(torch::allclose(dp(x), net->fc(x), 1e-5, 1e-6));
}

} // namespace
} // namespace lockstep
