// DistributedDataParallel's gradients, ranks as threads: how they are
// divided, what an unused parameter's .grad becomes, and static_graph's
// promise under a communication hook.

#include <lockstep/lockstep.h>

#include "support/collective_contract.h"
#include "support/errors.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace {

// 16-bit gradients are divided by the world size in float, as c10d's
// reducer does: 1/3 rounded to float16 first (0.33325) biased every
// averaged gradient by -0.024% (bfloat16's 0.33398: +0.2%).
struct HalfScaleImpl : torch::nn::Module {
  HalfScaleImpl() {
    w = register_parameter("w", torch::ones({4096}, torch::kHalf));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return (w * x).sum();
  }
  torch::Tensor w;
};
TORCH_MODULE(HalfScale);

TEST(DdpThreads, HalfGradientsAreDividedByTheWorldSizeWithoutBias) {
  testing::spawn(3, [](ProcessGroup& group) {
    HalfScale net;
    DistributedDataParallel<HalfScale> ddp(net, group);
    // The same x on every rank, so that the average is x itself.
    const auto x = torch::linspace(0.5, 1.5, 4096).to(torch::kHalf);
    ddp(x).backward();
    const auto exact = x.to(torch::kDouble);
    const double bias = ((net->w.grad().to(torch::kDouble) - exact).sum() / exact.sum()).item<double>();
    EXPECT_LT(std::abs(bias), 5e-5) << "mean relative error of the averaged gradient";
  });
}

// Under static_graph, a parameter that only rank 0 uses is marked ready as
// its backward starts, with the .grad it has then: in ImageNet's order
// (forward, zero_grad, backward) reading it at forward sent rank 1's stale
// gradient of the step before into the average.
struct BranchNetImpl : torch::nn::Cloneable<BranchNetImpl> {
  explicit BranchNetImpl(bool use_b) : use_b_(use_b) {
    reset();
  }
  void reset() override {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = a(x);
    return use_b_ ? b(y) : y;
  }
  bool use_b_;
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(BranchNet);

TEST(DdpThreads, StaticGraphReadsAnUnusedGradientWhenBackwardStarts) {
  testing::spawn(2, [](ProcessGroup& group) {
    BranchNet net(group.rank() == 0);
    DistributedDataParallel<BranchNet> ddp(net, group, DistributedOptions().static_graph(true));
    torch::optim::SGD sgd(ddp->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      const auto x = torch::linspace(-1, 1, 12).view({3, 4}) + group.rank() + step;
      auto loss = ddp(x).pow(2).sum();
      sgd.zero_grad(); // after forward, as PyTorch's ImageNet example
      BranchNet local = std::dynamic_pointer_cast<BranchNetImpl>(net->clone());
      local->zero_grad();
      local(x).pow(2).sum().backward();
      const auto mine = local->b->weight.grad().defined() ? local->b->weight.grad() : torch::zeros({4, 4});
      loss.backward();
      auto all = group.all_gather(mine);
      EXPECT_TRUE(torch::allclose(net->b->weight.grad(), (all[0] + all[1]) / 2, 1e-5, 1e-6)) << "step " << step;
      sgd.step();
    }
  });
}

// A parameter no rank used keeps its .grad's value, as PyTorch's reducer
// intends ("if a parameter is globally unused, we keep its grad untouched").
// Under gradient_as_bucket_view, a .grad assigned by hand became the bucket
// slot, holding the ranks' average: rank 0's 1 and rank 1's 2 both read 1.5.
// (Where buckets are built, a .grad moves into its slot, value and all, as in
// c10d's initialize_bucket_views.)
TEST(DdpThreads, AGloballyUnusedParameterKeepsAGradAssignedByHand) {
  for (const auto& options : {DistributedOptions().gradient_as_bucket_view(true).find_unused_parameters(true),
                              DistributedOptions().gradient_as_bucket_view(true).static_graph(true)}) {
    testing::spawn(2, [&](ProcessGroup& group) {
      BranchNet net(false);
      DistributedDataParallel<BranchNet> ddp(net, group, options);
      for (int step = 0; step < 2; ++step) {
        const auto mine = torch::full({4, 4}, static_cast<float>(group.rank() + 1 + step));
        net->b->weight.mutable_grad() = mine;
        ddp(torch::ones({2, 4})).sum().backward();
        EXPECT_TRUE(torch::equal(net->b->weight.grad(), mine))
            << "static_graph " << options.static_graph() << ", step " << step << ": "
            << net->b->weight.grad()[0][0].item<float>() << " instead of rank " << group.rank() << "'s "
            << mine[0][0].item<float>();
        EXPECT_TRUE(net->a->weight.grad().defined());
      }
    });
  }
}

// A layer-wise hook (PyTorch's GradBucket::gradients) reduces each gradient
// alone. static_graph's flag rode at the end of the last bucket, which such
// a hook never reduced: rank 1, which broke the promise, threw, while rank
// 0 went on as if nothing had happened.
TEST(DdpThreads, ABrokenStaticGraphUnderALayerWiseHookIsAnErrorOnEveryRank) {
  const CommHook layer_wise = [](const ProcessGroup& group, GradBucket& bucket) {
    for (auto& gradient : bucket.gradients) {
      group.allreduce(gradient);
      gradient.div_(group.size());
    }
    return comm_hooks::completed(bucket.buffer);
  };
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        BranchNet net(true);
        DistributedDataParallel<BranchNet> ddp(net, group, DistributedOptions().static_graph(true).comm_hook(layer_wise));
        const auto x = torch::ones({2, 4}) * (group.rank() + 1);
        for (int step = 0; step < 2; ++step) {
          ddp(x).sum().backward();
        }
        if (group.rank() == 1) {
          net->use_b_ = false;
        }
        EXPECT_ERROR_SAYS(ddp(x).sum().backward(), "static_graph(true)",
                          "rank 1's 'b.weight' received no gradient, but got one in the first iteration");
      },
      std::chrono::seconds(5));
}

