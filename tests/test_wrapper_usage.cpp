// The distributed wrappers against what users do around them: zero_grad
// between FullyShardedDataParallel's no_sync micro-batches (Note [Dropping
// a no_sync accumulation] in src/fsdp/precision.cpp), forwards that
// return a std::pair or throw halfway, a DistributedDataParallel cast or
// split over devices after wrapping. Ranks as threads.

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/fsdp_checks.h"
#include "support/scratch.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace lockstep {
namespace {

using Net = torch::nn::Sequential;

using testing::kStrategies;

Net tanh_net() {
  torch::manual_seed(0);
  return Net(torch::nn::Linear(5, 3), torch::nn::Tanh(), torch::nn::Linear(3, 2));
}

std::vector<torch::Tensor> params_of(torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  for (const auto& p : module.parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

// Each rank's module, made before the ranks' threads start: they share the
// generator, so seeding and drawing on each of them at once would mix.
template <typename M, typename Make>
std::vector<M> per_rank(Make make) {
  return {make(), make()};
}

bool close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  bool equal = a.size() == b.size();
  for (size_t i = 0; equal && i < a.size(); ++i) {
    equal = torch::allclose(a[i], b[i], 1e-6, 1e-6);
  }
  return equal;
}

torch::Tensor loss_of(const torch::Tensor& y) {
  return y.pow(2).mean();
}

// One SGD step of one process on the batches in `counted`, in order.
std::vector<torch::Tensor> reference_step(const std::vector<torch::Tensor>& counted) {
  auto net = tanh_net();
  torch::optim::SGD sgd(net->parameters(), 0.5);
  for (const auto& x : counted) {
    loss_of(net->forward(x)).backward();
  }
  sgd.step();
  return params_of(*net);
}

// How the gradients are cleared: the optimizer's zero_grad() (to none in
// LibTorch 2.x, to zero in 1.13), each of those by hand, or the wrapper's.
enum class Clear { kOptimizer, kToNone, kToZero, kModel };

const char* name_of(Clear clear) {
  switch (clear) {
    case Clear::kOptimizer:
      return "optimizer.zero_grad()";
    case Clear::kToNone:
      return "each shard's grad reset";
    case Clear::kToZero:
      return "each shard's grad zero_()";
    case Clear::kModel:
      return "model->zero_grad()";
  }
  return "?";
}

template <typename Model>
void clear_gradients(Clear clear, Model& model, torch::optim::Optimizer& optimizer) {
  switch (clear) {
    case Clear::kOptimizer:
      optimizer.zero_grad();
      break;
    case Clear::kModel:
      model->zero_grad();
      break;
    default:
      for (auto& p : model->parameters()) {
        if (clear == Clear::kToNone) {
          p.mutable_grad().reset();
        } else if (p.grad().defined()) {
          p.mutable_grad().zero_();
        }
      }
  }
}

// Three micro-batches: the first under no_sync, then the gradients cleared,
// then one more under no_sync and one synced. The step is one process's
// on the last two: what the first accumulated was dropped, as PyTorch's
// FSDP drops it (the optimizer clears the flat parameter holding it).
TEST(ShardedUsage, ZeroGradAfterANoSyncBackwardDropsWhatItAccumulated) {
  torch::manual_seed(7);
  const std::vector<torch::Tensor> batches{torch::randn({4, 5}), torch::randn({4, 5}), torch::randn({4, 5})};
  const auto want = reference_step({batches[1], batches[2]});
  for (auto strategy : kStrategies) {
    for (auto clear : {Clear::kOptimizer, Clear::kToNone, Clear::kToZero, Clear::kModel}) {
      const auto nets = per_rank<Net>(tanh_net);
      testing::spawn(2, [&](ProcessGroup& group) {
        FullyShardedDataParallel<Net> model(nets[group.rank()], group, ShardingOptions().strategy(strategy));
        torch::optim::SGD sgd(model->parameters(), 0.5);
        const auto share = [&](int b) { return batches[b].chunk(group.size())[group.rank()]; };
        {
          auto guard = model->no_sync();
          loss_of(model(share(0))).backward();
        }
        clear_gradients(clear, model, sgd);
        {
          auto guard = model->no_sync();
          loss_of(model(share(1))).backward();
        }
        loss_of(model(share(2))).backward();
        sgd.step();
        auto full = model->summon_full_params();
        EXPECT_TRUE(close(params_of(*model->module()), want))
            << "rank " << group.rank() << ", strategy " << static_cast<int>(strategy) << ", " << name_of(clear)
            << ": the step does not equal one process's on the micro-batches after the clear";
      });
    }
  }
}

// Without a clear in between, every no_sync micro-batch counts, whatever
// reads the shards' gradients before the synced backward.
TEST(ShardedUsage, AccumulationWithoutAClearKeepsEveryMicroBatch) {
  torch::manual_seed(8);
  const std::vector<torch::Tensor> batches{torch::randn({4, 5}), torch::randn({4, 5}), torch::randn({4, 5})};
  const auto want = reference_step(batches);
  for (auto strategy : kStrategies) {
    const auto nets = per_rank<Net>(tanh_net);
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<Net> model(nets[group.rank()], group, ShardingOptions().strategy(strategy));
      torch::optim::SGD sgd(model->parameters(), 0.5);
      sgd.zero_grad();
      const auto share = [&](int b) { return batches[b].chunk(group.size())[group.rank()]; };
      for (int b = 0; b < 2; ++b) {
        auto guard = model->no_sync();
        loss_of(model(share(b))).backward();
        for (const auto& p : model->parameters()) {
          (void)p.grad(); // a look, not a change
        }
      }
      loss_of(model(share(2))).backward();
      sgd.step();
      auto full = model->summon_full_params();
      EXPECT_TRUE(close(params_of(*model->module()), want))
          << "rank " << group.rank() << ", strategy " << static_cast<int>(strategy);
    });
  }
}

