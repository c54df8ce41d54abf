// FullyShardedDataParallel's precision policy (Note [Sharded mixed
// precision]): parameters gathered and used in param_dtype, fp32 shards
// stepped by the optimizer, gradients averaged in reduce_dtype; ranks as
// threads over a HashStore.

#include <lockstep/lockstep.h>

#include "../src/util/torch_compat.h"
#include "support/errors.h"
#include "support/fsdp_checks.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace lockstep {
namespace {

using testing::OddNet;

// OddNet, recording the dtype its first layer's weight has in forward.
struct ProbeImpl : torch::nn::Cloneable<ProbeImpl> {
  ProbeImpl() {
    reset();
  }
  void reset() override {
    body = register_module("body", OddNet());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    seen = body->fc1->weight.scalar_type();
    return body->forward(x);
  }
  OddNet body{nullptr};
  torch::ScalarType seen = torch::kFloat;
};
TORCH_MODULE(Probe);

const auto kBf16 = ShardingOptions().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat);

TEST(ShardedPrecision, ParametersComputeInParamDtypeAndTheShardsStayFloat) {
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
    SCOPED_TRACE(testing::name_of(strategy));
    torch::manual_seed(0);
    OddNet initial;
    const auto reference = testing::train_reference(initial, 5, 12);
    testing::spawn(2, [&](ProcessGroup& group) {
      Probe probe;
      testing::copy_values(*initial, *probe->body);
      FullyShardedDataParallel<Probe> model(probe, group, ShardingOptions(kBf16).strategy(strategy));
      for (const auto& p : model->parameters()) {
        EXPECT_EQ(p.scalar_type(), torch::kFloat) << "a shard is not fp32";
      }
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
      for (int step = 0; step < 5; ++step) {
        auto batch = testing::share_of(12, step, group.rank(), group.size());
        adam.zero_grad();
        auto out = model->forward(batch.first); // fp32 input, cast to bf16
        EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
        EXPECT_EQ(model->module()->seen, torch::kBFloat16) << "the gathered weight is not bf16";
        torch::mse_loss(out.to(torch::kFloat), batch.second).backward();
        for (const auto& p : model->parameters()) {
          ASSERT_TRUE(p.grad().defined());
          EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
        }
        adam.step();
      }
      auto full = model->summon_full_params();
      auto mine = model->module()->body->named_parameters();
      auto theirs = reference->named_parameters();
      for (size_t i = 0; i < mine.size(); ++i) {
        EXPECT_EQ(mine[i].value().scalar_type(), torch::kFloat) << "summon_full_params gave " << mine[i].key()
                                                                 << " in another dtype";
        EXPECT_TRUE(torch::allclose(mine[i].value(), theirs[i].value(), 3e-2, 3e-2))
            << mine[i].key() << " is far from fp32 training: "
            << (mine[i].value() - theirs[i].value()).abs().max().item<float>();
      }
    });
  }
}

// forward's tensors inside a vector, an optional and a tuple (an attention
// mask, several inputs) are cast to param_dtype too, as FSDP's
// _apply_to_tensors does: they met bf16 weights as fp32 and failed inside
// an operator.
struct NestedArgumentsImpl : torch::nn::Module {
  NestedArgumentsImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const std::vector<torch::Tensor>& xs, c10::optional<torch::Tensor> mask,
                        const std::tuple<torch::Tensor, int64_t>& extra) {
    auto h = fc(xs.at(0)) + fc(xs.at(1)) + fc(std::get<0>(extra)) * static_cast<double>(std::get<1>(extra));
    return mask.has_value() ? h * *mask : h;
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(NestedArguments);

TEST(ShardedPrecision, TensorsInsideContainerArgumentsAreCast) {
  testing::spawn(2, [](ProcessGroup& group) {
    FullyShardedDataParallel<NestedArguments> model(NestedArguments(), group, kBf16);
    const auto x = torch::randn({3, 4});
    const auto out = model->forward(std::vector<torch::Tensor>{x, x * 2}, c10::optional<torch::Tensor>(torch::ones({3, 2})),
                                    std::make_tuple(x, int64_t{3}));
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    out.to(torch::kFloat).sum().backward();
  });
}

// A Linear layer and a normalisation after it: one unit.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(torch::nn::AnyModule n) : norm(std::move(n)) {
    fc = register_module("fc", torch::nn::Linear(4, 6));
    register_module("norm", norm.ptr());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return norm.forward(fc(x));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::AnyModule norm;
};
TORCH_MODULE(Block);

