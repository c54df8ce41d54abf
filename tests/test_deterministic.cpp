// DistributedDataParallel's deterministic mode with ranks as threads: the
// same bits at W = 2, 3 and 4 as on one rank, and each refusal. Dropout is
// checked with ranks as processes (ddp_worker.cpp): threads share the
// process's default generator.

#include <lockstep/lockstep.h>

#include "support/collective_contract.h"
#include "support/deterministic_checks.h"
#include "support/errors.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

namespace lockstep {
namespace {

using testing::DeterministicNet;
using testing::DeterministicRun;

// Note [The same bits at any world size]: a matrix product may split its
// sums by thread, so every W runs with as many intra-op threads.
class Deterministic : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::set_num_threads(1);
  }
};

TEST_F(Deterministic, SgdGivesOneRanksBitsAtTwoThreeAndFourRanks) {
  for (int world : {2, 3, 4}) {
    testing::spawn(world, [](ProcessGroup& group) {
      testing::check_same_bits_as_one_rank(group, DeterministicRun(), testing::kCheck);
    });
  }
}

TEST_F(Deterministic, AdamWithClippingGivesOneRanksBitsAtTwoAndThreeRanks) {
  DeterministicRun run;
  run.optimizer = "adam";
  run.clip = 0.05;
  for (int world : {2, 3}) {
    testing::spawn(world, [&](ProcessGroup& group) { testing::check_same_bits_as_one_rank(group, run, testing::kCheck); });
  }
}

TEST_F(Deterministic, BatchNormGivesOneRanksBitsAtTwoAndThreeRanks) {
  DeterministicRun run;
  run.batch_norm = true;
  for (int world : {2, 3}) {
    testing::spawn(world, [&](ProcessGroup& group) { testing::check_same_bits_as_one_rank(group, run, testing::kCheck); });
  }
}

// On a GPU, over Gloo's staging copies (NCCL takes one rank per GPU): the
// same bits at two and three ranks, with BatchNorm and deterministic kernels.
TEST_F(Deterministic, OneRanksBitsOnTheGpu_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  DeterministicRun run;
  run.batch_norm = true;
  run.device = torch::Device(torch::kCUDA, 0);
  for (int world : {2, 3}) {
    testing::spawn(world, [&](ProcessGroup& group) { testing::check_same_bits_as_one_rank(group, run, testing::kCheck); });
  }
}

// Step `step` of 4 micro-batches of 3 rows through `ddp`, and the same
// micro-batches in order through `bare`'s forward alone.
void step_beside(DistributedDataParallel<DeterministicNet>& ddp, DeterministicNet& bare, int64_t step) {
  const auto batch = testing::global_batch(12, step);
  ddp->backward_micro_batches(step, [&](int64_t v) {
    return torch::mse_loss(ddp->forward(batch.first.narrow(0, 3 * v, 3)), batch.second.narrow(0, 3 * v, 3));
  });
  torch::NoGradGuard no_grad;
  for (int64_t v = 0; v < 4; ++v) {
    bare->forward(batch.first.narrow(0, 3 * v, 3));
  }
}

// Note [Running statistics over micro-batches]: the statistics are those of
// one BatchNorm that saw the micro-batches in order, up to rounding.
TEST_F(Deterministic, BatchNormStatisticsAreThoseOfTheMicroBatchesInOrder) {
  DeterministicNet net(0, true), bare(0, true);
  DistributedDataParallel<DeterministicNet> ddp(net, ProcessGroup(),
                                                DistributedOptions().deterministic(true).micro_batches(4));
  for (int64_t step = 0; step < 2; ++step) {
    step_beside(ddp, bare, step);
  }
  EXPECT_TRUE(torch::allclose(net->norm->running_mean, bare->norm->running_mean, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(net->norm->running_var, bare->norm->running_var, 1e-6, 1e-7));
  EXPECT_EQ(net->norm->num_batches_tracked.item<int64_t>(), 8);
  EXPECT_FALSE(torch::equal(net->norm->running_mean, torch::zeros({24})));
}

// The gradient is the mean over the global batch, as one backward over it
// gives it up to rounding: the loss is each micro-batch's mean, over V.
TEST_F(Deterministic, TheGradientIsTheMeanOverTheGlobalBatch) {
  DeterministicNet net, bare;
  DistributedDataParallel<DeterministicNet> ddp(net, ProcessGroup(),
                                                DistributedOptions().deterministic(true).micro_batches(4));
  const auto batch = testing::global_batch(12, 0);
  const double loss = ddp->backward_micro_batches(0, [&](int64_t v) {
    return torch::mse_loss(ddp->forward(batch.first.narrow(0, 3 * v, 3)), batch.second.narrow(0, 3 * v, 3));
  });
  auto whole = torch::mse_loss(bare->forward(batch.first), batch.second);
  whole.backward();
  EXPECT_NEAR(loss, whole.item<double>(), 1e-6);
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(net->parameters()[i].grad(), bare->parameters()[i].grad(), 1e-5, 1e-6)) << i;
  }
}

