// FullyShardedDataParallel's backward: gradients reduce-scattered into the
// shards (Note [Sharded step] in src/fsdp/forward.cpp).

#include <lockstep/timeline.h>

#include "comm/collective_check.h"
#include "fsdp/state.h"
#include "util/mapped_memory.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <cmath>

namespace lockstep {
namespace detail {

torch::autograd::variable_list ShardedCore::State::ReadyHook::operator()(
    const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& /*inputs*/) {
  if (auto state = state_.lock()) {
    Unwatched unwatched;
    state->on_ready(flat_, index_);
  }
  return outputs;
}

// Raised by the first gradient of a backward that no forward of its own
// opened: `what` received it.
void ShardedCore::State::refuse_unforwarded(const std::string& what) const {
  TORCH_CHECK(forward_dropped_by == nullptr, where(), what, " received a gradient from a forward made before ",
              forward_dropped_by, ": it may have changed the parameters, which would then take gradients computed at "
              "the old ones. Run forward again after it.");
  TORCH_CHECK(false, where(), what, " received a gradient, but no forward ran through FullyShardedDataParallel "
              "since the last backward (a second backward through a retained graph is one: each forward's "
              "gradients are reduced once). Run forward through the FullyShardedDataParallel (not its module()) "
              "before each backward, and sum the losses into one backward.");
}

// The gradient of forward's outputs comes before any parameter's: a
// backward refused here has added nothing to the parameters' gradients.
void ShardedCore::State::on_output_gradient() {
  if (!forwarded) {
    refuse_unforwarded("an output of the wrapped module");
  }
  decide_sync();
  if (sharded()) {
    begin_backward();
  }
}

// Note [no_sync at backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Whether a backward reduces is the no_sync guard's state when its first
// gradient comes, as PyTorch's FSDP reads it in its post-backward hook: a
// forward made under the guard whose backward runs after it has ended is
// reduced, with what the guard accumulated, and a backward run under the
// guard keeps its gradients, wherever its forward ran. (DDP decides at
// forward, as PyTorch's DDP does.) Deciding at forward instead left the first
// case's step with no gradient at all, without an error.
void ShardedCore::State::decide_sync() {
  if (!backward_decided) {
    backward_decided = true;
    backward_syncs = sync && !keep_grads;
  }
}

void ShardedCore::State::on_ready(size_t f, size_t j) {
  if (!forwarded) {
    refuse_unforwarded("parameter '" + flats[f].names[j] + "'");
  }
  decide_sync();
  if (!finalize_queued) {
    finalize_queued = true;
    std::weak_ptr<State> weak = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto state = weak.lock()) {
        Unwatched unwatched;
        state->finalize();
      }
    });
  }
  auto& flat = flats[f];
  if (!flat.ready[j]) {
    flat.ready[j] = 1;
    ++flat.ready_count;
  }
  if (flat.ready_count == flat.params.size() && strategy == ShardingStrategy::FullShard && pass == Pass::Backward) {
    // Its backward is over: every use of it has given its gradient. Its
    // prefetch may still be in flight, as when the first layer's backward
    // never reads its weight (its input takes no gradient). Under no_sync
    // too, as FSDP's post-backward reshards before it asks whether to reduce.
    if (flat.pending) {
      wait_in_flight(f);
    }
    release(flat, /*empty=*/false);
  }
  if (!backward_syncs) {
    return; // no_sync: the whole gradient stays in .grad
  }
  launch_ready();
}

// Buckets start in their fixed order, each once all its members' gradients
// are in. Starting one lands the one before it, as FSDP2 waits for the
// previous reduce-scatter: at most two buckets' padded gradients are alive.
void ShardedCore::State::launch_ready() {
  while (next_launch < reduce_buckets.size()) {
    auto& bucket = reduce_buckets[next_launch];
    for (size_t i : bucket.members) {
      if (flats[i].ready_count < flats[i].params.size()) {
        return;
      }
    }
    launch(bucket);
    if (next_launch > 0 && reduce_buckets[next_launch - 1].work) {
      land(reduce_buckets[next_launch - 1]);
    }
    ++next_launch;
  }
}

