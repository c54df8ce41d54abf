#pragma once

// Internal: the reducer's state, shared by src/ddp/reducer.cpp (buckets, hooks,
// the step's start), src/ddp/reducer_finalize.cpp (the end of backward) and
// src/ddp/reducer_slots.cpp (.grad as its bucket slot).

#include <lockstep/distributed_options.h>
#include <lockstep/timeline.h>

#include "comm/planned_collective.h"
#include "ddp/reducer.h"
#include "util/torch_compat.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

// Note [Reducer state]
// ~~~~~~~~~~~~~~~~~~~~
// A forward through DistributedDataParallel calls prepare_for_backward, which
// puts the reducer in phase Expecting (or Unsynced under no_sync). Each
// parameter's gradient accumulator has a post hook; in Expecting, it copies
// the accumulated .grad into the parameter's slot of its bucket (or, with
// gradient_as_bucket_view, makes .grad that slot) and marks the parameter
// ready. Buckets are launched strictly in order, so every rank issues the same
// collectives in the same order whatever order its gradients arrive in. The
// first hook queues finalize_backward on the engine, which runs when backward
// ends: parameters that got no gradient are reduced with what .grad holds,
// zeros if nothing (Note [Unused parameters]), so that no rank
// waits forever; every bucket is waited for and copied back into .grad (or
// made .grad: Note [Gradients that are bucket slots]), and,
// in plain mode (neither find_unused_parameters nor static_graph), one more
// tiny allreduce tells every rank whether any rank had parameters without
// gradients, so that they all raise the error instead of one raising and the
// others hanging.
//
// Note [Rebuilding buckets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The first buckets follow reverse registration order, a guess at the order
// backward produces gradients. The first reducing backward records the order
// the hooks actually fired in (parameters without a gradient last, or first
// under static_graph, where they are ready as soon as backward starts). At
// the next reducing forward, one rank's record is broadcast (rank 0's, or
// under join the first rank still training) and every rank rebuilds the same
// buckets from it, once. Gradients already accumulated (no_sync, or views)
// move into the new buckets.
//
// Note [Unused parameters]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// With find_unused_parameters (and in static_graph's first iteration), what a
// parameter's .grad becomes follows c10d's Reducer. A parameter counts as
// used on a rank if its hook fired with a gradient at any backward since the
// last reduction, no_sync passes included ("as long as it is used once during
// no_sync session", Reducer::autograd_hook). Parameters without a gradient in
// the reducing backward still put their .grad into the bucket (what no_sync
// accumulated; zeros when it is undefined), as mark_variable_ready_dense
// does, so that a rank that used one under no_sync contributes it. One more
// small allreduce, of the used flags, tells every rank which parameters no
// rank used: their .grad is kept untouched ("If a parameter is globally
// unused, we keep its grad untouched", copy_bucket_to_grad), not overwritten
// with zeros; under gradient_as_bucket_view, where .grad is the bucket slot
// the reduction wrote, its value from before is put back. Under static_graph
// the flags are reduced once, in the first iteration, and hold from then on,
// as c10d's local_used_map does.
//
// Note [Static graph]
// ~~~~~~~~~~~~~~~~~~~
// static_graph(true) promises that every iteration gives gradients to the
// same parameters. The first reducing backward records which ones got none;
// later ones mark those ready (as zeros) when backward starts, so their
// buckets go out at once, and skip both the search at the end of backward
// and plain mode's check collective. A broken promise must still fail on
// every rank, with no collective added to the normal step. So the last
// bucket carries one trailing element, a flag: a rank that saw a recorded
// parameter without gradient, or an unrecorded one with one, sets it. Plain
// mode's check, whether a rank had parameters without gradients, travels in
// that element in the same way. The last bucket is launched only once
// backward has ended, when both kinds of surprise are known; it is waited for with the others, and a non-zero flag
// makes every rank exchange what it saw, in one all_gather, and throw the
// same error naming the rank and the parameter. Under a communication hook
// the flag travels alone instead, in one more float's allreduce after the
// buckets: a hook need not reduce the whole buffer (a layer-wise one reduces
// GradBucket::gradients), and a flag it left out would let one rank throw
// while the others went on. A gradient that an
// unrecorded parameter gets inside no_sync is a surprise too: it is held
// until the next synced backward, whose flag carries it.

// One small allreduce (a sum) beside the buckets: launched, then read.
struct SmallCollective {
  torch::Tensor tensor;
  std::shared_ptr<Work> work;
  void launch(const ProcessGroup& group, torch::Tensor values, const std::string& what) {
    tensor = std::move(values);
    work = group.allreduce_async({tensor}, ReduceOp::Sum, what);
  }
  torch::Tensor result() {
    work->wait();
    return tensor.cpu();
  }
};

struct Reducer::State : std::enable_shared_from_this<Reducer::State> {
  // Runs autograd_hook once the parameter's gradient is accumulated.
  class ReadyHook : public torch::autograd::FunctionPostHook {
   public:
    ReadyHook(std::weak_ptr<State> state, size_t index) : state_(std::move(state)), index_(index) {}
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list& outputs,
        const torch::autograd::variable_list& /*inputs*/) override {
      if (auto state = state_.lock()) {
        state->autograd_hook(index_);
      }
      return outputs;
    }

