#pragma once

// Comparing a wrapped module with the bare one: copies, and parameter and
// buffer checks that name the first tensor that differs.

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace lockstep {
namespace testing {

/// A deep copy of a TORCH_MODULE holder: its own parameters and buffers.
template <typename Net>
Net deep_copy(const Net& net) {
  return Net(std::dynamic_pointer_cast<typename Net::ContainedType>(net->clone()));
}

/// Copies `from`'s parameter values into `to`'s, which has the same layout.
inline void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto src = from.parameters();
  auto dst = to.parameters();
  ASSERT_EQ(src.size(), dst.size());
  for (size_t i = 0; i < src.size(); ++i) {
    dst[i].copy_(src[i]);
  }
}

/// Whether every parameter of `a` equals the same parameter of `b` bitwise.
inline bool parameters_equal(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters();
  auto pb = b.parameters();
  if (pa.size() != pb.size()) {
    return false;
  }
  for (size_t i = 0; i < pa.size(); ++i) {
    if (!torch::equal(pa[i], pb[i])) {
      return false;
    }
  }
  return true;
}

/// `a` and `b` hold the same answer computed along different paths: a replica
/// multiplies its share of the batch, so BLAS may round differently, and an
/// output near zero then fails `allclose`'s default atol of 1e-8. The
/// tolerances here are far below any real defect's difference.
inline ::testing::AssertionResult same_answer(const torch::Tensor& a, const torch::Tensor& b, double rtol = 1e-5,
                                              double atol = 1e-6) {
  if (a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure() << "sizes differ: " << a.sizes() << " and " << b.sizes();
  }
  if (torch::allclose(a, b, rtol, atol)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "differ by up to " << (a - b).abs().max().item<double>();
}

/// Every parameter of `a` close to the same parameter of `b`.
inline void expect_params_close(torch::nn::Module& a, torch::nn::Module& b, double rtol = 1e-5, double atol = 1e-6) {
  auto pa = a.named_parameters();
  auto pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::allclose(pa[i].value(), pb[i].value(), rtol, atol))
        << pa[i].key() << " differs by " << (pa[i].value() - pb[i].value()).abs().max().item<double>();
  }
}

/// Every parameter's .grad of `a` defined and close to the same one of `b`.
inline void expect_grads_close(torch::nn::Module& a, torch::nn::Module& b, double rtol = 1e-5, double atol = 1e-6) {
  auto pa = a.named_parameters();
  auto pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    const auto& ga = pa[i].value().grad();
    const auto& gb = pb[i].value().grad();
    ASSERT_TRUE(ga.defined() && gb.defined()) << pa[i].key();
    EXPECT_TRUE(torch::allclose(ga, gb, rtol, atol)) << pa[i].key() << " differs by " << (ga - gb).abs().max().item<double>();
  }
}

/// Every buffer of `a` close to the same buffer of `b`, compared in double.
inline void expect_buffers_close(torch::nn::Module& a, torch::nn::Module& b, double rtol = 1e-5, double atol = 1e-6) {
  auto ba = a.named_buffers();
  auto bb = b.named_buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (size_t i = 0; i < ba.size(); ++i) {
    EXPECT_TRUE(torch::allclose(ba[i].value().to(torch::kDouble), bb[i].value().to(torch::kDouble), rtol, atol))
        << ba[i].key();
  }
}

} // namespace testing
} // namespace lockstep
