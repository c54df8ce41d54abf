// lockstep::DataParallel against the bare module: same outputs, same
// gradients, same parameters after several optimizer steps.

#include <lockstep/lockstep.h>

#include "support/errors.h"
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

std::vector<torch::Device> cpus(int n) {
  return std::vector<torch::Device>(n, torch::Device(torch::kCPU));
}

using testing::deep_copy;
using testing::expect_buffers_close;
using testing::expect_params_close;
using testing::error_of;
using testing::same_answer;

// --- models ---------------------------------------------------------------

struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::relu(fc1(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

struct CnnImpl : torch::nn::Cloneable<CnnImpl> {
  CnnImpl() {
    reset();
  }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    fc = register_module("fc", torch::nn::Linear(4 * 6 * 6, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc(torch::relu(bn(conv(x))).flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Cnn);

// Two inputs: the batch, and a [1, 8] table every replica needs whole.
struct TwoInputImpl : torch::nn::Cloneable<TwoInputImpl> {
  TwoInputImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& table) {
    return fc(x * table);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TwoInput);

struct TupleOutImpl : torch::nn::Cloneable<TupleOutImpl> {
  TupleOutImpl() {
    reset();
  }
  void reset() override {
    a = register_module("a", torch::nn::Linear(6, 3));
    b = register_module("b", torch::nn::Linear(6, 1));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    return {a(x), torch::tanh(b(x))};
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TupleOut);

struct ContainerInImpl : torch::nn::Cloneable<ContainerInImpl> {
  ContainerInImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(5, 2));
  }
  torch::Tensor forward(std::vector<torch::Tensor> xs, std::map<std::string, torch::Tensor> extra, double scale) {
    return fc(xs.at(0) + xs.at(1) * extra.at("w")) * scale;
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ContainerIn);

// Every walkable container, in and out (Note [One list of walkable types]).
struct AllContainersImpl : torch::nn::Cloneable<AllContainersImpl> {
  AllContainersImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(4, 3));
  }
  std::pair<torch::Tensor, std::array<torch::Tensor, 2>> forward(
      std::pair<torch::Tensor, torch::Tensor> xy,
      c10::optional<torch::Tensor> mask,
      std::array<torch::Tensor, 2> ab,
      std::optional<torch::Tensor> absent) {
    auto h = fc(xy.first * xy.second + ab[0] - ab[1]);
    if (absent.has_value()) {
      h = h + *absent;
    }
    return {h, {mask.has_value() ? h * *mask : h, h.sum(1, /*keepdim=*/true)}};
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(AllContainers);

// Keeps C++ member state that forward changes: each replica has its own.
struct CounterImpl : torch::nn::Cloneable<CounterImpl> {
  CounterImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(4, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    rows_seen += x.size(0);
    calls += 1;
    if (x.lt(-100).any().item<bool>()) {
      throw std::runtime_error("bad input row");
    }
    return fc(x);
  }
  int64_t rows_seen = 0;
  int64_t calls = 0;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Counter);

// A mean-reduced loss returned from forward: a 0-dim output.
struct LossNetImpl : torch::nn::Cloneable<LossNetImpl> {
  LossNetImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(3, 1));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return torch::mse_loss(fc(x), y);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(LossNet);

// --- numerical equivalence ------------------------------------------------

// What the bare module receives for an argument DataParallel gets.
template <typename T>
const T& plain(const T& value) {
  return value;
}
const torch::Tensor& plain(const Broadcast& b) {
  return b.tensor;
}

// Trains `bare` and a DataParallel over a deep copy side by side with SGD
// (momentum, so that a wrong gradient compounds) and compares parameters.
template <typename Net, typename Step>
void expect_same_training(Net bare, DataParallelOptions options, int steps, Step step) {
  torch::manual_seed(0);
  Net copy = deep_copy(bare);
  DataParallel<Net> dp(copy, options);
  torch::optim::SGD opt_bare(bare->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt_dp(dp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int s = 0; s < steps; ++s) {
    opt_bare.zero_grad();
    opt_dp.zero_grad();
    torch::Tensor loss_bare = step(s, [&](auto&&... a) { return bare->forward(plain(a)...); });
    torch::Tensor loss_dp = step(s, [&](auto&&... a) { return dp(a...); });
    EXPECT_TRUE(torch::allclose(loss_bare, loss_dp, 1e-5, 1e-6)) << "step " << s;
    loss_bare.backward();
    loss_dp.backward();
    opt_bare.step();
    opt_dp.step();
  }
  expect_params_close(*bare, *copy);
}

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
    auto start = bare->named_buffers();
    std::vector<torch::Tensor> initial, after0, sum;
    for (auto& b : start) {
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
    auto loss_bare = torch::cross_entropy_loss(torch::cat(outs), y);
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

// --- scalars ---------------------------------------------------------------

TEST(DataParallel, ScalarOutputs) {
  LossNet bare;
  auto x = torch::randn({7, 3});
  auto y = torch::randn({7, 1});
  auto expected = bare(x, y);

  DataParallel<LossNet> stack(deep_copy(bare), DataParallelOptions().devices(cpus(2)));
  auto stacked = stack(x, y);
  EXPECT_EQ(stacked.sizes(), torch::IntArrayRef({2}));

  LossNet mean_net = deep_copy(bare);
  DataParallel<LossNet> mean(mean_net, DataParallelOptions().devices(cpus(2)).scalar_outputs(ScalarGather::Mean));
  auto m = mean(x, y);
  EXPECT_EQ(m.dim(), 0);
  EXPECT_TRUE(torch::allclose(m, expected, 1e-5, 1e-6));
  expected.backward();
  m.backward();
  EXPECT_TRUE(torch::allclose(bare->fc->weight.grad(), mean_net->fc->weight.grad(), 1e-5, 1e-6));

  DataParallel<LossNet> sum(deep_copy(bare), DataParallelOptions().devices(cpus(2)).scalar_outputs(ScalarGather::Sum));
  EXPECT_TRUE(torch::allclose(sum(x, y), stacked.sum(), 1e-5, 1e-6));
}

// --- edge cases and errors ---------------------------------------------------

TEST(DataParallel, ChunksFollowWeightsAndSmallBatchesUseFewerReplicas) {
  Counter net;
  DataParallel<Counter> dp(net, DataParallelOptions().devices(cpus(3)).weights({3, 1, 4}));
  dp(torch::randn({16, 4}));
  EXPECT_EQ(dp->map_replicas([](CounterImpl& m) { return m.rows_seen; }), (std::vector<int64_t>{6, 2, 8}));

  Counter net2;
  DataParallel<Counter> dp2(net2, DataParallelOptions().devices(cpus(3)));
  auto x = torch::randn({2, 4});
  auto out = dp2(x);
  EXPECT_EQ(out.size(0), 2);
  EXPECT_TRUE(same_answer(out, net2(x)));
  // net2(x) ran the wrapped module itself, which is not replica 0 (Note [Replica 0]).
  EXPECT_EQ(dp2->map_replicas([](CounterImpl& m) { return m.calls; }), (std::vector<int64_t>{1, 1, 0}));
  EXPECT_EQ(net2->calls, 1);
}

TEST(DataParallel, OneRowOnTwoReplicasTrainsLikeBareModule) {
  torch::manual_seed(8);
  auto x = torch::randn({1, 16});
  auto y = torch::randn({1, 4});
  expect_same_training(Mlp(), DataParallelOptions().devices(cpus(2)), 3, [&](int, auto&& run) {
    return torch::mse_loss(run(x), y);
  });
  // Sum of a single running replica's scalar is that scalar itself.
  LossNet bare;
  LossNet net = deep_copy(bare);
  DataParallel<LossNet> dp(net, DataParallelOptions().devices(cpus(3)).scalar_outputs(ScalarGather::Sum));
  auto loss = dp(torch::randn({1, 3}), torch::randn({1, 1}));
  loss.backward();
  EXPECT_TRUE(net->fc->weight.grad().defined());
}

TEST(DataParallel, MismatchedBatchSizesAreAClearError) {
  TwoInput net;
  DataParallel<TwoInput> dp(net, DataParallelOptions().devices(cpus(2)));
  auto message = error_of([&] { dp(torch::randn({10, 8}), torch::randn({1, 8})); });
  EXPECT_NE(message.find("argument 0 has size 10 along dim 0 but argument 1 has size 1"), std::string::npos) << message;
  EXPECT_NE(message.find("lockstep::broadcast"), std::string::npos) << message;
  // With the hint, the batch-1 tensor goes whole to every replica and the output keeps all 10 rows.
  EXPECT_EQ(dp(torch::randn({10, 8}), broadcast(torch::randn({1, 8}))).size(0), 10);
}

TEST(DataParallel, ReplicaErrorNamesReplicaAndDeviceAndStaysUsable) {
  Counter net;
  DataParallel<Counter> dp(net, DataParallelOptions().devices(cpus(2)));
  auto x = torch::randn({4, 4});
  x[3][0] = -1000; // row 3 belongs to replica 1
  auto message = error_of([&] { dp(x); });
  EXPECT_NE(message.find("replica 1 on cpu failed in forward"), std::string::npos) << message;
  EXPECT_NE(message.find("bad input row"), std::string::npos) << message;
  auto good = torch::randn({4, 4});
  auto out = dp(good);
  // Two rows per replica against four in the bare module: 2.x's GEMM may
  // round differently by batch size, so values near 0 need an absolute slack.
  EXPECT_TRUE(torch::allclose(out, net(good), 1e-5, 1e-6));
}

TEST(DataParallel, StateKeptOnReplicasSumsToBareCount) {
  Counter bare;
  Counter net = deep_copy(bare);
  DataParallel<Counter> dp(net, DataParallelOptions().devices(cpus(3)));
  for (int64_t rows : {5, 9, 2, 12}) {
    auto x = torch::randn({rows, 4});
    bare(x);
    dp(x);
  }
  auto per_replica = dp->map_replicas([](CounterImpl& m) { return m.rows_seen; });
  EXPECT_EQ(per_replica.size(), 3u);
  EXPECT_EQ(std::accumulate(per_replica.begin(), per_replica.end(), int64_t{0}), bare->rows_seen);
  // Replica 0 is a clone sharing the module's parameters (Note [Replica 0]):
  // C++ member state lives on the replicas, not on the wrapped module.
  EXPECT_EQ(dp->module()->rows_seen, 0);
  EXPECT_EQ(dp->replicas().size(), 3u);
  EXPECT_NE(dp->replicas()[0].ptr(), net.ptr());
  EXPECT_EQ(dp->replicas()[0]->parameters()[0].data_ptr(), net->parameters()[0].data_ptr());
  dp->map_replicas([](CounterImpl& m) { m.rows_seen = 0; });
  EXPECT_EQ(dp->replicas()[2]->rows_seen, 0);
}

TEST(DataParallel, OptimizerStepIsSeenByEveryReplica) {
  Mlp net;
  DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2)));
  torch::optim::SGD opt(dp->parameters(), 0.5);
  dp(torch::randn({4, 16})).sum().backward();
  opt.step();
  auto replicas = dp->replicas();
  EXPECT_TRUE(torch::equal(replicas[1]->fc1->weight, net->fc1->weight));
  // CPU replicas share storage with the wrapped module: nothing is copied.
  EXPECT_EQ(replicas[1]->fc1->weight.data_ptr(), net->fc1->weight.data_ptr());
  EXPECT_FALSE(replicas[1]->fc1->weight.is_same(net->fc1->weight));
  EXPECT_EQ(dp->parameters().size(), net->parameters().size());
}

TEST(DataParallel, SaveAndLoadBetweenWrappedAndBareModule) {
  const std::string path = ::testing::TempDir() + "lockstep_dp_checkpoint.pt";
  Mlp source;
  DataParallel<Mlp> dp(source, DataParallelOptions().devices(cpus(2)));
  torch::save(dp, path);
  Mlp bare;
  torch::load(bare, path);
  expect_params_close(*bare, *source, 0, 0);
  for (const auto& p : dp->named_parameters()) {
    EXPECT_EQ(p.key().rfind("module.", 0), 0u); // the prefix lives in names only, not in files
  }

  Mlp other;
  torch::save(other, path);
  torch::load(dp, path);
  expect_params_close(*other, *source, 0, 0);
  auto x = torch::randn({6, 16});
  EXPECT_TRUE(same_answer(dp(x), other(x))); // replica 1 sees the loaded values too
  std::remove(path.c_str());
}

TEST(DataParallel, ModesAndInference) {
  Cnn net;
  DataParallel<Cnn> dp(net, DataParallelOptions().devices(cpus(2)));
  dp->eval();
  EXPECT_FALSE(net->is_training());
  EXPECT_FALSE(dp->replicas()[1]->is_training());
  auto x = torch::randn({4, 1, 6, 6});
  torch::NoGradGuard no_grad;
  auto out = dp(x);
  EXPECT_FALSE(out.requires_grad());
  EXPECT_TRUE(torch::allclose(out, net(x), 1e-5, 1e-6));
}

TEST(DataParallel, ToDoubleMovesReplicasToo) {
  Mlp net;
  DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2)));
  dp->to(torch::kFloat64);
  auto x = torch::randn({4, 16}, torch::kFloat64);
  auto out = dp(x);
  EXPECT_EQ(out.scalar_type(), torch::kFloat64);
  EXPECT_TRUE(same_answer(out, net(x)));
}

TEST(DataParallel, OneDeviceRunsTheModuleDirectly) {
  Counter net;
  DataParallel<Counter> dp(net, DataParallelOptions().devices(cpus(1)));
  auto x = torch::randn({3, 4});
  EXPECT_TRUE(torch::equal(dp(x), net(x)));
  EXPECT_EQ(dp->map_replicas([](CounterImpl& m) { return m.calls; }), (std::vector<int64_t>{2}));
}

TEST(DataParallel, SequentialAndDefaultDevices) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  seq->to(default_devices()[0]); // every GPU where there are some: the module goes on the first
  DataParallel<torch::nn::Sequential> dp(seq);
  EXPECT_EQ(dp->devices(), default_devices());
  auto x = torch::randn({5, 4}).to(default_devices()[0]);
  EXPECT_TRUE(torch::allclose(dp->forward(x), seq->forward(x), 1e-6, 1e-6));
}