// Ranks joined with other JoinOptions would act on other plans: the one
// that throws on early termination would stop while the others go on to a
// reduction it never joins. Every rank refuses at the first round.
TEST(DdpThreads, JoinOptionsThatDifferBetweenRanksAreAnErrorOnEveryRank) {
  const auto errors = testing::strings_by_rank(2, [](ProcessGroup& group) {
    torch::nn::Linear net(3, 2);
    DistributedDataParallel<torch::nn::Linear> ddp(net, group);
    return testing::message_of([&] {
      auto join = ddp->join(JoinOptions().throw_on_early_termination(group.rank() == 0));
      ddp->forward(torch::ones({2, 3})).sum().backward();
      join.finish();
    });
  }, std::chrono::seconds(10));
  for (const auto& error : errors) {
    EXPECT_NE(error.find("1 of 2 ranks passed JoinOptions().throw_on_early_termination(true), the others false"),
              std::string::npos) << error;
  }
}

// Each bucket slot takes its parameter's strides where they hold its rows
// in order (a channels-last convolution, a weight whose inner dimensions are
// permuted), as c10d's bucket views do. Slots were all row-major, so with
// gradient_as_bucket_view a .grad's layout differed from its parameter's
// (every optimizer step and accumulation then strided), and without it every
// copy into and out of the bucket was a transpose. A transposed matrix keeps
// a row-major slot: PowerSGD compresses the matrix a slot's memory holds.
struct LayoutNetImpl : torch::nn::Module {
  LayoutNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)));
    mix = register_parameter("mix", torch::randn({8, 2, 3}).permute({0, 2, 1})); // strides (6, 1, 3)
    fc = register_parameter("fc", torch::randn({5, 6}).t()); // strides (1, 6)
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return conv(x).mean({2, 3}).matmul(mix.reshape({8, 6})).matmul(fc).sum();
  }
  torch::nn::Conv2d conv{nullptr};
  torch::Tensor mix, fc;
};
TORCH_MODULE(LayoutNet);

