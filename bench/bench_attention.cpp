// The trainer's transformer block (examples/models.h: one qkv projection,
// batch-first matmuls) against the same block built on
// torch::nn::MultiheadAttention, forward and backward at the ViT's shape
// (batch 64, 50 tokens, width 64, 4 heads), one thread, in a process of its
// own. Run the two side by side, alternating:
//
//   for i in 1 2 3 4 5; do for a in ours mha; do build/lockstep-bench-attention $a; done; done
//
// Prints one line: ATTENTION steps_per_s=X

#include <examples/models.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>

namespace {

constexpr int64_t kBatch = 64, kLength = 50, kDim = 64, kHeads = 4;

// examples/models.h's TransformerBlock with its attention replaced by
// torch::nn::MultiheadAttention, which takes [length, batch, dim].
struct MhaBlockImpl : torch::nn::Module {
  MhaBlockImpl() {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    attention = register_module("attention", torch::nn::MultiheadAttention(kDim, kHeads));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    fc1 = register_module("fc1", torch::nn::Linear(kDim, 4 * kDim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto in = norm1(x).transpose(0, 1);
    auto h = x + std::get<0>(attention->forward(in, in, in, torch::Tensor(), /*need_weights=*/false)).transpose(0, 1);
    return h + fc2(torch::gelu(fc1(norm2(h))));
  }
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::MultiheadAttention attention{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MhaBlock);

} // namespace

int main(int argc, char** argv) {
  std::string which;
  int steps = 200;
  CLI::App app{"lockstep-bench-attention: the trainer's attention against torch::nn::MultiheadAttention"};
  app.add_option("ATTENTION", which, "ours or mha")->required()->check(CLI::IsMember({"ours", "mha"}));
  app.add_option("--steps", steps, "Timed forward-backward steps, after 20 untimed ones")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  torch::manual_seed(0);
  lockstep::examples::TransformerBlock ours(kDim, kHeads, 0.0);
  MhaBlock mha;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  if (which == "ours") {
    forward = [ours](const torch::Tensor& x) mutable { return ours->forward(x); };
  } else {
    forward = [mha](const torch::Tensor& x) mutable { return mha->forward(x); };
  }
  auto x = torch::randn({kBatch, kLength, kDim}, torch::requires_grad());
  auto step = [&] { forward(x).pow(2).mean().backward(); };
  for (int i = 0; i < 20; ++i) {
    step();
  }
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    step();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s steps_per_s=%.1f\n", which.c_str(), steps / seconds);
  return 0;
}
