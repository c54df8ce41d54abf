#pragma once

// What FullyShardedDataParallel promises, as checks that run the same on
// ranks as threads (test_fully_sharded.cpp, Gloo) and on ranks as processes
// (fsdp_worker.cpp: Gloo under test_ddp_processes.cpp, MPI under mpirun).
// Each compares against one process trained on the whole batch.

#include <lockstep/lockstep.h>

#include "collective_contract.h"
#include "ddp_models.h"

#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace lockstep {
namespace testing {

inline constexpr ShardingStrategy kStrategies[] = {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                                   ShardingStrategy::NoShard};

inline const char* name_of(ShardingStrategy s) {
  return s == ShardingStrategy::FullShard ? "FullShard" : s == ShardingStrategy::ShardGradOp ? "ShardGradOp" : "NoShard";
}

inline void copy_values(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto src = from.parameters();
  auto dst = to.parameters();
  for (size_t i = 0; i < src.size() && i < dst.size(); ++i) {
    dst[i].copy_(src[i]);
  }
}

/// A copy of `initial`, with the same frozen parameters.
inline OddNet copy_of(OddNet initial) {
  OddNet net(initial->hidden, initial->use_branch);
  copy_values(*initial, *net);
  net->fc1->weight.set_requires_grad(initial->fc1->weight.requires_grad());
  return net;
}

/// Rank r's rows of the global batch of `rows` at `step`.
inline std::pair<torch::Tensor, torch::Tensor> share_of(int64_t rows, int64_t step, int rank, int world) {
  auto batch = global_batch(rows, step);
  const int64_t n = rows / world;
  return {batch.first.narrow(0, rank * n, n), batch.second.narrow(0, rank * n, n)};
}

/// Whether every parameter of the summoned module is within `tolerance` of
/// the reference's.
inline void check_full_params(FullyShardedDataParallel<OddNet>& model, OddNet reference, const Check& check,
                              const std::string& what, double tolerance = 1e-5) {
  auto full = model->summon_full_params();
  auto mine = model->module()->named_parameters();
  auto theirs = reference->named_parameters();
  check(mine.size() == theirs.size(), what + ": parameter count");
  for (size_t i = 0; i < mine.size() && i < theirs.size(); ++i) {
    const bool close = mine[i].value().sizes() == theirs[i].value().sizes() &&
        torch::allclose(mine[i].value(), theirs[i].value(), tolerance, tolerance);
    check(close, what + ": " + mine[i].key() + " differs from one process trained on the whole batch");
  }
}

/// `steps` Adam steps on the whole batch, in one process.
inline OddNet train_reference(OddNet initial, int steps, int64_t rows) {
  auto net = copy_of(initial);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < steps; ++step) {
    auto batch = global_batch(rows, step);
    adam.zero_grad();
    torch::mse_loss(net->forward(batch.first), batch.second).backward();
    adam.step();
  }
  return net;
}

/// Steps [first, last) of this rank's share of the 12-row batches that
/// train_reference takes whole.
inline void train_shares(FullyShardedDataParallel<OddNet>& model, torch::optim::Optimizer& optimizer,
                         const ProcessGroup& group, int first, int last, torch::Device device = torch::kCPU) {
  for (int step = first; step < last; ++step) {
    auto batch = share_of(12, step, group.rank(), group.size());
    optimizer.zero_grad();
    torch::mse_loss(model->forward(batch.first.to(device)), batch.second.to(device)).backward();
    optimizer.step();
  }
}

/// 5 Adam steps of each rank's share equal 5 on the whole batch (12 rows,
/// odd layer sizes that no world size divides).
inline void check_matches_reference(ProcessGroup& group, OddNet initial, ShardingStrategy strategy, const Check& check,
                                    int steps = 5) {
  auto reference = train_reference(initial, steps, 12);
  FullyShardedDataParallel<OddNet> model(copy_of(initial), group, ShardingOptions().strategy(strategy));
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  train_shares(model, adam, group, 0, steps);
  check_full_params(model, reference, check, std::string(name_of(strategy)) + " after " + std::to_string(steps) +
                    " Adam steps on " + std::to_string(group.size()) + " ranks");
}

