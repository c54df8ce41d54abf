// FullyShardedDataParallel's deterministic mode: this rank's micro-batches
// run alone, each a forward and backward with its gradients left on the
// module's parameters, and one int64 reduce-scatter sums them exactly into
// the shards (Note [The same bits at any world size] in
// src/deterministic/micro_batch_step.cpp, Note [Sharded exact sums] below).

#include <lockstep/sharding_options.h>
#include <lockstep/timeline.h>

#include "comm/collective_fingerprint.h"
#include "fsdp/state.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>

namespace lockstep {
namespace detail {

// Note [Sharded exact sums]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Each micro-batch computes the same gradient of each parameter as under
// DistributedDataParallel: forward and backward see the whole parameters
// (gathered copies, the same bits), at the micro-batch's shape. The int64
// sum of a parameter's elements scaled by its own exponent is then the same
// integers as DDP's, whatever ranks hold which elements, and so is the
// gradient read back from them: reading is element by element. The buffer
// the ranks reduce is laid out as the reduce-scatters of an ordinary step,
// [W, the flats' shards] (one row for NoShard), so that one reduce-scatter
// (an allreduce where the backend has no int64 reduce-scatter, or for
// NoShard) leaves each rank the integers of its own shards. What follows is
// elementwise too: an optimizer's step on a shard gives each element the bits
// the whole parameter's step gives it, and clip_grad_norm_ gathers the whole
// gradient, so its norm is torch::nn::utils::clip_grad_norm_'s over the
// parameters in the module's order.

void ShardedCore::make_deterministic(torch::nn::Module& module, const ShardingOptions& options) {
  auto& s = *state_;
  const std::string where = "lockstep::FullyShardedDataParallel (deterministic, rank " +
      std::to_string(s.group.rank()) + " of " + std::to_string(s.group.size()) + "): ";
  TORCH_INTERNAL_ASSERT(!s.flats.empty(), "the constructor refuses a module with no parameter to train");
  MicroBatchConfig config;
  config.micro_batches = options.micro_batches();
  config.micro_batch_size = options.micro_batch_size();
  config.seed = options.seed();
  s.micro_batches = std::make_unique<MicroBatchStep>(module, s.group, config, s.flats.front().device, where);
  std::map<std::string, std::pair<size_t, size_t>> by_name;
  for (size_t f = 0; f < s.flats.size(); ++f) {
    for (size_t j = 0; j < s.flats[f].names.size(); ++j) {
      by_name[s.flats[f].names[j]] = {f, j};
    }
  }
  for (const auto& named : module.named_parameters(/*recurse=*/true)) {
    const auto found = by_name.find(named.key());
    if (found != by_name.end()) {
      s.module_order.push_back(found->second);
      by_name.erase(found); // a parameter shared under two names counts once, at its first
    }
  }
  TORCH_INTERNAL_ASSERT(by_name.empty(), where, "parameter '", by_name.begin()->first, "' is in no flat's module order.");
}

double ShardedCore::backward_micro_batches(int64_t step, const std::function<torch::Tensor(int64_t)>& loss_of) {
  auto& s = *state_;
  TORCH_CHECK(s.micro_batches != nullptr, s.where(), "backward_micro_batches needs "
              "ShardingOptions().deterministic(true).micro_batches(V); this wrapper reduces in backward.");
  TORCH_CHECK(!s.summoned, s.where(), "backward_micro_batches inside summon_full_params(). End the guard first.");
  s.check_still_frozen_or_trained();
  CollectiveTag tag(model_tag(s.model, 0)); // Note [Collective tags]: the step's own; each gather has its bucket's
  struct KeepGrads {
    bool& keep;
    ~KeepGrads() {
      keep = false;
    }
  } keep{s.keep_grads};
  s.keep_grads = true;
  const auto gradients = s.micro_batches->run(step, loss_of, [&s] { return s.take_micro_batch_gradients(); });
  s.keep_grads = false;
  s.reduce_exactly(step, gradients);
  return gradients.mean_loss;
}

// Every flat's parameters' gradients, flat after flat, taken off them.
std::vector<torch::Tensor> ShardedCore::State::take_micro_batch_gradients() {
  std::vector<torch::Tensor> grads;
  for (auto& flat : flats) {
    for (auto& param : flat.params) {
      grads.push_back(std::move(param.mutable_grad()));
      param.mutable_grad().reset();
    }
  }
  return grads;
}

namespace {

// Every parameter's gradient in pieces that each lie in one rank's shard of
// its flat, each placed in the int64 buffer [W, the flats' shards], with
// the flat it belongs to, and the buffer's row length.
struct ShardedPieces {
  std::vector<FixedPointPiece> pieces;
  std::vector<size_t> flat_of;
  int64_t per_rank = 0;
};

ShardedPieces pieces_by_shard(const std::vector<FlatParam>& flats) {
  ShardedPieces out;
  for (const auto& flat : flats) {
    out.per_rank += flat.layout.shard;
  }
  size_t param = 0;
  int64_t column = 0; // the flat's first column in a row
  for (size_t f = 0; f < flats.size(); ++f) {
    const auto& flat = flats[f];
    const int64_t shard = flat.layout.shard;
    for (size_t j = 0; j < flat.params.size(); ++j, ++param) {
      const int64_t begin = flat.offsets[j], end = begin + flat.views[j].numel();
      for (int64_t at = begin; at < end;) {
        const int64_t n = std::min(end - at, shard - at % shard);
        out.pieces.push_back({param, at - begin, n, (at / shard) * out.per_rank + column + at % shard});
        out.flat_of.push_back(f);
        at += n;
      }
    }
    column += shard;
  }
  return out;
}

} // namespace

// Note [Sharded exact sums]: the int64 buffer [W, the flats' shards], this
// rank's row of it after the reduction, and each shard's .grad from it.
void ShardedCore::State::reduce_exactly(int64_t step, const MicroBatchGradients& gradients) {
  timeline::Span to_integers("deterministic: to integers");
  const int64_t world = sharded() ? group.size() : 1;
  const auto [pieces, piece_flat, per_rank] = pieces_by_shard(flats);
  const auto device = flats.front().device;
  auto sum = torch::empty({world * per_rank}, torch::TensorOptions().dtype(torch::kLong).device(device));
  write_fixed_point(sum, pieces, gradients);
  to_integers.end();
  const std::string what = "the exact sum of step " + std::to_string(step) + "'s gradients (deterministic "
      "FullyShardedDataParallel, " + std::to_string(sum.numel()) + " int64 elements)";
  const int64_t row = sharded() ? group.rank() : 0;
  torch::Tensor mine;
  {
    timeline::Span reduce("deterministic: reduce-scatter of int64", sum.numel() * 8);
    if (world > 1 && group.supports(Collective::ReduceScatter, torch::kLong, device)) {
      mine = torch::empty({per_rank}, sum.options());
      const auto item = micro_batches->next_collective(
          {sum.numel(), sum.scalar_type(), fingerprint::kReduceScatter, current_collective_tag()});
      PlannedCollective planned(item.first, item.second); // Note [A step's planned collectives]
      group.reduce_scatter_async(mine, sum, ReduceOp::Sum, what)->wait();
    } else {
      group.allreduce_async({sum}, ReduceOp::Sum, what)->wait();
      mine = sum.narrow(0, row * per_rank, per_rank);
    }
  }
  timeline::Span to_floats("deterministic: back to floats");
  std::vector<int64_t> first_column; // each flat's in a row
  int64_t column = 0;
  for (auto& flat : flats) {
    flat.shard.mutable_grad() = torch::zeros_like(flat.shard); // the padding's gradient is zero
    first_column.push_back(column);
    column += flat.layout.shard;
  }
  for (size_t k = 0; k < pieces.size(); ++k) {
    auto piece = pieces[k];
    if (piece.at / per_rank != row) {
      continue;
    }
    piece.at -= row * per_rank;
    auto& flat = flats[piece_flat[k]];
    read_fixed_point_into(flat.shard.mutable_grad().narrow(0, piece.at - first_column[piece_flat[k]], piece.count),
                          mine, piece, gradients);
  }
}

// Note [Sharded exact sums]: the whole gradient, gathered, and
// torch::nn::utils::clip_grad_norm_'s norm of it; every shard scaled by the
// factor that function scales by.
torch::Tensor ShardedCore::State::exact_clip_grad_norm_(double max_norm, double norm_type) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> wholes;
  for (auto& flat : flats) {
    TORCH_CHECK(flat.shard.grad().defined(), where(), "clip_grad_norm_ before backward_micro_batches: the shards "
                "have no gradient to clip.");
    auto grad = flat.shard.grad();
    wholes.push_back(sharded() ? torch::cat(group.all_gather(grad)) : grad);
  }
  std::vector<torch::Tensor> holders; // one per parameter, in the module's order, holding its whole gradient
  for (const auto& [f, j] : module_order) {
    const auto& flat = flats[f];
    auto holder = torch::empty({0}, flat.options());
    holder.mutable_grad() = wholes[f].narrow(0, flat.offsets[j], flat.views[j].numel()).view(flat.shapes[j]).clone();
    holders.push_back(holder);
  }
  const double total = torch::nn::utils::clip_grad_norm_(holders, max_norm, norm_type);
  // torch::nn::utils::clip_grad_norm_'s factor, from its norm in the gradients' dtype.
  auto norm = torch::scalar_tensor(total, holders.front().grad().options());
  auto factor = torch::clamp_max(max_norm / (norm + 1e-6), 1.0);
  for (auto& flat : flats) {
    flat.shard.mutable_grad().mul_(factor);
  }
  return norm;
}

} // namespace detail
} // namespace lockstep
