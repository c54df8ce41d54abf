#pragma once

/// \file
/// FullyShardedDataParallel: data parallelism whose parameters,
/// gradients and optimizer state are split over the ranks (ZeRO-3, ZeRO-2),
/// or not (DDP's behaviour), as PyTorch's FSDP. See Note [Sharded step] in
/// src/fsdp/forward.cpp and docs/design.md.

#include <lockstep/detail/sharded_core.h>
#include <lockstep/detail/wrapper.h>
#include <lockstep/process_group.h>
#include <lockstep/sharding_options.h>
#include <lockstep/timeline.h>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>

#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

template <typename M>
class FullyShardedDataParallelImpl;

/// One flat parameter of a FullyShardedDataParallel: the trainable
/// parameters of one unit and dtype, in one buffer split over the ranks
/// (FullyShardedDataParallelImpl::flat_params).
struct FlatParamInfo {
  /// Its unit's dotted path; "" for the root unit.
  std::string unit;
  /// The dtype of its parameters (and of the shards).
  torch::ScalarType dtype;
  /// Its element count: every parameter's, unpadded.
  int64_t numel;
  /// This rank's shard's element count.
  int64_t shard_numel;
  /// Its parameters' names, as the wrapped module's named_parameters().
  std::vector<std::string> names;
};

/// While alive, backward keeps each parameter's whole gradient on this rank
/// and communicates nothing; the next backward outside the guard reduces
/// the accumulated sum. As in PyTorch's FSDP, and unlike DDP's no_sync, the
/// guard's state when backward runs decides, not when forward ran: a
/// backward after the guard ended reduces even if its forward ran under it
/// (Note [no_sync at backward]). A zero_grad() of the optimizer (or of the
/// FullyShardedDataParallel) in between drops that sum, as it would a
/// gradient. Made by FullyShardedDataParallelImpl::no_sync().
class ShardedNoSyncGuard {
 public:
  /// Takes over `other`'s guard; `other` then restores nothing when it ends.
  ShardedNoSyncGuard(ShardedNoSyncGuard&& other) noexcept : core_(other.core_), previous_(other.previous_) {
    other.core_ = nullptr;
  }
  ShardedNoSyncGuard(const ShardedNoSyncGuard&) = delete;
  ShardedNoSyncGuard& operator=(const ShardedNoSyncGuard&) = delete;
  ShardedNoSyncGuard& operator=(ShardedNoSyncGuard&&) = delete;
  ~ShardedNoSyncGuard() {
    if (core_ != nullptr) {
      core_->set_sync(previous_);
    }
  }

 private:
  template <typename M>
  friend class FullyShardedDataParallelImpl;
  // Made by FullyShardedDataParallelImpl::no_sync().
  explicit ShardedNoSyncGuard(detail::ShardedCore& core) : core_(&core), previous_(core.sync()) {
    core_->set_sync(false);
  }

  detail::ShardedCore* core_;
  bool previous_;
};

/// While alive, module()'s parameters are the whole, current parameters on
/// every rank. Edits made to them are copied into the shards when the guard
/// ends (writeback, on by default, as PyTorch FSDP's summon_full_params).
/// With writeback(false) the shards are left as they are, and a parameter
/// changed inside the guard is an error when it ends, naming it, under
/// FullShard and ShardGradOp, where the edit would be lost (NoShard's
/// parameters are its shard, so there the edit stays). Every rank makes and
/// ends it together. A guard ended by an exception writes nothing back: the
/// shards keep the values they had before it (Note [A summon ended by an
/// exception]).
class FullParamsGuard {
 public:
  /// Takes over `other`'s guard; `other` then ends nothing.
  FullParamsGuard(FullParamsGuard&& other) noexcept
      : core_(other.core_), writeback_(other.writeback_), exceptions_(other.exceptions_) {
    other.core_ = nullptr;
  }
  FullParamsGuard(const FullParamsGuard&) = delete;
  FullParamsGuard& operator=(const FullParamsGuard&) = delete;
  FullParamsGuard& operator=(FullParamsGuard&&) = delete;
  ~FullParamsGuard() noexcept(false) {
    if (core_ == nullptr) {
      return;
    }
    if (std::uncaught_exceptions() > exceptions_) {
      core_->abandon_summon(); // unwinding: throwing now would end the process
    } else {
      core_->unsummon(writeback_);
    }
  }
  /// Copy edits into the shards when the guard ends (default true).
  FullParamsGuard& writeback(bool writeback) {
    writeback_ = writeback;
    return *this;
  }

