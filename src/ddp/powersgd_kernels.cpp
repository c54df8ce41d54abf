// PowerSGD's arithmetic on its factors (Note [PowerSGD] in
// src/ddp/powersgd.cpp), on raw rows where the matrices are in this
// process's memory.

#include "ddp/powersgd_kernels.h"
#include "util/cpu_clones.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
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

// Note [PowerSGD's products and the BLAS]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each round multiplies the bucket's matrices by thin factors: P = M Q and
// Q = M^T P, M of n x m and the factors of rank r (4 by default). Where the
// loops of Note [PowerSGD's passes over M] do not take them (a GPU, double,
// another rank), the BLAS does. How fast
// a BLAS runs such a product depends on the form it is given, and the two
// BLAS that LibTorch ships with disagree (one core, n = m = 1024, r = 4,
// 2026-11-29's AMD EPYC):
//   P = M Q as mm(M, Q):       MKL 1.20 ms, OpenBLAS 0.25 ms
//   P = M Q as (Q^T M^T)^T:    MKL 0.30 ms, OpenBLAS 0.72 ms
//   Q = M^T P as mm(M^T, P):   MKL 3.79 ms, OpenBLAS 0.44 ms
//   Q = M^T P as (P^T M)^T:    MKL 0.25 ms, OpenBLAS 0.28 ms
// (OpenBLAS's 0.72 is the rows of a 1024-wide M falling 4 KiB apart; for
// n x m = 1024 x 784 it is 0.22 against 0.19.) So Q takes the thin operand
// first everywhere, and P does where ATen has MKL, and on GPUs, where
// cuBLAS's forms were not measured. The form decides the bits, and it
// follows from the build and the device, never from a timing, so that a
// resumed run repeats its bits.

// X^T F for a thin F (k x r), computed as (F^T X)^T.
torch::Tensor thin_times(const torch::Tensor& f, const torch::Tensor& x) {
  return torch::matmul(f.t(), x).t();
}

// X F for a thin F (k x r), in the form this build's BLAS runs faster; on
// a GPU, thin first.
torch::Tensor times_thin(const torch::Tensor& x, const torch::Tensor& f) {
  static const bool mkl = at::hasMKL();
  return mkl || !x.is_cpu() ? torch::matmul(f.t(), x.t()).t() : torch::mm(x, f);
}

// Note [PowerSGD's passes over M]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// M is the size of the gradients and, on a CPU, of no cache, so every pass
// over it is a pass over memory. Through the BLAS a round made seven: the
// error added to the gradient, the copy kept for the next error, P = M Q
// and Q = M^T P each with the BLAS's packing of M into its layout, M = P Q^T
// written, and the next error. Where M is a contiguous float matrix in this
// process's memory and r is 1, 2, 3, 4 or 8, a round makes three, row by
// row, each row worked on while it is in cache:
//  1. kept = gradient + error, and P's row = kept's row times Q (project_);
//  2. Q^T += P's row times M's row, for each row in order
//     (project_transposed_);
//  3. M = P Q^T into the bucket, and kept -= M, the next error
//     (low_rank_product_).
// A row's products with Q are summed in kLanes partial sums, added in a
// fixed tree at the row's end. Every loop here is compiled for each x86-64
// level (LOCKSTEP_CPU_CLONES) and this file without fused multiply-adds
// (CMakeLists.txt), so each product and each sum is rounded on its own, in
// the same order, whatever the vector width: every CPU computes the same
// bits. That matters for M = P Q^T, which every rank writes from the same
// averaged factors: ranks on AVX512 and on AVX2 keep the same parameters.
// One core, n x m = 1024 x 784, r = 4, in cache (2026-11-30's AMD EPYC,
// 2.15's MKL): step 1 0.15 ms against 0.29 for the addition and the BLAS's
// product, step 2 0.11 against 0.14, step 3 0.08 against 0.56 for a scalar
// loop. DDP + PowerSGD's step on the MLP, 2 ranks on 2 cores: 1.03 x the
// steps per second of the BLAS's (docs/performance.md).
constexpr int kLanes = 16;
// kLanes floats as one value: GCC's vector extension, which each clone
// lowers to its own registers (one AVX512 register, two AVX2 ones, four
// SSE ones), element by element, so every clone computes the same bits.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// One row of project_: kept = gradient + error (kAdd) and p = kept Q, the
// products summed in kLanes partial sums, then in a fixed tree.
template <int R, bool kAdd, bool kKeep>
inline __attribute__((always_inline)) void project_row(float* __restrict__ p, const float* __restrict__ gradient,
                                                       const float* __restrict__ error, const float* __restrict__ q_t,
                                                       float* __restrict__ kept, int64_t cols) {
  Lanes sums[R] = {};
  int64_t j = 0;
  for (; j + kLanes <= cols; j += kLanes) {
    Lanes x, e, q;
    std::memcpy(&x, gradient + j, sizeof(x));
    if (kAdd) {
      std::memcpy(&e, error + j, sizeof(e));
      x += e;
    }
    if (kKeep) {
      std::memcpy(kept + j, &x, sizeof(x));
    }
    for (int r = 0; r < R; ++r) {
      std::memcpy(&q, q_t + r * cols + j, sizeof(q));
      sums[r] += x * q;
    }
  }
  float lanes[R][kLanes];
  std::memcpy(lanes, sums, sizeof(lanes));
  for (int l = 0; j < cols; ++j, ++l) {
    const float x = kAdd ? gradient[j] + error[j] : gradient[j];
    if (kKeep) {
      kept[j] = x;
    }
    for (int r = 0; r < R; ++r) {
      lanes[r][l] += x * q_t[r * cols + j];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int width = kLanes / 2; width >= 1; width /= 2) {
      for (int l = 0; l < width; ++l) {
        lanes[r][l] += lanes[r][l + width];
      }
    }
    p[r] = lanes[r][0];
  }
}

