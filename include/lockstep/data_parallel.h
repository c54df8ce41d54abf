#pragma once

// lockstep::DataParallel: one process, many devices, the same training as one
// device.
//
// Note [DataParallel step]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A call dp(args...) goes through five stages:
//  1. plan: every tensor argument to be split is found (scatter_gather.h), the
//     batch sizes are checked to agree, and the rows are cut into one chunk per
//     replica (chunk_sizes).
//  2. sync: replicas were made once, by clone(), at construction; replica 0 is
//     a clone too (Note [Replica 0] in data_parallel.cpp). Before each call,
//     replicas' params are made to alias the wrapped module's storage where
//     they share a device (so optimizer.step() is seen with no copy), or are
//     copied when their version counter says the source changed. Replica 0's
//     buffers alias the module's; the others' follow BufferSync.
//  3. apply: each replica runs forward on its own persistent worker thread,
//     with the caller's grad mode and other thread-local state. Inputs that need
//     a gradient are detached into leaves of the replica's own graph.
//  4. gather: outputs are flattened, concatenated along `dim` (0-dim outputs
//     follow ScalarGather) on the output device, and the structure is rebuilt.
//     The gathered tensors get one autograd node, ParallelBackward, whose next
//     edges are the wrapped module's parameters and the caller's input tensors.
//  5. backward: when the caller's backward reaches ParallelBackward, it splits
//     the incoming gradient, runs every replica's backward on its own worker in
//     parallel (torch::autograd::grad, so replicas never hold .grad), sums the
//     parameter gradients and hands them to the engine, which accumulates them
//     into the wrapped module's .grad exactly as for a bare module. Hooks on
//     those parameters therefore fire once per backward, as without the wrapper.
//
// Why not LibTorch's replicate(): it clones on every call and wires replica
// parameters to the originals with ReduceAdd, which runs every replica's
// backward on the caller's thread. See docs/design.md.

#include <lockstep/detail/worker_pool.h>
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

/// What happens to replicas' buffers (BatchNorm running statistics).
enum class BufferSync {
  /// Before each forward, every replica takes the wrapped module's buffers;
  /// replica 0's buffers share the wrapped module's storage, so its updates
  /// are the ones kept. This is PyTorch's behaviour.
  Broadcast,
  /// As Broadcast, and after each forward in training mode the wrapped module's
  /// floating-point buffers become the average of all replicas' buffers,
  /// weighted by their share of the batch. For BatchNorm's running mean this is
  /// exactly the bare module's value.
  Average,
  /// Replicas keep their own buffers; nothing is copied. Replica 0's are the
  /// wrapped module's.
  Off,
};

/// Options of lockstep::DataParallel, with fluent setters.
struct DataParallelOptions {
  /// Devices, one replica each; replica 0 runs on devices[0], where the
  /// wrapped module must be. The same device may repeat. Empty: every visible
  /// GPU, or without one default_devices() (kDefaultCpuReplicas CPU replicas).
  TORCH_ARG(std::vector<torch::Device>, devices) = {};
  /// Where gathered outputs go. Default: devices[0].
  TORCH_ARG(c10::optional<torch::Device>, output_device) = c10::nullopt;
  /// The dimension inputs are split along and outputs concatenated along.
  TORCH_ARG(int64_t, dim) = 0;
  /// Share of the batch per device, one positive weight each. Empty: even.
  TORCH_ARG(std::vector<double>, weights) = {};
  /// How 0-dim outputs are combined.
  TORCH_ARG(ScalarGather, scalar_outputs) = ScalarGather::Stack;
  /// What happens to buffers.
  TORCH_ARG(BufferSync, buffers) = BufferSync::Broadcast;
  /// Intra-op threads of each CPU replica. 0: the caller's thread count split
  /// evenly between the CPU replicas (at least one each).
  TORCH_ARG(int64_t, intra_op_threads) = 0;
};

/// CPU replicas used when there is no GPU: one, which is the bare module with
/// no overhead. On the 2-core machines we measure on, two CPU replicas ran at
/// 0.81x-0.83x of the bare module using both cores as intra-op threads on an
/// MLP, and 0.99x-1.33x on a CNN (docs/performance.md): a loss as often as a
/// gain, so CPU replicas are opt-in, through devices().
constexpr int64_t kDefaultCpuReplicas = 1;

