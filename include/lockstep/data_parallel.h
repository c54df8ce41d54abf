#pragma once

/// \file
/// DataParallel: one process, many devices, the same training as one
/// device.

// Note [DataParallel step]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A call dp(args...) goes through five stages, each a method of
// detail::DataParallelCore, called in order by DataParallelImpl::forward:
//  1. plan (src/dp/data_parallel.cpp): every tensor argument to be split is found
//     (detail/scatter_gather.h), the batch sizes are checked to agree, and the
//     rows are cut into one chunk per replica (chunk_sizes).
//  2. prepare_forward: replicas were made once, by clone(), at construction;
//     replica 0 is a clone too (Note [Replica 0] in src/dp/data_parallel.cpp).
//     Before each call, replicas' params are made to alias the wrapped
//     module's storage where they share a device (so optimizer.step() is seen
//     with no copy), or are copied when their version counter says the source
//     changed. Replica 0's buffers alias the module's; the others' follow
//     BufferSync.
//  3. apply: each replica runs forward on its own persistent worker thread
//     (src/dp/worker_pool.h), with the caller's grad mode and other thread-local
//     state. Replica parameters and inputs that need a gradient are non-leaf
//     tensors whose edges lead to the module's parameters and the caller's
//     inputs (Note [Replica parameters] in src/dp/data_parallel.cpp).
//  4. gather: outputs are flattened, concatenated along `dim` (0-dim outputs
//     follow ScalarGather) on the output device; average_buffers follows.
//  5. attach_backward: the gathered tensors get one autograd node,
//     ParallelBackward (src/dp/parallel_backward.cpp), whose next edges are the
//     wrapped module's parameters and the caller's input tensors; then the
//     output structure is rebuilt around them. When the caller's backward reaches the
//     node, it splits the incoming gradient, runs every replica's backward on
//     its own worker in parallel (torch::autograd::grad, so replicas never
//     hold .grad), sums the parameter gradients and hands them to the engine,
//     which accumulates them into the wrapped module's .grad exactly as for a
//     bare module. Hooks on those parameters therefore fire once per backward,
//     as without the wrapper.
//
// Why not LibTorch's replicate(): it clones on every call and wires replica
// parameters to the originals with ReduceAdd, which runs every replica's
// backward on the caller's thread. See docs/design.md.

#include <lockstep/data_parallel_options.h>
#include <lockstep/detail/data_parallel_core.h>
#include <lockstep/detail/wrapper.h>
#include <lockstep/scatter_gather.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <c10/util/Optional.h>

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

/// Runs a module on several devices at once: one process, one replica per
/// device, each on its own thread. Made through the holder DataParallel<M>.
/// See Note [DataParallel step] in data_parallel.h. While one with CPU
/// replicas exists, their large allocations come from a cache, as on a GPU,
/// and it gives its memory back when the last one ends (Note [CPU replicas'
/// memory] in src/util/cpu_cache.cpp).
///
/// The wrapped module is its child "module", so parameters(), zero_grad(),
/// train() and to() reach it, and `module()` returns it. save() and load()
/// write and read it as if it were bare: a file of a DataParallel loads into
/// a bare M, and a bare M's file loads into a DataParallel.
template <typename M>
class DataParallelImpl : public detail::WrapperModule<M> {
 public:
  /// The wrapped module's class, M::ContainedType: `NetImpl` for M = `Net`.
  using Impl = typename M::ContainedType;
  static_assert(
      std::is_base_of<torch::nn::Cloneable<Impl>, Impl>::value,
      "lockstep::DataParallel needs a module whose Impl derives from "
      "torch::nn::Cloneable<Impl> (as TORCH_MODULE modules and torch::nn::Sequential do), "
      "because replicas are made with clone().");