// A net with the values of `like`, its convolution's weight channels-last.
LayoutNet channels_last_copy(const LayoutNet& like) {
  LayoutNet net;
  torch::NoGradGuard no_grad;
  for (const auto& p : like->named_parameters()) {
    net->named_parameters()[p.key()].copy_(p.value());
  }
  auto& w = net->conv->weight;
  w.set_data(w.contiguous(torch::MemoryFormat::ChannelsLast));
  return net;
}

TEST(DdpThreads, BucketSlotsTakeTheirParametersStridesWhereTheyHoldItsRows) {
  torch::manual_seed(3);
  const LayoutNet like;
  const auto x = torch::randn({4, 3, 6, 6}).contiguous(torch::MemoryFormat::ChannelsLast);
  for (const bool views : {true, false}) {
    testing::spawn(2, [&](ProcessGroup& group) {
      auto net = channels_last_copy(like);
      auto bare = channels_last_copy(like);
      ASSERT_TRUE(net->conv->weight.is_contiguous(torch::MemoryFormat::ChannelsLast));
      DistributedDataParallel<LayoutNet> ddp(net, group, DistributedOptions().gradient_as_bucket_view(views));
      ddp(x.narrow(0, 2 * group.rank(), 2)).backward();
      bare(x).backward();
      for (const auto& p : net->named_parameters()) {
        const auto& grad = p.value().grad();
        const bool row_major_slot = views && p.key() == "fc";
        EXPECT_EQ(grad.strides(), row_major_slot ? c10::IntArrayRef({5, 1}) : p.value().strides())
            << p.key() << (views ? ", views" : "");
        // the mean over 2 ranks' halves of the batch is half the whole batch's sum
        EXPECT_TRUE(torch::allclose(grad, bare->named_parameters()[p.key()].grad() / 2, 1e-5, 1e-6)) << p.key();
      }
    });
  }
}

// A slot's layout is the order its gradient's elements take in the
// allreduce: a rank whose weight is channels-last where rank 0's is not
// would sum unrelated elements, so every rank refuses it, naming the layout.
TEST(DdpThreads, ParametersInAnotherMemoryFormatThanRankZerosAreAnErrorOnEveryRank) {
  torch::manual_seed(3);
  const LayoutNet like;
  testing::spawn(2, [&](ProcessGroup& group) {
    auto net = channels_last_copy(like);
    if (group.rank() == 0) {
      auto& w = net->conv->weight;
      w.set_data(w.contiguous());
    }
    // Rank 1's error tells its own layout; rank 0's leaves that to rank 1's.
    const std::string theirs = group.rank() == 1 ? "'conv.weight' [8, 3, 3, 3] Float laid out with strides [27, 1, 9, 3]"
                                                 : "something else (its own error says what)";
    const auto message = testing::error_of([&] { DistributedDataParallel<LayoutNet>(net, group); });
    EXPECT_NE(message.find("rank 1's parameters differ from rank 0's at parameter 2: rank 0 has 'conv.weight' "
                           "[8, 3, 3, 3] Float, rank 1 has " + theirs + ". Every rank must build the same model, with "
                           "the same parameters in the same order and memory format."), std::string::npos) << message;
  });
}

