#pragma once

// Deterministic mode: the same bits at any world size, under
// DistributedDataParallel and every strategy of FullyShardedDataParallel. The checks run the same on ranks as threads (test_deterministic.cpp,
// Gloo) and as processes (ddp_worker.cpp: Gloo, and MPI under mpirun); each
// compares this group's training with one rank's, run in this process.

#include <lockstep/lockstep.h>

#include "collective_contract.h"
#include "ddp_models.h"

#include <torch/torch.h>

#include <cstring>
#include <memory>
#include <type_traits>
#include <string>
#include <vector>

namespace lockstep {
namespace testing {

/// An MLP whose parameters are set from a formula, not a generator: every
/// rank, thread or process builds the same one without seeding anything.
struct DeterministicNetImpl : torch::nn::Cloneable<DeterministicNetImpl> {
  explicit DeterministicNetImpl(double dropout = 0, bool batch_norm = false) : dropout(dropout), batch_norm(batch_norm) {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(7, 24));
    fc2 = register_module("fc2", torch::nn::Linear(24, 3));
    if (batch_norm) {
      norm = register_module("norm", torch::nn::BatchNorm1d(24));
    }
    torch::NoGradGuard no_grad;
    int64_t i = 0;
    for (auto& p : parameters()) {
      p.copy_(torch::sin(torch::arange(p.numel(), torch::kFloat) * 0.71 + static_cast<double>(++i)).view_as(p) * 0.4);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = fc1(x);
    if (batch_norm) {
      h = norm(h);
    }
    return fc2(torch::dropout(torch::tanh(h), dropout, is_training()));
  }
  double dropout;
  bool batch_norm;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(DeterministicNet);

struct DeterministicRun {
  int64_t micro_batches = 12, micro_batch_size = 3, steps = 3;
  std::string optimizer = "sgd"; // "sgd" (momentum 0.9) or "adam"
  double dropout = 0;
  bool batch_norm = false;
  double clip = 0; // > 0: clip the gradients' whole norm to it before each step
  torch::Device device = torch::kCPU;
  uint64_t seed = 5;
  // "ddp", or FullyShardedDataParallel's strategy: "full", "grad-op",
  // "no-shard"; "full-reordered" is FullShard with units {"fc2", "fc1"},
  // whose flats are not in the module's order; "dp": DataParallel on
  // two CPU replicas (its group must be of one).
  std::string wrapper = "ddp";
};

/// One step of `run` through `wrapper` (DDP or FSDP): the mean loss.
template <typename Wrapper>
double deterministic_step(Wrapper& wrapper, const DeterministicRun& run, torch::optim::Optimizer& optimizer,
                          int64_t step) {
  auto batch = global_batch(run.micro_batches * run.micro_batch_size, step);
  batch = {batch.first.to(run.device), batch.second.to(run.device)};
  const int64_t m = run.micro_batch_size;
  const double loss = wrapper->backward_micro_batches(step, [&](int64_t v) {
    auto out = wrapper->forward(batch.first.narrow(0, v * m, m));
    return torch::mse_loss(out, batch.second.narrow(0, v * m, m));
  });
  if (run.clip > 0) {
    if constexpr (!std::is_same_v<Wrapper, FullyShardedDataParallel<DeterministicNet>>) {
      // every rank holds the whole, same gradients: the norm is the same at every W
      torch::nn::utils::clip_grad_norm_(wrapper->parameters(), run.clip);
    } else {
      wrapper->clip_grad_norm_(run.clip);
    }
  }
  optimizer.step();
  return loss;
}

inline std::unique_ptr<torch::optim::Optimizer> deterministic_optimizer(const DeterministicRun& run,
                                                                        std::vector<torch::Tensor> params) {
  if (run.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

inline ShardingOptions deterministic_sharding(const DeterministicRun& run) {
  auto options = ShardingOptions().deterministic(true).micro_batches(run.micro_batches)
                     .micro_batch_size(run.micro_batch_size).seed(run.seed);
  if (run.wrapper == "grad-op") {
    options.strategy(ShardingStrategy::ShardGradOp);
  } else if (run.wrapper == "no-shard") {
    options.strategy(ShardingStrategy::NoShard);
  } else if (run.wrapper == "full-reordered") {
    options.units({"fc2", "fc1"});
  }
  return options;
}

/// Trains a DeterministicNet for `run` on `group` and returns every parameter
/// and buffer, flat, after the last step, with the losses the steps returned
/// appended.
inline torch::Tensor train_deterministic(const ProcessGroup& group, const DeterministicRun& run) {
  DeterministicNet net(run.dropout, run.batch_norm);
  net->to(run.device);
  std::vector<double> losses;
  auto state = [&] {
    std::vector<torch::Tensor> flat;
    for (const auto& p : net->parameters()) {
      flat.push_back(p.detach().reshape({-1}).to(torch::kDouble).cpu());
    }
    for (const auto& b : net->buffers()) {
      flat.push_back(b.detach().reshape({-1}).to(torch::kDouble).cpu());
    }
    flat.push_back(torch::tensor(losses, torch::kDouble));
    return torch::cat(flat);
  };
  if (run.wrapper == "ddp") {
    auto options = DistributedOptions().deterministic(true).micro_batches(run.micro_batches)
                       .micro_batch_size(run.micro_batch_size).seed(run.seed);
    DistributedDataParallel<DeterministicNet> ddp(net, group, options);
    auto optimizer = deterministic_optimizer(run, ddp->parameters());
    for (int64_t step = 0; step < run.steps; ++step) {
      losses.push_back(deterministic_step(ddp, run, *optimizer, step));
    }
    return state();
  }
  if (run.wrapper == "dp") {
    TORCH_INTERNAL_ASSERT(group.size() == 1);
    auto options = DataParallelOptions().devices({torch::kCPU, torch::kCPU}).deterministic(true)
                       .micro_batches(run.micro_batches).micro_batch_size(run.micro_batch_size).seed(run.seed);
    DataParallel<DeterministicNet> dp(net, options);
    auto optimizer = deterministic_optimizer(run, dp->parameters());
    for (int64_t step = 0; step < run.steps; ++step) {
      losses.push_back(deterministic_step(dp, run, *optimizer, step));
    }
    return state();
  }
  FullyShardedDataParallel<DeterministicNet> fsdp(net, group, deterministic_sharding(run));
  auto optimizer = deterministic_optimizer(run, fsdp->parameters());
  for (int64_t step = 0; step < run.steps; ++step) {
    losses.push_back(deterministic_step(fsdp, run, *optimizer, step));
  }
  auto full = fsdp->summon_full_params();
  return state();
}

/// This group's training against one rank's of DistributedDataParallel, to
/// the bit.
inline void check_same_bits_as_one_rank(const ProcessGroup& group, const DeterministicRun& run, const Check& check) {
  auto one_rank = run;
  one_rank.wrapper = "ddp";
  const auto alone = train_deterministic(ProcessGroup(), one_rank);
  const auto together = train_deterministic(group, run);
  const std::string what = " (" + run.wrapper + ", " + run.optimizer + ", dropout " + std::to_string(run.dropout) +
      (run.batch_norm ? ", BatchNorm" : "") + (run.clip > 0 ? ", clipped" : "") + ", W=" +
      std::to_string(group.size()) + ", rank " + std::to_string(group.rank()) + ")";
  const bool same = alone.numel() == together.numel() &&
      std::memcmp(alone.data_ptr(), together.data_ptr(), alone.nbytes()) == 0;
  check(same, "the parameters and losses are bitwise those of one rank" + what + "; largest difference " +
                  c10::str((alone - together).abs().max().item<double>()));
  check(torch::isfinite(together).all().item<bool>(), "the training stayed finite" + what);
}

} // namespace testing
} // namespace lockstep