 private:
  template <typename M>
  friend class FullyShardedDataParallelImpl;
  // Made by FullyShardedDataParallelImpl::summon_full_params(): gathers the
  // whole parameters.
  explicit FullParamsGuard(detail::ShardedCore& core) : core_(&core), exceptions_(std::uncaught_exceptions()) {
    core_->summon();
  }

  detail::ShardedCore* core_;
  bool writeback_ = true;
  int exceptions_; // std::uncaught_exceptions() when made
};

namespace detail {

// The tensors in what forward returned, hooked so that backward gathers
// the parameters again first. Declared before they are defined, so that
// each finds the others inside any nesting.
inline void collect_tensors(const torch::Tensor& t, std::vector<torch::Tensor>& out);
template <typename T>
void collect_tensors(const std::vector<T>& items, std::vector<torch::Tensor>& out);
template <typename T>
void collect_tensors(const c10::optional<T>& item, std::vector<torch::Tensor>& out);
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& pair, std::vector<torch::Tensor>& out);
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& tuple, std::vector<torch::Tensor>& out);
template <typename T>
void collect_tensors(const T&, std::vector<torch::Tensor>&) {
  // Another class could hold tensors that backward then reaches unseen:
  // its units would be freed, and its gradients never reduced.
  static_assert(std::is_arithmetic_v<T> || std::is_enum_v<T>,
                "lockstep::FullyShardedDataParallel: the wrapped module's forward returns a type whose tensors it "
                "cannot find. Return a torch::Tensor, or a std::vector, std::tuple, std::pair or c10::optional of them.");
}

inline void collect_tensors(const torch::Tensor& t, std::vector<torch::Tensor>& out) {
  out.push_back(t);
}
template <typename T>
void collect_tensors(const std::vector<T>& items, std::vector<torch::Tensor>& out) {
  for (const auto& item : items) {
    collect_tensors(item, out);
  }
}
template <typename T>
void collect_tensors(const c10::optional<T>& item, std::vector<torch::Tensor>& out) {
  if (item.has_value()) {
    collect_tensors(*item, out);
  }
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& pair, std::vector<torch::Tensor>& out) {
  collect_tensors(pair.first, out);
  collect_tensors(pair.second, out);
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& tuple, std::vector<torch::Tensor>& out) {
  std::apply([&](const auto&... t) { (collect_tensors(t, out), ...); }, tuple);
}

// Whether a forward argument of type T holds tensors that cast_argument
// reaches: a tensor, or a std::vector, c10::optional, std::pair or
// std::tuple of such (as FSDP's _apply_to_tensors recurses).
template <typename T>
struct HoldsTensors : std::is_same<T, torch::Tensor> {};
template <typename T>
struct HoldsTensors<std::vector<T>> : HoldsTensors<T> {};
template <typename T>
struct HoldsTensors<c10::optional<T>> : HoldsTensors<T> {};
template <typename A, typename B>
struct HoldsTensors<std::pair<A, B>> : std::bool_constant<HoldsTensors<A>::value || HoldsTensors<B>::value> {};
template <typename... Ts>
struct HoldsTensors<std::tuple<Ts...>> : std::bool_constant<(HoldsTensors<Ts>::value || ...)> {};

