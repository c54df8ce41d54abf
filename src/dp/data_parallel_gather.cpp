// Stage 4 of Note [DataParallel step]: the replicas' outputs made one on
// the output device, with what backward needs to split the gradient again.

#include <lockstep/data_parallel.h>

#include <ATen/WrapDimUtils.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>

namespace lockstep {
namespace detail {
namespace {

bool is_differentiable(const torch::Tensor& t) {
  return at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type());
}

// Replica outputs of one flat position, moved to `device` and made one.
torch::Tensor gather_one(
    std::vector<torch::Tensor>& parts,
    torch::Device device,
    int64_t dim,
    ScalarGather scalars,
    const std::vector<double>& shares,
    OutputSpec& spec) {
  torch::NoGradGuard no_grad;
  for (auto& p : parts) {
    p = p.to(device);
  }
  torch::Tensor gathered;
  if (parts[0].dim() > 0) {
    TORCH_CHECK(dim >= -parts[0].dim() && dim < parts[0].dim(), "lockstep::DataParallel: DataParallelOptions::dim is ",
                dim, ", but a replica's output has ", parts[0].dim(), " dimension(s) (sizes ", parts[0].sizes(), "), "
                "and outputs are concatenated along dim. Return outputs that have that dimension, or set a dim they "
                "have (0 for a batch-first output).");
    spec.dim = c10::maybe_wrap_dim(dim, parts[0].dim());
    for (const auto& p : parts) {
      spec.sizes.push_back(p.size(spec.dim));
    }
    gathered = parts.size() == 1 ? parts[0] : torch::cat(parts, spec.dim);
  } else if (scalars == ScalarGather::Stack) {
    // PyTorch warns here too; with uneven shares, the vector's plain mean is
    // not the batch's, which is how a loss goes silently wrong.
    const bool uneven = std::adjacent_find(shares.begin(), shares.end(), std::not_equal_to<>()) != shares.end();
    TORCH_WARN_ONCE("lockstep::DataParallel: the module returned a 0-dim tensor, so the replicas' values are stacked "
                    "into a vector of ", parts.size(), ", one per replica (ScalarGather::Stack, the default)",
                    uneven ? "; their shares of the batch differ, so the vector's mean is not the batch's mean" : "",
                    ". Pass DataParallelOptions().scalar_outputs(ScalarGather::Mean) for the batch's mean, or Sum.");
    spec.kind = OutputSpec::Kind::Stack;
    gathered = torch::stack(parts);
  } else {
    spec.kind = OutputSpec::Kind::Weighted;
    for (size_t i = 0; i < parts.size(); ++i) {
      spec.weights.push_back(scalars == ScalarGather::Mean ? shares[i] : 1.0);
      // A Sum keeps an integer count an integer, as torch::sum does (a bool
      // one counts as int64); a Mean is fractional.
      auto term = scalars == ScalarGather::Mean ? parts[i] * spec.weights.back()
          : parts[i].scalar_type() == torch::kBool ? parts[i].to(torch::kLong)
                                                   : parts[i];
      gathered = gathered.defined() ? gathered + term : term;
    }
  }
  // With one replica running, the gathered tensor can be that replica's own
  // output; giving it ParallelBackward's history would make the replica's
  // graph loop back into the node. detach() keeps storage and version.
  for (const auto& p : parts) {
    if (gathered.is_same(p)) {
      return gathered.detach();
    }
  }
  return gathered;
}

} // namespace

Gathered DataParallelCore::gather(const Plan& plan, const std::vector<std::vector<torch::Tensor>>& flat) const {
  const size_t n = plan.used.size();
  TORCH_INTERNAL_ASSERT(flat.size() == n && n > 0);
  for (size_t i = 1; i < n; ++i) {
    TORCH_CHECK(
        flat[i].size() == flat[0].size(), "lockstep::DataParallel: replica ", plan.used[i], " returned ",
        flat[i].size(), " tensors but replica ", plan.used[0], " returned ", flat[0].size(),
        "; every replica must return the same structure.");
  }
  std::vector<double> shares(n);
  for (size_t i = 0; i < n; ++i) {
    shares[i] = plan.batch == 0 ? 1.0 : static_cast<double>(plan.sizes[plan.used[i]]) / static_cast<double>(plan.batch);
  }
  Gathered gathered;
  gathered.tensors.resize(flat[0].size());
  for (size_t j = 0; j < flat[0].size(); ++j) {
    std::vector<torch::Tensor> parts(n);
    bool needs_grad = false;
    for (size_t i = 0; i < n; ++i) {
      parts[i] = flat[i][j];
      TORCH_CHECK(
          parts[i].defined() == parts[0].defined() && (!parts[i].defined() || parts[i].dim() == parts[0].dim()),
          "lockstep::DataParallel: output tensor ", j, " of replica ", plan.used[i],
          " differs in rank or definedness from replica ", plan.used[0], "'s.");
      needs_grad = needs_grad || (parts[i].defined() && parts[i].requires_grad());
    }
    if (!parts[0].defined()) {
      continue;
    }
    TORCH_CHECK(parts[0].dim() > 0 || options_.scalar_outputs() != ScalarGather::Mean ||
                    !at::isIntegralType(parts[0].scalar_type(), /*includeBool=*/true),
                "lockstep::DataParallel: output tensor ", j, " is a 0-dim ", parts[0].scalar_type(),
                " tensor, and ScalarGather::Mean would turn it into a fraction: the share-weighted mean of a count or "
                "a flag is neither. Use ScalarGather::Sum to add the replicas' counts, return it as a floating-point "
                "tensor to average it, or as a 1-element tensor to have the replicas' values concatenated.");
    OutputSpec spec;
    auto& out = gathered.tensors[j];
    out = gather_one(parts, output_device(), options_.dim(), options_.scalar_outputs(), shares, spec);
    if (needs_grad && is_differentiable(out)) {
      gathered.differentiable.push_back(j);
      gathered.specs.push_back(std::move(spec));
    }
  }
  return gathered;
}

} // namespace detail
} // namespace lockstep
