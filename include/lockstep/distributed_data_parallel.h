#pragma once

/// \file
/// DistributedDataParallel: one process per rank, gradients averaged
/// over ranks while backward runs. See Note [Reducer state] in src/ddp/reducer_state.h
/// and docs/design.md.

#include <lockstep/detail/distributed_core.h>
#include <lockstep/detail/wrapper.h>
#include <lockstep/distributed_options.h>
#include <lockstep/process_group.h>
#include <lockstep/timeline.h>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {

template <typename M>
class DistributedDataParallelImpl;

/// While alive, forward and backward through the DistributedDataParallel do
/// not communicate: .grad accumulates locally, and the next forward outside
/// the guard reduces the accumulated sum in its backward. A forward in grad
/// mode outside the guard whose backward never ran (an evaluation without
/// torch::NoGradGuard) is still waiting for it, and the next backward
/// reduces, inside the guard or not, as in PyTorch: evaluate under
/// torch::NoGradGuard.
class NoSyncGuard {
 public:
  /// Takes over `other`'s guard; `other` then restores nothing when it ends.
  NoSyncGuard(NoSyncGuard&& other) noexcept : core_(other.core_), previous_(other.previous_) {
    other.core_ = nullptr;
  }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard() {
    if (core_ != nullptr) {
      core_->set_sync(previous_);
    }
  }

 private:
  template <typename M>
  friend class DistributedDataParallelImpl;
  // Made by DistributedDataParallelImpl::no_sync().
  explicit NoSyncGuard(detail::DistributedCore& core) : core_(&core), previous_(core.sync()) {
    core_->set_sync(false);
  }

  detail::DistributedCore* core_;
  bool previous_;
};

/// Uneven inputs: made by DistributedDataParallelImpl::join().
///
/// ```
/// auto join = ddp->join();   // ranks may now run out of batches at different times
/// for (auto& batch : my_batches) { /* forward, backward, step */ }
/// join.finish();             // shadows the others' collectives until every rank is done
/// ```
///
/// While joined, every forward costs one small extra collective. In grad
/// mode, each forward must be followed by its backward, as without join.
/// When finish() returns, every rank holds bitwise the same parameters and
/// buffers (unless broadcast_buffers(false)): those of the rank that trained
/// last. Optimizer state stays each
/// rank's own: a rank that ran out early skipped steps, so its momentum or
/// Adam moments differ; to train on after finish(), make the optimizer anew
/// (or copy its state from the rank that trained last). Destroying the guard
/// without finish() (an exception unwinding) only leaves join mode; it never
/// communicates. See Note [Join] in src/ddp/join.cpp.
class JoinGuard {
 public:
  /// Takes over `other`'s guard; `other` then neither finishes nor leaves
  /// join mode.
  JoinGuard(JoinGuard&& other) noexcept : core_(other.core_) {
    other.core_ = nullptr;
  }
  JoinGuard(const JoinGuard&) = delete;
  JoinGuard& operator=(const JoinGuard&) = delete;
  JoinGuard& operator=(JoinGuard&&) = delete;
  ~JoinGuard() {
    if (core_ != nullptr) {
      core_->end_join();
    }
  }

  /// Takes part in the other ranks' collectives, as zeros, until every rank
  /// has called finish(); then copies the last rank to train's parameters
  /// and buffers (unless broadcast_buffers(false)) to every rank. Under throw_on_early_termination, throws on
  /// every rank if some still had inputs.
  void finish() {
    TORCH_CHECK(core_ != nullptr, "lockstep::JoinGuard::finish: this guard has already finished (or was moved from).");
    core_->finish_join();
    core_ = nullptr;
  }

 private:
  template <typename M>
  friend class DistributedDataParallelImpl;
  // Made by DistributedDataParallelImpl::join(): joins with `options`.
  JoinGuard(detail::DistributedCore& core, const JoinOptions& options) : core_(&core) {
    core_->begin_join(options.divide_by_initial_world_size(), options.throw_on_early_termination());
  }

  detail::DistributedCore* core_;
};

/// Data parallelism over processes. Made through the holder
/// DistributedDataParallel<M>.
///
/// The wrapped module is its child "module", so parameters(), zero_grad(),
/// train() and to() reach it, and `module()` returns it. save() writes it as
/// if it were bare: its file loads into a bare M. Load a file into the
/// module before wrapping it (the wrapper copies rank 0's parameters to
/// every rank), or after wrapping with lockstep::load_safetensors on every
/// rank: torch::load into the wrapper replaces the parameters that the
/// gradient hooks are on, and the next forward refuses it.
template <typename M>
class DistributedDataParallelImpl : public detail::WrapperModule<M> {
 public:
  /// The wrapped module's class, M::ContainedType: `NetImpl` for M = `Net`.
  using Impl = typename M::ContainedType;

