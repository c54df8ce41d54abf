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
//  - forward: every unit's buffer is all-gathered (a bucket of small units
//    per all-gather, Note [Shard buckets]; all started, then waited in
//    order) and the module's parameters are pointed at views of it
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
//    shard, with the rest of its bucket. Buckets start in a fixed order,
//    the reverse of the units', so that every rank starts the same
//    collectives in the same order; one whose gradients are not all there
//    holds back the ones after it until the end of backward, where what
//    never came is zero.
//  - at the end of backward, the shards' .grad get the results (added to
//    what is there, as autograd accumulates), and every buffer is released:
//    the module's parameters become empty tensors, so that nothing reads
//    values the optimizer step is about to make stale.
// ShardGradOp is the same without the release after forward, and keeps its
// buffers' memory from step to step (ZeRO-2: parameters whole), though its
// module's parameters are empty outside forward and backward too. NoShard keeps
// the whole flat buffer as the "shard" on every rank, the module's
// parameters as views of it, and averages gradients with an allreduce.

// Note [Shard buckets]
// ~~~~~~~~~~~~~~~~~~~~
// One collective per unit costs more than its bytes when units are small:
// each goes through the agreement check and two thread hops, about 1.5 ms
// on these machines, so 48 units of 256 KiB spent more time starting
// collectives than moving data. Consecutive flat buffers of one dtype and
// device therefore share one all-gather (in forward order) and one
// reduce-scatter (in backward's order), as DDP's buckets share an
// allreduce, up to kShardBucketBytes gathered. The price is a copy
// of the bucket's parameters out of the gathered buffer, and of its
// gradients into the reduce-scatter's input, and that buffer's transient
// memory. A unit of at least kShardBucketBytes is a bucket of its own and
// gathers straight into its buffer. A bucket's reduce-scatter starts when
// its last member's gradients are in, so it still overlaps the backward of
// the units before it.
constexpr int64_t kShardBucketBytes = 4 << 20;

