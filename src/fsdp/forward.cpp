#include <lockstep/fully_sharded_data_parallel.h>

#include "comm/collective_check.h"
#include "fsdp/state.h"
#include "fsdp/storage_watch.h"
#include "util/mapped_memory.h"
#include "util/torch_compat.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <c10/core/StorageImpl.h>

#include <algorithm>

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
//  - forward: the module's parameters are views of their units' buffers,
//    whose memory is released. The first operator that reads a unit's
//    parameters gathers it (Note [Watching storages]): its all-gather waited
//    for, the next unit's all-gather started, so that it moves while this
//    unit computes, and the unit before it freed. At most two units are
//    gathered at a time, and the root, whose parameters run around the
//    units (an embedding, a head), stays gathered. The order is the flats'
//    in the first forward, then the order the last forward used them in.
//  - after forward, every unit is freed but the root and the bucket forward
//    ended in, which backward reads first (a unit's StorageImpl stays, so
//    autograd's saved views of it are filled again in place);
//  - in backward, the first operator that reads a unit's saved parameters
//    waits for it and starts the all-gather of the unit before it, unless
//    the last backward never read that one (a first layer, whose input
//    takes no gradient, needs only its input to compute its gradients);
//  - once every parameter of a flat buffer has its gradient (autograd ran
//    every use of it), its buffer is freed; once its whole bucket has its
//    gradients, they are written, rank by rank and padded with zeros, into
//    one buffer (the parameters' .grad dropped) and reduce-scattered,
//    averaged, into a gradient of each shard. Buckets start in a fixed order, the reverse of the
//    units', so that every rank starts the same collectives in the same
//    order; one whose gradients are not all there holds back the ones after
//    it until the end of backward, where what never came is zero. That
//    holds while every rank gives the same parameters gradients: one that
//    gets a gradient on some ranks only (a head whose loss a rank skips)
//    starts its bucket mid-backward there and at the end elsewhere, against
//    backward's all-gathers: a desync (docs/troubleshooting.md). Starting
//    a reduce-scatter lands the one before it, so two buckets' gradients at
//    most are in flight.
//  - at the end of backward, the shards' .grad have the results (added to
//    what is there, as autograd accumulates), and every buffer is released:
//    the module's parameters become empty tensors, so that nothing reads
//    values the optimizer step is about to make stale.
// Every rank runs the same operators, so every rank gathers, prefetches and
// frees the same units in the same order. ShardGradOp starts every unit's
// all-gather when forward starts and frees nothing until the end of
// backward (operators still wait for the unit they read), and keeps its
// buffers' memory from step to step (ZeRO-2: parameters whole), though its
// module's parameters are empty outside forward and backward too. NoShard
// keeps the whole flat buffer as the "shard" on every rank, the module's
// parameters as views of it, and averages gradients with an allreduce.