// A copy of `value` with each floating-point tensor in param_dtype.
inline torch::Tensor cast_tensors(const ShardedCore& core, const torch::Tensor& value) {
  return core.cast_input(value);
}
template <typename T>
T cast_tensors(const ShardedCore&, const T& value) {
  return value;
}
template <typename T>
std::vector<T> cast_tensors(const ShardedCore& core, const std::vector<T>& values) {
  std::vector<T> cast;
  cast.reserve(values.size());
  for (const auto& value : values) {
    cast.push_back(cast_tensors(core, value));
  }
  return cast;
}
template <typename T>
c10::optional<T> cast_tensors(const ShardedCore& core, const c10::optional<T>& value) {
  return value.has_value() ? c10::optional<T>(cast_tensors(core, *value)) : c10::optional<T>();
}
template <typename A, typename B>
std::pair<A, B> cast_tensors(const ShardedCore& core, const std::pair<A, B>& value) {
  return {cast_tensors(core, value.first), cast_tensors(core, value.second)};
}
template <typename... Ts>
std::tuple<Ts...> cast_tensors(const ShardedCore& core, const std::tuple<Ts...>& value) {
  return std::apply([&](const auto&... items) { return std::tuple<Ts...>(cast_tensors(core, items)...); }, value);
}

// A forward argument as FullyShardedDataParallel passes it on: its tensors,
// at any depth HoldsTensors reaches, in ShardingOptions::param_dtype;
// anything else as it came.
template <typename T>
decltype(auto) cast_argument(const ShardedCore& core, T&& arg) {
  if constexpr (HoldsTensors<std::decay_t<T>>::value) {
    return cast_tensors(core, arg);
  } else {
    return std::forward<T>(arg);
  }
}

// Whether Impl's forward takes `A...` (a forward that takes a tensor by
// non-const reference cannot take a cast copy, and gets its arguments as
// they came).
template <typename Void, typename Impl, typename... A>
struct ForwardTakes : std::false_type {};
template <typename Impl, typename... A>
struct ForwardTakes<std::void_t<decltype(std::declval<Impl&>().forward(std::declval<A>()...))>, Impl, A...>
    : std::true_type {};
template <typename Impl, typename... Args>
constexpr bool kForwardTakesCastArguments =
    ForwardTakes<void, Impl, decltype(cast_argument(std::declval<const ShardedCore&>(), std::declval<Args>()))...>::value;

} // namespace detail

/// Sharded data parallelism over processes. Made through the holder
/// FullyShardedDataParallel<M>.
///
/// parameters() are this rank's shards, one leaf per unit and dtype, so any
/// torch::optim optimizer made from them steps this rank's share only. An
/// optimizer made from module()->parameters() (or the wrapped module's,
/// before wrapping) would step nothing: under FullShard and ShardGradOp,
/// Adam, AdamW, RMSprop and Adagrad there make the next forward an error;
/// SGD, and NoShard, go unseen. Make it from parameters().
/// module() is the wrapped module; outside forward and backward (and
/// summon_full_params) its trainable parameters of FullShard and
/// ShardGradOp are empty tensors, never stale values, and stay so once the
/// wrapper is destroyed: copy them out under summon_full_params() first.
/// Another wrapper over module() is refused while this one lives, and so is
/// a wrapper inside the module to wrap: make its submodule a unit instead
/// (ShardingOptions().units()).
template <typename M>
class FullyShardedDataParallelImpl : public torch::nn::Module, public detail::ShardedWrapperMark {
 public:
  /// The wrapped module's class, M::ContainedType: `NetImpl` for M = `Net`.
  using Impl = typename M::ContainedType;

  /// Wraps `module`: checks that every rank built the same parameters,
  /// copies rank 0's parameters and buffers to every rank, puts each unit's
  /// trainable parameters of one dtype into one flat buffer, and keeps this
  /// rank's shard of it. Every rank of `group` makes it together.
  FullyShardedDataParallelImpl(M module, ProcessGroup group = {}, ShardingOptions options = {})
      : module_(std::move(module)) {
    TORCH_CHECK(!module_.is_empty(), "lockstep::FullyShardedDataParallel: the module to wrap is empty (a null holder).");
    core_ = std::make_unique<detail::ShardedCore>(*this, *module_, std::move(group), options);
  }

