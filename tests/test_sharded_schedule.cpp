// When FullyShardedDataParallel gathers, frees and reduces: the order of
// its collectives (a group of one that logs them), and how many units are
// gathered at once (ranks as threads, tests/support/threads.h).

#include <lockstep/lockstep.h>

#include "../src/util/cpu_cache.h"
#include "../src/fsdp/storage_watch.h"
#include "support/errors.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace {

// Three layers, each its own all-gather (4 MiB): forward frees the first
// once the second runs.
TEST(FullyShardedDataParallel, BetweenForwardAndBackwardAFreedUnitIsGatheredAgainWhenRead) {
  torch::manual_seed(8);
  torch::nn::Sequential net(torch::nn::Linear(1024, 1024), torch::nn::Linear(1024, 1024), torch::nn::Linear(1024, 2));
  const auto initial = net[0]->as<torch::nn::Linear>()->weight.clone();
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<torch::nn::Sequential> model(
        std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone()), group);
    auto loss = model->forward(torch::randn({2, 1024})).sum();
    const auto& weight = model->module()[0]->as<torch::nn::Linear>()->weight;
    EXPECT_EQ(weight.storage().nbytes(), 0u) << "the first layer is freed after forward";
    EXPECT_THROW(weight.data_ptr<float>(), c10::Error) << "a raw read is no operator: refused, never garbage";
    EXPECT_TRUE(torch::equal(weight * 1, initial)) << "an operator reading it gathers it";
    loss.backward();
    EXPECT_EQ(weight.numel(), 0) << "outside forward and backward, never stale values";
  });
}

// Each layer its own unit and its own all-gather (just over 4 MiB, so that
// no two share a bucket of at most 8 MiB: Note [Shard buckets]), and a probe
// between layers that counts the units whose memory is there, in forward
// and, through a gradient hook, in backward.
TEST(FullyShardedDataParallel, AtMostTwoUnitsAreGatheredAtOnceInForwardAndBackward) {
  torch::manual_seed(3);
  constexpr int kLayers = 6;
  testing::spawn(2, [&](ProcessGroup& group) {
    torch::nn::Sequential net;
    std::vector<torch::Tensor> weights;
    size_t most_forward = 0, most_backward = 0;
    auto gathered = [&] {
      return static_cast<size_t>(std::count_if(weights.begin(), weights.end(),
                                               [](const torch::Tensor& w) { return w.storage().nbytes() > 0; }));
    };
    for (int i = 0; i < kLayers; ++i) {
      torch::nn::Linear layer(torch::nn::LinearOptions(1024, 1024));
      weights.push_back(layer->weight);
      net->push_back(layer);
      net->push_back(torch::nn::Functional([&](torch::Tensor x) {
        most_forward = std::max(most_forward, gathered());
        x.register_hook([&](const torch::Tensor& grad) {
          most_backward = std::max(most_backward, gathered());
          return grad;
        });
        return x;
      }));
    }
    FullyShardedDataParallel<torch::nn::Sequential> model(net, group);
    model->forward(torch::randn({2, 1024})).sum().backward();
    EXPECT_EQ(most_forward, 2u) << "a unit and the next one's prefetch";
    EXPECT_LE(most_backward, 2u);
    EXPECT_GE(most_backward, 1u);
    // Under no_sync too, as FSDP's: a unit whose backward is over is freed,
    // though its gradient is not reduced yet.
    most_forward = most_backward = 0;
    {
      auto accumulate = model->no_sync();
      model->forward(torch::randn({2, 1024})).sum().backward();
    }
    EXPECT_EQ(most_forward, 2u);
    EXPECT_LE(most_backward, 2u) << "no_sync's backward kept the units it was done with";
    model->forward(torch::randn({2, 1024})).sum().backward();
    EXPECT_LE(most_backward, 2u);
  });
}