namespace {

void release_storage(const torch::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

} // namespace

std::string ShardedCore::State::bucket_name(const std::vector<size_t>& members) const {
  const std::string first = shard_name(flats[members.front()]);
  return members.size() == 1 ? first
                             : std::to_string(members.size()) + " units (" + first + " to " +
          shard_name(flats[members.back()]) + ")";
}

// set_data keeps each parameter's TensorImpl, so the module's own members
// and autograd's edges see the views.
void ShardedCore::State::point_params_at_views(FlatParam& flat) {
  for (size_t j = 0; j < flat.params.size(); ++j) {
    flat.params[j].set_data(flat.views[j]);
  }
}

// Starts the all-gather of gather bucket g's members that are neither
// gathered nor in flight.
void ShardedCore::State::start_bucket(size_t g) {
  Bucket b;
  for (size_t i : gather_buckets[g]) {
    if (!flats[i].gathered && !flats[i].pending) {
      b.members.push_back(i);
      flats[i].pending = true;
    }
  }
  if (b.members.empty()) {
    return;
  }
  b.span = timeline::Span([&] { return "all_gather " + bucket_name(b.members); }, -1, "collectives");
  start_gather(b);
  in_flight.push_back(std::move(b));
}

// One all-gather: straight into the flat's own buffer when it is alone,
// else into one buffer holding each rank's shards one after another. This
// rank's shards are copied (cast to the gathered dtype: Note [Sharded mixed
// precision]) into its own part of that buffer, and the all-gather sends
// them from there, in place: no buffer of their own to fill and copy again.
void ShardedCore::State::start_gather(Bucket& b) {
  torch::NoGradGuard no_grad;
  int64_t per_rank = 0;
  for (size_t i : b.members) {
    per_rank += flats[i].layout.shard;
  }
  const auto& first = flats[b.members[0]];
  if (b.members.size() == 1) {
    allocate_mapped(first.full);
    b.output = first.full;
  } else {
    b.output = empty_mapped(per_rank * group.size(), first.options().dtype(first.compute_dtype));
  }
  auto mine = b.output.narrow(0, group.rank() * per_rank, per_rank);
  int64_t offset = 0;
  for (size_t i : b.members) {
    mine.narrow(0, offset, flats[i].layout.shard).copy_(flats[i].shard.detach());
    offset += flats[i].layout.shard;
  }
  const int64_t tag_number = model_tag(model, 1 + static_cast<int64_t>(bucket_of[b.members[0]]));
  CollectiveTag tag(tag_number); // Note [Collective tags]
  // Note [Planned rings]: backward's gathers only; forward's keep the check.
  const auto item = pass == Pass::Backward
      ? plan.next({mine.numel(), mine.scalar_type(), fingerprint::kAllGather, tag_number})
      : std::make_pair(int64_t{-1}, int64_t{0});
  PlannedCollective planned(item.first, item.second);
  b.work = group.all_gather_into_async(b.output, mine, "all_gather of " + bucket_name(b.members) + " (" +
                                       std::to_string(b.output.numel()) + " elements)");
}

// Waits for the all-gathers in flight, in the order they started, up to the
// one holding `flat` (all of them for kNone).
void ShardedCore::State::wait_in_flight(size_t flat) {
  while (!in_flight.empty()) {
    Bucket b = std::move(in_flight.front());
    in_flight.pop_front();
    b.work->wait();
    b.span.set_bytes(b.output.numel() * b.output.element_size());
    b.span.end();
    unpack_gathered(b);
    if (std::find(b.members.begin(), b.members.end(), flat) != b.members.end()) {
      return;
    }
  }
}

// Each member's part of every rank's shards copied into its own buffer.
void ShardedCore::State::unpack_gathered(const Bucket& b) {
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
    point_params_at_views(flat);
    flat.pending = false;
    flat.gathered = true;
  }
}

void ShardedCore::State::ensure_gathered(size_t f) {
  if (flats[f].gathered) {
    return;
  }
  if (!flats[f].pending) {
    start_bucket(bucket_of[f]);
  }
  wait_in_flight(f);
}

// Every sharded flat buffer gathered: all started, then waited in order.
void ShardedCore::State::gather_all() {
  if (!sharded()) {
    return;
  }
  for (size_t g = 0; g < gather_buckets.size(); ++g) {
    start_bucket(g);
  }
  wait_in_flight();
}

// The flat buffer's storage released, and with `empty` its parameters
// made empty tensors (outside forward and backward, so that nothing reads
// values the optimizer step is about to make stale).
// ShardGradOp keeps the buffer's memory for the next gather (ZeRO-2 keeps
// parameters whole; refilling fresh pages every step cost a third of the
// MLP's step), but its parameters still become empty.
void ShardedCore::State::release(FlatParam& flat, bool empty) {
  if (!sharded()) {
    return;
  }
  TORCH_INTERNAL_ASSERT(!flat.pending, "releasing a flat parameter whose all-gather is in flight");
  if (empty) {
    flat.rest_versions.clear();
    for (auto& p : flat.params) {
      p.set_data(torch::empty({0}, flat.options().dtype(flat.compute_dtype)));
      if (!p.grad().defined()) {
        p.mutable_grad() = torch::empty({0}, p.options()); // Note [Edits outside summon_full_params]
      }
      flat.rest_versions.push_back(p._version());
    }
    flat.resting = true;
  }
  if (strategy == ShardingStrategy::FullShard) {
    release_storage(flat.full);
  }
  flat.gathered = false;
}

void ShardedCore::State::release_all() {
  wait_in_flight();
  for (auto& flat : flats) {
    release(flat, /*empty=*/true);
  }
}

