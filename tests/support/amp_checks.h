#pragma once

// GradScaler across ranks, as checks that run the same on ranks as threads
// (test_amp_threads.cpp, Gloo) and under mpirun (fsdp_worker.cpp scaler):
// an inf or NaN on one rank only must skip the step on every rank.

#include <lockstep/lockstep.h>

#include "errors.h"
#include "fsdp_checks.h"

#include <torch/torch.h>

#include <limits>
#include <string>
#include <vector>

namespace lockstep {
namespace testing {

/// Copies of every parameter tensor, to compare after a step.
inline std::vector<torch::Tensor> snapshot(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> copies;
  for (const auto& p : params) {
    copies.push_back(p.detach().clone());
  }
  return copies;
}

inline bool unchanged(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& before) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!torch::equal(params[i].detach(), before[i])) {
      return false;
    }
  }
  return true;
}

/// Whether every rank holds the same `value`.
inline bool same_on_every_rank(ProcessGroup& group, double value) {
  auto low = torch::tensor({value}, torch::kDouble);
  auto high = low.clone();
  group.allreduce(low, ReduceOp::Min);
  group.allreduce(high, ReduceOp::Max);
  return low.item<double>() == high.item<double>();
}

/// DDP: rank 1 feeds an inf, so its local gradients overflow; DDP's average
/// carries that to every rank, whose scalers (with no group) all skip.
inline void check_ddp_scaler_skips_together(ProcessGroup& group, const Check& check) {
  torch::manual_seed(0);
  DistributedDataParallel<OddNet> model(OddNet(), group);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  GradScaler scaler(GradScalerOptions().init_scale(1024.0));
  auto batch = share_of(8, 0, group.rank(), group.size());
  if (group.rank() == 1) {
    batch.first[0][0] = std::numeric_limits<float>::infinity();
  }
  const auto before = snapshot(model->parameters());
  scaler.scale(torch::mse_loss(model->forward(batch.first), batch.second)).backward();
  const bool stepped = scaler.step(adam);
  scaler.update();
  const std::string where = "DDP, rank " + std::to_string(group.rank()) + ": ";
  check(!stepped, where + "the step with an inf on rank 1 was taken");
  check(unchanged(model->parameters(), before), where + "a skipped step changed the parameters");
  check(scaler.get_scale() == 512.0, where + "the scale did not back off to 512: " + std::to_string(scaler.get_scale()));
}

/// FSDP: rank 1 puts an inf into its own shard of the gradients after
/// backward, where no other rank can see it. With the group, every rank
/// skips and backs off; the next clean step is taken everywhere.
inline void check_fsdp_scaler_skips_together(ProcessGroup& group, ShardingStrategy strategy, const Check& check) {
  torch::manual_seed(0);
  FullyShardedDataParallel<OddNet> model(OddNet(), group, ShardingOptions().strategy(strategy));
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  GradScaler scaler(GradScalerOptions().init_scale(1024.0).group(group));
  const std::string where = std::string(name_of(strategy)) + ", rank " + std::to_string(group.rank()) + ": ";
  for (int step = 0; step < 2; ++step) {
    auto batch = share_of(8, step, group.rank(), group.size());
    adam.zero_grad();
    scaler.scale(torch::mse_loss(model->forward(batch.first), batch.second)).backward();
    if (step == 0 && group.rank() == 1) {
      model->parameters()[0].grad().view(-1)[0] = std::numeric_limits<float>::infinity();
    }
    const auto before = snapshot(model->parameters());
    const bool stepped = scaler.step(adam);
    scaler.update();
    if (step == 0) {
      check(!stepped, where + "the step with an inf in rank 1's shard was taken");
      check(unchanged(model->parameters(), before), where + "a skipped step changed the shards");
      check(adam.state().empty(), where + "a skipped step created optimizer state");
    } else {
      check(stepped, where + "the clean step after a skipped one was skipped");
      check(!unchanged(model->parameters(), before), where + "the clean step changed nothing");
    }
  }
  check(same_on_every_rank(group, scaler.get_scale()) && scaler.get_scale() == 512.0,
        where + "the scale is not 512 on every rank: " + std::to_string(scaler.get_scale()));
}

/// Without the group, the same inf would make rank 1 skip alone: the inf
/// is in its shard only. unscale_ refuses a scaler whose group is smaller
/// than the shards' world, on every rank.
inline void check_fsdp_scaler_without_group_is_refused(ProcessGroup& group, const Check& check) {
  torch::manual_seed(0);
  FullyShardedDataParallel<OddNet> model(OddNet(), group);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  GradScaler scaler;
  auto batch = share_of(8, 0, group.rank(), group.size());
  scaler.scale(torch::mse_loss(model->forward(batch.first), batch.second)).backward();
  if (group.rank() == 1) {
    model->parameters()[0].grad().view(-1)[0] = std::numeric_limits<float>::infinity();
  }
  const std::string where = "rank " + std::to_string(group.rank()) + ": ";
  bool finite = true;
  for (const auto& p : model->parameters()) {
    finite = finite && (!p.grad().defined() || torch::isfinite(p.grad()).all().item<bool>());
  }
  check(finite == (group.rank() != 1), where + "the inf should be in rank 1's shard only");
  const auto error = error_of([&] { scaler.step(sgd); });
  check(error.find("the shards of a FullyShardedDataParallel over 2 ranks, but this scaler's group has 1") !=
            std::string::npos && error.find("GradScalerOptions().group(group)") != std::string::npos,
        where + "a scaler without the group unscaled FSDP's shards: " + (error.empty() ? "no error" : error));
}

} // namespace testing
} // namespace lockstep
