#pragma once

// Internal: ShardedCore's state and the steps of a sharded forward and
// backward. The forward side (gathering, prefetch, freeing) is in
// src/fsdp/forward.cpp, the backward side (reduce-scatters) in
// src/fsdp/backward.cpp. Note [Sharded step] describes both.

#include <lockstep/detail/sharded_core.h>
#include <lockstep/sharding_options.h>
#include <lockstep/timeline.h>

#include "comm/collective_fingerprint.h"
#include "comm/planned_collective.h"
#include "deterministic/micro_batch_step.h"
#include "fsdp/flat_param.h"
#include "fsdp/storage_watch.h"
#include "io/dcp_hf.h"
#include "io/safetensors_file.h"
#include "util/cpu_cache.h"

#include <torch/csrc/autograd/function.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

struct ShardedCore::State : StorageWatcher, std::enable_shared_from_this<ShardedCore::State> {
  static constexpr size_t kNone = std::numeric_limits<size_t>::max();
  // Where the current step is: between before_forward and after_forward,
  // between after_forward and the first gradient, in backward, or none.
  enum class Pass { None, Forward, AfterForward, Backward };

  ProcessGroup group;
  int64_t model = 0; // this wrapper's number in its collectives' tags (Note [Collective tags])
  ShardingStrategy strategy = ShardingStrategy::FullShard;
  bool reshard_after_forward = true;
  std::vector<FlatParam> flats; // the root's first, then the units' in order
  Pass pass = Pass::None;
  bool watched_pass = false; // this core began a pass of storage_watch.h
  // Note [A sharded step's memory]: the cache this model's CPU passes
  // allocate from, and the thread whose caching a pass turned on.
  std::unique_ptr<CpuCacheUser> cache_user;
  std::thread::id cached_thread;
  bool thread_cached_before = false;
  bool forwarded = false; // a forward ran whose backward has not ended
  // What ended the forward whose backward had not come (load_sharded(),
  // summon_full_params()): its backward is then an error. Note [Loading
  // between forward and backward].
  const char* forward_dropped_by = nullptr;
  bool sync = true; // ShardedCore::set_sync: no_sync() sets it false
  // Deterministic mode (src/fsdp/deterministic.cpp): its step, and the
  // flats' parameters (flat, index) in the module's order; keep_grads while
  // a micro-batch's backward leaves its gradients on the parameters.
  std::unique_ptr<MicroBatchStep> micro_batches;
  std::vector<std::pair<size_t, size_t>> module_order;
  bool keep_grads = false;
  // Note [no_sync at backward]: whether the backward under way reduces.
  bool backward_syncs = true;
  bool backward_decided = false;
  bool finalize_queued = false;
  bool summoned = false;
  // Note [Shard buckets]: flat indices per all-gather (forward order), and
  // the reduce-scatters (the reverse), each with what it started.
  struct Bucket {
    std::vector<size_t> members;
    std::shared_ptr<Work> work;
    torch::Tensor output;
    timeline::Span span; // from its start to its wait (Note [Timeline] in src/util/timeline.cpp)
  };
  std::vector<std::vector<size_t>> gather_buckets;
  std::vector<size_t> bucket_of; // each flat's gather bucket
  std::deque<Bucket> in_flight; // all-gathers started and not yet waited, in start order
  // Gather buckets in the order this forward, and the last one, first used them.
  std::vector<size_t> order, last_order;
  // Per gather bucket, whether this backward, and the last one, read it.
  std::vector<char> backward_reads, last_backward_reads;
  std::vector<Bucket> reduce_buckets;
  size_t next_launch = 0; // into reduce_buckets
  // Note [Planned rings] in src/comm/planned_collective.cpp: a backward's
  // all-gathers and reduce-scatters, planned from the last backward's
  // (begin_backward starts each).
  RecurringPlan plan{"FullyShardedDataParallel's backward all-gathers and reduce-scatters",
                     "They follow from the units, the order forward read them in, which units backward reads, no_sync() "
                     "and ShardingOptions: look for one of these that differs between ranks."};
  // Shards whose .grad this backward created, each with its share of ranks
  // that used it (Note [Units no rank used]).
  std::vector<std::pair<size_t, torch::Tensor>> fresh_grads;
  // What is not sharded but is the model's state: buffers and frozen
  // parameters, by name, the live tensors, which checkpoints save whole.
  std::vector<std::pair<std::string, torch::Tensor>> whole;
  // The units whose checkpointing this wrapper switched on
  // (ShardingOptions().activation_checkpointing()), and switches off at its end.
  std::vector<std::shared_ptr<torch::nn::Module>> checkpointed_units;
  size_t first_frozen = 0; // whole's frozen parameters follow its buffers
  // A tied parameter's other names, each with the first, under which it is
  // planned (Note [Tied parameters in checkpoints]).
  std::vector<std::pair<std::string, std::string>> aliases;

