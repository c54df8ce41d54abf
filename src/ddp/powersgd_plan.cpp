// The pure parts of PowerSGD (Note [PowerSGD] in src/ddp/powersgd.cpp): which
// gradients are compressed, where their P and Q live, and the
// orthonormalisation.

#include "ddp/powersgd_plan.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

bool worth_compressing(int64_t rows, int64_t cols, int64_t rank, double min_rate) {
  return static_cast<double>((rows + cols) * rank) * min_rate < static_cast<double>(rows * cols);
}

namespace {

// Where `gradient` starts in `buffer`, in elements.
int64_t offset_in(const torch::Tensor& gradient, const torch::Tensor& buffer, const GradBucket& bucket, size_t i) {
  const int64_t offset = gradient.storage_offset() - buffer.storage_offset();
  TORCH_CHECK(gradient.is_alias_of(buffer) && gradient.is_contiguous() && offset >= 0 &&
                  offset + gradient.numel() <= buffer.numel(),
              "lockstep::PowerSGD: gradient ", i, " of ", bucket.name, " is not a contiguous view of the bucket's "
              "buffer; GradBucket::gradients must view GradBucket::buffer, as DistributedDataParallel's do.");
  return offset;
}

void add_whole(PowerSGDPlan& plan, int64_t offset, int64_t numel) {
  if (numel == 0) {
    return;
  }
  if (!plan.whole.empty() && plan.whole.back().first + plan.whole.back().second == offset) {
    plan.whole.back().second += numel;
  } else {
    plan.whole.emplace_back(offset, numel);
  }
  plan.whole_elements += numel;
}

} // namespace

PowerSGDPlan plan_powersgd(const GradBucket& bucket, int64_t rank, double min_rate) {
  const auto& buffer = bucket.buffer;
  TORCH_CHECK(buffer.dim() == 1 && buffer.is_contiguous(), "lockstep::PowerSGD: the buffer of ", bucket.name,
              " must be flat and contiguous, but is ", buffer.sizes(), ".");
  TORCH_CHECK(bucket.parameters.size() == bucket.gradients.size(), "lockstep::PowerSGD: ", bucket.name, " has ",
              bucket.gradients.size(), " gradients for ", bucket.parameters.size(), " parameters; GradBucket::gradients "
              "holds one view per entry of GradBucket::parameters.");
  PowerSGDPlan plan;
  std::vector<std::pair<int64_t, size_t>> order; // (offset, gradient)
  for (size_t i = 0; i < bucket.gradients.size(); ++i) {
    plan.offsets.push_back(offset_in(bucket.gradients[i], buffer, bucket, i));
    order.emplace_back(plan.offsets.back(), i);
  }
  std::sort(order.begin(), order.end());
  plan.bucket_elements = buffer.numel();
  int64_t cursor = 0;
  for (const auto& [offset, i] : order) {
    const auto& g = bucket.gradients[i];
    TORCH_CHECK(offset >= cursor, "lockstep::PowerSGD: gradients of ", bucket.name, " overlap at element ", offset, ".");
    add_whole(plan, cursor, offset - cursor);
    cursor = offset + g.numel();
    const int64_t rows = g.dim() >= 2 ? g.size(0) : 0;
    const int64_t cols = rows > 0 ? g.numel() / rows : 0;
    const int64_t r = std::min({rows, cols, rank});
    if (g.dim() < 2 || g.numel() == 0 || !worth_compressing(rows, cols, r, min_rate)) {
      add_whole(plan, offset, g.numel());
      continue;
    }
    plan.matrices.push_back(PowerSGDMatrix{i, rows, cols, r, plan.p_elements, plan.q_elements});
    plan.p_elements += rows * r;
    plan.q_elements += cols * r;
  }
  plan.parameter_elements = cursor;
  add_whole(plan, cursor, buffer.numel() - cursor);
  return plan;
}

void orthogonalize_(torch::Tensor matrix) {
  if (matrix.scalar_type() == torch::kHalf || matrix.scalar_type() == torch::kBFloat16) {
    // In float: float16 rounds float32's smallest normal, the clamp below,
    // to 0 (a zero column became 0 / 0 = NaN), and Gram-Schmidt in 8 or 11
    // bits leaves columns far from orthogonal.
    auto wide = matrix.to(torch::kFloat);
    orthogonalize_(wide);
    matrix.copy_(wide);
    return;
  }
  const int64_t columns = matrix.size(1);
  for (int64_t i = 0; i < columns; ++i) {
    auto column = matrix.narrow(1, i, 1);
    if (i > 0) {
      // Twice: when the matrix has rank below r, what one pass leaves of a
      // column is rounding noise, not orthogonal to the others.
      auto done = matrix.narrow(1, 0, i);
      for (int pass = 0; pass < 2; ++pass) {
        column.sub_(torch::matmul(done, torch::matmul(done.t(), column)));
      }
    }
    column.div_(column.norm().clamp_min(std::numeric_limits<float>::min())); // a zero column stays zero
  }
}

} // namespace detail
} // namespace lockstep