// Two units of 4 MiB (each its own all-gather), b called before and after
// a: FullShard frees b once a runs and gathers it again for its second
// call, and its gradient sums both uses, as one process's does.
struct TwiceNetImpl : torch::nn::Module {
  TwiceNetImpl() {
    a = register_module("a", torch::nn::Linear(1024, 1024));
    b = register_module("b", torch::nn::Linear(1024, 1024));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return b(torch::tanh(a(torch::tanh(b(x)))));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwiceNet);

TEST(FullyShardedDataParallel, AUnitForwardCallsTwiceIsGatheredAgainAndMatchesOneProcess) {
  auto make = [] {
    torch::manual_seed(11);
    return TwiceNet();
  };
  TwiceNet bare = make();
  std::vector<TwiceNet> nets{make(), make()};
  const auto x = torch::randn({4, 1024});
  // Two steps: the first forward keeps b, the unit it expects to end in
  // (the last registered); the second knows that forward ends in a.
  torch::optim::SGD bare_sgd(bare->parameters(), 0.5);
  for (int step = 0; step < 2; ++step) {
    bare_sgd.zero_grad();
    bare->forward(x).pow(2).mean().backward();
    bare_sgd.step();
  }
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<TwiceNet> model(nets[group.rank()], group);
    torch::optim::SGD sgd(model->parameters(), 0.5);
    for (int step = 0; step < 2; ++step) {
      sgd.zero_grad();
      model->forward(x.narrow(0, 2 * group.rank(), 2)).pow(2).mean().backward();
      sgd.step();
    }
    auto full = model->summon_full_params();
    const auto& net = model->module();
    for (const auto& [mine, theirs] : {std::make_pair(net->a->weight, bare->a->weight),
                                       std::make_pair(net->b->weight, bare->b->weight),
                                       std::make_pair(net->b->bias, bare->b->bias)}) {
      EXPECT_TRUE(torch::allclose(mine, theirs, 1e-5, 1e-6)) << (mine - theirs).abs().max().item<float>();
    }
  });
}

struct ThreeUnitsImpl : torch::nn::Cloneable<ThreeUnitsImpl> {
  ThreeUnitsImpl() {
    reset();
  }
  void reset() override {
    a = register_module("a", torch::nn::Linear(1024, 1024)); // 4 MiB: buckets of their own
    b = register_module("b", torch::nn::Linear(1024, 1024));
    c = register_module("c", torch::nn::Linear(1024, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return c(torch::tanh(b(torch::tanh(a(x)))));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(ThreeUnits);

// Two forwards, then one backward through both (a siamese loss), as
// PyTorch's test_fsdp_multiple_forward: FullShard has freed and gathered
// the units again between them, and backward refills both forwards' saved
// views of each unit.
TEST(FullyShardedDataParallel, TwoForwardsThenOneBackwardMatchOneProcess) {
  torch::manual_seed(3);
  ThreeUnits initial;
  const auto x1 = torch::randn({4, 1024});
  const auto x2 = torch::randn({4, 1024});
  auto copy = [&] { return ThreeUnits(std::dynamic_pointer_cast<ThreeUnitsImpl>(initial->clone())); };
  auto reference = copy();
  torch::optim::SGD reference_sgd(reference->parameters(), 0.1);
  for (int step = 0; step < 2; ++step) {
    reference_sgd.zero_grad();
    (reference->forward(x1).pow(2).mean() + reference->forward(x2).pow(2).mean()).backward();
    reference_sgd.step();
  }
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    std::vector<ThreeUnits> nets{copy(), copy()};
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<ThreeUnits> model(nets[group.rank()], group, ShardingOptions().strategy(strategy));
      torch::optim::SGD sgd(model->parameters(), 0.1);
      for (int step = 0; step < 2; ++step) {
        sgd.zero_grad();
        auto first = model->forward(x1.narrow(0, 2 * group.rank(), 2)).pow(2).mean();
        auto second = model->forward(x2.narrow(0, 2 * group.rank(), 2)).pow(2).mean();
        (first + second).backward();
        sgd.step();
      }
      auto full = model->summon_full_params();
      auto mine = model->module()->named_parameters();
      auto theirs = reference->named_parameters();
      for (size_t i = 0; i < mine.size(); ++i) {
        EXPECT_TRUE(torch::allclose(mine[i].value(), theirs[i].value(), 1e-5, 1e-6)) << mine[i].key();
      }
    });
  }
}

// A target computed under NoGradGuard between a forward and its backward
// leaves that backward's reduce-scatter, as PyTorch's FSDP does; and an
// exception inside backward, which drops the callback that ends the step,
// makes the next forward an error instead of a step that reduces nothing.
TEST(FullyShardedDataParallel, ANoGradForwardBeforeBackwardReducesAndAnErrorInBackwardIsCaught) {
  torch::manual_seed(5);
  ThreeUnits initial;
  const auto x = torch::randn({4, 1024});
  auto copy = [&] { return ThreeUnits(std::dynamic_pointer_cast<ThreeUnitsImpl>(initial->clone())); };
  auto reference = copy();
  auto target = [](ThreeUnits& net, const torch::Tensor& input) {
    torch::NoGradGuard no_grad;
    return net->forward(input * 2);
  };
  auto out = reference->forward(x);
  torch::mse_loss(out, target(reference, x)).backward();
  torch::optim::SGD(reference->parameters(), 0.1).step();
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    std::vector<ThreeUnits> nets{copy(), copy()};
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<ThreeUnits> model(nets[group.rank()], group, ShardingOptions().strategy(strategy));
      torch::optim::SGD sgd(model->parameters(), 0.1);
      const auto mine = x.narrow(0, 2 * group.rank(), 2);
      auto y = model->forward(mine);
      torch::Tensor t;
      {
        torch::NoGradGuard no_grad;
        t = model->forward(mine * 2);
      }
      torch::mse_loss(y, t).backward();
      sgd.step();
      {
        auto full = model->summon_full_params();
        auto params = model->module()->named_parameters();
        auto expected = reference->named_parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_TRUE(torch::allclose(params[i].value(), expected[i].value(), 1e-5, 1e-6)) << params[i].key();
        }
      }
      auto input = mine.clone().requires_grad_(true); // its gradient comes after every unit's
      input.register_hook([](const torch::Tensor&) -> torch::Tensor { TORCH_CHECK(false, "the hook fails"); });
      EXPECT_ERROR_SAYS(model->forward(input).sum().backward(), "the hook fails");
      EXPECT_ERROR_SAYS(model->forward(mine), "the last backward stopped with an error before its end");
    });
  }
}