// A synced forward, then one under no_sync (an auxiliary pass), then one
// backward of both: it is reduced, as DDP's and PyTorch's. It was not: the
// gradients were set aside as a no_sync accumulation, and the step read
// shards with no gradient.
TEST(ShardedUsage, ANoSyncForwardBeforeTheBackwardLeavesItsReduction) {
  torch::manual_seed(9);
  const std::vector<torch::Tensor> batches{torch::randn({4, 5}), torch::randn({4, 5})};
  const auto want = reference_step(batches);
  for (auto strategy : kStrategies) {
    const auto nets = per_rank<Net>(tanh_net);
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<Net> model(nets[group.rank()], group, ShardingOptions().strategy(strategy));
      torch::optim::SGD sgd(model->parameters(), 0.5);
      const auto share = [&](int b) { return batches[b].chunk(group.size())[group.rank()]; };
      auto main = loss_of(model(share(0)));
      torch::Tensor aux;
      {
        auto guard = model->no_sync();
        aux = loss_of(model(share(1)));
      }
      (main + aux).backward();
      sgd.step();
      auto full = model->summon_full_params();
      EXPECT_TRUE(close(params_of(*model->module()), want))
          << "rank " << group.rank() << ", strategy " << static_cast<int>(strategy);
    });
  }
}

