// The pure parts of PowerSGD (Note [PowerSGD] in src/ddp/powersgd.cpp): which
// gradients are compressed, where their P and Q live, and the
// orthonormalisation.

#include "ddp/powersgd_plan.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
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

namespace {

// orthogonalize_ on a contiguous n x r matrix in this process's memory:
// the same steps on the raw rows, with the sums in double. The tensor
// operations' path issues some 8 r operations on strided columns, whose
// dispatch alone took a fifth of a millisecond per matrix at r = 4, longer
// than the arithmetic.
template <typename T>
void orthogonalize_rows(T* m, int64_t n, int64_t r) {
  std::vector<double> dots(static_cast<size_t>(r));
  for (int64_t i = 0; i < r; ++i) {
    for (int pass = 0; i > 0 && pass < 2; ++pass) { // twice, as below
      std::fill(dots.begin(), dots.begin() + i, 0.0);
      for (int64_t k = 0; k < n; ++k) {
        const T* row = m + k * r;
        for (int64_t j = 0; j < i; ++j) {
          dots[j] += static_cast<double>(row[j]) * static_cast<double>(row[i]);
        }
      }
      for (int64_t k = 0; k < n; ++k) {
        T* row = m + k * r;
        double projection = 0;
        for (int64_t j = 0; j < i; ++j) {
          projection += static_cast<double>(row[j]) * dots[j];
        }
        row[i] = static_cast<T>(static_cast<double>(row[i]) - projection);
      }
    }
    double squares = 0;
    for (int64_t k = 0; k < n; ++k) {
      squares += static_cast<double>(m[k * r + i]) * static_cast<double>(m[k * r + i]);
    }
    const double norm = std::max(std::sqrt(squares), static_cast<double>(std::numeric_limits<float>::min()));
    for (int64_t k = 0; k < n; ++k) {
      m[k * r + i] = static_cast<T>(static_cast<double>(m[k * r + i]) / norm); // a zero column stays zero
    }
  }
}

} // namespace

// Note [Writing P Q^T by rows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// M = P Q^T at rank r is r multiply-adds per element of M, which is written
// once: a pass over memory. MKL, in PyTorch 2.15's wheel, took 0.67 ms for
// it where M is 1024 x 1024 and 0.14 ms where it is 1024 x 1040 (one core,
// r = 4): rows 4 KiB apart, which its kernel writes a few columns at a time
// down all of them, fall in the same cache sets. So M is written here one
// row at a time, each element once, as the sum of its r products with a row
// of Q^T (a copy, r x m, which stays in cache), in a fixed order, so every
// rank writes the same bits. In DDP's step on the MLP (two ranks on two
// cores), it took 0.5 ms where MKL took 1.05, and 0.3 ms with LibTorch 1.13,
// as OpenBLAS did.
namespace {

// Each element once, its R products summed in a register: R known here, so
// that the compiler unrolls them and vectorises along the row.
template <typename T, int R>
void low_rank_rows_of_rank(T* m, const T* p, const T* __restrict__ q_t, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    T c[R];
    for (int k = 0; k < R; ++k) {
      c[k] = p[i * R + k];
    }
    T* __restrict__ row = m + i * cols;
    for (int64_t j = 0; j < cols; ++j) {
      T sum = c[0] * q_t[j];
      for (int k = 1; k < R; ++k) {
        sum += c[k] * q_t[k * cols + j];
      }
      row[j] = sum;
    }
  }
}

// Any rank: the row gains one scaled row of Q^T at a time, in the same order.
template <typename T>
void low_rank_rows(T* m, const T* p, const T* __restrict__ q_t, int64_t rows, int64_t cols, int64_t rank) {
  switch (rank) {
    case 1: return low_rank_rows_of_rank<T, 1>(m, p, q_t, rows, cols);
    case 2: return low_rank_rows_of_rank<T, 2>(m, p, q_t, rows, cols);
    case 3: return low_rank_rows_of_rank<T, 3>(m, p, q_t, rows, cols);
    case 4: return low_rank_rows_of_rank<T, 4>(m, p, q_t, rows, cols);
    case 8: return low_rank_rows_of_rank<T, 8>(m, p, q_t, rows, cols);
    default: break;
  }
  for (int64_t i = 0; i < rows; ++i) {
    T* __restrict__ row = m + i * cols;
    for (int64_t j = 0; j < cols; ++j) {
      row[j] = p[i * rank] * q_t[j];
    }
    for (int64_t k = 1; k < rank; ++k) {
      const T c = p[i * rank + k];
      for (int64_t j = 0; j < cols; ++j) {
        row[j] += c * q_t[k * cols + j];
      }
    }
  }
}

} // namespace

void low_rank_product_(torch::Tensor matrix, const torch::Tensor& p, const torch::Tensor& q) {
  TORCH_INTERNAL_ASSERT(p.dim() == 2 && q.dim() == 2 && p.size(1) == q.size(1) && p.size(1) >= 1);
  const bool rows_in_memory = matrix.device().is_cpu() && matrix.is_contiguous() && matrix.dim() == 2 &&
      matrix.size(1) > 0 && p.scalar_type() == matrix.scalar_type() && q.scalar_type() == matrix.scalar_type();
  if (rows_in_memory && (matrix.scalar_type() == torch::kFloat || matrix.scalar_type() == torch::kDouble)) {
    const auto p_rows = p.contiguous();
    const auto q_t = q.t().contiguous();
    if (matrix.scalar_type() == torch::kFloat) {
      low_rank_rows(matrix.data_ptr<float>(), p_rows.data_ptr<float>(), q_t.data_ptr<float>(), matrix.size(0),
                    matrix.size(1), p.size(1));
    } else {
      low_rank_rows(matrix.data_ptr<double>(), p_rows.data_ptr<double>(), q_t.data_ptr<double>(), matrix.size(0),
                    matrix.size(1), p.size(1));
    }
    return;
  }
  torch::matmul_out(matrix, p, q.t());
}

void orthogonalize_(torch::Tensor matrix) {
  if (matrix.device().is_cpu() && matrix.is_contiguous() && matrix.dim() == 2) {
    if (matrix.scalar_type() == torch::kFloat) {
      orthogonalize_rows(matrix.data_ptr<float>(), matrix.size(0), matrix.size(1));
      return;
    }
    if (matrix.scalar_type() == torch::kDouble) {
      orthogonalize_rows(matrix.data_ptr<double>(), matrix.size(0), matrix.size(1));
      return;
    }
  }
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