// Writes the flat buffer's gradients into `rows`, a [W, shard] view whose
// row r is rank r's part (zeros where no gradient came, and in the
// padding), and drops the parameters' .grad and what no_sync accumulated.
// Returns whether any parameter had a gradient (Note [Units no rank used]).
bool ShardedCore::State::write_grads(FlatParam& flat, const torch::Tensor& rows) {
  drop_accumulated_if_cleared(flat);
  const int64_t shard = flat.layout.shard;
  // Elements [begin, end) of the flat buffer, row by row: `from` (in flat
  // order from `begin`), or zeros when it is undefined.
  auto write = [&](int64_t begin, int64_t end, const torch::Tensor& from) {
    for (int64_t at = begin; at < end;) {
      const int64_t n = std::min(end - at, shard - at % shard);
      auto into = rows.select(0, at / shard).narrow(0, at % shard, n);
      if (from.defined()) {
        into.copy_(from.narrow(0, at - begin, n));
      } else {
        into.zero_();
      }
      at += n;
    }
  };
  int64_t written = 0;
  bool used = false;
  for (size_t j = 0; j < flat.params.size(); ++j) {
    const auto grad = take_gradient(flat, j);
    TORCH_CHECK(!grad.defined() || grad.layout() == torch::kStrided, where(), "parameter '", flat.names[j],
                "' received a sparse gradient, and FullyShardedDataParallel shards dense gradients only: compute "
                "it densely (an Embedding with sparse(false)).");
    used = used || grad.defined();
    const int64_t numel = flat.views[j].numel();
    write(written, flat.offsets[j], torch::Tensor());
    write(flat.offsets[j], flat.offsets[j] + numel, grad.defined() ? grad.reshape({-1}) : torch::Tensor());
    written = flat.offsets[j] + numel;
  }
  write(written, flat.layout.padded, torch::Tensor());
  return used;
}

// Note [Units no rank used]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Every bucket is reduced in every backward, so that the ranks' collectives
// match, and a unit that got no gradient on a rank sends zeros. A unit that
// no rank used in a step must still not get zeros in its shard's .grad: a
// bare model's parameter that took no gradient keeps its .grad as it was
// (undefined after LibTorch 2.x's zero_grad), and optimizers skip it, while
// zeros move it under momentum or weight decay, silently apart from the
// bare model and from DDP (Note [Unused parameters]). So each row of the
// bucket's input ends with one flag per member, 1 where this rank's
// gradients for it were defined: every row carries the same flags, so every
// rank's part of the average holds, per member, the share of ranks that
// used it, and a member whose share is 0 leaves its shard's .grad as it was:
// a defined one adds exact zeros, and one that land() had to create is
// dropped again at the end of backward, where one look at all the flags
// decides (a device's flags reach the host once a backward, after its work
// is queued).
// Within a unit that some rank used, a parameter no rank used gets zeros,
// as in PyTorch's FSDP: the flat buffer has one gradient.