template <int R>
inline __attribute__((always_inline)) void project_rows_of_rank(float* p, const float* gradient, const float* error,
                                                                const float* q_t, float* kept, int64_t rows,
                                                                int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t at = i * cols;
    if (error != nullptr) {
      project_row<R, true, true>(p + i * R, gradient + at, error + at, q_t, kept + at, cols);
    } else if (kept != nullptr) {
      project_row<R, false, true>(p + i * R, gradient + at, nullptr, q_t, kept + at, cols);
    } else {
      project_row<R, false, false>(p + i * R, gradient + at, nullptr, q_t, nullptr, cols);
    }
  }
}

LOCKSTEP_CPU_CLONES void project_rows(float* p, const float* gradient, const float* error, const float* q_t,
                                      float* kept, int64_t rows, int64_t cols, int64_t rank) {
  switch (rank) {
    case 1: return project_rows_of_rank<1>(p, gradient, error, q_t, kept, rows, cols);
    case 2: return project_rows_of_rank<2>(p, gradient, error, q_t, kept, rows, cols);
    case 3: return project_rows_of_rank<3>(p, gradient, error, q_t, kept, rows, cols);
    case 4: return project_rows_of_rank<4>(p, gradient, error, q_t, kept, rows, cols);
    case 8: return project_rows_of_rank<8>(p, gradient, error, q_t, kept, rows, cols);
    default: TORCH_INTERNAL_ASSERT(false, "PowerSGD: no row kernel for rank ", rank);
  }
}

// q_t (R x cols, zeroed) += p's row i times m's row i, for every row: four
// rows at a time, their products summed in pairs before they are added, so
// that Q^T is read and written once per four rows of M.
template <int R>
inline __attribute__((always_inline)) void project_transposed_rows_of_rank(float* __restrict__ q_t,
                                                                           const float* __restrict__ m,
                                                                           const float* __restrict__ p, int64_t rows,
                                                                           int64_t cols) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) {
    const float* __restrict__ a = m + i * cols;
    const float* __restrict__ b = a + cols;
    const float* __restrict__ c = b + cols;
    const float* __restrict__ d = c + cols;
    for (int r = 0; r < R; ++r) {
      const float pa = p[i * R + r], pb = p[(i + 1) * R + r], pc = p[(i + 2) * R + r], pd = p[(i + 3) * R + r];
      float* __restrict__ out = q_t + r * cols;
      for (int64_t j = 0; j < cols; ++j) {
        out[j] += (pa * a[j] + pb * b[j]) + (pc * c[j] + pd * d[j]);
      }
    }
  }
  for (; i < rows; ++i) {
    const float* __restrict__ row = m + i * cols;
    for (int r = 0; r < R; ++r) {
      const float pa = p[i * R + r];
      float* __restrict__ out = q_t + r * cols;
      for (int64_t j = 0; j < cols; ++j) {
        out[j] += pa * row[j];
      }
    }
  }
}

