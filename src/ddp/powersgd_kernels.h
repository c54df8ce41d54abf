#pragma once

// PowerSGD's arithmetic on its factors (Note [PowerSGD] in
// src/ddp/powersgd.cpp). Unit-tested in tests/test_powersgd.cpp.

#include <torch/types.h>

namespace lockstep {
namespace detail {

// matrix = p q^T, in place, for `matrix` (n x m), p (n x r) and q (m x r):
// step 5 of Note [PowerSGD]. A contiguous matrix in this process's memory is
// written row by row (Note [Writing P Q^T by rows]); any other, by
// torch::matmul_out.
void low_rank_product_(torch::Tensor matrix, const torch::Tensor& p, const torch::Tensor& q);

// Gram-Schmidt on the columns of `matrix` (n x r), in place: PyTorch's
// _orthogonalize, with each projection done twice so that a matrix of rank
// below r still comes out orthonormal; a zero column stays zero.
void orthogonalize_(torch::Tensor matrix);

} // namespace detail
} // namespace lockstep
