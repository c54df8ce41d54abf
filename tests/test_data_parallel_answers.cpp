// DataParallel must give the bare module's answer where PyTorch's own tests
// found Lockstep's differed: buffers that require a gradient
// (test_data_parallel_buffers_requiring_grad), double backward through a
// gradient penalty (test_data_parallel_function_deletion), and an empty batch.

#include <lockstep/lockstep.h>

#include "support/dp_models.h"
#include "support/errors.h"
#include "support/modules.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

namespace lockstep {
namespace {

using testing::deep_copy;

using testing::dp_models::cpus;

// PyTorch's test module: one buffer that requires a gradient, one that does not.
struct BufferGradImpl : torch::nn::Cloneable<BufferGradImpl> {
  BufferGradImpl() {
    reset();
  }
  void reset() override {
    t_rg = register_buffer("t_rg", torch::randn({5}, torch::kDouble).requires_grad_());
    t_not_rg = register_buffer("t_not_rg", torch::randn({5}, torch::kDouble));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x * t_rg + t_not_rg;
  }
  torch::Tensor t_rg, t_not_rg;
};
TORCH_MODULE(BufferGrad);

// The gradient of sum(module(x) * weights) with respect to t_rg by central
// differences, as PyTorch's gradcheck takes it.
torch::Tensor numerical_buffer_grad(BufferGrad& net, const torch::Tensor& x, const torch::Tensor& weights) {
  torch::NoGradGuard no_grad;
  auto grad = torch::zeros({5}, torch::kDouble);
  const double eps = 1e-6;
  for (int64_t i = 0; i < 5; ++i) {
    const double saved = net->t_rg[i].item<double>();
    net->t_rg[i] = saved + eps;
    const double up = (net->forward(x) * weights).sum().item<double>();
    net->t_rg[i] = saved - eps;
    const double down = (net->forward(x) * weights).sum().item<double>();
    net->t_rg[i] = saved;
    grad[i] = (up - down) / (2 * eps);
  }
  return grad;
}

TEST(DataParallelAnswers, BufferThatRequiresGradGetsTheSummedGradient) {
  torch::manual_seed(0);
  BufferGrad net;
  auto x = torch::randn({6, 5}, torch::kDouble);
  auto weights = torch::randn({6, 5}, torch::kDouble);
  const auto numerical = numerical_buffer_grad(net, x, weights);
  for (int replicas : {2, 3}) {
    for (auto sync : {BufferSync::Broadcast, BufferSync::Off}) {
      DataParallel<BufferGrad> dp(net, DataParallelOptions().devices(cpus(replicas)).buffers(sync));
      net->t_rg.mutable_grad() = torch::Tensor();
      (dp(x) * weights).sum().backward();
      ASSERT_TRUE(net->t_rg.grad().defined()) << replicas << " replicas";
      EXPECT_TRUE(torch::allclose(net->t_rg.grad(), numerical, 1e-6, 1e-8))
          << replicas << " replicas: " << net->t_rg.grad() << " against " << numerical;
      EXPECT_FALSE(net->t_not_rg.grad().defined());
    }
  }
}

TEST(DataParallelAnswers, DoubleBackwardThroughAGradientPenalty) {
  auto penalty_grads = [](torch::nn::Linear& net, auto&& module) {
    auto x = torch::ones({2, 4}, torch::requires_grad());
    auto output = module(x);
    auto grad_x = torch::autograd::grad({output}, {x}, {torch::ones_like(output)}, /*retain_graph=*/true,
                                        /*create_graph=*/true)[0];
    net->zero_grad();
    grad_x.mean().backward();
    return std::make_pair(net->weight.grad(), net->bias.grad());
  };
  torch::nn::Linear net(4, 1);
  DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(cpus(2)));
  auto [weight, bias] = penalty_grads(net, [&](const torch::Tensor& x) { return dp(x); });
  ASSERT_TRUE(weight.defined());
  EXPECT_TRUE(torch::allclose(weight, torch::full({1, 4}, 0.25))) << weight;
  // The penalty does not depend on the bias: no gradient, or zeros.
  EXPECT_TRUE(!bias.defined() || torch::equal(bias, torch::zeros({1}))) << bias;