namespace {

void release_storage(const torch::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

// Consecutive flats in `order`, one open bucket per key (dtype and device),
// each closed before a flat would take it past `cap` bytes: a flat of `cap`
// or more is a bucket of its own (Note [Shard buckets]).
std::vector<std::vector<size_t>> shard_buckets(const std::vector<int64_t>& bytes, const std::vector<std::string>& keys,
                                               int64_t cap, const std::vector<size_t>& order) {
  std::map<std::string, std::pair<std::vector<size_t>, int64_t>> open;
  std::vector<std::string> key_order; // for the last open buckets, in the order their keys came
  std::vector<std::vector<size_t>> buckets;
  for (size_t k : order) {
    auto [it, inserted] = open.try_emplace(keys[k]);
    if (inserted) {
      key_order.push_back(keys[k]);
    }
    auto& [members, total] = it->second;
    if (!members.empty() && total + bytes[k] > cap) {
      buckets.push_back(std::move(members));
      members.clear();
      total = 0;
    }
    members.push_back(k);
    total += bytes[k];
  }
  for (const auto& key : key_order) {
    if (!open[key].first.empty()) {
      buckets.push_back(std::move(open[key].first));
    }
  }
  return buckets;
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
  // Note [Shard buckets]: flat indices per all-gather (forward order), and
  // the reduce-scatters (the reverse), each with what it started.
  struct Bucket {
    std::vector<size_t> members;
    std::shared_ptr<Work> work;
    torch::Tensor output;
    int64_t start_us = 0;
  };
  std::vector<std::vector<size_t>> gather_buckets;
  std::vector<Bucket> reduce_buckets;
  size_t next_launch = 0; // into reduce_buckets
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

  // The buckets (Note [Shard buckets]), by the flats' gathered bytes.
  void plan_buckets() {
    std::vector<int64_t> bytes;
    std::vector<std::string> keys;
    for (const auto& flat : flats) {
      bytes.push_back(flat.layout.padded * static_cast<int64_t>(c10::elementSize(flat.dtype)));
      keys.push_back(std::string(c10::toString(flat.dtype)) + "@" + flat.device.str());
    }
    std::vector<size_t> forward(flats.size());
    std::iota(forward.begin(), forward.end(), size_t{0});
    gather_buckets = shard_buckets(bytes, keys, kShardBucketBytes, forward);
    for (auto& members : shard_buckets(bytes, keys, kShardBucketBytes, {forward.rbegin(), forward.rend()})) {
      reduce_buckets.push_back(Bucket{std::move(members), nullptr, torch::Tensor(), 0});
    }
  }

  std::string bucket_name(const std::vector<size_t>& members) const {
    const std::string first = shard_name(flats[members.front()]);
    return members.size() == 1 ? first
                               : std::to_string(members.size()) + " units (" + first + " to " +
            shard_name(flats[members.back()]) + ")";
  }

  // Every sharded flat buffer gathered, a bucket per all-gather, and its
  // parameters pointed at it.
  void gather_all() {
    if (!sharded()) {
      return;
    }
    std::vector<Bucket> started;
    for (const auto& bucket : gather_buckets) {
      Bucket b;
      for (size_t i : bucket) {
        if (!flats[i].gathered) {
          b.members.push_back(i);
        }
      }
      if (!b.members.empty()) {
        b.start_us = timeline::enabled() ? timeline::detail::now_us() : 0;
        start_gather(b);
        started.push_back(std::move(b));
      }
    }
    for (auto& b : started) {
      b.work->wait();
      if (timeline::enabled()) {
        timeline::detail::record("all_gather " + bucket_name(b.members), b.start_us, timeline::detail::now_us(),
                                 "collectives", b.output.numel() * b.output.element_size());
      }
      unpack_gathered(b);
    }
  }

  // One all-gather: straight into the flat's own buffer when it is alone,
  // else into one buffer holding each rank's shards one after another.
  void start_gather(Bucket& b) {
    const std::string what = "all_gather of " + bucket_name(b.members);
    if (b.members.size() == 1) {
      auto& flat = flats[b.members[0]];
      allocate_mapped(flat.full);
      b.output = flat.full;
      b.work = group.all_gather_into_async(flat.full, flat.shard.detach(),
                                           what + " (" + std::to_string(flat.layout.padded) + " elements)");
      return;
    }
    std::vector<torch::Tensor> shards;
    for (size_t i : b.members) {
      shards.push_back(flats[i].shard.detach());
    }
    auto input = torch::cat(shards);
    b.output = empty_mapped(input.numel() * group.size(), input.options());
    b.work = group.all_gather_into_async(b.output, input, what + " (" + std::to_string(b.output.numel()) + " elements)");
  }

  // Each member's part of every rank's shards copied into its own buffer.
  void unpack_gathered(const Bucket& b) {
    torch::NoGradGuard no_grad;
    const int64_t world = group.size();
    const int64_t per_rank = b.output.numel() / world;
    int64_t offset = 0;
    for (size_t i : b.members) {
      auto& flat = flats[i];
      if (b.members.size() > 1) {
        allocate_mapped(flat.full);
        flat.full.view({world, flat.layout.shard})
            .copy_(b.output.view({world, per_rank}).narrow(1, offset, flat.layout.shard));
      }
      offset += flat.layout.shard;
      point_params_at(flat, flat.full);
      flat.gathered = true;
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
    while (next_launch < reduce_buckets.size()) {
      auto& bucket = reduce_buckets[next_launch];
      for (size_t i : bucket.members) {
        if (flats[i].ready_count < flats[i].params.size()) {
          return;
        }
      }
      launch(bucket);
      ++next_launch;
    }
  }

  // The flat buffer's gradients in one padded buffer (zeros where none
  // came); the parameters' .grad dropped.
  torch::Tensor padded_grads(FlatParam& flat) {
    auto grads = empty_mapped(flat.layout.padded, flat.options()).zero_();
    for (size_t j = 0; j < flat.params.size(); ++j) {
      auto& grad = flat.params[j].mutable_grad();
      if (grad.defined()) {
        grads.narrow(0, flat.offsets[j], grad.numel()).copy_(grad.reshape({-1}));
        grad = torch::Tensor();
      }
    }
    return grads;
  }

  // The bucket's gradients averaged into a gradient of each member's shard:
  // one reduce-scatter whose input holds, rank by rank, each member's part
  // for that rank (or one allreduce of them all, NoShard).
  void launch(Bucket& bucket) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> grads;
    int64_t per_rank = 0;
    for (size_t i : bucket.members) {
      grads.push_back(padded_grads(flats[i]));
      per_rank += flats[i].layout.shard;
    }
    const int64_t world = sharded() ? group.size() : 1;
    auto input = grads[0];
    if (grads.size() > 1) {
      input = empty_mapped(world * per_rank, grads[0].options());
      int64_t offset = 0;
      for (size_t k = 0; k < grads.size(); ++k) {
        const int64_t shard = flats[bucket.members[k]].layout.shard;
        input.view({world, per_rank}).narrow(1, offset, shard).copy_(grads[k].view({world, shard}));
        offset += shard;
      }
    }
    bucket.start_us = timeline::enabled() ? timeline::detail::now_us() : 0;
    const std::string what = (sharded() ? "reduce_scatter of " : "allreduce of ") + bucket_name(bucket.members) +
        " (" + std::to_string(input.numel()) + " elements)";
    if (sharded()) {
      bucket.output = torch::empty({per_rank}, input.options());
      bucket.work = group.reduce_scatter_async(bucket.output, input, ReduceOp::Avg, what);
    } else {
      bucket.output = input;
      bucket.work = group.allreduce_async({input}, ReduceOp::Avg, what);
    }
  }

  // Waits for the bucket and adds each member's part to its shard's .grad.
  void land(Bucket& bucket) {
    bucket.work->wait();
    if (timeline::enabled()) {
      timeline::detail::record((sharded() ? "reduce_scatter " : "allreduce ") + bucket_name(bucket.members),
                               bucket.start_us, timeline::detail::now_us(), "collectives",
                               bucket.output.numel() * bucket.output.element_size() * (sharded() ? group.size() : 1));
    }
    int64_t offset = 0;
    for (size_t i : bucket.members) {
      auto& flat = flats[i];
      auto reduced = bucket.output.narrow(0, offset, flat.layout.shard);
      offset += flat.layout.shard;
      auto& grad = flat.shard.mutable_grad();
      if (grad.defined()) {
        grad.add_(reduced);
      } else {
        grad = bucket.members.size() == 1 ? bucket.output : reduced.clone(); // no view into a shared buffer
      }
      std::fill(flat.ready.begin(), flat.ready.end(), 0);
      flat.ready_count = 0;
    }
    bucket.work.reset();
    bucket.output = torch::Tensor();
  }

  void finalize() {
    finalize_queued = false;
    forwarded = false;
    if (sync_at_forward) {
      for (; next_launch < reduce_buckets.size(); ++next_launch) {
        launch(reduce_buckets[next_launch]);
      }
      for (auto& bucket : reduce_buckets) {
        land(bucket);
      }
      next_launch = 0;
    }
    release_all();
  }
};

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
  s.plan_buckets();
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