// Note [no_sync at backward]: as PyTorch's FSDP, the guard's state when
// backward runs decides. A forward under the guard whose backward comes after
// it ended is reduced, with the micro-batch accumulated before it, and the
// step after it has the whole gradient; a synced forward whose backward runs
// under the guard sends nothing, and the next synced backward reduces all.
TEST(ShardedUsage, TheGuardsStateWhenBackwardRunsDecidesWhetherItReduces) {
  torch::manual_seed(10);
  const std::vector<torch::Tensor> batches{torch::randn({4, 5}), torch::randn({4, 5}), torch::randn({4, 5})};
  const auto want_two = reference_step({batches[0], batches[1]});
  const auto want_three = reference_step(batches);
  for (auto strategy : kStrategies) {
    for (bool forward_under_guard : {true, false}) {
      const auto nets = per_rank<Net>(tanh_net);
      testing::spawn(2, [&](ProcessGroup& group) {
        FullyShardedDataParallel<Net> model(nets[group.rank()], group, ShardingOptions().strategy(strategy));
        torch::optim::SGD sgd(model->parameters(), 0.5);
        const auto share = [&](int b) { return batches[b].chunk(group.size())[group.rank()]; };
        const std::string where = "rank " + std::to_string(group.rank()) + ", strategy " +
            std::to_string(static_cast<int>(strategy)) +
            (forward_under_guard ? ", forward under the guard, backward after it" : ", backward under the guard");
        {
          auto guard = model->no_sync();
          loss_of(model(share(0))).backward();
        }
        torch::Tensor loss;
        if (forward_under_guard) {
          {
            auto guard = model->no_sync();
            loss = loss_of(model(share(1)));
          }
          loss.backward();
        } else {
          loss = loss_of(model(share(1)));
          {
            auto guard = model->no_sync();
            loss.backward();
          }
          for (const auto& shard : model->parameters()) {
            EXPECT_TRUE(!shard.grad().defined() || shard.grad().abs().sum().item<double>() == 0.0)
                << where << ": a backward under the guard reduced";
          }
          loss_of(model(share(2))).backward();
        }
        sgd.step();
        auto full = model->summon_full_params();
        EXPECT_TRUE(close(params_of(*model->module()), forward_under_guard ? want_two : want_three)) << where;
      });
    }
  }
}

struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    torch::manual_seed(0);
    body = register_module("body", torch::nn::Linear(5, 3));
    head = register_module("head", torch::nn::Linear(3, 2));
  }
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    auto features = torch::tanh(body(x));
    return {head(features), features};
  }
  torch::nn::Linear body{nullptr}, head{nullptr};
};
TORCH_MODULE(TwoHeads);

// A forward that returns a std::pair (logits and features): its tensors are
// found, so backward gathers the units again and the step is one
// process's. They were not, and FullShard's backward read freed memory.
TEST(ShardedUsage, AForwardReturningAPairTrainsLikeOneProcess) {
  torch::manual_seed(9);
  const auto x = torch::randn({4, 5});
  TwoHeads reference;
  torch::optim::SGD sgd(reference->parameters(), 0.5);
  auto [logits, features] = reference->forward(x);
  (logits.pow(2).mean() + features.mean()).backward();
  sgd.step();
  const auto want = params_of(*reference);
  for (auto strategy : kStrategies) {
    const auto nets = per_rank<TwoHeads>([] { return TwoHeads(); });
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<TwoHeads> model(nets[group.rank()], group, ShardingOptions().strategy(strategy));
      torch::optim::SGD opt(model->parameters(), 0.5);
      auto [y, h] = model(x.chunk(group.size())[group.rank()]);
      (y.pow(2).mean() + h.mean()).backward();
      opt.step();
      auto full = model->summon_full_params();
      EXPECT_TRUE(close(params_of(*model->module()), want))
          << "rank " << group.rank() << ", strategy " << static_cast<int>(strategy);
    });
  }
}

