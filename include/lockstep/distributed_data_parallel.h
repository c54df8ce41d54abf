#pragma once

// lockstep::DistributedDataParallel: one process per rank, gradients averaged
// over ranks while backward runs. See Note [Reducer state] in src/reducer.cpp
// and docs/design.md.

#include <lockstep/detail/wrapper.h>
#include <lockstep/distributed.h>
#include <lockstep/reducer.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {

/// Options of lockstep::DistributedDataParallel, with fluent setters.
struct DistributedOptions {
  /// Cap of each bucket after the first (1 MiB, or this cap if smaller), in MiB.
  TORCH_ARG(double, bucket_cap_mb) = kDefaultBucketCapMb;
  /// Allow parameters that get no gradient in some iterations; they are
  /// reduced as zeros. Without it such parameters are an error on every rank.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Copy rank 0's buffers (BatchNorm statistics) to every rank before each
  /// forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Make each .grad a view into its bucket: no copy in or out, and no
  /// gradient-sized memory besides the buckets.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// How a bucket is reduced: comm_hooks::allreduce, fp16_compress,
  /// bf16_compress, or your own. Empty (the default): the built-in allreduce,
  /// comm_hooks::allreduce's result with the division fused into the copy of
  /// each gradient into its bucket.
  TORCH_ARG(CommHook, comm_hook) = nullptr;
};

namespace detail {

/// The part of DistributedDataParallel that does not depend on the module's
/// type: checks, broadcasts and the reducer.
class DistributedCore {
 public:
  DistributedCore(torch::nn::Module& module, ProcessGroup group, const DistributedOptions& options);

  /// Buffers from rank 0 if asked, and the reducer told what the next
  /// backward must do.
  void before_forward();

  const ProcessGroup& group() const {
    return group_;
  }
  Reducer& reducer() {
    return *reducer_;
  }
  /// False inside no_sync(): forwards then make their backward skip reduction.
  bool sync() const {
    return sync_;
  }
  void set_sync(bool sync) {
    sync_ = sync;
  }

 private:
  bool sync_ = true;
  ProcessGroup group_;
  bool broadcast_buffers_;
  std::vector<torch::Tensor> buffers_;
  std::unique_ptr<Reducer> reducer_;
};

/// Checks that every rank has the same parameters (count, names, shapes,
/// dtypes, in order); a mismatch throws on every rank, naming the first
/// differing parameter and what rank 0 has.
void verify_same_parameters(const ProcessGroup& group, const std::vector<std::string>& names, const std::vector<torch::Tensor>& params);

/// Copies root's `tensors` into every rank's, one collective per dtype.
void broadcast_coalesced(const ProcessGroup& group, const std::vector<torch::Tensor>& tensors, int root, const std::string& what);

} // namespace detail

/// While alive, forward and backward through the DistributedDataParallel do
/// not communicate: .grad accumulates locally, and the next forward outside
/// the guard reduces the accumulated sum in its backward.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(detail::DistributedCore& core) : core_(&core), previous_(core.sync()) {
    core_->set_sync(false);
  }
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

/// Data parallelism over processes. Made through the holder
/// DistributedDataParallel<M>.
template <typename M>
class DistributedDataParallelImpl : public detail::WrapperModule<M> {
 public:
  using Impl = typename M::ContainedType;

  /// Checks that every rank built the same parameters, copies rank 0's
  /// parameters and buffers to every rank, and installs the gradient hooks.
  DistributedDataParallelImpl(M module, ProcessGroup group, DistributedOptions options = {})
      : detail::WrapperModule<M>(std::move(module), "lockstep::DistributedDataParallel") {
    core_ = std::make_unique<detail::DistributedCore>(*module_, std::move(group), options);
  }

  /// Takes exactly M's forward arguments and returns its type.
  template <typename... Args>
  auto forward(Args&&... args) -> decltype(std::declval<Impl&>().forward(std::forward<Args>(args)...)) {
    core_->before_forward();
    return module_->forward(std::forward<Args>(args)...);
  }

  /// See NoSyncGuard: `{ auto guard = ddp->no_sync(); ... }`.
  NoSyncGuard no_sync() {
    return NoSyncGuard(*core_);
  }

  const ProcessGroup& group() const {
    return core_->group();
  }
  /// Parameter indices (in parameters() order) per bucket, in reduction order.
  std::vector<std::vector<size_t>> buckets() const {
    return core_->reducer().buckets();
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "lockstep::DistributedDataParallel(rank=" << core_->group().rank() << ", world_size=" << core_->group().size()
           << ", backend=" << core_->group().backend() << ")";
  }

 private:
  using detail::WrapperModule<M>::module_;
  std::unique_ptr<detail::DistributedCore> core_;
};

/// `lockstep::DistributedDataParallel<Net> ddp(net, group, DistributedOptions());`
/// A ModuleHolder, like DataParallel; torch::save(ddp, path) writes a bare
/// Net's file.
template <typename M>
using DistributedDataParallel = detail::ForwardingHolder<DistributedDataParallelImpl<M>>;

} // namespace lockstep