// FullShard's forward frees each unit an operator used once an operator
// reads another: at most that unit and the next one's prefetch are
// gathered (and the root, which stays for backward). The bucket forward
// is expected to end in stays whole: backward reads it first.
void ShardedCore::State::release_used(const std::vector<size_t>& touched) {
  const size_t last = last_order.empty() ? gather_buckets.size() - 1 : last_order.back();
  for (size_t i = 0; i < flats.size(); ++i) {
    auto& flat = flats[i];
    if (flat.used && flat.gathered && !flat.unit.empty() && bucket_of[i] != last &&
        std::find(touched.begin(), touched.end(), i) == touched.end()) {
      release(flat, /*empty=*/false);
    }
  }
}

// The gather bucket expected after g in forward: the last forward's order,
// or the flats' own before any forward ran.
size_t ShardedCore::State::forward_after(size_t g) const {
  if (last_order.empty()) {
    return g + 1 < gather_buckets.size() ? g + 1 : kNone;
  }
  auto it = std::find(last_order.begin(), last_order.end(), g);
  return (it == last_order.end() || it + 1 == last_order.end()) ? kNone : *(it + 1);
}

// The gather bucket expected after g in backward: this forward's order,
// reversed.
size_t ShardedCore::State::backward_after(size_t g) const {
  auto it = std::find(order.begin(), order.end(), g);
  return (it == order.end() || it == order.begin()) ? kNone : *(it - 1);
}

// Note [Watching storages]: an operator is about to read these flats.
void ShardedCore::State::on_touch(const std::vector<size_t>& touched) {
  for (size_t f : touched) {
    ensure_gathered(f);
  }
  const size_t g = bucket_of[touched.back()];
  size_t next = kNone;
  if (pass == Pass::Forward) {
    if (std::find(order.begin(), order.end(), g) == order.end()) {
      order.push_back(g);
    }
    if (strategy == ShardingStrategy::FullShard && reshard_after_forward) {
      release_used(touched);
    }
    for (size_t f : touched) {
      flats[f].used = true;
    }
    next = forward_after(g);
  } else if (pass == Pass::Backward) {
    backward_reads[g] = 1;
    next = backward_after(g);
    if (next != kNone && !last_backward_reads[next]) {
      next = kNone; // the last backward never read it (a first layer, whose input takes no gradient)
    }
  }
  if (next != kNone) {
    start_bucket(next);
  }
}

// Note [A sharded step's memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A sharded step allocates and frees megabytes that DDP keeps from step to
// step: the gathers' inputs, the reduce-scatters' outputs, the shards'
// gradients, autograd's gradients of units it then frees. Through glibc,
// whose arenas hand their free tops back to the kernel, each step faulted
// in fresh pages again (about 700 a step per rank on the deep model, where
// DDP takes none). So, from forward to the end of backward, the thread that
// runs them allocates large blocks from the cache that DataParallel's CPU
// replicas use (Note [CPU replicas' memory] in src/util/cpu_cache.cpp), which
// keeps them for the next step within twice the most it had live. A pass
// that ends on another thread (a backward called elsewhere) leaves the
// forward's thread caching until the model is gone, when the cache closes.
void ShardedCore::State::cache_thread_allocations(bool on) {
  if (!cache_user) {
    return;
  }
  if (on && cached_thread == std::thread::id()) {
    cached_thread = std::this_thread::get_id();
    thread_cached_before = set_thread_cache(true);
  } else if (!on && cached_thread == std::this_thread::get_id()) {
    set_thread_cache(thread_cached_before);
    cached_thread = std::thread::id();
  }
}

void ShardedCore::State::begin_forward() {
  if (!watched_pass) {
    begin_pass();
    watched_pass = true;
  }
  cache_thread_allocations(true);
  pass = Pass::Forward;
  order.clear();
  for (auto& flat : flats) {
    flat.used = false;
    point_params_at_views(flat); // released storage: the first operator to read one gathers it
  }
  if (strategy == ShardingStrategy::FullShard) {
    start_bucket(last_order.empty() ? 0 : last_order.front());
    return;
  }
  // ShardGradOp holds every unit until the end of backward anyway: all its
  // all-gathers start now, in the order forward will read them, so the
  // group's thread never waits for forward to ask for the next.
  for (size_t i = 0; i < gather_buckets.size(); ++i) {
    start_bucket(last_order.empty() || i >= last_order.size() ? i : last_order[i]);
  }
}

