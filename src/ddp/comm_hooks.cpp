#include <lockstep/comm_hooks.h>

#include <torch/torch.h>

namespace lockstep {
namespace comm_hooks {

namespace {

// A collective and what turns its result into the averaged bucket.
class WorkReduction : public PendingReduction {
 public:
  WorkReduction(std::shared_ptr<Work> work, std::function<torch::Tensor()> finish)
      : work_(std::move(work)), finish_(std::move(finish)) {}
  torch::Tensor wait() override {
    work_->wait();
    return finish_();
  }

 private:
  std::shared_ptr<Work> work_;
  std::function<torch::Tensor()> finish_;
};

class Completed : public PendingReduction {
 public:
  explicit Completed(torch::Tensor t) : t_(std::move(t)) {}
  torch::Tensor wait() override {
    return t_;
  }

 private:
  torch::Tensor t_;
};

std::shared_ptr<PendingReduction> compressed(const ProcessGroup& group, GradBucket& bucket, torch::Dtype dtype) {
  // Divide first: summing already-averaged values cannot overflow float16.
  auto values = bucket.buffer.div(group.size()).to(dtype);
  if (!group.supports(Collective::Allreduce, dtype, values.device())) {
    // A backend that cannot sum the type (MPI has no 16-bit float types;
    // 1.13's Gloo has no bfloat16 sum): round to the type (the same precision
    // loss), then sum in the bucket's own type, or in float32 where that is
    // the same 16-bit type. Nothing is saved on the wire.
    const auto own = bucket.buffer.scalar_type();
    values = values.to(group.supports(Collective::Allreduce, own, values.device()) ? own : torch::kFloat);
  }
  auto work = group.allreduce_async({values}, ReduceOp::Sum, "allreduce of " + bucket.name);
  auto buffer = bucket.buffer;
  return std::make_shared<WorkReduction>(std::move(work), [buffer, values]() mutable { return buffer.copy_(values); });
}

} // namespace

std::shared_ptr<PendingReduction> allreduce(const ProcessGroup& group, GradBucket& bucket) {
  return pending(group.allreduce_async({bucket.buffer}, ReduceOp::Avg, "allreduce of " + bucket.name), bucket.buffer);
}

std::shared_ptr<PendingReduction> pending(std::shared_ptr<Work> work, torch::Tensor result) {
  TORCH_CHECK(work, "lockstep::comm_hooks::pending: the work is null; pass what the collective returned (for "
              "example group.allreduce_async(...)).");
  TORCH_CHECK(result.defined(), "lockstep::comm_hooks::pending: the result tensor is undefined; pass the tensor the "
              "collective writes (for example bucket.buffer).");
  return std::make_shared<WorkReduction>(std::move(work), [result] { return result; });
}

std::shared_ptr<PendingReduction> fp16_compress(const ProcessGroup& group, GradBucket& bucket) {
  return compressed(group, bucket, torch::kHalf);
}

std::shared_ptr<PendingReduction> bf16_compress(const ProcessGroup& group, GradBucket& bucket) {
  return compressed(group, bucket, torch::kBFloat16);
}

std::shared_ptr<PendingReduction> completed(torch::Tensor averaged) {
  return std::make_shared<Completed>(std::move(averaged));
}

} // namespace comm_hooks
} // namespace lockstep