// The bucket's gradients averaged into a gradient of each member's shard:
// one reduce-scatter whose input holds, rank by rank, each member's part
// for that rank (or one allreduce of them all, NoShard).
void ShardedCore::State::launch(Bucket& bucket) {
  torch::NoGradGuard no_grad;
  const auto members = static_cast<int64_t>(bucket.members.size());
  int64_t per_rank = members; // Note [Units no rank used]: the flags
  for (size_t i : bucket.members) {
    per_rank += flats[i].layout.shard;
  }
  const int64_t world = sharded() ? group.size() : 1;
  const auto& first = flats[bucket.members[0]];
  auto input = empty_mapped(world * per_rank, first.options().dtype(first.reduce_dtype)); // Note [Sharded mixed precision]
  auto rows = input.view({world, per_rank});
  int64_t offset = 0;
  std::vector<double> used;
  for (size_t i : bucket.members) {
    used.push_back(write_grads(flats[i], rows.narrow(1, offset, flats[i].layout.shard)) ? 1.0 : 0.0);
    offset += flats[i].layout.shard;
  }
  for (int64_t m = 0; m < members; ++m) { // fills: a copy from a CPU tensor would wait for a GPU's stream
    rows.select(1, offset + m).fill_(used[static_cast<size_t>(m)]);
  }
  bucket.span = timeline::Span([&] { return (sharded() ? "reduce_scatter " : "allreduce ") + bucket_name(bucket.members); },
                               -1, "collectives");
  const std::string what = (sharded() ? "reduce_scatter of " : "allreduce of ") + bucket_name(bucket.members) +
      " (" + std::to_string(input.numel()) + " elements)";
  const int64_t tag_number = model_tag(model, 1 + (&bucket - reduce_buckets.data()));
  CollectiveTag tag(tag_number); // Note [Collective tags]
  if (sharded()) {
    bucket.output = torch::empty({per_rank}, input.options());
    const auto item = plan.next({input.numel(), input.scalar_type(), fingerprint::kReduceScatter, tag_number});
    PlannedCollective planned(item.first, item.second); // Note [Planned rings]
    bucket.work = group.reduce_scatter_async(bucket.output, input, ReduceOp::Avg, what);
  } else {
    bucket.output = input;
    bucket.work = group.allreduce_async({input}, ReduceOp::Avg, what);
  }
}

namespace {

// The first `numel` elements of `t`'s storage as a tensor of their own, not
// a view: a .grad that is a view refuses zero_grad()'s detach_().
torch::Tensor storage_prefix(const torch::Tensor& t, int64_t numel) {
  return torch::empty({0}, t.options()).set_(t.storage(), 0, {numel}, {1});
}

} // namespace

// Waits for the bucket and adds each member's part to its shard's .grad.
void ShardedCore::State::land(Bucket& bucket) {
  bucket.work->wait();
  bucket.span.set_bytes(bucket.output.numel() * bucket.output.element_size() * (sharded() ? group.size() : 1));
  bucket.span.end();
  const auto members = static_cast<int64_t>(bucket.members.size());
  // Note [Units no rank used]: the members' flags follow their gradients.
  const auto shares = bucket.output.narrow(0, bucket.output.numel() - members, members);
  int64_t offset = 0;
  for (int64_t m = 0; m < members; ++m) {
    auto& flat = flats[bucket.members[m]];
    auto reduced = bucket.output.narrow(0, offset, flat.layout.shard);
    offset += flat.layout.shard;
    std::fill(flat.ready.begin(), flat.ready.end(), 0);
    flat.ready_count = 0;
    auto& grad = flat.shard.mutable_grad();
    if (grad.defined()) {
      if (flat.set_aside_made && is_set_aside(flat, grad)) {
        fresh_grads.emplace_back(bucket.members[m], shares.narrow(0, m, 1).clone()); // no_sync's zeros
      }
      flat.set_aside_made = false;
      grad.add_(reduced); // zeros where no rank used it: .grad as it was
    } else {
      if (reduced.scalar_type() != flat.dtype) {
        grad = reduced.to(flat.dtype); // Note [Sharded mixed precision]
      } else {
        grad = members == 1 ? storage_prefix(bucket.output, flat.layout.shard) : reduced.clone();
      }
      fresh_grads.emplace_back(bucket.members[m], shares.narrow(0, m, 1).clone()); // not the whole buffer
    }
  }
  bucket.work.reset();
  bucket.output = torch::Tensor();
}

// Note [Units no rank used]: a .grad that land() created for a member no
// rank used goes back to undefined.
void ShardedCore::State::drop_unused_fresh_grads() {
  if (fresh_grads.empty()) {
    return;
  }
  std::vector<torch::Tensor> shares;
  for (const auto& entry : fresh_grads) {
    shares.push_back(entry.second);
  }
  const auto used = torch::cat(shares).to(torch::kCPU, torch::kDouble);
  for (size_t k = 0; k < fresh_grads.size(); ++k) {
    if (used[static_cast<int64_t>(k)].item<double>() == 0.0) {
      flats[fresh_grads[k].first].shard.mutable_grad() = torch::Tensor();
    }
  }
  fresh_grads.clear();
}