// Note [Gradients that are bucket slots]: without gradient_as_bucket_view, a
// CPU parameter's .grad that nothing else holds becomes its bucket slot,
// where PyTorch copies the average into it; a .grad the caller holds keeps
// PyTorch's values.
struct TwoLayersImpl : torch::nn::Module {
  TwoLayersImpl() {
    a = register_module("a", torch::nn::Linear(6, 5));
    b = register_module("b", torch::nn::Linear(5, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return b(torch::relu(a(x))).pow(2).sum();
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoLayers);

// A backward of `ddp` on this rank's batch of `step`, after zero_grad() of
// either kind; returns every parameter's average over the ranks, computed
// apart from DDP (from identical copies of the model).
std::vector<torch::Tensor> step_and_average(TwoLayers& net, DistributedDataParallel<TwoLayers>& ddp,
                                            ProcessGroup& group, int step, bool set_to_none) {
  TwoLayers copy;
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : net->named_parameters()) {
      copy->named_parameters()[p.key()].copy_(p.value());
    }
  }
  for (auto& p : net->parameters()) {
    if (set_to_none) {
      p.mutable_grad().reset();
    } else if (p.grad().defined()) {
      p.mutable_grad().zero_();
    }
  }
  const auto x = torch::linspace(-1, 1, 24).view({4, 6}) * (1 + step) + group.rank();
  ddp(x).backward();
  copy(x).backward();
  std::vector<torch::Tensor> averages;
  for (const auto& p : copy->parameters()) {
    const auto all = group.all_gather(p.grad());
    averages.push_back((all[0] + all[1]) / 2);
  }
  return averages;
}

void expect_averages(const TwoLayers& net, const std::vector<torch::Tensor>& averages, const std::string& when) {
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i].grad(), averages[i], 1e-5, 1e-6)) << "parameter " << i << ", " << when;
  }
}

const void* storage_of(const torch::Tensor& t) {
  return t.storage().unsafeGetStorageImpl();
}

// Under the built-in allreduce, comm_hooks::allreduce and PowerSGD (which
// compresses from the first iteration here, so its averages are not exact).
TEST(DdpThreads, GradientsThatNothingElseHoldsBecomeTheirBucketSlots) {
  for (const bool set_to_none : {true, false}) {
    for (const std::string hook : {"none", "allreduce", "powersgd"}) {
      testing::spawn(2, [&](ProcessGroup& group) {
        torch::manual_seed(1);
        TwoLayers net;
        auto options = DistributedOptions();
        if (hook == "allreduce") {
          options.comm_hook(comm_hooks::allreduce);
        } else if (hook == "powersgd") {
          options.comm_hook(comm_hooks::powersgd(PowerSGDOptions().rank(1).start_iteration(0)));
        }
        DistributedDataParallel<TwoLayers> ddp(net, group, options);
        const void* bucket = nullptr;
        for (int step = 0; step < 4; ++step) {
          const auto averages = step_and_average(net, ddp, group, step, set_to_none);
          const std::string when =
              "step " + std::to_string(step) + (set_to_none ? ", set to none" : ", zeroed") + ", hook " + hook;
          if (hook != "powersgd") {
            expect_averages(net, averages, when);
          }
          // one bucket: every .grad on its storage
          for (const auto& p : net->parameters()) {
            EXPECT_EQ(storage_of(p.grad()), storage_of(net->a->weight.grad())) << when;
          }
          // Once the buckets are rebuilt (at step 1's forward), nothing held
          // them, so no backward moved anything out of them.
          if (step >= 2) {
            EXPECT_EQ(storage_of(net->a->weight.grad()), bucket) << when;
          }
          bucket = storage_of(net->a->weight.grad());
        }
      });
    }
  }
}