LOCKSTEP_CPU_CLONES void project_transposed_rows(float* q_t, const float* m, const float* p, int64_t rows,
                                                 int64_t cols, int64_t rank) {
  switch (rank) {
    case 1: return project_transposed_rows_of_rank<1>(q_t, m, p, rows, cols);
    case 2: return project_transposed_rows_of_rank<2>(q_t, m, p, rows, cols);
    case 3: return project_transposed_rows_of_rank<3>(q_t, m, p, rows, cols);
    case 4: return project_transposed_rows_of_rank<4>(q_t, m, p, rows, cols);
    case 8: return project_transposed_rows_of_rank<8>(q_t, m, p, rows, cols);
    default: TORCH_INTERNAL_ASSERT(false, "PowerSGD: no row kernel for rank ", rank);
  }
}

// Whether the row kernels take these operands: contiguous float matrices
// in this process's memory, at a rank they are made for.
bool by_rows(std::initializer_list<const torch::Tensor*> operands, int64_t rank) {
  if (rank != 1 && rank != 2 && rank != 3 && rank != 4 && rank != 8) {
    return false;
  }
  for (const auto* t : operands) {
    if (t->defined() && !(t->device().is_cpu() && t->scalar_type() == torch::kFloat && t->dim() == 2 &&
                          t->is_contiguous())) {
      return false;
    }
  }
  return true;
}

} // namespace

void project_(torch::Tensor p, const torch::Tensor& gradient, const torch::Tensor& error, const torch::Tensor& q,
              torch::Tensor kept) {
  TORCH_INTERNAL_ASSERT(gradient.dim() == 2 && q.dim() == 2 && p.dim() == 2 && q.size(0) == gradient.size(1) &&
                        p.size(0) == gradient.size(0) && p.size(1) == q.size(1));
  // The rows' loop keeps gradient + error only where it is asked to keep it.
  if (by_rows({&p, &gradient, &error, &kept}, q.size(1)) && q.device().is_cpu() &&
      q.scalar_type() == torch::kFloat && (kept.defined() || !error.defined())) {
    const auto q_t = q.t().contiguous();
    project_rows(p.data_ptr<float>(), gradient.data_ptr<float>(), error.defined() ? error.data_ptr<float>() : nullptr,
                 q_t.data_ptr<float>(), kept.defined() ? kept.data_ptr<float>() : nullptr, gradient.size(0),
                 gradient.size(1), q.size(1));
    return;
  }
  torch::Tensor m = gradient;
  if (kept.defined()) {
    m = error.defined() ? torch::add_out(kept, gradient, error) : kept.copy_(gradient);
  } else if (error.defined()) {
    m = gradient + error;
  }
  p.copy_(times_thin(m, q));
}

void project_transposed_(torch::Tensor q, const torch::Tensor& m, const torch::Tensor& p) {
  TORCH_INTERNAL_ASSERT(m.dim() == 2 && q.dim() == 2 && p.dim() == 2 && q.size(0) == m.size(1) &&
                        p.size(0) == m.size(0) && p.size(1) == q.size(1));
  if (by_rows({&m, &p}, q.size(1)) && q.device().is_cpu() && q.scalar_type() == torch::kFloat) {
    auto q_t = torch::zeros({q.size(1), q.size(0)}, q.options());
    project_transposed_rows(q_t.data_ptr<float>(), m.data_ptr<float>(), p.data_ptr<float>(), m.size(0), m.size(1),
                            q.size(1));
    q.copy_(q_t.t());
    return;
  }
  q.copy_(thin_times(p, m));
}

