#pragma once

// Internal: what FullyShardedDataParallel's checkpoints share, whichever the
// format (src/fsdp/dcp_checkpoint.cpp, src/fsdp/checkpoint_v1.cpp) and
// src/fsdp/safetensors.cpp: how a step fails on every rank alike, the save's
// id, and the folder's checks (src/fsdp/checkpoint_common.cpp).

#include <lockstep/process_group.h>

#include "fsdp/flat_param.h"

#include <functional>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// control_device's for the flat parameters' device.
torch::Device control_device_of(const ProcessGroup& group, const std::vector<FlatParam*>& flats);

/// A number that tells one save from another, the same on every rank
/// (rank 0's, broadcast).
int64_t new_save_id(const ProcessGroup& group, torch::Device device);
/// Note [One save on every rank]: every rank learns that all loaded save
/// `save_id`, or fails naming the rank that did not.
void check_same_save(const ProcessGroup& group, torch::Device device, int64_t save_id, const std::string& dir);
/// load_sharded's first step, on every rank alike: an error unless `dir` is
/// a folder on every rank, then whether it holds lockstep's earlier sharded
/// format (index.json and shard-R-of-W.pt, Note [Sharded checkpoint] in
/// src/fsdp/checkpoint_v1.cpp) and no later save, an error unless every
/// rank's does or none does.
bool is_lockstep_v1_folder_on_every_rank(const ProcessGroup& group, torch::Device device, const std::string& dir);
/// Runs `step` on every rank, then every rank learns whether every other got
/// through it, so that none waits for one that failed: the failing rank
/// throws its own error, the others one naming it and `failure`, saying
/// that its own error `tells`. `device`: control_device_of's.
void on_every_rank(const ProcessGroup& group, torch::Device device, const std::string& failure,
                   const std::function<void()>& step, const char* tells = "names the file and what is wrong with it");

} // namespace detail
} // namespace lockstep