   private:
    std::weak_ptr<State> state_;
    size_t index_;
  };

  enum class Phase { Idle, Expecting, Unsynced };
  // What a rank saw under static_graph that the first iteration did not.
  enum Surprise : int64_t { kNone = 0, kGradientFromUnused = 1, kNoGradientFromUsed = 2 };

  struct Bucket {
    std::vector<size_t> params;
    // The gradients; in the last bucket, the flag (Note [Static graph]); then,
    // without a hook, room for the words (Note [Planned collectives] in
    // src/comm/planned_collective.cpp).
    torch::Tensor buffer;
    int64_t numel = 0; // the gradients' elements, which the flag follows
    std::vector<torch::Tensor> views; // per param of the bucket, shaped as the param
    size_t pending = 0;
    std::shared_ptr<PendingReduction> result;
    std::string name;
    int64_t bytes = 0;
    timeline::Span allreduce_span; // from its launch to its wait (Note [Timeline] in src/util/timeline.cpp)
    bool shared = false; // in memory every rank maps (Note [Buffers every rank can reach])
    bool checked = false; // Note [Gradients that are bucket slots]: this backward looked for holders
  };

  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  ProcessGroup group;
  DistributedOptions options;
  std::vector<Bucket> buckets;
  int64_t plan = -1; // the buckets' allreduces, as the ranks agreed on them
  int64_t model = 0; // the wrapper's number in the collectives' tags (Note [Collective tags])
  bool had_unused = false; // plain mode: this rank's last backward left parameters without gradients
  std::vector<std::pair<size_t, size_t>> slot_of; // param -> (bucket, position)
  std::vector<char> ready;
  size_t next_bucket = 0;
  Phase phase = Phase::Idle;
  bool finalize_queued = false;
  bool shadowing = false; // shadow_backward: zeros, nothing recorded
  int64_t divisor = 1;
  // Note [Rebuilding buckets]
  bool rebuilt = false;
  std::vector<size_t> ready_order;
  // Note [Static graph]
  bool static_recorded = false;
  std::vector<char> static_unused;
  std::vector<int64_t> surprises;
  std::vector<int64_t> unsynced_surprises; // no_sync's, for the next synced backward to report
  // Note [Unused parameters]
  std::vector<char> used_since_sync; // per param: a hook fired with a gradient since the last reduction
  std::vector<char> global_unused; // per param: no rank used it, so its .grad is left as it was
  bool static_used_known = false;
  std::vector<torch::Tensor> saved_grads; // per param: a bucket-view .grad's value before copy-in
  std::vector<detail::NodePtr> accumulators;
  std::vector<uintptr_t> hook_keys;
  timeline::Span backward_span; // from the first hook to the end of finalize_backward

  std::string where() const {
    return "lockstep::DistributedDataParallel: rank " + std::to_string(group.rank()) + ": ";
  }
  bool checks_unused() const {
    return !options.find_unused_parameters() && !options.static_graph();
  }
  bool recording_order() const {
    return options.rebuild_buckets() && !rebuilt && !shadowing;
  }
  bool reduces_used_flags() const {
    return options.find_unused_parameters() || (options.static_graph() && !static_used_known);
  }
  // Note [Static graph]: where the flag travels.
  bool flag_in_last_bucket() const {
    return (options.static_graph() || checks_unused()) && !options.comm_hook();
  }
  float last_bucket_flag() const {
    return (options.static_graph() ? surprised() : had_unused) ? 1.0f : 0.0f;
  }
  // Whether the built-in allreduce of `bucket` is an Avg that the backend
  // divides as it sums (Note [An average divided where it is summed] in
  // src/comm/backends/shared_memory_collectives.cpp), rather than a Sum of
  // gradients divided on their way in. The same on every rank: the backend,
  // the plan's dtypes and the divisor are.
  bool backend_averages(const Bucket& bucket) const {
    return !options.comm_hook() && divisor == group.size() &&
           group.averages_in_backend(bucket.buffer.scalar_type(), bucket.buffer.device());
  }
  bool surprised() const {
    return std::any_of(surprises.begin(), surprises.end(), [](int64_t s) { return s != kNone; });
  }

  void build_buckets(const std::vector<size_t>& order);
  // Memory for the buckets of `items` that every rank maps, or none.
  std::vector<torch::Tensor> bucket_memory(const std::vector<PlanItem>& items) const;
  // Each defined .grad of `which` copied into its bucket slot, and made the slot.
  void move_gradients_into_slots(const std::vector<char>& which);
  void autograd_hook(size_t index);
  // Note [Gradients that are bucket slots]: the parameter's slot, once what
  // others hold of its bucket has moved to memory of their own.
  torch::Tensor& writable_slot(size_t index);
  bool held_elsewhere(const Bucket& bucket) const;
  void move_out_holders(Bucket& bucket);
  // Before the buckets are replaced: which .grad move into the new slots.
  std::vector<char> gradients_to_move() const;
  // Whether copy_out may make the parameter's slot its .grad instead of copying into it.
  bool slot_may_become_grad(size_t index, const torch::Tensor& slot) const;
  void copy_in(size_t index);
  void copy_in_unused(size_t index);
  void mark_ready(size_t index);
  void launch_ready_buckets(bool backward_ended);
  void finalize_backward();
  std::vector<size_t> record_unused();
  void launch_remaining_buckets(const std::vector<size_t>& unused);
  void record_global_unused(const torch::Tensor& counts);
  // Every bucket's reduction, in order; with `copy_each`, each copied out
  // as soon as it is there.
  std::vector<torch::Tensor> wait_buckets(bool copy_each);
  void copy_out(size_t bucket, const torch::Tensor& reduced);
  void check_unused(const std::vector<size_t>& unused, int ranks) const;
  void throw_static_graph_error();
};

} // namespace detail
} // namespace lockstep
