#pragma once

// DataParallel's test models (an MLP, a CNN with BatchNorm, modules with
// several inputs, nested outputs, a counter kept in a member, a loss as
// output) and the side-by-side training check against the bare module,
// shared by test_data_parallel.cpp and test_data_parallel_edges.cpp.

#include <lockstep/lockstep.h>

#include "modules.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <optional>
#include <tuple>
#include <vector>

namespace lockstep {
namespace testing {
namespace dp_models {

inline std::vector<torch::Device> cpus(int n) {
  return std::vector<torch::Device>(n, torch::Device(torch::kCPU));
}

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

// What the bare module receives for an argument DataParallel gets.
template <typename T>
const T& plain(const T& value) {
  return value;
}
inline const torch::Tensor& plain(const Broadcast& b) {
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

} // namespace dp_models
} // namespace testing
} // namespace lockstep