// A module whose forward fails halfway, after its first layer ran.
struct MayFailImpl : torch::nn::Module {
  MayFailImpl() {
    torch::manual_seed(4);
    first = register_module("first", torch::nn::Linear(5, 3));
    second = register_module("second", torch::nn::Linear(3, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(first->forward(x));
    TORCH_CHECK(!fail, "a bad batch");
    return second->forward(h);
  }
  bool fail = false;
  torch::nn::Linear first{nullptr}, second{nullptr};
};
TORCH_MODULE(MayFail);

// A forward that throws halfway (a bad batch the caller skips) left what
// it had gathered marked gathered: after the optimizer's step, the next
// forward computed with those units' old values, and a summon's writeback
// copied them back over the step (Note [A forward that throws]).
TEST(ShardedUsage, AForwardThatThrowsLeavesNoUnitAtItsOldValues) {
  torch::manual_seed(10);
  const auto x = torch::randn({4, 5});
  const auto next = torch::randn({3, 5});
  MayFail reference;
  torch::optim::SGD sgd(reference->parameters(), 0.5);
  loss_of(reference->forward(x)).backward();
  sgd.step();
  const auto want = params_of(*reference);
  const auto predicted = reference->forward(next).detach();
  for (auto strategy : kStrategies) {
    const auto nets = per_rank<MayFail>([] { return MayFail(); });
    testing::spawn(2, [&](ProcessGroup& group) {
      const std::string where = "rank " + std::to_string(group.rank()) + ", strategy " +
          std::to_string(static_cast<int>(strategy));
      FullyShardedDataParallel<MayFail> model(nets[group.rank()], group, ShardingOptions().strategy(strategy));
      torch::optim::SGD opt(model->parameters(), 0.5);
      loss_of(model(x.chunk(group.size())[group.rank()])).backward();
      model->module()->fail = true;
      EXPECT_ERROR_SAYS(model(next), "a bad batch");
      model->module()->fail = false;
      opt.step();
      {
        torch::NoGradGuard no_grad;
        EXPECT_TRUE(torch::allclose(model(next), predicted, 1e-6, 1e-6)) << where << ": forward after the step";
      }
      {
        auto full = model->summon_full_params();
        full.writeback(true);
        EXPECT_TRUE(close(params_of(*model->module()), want)) << where << ": summoned after the step";
      }
      auto full = model->summon_full_params();
      EXPECT_TRUE(close(params_of(*model->module()), want)) << where << ": after a writeback";
    });
  }
}

// A to() of another dtype after wrapping gives each parameter a new
// gradient accumulator: its gradient would go unaveraged, rank by rank.
TEST(DdpUsage, ACastAfterWrappingIsAnErrorNamingTheParameter) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::nn::Sequential net(torch::nn::Linear(3, 2));
    DistributedDataParallel<torch::nn::Sequential> ddp(net, group);
    ddp(torch::ones({2, 3})).sum().backward();
    ddp->to(torch::kDouble);
    EXPECT_ERROR_SAYS(ddp(torch::ones({2, 3}, torch::kDouble)), "parameter '0.weight' is no longer the tensor it was",
                      "Load, move and cast the module before wrapping it", "[2, 3] Float on cpu then, [2, 3] Double on "
                      "cpu now");
  });
}

// torch::load into the wrapper set_()s each parameter, which gives it a new
// gradient accumulator: the refusal blamed a to() the caller never made.
// It names torch::load, and the ways that work: a load before wrapping, or
// load_safetensors after (Note [A parameter replaced after wrapping]).
TEST(DdpUsage, ATorchLoadAfterWrappingIsRefusedNamingTheWaysThatWork) {
  const std::string path = testing::scratch("loaded_after_wrapping.pt");
  const std::string weights = testing::scratch("loaded_after_wrapping.safetensors");
  torch::nn::Sequential saved(torch::nn::Linear(3, 2));
  torch::save(saved, path);
  save_safetensors(saved, weights);
  testing::spawn(2, [&](ProcessGroup& group) {
    torch::nn::Sequential net(torch::nn::Linear(3, 2));
    DistributedDataParallel<torch::nn::Sequential> ddp(net, group);
    torch::load(ddp, path);
    EXPECT_ERROR_SAYS(ddp(torch::ones({2, 3})), "parameter '0.weight' is no longer the tensor it was",
                      "([2, 3] Float on cpu then, [2, 3] Float on cpu now): a torch::load into the wrapper",
                      "Load, move and cast the module before wrapping it", "lockstep::load_safetensors");
  });
  testing::spawn(2, [&](ProcessGroup& group) {
    torch::nn::Sequential net(torch::nn::Linear(3, 2));
    DistributedDataParallel<torch::nn::Sequential> ddp(net, group);
    load_safetensors(ddp, weights);
    ddp(torch::ones({2, 3}) * (group.rank() + 1)).sum().backward();
    // sum(W x + b)'s gradient averaged over the ranks' inputs: 2 * (1 + 2) / 2.
    EXPECT_TRUE(torch::equal(net[0]->parameters()[0].grad(), torch::full({2, 3}, 3.0f)))
        << net[0]->parameters()[0].grad();
    EXPECT_TRUE(torch::equal(net[0]->parameters()[0], saved[0]->parameters()[0])) << "the file's weights";
  });
}