// Note [Writing P Q^T by rows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// M = P Q^T at rank r is r multiply-adds per element of M, which is written
// once: a pass over memory. MKL, in PyTorch 2.15's wheel, took 0.67 ms for
// it where M is 1024 x 1024 and 0.14 ms where it is 1024 x 1040 (one core,
// r = 4): rows 4 KiB apart, which its kernel writes a few columns at a time
// down all of them, fall in the same cache sets. So M is written here one
// row at a time, each element once, as the sum of its r products with a row
// of Q^T (a copy, r x m, which stays in cache), in a fixed order, so every
// rank writes the same bits (Note [PowerSGD's passes over M]).
namespace {

// One row: each element once, the sum of its R products, R known here so
// that the compiler unrolls them and vectorises along the row; with kLeft,
// the element is taken from `left` too, while it is in a register.
template <typename T, int R, bool kLeft>
inline __attribute__((always_inline)) void low_rank_row(T* __restrict__ row, const T* __restrict__ p_row,
                                                        const T* __restrict__ q_t, T* __restrict__ left,
                                                        int64_t cols) {
  T c[R];
  for (int k = 0; k < R; ++k) {
    c[k] = p_row[k];
  }
  for (int64_t j = 0; j < cols; ++j) {
    T sum = c[0] * q_t[j];
    for (int k = 1; k < R; ++k) {
      sum += c[k] * q_t[k * cols + j];
    }
    row[j] = sum;
    if (kLeft) {
      left[j] -= sum;
    }
  }
}

template <typename T, int R>
inline __attribute__((always_inline)) void low_rank_rows_of_rank(T* m, const T* p, const T* q_t, T* residual,
                                                                 int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    if (residual != nullptr) {
      low_rank_row<T, R, true>(m + i * cols, p + i * R, q_t, residual + i * cols, cols);
    } else {
      low_rank_row<T, R, false>(m + i * cols, p + i * R, q_t, nullptr, cols);
    }
  }
}

// Any rank: the row gains one scaled row of Q^T at a time, in the same order.
template <typename T>
inline __attribute__((always_inline)) void low_rank_rows(T* m, const T* p, const T* __restrict__ q_t, T* residual,
                                                         int64_t rows, int64_t cols, int64_t rank) {
  switch (rank) {
    case 1: return low_rank_rows_of_rank<T, 1>(m, p, q_t, residual, rows, cols);
    case 2: return low_rank_rows_of_rank<T, 2>(m, p, q_t, residual, rows, cols);
    case 3: return low_rank_rows_of_rank<T, 3>(m, p, q_t, residual, rows, cols);
    case 4: return low_rank_rows_of_rank<T, 4>(m, p, q_t, residual, rows, cols);
    case 8: return low_rank_rows_of_rank<T, 8>(m, p, q_t, residual, rows, cols);
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
    for (int64_t j = 0; residual != nullptr && j < cols; ++j) {
      residual[i * cols + j] -= row[j];
    }
  }
}

LOCKSTEP_CPU_CLONES void low_rank_rows_of_floats(float* m, const float* p, const float* q_t, float* residual,
                                                 int64_t rows, int64_t cols, int64_t rank) {
  low_rank_rows(m, p, q_t, residual, rows, cols, rank);
}

LOCKSTEP_CPU_CLONES void low_rank_rows_of_doubles(double* m, const double* p, const double* q_t, double* residual,
                                                  int64_t rows, int64_t cols, int64_t rank) {
  low_rank_rows(m, p, q_t, residual, rows, cols, rank);
}

} // namespace

void low_rank_product_(torch::Tensor matrix, const torch::Tensor& p, const torch::Tensor& q, torch::Tensor residual) {
  TORCH_INTERNAL_ASSERT(p.dim() == 2 && q.dim() == 2 && p.size(1) == q.size(1) && p.size(1) >= 1);
  const bool loop_by_rows = matrix.device().is_cpu() && matrix.is_contiguous() && matrix.dim() == 2 &&
      matrix.size(1) > 0 && p.scalar_type() == matrix.scalar_type() && q.scalar_type() == matrix.scalar_type() &&
      (!residual.defined() || (residual.is_contiguous() && residual.sizes() == matrix.sizes() &&
                               residual.scalar_type() == matrix.scalar_type() && residual.device().is_cpu()));
  if (loop_by_rows && (matrix.scalar_type() == torch::kFloat || matrix.scalar_type() == torch::kDouble)) {
    const auto p_rows = p.contiguous();
    const auto q_t = q.t().contiguous();
    if (matrix.scalar_type() == torch::kFloat) {
      low_rank_rows_of_floats(matrix.data_ptr<float>(), p_rows.data_ptr<float>(), q_t.data_ptr<float>(),
                    residual.defined() ? residual.data_ptr<float>() : nullptr, matrix.size(0), matrix.size(1),
                    p.size(1));
    } else {
      low_rank_rows_of_doubles(matrix.data_ptr<double>(), p_rows.data_ptr<double>(), q_t.data_ptr<double>(),
                    residual.defined() ? residual.data_ptr<double>() : nullptr, matrix.size(0), matrix.size(1),
                    p.size(1));
    }
    return;
  }
  torch::matmul_out(matrix, p, q.t());
  if (residual.defined()) {
    residual.sub_(matrix);
  }
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
