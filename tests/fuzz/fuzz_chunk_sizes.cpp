// Fuzz target: chunk_sizes, and the scatter planner's batch-size checks
// (find_split_sites, batch_size_of) over tensors of any shape and split dim,
// nested in vectors. A c10::Error is the right answer to bad input; anything
// else is a failure, as is a split that breaks chunk_sizes' promises.

#include <lockstep/scatter_gather.h>

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

namespace {

void check_chunk_sizes(FuzzedDataProvider& input) {
  const int64_t batch = input.ConsumeBool() ? input.ConsumeIntegral<int64_t>() : input.ConsumeIntegralInRange<int64_t>(-2, 1000);
  const int64_t replicas =
      input.ConsumeBool() ? input.ConsumeIntegral<int64_t>() : input.ConsumeIntegralInRange<int64_t>(-2, 64);
  std::vector<double> weights;
  if (input.ConsumeBool()) {
    const size_t n = input.ConsumeIntegralInRange<size_t>(0, 70);
    for (size_t i = 0; i < n; ++i) {
      weights.push_back(input.ConsumeBool() ? input.ConsumeFloatingPoint<double>()
                                            : input.ConsumeFloatingPointInRange<double>(0.0, 10.0));
    }
  }
  std::vector<int64_t> sizes;
  try {
    sizes = lockstep::chunk_sizes(batch, replicas, weights);
  } catch (const c10::Error&) {
    return;
  }
  // Sizes sum to the batch, none is negative, and each is within one row of
  // its exact share.
  if (static_cast<int64_t>(sizes.size()) != replicas) {
    std::abort();
  }
  // Shares from weights scaled by the largest, which cannot overflow.
  double largest = 0;
  for (int64_t i = 0; i < replicas; ++i) {
    largest = std::max(largest, weights.empty() ? 1.0 : weights[i]);
  }
  double total = 0;
  for (int64_t i = 0; i < replicas; ++i) {
    total += (weights.empty() ? 1.0 : weights[i]) / largest;
  }
  int64_t sum = 0;
  for (int64_t i = 0; i < replicas; ++i) {
    const double share = (weights.empty() ? 1.0 : weights[i]) / largest / total;
    const double exact = static_cast<double>(batch) * share;
    if (sizes[i] < 0 || std::fabs(static_cast<double>(sizes[i]) - exact) > 1.0 + 1e-9 * static_cast<double>(batch)) {
      std::abort();
    }
    sum += sizes[i];
  }
  if (sum != batch) {
    std::abort();
  }
}

// A tensor of a fuzzed shape that owns one element at most: every shape,
// however large its sizes, costs no memory.
torch::Tensor shaped(FuzzedDataProvider& input) {
  const size_t ndim = input.ConsumeIntegralInRange<size_t>(0, 5);
  std::vector<int64_t> sizes;
  for (size_t d = 0; d < ndim; ++d) {
    sizes.push_back(input.ConsumeBool() ? input.ConsumeIntegralInRange<int64_t>(0, 1 << 30)
                                        : input.ConsumeIntegralInRange<int64_t>(0, 9));
  }
  return sizes.empty() ? torch::zeros({}) : torch::zeros({1}).expand(sizes);
}

void check_split_sites(FuzzedDataProvider& input) {
  const int64_t dim = input.ConsumeIntegralInRange<int64_t>(-7, 7);
  try {
    // LibTorch refuses shapes whose element count overflows, with a c10::Error.
    torch::Tensor first = shaped(input);
    std::vector<torch::Tensor> list;
    const size_t n = input.ConsumeIntegralInRange<size_t>(0, 4);
    for (size_t i = 0; i < n; ++i) {
      list.push_back(shaped(input));
    }
    torch::Tensor last = shaped(input);
    const auto sites = lockstep::detail::find_split_sites(dim, first, list, last);
    const int64_t batch = lockstep::detail::batch_size_of(sites);
    if (batch < 0) {
      std::abort();
    }
  } catch (const c10::Error&) {
  }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider input(data, size);
  if (input.ConsumeBool()) {
    check_chunk_sizes(input);
  } else {
    check_split_sites(input);
  }
  return 0;
}
