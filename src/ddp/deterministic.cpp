// DistributedDataParallel's deterministic mode: this rank's micro-batches run
// alone and one int64 allreduce sums their gradients exactly (Note [The same
// bits at any world size] in src/deterministic/micro_batch_step.cpp).

#include <lockstep/distributed_data_parallel.h>
#include <lockstep/timeline.h>

#include "deterministic/micro_batch_step.h"

#include <torch/torch.h>

namespace lockstep {
namespace detail {

void DistributedCore::make_deterministic(std::vector<torch::Tensor> params, const DistributedOptions& options) {
  const std::string where = "lockstep::DistributedDataParallel (deterministic, rank " + std::to_string(group_.rank()) +
      " of " + std::to_string(group_.size()) + "): ";
  TORCH_CHECK(!options.comm_hook() && !options.gradient_as_bucket_view(), where, "deterministic(true) sums the "
              "gradients itself, exactly: it takes neither a comm_hook nor gradient_as_bucket_view. Leave them unset.");
  MicroBatchConfig config;
  config.micro_batches = options.micro_batches();
  config.micro_batch_size = options.micro_batch_size();
  config.seed = options.seed();
  micro_batches_ = std::make_unique<MicroBatchStep>(module_, group_, config, params.at(0).device(), where);
  exact_params_ = std::move(params);
}

double DistributedCore::backward_micro_batches(int64_t step,
                                               const std::function<torch::Tensor(int64_t)>& loss_of) {
  TORCH_CHECK(micro_batches_ != nullptr, "lockstep::DistributedDataParallel: rank ", group_.rank(),
              ": backward_micro_batches needs DistributedOptions().deterministic(true).micro_batches(V); this wrapper "
              "reduces in backward, as PyTorch's DDP.");
  check_still_frozen();
  const auto gradients = micro_batches_->run(step, loss_of, [this] {
    std::vector<torch::Tensor> grads;
    for (auto& p : exact_params_) {
      grads.push_back(std::move(p.mutable_grad()));
      p.mutable_grad().reset();
    }
    return grads;
  });
  timeline::Span to_integers("deterministic: to integers");
  std::vector<FixedPointPiece> pieces;
  int64_t total = 0;
  for (size_t p = 0; p < exact_params_.size(); ++p) {
    pieces.push_back({p, 0, exact_params_[p].numel(), total});
    total += exact_params_[p].numel();
  }
  auto sum = torch::empty({total}, torch::TensorOptions().dtype(torch::kLong).device(exact_params_[0].device()));
  write_fixed_point(sum, pieces, gradients);
  to_integers.end();
  timeline::Span allreduce("deterministic: allreduce of int64", sum.numel() * 8);
  group_.allreduce_async({sum}, ReduceOp::Sum, "the exact sum of step " + std::to_string(step) +
                         "'s gradients (deterministic DistributedDataParallel)")->wait();
  allreduce.end();
  timeline::Span to_floats("deterministic: back to floats");
  for (const auto& piece : pieces) {
    auto& param = exact_params_[piece.param];
    param.mutable_grad() = read_fixed_point(sum, piece, gradients, param.scalar_type(), param.sizes());
  }
  return gradients.mean_loss;
}

} // namespace detail
} // namespace lockstep
