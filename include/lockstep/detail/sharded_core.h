#pragma once

// Internal: the part of FullyShardedDataParallel that does not depend on the
// module's type (src/fsdp/forward.cpp), and the pure planning it rests on
// (src/fsdp/plan.cpp).

#include <lockstep/process_group.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {

class SafetensorsSaveOptions;
class SafetensorsLoadOptions;

struct FlatParamInfo;
struct ShardingOptions;

namespace detail {

/// Which unit owns each parameter: the longest unit path that is the
/// parameter's module path or a prefix of it, else the root (""). `paths`
/// are dotted submodule paths; `names` are parameter names as
/// named_parameters() gives them. Returns one index per name into the units
/// {"" (the root), paths...}.
std::vector<size_t> assign_units(const std::vector<std::string>& names, const std::vector<std::string>& paths);

/// A flat buffer of `numel` elements split over `world` ranks: padded to a
/// multiple of the world size, `shard` elements per rank.
struct ShardLayout {
  int64_t numel = 0;
  int64_t padded = 0;
  int64_t shard = 0;
};
ShardLayout shard_layout(int64_t numel, int world);

/// What ShardedCore keeps per unit and dtype (src/fsdp/forward.cpp).
struct FlatParam;

/// Marks every FullyShardedDataParallelImpl, whatever its module's type, so
/// that a wrapper finds one nested in the module it wraps (Note [Nested
/// wrappers] in src/fsdp/construct.cpp).
class ShardedCore;
struct ShardedWrapperMark {
  virtual ~ShardedWrapperMark() = default;
  /// Its core: lockstep::save_safetensors and load_safetensors reach it so.
  virtual ShardedCore& sharded_core() const = 0;
};

class ShardedCore {
 public:
  /// Plans the units, checks that every rank built the same model, copies
  /// rank 0's parameters and buffers to every rank, and registers this
  /// rank's shards on `owner` (the FullyShardedDataParallelImpl).
  ShardedCore(torch::nn::Module& owner, torch::nn::Module& module, ProcessGroup group, const ShardingOptions& options);
  ~ShardedCore();
  ShardedCore(const ShardedCore&) = delete;
  ShardedCore& operator=(const ShardedCore&) = delete;

  /// Gathers the units' parameters and points the module's at them.
  /// `batch`: the first tensor argument's size in dim 0, -1 if none
  /// (deterministic mode checks it).
  void before_forward(int64_t batch = -1);
  /// FullyShardedDataParallelImpl::backward_micro_batches (src/fsdp/deterministic.cpp).
  double backward_micro_batches(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of);
  /// Frees what the strategy frees after forward, and hooks the outputs so
  /// that backward gathers it again first.
  void after_forward(const std::vector<torch::Tensor>& outputs);
  /// The module's forward threw: forgets what it gathered (Note [A forward
  /// that throws]). Never throws itself.
  void abort_forward() noexcept;

  /// A floating-point input of forward in ShardingOptions::param_dtype
  /// (as it is without one).
  torch::Tensor cast_input(const torch::Tensor& input) const;

  /// summon_full_params: every unit gathered, the module's parameters its
  /// views; then the edits copied into the shards (writeback) and resharded.
  /// Without writeback, a parameter edited inside the guard is an error
  /// once it has ended (Note [A summon without writeback]).
  void summon();
  void unsummon(bool writeback);
  /// Ends a guard ended by an exception, writing nothing back: never throws
  /// (Note [A summon ended by an exception]).
  void abandon_summon() noexcept;

  /// The no_sync guard's state, which a backward reads when its first
  /// gradient comes (Note [no_sync at backward]).
  bool sync() const;
  void set_sync(bool sync);
  const ProcessGroup& group() const {
    return group_;
  }
  /// FullyShardedDataParallelImpl::to: nothing where the model is on
  /// `device` (when given) in `dtype` (when given) already, else an error
  /// (src/fsdp/construct.cpp).
  void check_move(const std::optional<torch::Device>& device, const std::optional<torch::Dtype>& dtype) const;
  /// FullyShardedDataParallelImpl::flat_params (src/fsdp/construct.cpp).
  std::vector<FlatParamInfo> flat_params() const;

  /// FullyShardedDataParallelImpl::clip_grad_norm_ (src/fsdp/backward.cpp).
  torch::Tensor clip_grad_norm_(double max_norm, double norm_type);

  /// lockstep::save_sharded and load_sharded, in PyTorch's distributed
  /// checkpoint layout (src/fsdp/dcp_checkpoint.cpp); `optimizer` nullptr:
  /// the weights alone.
  int64_t save_sharded(torch::optim::Optimizer* optimizer, const std::string& dir) const;
  void load_sharded(torch::optim::Optimizer* optimizer, const std::string& dir, std::optional<int64_t> expected_save_id);
  /// lockstep::save_safetensors and load_safetensors of the wrapper
  /// (src/fsdp/safetensors.cpp).
  void save_safetensors(const std::string& path, const SafetensorsSaveOptions& options) const;
  void load_safetensors(const std::string& path, const SafetensorsLoadOptions& options);
  /// FullyShardedDataParallelImpl's save and load: an error that says how
  /// to checkpoint instead (src/fsdp/checkpoint_common.cpp).
  [[noreturn]] void refuse_serialization(const char* what) const;
  /// lockstep::full_optimizer_state (src/fsdp/optimizer.cpp).
  void full_optimizer_state(torch::optim::Optimizer& optimizer, torch::optim::Optimizer& full) const;
  /// lockstep::shard_full_optimizer_state (src/fsdp/optimizer.cpp).
  void shard_full_optimizer_state(torch::optim::Optimizer& full, torch::optim::Optimizer& optimizer);

 private:
  std::vector<FlatParam*> flats() const;
  void end_summon(bool writeback);
  /// Buffers and frozen parameters: the model's state that is not sharded.
  const std::vector<std::pair<std::string, torch::Tensor>>& whole() const;
  bool sharded() const;
  /// load_sharded of a folder in lockstep's earlier format (src/fsdp/checkpoint_v1.cpp).
  void load_sharded_v1(torch::optim::Optimizer* optimizer, const std::string& dir, std::optional<int64_t> expected_save_id);
  /// Reads and checks what load_sharded_v1 would change; returns the change (Note [A load changes all or nothing]),
  /// and sets `save_id` to the save's (0 for an index without one).
  std::function<void()> stage_load(torch::optim::Optimizer* optimizer, const std::string& dir, int64_t& save_id);
  void shard_flat(torch::nn::Module& owner, size_t f);
  /// Deterministic mode's step (src/fsdp/deterministic.cpp).
  void make_deterministic(torch::nn::Module& module, const ShardingOptions& options);
  struct State;
  std::shared_ptr<State> state_;
  ProcessGroup group_;
  std::optional<torch::ScalarType> param_dtype_;
};

} // namespace detail
} // namespace lockstep