/// 3 SGD steps, each after model->clip_grad_norm_(0.05, p), equal 3 on the
/// whole batch after torch::nn::utils::clip_grad_norm_ in one process: the
/// norm returned is the whole model's on every rank, and every shard is
/// scaled by the same factor (Note [Clipping sharded gradients]).
inline void check_clip_grad_norm(ProcessGroup& group, OddNet initial, ShardingStrategy strategy, double norm_type,
                                 const Check& check) {
  const double max_norm = 0.05;
  auto reference = copy_of(initial);
  torch::optim::SGD ref_sgd(reference->parameters(), 0.1);
  FullyShardedDataParallel<OddNet> model(copy_of(initial), group, ShardingOptions().strategy(strategy));
  torch::optim::SGD sgd(model->parameters(), 0.1);
  const std::string what = std::string(name_of(strategy)) + ", norm_type " + std::to_string(norm_type);
  for (int step = 0; step < 3; ++step) {
    auto batch = global_batch(12, step);
    ref_sgd.zero_grad();
    torch::mse_loss(reference->forward(batch.first), batch.second).backward();
    std::vector<torch::Tensor> nonempty; // LibTorch's inf-norm takes max() of each, which an empty one refuses
    for (const auto& p : reference->parameters()) {
      if (p.numel() > 0) {
        nonempty.push_back(p);
      }
    }
    const double expected = torch::nn::utils::clip_grad_norm_(nonempty, max_norm, norm_type);
    ref_sgd.step();
    auto share = share_of(12, step, group.rank(), group.size());
    sgd.zero_grad();
    torch::mse_loss(model->forward(share.first), share.second).backward();
    const double norm = model->clip_grad_norm_(max_norm, norm_type).item<double>();
    sgd.step();
    check(expected > max_norm, what + ": the reference's gradient norm " + std::to_string(expected) +
          " is small enough not to clip");
    check(std::abs(norm - expected) <= 1e-5 * expected, what + ": clip_grad_norm_ returned " + std::to_string(norm) +
          " on rank " + std::to_string(group.rank()) + ", the whole model's norm is " + std::to_string(expected));
  }
  check_full_params(model, reference, check, what + " after 3 clipped SGD steps");
}

/// A backward under no_sync, then one outside it, then a step: the same as
/// one process's step on the gradient of both batches.
inline void check_no_sync(ProcessGroup& group, OddNet initial, ShardingStrategy strategy, const Check& check) {
  auto reference = copy_of(initial);
  torch::optim::SGD sgd(reference->parameters(), 0.1);
  for (int step = 0; step < 2; ++step) {
    auto batch = global_batch(8, step);
    torch::mse_loss(reference->forward(batch.first), batch.second).backward();
  }
  sgd.step();
  FullyShardedDataParallel<OddNet> model(copy_of(initial), group, ShardingOptions().strategy(strategy));
  torch::optim::SGD opt(model->parameters(), 0.1);
  {
    auto guard = model->no_sync();
    auto batch = share_of(8, 0, group.rank(), group.size());
    torch::mse_loss(model->forward(batch.first), batch.second).backward();
  }
  auto batch = share_of(8, 1, group.rank(), group.size());
  torch::mse_loss(model->forward(batch.first), batch.second).backward();
  opt.step();
  check_full_params(model, reference, check, std::string(name_of(strategy)) + " with no_sync", 1e-6);
}