  /// Checks that every rank built the same parameters, copies rank 0's
  /// parameters and buffers (unless broadcast_buffers(false)) to every rank,
  /// and installs the gradient hooks.
  DistributedDataParallelImpl(M module, ProcessGroup group, DistributedOptions options = {})
      : detail::WrapperModule<M>(std::move(module), "lockstep::DistributedDataParallel") {
    core_ = std::make_unique<detail::DistributedCore>(*module_, std::move(group), options);
  }

  /// Takes exactly M's forward arguments and returns its type.
  template <typename... Args>
  auto forward(Args&&... args) -> decltype(std::declval<Impl&>().forward(std::forward<Args>(args)...)) {
    timeline::Span span("forward");
    core_->before_forward(detail::leading_batch_size(args...));
    return module_->forward(std::forward<Args>(args)...);
  }

  /// Deterministic mode (DistributedOptions().deterministic(true)): one
  /// step's gradients, the same to the bit at every world size W that divides
  /// micro_batches() V. Calls `loss_of(v)` for this rank's micro-batches of
  /// the step, v = rank*V/W .. (rank+1)*V/W - 1, each with the default
  /// generator seeded from (seed, step, v), and runs backward on each loss
  /// alone. `loss_of` runs forward through this wrapper on micro-batch v of
  /// the step (the same samples at every W) and returns its mean loss. Every
  /// .grad is then the mean over all V micro-batches, summed exactly across
  /// ranks (a parameter no micro-batch used gets none, so the optimizer
  /// skips it); returns the mean of the V losses, the same on every rank.
  /// Forward may change BatchNorm's running statistics, kept exact, and no
  /// other buffer or frozen parameter. An error in any rank's micro-batch is
  /// an error on every rank.
  ///
  /// ```
  /// for (int64_t step = 0; step < steps; ++step) {
  ///   ddp->backward_micro_batches(step, [&](int64_t v) {
  ///     auto [x, y] = micro_batch(step, v);         // samples v*m .. v*m+m-1 of the step
  ///     return torch::nll_loss(ddp->forward(x), y);  // the micro-batch's mean
  ///   });
  ///   optimizer.step();
  /// }
  /// ```
  double backward_micro_batches(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of) {
    timeline::Span span("backward_micro_batches");
    return core_->backward_micro_batches(step, loss_of);
  }

  /// See NoSyncGuard: `{ auto guard = ddp->no_sync(); ... }`.
  NoSyncGuard no_sync() {
    return NoSyncGuard(*core_);
  }

  /// See JoinGuard: `auto join = ddp->join(); ...; join.finish();`.
  JoinGuard join(JoinOptions options = {}) {
    return JoinGuard(*core_, options);
  }

  /// The group the gradients are averaged over.
  const ProcessGroup& group() const {
    return core_->group();
  }
  /// Whether save_safetensors writes this model's files here: on rank 0
  /// only, as the replicas are the same on every rank.
  bool writes_files() const override {
    return core_->group().rank() == 0;
  }
  /// Indices into the reduced parameters (parameters() that require a
  /// gradient, a shared one once, at its first name) per bucket, in reduction
  /// order; after the first reducing backward, rebuilt in the order its
  /// gradients became ready (DistributedOptions::rebuild_buckets).
  std::vector<std::vector<size_t>> buckets() const {
    return core_->buckets();
  }

  /// Prints `lockstep::DistributedDataParallel(rank=0, world_size=2, backend=gloo)`.
  void pretty_print(std::ostream& stream) const override {
    stream << "lockstep::DistributedDataParallel(rank=" << core_->group().rank() << ", world_size=" << core_->group().size()
           << ", backend=" << core_->group().backend() << ")";
  }

 private:
  using detail::WrapperModule<M>::module_;
  std::unique_ptr<detail::DistributedCore> core_;
};

/// The module holder of DistributedDataParallelImpl, made as
/// `lockstep::DistributedDataParallel<Net> ddp(net, group, DistributedOptions())`.
/// Used as DataParallel is; torch::save(ddp, path) writes a bare Net's file.
template <typename M>
using DistributedDataParallel = detail::ForwardingHolder<DistributedDataParallelImpl<M>>;

} // namespace lockstep
