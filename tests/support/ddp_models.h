#pragma once

// Models shared by the in-process (threads as ranks) and multi-process DDP
// tests: odd sizes, an empty parameter, and a branch forward can skip.

#include <torch/torch.h>

namespace lockstep {
namespace testing {

struct OddNetImpl : torch::nn::Cloneable<OddNetImpl> {
  explicit OddNetImpl(int64_t hidden = 13, bool use_branch = true) : hidden(hidden), use_branch(use_branch) {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(7, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 3));
    branch = register_module("branch", torch::nn::Linear(7, 3));
    empty = register_parameter("empty", torch::zeros({0}));
    scale = register_parameter("scale", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = fc2(torch::tanh(fc1(x))) * scale + empty.sum();
    if (use_branch) {
      out = out + branch(x);
    }
    return out;
  }
  int64_t hidden;
  bool use_branch;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, branch{nullptr};
  torch::Tensor empty, scale;
};
TORCH_MODULE(OddNet);

/// Deterministic data for rank `rank` of `world`: rows [rank*b, (rank+1)*b)
/// of one global batch of world*b rows, different at every step.
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t rows, int64_t step) {
  auto x = torch::sin(torch::arange(rows * 7, torch::kFloat).reshape({rows, 7}) * 0.37 + static_cast<double>(step));
  auto y = torch::cos(torch::arange(rows * 3, torch::kFloat).reshape({rows, 3}) * 0.91 - static_cast<double>(step));
  return {x, y};
}

} // namespace testing
} // namespace lockstep
