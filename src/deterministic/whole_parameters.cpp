// The step of a wrapper whose every rank holds the whole parameters
// (DistributedDataParallel, DataParallel) in deterministic mode: the exact
// sum of the micro-batches' gradients into each parameter's .grad (Note
// [The same bits at any world size] in micro_batch_step.cpp).

#include "deterministic/whole_parameters.h"

#include <lockstep/timeline.h>

#include "comm/collective_fingerprint.h"

#include <torch/torch.h>

#include <algorithm>

namespace lockstep {
namespace detail {

namespace {

// The strides of a contiguous tensor of `sizes`.
std::vector<int64_t> dense_strides(at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  return strides;
}

// Note [Whole gradients from a reduce-scatter]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every rank of DistributedDataParallel needs every gradient, but the int64
// sums need not travel back whole: each element's gradient depends only on
// its own integer sum and its parameter's exponent (Note [The same bits at
// any world size]), so the rank that holds an element's sum after a
// reduce-scatter computes its gradient, with the bits every rank would, and
// an all-gather hands the gradients round in the parameters' dtype. A ring
// allreduce of int64 sends 2(W-1)/W of 8 bytes per element; this sends
// (W-1)/W of 8 and then of 4 (float), three quarters of it, and each rank
// converts 1/W of the elements back. Double parameters (as many bytes
// either way, and one collective more), parameters of several dtypes, or a
// backend without these collectives take the allreduce.
void sum_by_reduce_scatter(MicroBatchStep& micro_batches, std::vector<torch::Tensor>& params,
                           const std::vector<FixedPointPiece>& pieces, int64_t total,
                           const MicroBatchGradients& gradients, const std::string& what) {
  const auto& group = micro_batches.group();
  const int64_t world = group.size(), chunk = (total + world - 1) / world, first = group.rank() * chunk;
  timeline::Span to_integers("deterministic: to integers");
  auto sum = torch::empty({chunk * world}, params[0].options().dtype(torch::kLong));
  write_fixed_point(sum, pieces, gradients); // the padding at the end is zero
  to_integers.end();
  auto mine = torch::empty({chunk}, sum.options());
  {
    timeline::Span reduce("deterministic: reduce-scatter of int64", sum.numel() * 8);
    const auto item = micro_batches.next_collective(
        {sum.numel(), sum.scalar_type(), fingerprint::kReduceScatter, current_collective_tag()});
    PlannedCollective planned(item.first, item.second); // Note [A step's planned collectives]
    group.reduce_scatter_async(mine, sum, ReduceOp::Sum, what)->wait();
  }
  auto gathered = torch::empty({chunk * world}, params[0].options());
  auto own = gathered.narrow(0, first, chunk);
  {
    timeline::Span to_floats("deterministic: back to floats");
    const int64_t used = std::clamp<int64_t>(total - first, 0, chunk); // the rest is padding
    own.narrow(0, used, chunk - used).zero_();
    for (const auto& piece : pieces) {
      const int64_t lo = std::max(piece.at, first), hi = std::min(piece.at + piece.count, first + chunk);
      if (lo < hi) {
        const FixedPointPiece part{piece.param, piece.begin + lo - piece.at, hi - lo, lo - first};
        read_fixed_point_into(own.narrow(0, part.at, part.count), mine, part, gradients);
      }
    }
  }
  {
    timeline::Span gather("deterministic: all_gather of the gradients", gathered.numel() * gathered.element_size());
    const auto item = micro_batches.next_collective(
        {own.numel(), own.scalar_type(), fingerprint::kAllGather, current_collective_tag()});
    PlannedCollective planned(item.first, item.second);
    group.all_gather_into_async(gathered, own, what + ", gathered")->wait();
  }
  for (const auto& piece : pieces) {
    // Over the gathered storage, as gradient_as_bucket_view, but not a view:
    // zero_grad()'s detach_() refuses one.
    auto& param = params[piece.param];
    param.mutable_grad() = gradients.used[piece.param]
        ? torch::empty({0}, gathered.options())
              .set_(gathered.storage(), piece.at, param.sizes(), dense_strides(param.sizes()))
        : torch::Tensor();
  }
}

bool sums_by_reduce_scatter(const ProcessGroup& group, const std::vector<torch::Tensor>& params) {
  const auto device = params.at(0).device();
  const auto dtype = params[0].scalar_type();
  const bool one_dtype = std::all_of(params.begin(), params.end(), [&](const auto& p) { return p.scalar_type() == dtype; });
  return group.size() > 1 && one_dtype && c10::elementSize(dtype) < 8 &&
         group.supports(Collective::ReduceScatter, torch::kLong, device) &&
         group.supports(Collective::AllGather, dtype, device);
}

} // namespace

double step_whole_parameters(MicroBatchStep& micro_batches, std::vector<torch::Tensor>& params, int64_t step,
                             const std::function<torch::Tensor(int64_t)>& loss_of, const std::string& who) {
  const auto gradients = micro_batches.run(step, loss_of, [&params] {
    std::vector<torch::Tensor> grads;
    for (auto& p : params) {
      grads.push_back(std::move(p.mutable_grad()));
      p.mutable_grad().reset();
    }
    return grads;
  });
  std::vector<FixedPointPiece> pieces;
  int64_t total = 0;
  for (size_t p = 0; p < params.size(); ++p) {
    pieces.push_back({p, 0, params[p].numel(), total});
    total += params[p].numel();
  }
  const auto& group = micro_batches.group();
  const std::string what = "the exact sum of step " + std::to_string(step) + "'s gradients (" + who + ")";
  if (sums_by_reduce_scatter(group, params)) { // Note [Whole gradients from a reduce-scatter]
    sum_by_reduce_scatter(micro_batches, params, pieces, total, gradients, what);
    return gradients.mean_loss;
  }
  timeline::Span to_integers("deterministic: to integers");
  auto sum = torch::empty({total}, torch::TensorOptions().dtype(torch::kLong).device(params.at(0).device()));
  write_fixed_point(sum, pieces, gradients);
  to_integers.end();
  timeline::Span allreduce("deterministic: allreduce of int64", sum.numel() * 8);
  group.allreduce_async({sum}, ReduceOp::Sum, what)->wait();
  allreduce.end();
  timeline::Span to_floats("deterministic: back to floats");
  for (const auto& piece : pieces) {
    auto& param = params[piece.param];
    param.mutable_grad() = gradients.used[piece.param]
        ? read_fixed_point(sum, piece, gradients, param.scalar_type(), param.sizes())
        : torch::Tensor();
  }
  return gradients.mean_loss;
}

} // namespace detail
} // namespace lockstep