/// Every visible CUDA device, or kDefaultCpuReplicas CPU devices without one.
std::vector<torch::Device> default_devices();

namespace detail {

/// Fills in default devices, gives bare CUDA devices an index, and checks
/// every option, before anything is cloned.
DataParallelOptions resolve_options(DataParallelOptions options);

/// Throws, naming the first parameter or buffer of `module` not on `first`.
void check_module_on(const torch::nn::Module& module, torch::Device first);

/// What a call's chunking decided: rows and replicas that run.
struct Plan {
  int64_t batch = 0;
  std::vector<size_t> used; // replicas with at least one row, ascending
  std::vector<int64_t> sizes; // per replica, 0 for unused ones
  std::vector<int64_t> offsets; // per replica
};

/// Per-call record of the inputs that need a gradient.
struct StepInputs {
  std::vector<std::vector<torch::Tensor>> leaves; // per replica
  std::vector<InputSource> sources;
};

/// Everything of DataParallel that does not depend on the module's type:
/// replica bookkeeping, worker threads, gathering and the backward node.
class DataParallelCore {
 public:
  /// `source` is the wrapped module; `replicas` its clones, one per device of
  /// `options.devices()`, or just `source` when it runs alone (see
  /// Note [Replica 0]); `options` come from resolve_options().
  DataParallelCore(
      std::shared_ptr<torch::nn::Module> source,
      std::vector<std::shared_ptr<torch::nn::Module>> replicas,
      DataParallelOptions options);

  /// Whether forward runs the wrapped module itself: one device, outputs on it.
  static bool runs_alone(const DataParallelOptions& options) {
    return options.devices().size() == 1 && options.output_device().value_or(options.devices()[0]) == options.devices()[0];
  }

  const DataParallelOptions& options() const {
    return options_;
  }
  size_t size() const {
    return replicas_.size();
  }
  torch::Device output_device() const;

  /// Stage 1. `names` re-walks the arguments with paths, for errors only.
  Plan plan(const SplitSites& sites, const std::function<SplitSites()>& names) const;

  /// Stage 2: device checks, params and buffers onto the replicas that run.
  void prepare_forward(const Plan& plan);

  /// Stage 3: fn(replica, scatter) on each running replica's worker. Throws a
  /// c10::Error naming the replica and device if any of them threw.
  void apply(const Plan& plan, StepInputs& inputs, const std::function<void(size_t, ReplicaScatter&)>& fn);

  /// Stage 4: gathers one flat tensor list per running replica into one list,
  /// and attaches ParallelBackward. Also averages buffers (BufferSync::Average).
  std::vector<torch::Tensor> gather(
      const Plan& plan,
      std::vector<std::vector<torch::Tensor>>& flat,
      StepInputs&& inputs);

  /// fn(replica) on every replica's worker, or on the caller with one replica.
  void run_on_all(const std::function<void(size_t)>& fn);

  /// Mirrors train()/eval() and dtype changes of the wrapped module.
  void train(bool on);
  void to_dtype(torch::Dtype dtype, bool non_blocking);

 private:
  void check_on_first_device() const;
  void sync_params(size_t replica);
  void sync_buffers(size_t replica);
  void alias_replica0_buffers();
  void average_buffers(const Plan& plan);

  std::shared_ptr<torch::nn::Module> source_; // the wrapped module
  std::vector<std::shared_ptr<torch::nn::Module>> replicas_;
  DataParallelOptions options_;
  std::vector<std::string> param_names_;
  std::vector<std::string> buffer_names_;
  std::vector<torch::Tensor> source_params_;
  std::vector<torch::Tensor> source_buffers_;
  std::vector<std::vector<torch::Tensor>> params_; // [replica][param]
  std::vector<std::vector<torch::Tensor>> buffers_; // [replica][buffer]
  std::vector<std::vector<int64_t>> synced_versions_; // [replica][param], copied params only
  std::shared_ptr<WorkerPool> pool_; // shared with pending backward nodes
};

} // namespace detail

