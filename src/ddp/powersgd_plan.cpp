// The pure parts of PowerSGD (Note [PowerSGD] in src/ddp/powersgd.cpp): which
// gradients are compressed, and where their P and Q live.

#include "ddp/powersgd_plan.h"
#include "util/row_layout.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
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
  TORCH_CHECK(gradient.is_alias_of(buffer) && rows_in_memory(gradient) && offset >= 0 &&
                  offset + gradient.numel() <= buffer.numel(),
              "lockstep::PowerSGD: gradient ", i, " of ", bucket.name, " is not a view of numel elements of the "
              "bucket's buffer, its rows in order (strides ", gradient.strides(), "); GradBucket::gradients must view "
              "GradBucket::buffer, as DistributedDataParallel's do.");
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
    plan.gaps = plan.gaps || offset > cursor;
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

namespace {

// The largest absolute value of a rows x rank factor, row-major, and which
// of its columns are all zero.
double largest_of(const double* f, int64_t rows, int64_t rank, std::vector<bool>* zero_columns) {
  double largest = 0;
  for (int64_t j = 0; j < rank; ++j) {
    bool zero = true;
    for (int64_t k = 0; k < rows; ++k) {
      const double v = std::abs(f[k * rank + j]);
      largest = std::max(largest, v);
      zero = zero && v == 0;
    }
    if (zero_columns != nullptr) {
      zero_columns->push_back(zero);
    }
  }
  return largest;
}

} // namespace

FactorSummary summarize_factors(const PowerSGDPlan& plan, const torch::Tensor& ps, const torch::Tensor& qs) {
  TORCH_INTERNAL_ASSERT(ps.numel() == plan.p_elements && qs.numel() == plan.q_elements);
  const auto host = [](const torch::Tensor& t) { return t.to(torch::kCPU, torch::kDouble).contiguous(); };
  const auto p = host(ps), q = host(qs);
  FactorSummary summary;
  summary.finite = torch::isfinite(p).all().item<bool>() && torch::isfinite(q).all().item<bool>();
  if (!summary.finite) {
    return summary;
  }
  for (const auto& m : plan.matrices) {
    std::vector<bool> zero_columns;
    const double p_largest = largest_of(p.data_ptr<double>() + m.p_offset, m.rows, m.rank, nullptr);
    const double q_largest = largest_of(q.data_ptr<double>() + m.q_offset, m.cols, m.rank, &zero_columns);
    summary.bound.push_back(2.0 * static_cast<double>(m.rank) * p_largest * q_largest);
    summary.q_has_zero_column.push_back(std::find(zero_columns.begin(), zero_columns.end(), true) != zero_columns.end());
  }
  return summary;
}

} // namespace detail
} // namespace lockstep
