#include "deterministic/exact_sum.h"

#include "util/cpu_clones.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace lockstep {
namespace detail {
namespace {

constexpr int kSumBits = 62; // below int64's 63, so no sum reaches its limit
constexpr int64_t kGrain = 1 << 15; // elements per task of at::parallel_for

int ceil_log2(int64_t n) {
  int bits = 0;
  while ((int64_t{1} << bits) < n) {
    ++bits;
  }
  return bits;
}

// One pass over the elements where they are contiguous float or double on
// the CPU; elsewhere (a GPU) LibTorch's operators compute the same values
// (each a correctly rounded product or quotient).
bool on_cpu_as_float_or_double(const torch::Tensor& t) {
  return t.is_cpu() && t.is_contiguous() && (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kDouble);
}

// 2^exponent as two factors, each a double: a subnormal gradient's exponent
// is above 1023, double's largest. Multiplied in turn, they scale exactly
// wherever the result is a normal double.
struct Scale {
  explicit Scale(int exponent) : first(std::ldexp(1.0, exponent / 2)), second(std::ldexp(1.0, exponent - exponent / 2)) {}
  double first, second;
};

// Note [Rounding to integers without a conversion]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Below AVX512 no x86 vector instruction turns a double into an int64, so a
// loop of static_cast<int64_t> runs one element at a time. Instead, adding
// K = 1.5 * 2^52 to a double y with |y| < 2^51 leaves a double in
// [2^52, 2^53), whose spacing is 1: the addition rounds y half to even, as
// std::nearbyint does in the default rounding mode, and the bits of the sum,
// read as an integer, are K's bits plus that integer. A scaled gradient is
// below 2^62, so y is first split exactly into hi, a multiple of 2^32 (y
// rounded by adding 1.5 * 2^84, whose spacing is 2^32), and lo = y - hi,
// with |lo| <= 2^31 (the subtraction is exact: lo is a multiple of y's
// spacing and smaller than y or 2^31). hi / 2^32 and lo each go through K,
// and q = (hi / 2^32) * 2^32 + round(lo), which is round(y) because hi is
// even. Every step is an exact integer operation or an IEEE addition (the
// scaling by powers of two before it is exact, so a fused multiply-add
// rounds as the two operations do), so each CPU's clone
// (LOCKSTEP_CPU_CLONES) gives the same bits, and the loop vectorises down to
// SSE2.
constexpr double kTwo32 = 4294967296.0;
constexpr double kRoundToOne = 6755399441055744.0;     // 1.5 * 2^52
constexpr double kRoundToTwo32 = kRoundToOne * kTwo32; // 1.5 * 2^84

inline int64_t bits_of(double x) {
  int64_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

// round(y), half to even, for |y| < 2^62: Note [Rounding to integers without a conversion].
inline int64_t round_to_int64(double y) {
  const int64_t k = bits_of(kRoundToOne);
  const double hi = (y + kRoundToTwo32) - kRoundToTwo32;
  const double lo = y - hi;
  const int64_t high = bits_of(hi / kTwo32 + kRoundToOne) - k;
  const int64_t low = bits_of(lo + kRoundToOne) - k;
  return static_cast<int64_t>(static_cast<uint64_t>(high) << 32) + low;
}

template <typename T>
inline __attribute__((always_inline)) void add_scaled_range(int64_t* sum, const T* value, int64_t n, double first,
                                                            double second, bool add) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t q = round_to_int64(static_cast<double>(value[i]) * first * second);
    sum[i] = add ? sum[i] + q : q;
  }
}

LOCKSTEP_CPU_CLONES void add_scaled_floats(int64_t* sum, const float* value, int64_t n, double first, double second,
                                           bool add) {
  add_scaled_range(sum, value, n, first, second, add);
}

LOCKSTEP_CPU_CLONES void add_scaled_doubles(int64_t* sum, const double* value, int64_t n, double first,
                                            double second, bool add) {
  add_scaled_range(sum, value, n, first, second, add);
}

template <typename T>
void add_scaled(int64_t* sum, const T* value, int64_t n, Scale scale, bool add) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, float>) {
      add_scaled_floats(sum + begin, value + begin, end - begin, scale.first, scale.second, add);
    } else {
      add_scaled_doubles(sum + begin, value + begin, end - begin, scale.first, scale.second, add);
    }
  });
}

template <typename T>
inline __attribute__((always_inline)) void scale_back_range(T* out, const int64_t* sum, int64_t n, double first,
                                                            double second, double divisor) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<T>(static_cast<double>(sum[i]) * first * second / divisor);
  }
}

LOCKSTEP_CPU_CLONES void scale_back_floats(float* out, const int64_t* sum, int64_t n, double first, double second,
                                           double divisor) {
  scale_back_range(out, sum, n, first, second, divisor);
}