// A gradient is a tensor of its own: zero_grad(false) (1.13's zero_grad())
// detaches it in place, which a view would refuse.
TEST_F(Deterministic, GradientsAreNotViews) {
  for (int world : {1, 2}) { // at 2, the gradients share the gathered storage
    testing::spawn(world, [](ProcessGroup& group) {
      DeterministicNet net;
      DistributedDataParallel<DeterministicNet> ddp(net, group, DistributedOptions().deterministic(true).micro_batches(2));
      const auto x = torch::ones({1, 7});
      ddp->backward_micro_batches(0, [&](int64_t) { return ddp->forward(x).sum(); });
      for (const auto& p : net->parameters()) {
        EXPECT_FALSE(p.grad().is_view());
      }
      const auto kept = net->fc1->bias.grad();
      const auto before = kept.clone();
      for (auto& p : net->parameters()) { // Optimizer::zero_grad's loop without set_to_none, fc1's weight alone
        if (p.is_same(net->fc1->weight)) {
          p.mutable_grad().detach_();
          p.mutable_grad().zero_();
        }
      }
      EXPECT_TRUE(torch::equal(net->fc1->weight.grad(), torch::zeros_like(net->fc1->weight)));
      EXPECT_TRUE(torch::equal(net->fc1->bias.grad(), before)) << "zeroing one gradient reached another";
      ddp->backward_micro_batches(1, [&](int64_t) { return 2 * ddp->forward(x).sum(); });
      EXPECT_TRUE(torch::equal(kept, before)) << "the next step wrote into a gradient kept from this one";
      EXPECT_FALSE(torch::equal(net->fc1->bias.grad(), before));
    });
  }
}

TEST_F(Deterministic, TheSeedSetsEachMicroBatchsDropout) {
  auto grads = [](uint64_t seed, DeterministicNet net) {
    DistributedDataParallel<DeterministicNet> ddp(net, ProcessGroup(),
                                                  DistributedOptions().deterministic(true).micro_batches(2).seed(seed));
    const auto batch = testing::global_batch(4, 0);
    ddp->backward_micro_batches(0, [&](int64_t v) {
      return torch::mse_loss(ddp->forward(batch.first.narrow(0, 2 * v, 2)), batch.second.narrow(0, 2 * v, 2));
    });
    return net->fc1->weight.grad().clone();
  };
  EXPECT_TRUE(torch::equal(grads(1, DeterministicNet(0.5)), grads(1, DeterministicNet(0.5))));
  EXPECT_FALSE(torch::equal(grads(1, DeterministicNet(0.5)), grads(2, DeterministicNet(0.5))));
  DeterministicNet net(0.5); // its Linear layers draw when made
  torch::manual_seed(7);
  const auto expected = torch::rand({3});
  torch::manual_seed(7);
  grads(3, net);
  EXPECT_TRUE(torch::equal(torch::rand({3}), expected)) << "the caller's generator goes on as if nothing drew from it";
}

DistributedOptions deterministic() {
  return DistributedOptions().deterministic(true).micro_batches(4);
}

