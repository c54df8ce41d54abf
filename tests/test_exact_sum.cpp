// The pure parts of deterministic mode's sum (src/deterministic/exact_sum.h): the
// integers do not depend on the order or grouping of the terms, and what
// comes back is the mean to float's precision.

#include "deterministic/exact_sum.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace lockstep {
namespace detail {
namespace {

// Twelve micro-batches' "gradients", over many orders of magnitude.
std::vector<torch::Tensor> terms() {
  torch::manual_seed(3);
  std::vector<torch::Tensor> out;
  for (int v = 0; v < 12; ++v) {
    out.push_back(torch::randn({4096}) * torch::pow(10.0, torch::randint(-8, 3, {4096}).to(torch::kFloat)));
  }
  return out;
}

double largest_of(const std::vector<torch::Tensor>& values) {
  double m = 0;
  for (const auto& v : values) {
    m = std::max(m, v.abs().max().item<double>());
  }
  return m;
}

TEST(ExactSum, TheExponentIsTheLargestThatCannotOverflow) {
  for (double m : {1.0, 0.75, 3e-41, 1e-8, 123.0, 3.4e38}) {
    for (int64_t terms : {1, 2, 3, 12, 1024}) {
      const int e = fixed_point_exponent(m, terms);
      // terms * m * 2^e < 2^62, and with e + 1 a sum of terms copies of the
      // next power of two above m reaches it.
      EXPECT_LT(std::log2(static_cast<double>(terms)) + std::log2(m) + e, 62.0) << m << " " << terms;
      int p = 0;
      std::frexp(m, &p);
      const int bits = static_cast<int>(std::ceil(std::log2(static_cast<double>(terms))));
      EXPECT_EQ(p + bits + e, 62) << m << " " << terms;
    }
  }
  EXPECT_EQ(fixed_point_exponent(0.0, 5), 0);
}

// Micro-batches 0..11 summed as W = 1, 2, 3, 4 and 6 ranks would sum them
// (each rank its share, then the shares across ranks in another order),
// where float sums differ.
TEST(ExactSum, EveryGroupingGivesTheSameIntegers) {
  const auto values = terms();
  const int e = fixed_point_exponent(largest_of(values), 12);
  std::vector<torch::Tensor> sums;
  std::vector<torch::Tensor> float_sums;
  for (int world : {1, 2, 3, 4, 6}) {
    const int share = 12 / world;
    auto total = torch::zeros({4096}, torch::kLong);
    auto float_total = torch::zeros({4096});
    for (int r = world - 1; r >= 0; --r) { // across ranks: last rank first
      auto partial = torch::zeros({4096}, torch::kLong);
      auto float_partial = torch::zeros({4096});
      for (int k = 0; k < share; ++k) {
        add_fixed_point(partial, values[r * share + k], e);
        float_partial += values[r * share + k];
      }
      total += partial;
      float_total += float_partial;
    }
    sums.push_back(total);
    float_sums.push_back(float_total);
  }
  bool floats_differ = false;
  for (size_t i = 1; i < sums.size(); ++i) {
    EXPECT_TRUE(torch::equal(sums[0], sums[i])) << i;
    floats_differ = floats_differ || !torch::equal(float_sums[0], float_sums[i]);
  }
  EXPECT_TRUE(floats_differ) << "the float sums must depend on the grouping, or this test shows nothing";
}

TEST(ExactSum, TheMeanIsFloatsOwnRoundingOfTheExactOne) {
  const auto values = terms();
  const int e = fixed_point_exponent(largest_of(values), 12);
  auto sum = torch::zeros({4096}, torch::kLong);
  auto exact = torch::zeros({4096}, torch::kDouble);
  for (const auto& v : values) {
    add_fixed_point(sum, v, e);
    exact += v.to(torch::kDouble);
  }
  const auto mean = from_fixed_point(sum, e, 12, torch::kFloat, {4096});
  EXPECT_EQ(mean.scalar_type(), torch::kFloat);
  const auto reference = (exact / 12).to(torch::kFloat);
  // Above M * 2^-30, the mean is within one float ulp of the exact one.
  const auto large = reference.abs() > largest_of(values) * std::ldexp(1.0, -30);
  const auto ulp = torch::nextafter(reference.abs(), torch::full({4096}, INFINITY)) - reference.abs();
  EXPECT_TRUE(((mean - reference).abs() <= ulp).masked_select(large).all().item<bool>());
}

TEST(ExactSum, OneTermComesBackBitForBit) {
  for (double scale : {1e-40, 1e-20, 1.0, 1e20, 1e38}) {
    auto value = (torch::linspace(0.25, 1, 97) * scale).to(torch::kFloat);
    const int e = fixed_point_exponent(value.abs().max().item<double>(), 1);
    auto sum = torch::zeros({97}, torch::kLong);
    add_fixed_point(sum, value, e);
    EXPECT_TRUE(torch::equal(from_fixed_point(sum, e, 1, torch::kFloat, {97}), value)) << scale;
  }
  auto d = torch::linspace(-1, 1, 33, torch::kDouble) * 1e-300;
  const int e = fixed_point_exponent(1e-300, 1);
  auto sum = torch::zeros({33}, torch::kLong);
  add_fixed_point(sum, d, e);
  EXPECT_TRUE(torch::allclose(from_fixed_point(sum, e, 1, torch::kDouble, {33}), d, 1e-15, 0));
}

TEST(ExactSum, AddingDoesNotChangeTheTermAndWritingReplacesTheSum) {
  auto value = torch::full({5}, 0.5);
  auto sum = torch::zeros({5}, torch::kLong);
  add_fixed_point(sum, value, 10);
  EXPECT_TRUE(torch::equal(value, torch::full({5}, 0.5)));
  EXPECT_TRUE(torch::equal(sum, torch::full({5}, 512, torch::kLong)));
  add_fixed_point(sum, value, 3, /*add=*/false);
  EXPECT_TRUE(torch::equal(sum, torch::full({5}, 4, torch::kLong)));
  auto strided = torch::full({5, 2}, 0.25).select(1, 0); // not contiguous: LibTorch's operators
  add_fixed_point(sum, strided, 4, /*add=*/false);
  EXPECT_TRUE(torch::equal(sum, torch::full({5}, 4, torch::kLong)));
  add_fixed_point(sum, strided, 4);
  EXPECT_TRUE(torch::equal(sum, torch::full({5}, 8, torch::kLong)));
}

// The one-pass loops (contiguous float and double on the CPU) and
// LibTorch's operators (anything else, a GPU's tensors among it) give the
// same integers and the same floats back.
TEST(ExactSum, TheLoopsAndTheOperatorsAgree) {
  const auto values = terms();
  const auto matrix = values[0].view({64, 64}) + values[1].view({64, 64});
  const int e = fixed_point_exponent(max_abs(matrix), 3);
  auto fast = torch::zeros({4096}, torch::kLong);
  auto general = torch::zeros({4096}, torch::kLong);
  add_fixed_point(fast, matrix.t().contiguous(), e);
  add_fixed_point(general, matrix.t(), e); // not contiguous
  EXPECT_TRUE(torch::equal(fast, general));
  EXPECT_EQ(max_abs(matrix.t()), max_abs(matrix));
  EXPECT_EQ(max_abs(matrix), matrix.abs().max().item<double>());
  EXPECT_TRUE(std::isnan(max_abs(torch::tensor({1.0, std::nan(""), 2.0}))));
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    const auto loop = from_fixed_point(fast * 3, e, 12, dtype, {4096});
    const auto ops = (fast * 3).to(torch::kDouble).mul_(std::ldexp(1.0, -e / 2)).mul_(std::ldexp(1.0, -e + e / 2)).div_(12.0).to(dtype);
    EXPECT_TRUE(torch::equal(loop, ops)) << dtype;
  }
}

// The loop rounds half to even without std::nearbyint, and takes the
// largest magnitude from the values' bits: the same integers as torch::round
// on ties and on the largest doubles below and above 2^52, and the same
// maximum as the operators for every kind of value, NaN and infinities
// included.
TEST(ExactSum, TheLoopsRoundTiesToEvenAndFindTheLargestMagnitudeFromTheBits) {
  const double two52 = std::ldexp(1.0, 52);
  const std::vector<double> hard{0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999999999999994, -0.0, 1e-300,
                                 two52 - 0.5, two52 - 1.5, -(two52 - 0.5), std::ldexp(1.0, 51) + 0.5, two52 + 2,
                                 -std::ldexp(1.0, 61), std::ldexp(1.0, 61) - 512,
                                 // around the split at multiples of 2^32 (Note [Rounding to integers without a conversion])
                                 std::ldexp(1.0, 31) + 0.5, std::ldexp(1.0, 31) + 1.5, 3 * std::ldexp(1.0, 31),
                                 std::ldexp(1.0, 32) + 0.5, -(std::ldexp(1.0, 32) + 1.5), std::ldexp(1.0, 33) - 0.5,
                                 std::ldexp(1.0, 52) + std::ldexp(1.0, 31) + 1, std::ldexp(1.0, 62) - 1024,
                                 -(std::ldexp(1.0, 62) - 1024)};
  auto sum = torch::zeros({static_cast<int64_t>(hard.size())}, torch::kLong);
  add_fixed_point(sum, torch::tensor(hard, torch::kDouble), 0, /*add=*/false);
  EXPECT_TRUE(torch::equal(sum, torch::tensor(hard, torch::kDouble).round().to(torch::kLong))) << sum;
  torch::manual_seed(3);
  const auto random = torch::randn({100000}, torch::kDouble) * 1000;
  auto looped = torch::zeros({100000}, torch::kLong);
  add_fixed_point(looped, random, 40, /*add=*/false);
  EXPECT_TRUE(torch::equal(looped, (random * std::ldexp(1.0, 40)).round().to(torch::kLong)));
  add_fixed_point(looped, random, 49, /*add=*/false); // up to about 2^61
  EXPECT_TRUE(torch::equal(looped, (random * std::ldexp(1.0, 49)).round().to(torch::kLong)));
  const double inf = std::numeric_limits<double>::infinity();
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    EXPECT_EQ(max_abs(torch::tensor({-3.0, 2.0, 1e-40}, dtype)), 3.0) << dtype;
    EXPECT_EQ(max_abs(torch::tensor({1e-45, -1e-44}, dtype)), torch::tensor({1e-44}, dtype).item<double>()) << dtype;
    EXPECT_EQ(max_abs(torch::tensor({1.0, -inf, 2.0}, dtype)), inf) << dtype;
    EXPECT_TRUE(std::isnan(max_abs(torch::tensor({1.0, inf, -std::nan("")}, dtype)))) << dtype;
    EXPECT_EQ(max_abs(torch::tensor({-0.0, 0.0}, dtype)), 0.0) << dtype;
  }
}

TEST(ExactSum, EachMicroBatchHasASeedOfItsOwn) {
  EXPECT_EQ(micro_batch_seed(1, 2, 3), micro_batch_seed(1, 2, 3));
  std::vector<uint64_t> seeds;
  for (uint64_t seed : {0, 1}) {
    for (int64_t step : {0, 1, 2}) {
      for (int64_t v : {0, 1, 2}) {
        seeds.push_back(micro_batch_seed(seed, step, v));
      }
    }
  }
  std::sort(seeds.begin(), seeds.end());
  EXPECT_EQ(std::unique(seeds.begin(), seeds.end()), seeds.end());
}

} // namespace
} // namespace detail
} // namespace lockstep