// Two units of one size, which forward reads in another order on rank 1.
struct OrderNetImpl : torch::nn::Module {
  explicit OrderNetImpl(bool swap) : swap(swap) {
    a = register_module("a", torch::nn::Linear(1024, 1024)); // 4 MiB: a bucket each
    b = register_module("b", torch::nn::Linear(1024, 1024));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return swap ? a(torch::tanh(b(x))) : b(torch::tanh(a(x)));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  bool swap;
};
TORCH_MODULE(OrderNet);

// Each rank gathers the unit its forward reads first. With equal sizes the
// all-gathers' sizes agree, and without a tag every rank would take the
// other's shards of another unit into its own (0.06 off one process after
// 3 steps); each bucket's tag makes it an error on every rank (Note
// [Collective tags]).
TEST(FullyShardedDataParallel, UnitsReadInAnotherOrderOnOneRankAreAnErrorOnEveryRank) {
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
    testing::spawn(2, [&](ProcessGroup& group) {
      torch::manual_seed(11);
      FullyShardedDataParallel<OrderNet> model(OrderNet(group.rank() == 1), group, ShardingOptions().strategy(strategy));
      torch::optim::SGD sgd(model->parameters(), 0.5);
      auto train = [&] {
        for (int step = 0; step < 3; ++step) {
          sgd.zero_grad();
          model->forward(torch::randn({2, 1024})).pow(2).mean().backward();
          sgd.step();
        }
      };
      EXPECT_ERROR_SAYS(train(), "ranks disagree on this collective", "the same sizes, but another collective",
          "a forward that reads its units in another order on some rank");
    }, std::chrono::seconds(20));
  }
}