// A BatchNorm's parameters keep their dtype under param_dtype, as FSDP's
// mixed precision leaves _BatchNorm out by default: ATen's CPU batch norm
// takes a bf16 input only beside fp32 weights and running statistics, and
// refused the cast weights ("mixed dtype (CPU)") in eval mode, in a group
// of one, and for torch::nn::BatchNorm always (Note [Sharded mixed
// precision]). The layer shares a unit with a Linear whose weight is cast.
TEST(ShardedPrecision, ABatchNormKeepsItsParametersDtype) {
  for (bool sync : {false, true}) {
    SCOPED_TRACE(sync ? "SyncBatchNorm" : "BatchNorm1d");
    testing::spawn(2, [&](ProcessGroup& group) {
      torch::manual_seed(0);
      torch::nn::AnyModule norm;
      if (sync) {
        norm = torch::nn::AnyModule(SyncBatchNorm(torch::nn::BatchNormOptions(6), group));
      } else {
        norm = torch::nn::AnyModule(torch::nn::BatchNorm1d(6));
      }
      torch::nn::Sequential net(Block(std::move(norm)), torch::nn::Linear(6, 2));
      FullyShardedDataParallel<torch::nn::Sequential> model(net, group, kBf16);
      torch::optim::SGD sgd(model->parameters(), 0.1);
      for (int step = 0; step < 3; ++step) {
        const auto x = torch::arange(24, torch::kFloat).view({6, 4}).sin() * (step + group.rank() + 1);
        sgd.zero_grad();
        auto out = model->forward(x);
        EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
        out.to(torch::kFloat).square().mean().backward();
        sgd.step();
      }
      model->eval();
      torch::NoGradGuard no_grad;
      const auto out = model->forward(torch::arange(12, torch::kFloat).view({3, 4}).cos());
      EXPECT_TRUE(torch::isfinite(out.to(torch::kFloat)).all().item<bool>()) << out;
      const auto running_mean = model->module()[0]->named_buffers()["norm.running_mean"];
      EXPECT_GT(running_mean.abs().sum().item<float>(), 0.0f) << "the running statistics did not move";
      for (const auto& p : model->parameters()) {
        EXPECT_EQ(p.scalar_type(), torch::kFloat);
      }
    });
  }
}

// A frozen BatchNorm (fine-tuning) keeps its dtype too: it was refused,
// with advice (cast it to param_dtype) that ATen's batch norm then refuses.
TEST(ShardedPrecision, AFrozenBatchNormKeepsItsDtype) {
  testing::spawn(2, [&](ProcessGroup& group) {
    torch::nn::BatchNorm1d norm(6); // rank 0's Linear is every rank's
    norm->weight.set_requires_grad(false);
    norm->bias.set_requires_grad(false);
    torch::nn::Sequential net(Block(torch::nn::AnyModule(norm)), torch::nn::Linear(6, 2));
    FullyShardedDataParallel<torch::nn::Sequential> model(net, group, kBf16);
    const auto x = torch::arange(24, torch::kFloat).view({6, 4}).sin() * (group.rank() + 1);
    model->forward(x).to(torch::kFloat).square().mean().backward();
    EXPECT_EQ(norm->weight.scalar_type(), torch::kFloat);
    model->eval();
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::isfinite(model->forward(x).to(torch::kFloat)).all().item<bool>());
  });
}

