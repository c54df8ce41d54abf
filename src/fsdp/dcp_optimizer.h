#pragma once

// Internal: a FullyShardedDataParallel optimizer's state in PyTorch's
// distributed checkpoint layout, beside the weights that
// src/fsdp/dcp_checkpoint.cpp writes (Note [Optimizer state in the DCP
// layout], src/fsdp/dcp_optimizer.cpp).

#include "fsdp/flat_param.h"
#include "fsdp/optimizer.h"
#include "io/dcp_hf.h"

#include <nlohmann/json.hpp>
#include <torch/optim.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

/// PyTorch's name for a parameter's optimizer state `key`:
/// state.<parameter>.<key> (state.0.weight.exp_avg).
std::string optimizer_state_name(const std::string& parameter, const std::string& key);
/// Whether `name` is optimizer_state_name(p, key) for some p of `parameters`.
bool is_optimizer_state_name(const std::string& name, const std::vector<std::string>& parameters);

/// The boxes of the optimizer's state for `flats` that rank `rank` saves
/// (shard_boxes_of's `sharded` alike); rank 0 also the step counts.
std::vector<BoxSource> optimizer_state_boxes(torch::optim::Optimizer& optimizer, const std::vector<FlatParam*>& flats,
                                             int rank, bool sharded);
/// What the record keeps of the optimizer: {"optimizer": {"type", "param_groups"}}.
nlohmann::json optimizer_record(torch::optim::Optimizer& optimizer, const std::vector<FlatParam*>& flats);

/// What a load installs in the optimizer, read and checked.
struct StagedOptimizer {
  std::vector<std::pair<torch::Tensor, std::shared_ptr<torch::optim::OptimizerParamState>>> states; // per shard
  GroupOptions groups; // empty: the caller's stay
};
/// The optimizer's state for shard index `rank`'s range of each flat, from
/// `checkpoint`, and its groups' options from the record.
StagedOptimizer stage_optimizer_load(torch::optim::Optimizer& optimizer, const DcpCheckpoint& checkpoint,
                                     const std::vector<FlatParam*>& flats, int rank);
void install_optimizer(torch::optim::Optimizer& optimizer, const StagedOptimizer& staged);

} // namespace detail
} // namespace lockstep