// Two wrapped models of one layout, whose forwards one rank runs in the
// other order: each model's first unit is bucket 1, so without the model in
// the tag every rank would gather the other model's shards into its own
// without an error. Each wrapper's number, agreed at construction, joins
// its tags (Note [Collective tags]).
TEST(FullyShardedDataParallel, TwoModelsRunInAnotherOrderOnOneRankAreAnErrorOnEveryRank) {
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
    testing::spawn(2, [&](ProcessGroup& group) {
      torch::manual_seed(12);
      const auto options = ShardingOptions().strategy(strategy);
      FullyShardedDataParallel<torch::nn::Linear> first(torch::nn::Linear(1024, 1024), group, options);
      FullyShardedDataParallel<torch::nn::Linear> second(torch::nn::Linear(1024, 1024), group, options);
      auto run = [&] {
        const auto x = torch::randn({2, 1024});
        if (group.rank() == 1) {
          return second->forward(x).sum() + first->forward(x).sum();
        }
        return first->forward(x).sum() + second->forward(x).sum();
      };
      EXPECT_ERROR_SAYS(run(), "ranks disagree on this collective", "the same sizes, but another collective",
          "of wrapped model ", "two wrapped models run in another order on some rank");
    }, std::chrono::seconds(20));
  }
  testing::spawn(2, [&](ProcessGroup& group) { // the same for summon_full_params() called in another order
    FullyShardedDataParallel<torch::nn::Linear> first(torch::nn::Linear(1024, 1024), group);
    FullyShardedDataParallel<torch::nn::Linear> second(torch::nn::Linear(1024, 1024), group);
    auto summon = [&] {
      auto one = (group.rank() == 1 ? second : first)->summon_full_params();
      auto other = (group.rank() == 1 ? first : second)->summon_full_params();
    };
    EXPECT_ERROR_SAYS(summon(), "ranks disagree on this collective", "of wrapped model ");
  }, std::chrono::seconds(20));
}

// A group of one that keeps the name of every collective it is asked for.
class CountingGroup : public GroupImpl {
 public:
  explicit CountingGroup(std::vector<std::string>& log, bool cheap_starts = false)
      : log_(&log), cheap_starts_(cheap_starts) {}
  bool cheap_collective_starts() const override {
    return cheap_starts_;
  }
  int rank() const override {
    return 0;
  }
  int size() const override {
    return 1;
  }
  std::string backend() const override {
    return "counting";
  }
  std::chrono::milliseconds timeout() const override {
    return kDefaultTimeout;
  }
  std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>&, ReduceOp, std::string what) override {
    return done(what);
  }
  std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>&, int, std::string what) override {
    return done(what);
  }
  std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string what) override {
    outputs[0].copy_(input);
    return done(what);
  }
  std::shared_ptr<Work> barrier(std::string what) override {
    return done(what);
  }
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp, std::string what) override {
    output.copy_(input.view_as(output));
    return done(what);
  }

 private:
  struct Done : Work {
    void wait() override {}
  };
  std::shared_ptr<Work> done(const std::string& what) {
    log_->push_back(what);
    return std::make_shared<Done>();
  }
  std::vector<std::string>* log_;
  bool cheap_starts_;
};

std::vector<std::string> starting_with(const std::vector<std::string>& log, const std::string& prefix) {
  std::vector<std::string> found;
  for (const auto& what : log) {
    if (what.rfind(prefix, 0) == 0) {
      found.push_back(what);
    }
  }
  return found;
}

TEST(FullyShardedDataParallel, SmallUnitsShareTheirCollectivesAndALargeOneGoesAlone) {
  // Six units of 1 KiB, one of 8 MiB (a bucket of its own), one of 1 MiB.
  torch::nn::Sequential net;
  for (int i = 0; i < 6; ++i) {
    net->push_back(torch::nn::Linear(torch::nn::LinearOptions(16, 16).bias(false)));
  }
  net->push_back(torch::nn::Linear(torch::nn::LinearOptions(16, 131072).bias(false)));
  net->push_back(torch::nn::Linear(torch::nn::LinearOptions(131072, 2).bias(false)));
  std::vector<std::string> log;
  FullyShardedDataParallel<torch::nn::Sequential> model(net, ProcessGroup(std::make_shared<CountingGroup>(log)));
  log.clear();
  auto x = torch::randn({3, 16});
  model->forward(x).sum().backward();
  // In forward's order, then again in backward's (FullShard freed them all
  // but the last, which backward reads first).
  const std::vector<std::string> gathers{"all_gather of 6 units (0:Float to 5:Float) (1536 elements)",
                                         "all_gather of 6:Float (2097152 elements)",
                                         "all_gather of 7:Float (262144 elements)"};
  auto both = gathers;
  both.insert(both.end(), gathers.rbegin() + 1, gathers.rend());
  EXPECT_EQ(starting_with(log, "all_gather of"), both);
  // Reduce-scatters carry one more element per unit: Note [Units no rank used].
  EXPECT_EQ(starting_with(log, "reduce_scatter of"),
            (std::vector<std::string>{"reduce_scatter of 7:Float (262145 elements)",
                                      "reduce_scatter of 6:Float (2097153 elements)",
                                      "reduce_scatter of 6 units (5:Float to 0:Float) (1542 elements)"}));
}