  /// Wraps `module`, which must be on devices[0], and makes the replicas.
  explicit DataParallelImpl(M module, DataParallelOptions options = {})
      : detail::WrapperModule<M>(std::move(module), "lockstep::DataParallel") {
    options = detail::resolve_options(std::move(options));
    detail::check_module_on(*module_, options.devices()[0]); // before clone() trips over it
    std::vector<std::shared_ptr<torch::nn::Module>> all;
    if (detail::DataParallelCore::runs_alone(options)) {
      replicas_.push_back(module_.ptr());
    } else {
      detail::check_replicable(*module_, options.devices().size());
      for (const auto& device : options.devices()) { // replica 0 too: Note [Replica 0]
        auto replica = std::dynamic_pointer_cast<Impl>(module_->clone(device));
        TORCH_INTERNAL_ASSERT(replica, "clone() returned another module type");
        replicas_.push_back(replica);
      }
    }
    all.assign(replicas_.begin(), replicas_.end());
    if (options.deterministic()) {
      determinism_ = std::make_unique<detail::DataParallelDeterminism>(*module_, options);
    }
    core_ = std::make_unique<detail::DataParallelCore>(module_.ptr(), std::move(all), std::move(options));
  }

  /// Takes exactly the arguments of M's forward (plus lockstep::broadcast and
  /// lockstep::split markers in place of tensors) and returns its type.
  template <typename... Args>
  auto forward(Args&&... args) -> decltype(std::declval<Impl&>().forward(std::declval<detail::scatter_t<Args>>()...)) {
    using Output = decltype(std::declval<Impl&>().forward(std::declval<detail::scatter_t<Args>>()...));
    const auto& options = core_->options();
    if (detail::DataParallelCore::runs_alone(options) ||
        (determinism_ && determinism_->forward_alone(detail::leading_batch_size(args...)))) {
      // One device: the module itself, with inputs moved there, and no threads.
      detail::ReplicaScatter identity;
      identity.device = options.devices()[0];
      identity.identity = true;
      return module_->forward(detail::Scatter<std::decay_t<Args>>::apply(args, identity)...);
    }
    detail::DataParallelCore::ForwardGuard running(core_->forward_running());
    // Note [DataParallel step], one line per stage.
    const detail::Plan plan = core_->plan(detail::find_split_sites(options.dim(), args...));
    core_->prepare_forward(plan);
    std::vector<c10::optional<Output>> outputs(core_->size());
    detail::StepInputs inputs = core_->apply(plan, [&](size_t r, detail::ReplicaScatter& scatter) {
      // Braced initialisation: arguments are scattered left to right.
      std::tuple<detail::scatter_t<Args>...> replica_args{detail::Scatter<std::decay_t<Args>>::apply(args, scatter)...};
      Impl& replica = *replicas_[r];
      outputs[r].emplace(std::apply(
          [&replica](auto&&... a) { return replica.forward(std::forward<decltype(a)>(a)...); },
          std::move(replica_args)));
    });
    std::vector<std::vector<torch::Tensor>> flat(plan.used.size());
    std::vector<const Output*> ordered;
    for (size_t i = 0; i < plan.used.size(); ++i) {
      ordered.push_back(&*outputs[plan.used[i]]);
      detail::Gather<Output>::collect(*ordered.back(), flat[i]);
    }
    detail::Gathered gathered = core_->gather(plan, flat);
    core_->average_buffers(plan);
    core_->attach_backward(plan, flat, gathered, std::move(inputs));

    size_t next = 0;
    Output result = detail::Gather<Output>::rebuild(ordered, gathered.tensors, next);
    TORCH_INTERNAL_ASSERT(next == gathered.tensors.size());
    return result;
  }