  /// Takes exactly M's forward arguments and returns its type.
  template <typename... Args>
  auto forward(Args&&... args) -> decltype(std::declval<Impl&>().forward(std::forward<Args>(args)...)) {
    timeline::Span span("forward");
    core_->before_forward(detail::leading_batch_size(args...));
    auto output = [&]() -> decltype(auto) {
      try {
        if constexpr (detail::kForwardTakesCastArguments<Impl, Args&&...>) {
          return module_->forward(detail::cast_argument(*core_, std::forward<Args>(args))...);
        } else {
          return module_->forward(std::forward<Args>(args)...);
        }
      } catch (...) {
        core_->abort_forward();
        throw;
      }
    }();
    std::vector<torch::Tensor> outputs;
    detail::collect_tensors(output, outputs);
    core_->after_forward(outputs);
    return output;
  }

  /// Deterministic mode (ShardingOptions().deterministic(true)): one step's
  /// backward, as DistributedDataParallelImpl::backward_micro_batches: calls
  /// `loss_of(v)` for this rank's micro-batches of `step` (v from r*V/W to
  /// (r+1)*V/W - 1), each a forward through this wrapper and its backward
  /// alone; then the shards' .grad are this rank's part of the mean over all
  /// V micro-batches, summed exactly in int64, the same bits at every world
  /// size and strategy. Returns the mean of the V losses. Every rank calls
  /// it, with the same `step`.
  double backward_micro_batches(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of) {
    timeline::Span span("backward_micro_batches");
    return core_->backward_micro_batches(step, loss_of);
  }

  /// Refused, unless the model is on `device` in `dtype` already: the
  /// shards, the gathered buffers and the module's buffers and frozen
  /// parameters would part ways. Move or cast the module before wrapping it.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    core_->check_move(device, dtype);
  }
  /// See to(device, dtype).
  void to(torch::Dtype dtype, bool non_blocking = false) override {
    core_->check_move(std::nullopt, dtype);
  }
  /// See to(device, dtype).
  void to(torch::Device device, bool non_blocking = false) override {
    core_->check_move(device, std::nullopt);
  }

  /// The wrapped module (see the class comment for its parameters).
  M module() const {
    return module_;
  }
  /// See FullParamsGuard: `{ auto full = fsdp->summon_full_params(); ... }`.
  FullParamsGuard summon_full_params() {
    return FullParamsGuard(*core_);
  }
  /// See ShardedNoSyncGuard.
  ShardedNoSyncGuard no_sync() {
    return ShardedNoSyncGuard(*core_);
  }
  /// The group the parameters are sharded over.
  const ProcessGroup& group() const {
    return core_->group();
  }
  /// Scales the shards' gradients so that the whole model's gradient has a
  /// norm of at most `max_norm`, as torch::nn::utils::clip_grad_norm_ does
  /// on one process, and returns that norm before clipping (the same on
  /// every rank). Every rank calls it, after backward. Use it instead of
  /// torch::nn::utils::clip_grad_norm_(parameters()), which sees only this
  /// rank's shards and would clip each rank's share by a different factor.
  /// `norm_type` is p of the p-norm; std::numeric_limits<double>::infinity()
  /// for the largest magnitude.
  torch::Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0) {
    return core_->clip_grad_norm_(max_norm, norm_type);
  }
  /// Its core, for lockstep::save_safetensors and load_safetensors.
  detail::ShardedCore& sharded_core() const override {
    return *core_;
  }
  /// See lockstep::save_sharded(model, dir).
  void save_sharded(const std::string& dir) const {
    core_->save_sharded(nullptr, dir);
  }
  /// See lockstep::load_sharded(model, dir).
  void load_sharded(const std::string& dir) {
    core_->load_sharded(nullptr, dir, std::nullopt);
  }
  /// See lockstep::save_sharded.
  int64_t save_sharded(torch::optim::Optimizer& optimizer, const std::string& dir) const {
    return core_->save_sharded(&optimizer, dir);
  }
  /// See lockstep::load_sharded.
  void load_sharded(torch::optim::Optimizer& optimizer, const std::string& dir,
                    std::optional<int64_t> save_id = std::nullopt) {
    core_->load_sharded(&optimizer, dir, save_id);
  }
  /// See lockstep::full_optimizer_state.
  void full_optimizer_state(torch::optim::Optimizer& optimizer, torch::optim::Optimizer& full) const {
    core_->full_optimizer_state(optimizer, full);
  }
  /// See lockstep::shard_full_optimizer_state.
  void shard_full_optimizer_state(torch::optim::Optimizer& full, torch::optim::Optimizer& optimizer) {
    core_->shard_full_optimizer_state(full, optimizer);
  }
  /// Each flat parameter's unit, dtype, element count, shard size and
  /// parameter names.
  std::vector<FlatParamInfo> flat_params() const {
    return core_->flat_params();
  }

  /// Sets training mode (`on`) or eval mode on the wrapper and the wrapped
  /// module.
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_->train(on);
  }

  /// Refused: the wrapper's own parameters are this rank's shards, and a
  /// file of them (no names, no buffers) loads wrong values on another
  /// rank. Save under summon_full_params, or with lockstep::save_sharded.
  void save(torch::serialize::OutputArchive& /*archive*/) const override {
    core_->refuse_serialization("torch::save");
  }
  /// Refused, as save() is.
  void load(torch::serialize::InputArchive& /*archive*/) override {
    core_->refuse_serialization("torch::load");
  }

  /// Prints `lockstep::FullyShardedDataParallel(rank=0, world_size=2, backend=gloo)`.
  void pretty_print(std::ostream& stream) const override {
    stream << "lockstep::FullyShardedDataParallel(rank=" << core_->group().rank()
           << ", world_size=" << core_->group().size() << ", backend=" << core_->group().backend() << ")";
  }

 private:
  M module_;
  std::unique_ptr<detail::ShardedCore> core_;
};