TEST_F(Deterministic, RefusesWhatItCannotKeepExact) {
  DeterministicNet net;
  EXPECT_ERROR_SAYS(DistributedDataParallel<DeterministicNet>(net, ProcessGroup(), DistributedOptions().deterministic(true)),
                    "needs micro_batches(V)");
  EXPECT_ERROR_SAYS(DistributedDataParallel<DeterministicNet>(net, ProcessGroup(),
                                                              deterministic().comm_hook(comm_hooks::fp16_compress)),
                    "neither a comm_hook");
  torch::nn::Sequential cumulative(torch::nn::Linear(7, 4),
                                   torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(4).momentum(c10::nullopt)));
  EXPECT_ERROR_SAYS(DistributedDataParallel<torch::nn::Sequential>(cumulative, ProcessGroup(), deterministic()),
                    "'1' (torch::nn::BatchNorm1d", "keeps a cumulative average", "Give it a momentum");
  torch::nn::Sequential synced(torch::nn::Linear(7, 4), SyncBatchNorm(torch::nn::BatchNormOptions(4)));
  EXPECT_ERROR_SAYS(DistributedDataParallel<torch::nn::Sequential>(synced, ProcessGroup(), deterministic()),
                    "'1' is a lockstep::SyncBatchNorm");
  EXPECT_ERROR_SAYS(DistributedDataParallel<DeterministicNet>(net, ProcessGroup(),
                                                              deterministic().find_unused_parameters(true)),
                    "find_unused_parameters and static_graph", "would change nothing");
}

// Options that only deterministic mode reads were taken without it, and
// changed nothing: each wrapper refuses them, naming deterministic(true).
TEST_F(Deterministic, ItsOptionsWithoutItAreRefused) {
  DeterministicNet net;
  EXPECT_ERROR_SAYS(DistributedDataParallel<DeterministicNet>(net, ProcessGroup(), DistributedOptions().micro_batch_size(8)),
                    "DistributedOptions() sets micro_batches(0), micro_batch_size(8) or seed(0) without "
                    "deterministic(true)");
  EXPECT_ERROR_SAYS(FullyShardedDataParallel<DeterministicNet>(DeterministicNet(), ProcessGroup(),
                                                               ShardingOptions().seed(3)),
                    "ShardingOptions() sets", "seed(3) without deterministic(true)");
  EXPECT_ERROR_SAYS(DataParallel<DeterministicNet>(DeterministicNet(), DataParallelOptions().micro_batches(4)),
                    "DataParallelOptions() sets micro_batches(4)", "Add deterministic(true)");
}