TEST(DataParallel, BadOptionsAreClearErrors) {
  auto message = error_of([] { DataParallel<Mlp> dp(Mlp(), DataParallelOptions().devices(cpus(2)).weights({1})); });
  EXPECT_NE(message.find("weights has 1 entries but there are 2 devices"), std::string::npos) << message;
  if (!torch::cuda::is_available()) {
    message = error_of([] {
      DataParallel<Mlp> dp(Mlp(), DataParallelOptions().devices({torch::kCPU, torch::Device(torch::kCUDA, 0)}));
    });
    EXPECT_NE(message.find("devices[1] is cuda:0 but this process sees 0 CUDA device(s)"), std::string::npos) << message;
  }
}

// A parameter on a device other than devices[0], on any machine.
struct OffDeviceImpl : torch::nn::Cloneable<OffDeviceImpl> {
  OffDeviceImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    extra = register_parameter("extra", torch::empty({4}, torch::kMeta));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor extra;
};
TORCH_MODULE(OffDevice);

TEST(DataParallel, ParameterOffFirstDeviceIsAClearError) {
  auto message = error_of([&] { DataParallel<OffDevice> dp(OffDevice(), DataParallelOptions().devices(cpus(2))); });
  EXPECT_NE(message.find("parameter 'extra' is on meta but devices[0] is cpu"), std::string::npos) << message;
  EXPECT_NE(message.find("call module->to(cpu)"), std::string::npos) << message;
}

