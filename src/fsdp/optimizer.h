#pragma once

// Internal: the optimizer's state of a FullyShardedDataParallel's shards, as
// save_sharded, load_sharded (src/fsdp/dcp_checkpoint.cpp, and
// src/fsdp/checkpoint_v1.cpp for the earlier format) and full_optimizer_state
// (src/fsdp/optimizer.cpp) read and write it.

#include "fsdp/flat_param.h"

#include <torch/optim.h>
#include <torch/serialize.h>

#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

constexpr const char* kSaveFullInstead = "Save a full checkpoint under summon_full_params() instead.";

/// The optimizer's type, as the index records it: a state read into an
/// optimizer of another type would fill the wrong fields, or leave its own
/// undefined for its step to trip on.
std::string optimizer_kind(torch::optim::Optimizer& optimizer);
/// A fresh state of the optimizer's own type; `who` names the caller, and
/// `advice` ends the error for a type whose state cannot be resharded.
std::unique_ptr<torch::optim::OptimizerParamState> new_state(torch::optim::Optimizer& optimizer,
                                                             const char* who = "lockstep::load_sharded",
                                                             const char* advice = kSaveFullInstead);
/// What an output archive wrote, for reading.
torch::serialize::InputArchive readable(torch::serialize::OutputArchive& archive);
/// `state` (as an optimizer's param state serializes) read into a new state
/// object of the optimizer's own type: as load_state_dict, nothing of the
/// state it replaces is kept.
std::shared_ptr<torch::optim::OptimizerParamState> read_state(torch::optim::Optimizer& optimizer,
                                                              torch::serialize::OutputArchive& state);
/// `state` becomes `param`'s state in `optimizer` (nullptr: it has none).
void install_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                   const std::shared_ptr<torch::optim::OptimizerParamState>& state);

/// Note [Optimizer options in a sharded checkpoint]: each parameter group's
/// options (lr, momentum, betas, weight decay) into `archive`, and read
/// back into copies of `optimizer`'s own for load_sharded to install.
/// `file` names what is read, for the error when the counts differ.
void write_group_options(torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive);
using GroupOptions = std::vector<std::shared_ptr<torch::optim::OptimizerOptions>>;
GroupOptions read_group_options(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive,
                                const std::string& file);
void install_group_options(torch::optim::Optimizer& optimizer, const GroupOptions& options);

} // namespace detail
} // namespace lockstep