  std::string where() const {
    return "lockstep::FullyShardedDataParallel: rank " + std::to_string(group.rank()) + " of " +
        std::to_string(group.size()) + ": ";
  }
  bool sharded() const {
    return strategy != ShardingStrategy::NoShard;
  }
  std::string bucket_name(const std::vector<size_t>& members) const;

  // src/fsdp/forward.cpp: gathering and freeing.
  void plan_buckets();
  void point_params_at_views(FlatParam& flat);
  void start_bucket(size_t g);
  void start_gather(Bucket& b);
  void wait_in_flight(size_t flat = kNone);
  void unpack_gathered(const Bucket& b);
  void ensure_gathered(size_t f);
  void gather_all();
  void release(FlatParam& flat, bool empty);
  void release_all();
  void forget_gathered();
  void release_used(const std::vector<size_t>& touched);
  size_t forward_after(size_t g) const;
  size_t backward_after(size_t g) const;
  void on_touch(const std::vector<size_t>& touched) override;
  void cache_thread_allocations(bool on);
  void begin_forward();
  void begin_backward();
  void end_pass();
  /// Note [Loading between forward and backward]: a load by `load` ("load_sharded()").
  void drop_forward(const char* load);

  // src/fsdp/safetensors.cpp: Note [Saving sharded weights as safetensors].
  struct OneFlat { // the flat buffer gathered last, whole, on the CPU
    size_t f = kNone;
    torch::Tensor full;
  };
  torch::Tensor gathered_in_own_dtype(OneFlat& cache, size_t f);
  // src/fsdp/dcp_checkpoint.cpp: Note [A flat shard as boxes].
  std::vector<BoxSource> shard_boxes() const;
  // Where a parameter's first name lives: (flat, parameter), or (kNone,
  // index into whole) for a frozen one.
  std::pair<size_t, size_t> locate(const std::string& first) const;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> stage_dcp_load(const DcpCheckpoint& checkpoint) const;
  std::vector<SafetensorsSource> safetensors_sources(const std::string& who);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> stage_safetensors_load(const std::string& path,
                                                                              const SafetensorsLoadOptions& options);

  // src/fsdp/precision.cpp: Note [Sharded mixed precision].
  // `frozen_batch_norms`: frozen parameters that keep their dtype.
  void set_precision(const ShardingOptions& options, const std::set<std::string>& frozen_batch_norms);
  bool summon_in_own_dtype();
  // Note [Dropping a no_sync accumulation].
  void set_aside_accumulated();
  static void drop_accumulated_if_cleared(FlatParam& flat);
  static torch::Tensor take_gradient(FlatParam& flat, size_t j);

  // src/fsdp/summon.cpp: Note [Replaced parameters] and Note [Edits
  // outside summon_full_params].
  void adopt_replaced_params(bool writeback);
  const std::string* edited_while_summoned() const; // Note [A summon without writeback]
  void check_untouched_at_rest();
  void check_still_frozen_or_trained() const;

  // src/fsdp/backward.cpp: gradients into the shards.
  // Calls on_ready(flat, index) after autograd accumulates a parameter's
  // gradient.
  class ReadyHook : public torch::autograd::FunctionPostHook {
   public:
    ReadyHook(std::weak_ptr<State> state, size_t flat, size_t index)
        : state_(std::move(state)), flat_(flat), index_(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list& inputs) override;

   private:
    std::weak_ptr<State> state_;
    size_t flat_, index_;
  };
  void on_ready(size_t f, size_t j);
  void launch_ready();
  bool write_grads(FlatParam& flat, const torch::Tensor& rows);
  void launch(Bucket& bucket);
  void land(Bucket& bucket);
  void drop_unused_fresh_grads();
  void finalize();
  [[noreturn]] void refuse_unforwarded(const std::string& what) const;
  void on_output_gradient();
  void decide_sync();
  // src/fsdp/deterministic.cpp.
  std::vector<torch::Tensor> take_micro_batch_gradients();
  void reduce_exactly(int64_t step, const MicroBatchGradients& gradients);
  torch::Tensor exact_clip_grad_norm_(double max_norm, double norm_type);
};

} // namespace detail
} // namespace lockstep
