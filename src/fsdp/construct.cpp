// FullyShardedDataParallel's construction: the wrapped module's parameters
// planned into units, flat buffers and buckets, the check that every rank
// built the same model (src/fsdp/flat_param.h), each rank's shards, and the
// destructor that undoes what the constructor set up.

#include <lockstep/activation_checkpoint.h>
#include <lockstep/fully_sharded_data_parallel.h>
#include <lockstep/sync_batch_norm.h>

#include "comm/collective_fingerprint.h"
#include "deterministic/micro_batch_step.h"
#include "fsdp/flat_param.h"
#include "fsdp/state.h"
#include "fsdp/storage_watch.h"
#include "util/bucket_key.h"
#include "util/shard_registry.h"
#include "util/sparse_embeddings.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>

namespace lockstep {
namespace detail {

// Note [A module wrapped twice]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Between steps a FullShard or ShardGradOp wrapper's module holds empty
// tensors for its trainable parameters, the values living in the shards
// (Note [Edits outside summon_full_params]). A second wrapper over
// model->module() would plan units of no elements: the trained values
// lost, and its forward failing on a shape. So the parameters of every
// live wrapper are noted, and another wrapper refuses them while it lives.
namespace {

std::mutex wrapped_mutex;
std::unordered_map<const c10::TensorImpl*, int> wrapped; // parameter: the live wrappers holding it

} // namespace

void check_not_wrapped(const std::vector<std::string>& names, const std::vector<torch::Tensor>& params,
                       const std::string& where) {
  std::lock_guard<std::mutex> lock(wrapped_mutex);
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(wrapped.count(params[i].unsafeGetTensorImpl()) == 0, where, "parameter '", names[i], "' belongs to "
                "another FullyShardedDataParallel that is still alive (a model->module() wrapped again?); between "
                "steps it holds an empty tensor, its values living in that wrapper's shards. To wrap the model anew, "
                "copy its parameters out under summon_full_params() into a new module (or torch::save it there and "
                "torch::load a new one), and wrap that.");
  }
}

void note_wrapped(const std::vector<torch::Tensor>& params) {
  std::lock_guard<std::mutex> lock(wrapped_mutex);
  for (const auto& p : params) {
    ++wrapped[p.unsafeGetTensorImpl()];
  }
}

void forget_wrapped(const std::vector<torch::Tensor>& params) {
  std::lock_guard<std::mutex> lock(wrapped_mutex);
  for (const auto& p : params) {
    auto it = wrapped.find(p.unsafeGetTensorImpl());
    if (it != wrapped.end() && --it->second == 0) {
      wrapped.erase(it);
    }
  }
}

// Note [Nested wrappers]
// ~~~~~~~~~~~~~~~~~~~~~~
// PyTorch FSDP's auto-wrap nests one wrapper per block inside the root's.
// Here the inner wrapper's parameters are its shards, so the outer one
// would shard those shards and leave them empty, and the inner one's next
// all-gather would read from storage that is gone (a SIGSEGV). Nesting
// buys nothing that units do not give: each unit of one wrapper is
// gathered, freed and reduce-scattered on its own, as each nested wrapper
// is in PyTorch (FSDP2 names them "modules" of fully_shard). So a wrapper
// found inside the module to wrap is refused, naming its path and the
// units that do the same.
void check_not_nested(torch::nn::Module& module, const std::string& where) {
  for (const auto& named : module.named_modules("", /*include_self=*/true)) {
    const bool wrapper = dynamic_cast<const ShardedWrapperMark*>(named.value().get()) != nullptr;
    const std::string path = named.key();
    TORCH_CHECK(!wrapper, where, path.empty() ? std::string("the module to wrap is itself")
                                              : "the module to wrap holds, at '" + path + "',",
                " a FullyShardedDataParallel. Wrappers do not nest: the outer one would shard the inner one's "
                "shards. Wrap the bare model once, and make each submodule that should be gathered on its own a "
                "unit, as PyTorch's auto-wrap does: ShardingOptions().units({\"", path.empty() ? "block" : path,
                "\", ...}).");
  }
}

// A sparse gradient cannot be written into a flat buffer: an Embedding or
// EmbeddingBag with sparse(true) and a trainable weight is refused here,
// where backward would fail on reshaping it, naming nothing.
void check_dense_gradients(torch::nn::Module& module, const std::string& where) {
  const auto sparse = first_sparse_embedding(module);
  TORCH_CHECK(!sparse, where, "'", *sparse, "' is an Embedding with sparse(true), whose gradient is sparse, and "
              "FullyShardedDataParallel shards dense gradients only. Construct it with sparse(false).");
}

// The unit paths: the options', checked, or each direct child. The root
// ("") is always a unit; naming it alone makes it the only one.
std::vector<std::string> unit_paths(torch::nn::Module& module, const ShardingOptions& options, const std::string& where) {
  std::vector<std::string> paths;
  for (const auto& path : options.units()) {
    if (!path.empty()) {
      paths.push_back(path);
    }
  }
  if (options.units().empty()) {
    for (const auto& child : module.named_children()) {
      paths.push_back(child.key());
    }
  }
  const auto submodules = module.named_modules("", /*include_self=*/false);
  for (size_t i = 0; i < paths.size(); ++i) {
    TORCH_CHECK(submodules.contains(paths[i]), where, "ShardingOptions().units() names '", paths[i],
                "', which is not a submodule of the wrapped module. Use dotted paths as named_modules() gives them "
                "(\"encoder\", \"layers.3\").");
    TORCH_CHECK(std::find(paths.begin(), paths.begin() + i, paths[i]) == paths.begin() + i, where,
                "ShardingOptions().units() names '", paths[i], "' twice. Name each unit once.");
  }
  return paths;
}

// ShardingOptions().activation_checkpointing(): switches on checkpointing in
// each unit's module, which must offer it (lockstep::Checkpointable).
// Returns the units it switched on, which the wrapper switches off again
// when it ends (the module is then the caller's, as it was).
std::vector<std::shared_ptr<torch::nn::Module>> checkpoint_units(torch::nn::Module& module,
                                                                const std::vector<std::string>& paths,
                                                                const std::string& where) {
  TORCH_CHECK(!paths.empty(), where, "ShardingOptions().activation_checkpointing(true) checkpoints each unit but the "
              "root, and there is none: name the units, e.g. ShardingOptions().units({\"blocks.0\", ...}).");
  const auto submodules = module.named_modules("", /*include_self=*/false);
  std::vector<std::shared_ptr<torch::nn::Module>> switched;
  for (const auto& path : paths) {
    const auto& unit = submodules[path];
    auto* checkpointable = dynamic_cast<Checkpointable*>(unit.get());
    TORCH_CHECK(checkpointable != nullptr, where, "ShardingOptions().activation_checkpointing(true): unit '", path,
                "' (", unit->name(), ") cannot run as a checkpoint segment. LibTorch modules have no forward hooks, "
                "so a unit's own forward must offer it: derive its Impl from lockstep::Checkpointable and route "
                "forward's body through checkpointed_call (<lockstep/activation_checkpoint.h>), or call "
                "lockstep::checkpoint in the parent's forward and leave this option off.");
    if (!checkpointable->activation_checkpointing()) {
      checkpointable->set_activation_checkpointing(true);
      switched.push_back(unit);
    }
  }
  return switched;
}

Planned plan_parameters(torch::nn::Module& module, const std::vector<std::string>& paths, bool keep_batch_norms,
                        const std::string& where) {
  std::vector<std::string> all_names;
  std::vector<torch::Tensor> all_params;
  for (const auto& named : module.named_parameters(/*recurse=*/true)) {
    all_names.push_back(named.key());
    all_params.push_back(named.value());
  }
  const auto all_units = assign_units(all_names, paths);
  std::set<std::string> normalised;
  if (keep_batch_norms) {
    const auto names = detail::batch_norm_parameter_names(module);
    normalised.insert(names.begin(), names.end());
  }
  Planned planned;
  std::unordered_map<const void*, size_t> seen;
  for (size_t i = 0; i < all_params.size(); ++i) {
    auto it = seen.find(all_params[i].unsafeGetTensorImpl());
    if (it != seen.end()) {
      TORCH_CHECK(planned.units[it->second] == all_units[i], where, "parameter '", planned.names[it->second],
                  "' is also '", all_names[i], "': two units share it, and each unit shards its own. Put the modules "
                  "that share a parameter in one unit (ShardingOptions().units() naming their common parent).");
      planned.aliases.emplace_back(all_names[i], it->second);
      continue;
    }
    seen.emplace(all_params[i].unsafeGetTensorImpl(), planned.names.size());
    planned.names.push_back(all_names[i]);
    planned.params.push_back(all_params[i]);
    planned.units.push_back(all_units[i]);
    planned.keep_dtype.push_back(normalised.count(all_names[i]) != 0);
  }
  return planned;
}

// Note [Frozen parameters]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Parameters that require no gradient are not sharded. They stay whole in
// the module on every rank (rank 0's values), as they take no gradient and
// no optimizer state; only their own memory is not divided. Which
// parameters train is fixed when the module is wrapped: a parameter frozen
// later would keep being stepped from zero gradients (Adam's momentum, weight
// decay), and one unfrozen later would have no shard and an unaveraged
// gradient, so either is an error at the next forward or summon.

// One flat parameter per unit and (dtype, device), the root's first, with
// its parameters and offsets; layouts and buffers come later.
std::vector<FlatParam> group_into_flats(const Planned& planned, const std::vector<std::string>& paths) {
  std::vector<FlatParam> flats;
  for (size_t u = 0; u <= paths.size(); ++u) {
    std::map<std::tuple<int, std::string, char>, size_t> by_type;
    for (size_t i = 0; i < planned.params.size(); ++i) {
      const auto& p = planned.params[i];
      if (planned.units[i] != u || !p.requires_grad()) {
        continue; // Note [Frozen parameters]
      }
      const auto key = std::make_tuple(static_cast<int>(p.scalar_type()), p.device().str(), planned.keep_dtype[i]);
      if (by_type.count(key) == 0) {
        by_type[key] = flats.size();
        flats.emplace_back();
        flats.back().unit = u == 0 ? "" : paths[u - 1];
        flats.back().dtype = p.scalar_type();
        flats.back().compute_dtype = p.scalar_type();
        flats.back().reduce_dtype = p.scalar_type();
        flats.back().device = p.device();
        flats.back().keep_dtype = planned.keep_dtype[i];
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

// Note [Shard buckets]
// ~~~~~~~~~~~~~~~~~~~~
// One collective per unit costs more than its bytes when units are small:
// each goes through the agreement check (a round trip) and two thread hops,
// about 1.5 ms on these machines, so 48 units of 256 KiB spent more time
// starting collectives than moving data. Consecutive flat buffers of one
// dtype and device therefore share one all-gather (in forward order) and
// one reduce-scatter (in backward's order), as DDP's buckets share an
// allreduce, up to kShardBucketBytes gathered. The price is a copy of the
// bucket's parameters out of the gathered buffer into each unit's, and that
// buffer's transient memory (gradients are written straight into their
// places in the reduce-scatter's input); FullShard holds at most two
// buckets gathered. A unit of kShardBucketBytes or more is a bucket of its
// own and gathers straight into its buffer. A bucket's reduce-scatter
// starts when its last member's gradients are in, so it still overlaps the
// backward of the units before it. On the deep benchmark model (48 units of
// 256 KiB), 8 MiB against 4 took FullShard from 0.78-0.85 of DDP's speed
// over Gloo to 0.92-0.96, and 2 MiB to 0.72 (docs/performance.md).
//
// The first bucket of forward holds at most kFirstShardBucketBytes, as
// DDP's first bucket does: nothing computes while forward waits for it, and
// its reduce-scatter is backward's last, which nothing hides. Where the
// backend starts collectives cheaply (GroupImpl::cheap_collective_starts:
// MPI on one machine, NCCL), the caps after it double (1, 2, 4, then
// 8 MiB), so that forward computes each bucket while the next, twice its
// size, arrives: on 1.13's deep model that made ShardGradOp over MPI 4-10%
// faster side by side (about 3% slower on 2.15's, whose slower compute
// hides the gathers anyway), and on Gloo, whose every collective costs a
// round trip, it cost FullShard on the MLP a fifth (docs/performance.md).
// The reduce-scatters take the all-gathers' buckets in reverse.
constexpr int64_t kShardBucketBytes = 8 << 20;
constexpr int64_t kFirstShardBucketBytes = 1 << 20;

namespace {

// Consecutive flats in `order`, one open bucket per key (dtype and device),
// each closed before a flat would take it past `cap` bytes (`first_cap` for
// a key's first bucket, and with `doubling` twice the cap before it for the
// next, up to `cap`): a flat of that size or more is a bucket of its own
// (Note [Shard buckets]).
std::vector<std::vector<size_t>> shard_buckets(const std::vector<int64_t>& bytes, const std::vector<std::string>& keys,
                                               int64_t first_cap, int64_t cap, bool doubling,
                                               const std::vector<size_t>& order) {
  struct Open {
    std::vector<size_t> members;
    int64_t total = 0;
    int closed = 0; // buckets of this key before this one
  };
  std::map<std::string, Open> open;
  std::vector<std::string> key_order; // for the last open buckets, in the order their keys came
  std::vector<std::vector<size_t>> buckets;
  for (size_t k : order) {
    auto [it, inserted] = open.try_emplace(keys[k]);
    if (inserted) {
      key_order.push_back(keys[k]);
    }
    auto& bucket = it->second;
    int64_t limit = first_cap; // this key's first bucket
    if (bucket.closed > 0) {
      limit = doubling ? std::min(cap, first_cap << std::min(bucket.closed, 30)) : cap;
    }
    if (!bucket.members.empty() && bucket.total + bytes[k] > limit) {
      buckets.push_back(std::move(bucket.members));
      bucket = Open{{}, 0, bucket.closed + 1};
    }
    bucket.members.push_back(k);
    bucket.total += bytes[k];
  }
  for (const auto& key : key_order) {
    if (!open[key].members.empty()) {
      buckets.push_back(std::move(open[key].members));
    }
  }
  return buckets;
}

} // namespace

// The buckets (Note [Shard buckets]), by the flats' gathered bytes.
void ShardedCore::State::plan_buckets() {
  std::vector<int64_t> bytes;
  std::vector<std::string> keys;
  for (const auto& flat : flats) {
    bytes.push_back(flat.layout.padded * static_cast<int64_t>(c10::elementSize(flat.dtype)));
    // One gathered buffer and one reduce-scatter per bucket: one compute and one reduce dtype.
    keys.push_back(bucket_key(flat.dtype, flat.device) + "/" + c10::toString(flat.compute_dtype) + "/" +
                   c10::toString(flat.reduce_dtype));
  }
  std::vector<size_t> forward(flats.size());
  std::iota(forward.begin(), forward.end(), size_t{0});
  gather_buckets =
      shard_buckets(bytes, keys, kFirstShardBucketBytes, kShardBucketBytes, group.cheap_collective_starts(), forward);
  bucket_of.assign(flats.size(), 0);
  for (size_t g = 0; g < gather_buckets.size(); ++g) {
    for (size_t i : gather_buckets[g]) {
      bucket_of[i] = g;
    }
  }
  backward_reads.assign(gather_buckets.size(), 0);
  last_backward_reads.assign(gather_buckets.size(), 1); // before any backward, expect every one read
  for (auto g = gather_buckets.rbegin(); g != gather_buckets.rend(); ++g) {
    reduce_buckets.push_back(Bucket{{g->rbegin(), g->rend()}, nullptr, torch::Tensor(), timeline::Span()});
  }
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

bool ShardedCore::sync() const {
  return state_->sync;
}

void ShardedCore::set_sync(bool sync) {
  state_->sync = sync;
}

std::vector<FlatParamInfo> ShardedCore::flat_params() const {
  std::vector<FlatParamInfo> infos;
  for (const auto& flat : state_->flats) {
    infos.push_back({flat.unit, flat.dtype, flat.layout.numel, flat.layout.shard, flat.names});
  }
  return infos;
}

namespace {

// Rank 0's values of `params` and `buffers` on every rank.
void broadcast_from_rank0(ProcessGroup& group, const std::vector<torch::Tensor>& params,
                          const std::vector<torch::Tensor>& buffers) {
  torch::NoGradGuard no_grad;
  for (const auto* tensors : {&params, &buffers}) {
    for (const auto& t : *tensors) {
      auto data = t.detach();
      group.broadcast(data, 0);
    }
  }
}

} // namespace

ShardedCore::ShardedCore(torch::nn::Module& owner, torch::nn::Module& module, ProcessGroup group,
                         const ShardingOptions& options)
    : state_(std::make_shared<State>()), group_(group) {
  auto& s = *state_;
  s.group = std::move(group);
  s.strategy = options.strategy();
  s.reshard_after_forward = options.reshard_after_forward();
  check_not_nested(module, s.where()); // Note [Nested wrappers]
  check_dense_gradients(module, s.where());
  if (options.deterministic()) {
    check_exactly_summable(module, s.where(), /*frozen_too=*/false); // before the parameters become the flats' views
  } else {
    check_no_micro_batch_options({options.micro_batches(), options.micro_batch_size(), options.seed()}, s.where(),
                                 "ShardingOptions");
  }
  const auto paths = unit_paths(module, options, s.where());
  if (options.activation_checkpointing()) {
    s.checkpointed_units = checkpoint_units(module, paths, s.where());
  }
  const auto planned = plan_parameters(module, paths, options.param_dtype() || options.reduce_dtype(), s.where());
  check_not_wrapped(planned.names, planned.params, s.where()); // Note [A module wrapped twice]
  s.model = check_same_model(s.group, planned.names, planned.params, options, s.where());
  // After the check above, so that every rank has the same model and fails alike.
  TORCH_CHECK(std::any_of(planned.params.begin(), planned.params.end(), [](const auto& p) { return p.requires_grad(); }),
              s.where(), "the module has no parameter that requires a gradient, so there is nothing to shard or "
              "reduce. Wrap a module with a trainable parameter, or run a frozen one bare.");
  detail::label_sync_batch_norms(module, s.group, s.model);
  broadcast_from_rank0(s.group, planned.params, module.buffers(/*recurse=*/true));
  s.flats = group_into_flats(planned, paths);
  for (auto& named : module.named_buffers(/*recurse=*/true)) {
    s.whole.emplace_back(named.key(), named.value());
  }
  s.first_frozen = s.whole.size();
  for (const auto& [alias, i] : planned.aliases) {
    s.aliases.emplace_back(alias, planned.names[i]);
  }
  std::set<std::string> frozen_batch_norms; // keep their dtype (Note [Sharded mixed precision])
  for (size_t i = 0; i < planned.params.size(); ++i) {
    if (!planned.params[i].requires_grad()) {
      s.whole.emplace_back(planned.names[i], planned.params[i]); // Note [Frozen parameters]
      if (planned.keep_dtype[i] != 0) {
        frozen_batch_norms.insert(planned.names[i]);
      }
    }
  }
  s.set_precision(options, frozen_batch_norms); // Note [Sharded mixed precision]
  param_dtype_ = options.param_dtype();
  for (size_t f = 0; f < s.flats.size(); ++f) {
    shard_flat(owner, f);
  }
  s.plan_buckets();
  if (!s.flats.empty() && s.flats.front().device.is_cpu()) {
    s.cache_user = std::make_unique<CpuCacheUser>(); // Note [A sharded step's memory]
  }
  if (options.deterministic()) {
    make_deterministic(module, options);
  }
  for (const auto& flat : s.flats) {
    note_wrapped(flat.params);
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
  note_shard(flat.shard.unsafeGetTensorImpl(), s.sharded() ? s.group.size() : 1); // GradScaler checks its group
  flat.full = s.sharded() ? whole.to(flat.compute_dtype) : torch::Tensor();
  // The accumulators are made, and kept, while the parameters have their
  // own shapes and the dtype they compute in: autograd checks each gradient
  // against what its accumulator saw when it was made.
  if (flat.compute_dtype != flat.dtype) {
    torch::NoGradGuard no_grad;
    for (auto& p : flat.params) {
      p.set_data(p.detach().to(flat.compute_dtype)); // Note [Sharded mixed precision]
    }
  }
  flat.ready.assign(flat.params.size(), 0);
  for (size_t j = 0; j < flat.params.size(); ++j) {
    auto accumulator = torch::autograd::impl::grad_accumulator(flat.params[j]);
    TORCH_INTERNAL_ASSERT(accumulator, "parameter without a gradient accumulator");
    flat.hook_keys.push_back(accumulator->add_post_hook(std::make_unique<State::ReadyHook>(state_, f, j)));
    flat.accumulators.push_back(std::move(accumulator));
    const auto& buffer = s.sharded() ? flat.full : whole;
    flat.views.push_back(buffer.narrow(0, flat.offsets[j], flat.params[j].numel()).view(flat.params[j].sizes()));
  }
  if (s.sharded()) {
    s.release(flat, /*empty=*/true);
    watch_storage(flat.full.storage().unsafeGetStorageImpl(), state_, f);
  } else {
    s.point_params_at_views(flat); // views of the shard, which is the whole
  }
}

void ShardedCore::check_move(const std::optional<torch::Device>& device, const std::optional<torch::Dtype>& dtype) const {
  std::vector<std::pair<torch::ScalarType, torch::Device>> held; // the flats', the buffers' and the frozen parameters'
  for (const auto& flat : state_->flats) {
    held.emplace_back(flat.dtype, flat.device);
  }
  for (const auto& [name, tensor] : state_->whole) {
    held.emplace_back(tensor.scalar_type(), tensor.device());
  }
  for (const auto& [held_dtype, held_device] : held) {
    const bool moves = device && *device != held_device &&
        !(device->type() == held_device.type() && !device->has_index()); // cuda for cuda:0 (the model's own)
    const bool casts = dtype && *dtype != held_dtype && c10::isFloatingType(held_dtype);
    TORCH_CHECK(!moves && !casts, state_->where(), "to(", device ? device->str() : std::string(),
                device && dtype ? ", " : "", dtype ? c10::toString(*dtype) : "", ") after wrapping would move or cast "
                "only this rank's shards, apart from the gathered parameters, the buffers and the frozen "
                "parameters (the model holds ", held_dtype, " on ", held_device, "). Move or cast the module before "
                "wrapping it: FullyShardedDataParallel<Net>(net) after net->to(...).");
  }
}

ShardedCore::~ShardedCore() {
  unwatch_storages(state_.get());
  state_->cache_thread_allocations(false);
  if (state_->watched_pass) {
    detail::end_pass();
  }
  for (auto& unit : state_->checkpointed_units) {
    dynamic_cast<Checkpointable&>(*unit).set_activation_checkpointing(false);
  }
  for (auto& flat : state_->flats) {
    forget_wrapped(flat.params);
    forget_shard(flat.shard.unsafeGetTensorImpl());
    for (size_t j = 0; j < flat.accumulators.size(); ++j) {
      flat.accumulators[j]->del_post_hook(flat.hook_keys[j]);
    }
  }
}

} // namespace detail
} // namespace lockstep