  auto [bare_weight, bare_bias] = penalty_grads(net, [&](const torch::Tensor& x) { return net(x); });
  EXPECT_TRUE(testing::same_answer(weight, bare_weight));
}

TEST(DataParallelAnswers, DoubleBackwardReachesTheInputs) {
  // d/dx of sum((d out/dx)^2) where out = tanh(x W^T): non-zero, and the same
  // through the wrapper as without it.
  torch::manual_seed(1);
  torch::nn::Linear net(3, 2);
  DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(cpus(2)));
  auto x = torch::randn({5, 3});
  auto run = [&](auto&& module) {
    auto leaf = x.clone().requires_grad_();
    auto out = torch::tanh(module(leaf));
    auto g = torch::autograd::grad({out.sum()}, {leaf}, {}, true, true)[0];
    net->zero_grad();
    g.pow(2).sum().backward();
    return std::make_pair(leaf.grad(), net->weight.grad().clone());
  };
  auto [dp_x, dp_w] = run([&](const torch::Tensor& t) { return dp(t); });
  auto [bare_x, bare_w] = run([&](const torch::Tensor& t) { return net(t); });
  ASSERT_TRUE(dp_x.defined());
  EXPECT_TRUE(torch::allclose(dp_x, bare_x, 1e-5, 1e-6)) << dp_x << bare_x;
  EXPECT_TRUE(torch::allclose(dp_w, bare_w, 1e-5, 1e-6)) << dp_w << bare_w;
}

TEST(DataParallelAnswers, FirstOrderGradientsStayTheBareModules) {
  // The replicas' non-leaf parameters must not change a plain backward: same
  // gradients, and a hook on a parameter runs once per backward.
  torch::manual_seed(2);
  torch::nn::Linear net(6, 3);
  auto bare = deep_copy(net);
  int calls = 0;
  net->weight.register_hook([&calls](const torch::Tensor&) { ++calls; });
  DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(cpus(3)));
  auto x = torch::randn({7, 6});
  dp(x).pow(2).sum().backward();
  bare(x).pow(2).sum().backward();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(torch::allclose(net->weight.grad(), bare->weight.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(net->bias.grad(), bare->bias.grad(), 1e-5, 1e-6));
}

TEST(DataParallelAnswers, EmptyBatchGivesTheBareModulesOutputOnAnyNumberOfDevices) {
  torch::nn::Linear net(16, 3);
  auto bare_x = torch::randn({0, 16}, torch::requires_grad());
  const auto bare = net(bare_x);
  bare.sum().backward();
  const auto bare_grad = net->weight.grad().defined() ? net->weight.grad().clone() : torch::Tensor();
  for (int replicas : {1, 2, 3}) {
    DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(cpus(replicas)));
    auto x = torch::randn({0, 16}, torch::requires_grad());
    auto out = dp(x);
    EXPECT_EQ(out.sizes(), bare.sizes()) << replicas << " replicas";
    net->weight.mutable_grad() = torch::Tensor();
    out.sum().backward();
    const auto& grad = net->weight.grad();
    EXPECT_EQ(grad.defined(), bare_grad.defined()) << replicas << " replicas";
    EXPECT_TRUE(!grad.defined() || torch::equal(grad, bare_grad)) << replicas << " replicas";
  }
}

TEST(DataParallelAnswers, BufferGradientAndDoubleBackwardAcrossDevices_CUDA) {
  // A replica on another device than the module: the gradients come back
  // through ReplicaToModule's device move, first and second order.
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(0);
  BufferGrad net;
  auto x = torch::randn({6, 5}, torch::kDouble);
  auto weights = torch::randn({6, 5}, torch::kDouble);
  const auto numerical = numerical_buffer_grad(net, x, weights);
  net->to(gpu);
  DataParallel<BufferGrad> dp(net, DataParallelOptions().devices({gpu, torch::Device(torch::kCPU)}));
  (dp(x.to(gpu)) * weights.to(gpu)).sum().backward();
  ASSERT_TRUE(net->t_rg.grad().defined());
  EXPECT_TRUE(torch::allclose(net->t_rg.grad().cpu(), numerical, 1e-6, 1e-8)) << net->t_rg.grad();

  torch::nn::Linear linear(4, 1);
  linear->to(gpu);
  DataParallel<torch::nn::Linear> dpl(linear, DataParallelOptions().devices({gpu, torch::Device(torch::kCPU)}));
  auto input = torch::ones({2, 4}, torch::TensorOptions().device(gpu).requires_grad(true));
  auto output = dpl(input);
  auto grad_x = torch::autograd::grad({output}, {input}, {torch::ones_like(output)}, true, true)[0];
  grad_x.mean().backward();
  ASSERT_TRUE(linear->weight.grad().defined());
  EXPECT_TRUE(torch::allclose(linear->weight.grad().cpu(), torch::full({1, 4}, 0.25))) << linear->weight.grad();
}

} // namespace
} // namespace lockstep
