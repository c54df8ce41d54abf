#pragma once

// The models the trainer and the benchmarks share.

#include <torch/torch.h>

namespace lockstep {
namespace examples {

/// A small convolutional classifier for 1x28x28 images (MNIST's shape).
struct ConvNetImpl : torch::nn::Cloneable<ConvNetImpl> {
  ConvNetImpl() {
    reset();
  }
  void reset() override {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 5).padding(2)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 5).padding(2)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(32));
    fc1 = register_module("fc1", torch::nn::Linear(32 * 7 * 7, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    h = torch::max_pool2d(torch::relu(bn2(conv2(h))), 2);
    return fc2(torch::relu(fc1(h.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ConvNet);

/// The MLP 784-1024-1024-10.
inline torch::nn::Sequential make_mlp() {
  return torch::nn::Sequential(
      torch::nn::Linear(784, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
      torch::nn::Linear(1024, 10));
}

} // namespace examples
} // namespace lockstep
