#pragma once

// Internal: what FullyShardedDataParallel keeps per unit and dtype, shared by
// src/fsdp/forward.cpp and src/fsdp/checkpoint_v1.cpp.

#include <lockstep/detail/sharded_core.h>

#include "util/torch_compat.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

struct FlatParam {
  std::string unit; // "" for the root
  torch::ScalarType dtype = torch::kFloat; // the parameters' and the shard's
  // ShardingOptions::param_dtype for a floating-point flat, else dtype: the
  // gathered buffer's, and so what forward and backward compute in
  // (Note [Sharded mixed precision]).
  torch::ScalarType compute_dtype = torch::kFloat;
  torch::ScalarType reduce_dtype = torch::kFloat; // what its gradients are reduce-scattered in
  bool keep_dtype = false; // a BatchNorm's parameters: no param_dtype or reduce_dtype
  torch::Device device = torch::kCPU;
  std::vector<torch::Tensor> params; // the module's own
  std::vector<std::string> names;
  std::vector<int64_t> offsets;
  std::vector<std::vector<int64_t>> shapes; // the parameters' own, kept while they are empty
  ShardLayout layout;
  torch::Tensor shard; // registered on the wrapper
  torch::Tensor full; // the gathered buffer, in compute_dtype; its storage is released while sharded
  torch::Tensor summoned; // summon_full_params() under a param_dtype: the whole buffer in dtype
  std::vector<torch::Tensor> views; // the parameters' views of `full`, made once
  // Under no_sync: each parameter's gradients summed so far, in reduce_dtype
  // where that is wider than compute_dtype (Note [Sharded mixed precision]);
  // undefined where none came. Dropped once the shard's .grad is no longer
  // the tensor noted beside it (Note [Dropping a no_sync accumulation]).
  std::vector<torch::Tensor> accumulated;
  const void* set_aside_beside = nullptr;
  int64_t set_aside_version = 0;
  // Whether that .grad is the zeros no_sync gave a shard that had none: a
  // synced backward then treats it as one it made itself (Note [Units no
  // rank used]).
  bool set_aside_made = false;
  // Note [Edits outside summon_full_params]: whether its parameters are
  // empty tensors at rest, and their version counters since.
  bool resting = false;
  std::vector<int64_t> rest_versions;
  // Note [A summon without writeback]: the parameters' version counters
  // when summon_full_params() gathered them.
  std::vector<int64_t> summon_versions;
  bool gathered = false;
  bool pending = false; // its all-gather is in flight
  bool used = false; // an operator read it in this forward
  std::vector<char> ready;
  size_t ready_count = 0;
  std::vector<NodePtr> accumulators;
  std::vector<uintptr_t> hook_keys;

  torch::TensorOptions options() const {
    return torch::TensorOptions().dtype(dtype).device(device);
  }
};

/// The name of `flat`'s shard on the wrapper ("layers/0:Float", and
/// "layers/0:Float:batch_norm" for its BatchNorms' parameters under a
/// param_dtype; a parameter's name has no dots).
inline std::string shard_name(const FlatParam& flat) {
  std::string name = flat.unit.empty() ? std::string("root") : flat.unit;
  std::replace(name.begin(), name.end(), '.', '/');
  return name + ":" + c10::toString(flat.dtype) + (flat.keep_dtype ? ":batch_norm" : "");
}

/// Whether `shard_grad` is the .grad that no_sync last set aside beside its
/// accumulation, unchanged since (Note [Dropping a no_sync accumulation]).
inline bool is_set_aside(const FlatParam& flat, const torch::Tensor& shard_grad) {
  return shard_grad.defined() && shard_grad.unsafeGetTensorImpl() == flat.set_aside_beside &&
      shard_grad._version() == flat.set_aside_version;
}

// src/fsdp/same_model.cpp: the ranks' agreement at construction.

/// Every rank must shard the same parameters, or the flat buffers would not
/// line up: the names, shapes and dtypes, hashed and compared, and the
/// options; a different model or options on any rank, or parameters on
/// several devices, is an error on every rank. Returns the wrapper's model
/// number, rank 0's proposal (Note [Collective tags]).
int64_t check_same_model(const ProcessGroup& group, const std::vector<std::string>& names,
                         const std::vector<torch::Tensor>& params, const ShardingOptions& options,
                         const std::string& where);

/// Where the group carries FSDP's own small int64 tensors (the model check,
/// a checkpoint's verdicts and id): the CPU where it can, else `device`, the
/// parameters' (NCCL takes CUDA tensors only).
torch::Device control_device(const ProcessGroup& group, torch::Device device);

// src/fsdp/construct.cpp: what ShardedCore's constructor plans.

/// Note [A module wrapped twice]: the trainable parameters of the live
/// wrappers. A parameter another wrapper holds is an error naming it.
void check_not_wrapped(const std::vector<std::string>& names, const std::vector<torch::Tensor>& params,
                       const std::string& where);
void note_wrapped(const std::vector<torch::Tensor>& params);
/// Note [Nested wrappers]: a FullyShardedDataParallel inside `module` (or
/// `module` itself one) is an error naming its path.
void check_not_nested(torch::nn::Module& module, const std::string& where);
void forget_wrapped(const std::vector<torch::Tensor>& params);

/// The units' submodule paths: options.units(), or each direct child; a
/// path that names no submodule is an error.
std::vector<std::string> unit_paths(torch::nn::Module& module, const ShardingOptions& options, const std::string& where);

// The module's parameters, each once at its first name, with its unit; one
// that two units share is refused.
struct Planned {
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  std::vector<size_t> units;
  std::vector<std::pair<std::string, size_t>> aliases; // another name of parameter i (a tied one)
  std::vector<char> keep_dtype; // a BatchNorm's: no param_dtype or reduce_dtype (Note [Sharded mixed precision])
};

/// With keep_batch_norms (a param_dtype or reduce_dtype is set), BatchNorm's
/// parameters are marked keep_dtype (Note [Sharded mixed precision]).
Planned plan_parameters(torch::nn::Module& module, const std::vector<std::string>& paths, bool keep_batch_norms,
                        const std::string& where);

/// One flat parameter per unit, (dtype, device) and keep_dtype, the root's first, with
/// its parameters and offsets; layouts and buffers come later. Frozen
/// parameters are left out (Note [Frozen parameters]).
std::vector<FlatParam> group_into_flats(const Planned& planned, const std::vector<std::string>& paths);

} // namespace detail
} // namespace lockstep
