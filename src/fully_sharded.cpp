#include <lockstep/fully_sharded_data_parallel.h>

#include "flat_param.h"
#include "mapped_memory.h"
#include "torch_compat.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <sstream>
#include <unordered_map>

namespace lockstep {
namespace detail {

// Note [Sharded step]
// ~~~~~~~~~~~~~~~~~~~
// Each unit's trainable parameters of one dtype live in one flat buffer,
// padded with zeros to a multiple of the world size W; rank r owns elements
// [r*s, (r+1)*s) of it, s = padded / W, as a leaf tensor registered on the
// wrapper: model->parameters() is the shards, and an optimizer made from
// them steps this rank's share and keeps its state for that share only.
// Padding has zero gradients, so Adam, SGD and weight decay leave it zero.
//
// One step, FullShard:
//  - forward: every unit's buffer is all-gathered (all started, then waited
//    in order) and the module's parameters are pointed at views of it
//    (set_data keeps each parameter's TensorImpl, so the module's own
//    members and autograd's edges see them). LibTorch's modules have no
//    forward hooks, so a unit cannot be gathered just before it runs: all
//    are gathered before the module's forward.
//  - after forward, each unit's buffer except the root's has its storage
//    released (the StorageImpl stays, so autograd's saved views of it are
//    filled again in place), and a hook on the outputs' gradients gathers
//    them again before any of the module's backward runs;
//  - in backward, once every parameter of a flat buffer has its gradient,
//    the gradients are copied into one padded buffer (and the parameters'
//    .grad dropped) and reduce-scattered, averaged, into a gradient of the
//    shard. Buffers start in a fixed order, the reverse of the units', so
//    that every rank starts the same collectives in the same order; one
//    whose gradients are not all there holds back the ones after it until
//    the end of backward, where what never came is zero.
//  - at the end of backward, the shards' .grad get the results (added to
//    what is there, as autograd accumulates), and every buffer is released:
//    the module's parameters become empty tensors, so that nothing reads
//    values the optimizer step is about to make stale.
// ShardGradOp is the same without the release after forward, and keeps its
// buffers' memory from step to step (ZeRO-2: parameters whole), though its
// module's parameters are empty outside forward and backward too. NoShard keeps
// the whole flat buffer as the "shard" on every rank, the module's
// parameters as views of it, and averages gradients with an allreduce.

namespace {

void release_storage(const torch::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

std::string shard_name(const FlatParam& flat) {
  std::string name = flat.unit.empty() ? std::string("root") : flat.unit;
  std::replace(name.begin(), name.end(), '.', '/'); // a parameter's name has no dots
  return name + ":" + c10::toString(flat.dtype);
}

} // namespace

struct ShardedCore::State : std::enable_shared_from_this<ShardedCore::State> {
  ProcessGroup group;
  ShardingStrategy strategy = ShardingStrategy::FullShard;
  bool reshard_after_forward = true;
  std::vector<FlatParam> flats; // the root's first, then the units' in order
  bool forwarded = false; // a forward ran whose backward has not ended
  bool sync_at_forward = true;
  bool finalize_queued = false;
  size_t next_launch = 0; // into the reverse of `flats`
  bool summoned = false;
  // What is not sharded but is the model's state: buffers and frozen
  // parameters, by name, the live tensors (Note [Sharded checkpoint]).
  std::vector<std::pair<std::string, torch::Tensor>> whole;

  class ReadyHook : public torch::autograd::FunctionPostHook {
   public:
    ReadyHook(std::weak_ptr<State> state, size_t flat, size_t index) : state_(std::move(state)), flat_(flat), index_(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list& /*inputs*/) override {
      if (auto state = state_.lock()) {
        state->on_ready(flat_, index_);
      }
      return outputs;
    }

   private:
    std::weak_ptr<State> state_;
    size_t flat_, index_;
  };

  std::string where() const {
    return "lockstep::FullyShardedDataParallel: rank " + std::to_string(group.rank()) + " of " +
        std::to_string(group.size()) + ": ";
  }

  bool sharded() const {
    return strategy != ShardingStrategy::NoShard;
  }