// What the caller keeps of a step's .grad keeps that step's values through
// the next backward, as in PyTorch, whose next backward makes .grad anew
// after zero_grad() set it to none; zeroed in place, the kept tensor is
// .grad itself, and takes the next average, as in PyTorch. Under
// gradient_as_bucket_view the kept tensor is the slot, and .grad, either way.
TEST(DdpThreads, AGradientTheCallerKeptKeepsPyTorchsValuesThroughTheNextBackwards) {
  for (const auto& [set_to_none, views] : {std::pair{true, false}, std::pair{false, false}, std::pair{true, true},
                                           std::pair{false, true}}) {
    testing::spawn(2, [&, set_to_none = set_to_none, views = views](ProcessGroup& group) {
      torch::manual_seed(1);
      TwoLayers net;
      DistributedDataParallel<TwoLayers> ddp(net, group, DistributedOptions().gradient_as_bucket_view(views));
      for (int step = 0; step < 2; ++step) { // past the rebuild
        step_and_average(net, ddp, group, step, set_to_none);
      }
      const auto kept = net->a->weight.grad();
      const auto kept_values = kept.clone();
      ASSERT_EQ(storage_of(kept), storage_of(net->b->weight.grad())) << "a slot, one bucket";
      for (int step = 2; step < 4; ++step) {
        const auto averages = step_and_average(net, ddp, group, step, set_to_none);
        const std::string when =
            "step " + std::to_string(step) + (set_to_none ? ", set to none" : ", zeroed") + (views ? ", views" : "");
        expect_averages(net, averages, when);
        if (set_to_none && !views) {
          EXPECT_TRUE(torch::equal(kept, kept_values)) << when;
        } else {
          EXPECT_TRUE(kept.is_same(net->a->weight.grad())) << when;
          EXPECT_TRUE(torch::allclose(kept, averages[0], 1e-5, 1e-6)) << when;
        }
      }
      // The other gradients, which nothing held, are slots again.
      EXPECT_EQ(storage_of(net->a->bias.grad()), storage_of(net->b->weight.grad()));
    });
  }
}

// A .grad the caller set and holds stays that tensor, and takes the average.
TEST(DdpThreads, AGradTheCallerHoldsStaysItsTensorAndTakesTheAverage) {
  testing::spawn(2, [&](ProcessGroup& group) {
    torch::manual_seed(1);
    TwoLayers net;
    DistributedDataParallel<TwoLayers> ddp(net, group);
    for (int step = 0; step < 3; ++step) {
      const auto mine = torch::zeros_like(net->b->weight);
      const auto averages = step_and_average(net, ddp, group, step, /*set_to_none=*/true);
      EXPECT_FALSE(mine.is_same(net->b->weight.grad()));
      net->b->weight.mutable_grad() = mine;
      const auto next = step_and_average(net, ddp, group, step + 10, /*set_to_none=*/false);
      EXPECT_TRUE(mine.is_same(net->b->weight.grad())) << "step " << step;
      expect_averages(net, next, "step " + std::to_string(step));
    }
  });
}

// A view of a .grad that is its slot sees what .grad holds, as in PyTorch:
// zero_grad() in place (LibTorch 1.13's only kind), an accumulation under
// no_sync, and the next average.
TEST(DdpThreads, AViewOfAGradThatIsItsSlotFollowsTheGrad) {
  for (const bool accumulate : {false, true}) {
    testing::spawn(2, [&](ProcessGroup& group) {
      torch::manual_seed(1);
      TwoLayers net;
      DistributedDataParallel<TwoLayers> ddp(net, group);
      for (int step = 0; step < 2; ++step) { // past the rebuild
        step_and_average(net, ddp, group, step, /*set_to_none=*/true);
      }
      const auto view = net->a->weight.grad().view({-1});
      ASSERT_EQ(storage_of(view), storage_of(net->b->weight.grad())) << "a slot, one bucket";
      for (int step = 2; step < 4; ++step) {
        const std::string when = "step " + std::to_string(step) + (accumulate ? ", after no_sync" : "");
        torch::Tensor extra; // what the no_sync pass adds, the same on both ranks
        if (accumulate) {
          for (auto& p : net->parameters()) {
            p.mutable_grad().zero_();
          }
          auto guard = ddp->no_sync();
          ddp(torch::ones({2, 6})).backward();
          EXPECT_TRUE(torch::equal(view, net->a->weight.grad().view({-1}))) << when;
          extra = net->a->weight.grad().clone();
        }
        const auto averages = accumulate ? std::vector<torch::Tensor>{} : step_and_average(net, ddp, group, step, false);
        if (accumulate) {
          const auto x = torch::linspace(-1, 1, 24).view({4, 6}) + group.rank();
          ddp(x).backward();
        }
        EXPECT_TRUE(torch::equal(view, net->a->weight.grad().view({-1}))) << when;
        if (!accumulate) {
          EXPECT_TRUE(torch::allclose(view, averages[0].view({-1}), 1e-5, 1e-6)) << when;
        } else {
          EXPECT_FALSE(torch::allclose(net->a->weight.grad(), extra)) << when << ": the synced backward was averaged in";
        }
      }
    });
  }
}

