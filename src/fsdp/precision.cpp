// FullyShardedDataParallel's precision policy: ShardingOptions' param_dtype
// and reduce_dtype (Note [Sharded mixed precision]).

#include "fsdp/state.h"

#include <c10/core/ScalarType.h>

namespace lockstep {
namespace detail {

// Note [Sharded mixed precision]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With a param_dtype, each floating-point flat keeps its shard in the
// parameters' own dtype (fp32 master weights, which the optimizer steps),
// and its gathered buffer in param_dtype: an all-gather casts this rank's
// shard first, so it moves param_dtype's bytes (half of fp32's for bf16),
// and the module's parameters are param_dtype views of that buffer from
// forward to the end of backward. Autograd then gives their gradients in
// param_dtype; they are written into the reduce-scatter's input in
// reduce_dtype (param_dtype unless set), averaged there, and added to the
// shard's fp32 gradient. Under no_sync, where reduce_dtype is the wider
// (fp32 beside bf16), each backward's gradients are added off the
// parameters into a sum in reduce_dtype, as FSDP2 upcasts its unsharded
// gradients: autograd would add them up in param_dtype, where bf16's 8 bits
// lose every micro-batch's gradient smaller than 1/256 of the sum so far.
// summon_full_params gathers the shards as they are, in their own dtype,
// into a buffer of its own: a writeback of bf16 values
// would round the master weights. NoShard keeps the module's parameters as
// views of its fp32 "shard", so it has no gathered buffer to hold another
// dtype, and refuses a param_dtype.
//
// A BatchNorm's (or SyncBatchNorm's) parameters keep their dtype, in flats
// of their own, gathered and reduced in it under a param_dtype or a
// reduce_dtype, as PyTorch's FSDP leaves _BatchNorm out of all of its
// MixedPrecision by default (_module_classes_to_ignore): its running statistics
// are buffers, never cast, and ATen's CPU batch norm takes a bf16 or fp16
// input only beside weights in the statistics' dtype ("mixed dtype (CPU)").
// The layer's output is in its input's dtype, as under autocast.

void ShardedCore::State::set_precision(const ShardingOptions& options, const std::set<std::string>& frozen_batch_norms) {
  const auto& param = options.param_dtype();
  const auto& reduce = options.reduce_dtype();
  if (!param && !reduce) {
    return;
  }
  TORCH_CHECK(!param || c10::isFloatingType(*param), where(), "ShardingOptions().param_dtype(", *param,
              ") is not a floating-point dtype; pass torch::kBFloat16, torch::kHalf or torch::kFloat");
  TORCH_CHECK(!reduce || c10::isFloatingType(*reduce), where(), "ShardingOptions().reduce_dtype(", *reduce,
              ") is not a floating-point dtype; pass torch::kFloat, torch::kBFloat16 or torch::kHalf");
  TORCH_CHECK(sharded(), where(), "ShardingOptions().param_dtype() and reduce_dtype() need FullShard or "
              "ShardGradOp: NoShard keeps no gathered buffer to hold another dtype. Under NoShard, run forward "
              "inside a lockstep::AutocastGuard instead");
  // Frozen parameters are not sharded (Note [Frozen parameters]), so no
  // gathered buffer casts them: the module would mix them, in their own
  // dtype, with the cast inputs and trained parameters, and fail inside an
  // operator with a message that does not say why.
  for (size_t i = first_frozen; param && i < whole.size(); ++i) {
    const auto& [name, frozen] = whole[i];
    TORCH_CHECK(!c10::isFloatingType(frozen.scalar_type()) || frozen.scalar_type() == *param ||
                    frozen_batch_norms.count(name) != 0, where(),
                "parameter '", name, "' is frozen (requires_grad false) and ", frozen.scalar_type(), ", and frozen "
                "parameters are not sharded, so ShardingOptions().param_dtype(", *param, ") would not cast it: "
                "forward would mix ", frozen.scalar_type(), " and ", *param, " tensors. Cast the frozen parameters to ",
                *param, " before wrapping (they are not trained), or run forward inside a lockstep::AutocastGuard "
                "instead of param_dtype.");
  }
  for (auto& flat : flats) {
    if (!c10::isFloatingType(flat.dtype) || flat.keep_dtype) {
      continue; // integer parameters keep their dtype, as FSDP's; so do BatchNorm's
    }
    flat.compute_dtype = param.value_or(flat.dtype);
    flat.reduce_dtype = reduce.value_or(flat.compute_dtype);
    TORCH_CHECK(group.supports(Collective::AllGather, flat.compute_dtype, flat.device), where(), "the ",
                group.backend(), " backend cannot all-gather ", flat.compute_dtype, " tensors on ", flat.device,
                " (ShardingOptions().param_dtype); pick another param_dtype or backend");
    TORCH_CHECK(group.supports(Collective::ReduceScatter, flat.reduce_dtype, flat.device), where(), "the ",
                group.backend(), " backend cannot reduce-scatter ", flat.reduce_dtype, " tensors on ", flat.device,
                " (ShardingOptions().reduce_dtype, else param_dtype); set reduce_dtype(torch::kFloat)");
  }
}

// Each flat whose gathered buffer is in another dtype than its shard:
// gathered in the shard's dtype into a buffer of its own, the module's
// parameters its views, for summon_full_params.
bool ShardedCore::State::summon_in_own_dtype() {
  bool any = false;
  for (auto& flat : flats) {
    any = any || flat.compute_dtype != flat.dtype;
  }
  if (!any) {
    return false;
  }
  torch::NoGradGuard no_grad;
  for (size_t f = 0; f < flats.size(); ++f) {
    auto& flat = flats[f];
    flat.summoned = torch::empty({flat.layout.padded}, flat.options());
    group.all_gather_into_async(flat.summoned, flat.shard.detach(), "all_gather of " + bucket_name({f}) +
                                " for summon_full_params")->wait();
    for (size_t j = 0; j < flat.params.size(); ++j) {
      flat.params[j].set_data(flat.summoned.narrow(0, flat.offsets[j], flat.views[j].numel()).view(flat.views[j].sizes()));
    }
  }
  return true;
}

// Note [Dropping a no_sync accumulation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A no_sync backward leaves each parameter's whole gradient on this rank,
// for the next synced backward to reduce. In PyTorch's FSDP the optimizer
// holds the flat parameter whose .grad that is, so its zero_grad() drops
// it. Here the optimizer holds the shards, and the sum lives beside them:
// at the end of each no_sync backward it is moved off the module's
// parameters into `accumulated` (in reduce_dtype where that is wider, Note
// [Sharded mixed precision]), and the shard's .grad is given a zero tensor
// if it has none, whose identity and version counter are noted. A
// zero_grad() of the optimizer or of the wrapper, to none or to zero,
// changes one of them, and the next backward then drops the sum before it
// adds to it or reduces it. Looking at the gradients changes neither.
void ShardedCore::State::set_aside_accumulated() {
  torch::NoGradGuard no_grad;
  for (auto& flat : flats) {
    drop_accumulated_if_cleared(flat);
    const bool wider = flat.reduce_dtype != flat.compute_dtype &&
        c10::promoteTypes(flat.compute_dtype, flat.reduce_dtype) == flat.reduce_dtype;
    flat.accumulated.resize(flat.params.size());
    for (size_t j = 0; j < flat.params.size(); ++j) {
      auto& grad = flat.params[j].mutable_grad();
      if (grad.defined()) {
        auto& sum = flat.accumulated[j];
        sum = sum.defined() ? sum.add_(grad) : grad.to(wider ? flat.reduce_dtype : grad.scalar_type());
        grad = torch::Tensor();
      }
    }
    auto& shard_grad = flat.shard.mutable_grad();
    if (!shard_grad.defined()) {
      shard_grad = torch::zeros_like(flat.shard);
      flat.set_aside_made = true;
    } else if (!is_set_aside(flat, shard_grad)) {
      flat.set_aside_made = false;
    }
    flat.set_aside_beside = shard_grad.unsafeGetTensorImpl();
    flat.set_aside_version = shard_grad._version();
  }
}

void ShardedCore::State::drop_accumulated_if_cleared(FlatParam& flat) {
  if (flat.accumulated.empty() || is_set_aside(flat, flat.shard.grad())) {
    return;
  }
  flat.accumulated.clear(); // the caller cleared the gradients since
}

// Parameter j's whole gradient, taken off it: its .grad, plus what no_sync
// accumulated; undefined where neither is.
torch::Tensor ShardedCore::State::take_gradient(FlatParam& flat, size_t j) {
  auto grad = std::move(flat.params[j].mutable_grad());
  flat.params[j].mutable_grad() = torch::Tensor();
  if (j >= flat.accumulated.size() || !flat.accumulated[j].defined()) {
    return grad;
  }
  auto sum = std::move(flat.accumulated[j]);
  flat.accumulated[j] = torch::Tensor();
  return grad.defined() ? sum.add_(grad) : sum;
}

} // namespace detail

torch::Tensor detail::ShardedCore::cast_input(const torch::Tensor& input) const {
  if (!param_dtype_ || !input.defined() || !input.is_floating_point() || input.scalar_type() == *param_dtype_) {
    return input;
  }
  return input.to(*param_dtype_);
}

} // namespace lockstep