  void point_params_at(FlatParam& flat, const torch::Tensor& buffer) {
    for (size_t j = 0; j < flat.params.size(); ++j) {
      const auto& shape = flat.shapes[j];
      const int64_t numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
      flat.params[j].set_data(buffer.narrow(0, flat.offsets[j], numel).view(shape));
    }
  }

  // Every sharded flat buffer gathered and its parameters pointed at it.
  void gather_all() {
    if (!sharded()) {
      return;
    }
    std::vector<std::shared_ptr<Work>> works(flats.size());
    std::vector<int64_t> starts(flats.size(), 0);
    for (size_t i = 0; i < flats.size(); ++i) {
      auto& flat = flats[i];
      if (flat.gathered) {
        continue;
      }
      allocate_mapped(flat.full);
      starts[i] = timeline::enabled() ? timeline::detail::now_us() : 0;
      works[i] = group.all_gather_into_async(flat.full, flat.shard.detach(), "all_gather of " + shard_name(flat) + " (" +
                                             std::to_string(flat.layout.padded) + " elements)");
    }
    for (size_t i = 0; i < flats.size(); ++i) {
      if (!works[i]) {
        continue;
      }
      works[i]->wait();
      if (timeline::enabled()) {
        timeline::detail::record("all_gather " + shard_name(flats[i]), starts[i], timeline::detail::now_us(),
                                 "collectives", flats[i].full.numel() * flats[i].full.element_size());
      }
      point_params_at(flats[i], flats[i].full);
      flats[i].gathered = true;
    }
  }

  // The flat buffer's storage released, and with `empty` its parameters
  // made empty tensors.
  // ShardGradOp keeps the buffer's memory for the next gather (ZeRO-2 keeps
  // parameters whole; refilling fresh pages every step cost a third of the
  // MLP's step), but its parameters still become empty: the values are stale
  // once the optimizer steps.
  void release(FlatParam& flat, bool empty) {
    if (!sharded()) {
      return;
    }
    if (empty) {
      for (auto& p : flat.params) {
        p.set_data(torch::empty({0}, flat.options()));
      }
    }
    if (strategy == ShardingStrategy::FullShard) {
      release_storage(flat.full);
    }
    flat.gathered = false;
  }

  void release_all() {
    for (auto& flat : flats) {
      release(flat, /*empty=*/true);
    }
  }

  void on_ready(size_t f, size_t j) {
    TORCH_CHECK(forwarded, where(), "parameter '", flats[f].names[j],
                "' received a gradient, but no forward ran through FullyShardedDataParallel since the last backward. "
                "Run forward through the FullyShardedDataParallel (not its module()) before each backward.");
    if (!finalize_queued) {
      finalize_queued = true;
      std::weak_ptr<State> weak = shared_from_this();
      torch::autograd::Engine::get_default_engine().queue_callback([weak] {
        if (auto state = weak.lock()) {
          state->finalize();
        }
      });
    }
    if (!sync_at_forward) {
      return; // no_sync: the whole gradient stays in .grad
    }
    auto& flat = flats[f];
    if (!flat.ready[j]) {
      flat.ready[j] = 1;
      ++flat.ready_count;
    }
    launch_ready();
  }

  void launch_ready() {
    while (next_launch < flats.size()) {
      auto& flat = flats[flats.size() - 1 - next_launch];
      if (flat.ready_count < flat.params.size()) {
        return;
      }
      launch(flat);
      ++next_launch;
    }
  }

  // The flat buffer's gradients (zeros where none came) averaged into a
  // gradient of its shard.
  void launch(FlatParam& flat) {
    auto grads = empty_mapped(flat.layout.padded, flat.options()).zero_();
    for (size_t j = 0; j < flat.params.size(); ++j) {
      auto& grad = flat.params[j].mutable_grad();
      if (grad.defined()) {
        grads.narrow(0, flat.offsets[j], grad.numel()).copy_(grad.reshape({-1}));
        grad = torch::Tensor();
      }
    }
    flat.reduce_start_us = timeline::enabled() ? timeline::detail::now_us() : 0;
    const std::string what = (sharded() ? "reduce_scatter of " : "allreduce of ") + shard_name(flat) + " (" +
        std::to_string(flat.layout.padded) + " elements)";
    if (sharded()) {
      flat.reduced = torch::empty({flat.layout.shard}, grads.options());
      flat.reduce = group.reduce_scatter_async(flat.reduced, grads, ReduceOp::Avg, what);
    } else {
      flat.reduced = grads;
      flat.reduce = group.allreduce_async({grads}, ReduceOp::Avg, what);
    }
  }