struct TwiceNormImpl : torch::nn::Module {
  TwiceNormImpl() {
    fc = register_module("fc", torch::nn::Linear(7, 7));
    norm = register_module("norm", torch::nn::BatchNorm1d(7));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return norm(fc(norm(x)));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(TwiceNorm);

TEST_F(Deterministic, RefusesABatchNormRunTwiceInOneMicroBatch) {
  TwiceNorm net;
  DistributedDataParallel<TwiceNorm> ddp(net, ProcessGroup(), deterministic());
  const auto x = torch::randn({3, 7});
  EXPECT_ERROR_SAYS(ddp->backward_micro_batches(0, [&](int64_t) { return ddp->forward(x).sum(); }),
                    "'norm' ran 2 times in micro-batch 0");
}

TEST_F(Deterministic, RefusesAMisusedStep) {
  DeterministicNet net;
  DistributedDataParallel<DeterministicNet> ddp(net, ProcessGroup(), deterministic());
  const auto x = torch::ones({3, 7});
  auto loss_of = [&](int64_t) { return ddp->forward(x).sum(); };
  EXPECT_ERROR_SAYS(ddp->backward_micro_batches(-1, loss_of), "step must be >= 0, but got -1");
  EXPECT_ERROR_SAYS(ddp->backward_micro_batches(0, [&](int64_t) {
    ddp->backward_micro_batches(0, loss_of);
    return ddp->forward(x).sum();
  }), "called from inside its own loss_of");
  {
    torch::NoGradGuard no_grad;
    EXPECT_ERROR_SAYS(ddp->backward_micro_batches(0, loss_of), "needs autograd on");
  }
  EXPECT_ERROR_SAYS(DistributedDataParallel<DeterministicNet>(DeterministicNet(), ProcessGroup(),
                                                              deterministic().gradient_as_bucket_view(true)),
                    "nor gradient_as_bucket_view");
  EXPECT_ERROR_SAYS(DistributedDataParallel<DeterministicNet>(DeterministicNet(), ProcessGroup(),
                                                              deterministic().micro_batch_size(-2)),
                    "micro_batch_size must be >= 0");
  ddp->backward_micro_batches(1, loss_of); // each refusal left the wrapper usable
}

// A buffer that forward changes: from the data, it would differ between
// ranks after a step; counting forwards, it would grow by V/W a step.
struct CountingNetImpl : torch::nn::Module {
  CountingNetImpl() {
    fc = register_module("fc", torch::nn::Linear(7, 3));
    seen = register_buffer("seen", torch::zeros({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    seen.add_(x.sum().detach());
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor seen;
};
TORCH_MODULE(CountingNet);

TEST_F(Deterministic, RefusesABufferThatDiffersBetweenRanks) {
  testing::spawn(2, [](ProcessGroup& group) {
    CountingNet net;
    DistributedDataParallel<CountingNet> ddp(net, group, DistributedOptions().deterministic(true).micro_batches(2));
    const auto x = torch::zeros({2, 7}); // forward adds 0: the buffer stays as it is
    auto loss_of = [&](int64_t) { return ddp->forward(x).sum(); };
    ddp->backward_micro_batches(0, loss_of);
    {
      torch::NoGradGuard no_grad;
      net->seen.fill_(static_cast<double>(group.rank())); // between steps, each rank its own
    }
    EXPECT_ERROR_SAYS(ddp->backward_micro_batches(1, loss_of), "as step 1 starts, buffer 'seen' differs between rank 0 "
                      "and rank 1");
  });
}

// A buffer that the micro-batches change would end other at another W (a
// count of forwards grows by V/W on each rank), even where the ranks agree:
// refused on every rank, at one rank too. So is a frozen parameter changed.
TEST_F(Deterministic, RefusesABufferOrFrozenParameterThatForwardChanges) {
  for (int world : {1, 2}) {
    const auto errors = testing::strings_by_rank(world, [](ProcessGroup& group) {
      CountingNet net;
      DistributedDataParallel<CountingNet> ddp(net, group, DistributedOptions().deterministic(true).micro_batches(2));
      const auto x = torch::ones({2, 7}); // the same on every rank
      return testing::message_of([&] { ddp->backward_micro_batches(0, [&](int64_t) { return ddp->forward(x).sum(); }); });
    });
    for (const auto& error : errors) {
      EXPECT_NE(error.find("step 0's micro-batches changed buffer 'seen' on rank 0"), std::string::npos) << error;
    }
  }
  DeterministicNet net;
  net->fc2->weight.requires_grad_(false);
  DistributedDataParallel<DeterministicNet> ddp(net, ProcessGroup(), deterministic());
  EXPECT_ERROR_SAYS(ddp->backward_micro_batches(0, [&](int64_t) {
    {
      torch::NoGradGuard no_grad;
      net->fc2->weight.mul_(0.5); // as an EMA teacher updated in forward
    }
    return ddp->forward(torch::ones({3, 7})).sum();
  }), "changed frozen parameter 'fc2.weight'");
}

// Each micro-batch's dropout is seeded by (seed, step, micro-batch): ranks
// passed other step numbers would draw what no single rank would, and give
// other bits than one rank, without a word. Every rank refuses.
TEST_F(Deterministic, RefusesRanksAtOtherStepNumbers) {
  const auto errors = testing::strings_by_rank(2, [](ProcessGroup& group) {
    DeterministicNet net;
    DistributedDataParallel<DeterministicNet> ddp(net, group, DistributedOptions().deterministic(true).micro_batches(2));
    const auto x = torch::ones({3, 7});
    return testing::message_of(
        [&] { ddp->backward_micro_batches(4 + group.rank(), [&](int64_t) { return ddp->forward(x).sum(); }); });
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank 0 runs backward_micro_batches(4) but rank 1 runs backward_micro_batches(5)"),
              std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// A net of another layout than DeterministicNet's.
struct WideNetImpl : torch::nn::Module {
  WideNetImpl() {
    fc = register_module("fc", torch::nn::Linear(7, 300));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(WideNet);

// Note [A step's planned collectives]: from the second step on, a step's
// collectives go as a plan. Two models whose steps one rank runs in the
// other order would meet collective for collective: of one layout, with the
// same sizes; of two, with other sizes, which Gloo's own thread would end
// the process on. The rank that switches plans is at a check (Note [A
// switch of plans is checked]), which the other's planned ring never pairs
// with: every rank fails at the group's timeout, naming its collective, and
// no model takes the other's sums.
TEST_F(Deterministic, TwoModelsWhoseStepsRunInAnotherOrderOnOneRankAreAnErrorOnEveryRank) {
  for (const bool same_layout : {true, false}) {
    const auto errors = testing::strings_by_rank(2, [&](ProcessGroup& group) {
      const auto options = DistributedOptions().deterministic(true).micro_batches(2);
      DistributedDataParallel<DeterministicNet> first(DeterministicNet(), group, options);
      DistributedDataParallel<DeterministicNet> same(DeterministicNet(), group, options);
      DistributedDataParallel<WideNet> wide(WideNet(), group, options);
      const auto x = torch::ones({3, 7});
      auto step = [&](auto& model, int64_t s) {
        model->backward_micro_batches(s, [&](int64_t) { return model->forward(x).sum(); });
      };
      auto second = [&](int64_t s) { same_layout ? step(same, s) : step(wide, s); };
      for (int64_t s = 0; s < 3; ++s) { // checked and recorded; agreed and planned; planned
        step(first, s);
        second(s);
      }
      return testing::message_of([&] {
        if (group.rank() == 1) {
          second(3);
          step(first, 3);
        } else {
          step(first, 3);
          second(3);
        }
      });
    }, std::chrono::seconds(3));
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find("step 3's largest gradients, losses and buffers (deterministic mode) failed or did not "
                               "complete within the group's timeout"),
                std::string::npos) << "rank " << r << ": " << errors[r];
    }
  }
}

TEST_F(Deterministic, RefusesGradientsFromElsewhere) {
  DeterministicNet net;
  DistributedDataParallel<DeterministicNet> ddp(net, ProcessGroup(), deterministic().micro_batch_size(3));
  const auto x = torch::ones({3, 7});
  EXPECT_ERROR_SAYS(ddp->forward(x), "outside backward_micro_batches", "NoGradGuard");
  {
    torch::NoGradGuard no_grad;
    EXPECT_EQ(ddp->forward(x).size(0), 3); // evaluation
  }
  EXPECT_ERROR_SAYS(ddp->backward_micro_batches(0, [&](int64_t) { return ddp->forward(torch::ones({2, 7})).sum(); }),
                    "micro-batch 0's forward got a batch of 2", "micro_batch_size is 3");
  EXPECT_ERROR_SAYS(ddp->backward_micro_batches(0, [&](int64_t) { return ddp->forward(x); }),
                    "loss_of(0) must return the micro-batch's loss", "9 elements");
  EXPECT_ERROR_SAYS([&] {
    auto guard = ddp->no_sync();
    ddp->backward_micro_batches(0, [&](int64_t) { return ddp->forward(x).sum(); });
  }(), "no_sync() has no use");
  EXPECT_ERROR_SAYS(ddp->join(), "deterministic mode has no join");
  DeterministicNet other;
  DistributedDataParallel<DeterministicNet> plain(other, ProcessGroup());
  EXPECT_ERROR_SAYS(plain->backward_micro_batches(0, [&](int64_t) { return plain->forward(x).sum(); }),
                    "needs DistributedOptions().deterministic(true)");
}

// An error in one rank's micro-batch (here a short batch on rank 1 only)
// is an error on every rank at once, not a wait until the group's timeout;
// the running statistics are as the step found them.
TEST_F(Deterministic, OneRanksMicroBatchErrorIsAnErrorOnEveryRank) {
  const auto errors = testing::strings_by_rank(2, [](ProcessGroup& group) {
    DeterministicNet net(0, true);
    DistributedDataParallel<DeterministicNet> ddp(net, group, deterministic().micro_batch_size(3));
    const auto before = net->norm->running_mean.clone();
    const auto rows = group.rank() == 1 ? 2 : 3;
    auto message = testing::message_of([&] {
      ddp->backward_micro_batches(0, [&](int64_t) { return ddp->forward(torch::ones({rows, 7})).sum(); });
    });
    EXPECT_TRUE(torch::equal(net->norm->running_mean, before));
    return message;
  }, std::chrono::seconds(10));
  EXPECT_NE(errors[0].find("rank 1 failed in micro-batch 2 of step 0; its own error says why"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("micro-batch 2's forward got a batch of 2"), std::string::npos) << errors[1];
}

// Every micro-batch's update uses the momentum forward used, read at each
// step: a schedule set after wrapping is followed, and a layer registered
// under two names is one layer, updated once per micro-batch.
TEST_F(Deterministic, BatchNormFollowsAMomentumScheduleAndIsOneLayerUnderTwoNames) {
  DeterministicNet net(0, true), bare(0, true);
  net->register_module("same_norm", net->norm);
  DistributedDataParallel<DeterministicNet> ddp(net, ProcessGroup(), deterministic());
  for (int64_t step = 0; step < 2; ++step) {
    net->norm->options.momentum(step == 0 ? 0.1 : 0.5);
    bare->norm->options.momentum(step == 0 ? 0.1 : 0.5);
    step_beside(ddp, bare, step);
  }
  EXPECT_EQ(net->norm->num_batches_tracked.item<int64_t>(), 8);
  EXPECT_TRUE(torch::allclose(net->norm->running_mean, bare->norm->running_mean, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(net->norm->running_var, bare->norm->running_var, 1e-6, 1e-7));
}

// A parameter that no micro-batch uses gets no gradient, so that momentum
// and weight decay leave it alone, as under PyTorch's DDP.
struct WithUnusedHeadImpl : torch::nn::Module {
  WithUnusedHeadImpl() {
    fc = register_module("fc", torch::nn::Linear(7, 3));
    unused = register_module("unused", torch::nn::Linear(7, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc(x);
  }
  torch::nn::Linear fc{nullptr}, unused{nullptr};
};
TORCH_MODULE(WithUnusedHead);

TEST_F(Deterministic, AnUnusedParameterGetsNoGradient) {
  testing::spawn(2, [](ProcessGroup& group) {
    WithUnusedHead net;
    DistributedDataParallel<WithUnusedHead> ddp(net, group, deterministic());
    torch::optim::SGD sgd(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.1));
    const auto before = net->unused->weight.clone();
    ddp->backward_micro_batches(0, [&](int64_t) { return ddp->forward(torch::ones({3, 7})).sum(); });
    sgd.step();
    EXPECT_TRUE(net->fc->weight.grad().defined());
    EXPECT_FALSE(net->unused->weight.grad().defined());
    EXPECT_TRUE(torch::equal(net->unused->weight, before));
  });
}

// What deterministic mode cannot sum exactly is refused as it wraps, naming
// the parameter or layer.
TEST_F(Deterministic, RefusesComplexParametersAndSparseGradients) {
  torch::nn::Sequential complex(torch::nn::Linear(7, 3));
  complex->register_parameter("phase", torch::zeros({3}, torch::kComplexFloat));
  EXPECT_ERROR_SAYS(DistributedDataParallel<torch::nn::Sequential>(complex, ProcessGroup(), deterministic()),
                    "parameter 'phase' is complex", "view_as_real");
  const void* weight = complex->named_parameters()["0.weight"].data_ptr();
  EXPECT_ERROR_SAYS(FullyShardedDataParallel<torch::nn::Sequential>(
                        complex, ProcessGroup(), ShardingOptions().deterministic(true).micro_batches(4)),
                    "parameter 'phase' is complex");
  EXPECT_EQ(complex->named_parameters()["0.weight"].data_ptr(), weight) << "refused after sharding changed the module";
  complex->named_parameters()["phase"].requires_grad_(false); // frozen: DDP never sums it
  EXPECT_NO_THROW(DistributedDataParallel<torch::nn::Sequential>(complex, ProcessGroup(), deterministic()));
  EXPECT_ERROR_SAYS(DataParallel<torch::nn::Sequential>(complex, DataParallelOptions().deterministic(true).micro_batches(2)),
                    "parameter 'phase' is complex"); // DataParallel sums frozen ones too: one may train later
  torch::nn::Sequential sparse(torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)));
  EXPECT_ERROR_SAYS(DataParallel<torch::nn::Sequential>(sparse, DataParallelOptions().deterministic(true).micro_batches(2)),
                    "'0' is an Embedding with sparse(true)", "sparse(false)");
}

} // namespace
} // namespace lockstep