void ShardedCore::State::finalize() {
  finalize_queued = false;
  forwarded = false;
  backward_decided = false;
  if (backward_syncs) {
    for (; next_launch < reduce_buckets.size(); ++next_launch) {
      launch(reduce_buckets[next_launch]);
    }
    for (auto& bucket : reduce_buckets) {
      if (bucket.work) {
        land(bucket);
      }
    }
    drop_unused_fresh_grads();
    next_launch = 0;
  } else {
    for (auto& flat : flats) { // land() does it for a backward that reduces
      std::fill(flat.ready.begin(), flat.ready.end(), 0);
      flat.ready_count = 0;
    }
    if (!keep_grads) {
      set_aside_accumulated();
    }
  }
  end_pass();
}

} // namespace detail

// Note [Clipping sharded gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each rank holds a slice of the model's gradient, so a norm over
// parameters() is a norm of that slice: clipping by it scales each rank's
// slice by its own factor, and the model's parameters drift from any
// single-process run without an error. As FSDP1's clip_grad_norm_, each
// rank sums |g|^p over its shards (their padding's gradient is zero), one
// allreduce adds the sums (takes the max, for the inf-norm) and every rank
// scales by the same max_norm / (norm + 1e-6), capped at 1. NoShard's
// "shards" hold the whole averaged gradient on every rank: its local norm
// is already the model's.
torch::Tensor detail::ShardedCore::clip_grad_norm_(double max_norm, double norm_type) {
  TORCH_CHECK(norm_type > 0, "lockstep::FullyShardedDataParallel::clip_grad_norm_: rank ", group_.rank(),
              ": norm_type ", norm_type, " is not a norm; pass 2.0 (the default), 1.0, or "
              "std::numeric_limits<double>::infinity()");
  // A negative max_norm would flip every gradient's sign (the factor below
  // is max_norm / norm), and NaN would make every gradient NaN after the
  // loss scaler's check. Infinity clips nothing: the norm alone, as in
  // PyTorch.
  TORCH_CHECK(!std::isnan(max_norm) && max_norm >= 0, "lockstep::FullyShardedDataParallel::clip_grad_norm_: rank ",
              group_.rank(), ": max_norm ", max_norm, " is not a largest norm; pass a number >= 0, or infinity to "
              "read the norm without clipping.");
  CollectiveTag tag(model_tag(state_->model, 0)); // Note [Collective tags]: two models' norms never swap
  if (state_->micro_batches) {
    return state_->exact_clip_grad_norm_(max_norm, norm_type);
  }
  const bool largest = std::isinf(norm_type);
  std::vector<torch::Tensor> grads;
  torch::Device device = torch::kCPU;
  auto dtype = torch::kFloat; // as PyTorch's, the norm in double for double gradients (1e20 squared is past float)
  for (auto* flat : flats()) {
    device = flat->device;
    if (flat->shard.scalar_type() == torch::kDouble) {
      dtype = torch::kDouble; // from the flats, not the gradients: every rank picks the same
    }
    if (flat->shard.grad().defined()) {
      grads.push_back(flat->shard.grad());
    }
  }
  torch::NoGradGuard no_grad;
  auto local = torch::zeros({1}, torch::TensorOptions().dtype(dtype).device(device));
  for (const auto& g : grads) {
    if (g.numel() > 0) {
      auto magnitude = g.detach().to(local.options()).abs();
      local = largest ? torch::maximum(local, magnitude.max()) : local + magnitude.pow(norm_type).sum();
    }
  }
  if (sharded()) {
    group_.allreduce_async({local}, largest ? ReduceOp::Max : ReduceOp::Sum, "clip_grad_norm_'s allreduce of the "
                           "shards' gradient norms")->wait();
  }
  auto total = largest ? local : local.pow(1.0 / norm_type);
  auto scale = (max_norm / (total + 1e-6)).clamp_max(1.0);
  for (auto& g : grads) {
    g.mul_(scale.to(g.options()));
  }
  return total.squeeze(0);
}

} // namespace lockstep
