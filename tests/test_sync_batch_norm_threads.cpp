// SyncBatchNorm over ranks as threads in one process: its statistics and
// gradients against BatchNorm on the whole batch in float64. (The group of
// one is in test_sync_batch_norm.cpp; DDP's SyncBatchNorm over processes in
// test_ddp_processes.cpp.)

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

namespace lockstep {
namespace {

// Largest |a - b| over the largest |b|.
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const auto reference = b.to(torch::kDouble);
  return (a.to(torch::kDouble) - reference).abs().max().item<double>() / reference.abs().max().item<double>();
}

// The layer under autocast (a conv's fp16 or bf16 output, float weights) on
// two ranks. A constant channel (a dead filter) has variance 0: its invstd
// is 316, whose square overflowed fp16 and made the channel's input
// gradient NaN. A narrow channel far from zero lost a tenth of its
// deviation to a mean rounded to bf16. Both are exact here up to the
// output's own rounding, in the input's dtype.
TEST(SyncBatchNormThreads, SixteenBitInputsMatchTheWholeBatchInDouble) {
  for (const auto dtype : {torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(0);
    auto values = torch::empty({8, 3, 5});
    values.select(1, 0).fill_(0.5);
    values.select(1, 1).copy_(3.1 + 0.05 * torch::randn({8, 5}));
    values.select(1, 2).copy_(torch::randn({8, 5}));
    const auto whole = values.to(dtype);
    const auto dy = torch::randn({8, 3, 5}).to(dtype);
    const auto weight = torch::rand({3}) + 0.5;
    const auto bias = torch::randn({3});

    auto reference_input = whole.to(torch::kDouble).requires_grad_();
    auto reference_weight = weight.to(torch::kDouble).requires_grad_();
    const auto reference = torch::batch_norm(reference_input, reference_weight, bias.to(torch::kDouble), {}, {},
                                             /*training=*/true, 0.1, 1e-5, /*cudnn_enabled=*/false);
    reference.backward(dy.to(torch::kDouble));

    testing::spawn(2, [&](ProcessGroup& group) {
      SyncBatchNorm norm(torch::nn::BatchNormOptions(3), group);
      {
        torch::NoGradGuard no_grad;
        norm->weight.copy_(weight);
        norm->bias.copy_(bias);
      }
      const auto rows = torch::indexing::Slice(4 * group.rank(), 4 * group.rank() + 4);
      auto x = whole.index({rows}).clone().requires_grad_();
      const auto out = norm->forward(x);
      out.backward(dy.index({rows}));
      EXPECT_EQ(out.scalar_type(), dtype) << "the output takes the input's dtype, as BatchNorm's";
      EXPECT_EQ(x.grad().scalar_type(), dtype);
      EXPECT_TRUE(torch::isfinite(x.grad().to(torch::kDouble)).all().item<bool>()) << x.grad();
      EXPECT_LT(relative_error(out, reference.index({rows})), 0.01) << out;
      EXPECT_LT(relative_error(x.grad(), reference_input.grad().index({rows})), 0.01) << x.grad();
      auto weight_grad = norm->weight.grad().clone(); // this rank's share, as BatchNorm's on its rows
      group.allreduce_async({weight_grad}, ReduceOp::Sum, "the test's weight gradients")->wait();
      EXPECT_LT(relative_error(weight_grad, reference_weight.grad()), 1e-4) << weight_grad;
    });
  }
}

// A float64 channel whose mean is far from zero beside its spread (1e6
// and 0.01): the ranks' squares combine about the whole batch's mean, as
// PyTorch's batch_norm_gather_stats_with_counts does; sums of squares about
// zero lose the variance (E[x^2] - mean^2 cancels at 2e-16 * 1e12 = 2e-4,
// twice the variance). Uneven ranks, 5 rows and 3.
TEST(SyncBatchNormThreads, AFloat64ChannelFarFromZeroKeepsItsVariance) {
  torch::manual_seed(0);
  const auto whole = 1e6 + 0.01 * torch::randn({8, 2, 4}, torch::kDouble);
  const auto reference_mean = torch::zeros({2}, torch::kDouble);
  const auto reference_var = torch::ones({2}, torch::kDouble);
  const auto reference = torch::batch_norm(whole, {}, {}, reference_mean, reference_var, /*training=*/true, 0.1, 1e-5,
                                           /*cudnn_enabled=*/false);
  testing::spawn(2, [&](ProcessGroup& group) {
    SyncBatchNorm norm(torch::nn::BatchNormOptions(2), group);
    norm->to(torch::kDouble);
    const auto rows = group.rank() == 0 ? torch::indexing::Slice(0, 5) : torch::indexing::Slice(5, 8);
    const auto out = norm->forward(whole.index({rows}));
    EXPECT_LT(relative_error(out, reference.index({rows})), 1e-6) << out;
    EXPECT_LT(relative_error(norm->running_var, reference_var), 1e-6) << norm->running_var;
    EXPECT_LT(relative_error(norm->running_mean, reference_mean), 1e-12) << norm->running_mean;
  });
}

// Without affine parameters or running statistics, as PyTorch's
// SyncBatchNorm takes weight=None and running_mean=None: the whole batch's
// output and input gradient, and statistics tracked where asked.
TEST(SyncBatchNormThreads, WithoutAffineOrRunningStatisticsNormalisesTheWholeBatch) {
  torch::manual_seed(0);
  const auto whole = torch::randn({6, 3, 4}, torch::kDouble);
  const auto dy = torch::randn({6, 3, 4}, torch::kDouble);
  auto reference_input = whole.clone().requires_grad_();
  const auto reference = torch::batch_norm(reference_input, {}, {}, {}, {}, /*training=*/true, 0.1, 1e-5,
                                           /*cudnn_enabled=*/false);
  reference.backward(dy);
  for (const bool affine : {false, true}) {
    for (const bool track : {false, true}) {
      if (affine && track) {
        continue;
      }
      SCOPED_TRACE("affine " + std::to_string(affine) + ", track_running_stats " + std::to_string(track));
      testing::spawn(2, [&](ProcessGroup& group) {
        SyncBatchNorm norm(torch::nn::BatchNormOptions(3).affine(affine).track_running_stats(track), group);
        norm->to(torch::kDouble);
        const auto rows = torch::indexing::Slice(3 * group.rank(), 3 * group.rank() + 3);
        auto x = whole.index({rows}).clone().requires_grad_();
        const auto out = norm->forward(x);
        EXPECT_LT(relative_error(out, reference.index({rows})), 1e-12);
        out.backward(dy.index({rows}));
        EXPECT_LT(relative_error(x.grad(), reference_input.grad().index({rows})), 1e-12);
        EXPECT_EQ(norm->running_mean.defined(), track);
        if (track) {
          EXPECT_LT(relative_error(norm->running_mean, 0.1 * whole.mean(std::vector<int64_t>{0, 2})), 1e-12);
        }
      });
    }
  }
}

// A channels-last input gives a channels-last output, as BatchNorm's (and
// PyTorch's SyncBatchNorm's) does, with the whole batch's values.
TEST(SyncBatchNormThreads, AChannelsLastInputKeepsItsMemoryFormat) {
  torch::manual_seed(0);
  const auto whole = torch::randn({4, 3, 5, 5}, torch::kDouble);
  const auto dy = torch::randn({4, 3, 5, 5}, torch::kDouble);
  auto reference_input = whole.clone().requires_grad_();
  const auto reference = torch::batch_norm(reference_input, {}, {}, {}, {}, /*training=*/true, 0.1, 1e-5,
                                           /*cudnn_enabled=*/false);
  reference.backward(dy);
  testing::spawn(2, [&](ProcessGroup& group) {
    SyncBatchNorm norm(torch::nn::BatchNormOptions(3), group);
    norm->to(torch::kDouble);
    const auto rows = torch::indexing::Slice(2 * group.rank(), 2 * group.rank() + 2);
    auto x = whole.index({rows}).contiguous(torch::MemoryFormat::ChannelsLast).requires_grad_();
    const auto out = norm->forward(x);
    EXPECT_TRUE(out.is_contiguous(torch::MemoryFormat::ChannelsLast));
    EXPECT_LT(relative_error(out, reference.index({rows})), 1e-12);
    out.backward(dy.index({rows}).contiguous(torch::MemoryFormat::ChannelsLast));
    EXPECT_LT(relative_error(x.grad(), reference_input.grad().index({rows})), 1e-12);
  });
}

// A gradient penalty's create_graph through the layer on two ranks: its
// allreduce is not differentiable, so the second-order gradient would miss
// the other rank's terms. An error on every rank, as PyTorch's; a plain
// backward after it still works.
TEST(SyncBatchNormThreads, DoubleBackwardIsAnErrorOnEveryRank) {
  testing::spawn(2, [&](ProcessGroup& group) {
    SyncBatchNorm norm(torch::nn::BatchNormOptions(3), group);
    auto x = (torch::arange(24, torch::kFloat).reshape({4, 3, 2}) * (group.rank() + 1)).requires_grad_();
    auto loss = norm->forward(x).pow(2).sum();
    const auto where = "rank " + std::to_string(group.rank()) + " of 2: a backward with create_graph";
    EXPECT_ERROR_SAYS(torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true),
                      where.c_str(), "is not differentiable");
    loss.backward();
    EXPECT_TRUE(x.grad().defined());
  });
}

// DataParallel's replicas are threads of one process: their allreduces
// would pair with the other rank's replicas in whatever order the threads
// came, mixing statistics without an error. Refused at construction; one
// replica (a single device) is fine.
TEST(SyncBatchNormThreads, ReplicasOfAMultiRankLayerInDataParallelAreRefused) {
  testing::spawn(2, [&](ProcessGroup& group) {
    auto net = torch::nn::Sequential(torch::nn::Linear(4, 3), SyncBatchNorm(torch::nn::BatchNormOptions(3), group));
    EXPECT_ERROR_SAYS(DataParallel<torch::nn::Sequential>(net, DataParallelOptions().devices({torch::kCPU, torch::kCPU})),
                      "'1' is a lockstep::SyncBatchNorm over 2 ranks, but DataParallel runs 2 replicas");
    DataParallel<torch::nn::Sequential> alone(net, DataParallelOptions().devices({torch::kCPU}));
    EXPECT_EQ(alone->forward(torch::ones({2, 4})).sizes(), (std::vector<int64_t>{2, 3}));
  });
}

// Two wrapped models, each with a SyncBatchNorm of one width, that one rank
// runs in the other order: each is its model's layer 1, so without the
// model's number in the tag the ranks would swap statistics without an
// error (Note [Collective tags]).
TEST(SyncBatchNormThreads, TwoModelsRunInAnotherOrderOnOneRankAreAnErrorOnEveryRank) {
  testing::spawn(2, [&](ProcessGroup& group) {
    const auto options = DistributedOptions().broadcast_buffers(false); // only the layers' own collectives
    DistributedDataParallel<SyncBatchNorm> first(SyncBatchNorm(torch::nn::BatchNormOptions(4), group), group, options);
    DistributedDataParallel<SyncBatchNorm> second(SyncBatchNorm(torch::nn::BatchNormOptions(4), group), group, options);
    const auto x = torch::randn({3, 4}) + group.rank();
    auto run = [&] {
      return group.rank() == 1 ? second->forward(x) + first->forward(x) : first->forward(x) + second->forward(x);
    };
    EXPECT_ERROR_SAYS(run(), "ranks disagree on this collective", "tagged layer 1 of wrapped model ",
                      "two wrapped models run in another order on some rank");
  }, std::chrono::seconds(20));
}

// Wrappers over the pairs {0, 1} and {2, 3}, each holding a SyncBatchNorm
// over all four ranks: the pairs' wrappers have numbers of their own, so
// the layer's tag leaves them out, and the four ranks normalise one batch.
TEST(SyncBatchNormThreads, ALayerOverTheWorldInWrappersOverPairsNormalisesTheWholeBatch) {
  std::vector<c10::intrusive_ptr<c10d::Store>> stores{c10::make_intrusive<c10d::HashStore>(),
                                                      c10::make_intrusive<c10d::HashStore>()};
  torch::manual_seed(4);
  const auto whole = torch::randn({8, 3});
  const auto expected = torch::batch_norm(whole, {}, {}, {}, {}, /*training=*/true, 0.1, 1e-5, false);
  testing::spawn(4, [&](ProcessGroup& world) {
    auto pair = new_group(stores[world.rank() / 2], world.rank() % 2, 2, "gloo", std::chrono::seconds(20));
    DistributedDataParallel<SyncBatchNorm> model(SyncBatchNorm(torch::nn::BatchNormOptions(3).affine(true), world),
                                                 pair);
    const auto out = model->forward(whole.narrow(0, 2 * world.rank(), 2));
    EXPECT_TRUE(torch::allclose(out, expected.narrow(0, 2 * world.rank(), 2), 1e-5, 1e-5)) << "rank " << world.rank();
  }, std::chrono::seconds(20));
}

} // namespace
} // namespace lockstep