/// The branch, a unit of its own, used by every rank at step 0 and by none
/// after: as in the bare model, its shard's .grad stays undefined when its
/// gradients were set to none, so Adam's momentum and weight decay leave it
/// alone (Note [Units no rank used]).
inline void check_unit_no_rank_used(ProcessGroup& group, OddNet initial, ShardingStrategy strategy,
                                    const Check& check, bool accumulate = false) {
  const auto options = torch::optim::AdamOptions(0.01).weight_decay(0.1);
  auto clear = [](const std::vector<torch::Tensor>& params) {
    for (auto p : params) {
      p.mutable_grad() = torch::Tensor(); // zero_grad(set_to_none), which 1.13 lacks
    }
  };
  auto reference = copy_of(initial);
  torch::optim::Adam ref_adam(reference->parameters(), options);
  FullyShardedDataParallel<OddNet> model(copy_of(initial), group, ShardingOptions().strategy(strategy));
  torch::optim::Adam adam(model->parameters(), options);
  const std::string what = std::string(name_of(strategy)) + ", the branch used at step 0 only" +
      (accumulate ? ", a no_sync micro-batch before each step's: " : ": ");
  // With `accumulate`, micro-batch 10 * step goes under no_sync, then 10 * step + 1.
  const std::vector<int> first_micro_batch{0, accumulate ? 10 : 1, accumulate ? 20 : 2};
  for (int step = 0; step < 3; ++step) {
    reference->use_branch = model->module()->use_branch = step == 0;
    clear(reference->parameters());
    clear(model->parameters());
    for (int micro = first_micro_batch[step]; micro <= (accumulate ? first_micro_batch[step] + 1 : step); ++micro) {
      auto batch = global_batch(12, micro);
      torch::mse_loss(reference->forward(batch.first), batch.second).backward();
      auto share = share_of(12, micro, group.rank(), group.size());
      const bool synced = !accumulate || micro != first_micro_batch[step];
      std::optional<ShardedNoSyncGuard> guard;
      if (!synced) {
        guard.emplace(model->no_sync());
      }
      torch::mse_loss(model->forward(share.first), share.second).backward();
    }
    ref_adam.step();
    const auto flats = model->flat_params();
    for (size_t f = 0; f < flats.size(); ++f) {
      check(model->parameters()[f].grad().defined() == (step == 0 || flats[f].unit != "branch"),
            what + "unit '" + flats[f].unit + "' has a .grad at step " + std::to_string(step) + " iff some rank used it");
    }
    adam.step();
  }
  check_full_params(model, reference, check, what + "after 3 Adam steps with weight decay");
}

/// With `save`, 2 Adam steps saved into DIR/<strategy> with save_sharded;
/// else loaded from there, at whatever world size saved it, and 2 more, then
/// the whole model equals 4 steps of one process. On load, each rank's shard
/// sizes are also checked, and rank 0's full checkpoint (under
/// summon_full_params) loads into a bare module on every rank.
inline void check_sharded_checkpoint(ProcessGroup& group, OddNet initial, ShardingStrategy strategy,
                                     const std::string& dir, bool save, const Check& check) {
  const std::string where = dir + "/" + name_of(strategy);
  const std::string id_path = where + ".save_id";
  FullyShardedDataParallel<OddNet> model(copy_of(initial), group, ShardingOptions().strategy(strategy));
  // The load restores the saved lr, as torch::load of an optimizer does:
  // training on at 0.5 would leave the reference.
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(save ? 0.01 : 0.5));
  if (!save) {
    int64_t id = 0;
    std::ifstream(id_path) >> id;
    const std::string refused = message_of([&] { load_sharded(model, adam, where, id + 1); });
    check(refused.find(where + " holds save " + std::to_string(id) + ", not save " + std::to_string(id + 1)) !=
              std::string::npos,
          std::string(name_of(strategy)) + ": a load naming another save was not refused: " + refused);
    load_sharded(model, adam, where, id);
    const double lr = static_cast<const torch::optim::AdamOptions&>(adam.param_groups()[0].options()).lr();
    check(lr == 0.01, std::string(name_of(strategy)) + ": the load left lr at " + std::to_string(lr) + ", not the saved 0.01");
  }
  train_shares(model, adam, group, save ? 0 : 2, save ? 2 : 4);
  if (save) {
    const int64_t id = save_sharded(model, adam, where);
    if (group.rank() == 0) {
      std::ofstream(id_path) << id;
    }
    group.barrier();
    return;
  }
  const int world = strategy == ShardingStrategy::NoShard ? 1 : group.size();
  const auto flats = model->flat_params();
  const auto shards = model->parameters();
  for (size_t f = 0; f < flats.size() && f < shards.size(); ++f) {
    const int64_t want = (flats[f].numel + world - 1) / world;
    check(shards[f].numel() == want && flats[f].shard_numel == want,
          std::string(name_of(strategy)) + ": unit '" + flats[f].unit + "' has a shard of " +
              std::to_string(shards[f].numel()) + " elements, expected " + std::to_string(want));
  }
  auto reference = train_reference(initial, 4, 12);
  check_full_params(model, reference, check, std::string(name_of(strategy)) + " resumed from " + where + " on " +
                    std::to_string(group.size()) + " ranks");
  const std::string full_path = where + "/full.pt";
  {
    auto full = model->summon_full_params();
    if (group.rank() == 0) {
      torch::save(model->module(), full_path);
    }
  }
  group.barrier();
  OddNet bare(initial->hidden, initial->use_branch);
  torch::load(bare, full_path);
  const auto got = bare->parameters();
  const auto want = reference->parameters();
  bool close = got.size() == want.size();
  for (size_t i = 0; close && i < got.size(); ++i) {
    close = torch::allclose(got[i], want[i], 1e-5, 1e-5);
  }
  check(close, std::string(name_of(strategy)) + ": rank 0's full checkpoint in a bare module differs from the reference");
}