// The first gradient of the outputs: backward's first unit is forward's
// last. A backward that no open pass watches (called on another thread, or
// a second one through a retained graph) cannot gather on demand, so
// everything is gathered now.
void ShardedCore::State::begin_backward() {
  if (pass == Pass::Backward) {
    return;
  }
  const bool watched = pass == Pass::AfterForward && watching();
  pass = Pass::Backward;
  if (!flats.empty()) {
    plan.start_iteration(group, flats.front().device); // Note [Planned rings]: a backward's collectives
  }
  if (!watched) {
    gather_all();
  } else if (!order.empty()) {
    start_bucket(order.back());
  }
}

void ShardedCore::State::end_pass() {
  if (pass == Pass::Backward) {
    last_backward_reads = backward_reads;
    std::fill(backward_reads.begin(), backward_reads.end(), 0);
  }
  release_all();
  cache_thread_allocations(false);
  pass = Pass::None;
  if (watched_pass) {
    watched_pass = false;
    detail::end_pass();
  }
}

void ShardedCore::before_forward(int64_t batch) {
  auto& s = *state_;
  TORCH_CHECK(!s.summoned, s.where(), "forward inside summon_full_params(). End the guard first.");
  if (s.micro_batches) {
    TORCH_CHECK(s.sync, s.where(), "no_sync() has no use in deterministic mode, where backward_micro_batches "
                "accumulates a step's micro-batches itself.");
    s.micro_batches->check_forward(batch);
  }
  // The callback that ends a backward is queued by its first hook; an
  // exception inside backward drops it, and with it the reduce-scatters.
  TORCH_CHECK(!s.finalize_queued, s.where(), "the last backward stopped with an error before its end, so its "
              "gradients never reached the shards, and some of its collectives may have reached the other ranks and "
              "some not. This FullyShardedDataParallel cannot go on from there: let the error end the job (the "
              "launcher restarts it from the last checkpoint), or make a new one on every rank.");
  s.check_untouched_at_rest();
  if (s.sharded()) {
    Unwatched unwatched;
    if (s.forwarded) {
      s.forget_gathered(); // Note [A forward without its backward] in src/fsdp/summon.cpp
    }
    s.begin_forward();
  }
}

void ShardedCore::State::drop_forward(const char* load) {
  if (!forwarded) {
    return;
  }
  Unwatched unwatched;
  if (sharded()) {
    forget_gathered();
  }
  forwarded = false;
  forward_dropped_by = load;
}

void ShardedCore::after_forward(const std::vector<torch::Tensor>& outputs) {
  auto& s = *state_;
  Unwatched unwatched;
  s.wait_in_flight(); // a prefetch that no operator used
  s.last_order = s.order;
  std::vector<torch::Tensor> hooked;
  for (const auto& out : outputs) {
    if (out.defined() && out.requires_grad()) {
      hooked.push_back(out);
    }
  }
  if (hooked.empty() && !s.forwarded) {
    s.end_pass(); // no backward follows
    return;
  }
  // A forward without autograd (a target under NoGradGuard) while an
  // earlier forward's backward is still to come leaves the units as that
  // forward did: its backward reads them, and reduces as it was set to.
  if (!hooked.empty()) {
    s.backward_decided = false; // Note [no_sync at backward]
    s.forwarded = true;
    s.forward_dropped_by = nullptr;
  }
  std::weak_ptr<State> weak = state_;
  for (auto& out : hooked) {
    out.register_hook([weak](const torch::Tensor& grad) {
      if (auto state = weak.lock()) {
        Unwatched unwatched;
        state->on_output_gradient();
      }
      return grad;
    });
  }
  if (!s.sharded()) {
    return;
  }
  s.pass = State::Pass::AfterForward;
  if (s.strategy == ShardingStrategy::FullShard && s.reshard_after_forward) {
    // Forward's last unit stays: backward reads it first.
    const size_t last = s.order.empty() ? State::kNone : s.order.back();
    for (size_t i = 0; i < s.flats.size(); ++i) {
      if (!s.flats[i].unit.empty() && s.bucket_of[i] != last) {
        s.release(s.flats[i], /*empty=*/false); // the next operator to read it gathers it again
      }
    }
  }
}

} // namespace detail
} // namespace lockstep