// A slot kept from the first step keeps its values after the buckets are
// rebuilt (at the second forward) and through later backwards.
TEST(DdpThreads, ASlotKeptAcrossTheRebuildKeepsItsValues) {
  testing::spawn(2, [&](ProcessGroup& group) {
    torch::manual_seed(1);
    TwoLayers net;
    DistributedDataParallel<TwoLayers> ddp(net, group, DistributedOptions().bucket_bytes(128).first_bucket_bytes(64));
    step_and_average(net, ddp, group, 0, /*set_to_none=*/true);
    const auto kept = net->b->weight.grad();
    const auto kept_values = kept.clone();
    for (int step = 1; step < 4; ++step) {
      const auto averages = step_and_average(net, ddp, group, step, /*set_to_none=*/true);
      expect_averages(net, averages, "step " + std::to_string(step));
      EXPECT_TRUE(torch::equal(kept, kept_values)) << "step " << step;
    }
  });
}

// Over shared memory, the built-in allreduce is an average that the backend
// divides as it sums (Note [An average divided where it is summed]): every
// rank's .grad is the ranks' gradients summed in rank order, then divided
// once by the world size, to the bit, whether .grad was set to none or
// zeroed. At 3 ranks, where 1/3 is inexact, gradients divided before the sum
// give other bits, which the test checks it would see.
TEST(DdpThreads, OverSharedMemoryAGradientIsTheRanksSumDividedOnce) {
  if (const char* shm = std::getenv("LOCKSTEP_GLOO_SHM"); shm != nullptr && std::string(shm) == "0") {
    GTEST_SKIP() << "LOCKSTEP_GLOO_SHM=0: the group does not go through shared memory";
  }
  for (const bool set_to_none : {true, false}) {
    std::atomic<int> differs{0};
    testing::spawn(3, [&](ProcessGroup& group) {
      ASSERT_TRUE(group.averages_in_backend(torch::kFloat)) << "ranks as threads share memory";
      EXPECT_FALSE(group.averages_in_backend(torch::kBFloat16));
      torch::manual_seed(1);
      TwoLayers net, copy;
      DistributedDataParallel<TwoLayers> ddp(net, group);
      for (int step = 0; step < 3; ++step) { // the first buckets, then the rebuilt ones
        {
          torch::NoGradGuard no_grad;
          for (const auto& p : net->named_parameters()) {
            copy->named_parameters()[p.key()].copy_(p.value());
          }
        }
        for (auto& p : net->parameters()) {
          if (set_to_none) {
            p.mutable_grad().reset();
          } else if (p.grad().defined()) {
            p.mutable_grad().zero_();
          }
        }
        const auto x = torch::linspace(-1, 1, 24).view({4, 6}) * (1 + step) + 0.3 * group.rank();
        ddp(x).backward();
        copy->zero_grad();
        copy(x).backward();
        const auto params = net->parameters(), local = copy->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          const auto all = group.all_gather(local[i].grad());
          const auto expected = ((all[0] + all[1]) + all[2]).div_(3);
          const float third = 1.0f / 3;
          const auto divided_first = (all[0] * third + all[1] * third) + all[2] * third;
          differs += torch::equal(divided_first, expected) ? 0 : 1;
          EXPECT_TRUE(torch::equal(params[i].grad(), expected))
              << "rank " << group.rank() << ", step " << step << ", parameter " << i
              << (set_to_none ? ", set to none" : ", zeroed");
        }
      }
    });
    EXPECT_GT(differs.load(), 0) << "no gradient here tells the two ways of averaging apart";
  }
}

} // namespace
} // namespace lockstep
