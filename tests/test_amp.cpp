// AutocastGuard and GradScaler in one thread (Note [Mixed precision] in
// src/amp.cpp). Their thread and multi-rank behaviour is in
// test_amp_threads.cpp.

#include <lockstep/lockstep.h>

#include "src/util/torch_compat.h"
#include "support/errors.h"
#include "support/warnings.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep {
namespace {

torch::ScalarType mm_dtype() {
  auto a = torch::randn({4, 4});
  return torch::mm(a, a).scalar_type();
}

TEST(AutocastGuard, NestsAndRestoresTheStateItFound) {
  ASSERT_EQ(mm_dtype(), torch::kFloat);
  {
    AutocastGuard outer(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(mm_dtype(), torch::kBFloat16);
    {
      AutocastGuard off(torch::kCPU, torch::kBFloat16, /*enabled=*/false);
      EXPECT_EQ(mm_dtype(), torch::kFloat);
    }
    EXPECT_EQ(mm_dtype(), torch::kBFloat16);
#if TORCH_VERSION_MAJOR >= 2
    {
      AutocastGuard half(torch::kCPU, torch::kHalf);
      EXPECT_EQ(mm_dtype(), torch::kHalf);
    }
    EXPECT_EQ(mm_dtype(), torch::kBFloat16) << "the inner guard's dtype outlived it";
#endif
  }
  EXPECT_EQ(mm_dtype(), torch::kFloat);
}

// Autocast caches its bfloat16 copy of a weight while a guard is open; the
// outermost guard's end drops it, so the next guard sees the updated weight.
TEST(AutocastGuard, TheOutermostGuardClearsTheCastCache) {
  auto x = torch::randn({4, 8});
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto fresh = [&] { return torch::mm(x.to(torch::kBFloat16), w.detach().to(torch::kBFloat16)); };
  {
    AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    EXPECT_TRUE(torch::equal(torch::mm(x, w), fresh()));
    torch::NoGradGuard no_grad;
    w.add_(1.0);
  }
  AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  EXPECT_TRUE(torch::equal(torch::mm(x, w), fresh())) << "a new guard computed with the weight before the step";
}

// A guard without cache_enabled keeps what it found, as Python's
// cache_enabled=None: inside an outer guard that turned the cache off, a
// nested one (a library's own) must not turn it back on, and ends with it
// as it found it.
TEST(AutocastGuard, ANestedGuardInheritsTheCacheSetting) {
  ASSERT_TRUE(at::autocast::is_autocast_cache_enabled());
  {
    AutocastGuard outer(torch::kCPU, torch::kBFloat16, /*enabled=*/true, /*cache_enabled=*/false);
    {
      AutocastGuard inner(torch::kCPU, torch::kBFloat16);
      EXPECT_FALSE(at::autocast::is_autocast_cache_enabled()) << "the nested guard turned the cache back on";
    }
    EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
  }
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
  AutocastGuard top(torch::kCPU, torch::kBFloat16);
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled()) << "a guard alone keeps the default, on";
}

TEST(AutocastGuard, RefusesWhatAutocastCannotRun) {
  EXPECT_ERROR_SAYS(AutocastGuard(torch::kCPU, torch::kFloat), "dtype Float is not a lower precision");
  // XPU has autocast in PyTorch 2.x, but lockstep carries only CPU's and CUDA's state to replicas and recomputation.
  EXPECT_ERROR_SAYS(AutocastGuard(c10::DeviceType::XPU, torch::kBFloat16), "lockstep runs autocast for CPU and CUDA "
                    "tensors, not xpu ones", "use torch::kCPU or torch::kCUDA");
#if TORCH_VERSION_MAJOR < 2
  EXPECT_ERROR_SAYS(AutocastGuard(torch::kCPU, torch::kHalf), "CPU autocast to float16 needs PyTorch 2.4");
#endif
  EXPECT_EQ(mm_dtype(), torch::kFloat) << "a refused guard left autocast on";
}

// AutocastGuard(kCUDA, ...) on a machine without CUDA was on, without a
// word, while every tensor, on the CPU, ran in fp32: as Python's
// torch.autocast("cuda") there, it warns and is off. With CUDA, it is on.
TEST(AutocastGuard, ACudaGuardWithoutCudaIsSaidAndOff) {
  bool on = false;
  const auto warned = testing::warning_text_of([&] {
    AutocastGuard guard(torch::kCUDA, torch::kHalf);
    on = detail::autocast_enabled(c10::DeviceType::CUDA);
  });
  if (torch::cuda::is_available()) {
    EXPECT_TRUE(on);
    EXPECT_EQ(warned, "");
  } else {
    EXPECT_FALSE(on);
    EXPECT_NE(warned.find("autocast for CUDA, but this machine has no CUDA device, so the guard is off"),
              std::string::npos) << warned;
  }
  EXPECT_FALSE(detail::autocast_enabled(c10::DeviceType::CUDA)) << "the guard restored what it found";
}

// `AutocastGuard g(kCPU, amp ? kBFloat16 : kFloat, amp)`, as torch.autocast
// takes float32 when disabled: the guard turns autocast off and keeps the
// dtype an enclosing guard set.
TEST(AutocastGuard, ADisabledGuardTakesAnyDtypeAndKeepsTheOneItFound) {
  AutocastGuard outer(torch::kCPU, torch::kBFloat16);
  {
    AutocastGuard off(torch::kCPU, torch::kFloat, /*enabled=*/false);
    EXPECT_EQ(mm_dtype(), torch::kFloat);
    EXPECT_EQ(detail::autocast_dtype(torch::kCPU), torch::kBFloat16);
  }
  EXPECT_EQ(mm_dtype(), torch::kBFloat16);
}

// PyTorch's test_grad_scaling_update_scale: growth 2, backoff 0.25, interval 2.
TEST(GradScaler, TheScaleSequenceOfPyTorchsUpdateScaleTest) {
  auto s = detail::next_scale(4.0f, 0, false, 2.0, 0.25, 2);
  EXPECT_EQ(s, std::make_pair(4.0f, 1));
  s = detail::next_scale(s.first, s.second, false, 2.0, 0.25, 2);
  EXPECT_EQ(s, std::make_pair(8.0f, 0));
  s = detail::next_scale(s.first, s.second, true, 2.0, 0.25, 2);
  EXPECT_EQ(s, std::make_pair(2.0f, 0));
  const float largest = std::numeric_limits<float>::max();
  EXPECT_EQ(detail::next_scale(largest, 1, false, 2.0, 0.25, 2), std::make_pair(largest, 0)) << "grew into inf";
}

// One scaled backward of sum(w * x) for a parameter w, with an inf in its
// gradient when `overflow`, then step and update.
bool scaled_step(GradScaler& scaler, torch::optim::Optimizer& optimizer, torch::Tensor w, bool overflow) {
  optimizer.zero_grad();
  auto x = torch::full({3}, overflow ? std::numeric_limits<float>::infinity() : 1.0f);
  scaler.scale((w * x).sum()).backward();
  const bool stepped = scaler.step(optimizer);
  scaler.update();
  return stepped;
}

TEST(GradScaler, FollowsTheSameSequenceThroughRealSteps) {
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD sgd({w}, 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(4.0).growth_factor(2.0).backoff_factor(0.25).growth_interval(2));
  EXPECT_TRUE(scaled_step(scaler, sgd, w, false));
  EXPECT_EQ(scaler.get_scale(), 4.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
  EXPECT_TRUE(scaled_step(scaler, sgd, w, false));
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_FALSE(scaled_step(scaler, sgd, w, true));
  EXPECT_EQ(scaler.get_scale(), 2.0);
  EXPECT_TRUE(torch::allclose(w, torch::full({3}, 0.8f))) << "the unscaled gradient is 1, so two steps of 0.1";
}

TEST(GradScaler, ASkippedStepLeavesParametersAndOptimizerStateUntouched) {
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::Adam adam({w}, 0.1);
  GradScaler scaler;
  ASSERT_TRUE(scaled_step(scaler, adam, w, false));
  const auto weight = w.detach().clone();
  std::ostringstream before;
  {
    torch::serialize::OutputArchive archive;
    adam.save(archive);
    archive.save_to(before);
  }
  EXPECT_FALSE(scaled_step(scaler, adam, w, true));
  EXPECT_TRUE(torch::equal(w.detach(), weight));
  std::ostringstream after;
  torch::serialize::OutputArchive archive;
  adam.save(archive);
  archive.save_to(after);
  EXPECT_EQ(before.str(), after.str()) << "the skipped step changed Adam's state";
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

// LibTorch's parameters() lists a tied weight once per name, so the
// optimizer holds it twice: its gradient is unscaled once (it was divided
// by the scale twice, and the weight barely trained).
TEST(GradScaler, AWeightTheOptimizerHoldsTwiceIsUnscaledOnce) {
  auto w = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD sgd({w, w}, 0.0);
  GradScaler scaler(GradScalerOptions().init_scale(4));
  scaler.scale(w.sum()).backward();
  scaler.unscale_(sgd);
  EXPECT_TRUE(torch::allclose(w.grad(), torch::ones({4}))) << w.grad();
}

// A 0-dim parameter (CLIP's logit scale): the loss stays 0-dim, and its
// gradient unscales where ATen has no kernel for it (LibTorch 1.13's CPU),
// which threw "output with shape [] doesn't match the broadcast shape [1]".
TEST(GradScaler, AZeroDimParameterStepsAndTheLossStaysZeroDim) {
  auto p = torch::ones({}, torch::requires_grad());
  torch::optim::SGD sgd({p}, 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(8));
  auto scaled = scaler.scale(p * 3);
  EXPECT_EQ(scaled.dim(), 0);
  scaled.backward();
  scaler.step(sgd);
  scaler.update();
  EXPECT_NEAR(p.item<float>(), 0.7f, 1e-6);
}

// A float16 loss of more than one element (a per-pixel loss, or the output
// of a module under FullyShardedDataParallel's param_dtype) is scaled into
// float32, as PyTorch's scale() does: by a 0-dim scale it stayed float16,
// where 1 x 65536 is inf, and the mean's backward ran in float16 (with
// 2^25 elements, every gradient was 0 and the step was taken).
TEST(GradScaler, AFloat16LossIsScaledInFloat32) {
  auto w = torch::ones({4}, torch::requires_grad());
  GradScaler scaler; // 65536
  auto loss = (w * 1.5).to(torch::kHalf);
  auto scaled = scaler.scale(loss);
  EXPECT_EQ(scaled.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(scaled, torch::full({4}, 1.5 * 65536))) << scaled;
  scaled.mean().backward();
  EXPECT_TRUE(torch::allclose(w.grad(), torch::full({4}, 1.5 * 65536 / 4))) << w.grad();
  const auto total = scaler.scale(w.sum().to(torch::kHalf));
  EXPECT_EQ(total.scalar_type(), torch::kFloat);
  EXPECT_EQ(total.dim(), 0);
}

// A refused unscale_ records no inf check: update() after it is refused too,
// rather than counting the step as a good one.
TEST(GradScaler, ARefusedUnscaleRecordsNoCheck) {
  auto w = torch::ones({3}, torch::dtype(torch::kHalf).requires_grad(true));
  torch::optim::SGD sgd({w}, 0.1);
  GradScaler scaler(GradScalerOptions().growth_interval(1));
  scaler.scale((w.to(torch::kFloat) * 2).sum()).backward();
  EXPECT_ERROR_SAYS(scaler.unscale_(sgd), "parameter 1 (of [3]) is float16");
  EXPECT_ERROR_SAYS(scaler.update(), "no optimizer with gradients was unscaled or stepped since the last");
  EXPECT_EQ(scaler.get_scale(), 65536.0);
}

// As PyTorch's "No inf checks were recorded": an optimizer none of whose
// parameters has a gradient (a forgotten backward, a model the loss did not
// use) is refused at step, and counts for nothing at update(). It was
// stepped, and every such iteration counted towards the scale's growth.
TEST(GradScaler, AnOptimizerWithNoGradientIsRefusedAtStep) {
  auto w = torch::ones({3}, torch::requires_grad());
  auto idle_weight = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD sgd({w}, 0.1);
  torch::optim::SGD idle({idle_weight}, 0.1);
  GradScaler scaler(GradScalerOptions().growth_interval(1));
  scaler.scale((w * 2).sum()).backward();
  EXPECT_ERROR_SAYS(scaler.step(idle), "GradScaler::step: no parameter of the optimizer has a gradient",
                    "Run scaler.scale(loss).backward() before scaler.step(optimizer)");
  EXPECT_TRUE(scaler.step(sgd));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 131072.0) << "one good step, with growth_interval 1";
  w.mutable_grad() = torch::Tensor(); // then no backward
  EXPECT_ERROR_SAYS(scaler.step(sgd), "no parameter of the optimizer has a gradient");
  EXPECT_ERROR_SAYS(scaler.update(), "no optimizer with gradients was unscaled or stepped");
  EXPECT_EQ(scaler.get_scale(), 131072.0) << "an iteration without gradients grew the scale";
}

// unscale_, then clipping, then step: the same as clipping an unscaled step.
TEST(GradScaler, UnscaleThenClipMatchesClippingWithoutAScale) {
  torch::manual_seed(0);
  torch::nn::Linear reference(6, 2);
  torch::nn::Linear scaled(6, 2);
  {
    torch::NoGradGuard no_grad;
    scaled->weight.copy_(reference->weight);
    scaled->bias.copy_(reference->bias);
  }
  torch::optim::SGD ref_sgd(reference->parameters(), 0.1);
  torch::optim::SGD sgd(scaled->parameters(), 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(1024.0));
  auto x = torch::randn({5, 6});
  reference->forward(x).pow(2).sum().backward();
  torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
  ref_sgd.step();
  scaler.scale(scaled->forward(x).pow(2).sum()).backward();
  scaler.unscale_(sgd);
  torch::nn::utils::clip_grad_norm_(scaled->parameters(), 0.5);
  EXPECT_ERROR_SAYS(scaler.unscale_(sgd), "unscale_() was already called for this optimizer");
  EXPECT_TRUE(scaler.step(sgd));
  EXPECT_ERROR_SAYS(scaler.step(sgd), "step() was already called for this optimizer");
  scaler.update();
  EXPECT_TRUE(torch::allclose(scaled->weight, reference->weight, 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(scaled->bias, reference->bias, 1e-6, 1e-6));
}

TEST(GradScaler, StateRoundTripsThroughAnArchive) {
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD sgd({w}, 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(8.0).growth_interval(3).backoff_factor(0.25));
  scaled_step(scaler, sgd, w, true);
  scaled_step(scaler, sgd, w, false);
  scaled_step(scaler, sgd, w, false);
  std::stringstream bytes;
  torch::serialize::OutputArchive out;
  scaler.save(out);
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  GradScaler loaded;
  loaded.load(in);
  EXPECT_EQ(loaded.get_scale(), 2.0);
  EXPECT_EQ(loaded.growth_tracker(), 2);
  EXPECT_EQ(loaded.options().growth_interval(), 3);
  EXPECT_EQ(loaded.options().backoff_factor(), 0.25);
  scaled_step(loaded, sgd, w, false);
  EXPECT_EQ(loaded.get_scale(), 4.0) << "the loaded scaler did not grow on its third good step";

  torch::serialize::InputArchive empty;
  GradScaler fresh;
  EXPECT_ERROR_SAYS(fresh.load(empty), "the archive has no \"scale\"");

  // A resumed run's own growth_interval over the loaded one: the good steps
  // counted stay, up to the new interval less one.
  torch::serialize::InputArchive again;
  bytes.clear();
  bytes.seekg(0);
  again.load_from(bytes);
  GradScaler shorter;
  shorter.load(again);
  shorter.set_growth_interval(2);
  EXPECT_EQ(shorter.options().growth_interval(), 2);
  EXPECT_EQ(shorter.growth_tracker(), 1);
  scaled_step(shorter, sgd, w, false);
  EXPECT_EQ(shorter.get_scale(), 4.0) << "it did not grow at the new interval";
  EXPECT_ERROR_SAYS(shorter.set_growth_interval(0), "set_growth_interval: 0 is not a number of steps");
}

// A damaged or hand-made state is refused at load, naming the value: a
// scale of 0 or NaN skipped every step from then on, without an error.
TEST(GradScaler, LoadRefusesAStateThatCannotWork) {
  auto archive_with = [](const char* key, double value) {
    GradScaler saved;
    torch::serialize::OutputArchive out;
    saved.save(out);
    out.write(key, torch::tensor(value, torch::kDouble), /*is_buffer=*/true);
    std::stringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    return in;
  };
  GradScaler scaler(GradScalerOptions().init_scale(8.0));
  auto zero = archive_with("scale", 0.0);
  EXPECT_ERROR_SAYS(scaler.load(zero), "GradScaler::load: the archive's init_scale 0 must be a finite number from "
                    "float32's smallest normal (1.2e-38)");
  auto nan = archive_with("scale", std::nan(""));
  EXPECT_ERROR_SAYS(scaler.load(nan), "init_scale nan must be");
  auto backoff = archive_with("backoff_factor", 0.0);
  EXPECT_ERROR_SAYS(scaler.load(backoff), "the archive's backoff_factor 0 must be between 0 and 1");
  auto interval = archive_with("growth_interval", -3.0);
  EXPECT_ERROR_SAYS(scaler.load(interval), "the archive's growth_interval -3 must be a positive number");
  auto tracker = archive_with("_growth_tracker", 5000.0);
  EXPECT_ERROR_SAYS(scaler.load(tracker), "_growth_tracker 5000 must count the good steps");
  EXPECT_EQ(scaler.get_scale(), 8.0) << "a refused load changes nothing";
  EXPECT_ERROR_SAYS(GradScaler(GradScalerOptions().init_scale(1e39)), "init_scale 1e+39 must be a finite number");
  // Rounded to float32, 1e-50 is 0: every step would be skipped.
  EXPECT_ERROR_SAYS(GradScaler(GradScalerOptions().init_scale(1e-50)), "init_scale 1e-50 must be a finite number");
  GradScaler started(GradScalerOptions().init_scale(8.0));
  auto w = torch::ones({1}, torch::requires_grad());
  started.scale(w.sum()).backward();
  EXPECT_ERROR_SAYS(started.update(1e-40), "new_scale 1e-40 must be a finite number from float32's smallest normal");
}

// Note [The loss scale's floor]: skipped steps back the scale off down to
// float32's smallest normal number, not to 0 (or to a scale whose
// reciprocal is inf), so a run whose gradients are finite again steps again.
TEST(GradScaler, BackingOffStopsAtFloat32sSmallestNormalAndTheRunRecovers) {
  const double smallest = std::numeric_limits<float>::min();
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD sgd({w}, 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(2 * smallest).backoff_factor(0.5));
  for (int skipped = 0; skipped < 4; ++skipped) {
    EXPECT_FALSE(scaled_step(scaler, sgd, w, true));
    EXPECT_EQ(scaler.get_scale(), smallest) << "after " << skipped + 1 << " skipped steps";
  }
  EXPECT_TRUE(scaled_step(scaler, sgd, w, false)) << "a finite gradient must step again";
  EXPECT_TRUE(torch::allclose(w, torch::full({3}, 0.9f))) << "the unscaled gradient is 1: one step of 0.1";
  // The update without ATen's kernel (1.13 on some devices) keeps the same floor.
  EXPECT_EQ(detail::next_scale(static_cast<float>(smallest), 0, true, 2.0, 0.5, 10).first, static_cast<float>(smallest));
}

// The texts of the warnings raised while a WarningsTo guard holds it.
struct Warnings : detail::WarningTextHandler {
  std::vector<std::string> texts;
  void on_warning(const std::string& text) override {
    texts.push_back(text);
  }
};

// Note [The loss scale's floor]: a step skipped where the scale cannot back
// off further says why, and a scale loaded below the floor says it was raised.
TEST(GradScaler, WarnsWhenItSkipsAStepAtTheFloorOrLoadsAScaleBelowIt) {
  const double smallest = std::numeric_limits<float>::min();
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD sgd({w}, 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(4 * smallest).backoff_factor(0.5));
  Warnings warnings;
  {
    detail::WarningsTo to(warnings);
    scaled_step(scaler, sgd, w, true);
    scaled_step(scaler, sgd, w, true);
    EXPECT_TRUE(warnings.texts.empty()) << "the scales 4 and 2 times the floor back off to it: " << warnings.texts[0];
    scaled_step(scaler, sgd, w, true);
    ASSERT_EQ(warnings.texts.size(), 1u) << "a step skipped at the floor warns";
    EXPECT_NE(warnings.texts[0].find("the gradients hold inf or NaN at a loss scale of 1.17549e-38"), std::string::npos)
        << warnings.texts[0];

    GradScaler saved(GradScalerOptions().init_scale(8.0));
    torch::serialize::OutputArchive out;
    saved.save(out);
    out.write("scale", torch::tensor(1e-40, torch::kDouble), /*is_buffer=*/true);
    std::stringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    scaler.load(in);
  }
  ASSERT_EQ(warnings.texts.size(), 2u);
  EXPECT_NE(warnings.texts[1].find("the archive's scale 1e-40 is below float32's smallest normal"), std::string::npos)
      << warnings.texts[1];
  EXPECT_EQ(scaler.get_scale(), smallest);
}

TEST(GradScaler, DisabledEveryCallPassesThrough) {
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD sgd({w}, 0.1);
  GradScaler scaler(GradScalerOptions().enabled(false));
  auto loss = (w * 2).sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  scaler.unscale_(sgd);
  EXPECT_TRUE(scaler.step(sgd));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(torch::allclose(w, torch::full({3}, 0.8f)));
}

TEST(GradScaler, RefusesMisuseWithWhatToDo) {
  EXPECT_ERROR_SAYS(GradScaler(GradScalerOptions().growth_factor(0.5)), "growth_factor 0.5 must be above 1");
  EXPECT_ERROR_SAYS(GradScaler(GradScalerOptions().backoff_factor(1.5)), "backoff_factor 1.5 must be between 0 and 1");
  EXPECT_ERROR_SAYS(GradScaler(GradScalerOptions().growth_interval(0)), "growth_interval 0 must be a positive");
  auto w = torch::ones({3}, torch::dtype(torch::kHalf).requires_grad(true));
  torch::optim::SGD sgd({w}, 0.1);
  GradScaler scaler;
  EXPECT_ERROR_SAYS(scaler.step(sgd), "nothing was scaled yet; call scaler.scale(loss).backward()");
  scaler.scale((w.to(torch::kFloat) * 2).sum()).backward();
  EXPECT_ERROR_SAYS(scaler.unscale_(sgd), "parameter 1 (of [3]) is float16");
}

// fp16 autocast and the scaler on one GPU: ATen's CUDA kernels unscale and
// update, the scale lives on the GPU, and an inf skips the step.
TEST(GradScaler, Fp16AutocastAndTheScalerOnOneGpu_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  torch::manual_seed(0);
  torch::nn::Linear net(16, 4);
  net->to(torch::kCUDA);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(1024.0).growth_interval(2));
  auto x = torch::randn({8, 16}, torch::kCUDA);
  for (int step = 0; step < 3; ++step) {
    const bool overflow = step == 2;
    auto input = x.clone();
    if (overflow) {
      input[0][0] = std::numeric_limits<float>::infinity();
    }
    sgd.zero_grad();
    torch::Tensor loss;
    {
      AutocastGuard autocast(torch::kCUDA, torch::kHalf);
      auto out = net->forward(input);
      EXPECT_EQ(out.scalar_type(), torch::kHalf);
      loss = out.to(torch::kFloat).pow(2).mean();
    }
    auto scaled = scaler.scale(loss);
    EXPECT_TRUE(scaled.is_cuda());
    scaled.backward();
    const auto before = net->weight.detach().clone();
    EXPECT_EQ(scaler.step(sgd), !overflow) << "step " << step;
    scaler.update();
    EXPECT_EQ(torch::equal(net->weight.detach(), before), overflow) << "step " << step;
  }
  EXPECT_EQ(scaler.get_scale(), 1024.0) << "two good steps double it, the overflow halves it";
}

} // namespace
} // namespace lockstep