// reduce_dtype alone leaves a BatchNorm's gradients in their dtype too, as
// FSDP's MixedPrecision leaves _BatchNorm out of all its dtypes: after one
// step, the BatchNorm's parameters are the bits of fp32 training, the
// Linear's (reduced in float16) are not.
TEST(ShardedPrecision, ReduceDtypeAloneLeavesABatchNormsGradientsInTheirDtype) {
  testing::spawn(2, [&](ProcessGroup& group) {
    std::vector<std::vector<torch::Tensor>> results;
    // float16: LibTorch 1.13's Gloo has no bfloat16 reduction.
    for (const auto& options : {ShardingOptions(), ShardingOptions().reduce_dtype(torch::kHalf)}) {
      torch::nn::Sequential net(Block(torch::nn::AnyModule(torch::nn::BatchNorm1d(6))), torch::nn::Linear(6, 2));
      {
        torch::NoGradGuard no_grad; // the ranks' threads share the generator: values of their own
        double i = 0;
        for (auto& p : net->parameters()) {
          p.copy_(torch::cos(torch::arange(p.numel(), torch::kFloat) * 0.37 + ++i).view_as(p) * 0.5 + 0.2);
        }
      }
      FullyShardedDataParallel<torch::nn::Sequential> model(net, group, options);
      torch::optim::SGD sgd(model->parameters(), 0.1);
      const auto x = torch::arange(24, torch::kFloat).view({6, 4}).sin() * (group.rank() + 1.3);
      model->forward(x).square().mean().backward();
      sgd.step();
      auto full = model->summon_full_params();
      results.emplace_back();
      for (const auto& p : model->module()->parameters()) {
        results.back().push_back(p.detach().clone());
      }
    }
    const auto names = torch::nn::Sequential(Block(torch::nn::AnyModule(torch::nn::BatchNorm1d(6))),
                                             torch::nn::Linear(6, 2))->named_parameters().keys();
    ASSERT_EQ(results[0].size(), names.size());
    for (size_t i = 0; i < names.size(); ++i) {
      const bool norm = names[i].find("norm.") != std::string::npos;
      if (names[i] == "0.fc.bias") {
        continue; // a bias before a BatchNorm has a zero gradient, exact in any dtype
      }
      EXPECT_EQ(torch::equal(results[0][i], results[1][i]), norm)
          << names[i] << (norm ? " was reduced in float16" : " was not reduced in float16: the test shows nothing");
    }
  });
}

// An fp32 value that bf16 cannot hold survives a writeback exactly, and the
// gradient hooks survive the parameters' change of dtype in and out of
// summon_full_params: the next backward still reaches the shards.
TEST(ShardedPrecision, SummonIsFloatAndWritebackKeepsFloatValues) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::manual_seed(0);
    FullyShardedDataParallel<OddNet> model(OddNet(), group, kBf16);
    const float value = 1.0001f; // bf16 would make it 1.0
    {
      auto full = model->summon_full_params();
      full.writeback(true);
      ASSERT_EQ(model->module()->fc1->weight.scalar_type(), torch::kFloat);
      torch::NoGradGuard no_grad;
      model->module()->fc1->weight[0][0] = value;
    }
    {
      auto full = model->summon_full_params();
      EXPECT_EQ(model->module()->fc1->weight[0][0].item<float>(), value);
    }
    auto batch = testing::share_of(8, 0, group.rank(), group.size());
    torch::mse_loss(model->forward(batch.first).to(torch::kFloat), batch.second).backward();
    float total = 0;
    for (const auto& p : model->parameters()) {
      ASSERT_TRUE(p.grad().defined()) << "a shard got no gradient after summon_full_params";
      total += p.grad().abs().sum().item<float>();
    }
    EXPECT_GT(total, 0);
  });
}