// Note [Shard buckets]: forward's first bucket holds at most 1 MiB, the
// others up to 8 MiB, and the reduce-scatters take the same buckets in
// reverse. Seven units of 512 KiB.
TEST(FullyShardedDataParallel, TheFirstBucketIsSmallAndTheReduceScattersTakeTheBucketsInReverse) {
  torch::nn::Sequential net;
  for (int i = 0; i < 7; ++i) {
    net->push_back(torch::nn::Linear(torch::nn::LinearOptions(i % 2 ? 512 : 256, i % 2 ? 256 : 512).bias(false)));
  }
  std::vector<std::string> log;
  FullyShardedDataParallel<torch::nn::Sequential> model(net, ProcessGroup(std::make_shared<CountingGroup>(log)));
  log.clear();
  model->forward(torch::randn({3, 256})).sum().backward();
  EXPECT_EQ(starting_with(log, "all_gather of"),
            (std::vector<std::string>{"all_gather of 2 units (0:Float to 1:Float) (262144 elements)",
                                      "all_gather of 5 units (2:Float to 6:Float) (655360 elements)",
                                      "all_gather of 2 units (0:Float to 1:Float) (262144 elements)"}));
  EXPECT_EQ(starting_with(log, "reduce_scatter of"),
            (std::vector<std::string>{"reduce_scatter of 5 units (6:Float to 2:Float) (655365 elements)",
                                      "reduce_scatter of 2 units (1:Float to 0:Float) (262146 elements)"}));
}

// Note [Shard buckets]: where the backend starts collectives cheaply, the
// caps after the first double (1, 2, 4, then 8 MiB); elsewhere every bucket
// after the first holds up to 8 MiB. Fifteen units of 512 KiB.
TEST(FullyShardedDataParallel, WhereCollectivesStartCheaplyTheBucketCapsDouble) {
  auto gathers_with = [](bool cheap_starts) {
    torch::nn::Sequential net;
    for (int i = 0; i < 15; ++i) {
      net->push_back(torch::nn::Linear(torch::nn::LinearOptions(i % 2 ? 512 : 256, i % 2 ? 256 : 512).bias(false)));
    }
    std::vector<std::string> log;
    FullyShardedDataParallel<torch::nn::Sequential> model(
        net, ProcessGroup(std::make_shared<CountingGroup>(log, cheap_starts)),
        ShardingOptions().strategy(ShardingStrategy::ShardGradOp));
    log.clear();
    model->forward(torch::randn({3, 256})).sum().backward();
    return starting_with(log, "all_gather of");
  };
  EXPECT_EQ(gathers_with(true),
            (std::vector<std::string>{"all_gather of 2 units (0:Float to 1:Float) (262144 elements)",
                                      "all_gather of 4 units (2:Float to 5:Float) (524288 elements)",
                                      "all_gather of 8 units (6:Float to 13:Float) (1048576 elements)",
                                      "all_gather of 14:Float (131072 elements)"}));
  EXPECT_EQ(gathers_with(false),
            (std::vector<std::string>{"all_gather of 2 units (0:Float to 1:Float) (262144 elements)",
                                      "all_gather of 13 units (2:Float to 14:Float) (1703936 elements)"}));
}

// Note [Watching storages]: a thread is watched from forward to the end of
// backward, and its operators after the step pass the dispatcher as before.
TEST(FullyShardedDataParallel, AfterTheStepTheThreadIsNoLongerWatched) {
  torch::nn::Sequential net(torch::nn::Linear(1024, 1024), torch::nn::Linear(1024, 2));
  std::vector<std::string> log;
  FullyShardedDataParallel<torch::nn::Sequential> model(net, ProcessGroup(std::make_shared<CountingGroup>(log)));
  torch::optim::SGD sgd(model->parameters(), 0.1);
  EXPECT_FALSE(detail::watching());
  auto loss = model->forward(torch::randn({3, 1024})).sum();
  EXPECT_TRUE(detail::watching()) << "between forward and backward";
  loss.backward();
  sgd.step(); // operators after the last pass has ended
  EXPECT_FALSE(detail::watching());
}

