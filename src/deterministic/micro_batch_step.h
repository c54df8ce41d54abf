#pragma once

// Internal: the step of deterministic mode that every wrapper shares (Note
// [The same bits at any world size] in src/deterministic/micro_batch_step.cpp).
// Each rank runs its share of a step's micro-batches one by one and keeps each
// one's gradient; the ranks then agree on each parameter's largest gradient,
// the losses and the BatchNorm updates. How the gradients are then summed in
// int64 is the wrapper's: one allreduce (DistributedDataParallel) or one
// reduce-scatter (FullyShardedDataParallel), laid out with FixedPointPiece.

#include <lockstep/process_group.h>

#include "comm/planned_collective.h"
#include "deterministic/micro_batch_norms.h"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// What a wrapper's options set in deterministic mode.
struct MicroBatchConfig {
  int64_t micro_batches = 0; // V
  int64_t micro_batch_size = 0; // 0 checks nothing
  uint64_t seed = 0;
};

/// Refuses micro_batches, micro_batch_size and seed given to a wrapper
/// outside deterministic mode, where nothing reads them: `options` names the
/// wrapper's options ("DistributedOptions").
void check_no_micro_batch_options(const MicroBatchConfig& config, const std::string& where, const char* options);

/// One step's micro-batch gradients, and what the ranks agreed on.
struct MicroBatchGradients {
  /// [micro-batch k of this rank][parameter]: flat, contiguous, undefined
  /// where the micro-batch gave the parameter none.
  std::vector<std::vector<torch::Tensor>> grads;
  /// Per parameter, the largest |g| over every rank's micro-batches; NaN
  /// where one was not finite.
  std::vector<double> maxima;
  /// Per parameter, whether a micro-batch on some rank gave it a gradient.
  std::vector<char> used;
  int64_t micro_batches = 0; // V
  double mean_loss = 0; // over all V micro-batches, added in micro-batch order
};

/// Elements [begin, begin + count) of parameter `param`, at `at` in an int64
/// buffer of the step's exact sum.
struct FixedPointPiece {
  size_t param;
  int64_t begin, count, at;
};

/// Writes into `sum` (int64, contiguous) this rank's micro-batches' gradients
/// of each piece, scaled by its parameter's exponent and added; zeros where
/// no piece lies, and in a piece no micro-batch gave a gradient.
void write_fixed_point(torch::Tensor& sum, const std::vector<FixedPointPiece>& pieces,
                       const MicroBatchGradients& gradients);

/// A piece's gradient once `sum` holds every rank's sum: the mean over the V
/// micro-batches in `dtype`, shaped `sizes`; NaN where the parameter's
/// maximum was not finite.
torch::Tensor read_fixed_point(const torch::Tensor& sum, const FixedPointPiece& piece,
                               const MicroBatchGradients& gradients, torch::ScalarType dtype, at::IntArrayRef sizes);

/// The same, written into `out` (the piece's count of elements, in its
/// dtype), with no tensor of its own.
void read_fixed_point_into(torch::Tensor out, const torch::Tensor& sum, const FixedPointPiece& piece,
                           const MicroBatchGradients& gradients);

/// Refuses what deterministic mode cannot sum exactly, naming it: a complex
/// parameter that trains (`frozen_too`: any; its gradient would lose its
/// imaginary part in double) and an Embedding with sparse(true) (it sums
/// dense gradients). A wrapper calls it before it changes the module.
void check_exactly_summable(torch::nn::Module& module, const std::string& where, bool frozen_too);

class MicroBatchStep {
 public:
  /// `module` is the wrapped module: its buffers must be alike on every rank
  /// as each step starts, and its BatchNorms' statistics are kept (Note
  /// [Running statistics over micro-batches]). `where` begins each error.
  /// On a GPU `device`, turns the process's deterministic algorithms on.
  MicroBatchStep(torch::nn::Module& module, ProcessGroup group, const MicroBatchConfig& config, torch::Device device,
                 std::string where);

  /// Runs this rank's micro-batches of `step`: after micro-batch v's
  /// loss_of(v) and its backward, `take()` returns the gradient it gave
  /// each parameter (undefined where none) and clears them. An error in a
  /// micro-batch on any rank is an error on every rank, after the step's
  /// first collective, with the running statistics as the step found them.
  MicroBatchGradients run(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of,
                          const std::function<std::vector<torch::Tensor>()>& take);

  /// At each forward through the wrapper: refuses one that would make a
  /// gradient outside run(), and one whose batch (the first tensor
  /// argument's size in dim 0, -1 if none) is not micro_batch_size.
  void check_forward(int64_t batch) const;

  const std::string& where() const {
    return where_;
  }
  const ProcessGroup& group() const {
    return group_;
  }

  /// Records `item`, the step's next collective, on the step's recurring
  /// plan (Note [A step's planned collectives]); returns the plan and index
  /// for its PlannedCollective ({-1, 0} on a group of one).
  std::pair<int64_t, int64_t> next_collective(const PlanItem& item);

 private:
  // What a rank sends in the step's all_gather, besides its gradients' maxima.
  struct Report {
    std::vector<double> losses; // per micro-batch of this rank's share (0 where one did not run)
    std::vector<double> buffer_hashes; // as the step started
    int64_t changed = -1; // the first of watched_ that the micro-batches changed
    int64_t failed_at = -1; // the micro-batch whose error stopped this rank
  };
  void check_loss(const torch::Tensor& loss, int64_t v) const;
  int64_t first_changed(const std::vector<uint32_t>& versions, const std::vector<double>& buffer_hashes) const;
  void gather(int64_t step, MicroBatchGradients& gradients, size_t count, const Report& report,
              const std::exception_ptr& failure);
  void combine(MicroBatchGradients& gradients, const std::vector<const double*>& reports, size_t count, size_t share);
  void check_same_as_rank0(size_t r, const double* theirs, const double* rank0, size_t buffers_at,
                           size_t step_at) const;
  void check_no_failure(int64_t step, const std::vector<const double*>& reports, size_t at,
                        const std::exception_ptr& failure) const;

  std::vector<std::pair<std::string, torch::Tensor>> buffers_;
  // Buffers other than BatchNorm's statistics (by index into buffers_) and
  // frozen parameters (-1): forward must not change them (Note [The same
  // bits at any world size]).
  struct Watched {
    std::string name;
    torch::Tensor tensor;
    int64_t buffer;
  };
  std::vector<Watched> watched_;
  ProcessGroup group_;
  std::string where_;
  MicroBatchNorms norms_;
  MicroBatchConfig config_;
  torch::Device device_;
  int64_t running_ = -1; // the micro-batch whose loss is being computed, -1 outside one
  RecurringPlan plan_;
};

} // namespace detail
} // namespace lockstep