// One unit, Linear(4, 1) without bias: with loss = out.sum() and one row
// of x per rank, each weight's gradient is x's value.
struct SumNetImpl : torch::nn::Cloneable<SumNetImpl> {
  SumNetImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(4, 1).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc->forward(x);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SumNet);

// Gradient accumulation under no_sync sums in reduce_dtype, as FSDP2 does:
// a first micro-batch's gradient of 1, then eight of 2^-9. In bf16 each
// 1 + 2^-9 rounds back to 1; in fp32 the sum is 1 + 8 * 2^-9.
TEST(ShardedPrecision, NoSyncAccumulatesInReduceDtype) {
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
    SCOPED_TRACE(testing::name_of(strategy));
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<SumNet> model(SumNet(), group, ShardingOptions(kBf16).strategy(strategy));
      const float small = 1.0f / 512;
      auto micro_batch = [&](float value) {
        model->forward(torch::full({1, 4}, value)).to(torch::kFloat).sum().backward();
      };
      {
        auto guard = model->no_sync();
        micro_batch(1.0f);
        for (int i = 0; i < 7; ++i) {
          micro_batch(small);
        }
      }
      micro_batch(small);
      for (const auto& p : model->parameters()) {
        ASSERT_TRUE(p.grad().defined());
        ASSERT_EQ(p.grad().scalar_type(), torch::kFloat);
        const auto weights = p.grad().narrow(0, 0, std::min<int64_t>(p.numel(), 4 / group.size()));
        EXPECT_TRUE(torch::equal(weights, torch::full_like(weights, 1.0f + 8 * small)))
            << "accumulated gradient " << weights << ", want " << 1.0f + 8 * small;
      }
    });
  }
}

TEST(ShardedPrecision, ReduceDtypeDefaultsToParamDtypeWhereTheBackendCarriesIt) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::manual_seed(0);
    const auto options = ShardingOptions().param_dtype(torch::kBFloat16);
    if (!detail::kGlooCarriesBFloat16AndBool) {
      EXPECT_ERROR_SAYS(FullyShardedDataParallel<OddNet>(OddNet(), group, options),
                        "the gloo backend cannot reduce-scatter BFloat16 tensors on cpu",
                        "set reduce_dtype(torch::kFloat)");
      return;
    }
    FullyShardedDataParallel<OddNet> model(OddNet(), group, options);
    auto batch = testing::share_of(8, 0, group.rank(), group.size());
    torch::mse_loss(model->forward(batch.first).to(torch::kFloat), batch.second).backward();
    for (const auto& p : model->parameters()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
    }
  });
}

TEST(ShardedPrecision, WhatItCannotDoIsRefused) {
  testing::spawn(2, [](ProcessGroup& group) {
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<OddNet>(OddNet(), group, ShardingOptions(kBf16).strategy(
                          ShardingStrategy::NoShard)),
                      "param_dtype() and reduce_dtype() need FullShard or ShardGradOp", "AutocastGuard");
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<OddNet>(OddNet(), group, ShardingOptions().param_dtype(torch::kInt)),
                      "ShardingOptions().param_dtype(Int) is not a floating-point dtype");
  });
}

// A frozen parameter is not sharded, so param_dtype cannot cast it: forward
// failed inside Linear with "expected scalar type" and no word of why.
TEST(ShardedPrecision, AFrozenParameterOfAnotherDtypeIsRefusedNamingIt) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::nn::Sequential net(torch::nn::Linear(4, 3), torch::nn::Tanh(), torch::nn::Linear(3, 2));
    net[0]->as<torch::nn::Linear>()->weight.set_requires_grad(false);
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<torch::nn::Sequential>(net, group,
                                                                      ShardingOptions().param_dtype(torch::kHalf)),
                      "parameter '0.weight' is frozen (requires_grad false) and Float",
                      "param_dtype(Half) would not cast it", "Cast the frozen parameters to Half before wrapping");
  });
}

} // namespace
} // namespace lockstep
