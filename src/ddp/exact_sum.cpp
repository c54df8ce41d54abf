#include "ddp/exact_sum.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <cmath>

namespace lockstep {
namespace detail {
namespace {

constexpr int kSumBits = 62; // below int64's 63, so no sum reaches its limit

// Scaling by 2^e stays exact in float only while 2^e itself is a float:
// larger steps are taken in two.
constexpr int kOneStep = 120;

int ceil_log2(int64_t n) {
  int bits = 0;
  while ((int64_t{1} << bits) < n) {
    ++bits;
  }
  return bits;
}

} // namespace

int fixed_point_exponent(double max_abs, int64_t terms) {
  TORCH_INTERNAL_ASSERT(std::isfinite(max_abs) && max_abs >= 0 && terms >= 1);
  if (max_abs == 0) {
    return 0;
  }
  int e = 0;
  std::frexp(max_abs, &e); // max_abs < 2^e
  // terms * max_abs * 2^exponent < 2^(ceil_log2(terms) + e + exponent) = 2^kSumBits.
  return kSumBits - e - ceil_log2(terms);
}

void add_fixed_point(torch::Tensor& sum, const torch::Tensor& value, int exponent) {
  TORCH_INTERNAL_ASSERT(sum.scalar_type() == torch::kLong && sum.numel() == value.numel());
  const auto type = value.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto scaled = value.reshape({-1}).to(type, /*non_blocking=*/false, /*copy=*/true);
  for (int left = exponent; left != 0;) {
    const int step = left > kOneStep ? kOneStep : (left < -kOneStep ? -kOneStep : left);
    scaled.mul_(std::ldexp(1.0, step));
    left -= step;
  }
  sum.view({-1}).add_(scaled.round_().to(torch::kLong));
}

torch::Tensor from_fixed_point(const torch::Tensor& sum, int exponent, int64_t divisor, torch::ScalarType dtype) {
  auto value = sum.to(torch::kDouble);
  value.mul_(std::ldexp(1.0, -exponent)).div_(static_cast<double>(divisor));
  return value.to(dtype);
}

uint64_t micro_batch_seed(uint64_t seed, int64_t step, int64_t micro_batch) {
  auto mix = [](uint64_t x) { // splitmix64's finaliser
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  return mix(mix(mix(seed) + static_cast<uint64_t>(step)) + static_cast<uint64_t>(micro_batch));
}

} // namespace detail
} // namespace lockstep
