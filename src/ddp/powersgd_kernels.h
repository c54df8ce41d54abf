#pragma once

// PowerSGD's arithmetic on its factors (Note [PowerSGD] in
// src/ddp/powersgd.cpp). Unit-tested in tests/test_powersgd.cpp.

#include <torch/types.h>

namespace lockstep {
namespace detail {

// Steps 1 and 2 of Note [PowerSGD] for one matrix: p = (gradient + error) q,
// for gradient (n x m), q (m x r) and p (n x r); where `kept` (n x m) is
// given, gradient + error is written there too. An undefined `error` adds
// nothing. One pass over the rows where every operand is a contiguous float
// matrix in this process's memory and r is 1, 2, 3, 4 or 8 (Note
// [PowerSGD's passes over M]); tensor operations otherwise.
void project_(torch::Tensor p, const torch::Tensor& gradient, const torch::Tensor& error, const torch::Tensor& q,
              torch::Tensor kept);

// q = m^T p, for m (n x m), p (n x r) and q (m x r): step 4 of Note
// [PowerSGD]. By rows where project_ is; tensor operations otherwise.
void project_transposed_(torch::Tensor q, const torch::Tensor& m, const torch::Tensor& p);

// matrix = p q^T, in place, for `matrix` (n x m), p (n x r) and q (m x r),
// and residual -= matrix where `residual` (n x m) is given: step 5 of Note
// [PowerSGD]. A contiguous matrix in this process's memory is written row by
// row (Note [Writing P Q^T by rows]); any other, by torch::matmul_out.
void low_rank_product_(torch::Tensor matrix, const torch::Tensor& p, const torch::Tensor& q,
                       torch::Tensor residual = {});

// Gram-Schmidt on the columns of `matrix` (n x r), in place: PyTorch's
// _orthogonalize, with each projection done twice so that a matrix of rank
// below r still comes out orthonormal; a zero column stays zero.
void orthogonalize_(torch::Tensor matrix);

} // namespace detail
} // namespace lockstep