/// Runs a module on several devices at once: one process, one replica per
/// device, each on its own thread. Made through the holder DataParallel<M>.
/// See Note [DataParallel step].
template <typename M>
class DataParallelImpl : public detail::WrapperModule<M> {
 public:
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
      for (const auto& device : options.devices()) { // replica 0 too: Note [Replica 0]
        auto replica = std::dynamic_pointer_cast<Impl>(module_->clone(device));
        TORCH_INTERNAL_ASSERT(replica, "clone() returned another module type");
        replicas_.push_back(replica);
      }
    }
    all.assign(replicas_.begin(), replicas_.end());
    core_ = std::make_unique<detail::DataParallelCore>(module_.ptr(), std::move(all), std::move(options));
  }

  /// Takes exactly the arguments of M's forward (plus lockstep::broadcast and
  /// lockstep::split markers in place of tensors) and returns its type.
  template <typename... Args>
  auto forward(Args&&... args) -> decltype(std::declval<Impl&>().forward(std::declval<detail::scatter_t<Args>>()...)) {
    using Output = decltype(std::declval<Impl&>().forward(std::declval<detail::scatter_t<Args>>()...));
    const auto& options = core_->options();
    if (detail::DataParallelCore::runs_alone(options)) {
      // One device: the module itself, with inputs moved there, and no threads.
      detail::ReplicaScatter identity;
      identity.device = options.devices()[0];
      identity.identity = true;
      return module_->forward(detail::Scatter<std::decay_t<Args>>::apply(args, identity)...);
    }
    auto sites = detail::find_split_sites(options.dim(), /*naming=*/false, args...);
    auto plan = core_->plan(sites, [&] { return detail::find_split_sites(options.dim(), /*naming=*/true, args...); });
    core_->prepare_forward(plan);

    std::vector<c10::optional<Output>> outputs(core_->size());
    detail::StepInputs inputs;
    core_->apply(plan, inputs, [&](size_t r, detail::ReplicaScatter& scatter) {
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
      const Output& out = *outputs[plan.used[i]];
      detail::Gather<Output>::collect(out, flat[i]);
      ordered.push_back(&out);
    }
    auto gathered = core_->gather(plan, flat, std::move(inputs));
    size_t next = 0;
    Output result = detail::Gather<Output>::rebuild(ordered, gathered, next);
    TORCH_INTERNAL_ASSERT(next == gathered.size());
    return result;
  }

  /// All replicas, in device order. Each is a clone sharing the wrapped
  /// module's parameters and buffers, except that a DataParallel on one device
  /// runs the wrapped module itself (Note [Replica 0] in data_parallel.cpp).
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
      core_->run_on_all([&](size_t r) { f(*replicas_[r]); });
    } else {
      std::vector<c10::optional<R>> slots(replicas_.size());
      core_->run_on_all([&](size_t r) { slots[r].emplace(f(*replicas_[r])); });
      std::vector<R> results;
      results.reserve(slots.size());
      for (auto& s : slots) {
        results.push_back(std::move(*s));
      }
      return results;
    }
  }

  void train(bool on = true) override {
    torch::nn::Module::train(on);
    core_->train(on);
  }

  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    torch::nn::Module::to(device, dtype, non_blocking);
    core_->to_dtype(dtype, non_blocking);
  }
  void to(torch::Dtype dtype, bool non_blocking = false) override {
    torch::nn::Module::to(dtype, non_blocking);
    core_->to_dtype(dtype, non_blocking);
  }
  /// Moves the wrapped module only: replicas stay on their devices, and a
  /// wrapped module no longer on devices[0] is reported at the next call.
  void to(torch::Device device, bool non_blocking = false) override {
    torch::nn::Module::to(device, non_blocking);
  }

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
  std::unique_ptr<detail::DataParallelCore> core_;
};

/// `lockstep::DataParallel<Net> dp(net, DataParallelOptions().devices({...}));`
/// A ModuleHolder: dp(args...), dp->forward(args...), dp->parameters(),
/// torch::save(dp, path) all work as for Net; dp->module() is net.
template <typename M>
using DataParallel = detail::ForwardingHolder<DataParallelImpl<M>>;

} // namespace lockstep
