#pragma once

// The pure parts of deterministic mode's gradient sum (Note [The same bits at
// any world size] in src/deterministic/micro_batch_step.cpp): every micro-batch's
// gradient is scaled by a power of two into int64, whose sum does not depend
// on the order it is taken in. Unit-tested in tests/test_exact_sum.cpp.

#include <torch/types.h>

#include <cstdint>

namespace lockstep {
namespace detail {

/// The exponent e for which `terms` values of magnitude at most `max_abs`,
/// each times 2^e and rounded, add up below 2^62 in int64: the largest such
/// e, so that the sum keeps as many bits as it can. `max_abs` must be finite
/// and >= 0; 0 gives 0.
int fixed_point_exponent(double max_abs, int64_t terms);

/// The largest |x| over `value`'s elements; NaN if one is NaN.
double max_abs(const torch::Tensor& value);

/// Adds round(value * 2^exponent), half to even, to `sum` (int64, as many
/// elements as `value`, contiguous), or with `add` false writes it there.
/// value * 2^exponent is exact in double, so the rounding is the only one.
void add_fixed_point(torch::Tensor& sum, const torch::Tensor& value, int exponent, bool add = true);

/// sum * 2^-exponent / divisor, computed in double and rounded once more to
/// `dtype`, as a tensor of its own shaped `sizes` (a gradient: no view, which
/// zero_grad could not detach).
torch::Tensor from_fixed_point(const torch::Tensor& sum, int exponent, int64_t divisor, torch::ScalarType dtype,
                               at::IntArrayRef sizes);

/// The same values written into `out`, as many elements as `sum`, in its
/// dtype: a part of a gradient already allocated.
void from_fixed_point_into(torch::Tensor out, const torch::Tensor& sum, int exponent, int64_t divisor);

/// A seed for micro-batch `micro_batch` of step `step` of a run seeded with
/// `seed`: the same wherever that micro-batch runs.
uint64_t micro_batch_seed(uint64_t seed, int64_t step, int64_t micro_batch);

} // namespace detail
} // namespace lockstep