LOCKSTEP_CPU_CLONES void scale_back_doubles(double* out, const int64_t* sum, int64_t n, double first, double second,
                                            double divisor) {
  scale_back_range(out, sum, n, first, second, divisor);
}

template <typename T>
void scale_back(T* out, const int64_t* sum, int64_t n, Scale scale, double divisor) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, float>) {
      scale_back_floats(out + begin, sum + begin, end - begin, scale.first, scale.second, divisor);
    } else {
      scale_back_doubles(out + begin, sum + begin, end - begin, scale.first, scale.second, divisor);
    }
  });
}

// The largest |x|, or NaN where one is NaN, from the bits: without their
// sign, IEEE floats of one width order as unsigned integers of that width,
// infinity above every finite value and NaNs above infinity. An integer
// maximum vectorises, where a floating-point one with NaN checks does not.
template <typename T, typename Bits>
inline __attribute__((always_inline)) double max_abs_of(const T* value, int64_t n) {
  static_assert(sizeof(T) == sizeof(Bits), "the bits of one value");
  constexpr Bits kMagnitude = ~Bits{0} >> 1;
  Bits largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, value + i, sizeof(bits));
    bits &= kMagnitude;
    largest = bits > largest ? bits : largest;
  }
  T result;
  std::memcpy(&result, &largest, sizeof(result));
  return static_cast<double>(result); // a NaN stays NaN
}

LOCKSTEP_CPU_CLONES double max_abs_of_floats(const float* value, int64_t n) {
  return max_abs_of<float, uint32_t>(value, n);
}

LOCKSTEP_CPU_CLONES double max_abs_of_doubles(const double* value, int64_t n) {
  return max_abs_of<double, uint64_t>(value, n);
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

double max_abs(const torch::Tensor& value) {
  if (value.numel() == 0) {
    return 0;
  }
  if (!on_cpu_as_float_or_double(value)) {
    return value.abs().max().item<double>();
  }
  return value.scalar_type() == torch::kFloat ? max_abs_of_floats(value.data_ptr<float>(), value.numel())
                                              : max_abs_of_doubles(value.data_ptr<double>(), value.numel());
}

void add_fixed_point(torch::Tensor& sum, const torch::Tensor& value, int exponent, bool add) {
  TORCH_INTERNAL_ASSERT(sum.scalar_type() == torch::kLong && sum.is_contiguous() && sum.numel() == value.numel());
  const Scale scale(exponent);
  if (!sum.is_cpu() || !on_cpu_as_float_or_double(value)) {
    // round_to_int64 and torch::round both round half to even.
    auto scaled = value.reshape({-1}).to(torch::kDouble).mul(scale.first).mul_(scale.second).round_();
    add ? sum.view({-1}).add_(scaled.to(torch::kLong)) : sum.view({-1}).copy_(scaled);
    return;
  }
  auto* out = sum.data_ptr<int64_t>();
  if (value.scalar_type() == torch::kFloat) {
    add_scaled(out, value.data_ptr<float>(), value.numel(), scale, add);
  } else {
    add_scaled(out, value.data_ptr<double>(), value.numel(), scale, add);
  }
}

torch::Tensor from_fixed_point(const torch::Tensor& sum, int exponent, int64_t divisor, torch::ScalarType dtype,
                               at::IntArrayRef sizes) {
  auto out = torch::empty(sizes, sum.options().dtype(dtype));
  from_fixed_point_into(out, sum, exponent, divisor);
  return out;
}

void from_fixed_point_into(torch::Tensor out, const torch::Tensor& sum, int exponent, int64_t divisor) {
  const Scale scale(-exponent);
  TORCH_INTERNAL_ASSERT(out.numel() == sum.numel());
  const auto dtype = out.scalar_type();
  if (!sum.is_cpu() || !sum.is_contiguous() || !out.is_contiguous() ||
      (dtype != torch::kFloat && dtype != torch::kDouble)) {
    auto value = sum.reshape({-1}).to(torch::kDouble).mul_(scale.first).mul_(scale.second);
    // A tensor divisor, not a double: ATen's CUDA kernels multiply by the
    // reciprocal of a number given from the CPU, which can differ from the
    // quotient in the last bit; with a tensor on the device they divide.
    out.view({-1}).copy_(value.div_(torch::scalar_tensor(static_cast<double>(divisor), value.options())));
    return;
  }
  const auto* in = sum.data_ptr<int64_t>();
  if (dtype == torch::kFloat) {
    scale_back(out.data_ptr<float>(), in, sum.numel(), scale, static_cast<double>(divisor));
  } else {
    scale_back(out.data_ptr<double>(), in, sum.numel(), scale, static_cast<double>(divisor));
  }
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
