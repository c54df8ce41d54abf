#pragma once

/// \file
/// PowerSGD (Vogels et al., NeurIPS 2019), as PyTorch's powerSGD_hook: a
/// DistributedDataParallel communication hook that sends, for each
/// matrix-shaped gradient M (n x m), two thin factors P (n x r) and Q (m x r)
/// with M ~ P Q^T, instead of M itself. On slow links that is the difference
/// between communication and compute setting the step time.
///
/// ```
/// lockstep::PowerSGD powersgd = lockstep::comm_hooks::powersgd(
///     lockstep::PowerSGDOptions().rank(4).start_iteration(10));
/// lockstep::DistributedDataParallel<Net> ddp(net, group,
///     lockstep::DistributedOptions().comm_hook(powersgd));
/// ...
/// powersgd.save(archive);   // with the checkpoint: error feedback and warm start resume exactly
/// ```
///
/// Note [PowerSGD] in src/ddp/powersgd.cpp follows one bucket through a step.

#include <lockstep/comm_hooks.h>

#include <torch/arg.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>

namespace lockstep {

/// Options of comm_hooks::powersgd, with PyTorch's PowerSGDState's meaning.
struct PowerSGDOptions {
  /// Rank r of each matrix's approximation (matrix_approximation_rank): the
  /// lower, the fewer bytes and the coarser the gradients. 1 to 4 is usual.
  TORCH_ARG(int64_t, rank) = 1;
  /// Iterations of plain allreduce before compression starts
  /// (start_powerSGD_iter): early training is sensitive to coarse gradients.
  /// Any value from 0 works: the state is kept by parameter, so DDP's
  /// rebuilt buckets find it (PyTorch's, kept by bucket, needs 2).
  TORCH_ARG(int64_t, start_iteration) = 1000;
  /// A matrix is compressed only when its compressed size, (n + m) * r, is
  /// more than this many times smaller than n * m; other gradients, and every
  /// vector, are allreduced whole.
  TORCH_ARG(double, min_compression_rate) = 2.0;
  /// Add to each iteration's gradients what compression lost from this
  /// rank's gradients the iteration before (use_error_feedback). PowerSGD is
  /// biased without it.
  TORCH_ARG(bool, error_feedback) = true;
  /// Start each iteration's power step from the last iteration's Q
  /// (warm_start): better approximations, no random draws.
  TORCH_ARG(bool, warm_start) = true;
  /// Seed of the random Q's drawn when compression starts (and every
  /// iteration without warm_start), each from (seed, iteration, parameter).
  /// Every rank must use the same.
  TORCH_ARG(uint64_t, seed) = 0;
};

namespace detail {
struct PowerSGDState;
} // namespace detail

/// The PowerSGD hook and its state. Pass it as DistributedOptions::comm_hook
/// (it is a CommHook); copies share the state, so keep one to save and load
/// it. One PowerSGD serves one DistributedDataParallel: a second one's
/// buckets are refused while the first lives. A model wrapped once the first
/// is destroyed takes over its iteration count, with the error feedback and
/// warm start's Q's afresh (it may reduce other parameters), unless a state
/// was loaded in between.
class PowerSGD {
 public:
  /// A hook with `options`, and a fresh state; a rank below 1, a negative
  /// start_iteration or a min_compression_rate not above 0 is an error.
  explicit PowerSGD(PowerSGDOptions options = {});

  /// Starts the reduction of one bucket (what DistributedDataParallel calls).
  std::shared_ptr<PendingReduction> operator()(const ProcessGroup& group, GradBucket& bucket) const;

  /// The options it was made with.
  const PowerSGDOptions& options() const;
  /// Reducing iterations seen so far: compression runs once this reaches
  /// options().start_iteration().
  int64_t iteration() const;
  /// Elements of the gradients over elements sent, in the last iteration;
  /// 0 where it was not compressed (before start_iteration). After load(),
  /// the saved state's, until the next iteration.
  double compression_rate() const;

  /// This rank's state: the iteration, the error feedback (this rank's own),
  /// warm start's Q's, and compression_rate(). With them, a resumed run goes on exactly as the
  /// uninterrupted one.
  void save(torch::serialize::OutputArchive& archive) const;
  /// The state save() wrote, saved with the same model. A state saved with
  /// another rank keeps its iteration and error feedback, and draws warm
  /// start's Q's anew at this rank (Note [PowerSGD state of another rank]).
  /// A state of another model is refused at the first compressed bucket,
  /// naming the parameter.
  void load(torch::serialize::InputArchive& archive);
  /// Loads only the iteration and warm start's Q's, with no error feedback
  /// (what a rank that did not save this state can take: resuming at
  /// another world size).
  void load_shared(torch::serialize::InputArchive& archive);

 private:
  std::shared_ptr<detail::PowerSGDState> state_;
};

namespace comm_hooks {
/// PowerSGD compression: see PowerSGD.
PowerSGD powersgd(PowerSGDOptions options = {});
} // namespace comm_hooks

} // namespace lockstep