/// The full parameters, on the CPU, equal `reference`'s within 1e-4.
inline void check_full_params_on_gpu(FullyShardedDataParallel<OddNet>& model, OddNet reference, const Check& check,
                                     const std::string& what) {
  auto full = model->summon_full_params();
  const auto mine = model->module()->parameters();
  const auto theirs = reference->parameters();
  check(mine.size() == theirs.size(), what + ": parameter count");
  for (size_t i = 0; i < mine.size() && i < theirs.size(); ++i) {
    check(mine[i].is_cuda(), what + ": parameter " + std::to_string(i) + " is not on the GPU");
    check(torch::allclose(mine[i].cpu(), theirs[i], 1e-4, 1e-5),
          what + ": parameter " + std::to_string(i) + " differs from one CPU process on the whole batch");
  }
}

/// FullShard on GPU 0: 3 Adam steps of this rank's share equal 3 of one CPU
/// process on the whole batch.
inline void check_fullshard_on_gpu(ProcessGroup& group, OddNet initial, const Check& check) {
  const torch::Device gpu(torch::kCUDA, 0);
  auto net = copy_of(initial);
  net->to(gpu);
  FullyShardedDataParallel<OddNet> model(net, group);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  train_shares(model, adam, group, 0, 3, gpu);
  check_full_params_on_gpu(model, train_reference(initial, 3, 12), check,
                           "FullShard on the GPU over " + group.backend() + " on " + std::to_string(group.size()) +
                               " ranks");
}

/// The optimizer's state follows the parameters to the device they are on
/// at loading, as load_state_dict's does: one step saved with save_sharded
/// (into DIR) from the CPU, then loaded on GPU 0 and stepped twice there,
/// equals 3 steps of one CPU process.
inline void check_state_loads_onto_gpu(ProcessGroup& group, OddNet initial, const std::string& dir,
                                       const Check& check) {
  {
    FullyShardedDataParallel<OddNet> model(copy_of(initial), group);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    train_shares(model, adam, group, 0, 1);
    save_sharded(model, adam, dir);
  }
  const torch::Device gpu(torch::kCUDA, 0);
  auto net = copy_of(initial);
  net->to(gpu);
  FullyShardedDataParallel<OddNet> model(net, group);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  load_sharded(model, adam, dir);
  check(adam.state().size() == model->parameters().size(), "every shard has Adam's state after load_sharded");
  for (const auto& entry : adam.state()) {
    const auto& state = static_cast<const torch::optim::AdamParamState&>(*entry.second);
    check(state.exp_avg().is_cuda() && state.exp_avg_sq().is_cuda(),
          "Adam's state loaded for the GPU's shards is on the GPU");
  }
  train_shares(model, adam, group, 1, 3, gpu);
  check_full_params_on_gpu(model, train_reference(initial, 3, 12), check, "loaded onto the GPU, then 2 steps there");
}

/// Rank 1 builds a wider model than rank 0: an error on every rank, and
/// rank 1's names the first parameter that differs (it said only "4 against
/// 4 parameters, or different names, shapes, ...").
inline void check_model_mismatch(ProcessGroup& group, const Check& check) {
  OddNet net(group.rank() == 1 ? 14 : 13);
  const std::string said = message_of([&] { FullyShardedDataParallel<OddNet> model(net, group); });
  if (group.rank() == 1) {
    check_says(check, said, {"this rank built a different model than rank 0: rank 0 has 'fc1.weight' [13, 7] Float "
                             "where this rank has 'fc1.weight' [14, 7] Float.",
                             "Every rank must construct the same module"}, "a different model on rank 1");
  } else {
    check_says(check, said, {"rank 1 built a different model than rank 0 (its own error names the first parameter",
                             "Every rank must construct the same module"}, "a different model on rank 1");
  }
}

} // namespace testing
} // namespace lockstep