// Unfreezing after wrapping: the parameter has no hook, so each rank would
// step it by its own gradient and the ranks' copies would drift apart.
TEST(DdpUsage, UnfreezingAParameterAfterWrappingIsAnErrorNamingIt) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::nn::Sequential net(torch::nn::Linear(3, 3), torch::nn::Linear(3, 2));
    net[0]->parameters()[0].set_requires_grad(false);
    DistributedDataParallel<torch::nn::Sequential> ddp(net, group);
    ddp(torch::ones({2, 3}) * (group.rank() + 1)).sum().backward();
    net[0]->parameters()[0].set_requires_grad(true);
    EXPECT_ERROR_SAYS(ddp(torch::ones({2, 3})), "parameter '0.weight' was frozen (requires_grad false) when the module was wrapped",
                      "Set requires_grad before wrapping");
  });
}

// A join where rank 0 had no batch and the others one each: only they saw
// the order the gradients came in, which the buckets are rebuilt by at the
// next forward. After finish() every rank rebuilds alike, and trains on.
TEST(DdpUsage, TrainingGoesOnAfterAJoinWhereOneRankHadNoBatch) {
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < 3; ++r) {
    nets.emplace_back(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
  }
  testing::spawn(3, [&](ProcessGroup& group) {
    auto net = nets[group.rank()];
    DistributedDataParallel<torch::nn::Sequential> ddp(net, group);
    torch::optim::SGD sgd(ddp->parameters(), 0.1);
    auto step = [&](const torch::Tensor& x) {
      sgd.zero_grad();
      ddp(x).sum().backward();
      sgd.step();
    };
    {
      auto guard = ddp->join();
      if (group.rank() != 0) {
        step(torch::ones({2, 3}) * group.rank());
      }
      guard.finish();
    }
    step(torch::ones({2, 3}) * (group.rank() + 1));
    for (const auto& p : net->parameters()) {
      const auto all = group.all_gather(p.detach());
      EXPECT_TRUE(torch::equal(all[0], all[1]) && torch::equal(all[0], all[2])) << "rank " << group.rank();
    }
  });
}

// Head b only when use_b is set.
struct SwitchImpl : torch::nn::Module {
  SwitchImpl() {
    a = register_module("a", torch::nn::Linear(4, 2));
    b = register_module("b", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return use_b ? a(x) + b(x) : a(x);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  bool use_b = false;
};
TORCH_MODULE(Switch);

// static_graph's promise broken inside no_sync: b, unused in the first
// iteration, gets a gradient in a no_sync pass on rank 0. Its .grad would
// stay rank 0's own; the next synced backward says so on every rank.
TEST(DdpUsage, StaticGraphBrokenUnderNoSyncIsAnErrorAtTheSyncedBackward) {
  testing::spawn(2, [](ProcessGroup& group) {
    Switch net;
    DistributedDataParallel<Switch> ddp(net, group, DistributedOptions().static_graph(true));
    const auto x = torch::ones({2, 4});
    ddp(x).sum().backward();
    {
      auto guard = ddp->no_sync();
      net->use_b = group.rank() == 0;
      ddp(x).sum().backward();
    }
    net->use_b = false;
    EXPECT_ERROR_SAYS(ddp(x).sum().backward(), "static_graph(true) promises",
                      "rank 0's 'b.weight' received a gradient, but got none in the first iteration");
  });
}

// A module split over devices would run the reducer's hooks on two of
// autograd's device threads at once (here the CPU and the meta device, which
// every build has): refused, naming both.
TEST(DdpUsage, ParametersOnTwoDevicesAreAnErrorNamingThem) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::nn::Sequential net(torch::nn::Linear(3, 2));
    net->ptr(0)->register_parameter("extra", torch::empty({2}, torch::TensorOptions().device(torch::kMeta)));
    EXPECT_ERROR_SAYS(DistributedDataParallel<torch::nn::Sequential>(net, group),
                      "parameters are on more than one device ('0.weight' on cpu, '0.extra' on meta)",
                      "Move the module to one device");
  });
}

} // namespace
} // namespace lockstep