// The first layer's backward reads only its input, when the input takes no
// gradient: its gather in backward is wasted once, then no longer
// prefetched, and gathered on demand when a backward reads it after all.
TEST(FullyShardedDataParallel, BackwardPrefetchesOnlyTheUnitsTheLastBackwardRead) {
  torch::manual_seed(5);
  torch::nn::Sequential net(torch::nn::Linear(1024, 1024), torch::nn::Linear(1024, 1024), torch::nn::Linear(1024, 2));
  auto bare = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
  std::vector<std::string> log;
  FullyShardedDataParallel<torch::nn::Sequential> model(net, ProcessGroup(std::make_shared<CountingGroup>(log)));
  auto gathers_of_first = [&] {
    auto gathers = starting_with(log, "all_gather of 0:Float");
    log.clear();
    return gathers.size();
  };
  auto x = torch::randn({3, 1024});
  log.clear();
  model->forward(x).sum().backward();
  EXPECT_EQ(gathers_of_first(), 2u) << "forward, and backward's prefetch";
  model->forward(x).sum().backward();
  EXPECT_EQ(gathers_of_first(), 1u) << "forward only";
  auto input = x.clone().requires_grad_(true);
  model->forward(input).sum().backward();
  EXPECT_EQ(gathers_of_first(), 2u) << "forward, and backward's read on demand";
  auto expected = x.clone().requires_grad_(true);
  bare->forward(expected).sum().backward();
  EXPECT_TRUE(torch::allclose(input.grad(), expected.grad(), 1e-5, 1e-6));
}

// Note [A sharded step's memory]: from the second step on, the step's large
// blocks (gathers' inputs, gradients, reduce-scatters' outputs) come from
// the cache, the caller's thread allocates from glibc again after the step,
// and the cache gives everything back when the last model is gone.
TEST(FullyShardedDataParallel, ASteadyStepReusesItsMemoryAndTheCacheClosesWithTheModel) {
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
    SCOPED_TRACE(strategy == ShardingStrategy::FullShard ? "FullShard" : "ShardGradOp");
    torch::manual_seed(2);
    torch::nn::Sequential net(torch::nn::Linear(256, 256), torch::nn::Linear(256, 256), torch::nn::Linear(256, 256),
                              torch::nn::Linear(256, 10));
    const auto x = torch::randn({64, 256});
    testing::spawn(2, [&](ProcessGroup& group) {
      {
        FullyShardedDataParallel<torch::nn::Sequential> model(
            std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone()), group,
            ShardingOptions().strategy(strategy));
        torch::optim::Adam adam(model->parameters(), 1e-3);
        auto step = [&] {
          adam.zero_grad();
          model->forward(x).sum().backward();
          adam.step();
        };
        for (int i = 0; i < 3; ++i) {
          step();
        }
        group.barrier();
        const auto warm = detail::cpu_cache_stats();
        constexpr int kSteps = 5;
        for (int i = 0; i < kSteps; ++i) {
          step();
        }
        group.barrier();
        const auto steady = detail::cpu_cache_stats(); // both ranks' steps: the cache is the process's
        const auto reused = steady.reused - warm.reused, fresh = steady.fresh - warm.fresh;
        EXPECT_GE(reused, 4 * kSteps) << "each step reuses its gradients and its gathers' inputs";
        EXPECT_GE(reused, 9 * fresh) << "steady steps took " << fresh << " blocks fresh from the system";
        auto on_caller = torch::ones({1 << 20});
        group.barrier();
        const auto after = detail::cpu_cache_stats();
        EXPECT_EQ(after.reused + after.fresh, steady.reused + steady.fresh)
            << "an allocation after the step went through the cache";
        EXPECT_EQ(on_caller.sum().item<float>(), float(1 << 20));
        group.barrier();
      }
      group.barrier();
    });
    EXPECT_EQ(detail::cpu_cache_stats().idle_bytes, 0u) << "the cache kept its memory after the model was gone";
  }
}


} // namespace
} // namespace lockstep