/// The module holder of FullyShardedDataParallelImpl, made as
/// `lockstep::FullyShardedDataParallel<Net> model(net, group, ShardingOptions())`.
template <typename M>
using FullyShardedDataParallel = detail::ForwardingHolder<FullyShardedDataParallelImpl<M>>;

/// Writes the model's weights to the folder `dir` (made if missing) as
/// PyTorch's distributed checkpoint writes them with
/// `HuggingFaceStorageWriter(dir, save_distributed=True)`: each rank writes
/// its own shards, with no communication, as safetensors files whose
/// `DCP_SHARDING_INFO` gives each piece's offsets. Python's
/// `dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(dir))` reads
/// them into a plain module or an FSDP2 one at any world size. Rank 0 writes
/// `lockstep_save.json` last: a save stopped halfway never loads. Earlier
/// shard files in `dir` are removed first. Every rank calls it.
template <typename M>
void save_sharded(const FullyShardedDataParallel<M>& model, const std::string& dir) {
  model->save_sharded(dir);
}

/// Loads a folder that save_sharded(model, dir) wrote, or that PyTorch's
/// `dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(dir,
/// save_distributed=True))` wrote (FSDP2 included), at any world size: each
/// rank reads only the pieces its shards cover. Every parameter and buffer
/// must be in it, of the same shape and dtype, and nothing else but an
/// optimizer's state (`state.NAME.KEY`), which stays unread, as
/// `load_state_dict` lists missing and unexpected names. A folder in
/// lockstep's earlier format loads too. A damaged, incomplete or mixed
/// folder is an error naming the file, and nothing is loaded on any rank.
/// Every rank calls it.
template <typename M>
void load_sharded(FullyShardedDataParallel<M>& model, const std::string& dir) {
  model->load_sharded(dir);
}