  /// Deterministic mode (DataParallelOptions().deterministic(true)): one
  /// step's backward, as DistributedDataParallelImpl::backward_micro_batches
  /// with one rank: calls `loss_of(v)` for each of the V micro-batches of
  /// `step` in order, each a forward through this wrapper and its backward
  /// alone; then the parameters' .grad are the mean over them, summed
  /// exactly, the bits DistributedDataParallel gives at any world size (a
  /// parameter no micro-batch used gets none, and one frozen at wrapping
  /// may train later). Returns the mean of the V losses.
  double backward_micro_batches(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of) {
    TORCH_CHECK(determinism_ != nullptr, "lockstep::DataParallel: backward_micro_batches needs "
                "DataParallelOptions().deterministic(true).micro_batches(V); this wrapper reduces in backward.");
    return determinism_->backward_micro_batches(step, loss_of);
  }

  /// All replicas, in device order. Each is a clone sharing the wrapped
  /// module's parameters and buffers, except that a DataParallel on one device
  /// runs the wrapped module itself (Note [Replica 0] in src/dp/data_parallel.cpp).
  std::vector<M> replicas() const {
    return std::vector<M>(replicas_.begin(), replicas_.end());
  }

  /// The devices, one per replica.
  const std::vector<torch::Device>& devices() const {
    return core_->options().devices();
  }

  /// Runs f(Impl&) on every replica, each on its own worker thread, and
  /// returns the results in replica order (nothing when f returns void). For
  /// reading or resetting state that forward keeps on the replicas.
  template <typename F>
  auto map_replicas(F&& f) -> std::conditional_t<
      std::is_void<std::invoke_result_t<F&, Impl&>>::value,
      void,
      std::vector<std::invoke_result_t<F&, Impl&>>> {
    using R = std::invoke_result_t<F&, Impl&>;
    if constexpr (std::is_void<R>::value) {
      core_->map_replicas([&](size_t r) { f(*replicas_[r]); });
    } else {
      std::vector<c10::optional<R>> slots(replicas_.size());
      core_->map_replicas([&](size_t r) { slots[r].emplace(f(*replicas_[r])); });
      std::vector<R> results;
      results.reserve(slots.size());
      for (auto& s : slots) {
        results.push_back(std::move(*s));
      }
      return results;
    }
  }

  /// Sets training mode (`on`) or eval mode on the wrapped module and every
  /// replica.
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    core_->train(on);
  }

  /// Moves the wrapped module to `device` and converts it to `dtype`; the
  /// replicas are converted to `dtype` on their own devices. A wrapped module
  /// no longer on devices[0] is reported at the next call.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    torch::nn::Module::to(device, dtype, non_blocking);
    core_->to_dtype(dtype, non_blocking);
  }
  /// Converts the wrapped module and every replica to `dtype`.
  void to(torch::Dtype dtype, bool non_blocking = false) override {
    torch::nn::Module::to(dtype, non_blocking);
    core_->to_dtype(dtype, non_blocking);
  }
  /// Moves the wrapped module only: replicas stay on their devices, and a
  /// wrapped module no longer on devices[0] is reported at the next call.
  void to(torch::Device device, bool non_blocking = false) override {
    torch::nn::Module::to(device, non_blocking);
  }

  /// Prints `lockstep::DataParallel(devices=[cuda:0, cuda:1])`.
  void pretty_print(std::ostream& stream) const override {
    stream << "lockstep::DataParallel(devices=[";
    const auto& devices = core_->options().devices();
    for (size_t i = 0; i < devices.size(); ++i) {
      stream << (i ? ", " : "") << devices[i];
    }
    stream << "])";
  }

 private:
  using detail::WrapperModule<M>::module_;
  std::vector<std::shared_ptr<Impl>> replicas_;
  std::unique_ptr<detail::DataParallelDeterminism> determinism_; // null unless deterministic
  std::unique_ptr<detail::DataParallelCore> core_;
};

/// The module holder of DataParallelImpl, made as
/// `lockstep::DataParallel<Net> dp(net, DataParallelOptions().devices({...}))`.
/// dp(args...), dp->forward(args...), dp->parameters(), torch::save(dp, path)
/// all work as for Net; dp->module() is net.
template <typename M>
using DataParallel = detail::ForwardingHolder<DataParallelImpl<M>>;

} // namespace lockstep
