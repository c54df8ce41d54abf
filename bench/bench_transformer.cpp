// One contender of scripts/gpu_bench.sh: a transformer's training steps at
// world size 1, under bf16 autocast, with AdamW, in a process of its own.
//
//   lockstep-bench-transformer CONTENDER MODEL [--device cuda|cpu] [--size full|tiny] [--steps N] [--batch B]
//
// CONTENDER: bare (the module alone) | dataparallel (DataParallel on
// [DEVICE]) | ddp (DistributedDataParallel over NCCL on a GPU, Gloo on the
// CPU) | fullshard (FullyShardedDataParallel, each block a unit) |
// fullshard-checkpointed (the same, each block a lockstep::checkpoint
// segment). MODEL: gpt (--size full: GPT-2 small's shape, 124M parameters
// with a 50304-token vocabulary, sequences of 512) | vit (--size full: width
// 384, 12 blocks of 6 heads, on 1x28x28 images in 4x4 patches). --size tiny
// runs both at a few thousand parameters, to test the script's logic on the CPU.
// Prints one line:
//   CONTENDER MODEL items_per_s=X unit=tokens|samples peak_mem_mb=M flops_per_s=F params=P

#include "device_memory.h"

#include <examples/models.h>

#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Options {
  std::string contender;
  std::string model;
  std::string device = "cuda";
  std::string size = "full";
  int steps = 10;
  int64_t batch = 0; // 0: the model's default
};

// A model's shape and its batch: `context` tokens (or patches and the class
// token) a sample.
struct Shape {
  int64_t vocab = 50304, context = 512, dim = 768, depth = 12, heads = 12, batch = 16;
};

Shape shape_of(const Options& o) {
  Shape s;
  if (o.model == "vit") {
    s = Shape{10, 50, 384, 12, 6, 256};
  }
  if (o.size == "tiny") {
    s = o.model == "vit" ? Shape{10, 50, 32, 2, 2, 8} : Shape{256, 32, 32, 2, 2, 4};
  }
  if (o.batch > 0) {
    s.batch = o.batch;
  }
  return s;
}

// Training FLOPs of one sample: 6 per parameter and token (forward and
// backward of the matrix products), and attention's 12 per layer, width and
// pair of positions (PaLM's appendix B). The position embedding does no
// matrix product and is left out.
double flops_per_sample(int64_t params, const Shape& s) {
  const double tokens = static_cast<double>(s.context);
  return 6.0 * static_cast<double>(params) * tokens + 12.0 * s.depth * s.dim * tokens * tokens;
}

// A contender's forward, and the parameters its optimizer steps (the
// shards under FullyShardedDataParallel).
struct Wrapped {
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> params;
};

template <typename M>
Wrapped wrap(M net, const Options& o, torch::Device device) {
  if (o.contender == "bare") {
    return {[net](const torch::Tensor& x) mutable { return net->forward(x); }, net->parameters()};
  }
  if (o.contender == "dataparallel") {
    lockstep::DataParallel<M> dp(net, lockstep::DataParallelOptions().devices({device}));
    return {[dp](const torch::Tensor& x) mutable { return dp(x); }, net->parameters()};
  }
  auto group = lockstep::new_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, device.is_cuda() ? "nccl" : "gloo");
  if (o.contender == "ddp") {
    lockstep::DistributedDataParallel<M> ddp(net, group);
    return {[ddp](const torch::Tensor& x) mutable { return ddp(x); }, net->parameters()};
  }
  std::vector<std::string> units;
  for (int64_t i = 0; i < net->depth; ++i) {
    units.push_back("blocks." + std::to_string(i));
  }
  lockstep::FullyShardedDataParallel<M> fsdp(net, group, lockstep::ShardingOptions().units(units));
  return {[fsdp](const torch::Tensor& x) mutable { return fsdp(x); }, fsdp->parameters()};
}

template <typename M>
void run(M net, const Options& o, const Shape& s, torch::Device device) {
  const bool text = o.model == "gpt";
  int64_t params = 0;
  for (const auto& p : net->named_parameters()) {
    params += p.key() == "wpe" || p.key() == "pos_embed" ? 0 : p.value().numel();
  }
  net->to(device);
  auto [forward, trained] = wrap(net, o, device);
  torch::optim::AdamW optimizer(trained, torch::optim::AdamWOptions(1e-4));
  const auto ids = torch::TensorOptions().dtype(torch::kLong).device(device);
  auto x = text ? torch::randint(0, s.vocab, {s.batch, s.context}, ids) : torch::randn({s.batch, 1, 28, 28}, device);
  auto y = text ? torch::randint(0, s.vocab, {s.batch, s.context}, ids) : torch::randint(0, 10, {s.batch}, ids);
  auto step = [&] {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      lockstep::AutocastGuard autocast(device.type(), torch::kBFloat16);
      auto logits = forward(x);
      loss = torch::cross_entropy_loss(logits.flatten(0, -2).to(torch::kFloat), y.flatten());
    }
    loss.backward();
    optimizer.step();
  };
  const auto sync = [&] {
    if (device.is_cuda()) {
      torch::cuda::synchronize();
    }
  };
  for (int i = 0; i < 3; ++i) {
    step();
  }
  sync();
  lockstep::bench::reset_peak_device_memory(device);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < o.steps; ++i) {
    step();
  }
  sync();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double samples_per_s = static_cast<double>(o.steps * s.batch) / seconds;
  std::printf("%s %s items_per_s=%.1f unit=%s peak_mem_mb=%.1f flops_per_s=%.4g params=%lld\n", o.contender.c_str(),
              o.model.c_str(), samples_per_s * (text ? static_cast<double>(s.context) : 1.0), text ? "tokens" : "samples",
              lockstep::bench::peak_device_memory_mb(device), samples_per_s * flops_per_sample(params, s),
              static_cast<long long>(params));
}

} // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"lockstep-bench-transformer: one contender of scripts/gpu_bench.sh at world size 1"};
  app.add_option("CONTENDER", o.contender, "bare, dataparallel, ddp, fullshard or fullshard-checkpointed")
      ->required()->check(CLI::IsMember({"bare", "dataparallel", "ddp", "fullshard", "fullshard-checkpointed"}));
  app.add_option("MODEL", o.model, "gpt or vit")->required()->check(CLI::IsMember({"gpt", "vit"}));
  app.add_option("--device", o.device, "cuda (cuda:0) or cpu")->check(CLI::IsMember({"cuda", "cpu"}))
      ->capture_default_str();
  app.add_option("--size", o.size, "full, or tiny (a logic test on the CPU)")->check(CLI::IsMember({"full", "tiny"}))
      ->capture_default_str();
  app.add_option("--steps", o.steps, "Timed steps, after 3 untimed ones")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--batch", o.batch, "Samples a step (default: 16 sequences, or 256 images)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    const torch::Device device = o.device == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
    TORCH_CHECK(!device.is_cuda() || torch::cuda::is_available(), "lockstep-bench-transformer: --device cuda, and this "
                "machine has no GPU that LibTorch can use; give --device cpu.");
    torch::manual_seed(0);
    const Shape s = shape_of(o);
    const bool checkpointed = o.contender == "fullshard-checkpointed";
    if (o.model == "gpt") {
      run(lockstep::examples::Gpt(s.vocab, s.context, s.dim, s.depth, s.heads, 0.0, checkpointed), o, s, device);
    } else {
      run(lockstep::examples::VisionTransformer(s.dim, s.depth, s.heads, 0.0, checkpointed), o, s, device);
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