  void finalize() {
    finalize_queued = false;
    forwarded = false;
    if (sync_at_forward) {
      for (; next_launch < flats.size(); ++next_launch) {
        launch(flats[flats.size() - 1 - next_launch]);
      }
      for (auto& flat : flats) {
        flat.reduce->wait();
        if (timeline::enabled()) {
          timeline::detail::record((sharded() ? "reduce_scatter " : "allreduce ") + shard_name(flat),
                                   flat.reduce_start_us, timeline::detail::now_us(), "collectives",
                                   flat.reduced.numel() * flat.reduced.element_size() * (sharded() ? group.size() : 1));
        }
        auto& grad = flat.shard.mutable_grad();
        if (grad.defined()) {
          grad.add_(flat.reduced);
        } else {
          grad = flat.reduced;
        }
        flat.reduce.reset();
        flat.reduced = torch::Tensor();
        std::fill(flat.ready.begin(), flat.ready.end(), 0);
        flat.ready_count = 0;
      }
      next_launch = 0;
    }
    release_all();
  }
};

namespace {

// Every rank must shard the same parameters, or the flat buffers would not
// line up: the names, shapes and dtypes, hashed, and compared.
void check_same_model(const ProcessGroup& group, const std::vector<std::string>& names,
                      const std::vector<torch::Tensor>& params, const std::string& where) {
  std::ostringstream text;
  for (size_t i = 0; i < names.size(); ++i) {
    text << names[i] << params[i].sizes() << c10::toString(params[i].scalar_type()) << params[i].requires_grad() << ";";
  }
  const auto hash = static_cast<int64_t>(std::hash<std::string>()(text.str()) >> 1);
  auto mine = torch::tensor({static_cast<int64_t>(names.size()), hash}, torch::kLong);
  const auto all = group.all_gather(mine);
  for (int r = 1; r < group.size(); ++r) {
    const auto* theirs = all[r].data_ptr<int64_t>();
    const auto* first = all[0].data_ptr<int64_t>();
    TORCH_CHECK(theirs[0] == first[0] && theirs[1] == first[1], where, "rank ", r,
                " built a different model than rank 0 (", theirs[0], " against ", first[0],
                " parameters, or different names, shapes, dtypes or requires_grad). Every rank must construct the "
                "same module before wrapping it.");
  }
}

// The unit paths: the options', checked, or each direct child.
std::vector<std::string> unit_paths(torch::nn::Module& module, const ShardingOptions& options, const std::string& where) {
  std::vector<std::string> paths = options.units();
  if (paths.empty()) {
    for (const auto& child : module.named_children()) {
      paths.push_back(child.key());
    }
  }
  const auto submodules = module.named_modules("", /*include_self=*/false);
  for (const auto& path : paths) {
    TORCH_CHECK(submodules.contains(path), where, "ShardingOptions().units() names '", path,
                "', which is not a submodule of the wrapped module. Use dotted paths as named_modules() gives them "
                "(\"encoder\", \"layers.3\").");
  }
  return paths;
}

// The module's parameters, each once at its first name, with its unit; one
// that two units share is refused.
struct Planned {
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  std::vector<size_t> units;
};

Planned plan_parameters(torch::nn::Module& module, const std::vector<std::string>& paths, const std::string& where) {
  std::vector<std::string> all_names;
  std::vector<torch::Tensor> all_params;
  for (const auto& named : module.named_parameters(/*recurse=*/true)) {
    all_names.push_back(named.key());
    all_params.push_back(named.value());
  }
  const auto all_units = assign_units(all_names, paths);
  Planned planned;
  std::unordered_map<const void*, size_t> seen;
  for (size_t i = 0; i < all_params.size(); ++i) {
    auto it = seen.find(all_params[i].unsafeGetTensorImpl());
    if (it != seen.end()) {
      TORCH_CHECK(planned.units[it->second] == all_units[i], where, "parameter '", planned.names[it->second],
                  "' is also '", all_names[i], "': two units share it, and each unit shards its own. Put the modules "
                  "that share a parameter in one unit (ShardingOptions().units() naming their common parent).");
      continue;
    }
    seen.emplace(all_params[i].unsafeGetTensorImpl(), planned.names.size());
    planned.names.push_back(all_names[i]);
    planned.params.push_back(all_params[i]);
    planned.units.push_back(all_units[i]);
  }
  return planned;
}

// Note [Frozen parameters]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Parameters that require no gradient are not sharded. They stay whole in
// the module on every rank (rank 0's values), as they take no gradient and
// no optimizer state; only their own memory is not divided.

// One flat parameter per unit and (dtype, device), the root's first, with
// its parameters and offsets; layouts and buffers come later.
std::vector<FlatParam> group_into_flats(const Planned& planned, const std::vector<std::string>& paths) {
  std::vector<FlatParam> flats;
  for (size_t u = 0; u <= paths.size(); ++u) {
    std::map<std::pair<int, std::string>, size_t> by_type;
    for (size_t i = 0; i < planned.params.size(); ++i) {
      const auto& p = planned.params[i];
      if (planned.units[i] != u || !p.requires_grad()) {
        continue; // Note [Frozen parameters]
      }
      const auto key = std::make_pair(static_cast<int>(p.scalar_type()), p.device().str());
      if (by_type.count(key) == 0) {
        by_type[key] = flats.size();
        flats.emplace_back();
        flats.back().unit = u == 0 ? "" : paths[u - 1];
        flats.back().dtype = p.scalar_type();
        flats.back().device = p.device();
      }
      auto& flat = flats[by_type[key]];
      flat.offsets.push_back(flat.layout.numel);
      flat.layout.numel += p.numel();
      flat.params.push_back(p);
      flat.shapes.push_back(p.sizes().vec());
      flat.names.push_back(planned.names[i]);
    }
  }
  return flats;
}

} // namespace

ShardedCore::ShardedCore(torch::nn::Module& owner, torch::nn::Module& module, ProcessGroup group,
                         const ShardingOptions& options)
    : state_(std::make_shared<State>()), group_(group) {
  auto& s = *state_;
  s.group = std::move(group);
  s.strategy = options.strategy();
  s.reshard_after_forward = options.reshard_after_forward();
  const auto paths = unit_paths(module, options, s.where());
  const auto planned = plan_parameters(module, paths, s.where());
  check_same_model(s.group, planned.names, planned.params, s.where());
  {
    torch::NoGradGuard no_grad; // rank 0's values everywhere
    for (auto& p : planned.params) {
      auto data = p.detach();
      s.group.broadcast(data, 0);
    }
    for (auto& b : module.buffers(/*recurse=*/true)) {
      auto data = b.detach();
      s.group.broadcast(data, 0);
    }
  }
  s.flats = group_into_flats(planned, paths);
  for (auto& named : module.named_buffers(/*recurse=*/true)) {
    s.whole.emplace_back(named.key(), named.value());
  }
  for (size_t i = 0; i < planned.params.size(); ++i) {
    if (!planned.params[i].requires_grad()) {
      s.whole.emplace_back(planned.names[i], planned.params[i]); // Note [Frozen parameters]
    }
  }
  for (size_t f = 0; f < s.flats.size(); ++f) {
    shard_flat(owner, f);
  }
}

// Flat parameter f's padded buffer, this rank's shard of it (registered on
// `owner`), and its gradient hooks.
void ShardedCore::shard_flat(torch::nn::Module& owner, size_t f) {
  auto& s = *state_;
  auto& flat = s.flats[f];
  flat.layout = shard_layout(flat.layout.numel, s.sharded() ? s.group.size() : 1);
  auto whole = torch::zeros({flat.layout.padded}, flat.options());
  {
    torch::NoGradGuard no_grad;
    for (size_t j = 0; j < flat.params.size(); ++j) {
      whole.narrow(0, flat.offsets[j], flat.params[j].numel()).copy_(flat.params[j].detach().reshape({-1}));
    }
  }
  const int rank = s.sharded() ? s.group.rank() : 0;
  auto shard = s.sharded() ? whole.narrow(0, rank * flat.layout.shard, flat.layout.shard).clone() : whole;
  flat.shard = owner.register_parameter(shard_name(flat), shard);
  flat.full = s.sharded() ? whole : torch::Tensor();
  // The accumulators are made, and kept, while the parameters have their
  // own shapes: autograd checks each gradient against the shape its
  // accumulator saw when it was made.
  flat.ready.assign(flat.params.size(), 0);
  for (size_t j = 0; j < flat.params.size(); ++j) {
    auto accumulator = torch::autograd::impl::grad_accumulator(flat.params[j]);
    TORCH_INTERNAL_ASSERT(accumulator, "parameter without a gradient accumulator");
    flat.hook_keys.push_back(accumulator->add_post_hook(std::make_unique<State::ReadyHook>(state_, f, j)));
    flat.accumulators.push_back(std::move(accumulator));
  }
  if (s.sharded()) {
    s.release(flat, /*empty=*/true);
  } else {
    s.point_params_at(flat, flat.shard.detach());
  }
}

ShardedCore::~ShardedCore() {
  for (auto& flat : state_->flats) {
    for (size_t j = 0; j < flat.accumulators.size(); ++j) {
      flat.accumulators[j]->del_post_hook(flat.hook_keys[j]);
    }
  }
}

void ShardedCore::before_forward() {
  auto& s = *state_;
  TORCH_CHECK(!s.summoned, s.where(), "forward inside summon_full_params(). End the guard first.");
  s.gather_all();
}

void ShardedCore::after_forward(const std::vector<torch::Tensor>& outputs) {
  auto& s = *state_;
  std::vector<torch::Tensor> hooked;
  for (const auto& out : outputs) {
    if (out.defined() && out.requires_grad()) {
      hooked.push_back(out);
    }
  }
  if (hooked.empty()) {
    s.release_all(); // no backward follows
    return;
  }
  s.forwarded = true;
  s.sync_at_forward = sync_;
  if (s.strategy == ShardingStrategy::FullShard && s.reshard_after_forward) {
    // The parameters become empty too, so that nothing reads released
    // memory if no backward follows: autograd keeps each parameter's
    // TensorImpl, and the outputs' hook points it at its buffer again
    // before any of the module's backward runs.
    for (auto& flat : s.flats) {
      if (!flat.unit.empty()) {
        s.release(flat, /*empty=*/true);
      }
    }
    std::weak_ptr<State> weak = state_;
    for (auto& out : hooked) {
      out.register_hook([weak](const torch::Tensor& grad) {
        if (auto state = weak.lock()) {
          state->gather_all();
        }
        return grad;
      });
    }
  }
}

void ShardedCore::summon() {
  auto& s = *state_;
  TORCH_CHECK(!s.summoned, s.where(), "summon_full_params() inside another; end the first guard.");
  TORCH_CHECK(!s.forwarded, s.where(), "summon_full_params() between a forward and its backward. Call it before "
              "forward or after backward.");
  s.gather_all();
  s.summoned = true;
}

void ShardedCore::unsummon(bool writeback) {
  auto& s = *state_;
  s.summoned = false;
  if (writeback && s.sharded()) {
    torch::NoGradGuard no_grad;
    for (auto& flat : s.flats) {
      flat.shard.detach().copy_(flat.full.narrow(0, s.group.rank() * flat.layout.shard, flat.layout.shard));
    }
  }
  s.release_all();
}

std::vector<FlatParam*> ShardedCore::flats() const {
  std::vector<FlatParam*> flats;
  for (auto& flat : state_->flats) {
    flats.push_back(&flat);
  }
  return flats;
}

const std::vector<std::pair<std::string, torch::Tensor>>& ShardedCore::whole() const {
  return state_->whole;
}

bool ShardedCore::sharded() const {
  return state_->sharded();
}

std::vector<ShardedCore::FlatInfo> ShardedCore::flat_params() const {
  std::vector<FlatInfo> infos;
  for (const auto& flat : state_->flats) {
    infos.push_back({flat.unit, flat.dtype, flat.layout.numel, flat.layout.shard, flat.names});
  }
  return infos;
}

} // namespace detail
} // namespace lockstep