// --- CUDA ----------------------------------------------------------------------

TEST(DataParallel, ParameterOffFirstDeviceIsAClearError_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  Mlp net;
  net->fc2->to(torch::Device(torch::kCUDA, 0));
  auto message = error_of([&] { DataParallel<Mlp> dp(net, DataParallelOptions().devices(cpus(2))); });
  EXPECT_NE(message.find("parameter 'fc2.weight' is on cuda:0 but devices[0] is cpu"), std::string::npos) << message;
}

TEST(DataParallel, MlpMatchesBareModule_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const torch::Device gpu(torch::kCUDA, 0);
  Mlp bare;
  bare->to(gpu);
  auto x = torch::randn({10, 16}, gpu);
  auto y = torch::randn({10, 4}, gpu);
  expect_same_training(bare, DataParallelOptions().devices({gpu, gpu}), 4, [&](int, auto&& run) {
    return torch::mse_loss(run(x), y);
  });
}

TEST(DataParallel, MlpMatchesBareModuleOnTwoGpus_MultiCUDA) {
  if (torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "fewer than 2 CUDA devices";
  }
  const torch::Device gpu0(torch::kCUDA, 0), gpu1(torch::kCUDA, 1);
  Mlp bare;
  bare->to(gpu0);
  auto x = torch::randn({10, 16}, gpu0);
  auto y = torch::randn({10, 4}, gpu0);
  expect_same_training(bare, DataParallelOptions().devices({gpu0, gpu1}), 4, [&](int, auto&& run) {
    return torch::mse_loss(run(x), y);
  });
}

} // namespace
} // namespace lockstep
