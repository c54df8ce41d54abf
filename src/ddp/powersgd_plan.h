#pragma once

// The pure parts of PowerSGD (Note [PowerSGD] in src/ddp/powersgd.cpp): which of
// a bucket's gradients are compressed, and where each P and Q lives.
// Unit-tested in tests/test_powersgd.cpp.

#include <lockstep/comm_hooks.h>

#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {

// One gradient compressed: viewed as rows x cols, with P (rows x rank) at
// p_offset of the P's and Q (cols x rank) at q_offset of the Q's.
struct PowerSGDMatrix {
  size_t gradient = 0; // index in GradBucket::gradients
  int64_t rows = 0, cols = 0, rank = 0;
  int64_t p_offset = 0, q_offset = 0;
};

struct PowerSGDPlan {
  // Ranges of the bucket's buffer sent whole, (offset, elements), in order,
  // adjacent ones merged: the gradients not worth compressing, and whatever
  // follows the gradients (in a bucket made by hand).
  std::vector<std::pair<int64_t, int64_t>> whole;
  std::vector<PowerSGDMatrix> matrices;
  std::vector<int64_t> offsets; // of each gradient in the buffer
  int64_t parameter_elements = 0; // where the last gradient ends: what error feedback covers
  bool gaps = false; // whether elements before that lie between gradients (a bucket made by hand)
  int64_t bucket_elements = 0;
  int64_t whole_elements = 0, p_elements = 0, q_elements = 0;
  int64_t sent() const {
    return whole_elements + p_elements + q_elements;
  }
  // The bucket's elements over the elements sent.
  double rate() const {
    return sent() == 0 ? 1.0 : static_cast<double>(bucket_elements) / static_cast<double>(sent());
  }
};

// PyTorch's _should_compress: (n + m) * r * min_rate < n * m.
bool worth_compressing(int64_t rows, int64_t cols, int64_t rank, double min_rate);

// Which gradients of `bucket` are compressed at `rank`. The gradients must
// view the buffer without overlapping, each numel elements of it with its
// rows in order (contiguous, or a channels-last weight's strides); each is
// compressed as the matrix its memory holds.
PowerSGDPlan plan_powersgd(const GradBucket& bucket, int64_t rank, double min_rate);

// What the end of a round needs of its averaged factors (Note [PowerSGD's
// state]), read in one pass over a copy in this process's memory: whether
// every P and Q is finite, for each matrix the bound 2 r max|P| max|Q| on the
// elements of M = P Q^T, and whether its Q has a zero column. `ps` and `qs`
// are the plan's P's and Q's, flat.
struct FactorSummary {
  bool finite = true;
  std::vector<double> bound;
  std::vector<bool> q_has_zero_column;
};
FactorSummary summarize_factors(const PowerSGDPlan& plan, const torch::Tensor& ps, const torch::Tensor& qs);

} // namespace detail
} // namespace lockstep
