// PowerSGD's arithmetic on its factors (Note [PowerSGD] in
// src/ddp/powersgd.cpp), on raw rows where the matrices are in this
// process's memory.

#include "ddp/powersgd_kernels.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace lockstep {
namespace detail {

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
