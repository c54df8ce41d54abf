#pragma once

/// \file
/// DistributedDataParallel: one process per rank, gradients averaged
/// over ranks while backward runs. See Note [Reducer state] in src/ddp/reducer_state.h
/// and docs/design.md.

#include <lockstep/comm_hooks.h>
#include <lockstep/detail/distributed_core.h>
#include <lockstep/detail/wrapper.h>
#include <lockstep/process_group.h>
#include <lockstep/timeline.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {

/// Cap of the first bucket: small, so that its allreduce starts early in backward.
constexpr int64_t kFirstBucketBytes = 1024 * 1024;
/// Cap of the other buckets: PyTorch's default bucket_cap_mb, 25 MiB.
constexpr int64_t kDefaultBucketBytes = 25 * 1024 * 1024;

/// Options of lockstep::DistributedDataParallel, with fluent setters.
struct DistributedOptions {
  /// Cap of each bucket after the first, in bytes.
  TORCH_ARG(int64_t, bucket_bytes) = kDefaultBucketBytes;
  /// Cap of the first bucket, in bytes. A smaller bucket_bytes caps it too.
  TORCH_ARG(int64_t, first_bucket_bytes) = kFirstBucketBytes;
  /// Allow parameters that get no gradient in some iterations; they are
  /// reduced as zeros. Without it such parameters are an error on every rank.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Copy rank 0's buffers (BatchNorm statistics) to every rank at wrapping
  /// and before each forward (at join's end, the last trainer's); false
  /// leaves each rank's buffers its own, as PyTorch's.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Make each .grad a view into its bucket: no copy in or out, and no
  /// gradient-sized memory besides the buckets.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// How a bucket is reduced: comm_hooks::allreduce, fp16_compress,
  /// bf16_compress, or your own. Empty (the default): the built-in allreduce,
  /// comm_hooks::allreduce's result with the division by the world size
  /// fused into the copy of each gradient into its bucket.
  TORCH_ARG(CommHook, comm_hook) = nullptr;
  /// Promise that every iteration gives gradients to the same parameters:
  /// the first reducing backward records which ones get none, and later
  /// ones skip the search for them and plain mode's check collective. A
  /// broken promise is an error on every rank naming the parameter (Note
  /// [Static graph] in src/ddp/reducer_state.h).
  TORCH_ARG(bool, static_graph) = false;
  /// After the first reducing backward, rebuild the buckets in the order its
  /// gradients became ready, as c10d does; false keeps reverse registration
  /// order (Note [Rebuilding buckets] in src/ddp/reducer_state.h).
  TORCH_ARG(bool, rebuild_buckets) = true;

 public: // TORCH_ARG leaves the rest private
  /// bucket_bytes in MiB, as PyTorch's bucket_cap_mb; at least one byte.
  DistributedOptions& bucket_cap_mb(double mib) {
    TORCH_CHECK(mib > 0, "lockstep::DistributedOptions: bucket_cap_mb must be > 0, but got ", mib, ".");
    bucket_bytes_ = std::max<int64_t>(1, static_cast<int64_t>(mib * 1024 * 1024));
    return *this;
  }
};

/// While alive, forward and backward through the DistributedDataParallel do
/// not communicate: .grad accumulates locally, and the next forward outside
/// the guard reduces the accumulated sum in its backward.
class NoSyncGuard {
 public:
  /// Made by DistributedDataParallelImpl::no_sync().
  explicit NoSyncGuard(detail::DistributedCore& core) : core_(&core), previous_(core.sync()) {
    core_->set_sync(false);
  }
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
  detail::DistributedCore* core_;
  bool previous_;
};

/// Options of DistributedDataParallelImpl::join, as PyTorch's Join.
struct JoinOptions {
  /// Divide the summed gradients by the world size even when some ranks have
  /// joined and contribute zeros (PyTorch's default); false: by the number of
  /// ranks still training. Needs the built-in allreduce: a comm hook chooses
  /// its own divisor.
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
  /// Make every rank throw as soon as any rank runs out of inputs, instead
  /// of shadowing it.
  TORCH_ARG(bool, throw_on_early_termination) = false;
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
  /// Made by DistributedDataParallelImpl::join(): joins with `options`.
  JoinGuard(detail::DistributedCore& core, const JoinOptions& options) : core_(&core) {
    core_->begin_join(options.divide_by_initial_world_size(), options.throw_on_early_termination());
  }
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
  detail::DistributedCore* core_;
};

/// Data parallelism over processes. Made through the holder
/// DistributedDataParallel<M>.
///
/// The wrapped module is its child "module", so parameters(), zero_grad(),
/// train() and to() reach it, and `module()` returns it. save() and load()
/// write and read it as if it were bare: a file of a DistributedDataParallel
/// loads into a bare M, and a bare M's file loads into one.
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
    core_->before_forward();
    return module_->forward(std::forward<Args>(args)...);
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