/// Writes the model's weights and its optimizer's state to the folder `dir`
/// (made if missing), as save_sharded(model, dir) writes the weights: the
/// state beside them under PyTorch's names, `state.NAME.exp_avg`
/// and so on, each rank its own shards of it, so that Python's `dcp.load`
/// reads it into an optimizer of a plain module or of FSDP2. What is not a
/// tensor, the optimizer's type and its parameter groups' options, goes in
/// `lockstep_save.json` under "optimizer". Adam, AdamW, SGD, RMSprop and
/// Adagrad; another optimizer is refused before anything is written.
/// Every rank calls it. Returns the save's id, the same on every rank,
/// which each of its files carries: a caller that records it beside the
/// folder (a training checkpoint naming its shards) gives it to
/// load_sharded, which then refuses a folder of another save.
template <typename M>
int64_t save_sharded(const FullyShardedDataParallel<M>& model, torch::optim::Optimizer& optimizer,
                     const std::string& dir) {
  return model->save_sharded(optimizer, dir);
}

/// Reads what save_sharded wrote into this rank's shards and optimizer
/// state, at any world size: each rank reads the pieces it now owns. The
/// optimizer must be made from model->parameters(); as torch::load of an
/// optimizer, its parameter groups' options (learning rate, momentum) become
/// the saved ones. A folder that PyTorch wrote loads too: its
/// `state.NAME.KEY` tensors, where it has them, become the
/// optimizer's state, and the caller's options stay. A folder without
/// optimizer state leaves the optimizer without state, as a fresh one. A
/// folder in lockstep's earlier format (index.json and shard-R-of-W.pt)
/// still loads. `save_id`, when given, is the one save_sharded returned:
/// a folder of another save is an error. A damaged or mismatched file is an
/// error naming it, and nothing is loaded on any rank. Every rank calls it.
template <typename M>
void load_sharded(FullyShardedDataParallel<M>& model, torch::optim::Optimizer& optimizer, const std::string& dir,
                  std::optional<int64_t> save_id = std::nullopt) {
  model->load_sharded(optimizer, dir, save_id);
}

/// The whole model's optimizer state, gathered from every rank's shards
/// into `full`: an optimizer of `optimizer`'s type over
/// model->module()->parameters(), made as a bare model's optimizer is.
/// Afterwards rank 0's `torch::save(full, path)` writes what a bare model's
/// optimizer loads with `torch::load` (PyTorch FSDP's full_optim_state_dict;
/// Note [Full optimizer state]). Adam, AdamW, SGD, RMSprop and Adagrad.
/// Every rank calls it.
///
/// ```
/// torch::optim::Adam full(model->module()->parameters(), adam_options);
/// lockstep::full_optimizer_state(model, adam, full);
/// if (rank == 0) torch::save(full, "optimizer.pt");
/// ```
template <typename M>
void full_optimizer_state(const FullyShardedDataParallel<M>& model, torch::optim::Optimizer& optimizer,
                          torch::optim::Optimizer& full) {
  model->full_optimizer_state(optimizer, full);
}

/// The other way: this rank's share of `full`, a bare model's optimizer over
/// model->module()->parameters() holding the whole model's state (a
/// torch::load of one, or full_optimizer_state's), into `optimizer`, made
/// from model->parameters(); the parameter groups' options too (PyTorch
/// FSDP's shard_full_optim_state_dict). So a checkpoint of a bare model, of
/// DataParallel or of DistributedDataParallel resumes under sharding:
///
/// ```
/// torch::optim::SGD full(model->module()->parameters(), options);
/// { auto whole = model->summon_full_params(); torch::load(model->module(), "model.pt"); }
/// torch::load(full, "optimizer.pt");
/// lockstep::shard_full_optimizer_state(model, full, sgd);
/// ```
///
/// Every rank calls it, with the same `full`.
template <typename M>
void shard_full_optimizer_state(FullyShardedDataParallel<M>& model, torch::optim::Optimizer& full,
                                torch::optim::Optimizer& optimizer) {
  model->shard_full_optimizer_state(full, optimizer);
}

} // namespace lockstep
