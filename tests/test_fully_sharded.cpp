// FullyShardedDataParallel and the flat collectives it rests on, with ranks
// as threads over a HashStore (tests/support/threads.h). The multi-process
// and mpirun runs of the same checks are in tests/fsdp_worker.cpp.

#include "../src/io/dcp_hf.h"
#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/scratch.h"
#include "support/fsdp_checks.h"
#include "support/modules.h"
#include "support/threads.h"

#include <examples/checkpoint.h>

#include <gtest/gtest.h>

#include <cmath>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <unistd.h>
#include <vector>

namespace lockstep {
namespace {

using testing::OddNet;

using testing::kStrategies;

using testing::kCheck;

TEST(FlatCollectives, ReduceScatterAndAllGatherOnTwoAndThreeRanks) {
  for (int size : {2, 3}) {
    testing::spawn(size, [size](ProcessGroup& group) {
      const int r = group.rank();
      // Rank q's input holds q + 10*i at element i.
      auto input = torch::arange(size * 5, torch::kFloat) * 10 + r;
      auto out = torch::empty({5});
      group.reduce_scatter_async(out, input, ReduceOp::Sum)->wait();
      const double ranks = size * (size - 1) / 2.0;
      EXPECT_TRUE(torch::equal(out, (torch::arange(5, torch::kFloat) + 5 * r) * 10 * size + ranks)) << out;
      group.reduce_scatter_async(out, input, ReduceOp::Max)->wait();
      EXPECT_TRUE(torch::equal(out, (torch::arange(5, torch::kFloat) + 5 * r) * 10 + (size - 1))) << out;
      auto ints = torch::full({size * 2}, r + 1, torch::kLong);
      auto avg = torch::empty({2}, torch::kLong);
      group.reduce_scatter_async(avg, ints, ReduceOp::Avg)->wait();
      EXPECT_EQ(avg[0].item<int64_t>(), (size * (size + 1) / 2) / size); // floor, as Python's //
      EXPECT_TRUE(torch::equal(input, torch::arange(size * 5, torch::kFloat) * 10 + r)) << "the input was changed";

      auto mine = torch::full({3}, static_cast<double>(r), torch::kDouble);
      auto all = torch::empty({3 * size}, torch::kDouble);
      group.all_gather_into_async(all, mine)->wait();
      EXPECT_TRUE(torch::equal(all, torch::arange(size, torch::kDouble).repeat_interleave(3))) << all;
    });
  }
}

// Gathers of 256 KiB and more take the Gloo backend's own ring.
TEST(FlatCollectives, LargeGathersAndReduceScattersOnTwoAndThreeRanks) {
  for (int size : {2, 3}) {
    testing::spawn(size, [size](ProcessGroup& group) {
      const int64_t n = 100003;
      auto mine = torch::arange(n, torch::kFloat) + group.rank() * 1e6;
      auto all = torch::empty({n * size});
      group.all_gather_into_async(all, mine)->wait();
      for (int r = 0; r < size; ++r) {
        EXPECT_TRUE(torch::equal(all.narrow(0, r * n, n), torch::arange(n, torch::kFloat) + r * 1e6)) << r;
      }
      auto out = torch::empty({n});
      group.reduce_scatter_async(out, all, ReduceOp::Avg)->wait();
      EXPECT_TRUE(torch::equal(out, all.narrow(0, group.rank() * n, n))) << "the average of equal inputs";
    });
  }
}

TEST(FlatCollectives, WrongSizesAreRefusedAtTheCall) {
  testing::spawn(2, [](ProcessGroup& group) {
    auto input = torch::zeros({5});
    auto out = torch::empty({2});
    EXPECT_ERROR_SAYS(group.reduce_scatter_async(out, input), "refused on this rank before anything was sent",
                      "has 5 elements but the shard has 2", "pad the whole to a multiple");
    EXPECT_ERROR_SAYS(group.all_gather_into_async(torch::empty({3}), torch::zeros({2})), "has 3 elements");
    // Nothing was sent: the group still works.
    auto ok = torch::ones({4});
    group.reduce_scatter_async(out, ok)->wait();
    EXPECT_TRUE(torch::equal(out, torch::full({2}, 2.0)));
  });
}

TEST(FullyShardedDataParallel, EachStrategyMatchesOneProcessOnTwoAndThreeRanks) {
  torch::manual_seed(0);
  OddNet initial;
  for (auto strategy : kStrategies) {
    for (int size : {2, 3}) {
      testing::spawn(size, [&](ProcessGroup& group) { testing::check_matches_reference(group, initial, strategy, kCheck); });
    }
  }
}

TEST(FullyShardedDataParallel, ClipGradNormClipsByTheWholeModelsNorm) {
  torch::manual_seed(0);
  OddNet initial;
  for (auto strategy : kStrategies) {
    for (double norm_type : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
      testing::spawn(3, [&](ProcessGroup& group) {
        testing::check_clip_grad_norm(group, initial, strategy, norm_type, kCheck);
      });
    }
  }
  testing::spawn(2, [](ProcessGroup& group) {
    FullyShardedDataParallel<OddNet> model(OddNet(), group);
    EXPECT_ERROR_SAYS(model->clip_grad_norm_(1.0, 0.0), "norm_type 0 is not a norm");
    EXPECT_ERROR_SAYS(model->clip_grad_norm_(-1.0), "max_norm -1 is not a largest norm");
    EXPECT_ERROR_SAYS(model->clip_grad_norm_(std::nan("")), "max_norm nan is not a largest norm");
    model->forward(torch::randn({4, 7})).sum().backward();
    std::vector<torch::Tensor> before;
    for (const auto& p : model->parameters()) {
      before.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    }
    const auto norm = model->clip_grad_norm_(std::numeric_limits<double>::infinity());
    EXPECT_GT(norm.item<double>(), 0) << "infinity reads the norm";
    for (size_t i = 0; i < before.size(); ++i) {
      if (before[i].defined()) {
        EXPECT_TRUE(torch::equal(model->parameters()[i].grad(), before[i])) << "and clips nothing";
      }
    }
  });
}

// Double gradients' norm was summed in float: gradients of 1e20 squared to
// inf, and every gradient was scaled to 0.
TEST(FullyShardedDataParallel, ClipGradNormOfDoubleGradientsIsTakenInDouble) {
  testing::spawn(2, [](ProcessGroup& group) {
    torch::nn::Linear linear(4, 2);
    linear->to(torch::kDouble);
    FullyShardedDataParallel<torch::nn::Linear> model(linear, group);
    (model->forward(torch::full({3, 4}, 1e20, torch::kDouble)).sum()).backward();
    const auto norm = model->clip_grad_norm_(1.0).item<double>();
    EXPECT_TRUE(std::isfinite(norm)) << norm;
    EXPECT_GT(norm, 1e20);
    double clipped = 0;
    for (const auto& p : model->parameters()) {
      if (p.grad().defined()) {
        clipped += p.grad().pow(2).sum().item<double>();
      }
    }
    EXPECT_GT(clipped, 0.0) << "rank " << group.rank() << "'s gradients were scaled to 0";
  });
}

TEST(FullyShardedDataParallel, ParametersAreThisRanksShardsPaddedToTheWorldSize) {
  testing::spawn(3, [](ProcessGroup& group) {
    FullyShardedDataParallel<OddNet> model(OddNet(), group);
    const auto flats = model->flat_params();
    // The root keeps `empty` and `scale`; fc1 (7*13+13), fc2 (13*3+3), branch (7*3+3).
    ASSERT_EQ(flats.size(), 4u);
    const std::vector<std::string> units{"", "fc1", "fc2", "branch"};
    const std::vector<int64_t> numels{1, 104, 42, 24};
    auto shards = model->parameters();
    ASSERT_EQ(shards.size(), 4u);
    for (size_t i = 0; i < flats.size(); ++i) {
      EXPECT_EQ(flats[i].unit, units[i]);
      EXPECT_EQ(flats[i].numel, numels[i]);
      EXPECT_EQ(flats[i].shard_numel, (numels[i] + 2) / 3);
      EXPECT_EQ(shards[i].numel(), flats[i].shard_numel);
      EXPECT_TRUE(shards[i].is_leaf() && shards[i].requires_grad());
    }
    // Outside forward and backward the module holds no stale values.
    for (const auto& p : model->module()->parameters()) {
      EXPECT_EQ(p.numel(), 0);
    }
  });
}

// Forwards whose backward never comes (a logged prediction), one of them
// before a step: every forward reads the shards' current values, and the
// parameters are empty again after the next backward.
TEST(FullyShardedDataParallel, AForwardWithoutBackwardLeavesNoStaleParameters) {
  torch::manual_seed(8);
  OddNet initial;
  auto reference = testing::train_reference(initial, 2, 12);
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<OddNet> model(testing::copy_of(initial), group, ShardingOptions().strategy(strategy));
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
      auto batch = testing::share_of(12, 0, group.rank(), 2);
      model->forward(batch.first);
      EXPECT_TRUE(torch::equal(model->module()->fc1->weight * 1, initial->fc1->weight)) << "an operator reads the values";
      torch::mse_loss(model->forward(batch.first), batch.second).backward();
      model->forward(batch.first);
      adam.step();
      testing::train_shares(model, adam, group, 1, 2);
      if (strategy != ShardingStrategy::NoShard) {
        EXPECT_EQ(model->module()->fc1->weight.numel(), 0) << "outside forward and backward, never stale values";
      }
      testing::check_full_params(model, reference, kCheck, std::string(testing::name_of(strategy)) +
                                 ": two steps with forwards without backward");
    });
  }
}

TEST(FullyShardedDataParallel, NamedUnitsTakeTheirSubmodulesAndTheRootTheRest) {
  testing::spawn(2, [](ProcessGroup& group) {
    FullyShardedDataParallel<OddNet> model(OddNet(), group, ShardingOptions().units({"fc1"}));
    const auto flats = model->flat_params();
    ASSERT_EQ(flats.size(), 2u);
    EXPECT_EQ(flats[0].unit, "");
    EXPECT_EQ(flats[0].numel, 1 + 42 + 24);
    EXPECT_EQ(flats[1].unit, "fc1");
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<OddNet>(OddNet(), group, ShardingOptions().units({"fc9"})),
                      "names 'fc9', which is not a submodule");
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<OddNet>(OddNet(), group, ShardingOptions().units({"fc1", "fc1"})),
                      "names 'fc1' twice"); // accepted without a word
  });
}

TEST(FullyShardedDataParallel, NoSyncAccumulatesAndTheNextBackwardReducesTheSum) {
  torch::manual_seed(1);
  OddNet initial;
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) { testing::check_no_sync(group, initial, strategy, kCheck); });
  }
}

// A unit whose weight is frozen, and a branch that gets no gradient.
TEST(FullyShardedDataParallel, FrozenParametersAndUnusedUnitsMatchOneProcess) {
  torch::manual_seed(2);
  OddNet initial(13, /*use_branch=*/false);
  initial->fc1->weight.set_requires_grad(false);
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) { testing::check_matches_reference(group, initial, strategy, kCheck, 3); });
  }
}

// Every bucket is reduced in every backward; a unit no rank used must still
// not get zeros in its .grad, which momentum and weight decay act on.
TEST(FullyShardedDataParallel, AUnitNoRankUsedKeepsItsGradientUndefined) {
  torch::manual_seed(3);
  OddNet initial;
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) { testing::check_unit_no_rank_used(group, initial, strategy, kCheck); });
  }
}

// The same when each step accumulates a micro-batch under no_sync first:
// no_sync gives the shards a zero .grad to accumulate beside, and a unit no
// rank used must not keep it.
TEST(FullyShardedDataParallel, AUnitNoRankUsedKeepsItsGradientUndefinedUnderNoSync) {
  torch::manual_seed(3);
  OddNet initial;
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) {
      testing::check_unit_no_rank_used(group, initial, strategy, kCheck, /*accumulate=*/true);
    });
  }
}

// summon_full_params writes edits back by default, as PyTorch FSDP's does;
// with writeback(false) an edit, which the shards would not keep, is an
// error naming the parameter (Note [A summon without writeback]), and
// NoShard, whose parameters are its shard, keeps it.
TEST(FullyShardedDataParallel, WritebackCopiesEditsIntoTheShards) {
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<OddNet> model(OddNet(), group, ShardingOptions().strategy(strategy));
      const std::string where = testing::name_of(strategy);
      {
        auto full = model->summon_full_params();
        torch::NoGradGuard no_grad;
        model->module()->fc2->bias.fill_(3.0);
      }
      {
        auto full = model->summon_full_params();
        EXPECT_TRUE(torch::equal(model->module()->fc2->bias, torch::full({3}, 3.0))) << where << ": by default";
      }
      auto edit_without_writeback = [&] {
        auto full = model->summon_full_params();
        full.writeback(false);
        torch::NoGradGuard no_grad;
        model->module()->fc2->bias.fill_(5.0);
      };
      if (strategy == ShardingStrategy::NoShard) {
        edit_without_writeback();
        auto full = model->summon_full_params();
        EXPECT_TRUE(torch::equal(model->module()->fc2->bias, torch::full({3}, 5.0))) << where << ": its shard was edited";
        return;
      }
      EXPECT_ERROR_SAYS(edit_without_writeback(), "parameter 'fc2.bias' was changed inside summon_full_params() with "
                        "writeback(false), so the edit is lost", "Leave writeback on");
      {
        auto full = model->summon_full_params();
        full.writeback(false); // reading alone is no error
        EXPECT_TRUE(torch::equal(model->module()->fc2->bias, torch::full({3}, 3.0))) << where << ": after the error";
      }
      torch::NoGradGuard no_grad;
      model->forward(torch::ones({2, 7})); // the module is whole again after the error
    });
  }
}

// torch::load replaces each parameter's tensor (set_) rather than writing
// into the gathered buffer it views (Note [Replaced parameters]): the loaded
// values, not the gathered ones, reach the shards (FullShard, ShardGradOp),
// and NoShard computes with the tensors its optimizer steps.
TEST(FullyShardedDataParallel, AFullCheckpointLoadedUnderSummonReachesTheShards) {
  const std::string path = testing::scratch("fsdp_load.pt");
  const std::string wider = path + ".wider";
  torch::manual_seed(4);
  OddNet saved;
  torch::save(saved, path);
  torch::save(OddNet(14), wider);
  auto reference = testing::train_reference(saved, 2, 12);
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<OddNet> model(OddNet(), group, ShardingOptions().strategy(strategy));
      {
        auto full = model->summon_full_params();
        full.writeback(true);
        OddNet module = model->module();
        torch::load(module, path);
      }
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
      testing::train_shares(model, adam, group, 0, 2);
      testing::check_full_params(model, reference, kCheck, std::string(testing::name_of(strategy)) +
                                 ": loaded under summon_full_params, then 2 Adam steps");
      EXPECT_ERROR_SAYS(([&] {
                          auto full = model->summon_full_params();
                          full.writeback(true);
                          OddNet module = model->module();
                          torch::load(module, wider);
                        }()),
                        "parameter 'fc1.weight' was given a tensor of shape [14, 7]", "the sharded model's is [13, 7]");
    });
  }
  std::remove(path.c_str());
  std::remove(wider.c_str());
}

// An init after wrapping writes into FullShard's and ShardGradOp's empty
// parameters, and LibTorch says nothing: the edit would be lost (Note
// [Edits outside summon_full_params]). The next forward, or
// summon_full_params, is an error naming the parameter; NoShard's
// parameters view its shard, and the edit takes effect.
TEST(FullyShardedDataParallel, AnEditOutsideSummonIsAnErrorWhereItWouldBeLost) {
  const std::string path = testing::scratch("fsdp_edit.pt");
  torch::save(OddNet(), path);
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<OddNet> model(OddNet(), group, ShardingOptions().strategy(strategy));
      auto init = [&] {
        torch::NoGradGuard no_grad;
        model->module()->fc2->weight.normal_(0, 0.02);
      };
      auto forward = [&] {
        torch::NoGradGuard no_grad; // no backward follows: the parameters rest again
        model->forward(torch::ones({2, 7}));
      };
      if (strategy == ShardingStrategy::NoShard) {
        init();
        forward();
        auto full = model->summon_full_params();
        EXPECT_LT(model->module()->fc2->weight.abs().max().item<float>(), 0.2) << "NoShard's edit took no effect";
        return;
      }
      init();
      EXPECT_ERROR_SAYS(forward(), "parameter 'fc2.weight' of the wrapped module was changed in place outside forward",
                        "full.writeback(true)");
      forward(); // the check has spoken: training goes on from the shards' values
      OddNet module = model->module();
      torch::load(module, path);
      EXPECT_ERROR_SAYS(model->summon_full_params(), "of the wrapped module was changed in place");
    });
  }
  std::remove(path.c_str());
}

// DDP's habit, an optimizer over the module's own parameters, stepped
// nothing (the shards take the gradients) and said nothing. Those that
// write into their parameters in place now make the next forward an error.
TEST(FullyShardedDataParallel, AnOptimizerOverTheModulesOwnParametersIsAnError) {
  using Make = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
  const std::vector<std::pair<std::string, Make>> optimizers = {
      {"Adam", [](auto p) { return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01)); }},
      {"AdamW", [](auto p) { return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.01)); }},
      {"RMSprop", [](auto p) { return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(0.01)); }},
      {"Adagrad", [](auto p) { return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.01)); }}};
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp}) {
    for (const auto& [name, make] : optimizers) {
      SCOPED_TRACE(std::string(testing::name_of(strategy)) + ", " + name);
      testing::spawn(2, [&](ProcessGroup& group) {
        OddNet net;
        FullyShardedDataParallel<OddNet> model(net, group, ShardingOptions().strategy(strategy));
        auto wrong = make(net->parameters());
        auto step = [&] {
          wrong->zero_grad();
          torch::mse_loss(model->forward(torch::ones({2, 7})), torch::zeros({2, 3})).backward();
          wrong->step();
        };
        step(); // writes into the empty parameters: the next forward sees it
        EXPECT_ERROR_SAYS(step(), "by an optimizer made from model->module()->parameters()",
                          "Make optimizers from model->parameters()");
      });
    }
  }
}

TEST(FullyShardedDataParallel, AFullCheckpointFromRankZeroLoadsIntoABareModule) {
  const std::string path = testing::scratch("fsdp_full.pt");
  torch::manual_seed(3);
  OddNet initial;
  auto reference = testing::train_reference(initial, 2, 12);
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<OddNet> model(testing::copy_of(initial), group);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    testing::train_shares(model, adam, group, 0, 2);
    auto full = model->summon_full_params();
    if (group.rank() == 0) {
      torch::save(model->module(), path);
    }
  });
  OddNet bare;
  torch::load(bare, path);
  testing::expect_params_close(*bare, *reference, 1e-5, 1e-5);
  std::remove(path.c_str());
}

TEST(FullyShardedDataParallel, AFullOptimizerStateFromRankZeroLoadsIntoABareOptimizer) {
  const std::string path = testing::scratch("fsdp_optimizer.pt");
  torch::manual_seed(6);
  OddNet initial;
  auto reference = testing::copy_of(initial);
  torch::optim::Adam reference_adam(reference->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < 2; ++step) {
    auto batch = testing::global_batch(12, step);
    reference_adam.zero_grad();
    torch::mse_loss(reference->forward(batch.first), batch.second).backward();
    reference_adam.step();
  }
  const auto want = examples::optimizer_tensors(reference_adam);
  ASSERT_FALSE(want.empty());
  for (auto strategy : kStrategies) {
    SCOPED_TRACE(testing::name_of(strategy));
    testing::spawn(3, [&](ProcessGroup& group) {
      FullyShardedDataParallel<OddNet> model(testing::copy_of(initial), group, ShardingOptions().strategy(strategy));
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
      testing::train_shares(model, adam, group, 0, 2);
      // A scheduler's lr: the full state carries the sharded optimizer's
      // options, not those the full optimizer was made with.
      static_cast<torch::optim::AdamOptions&>(adam.param_groups()[0].options()).lr(0.005);
      torch::optim::Adam full(model->module()->parameters(), torch::optim::AdamOptions(0.01));
      full_optimizer_state(model, adam, full);
      EXPECT_EQ(static_cast<torch::optim::AdamOptions&>(full.param_groups()[0].options()).lr(), 0.005);
      if (group.rank() == 0) {
        torch::save(full, path);
      }
    });
    auto bare = testing::copy_of(initial);
    torch::optim::Adam bare_adam(bare->parameters(), torch::optim::AdamOptions(0.01));
    torch::load(bare_adam, path);
    const auto got = examples::optimizer_tensors(bare_adam);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::allclose(got[i].second, want[i].second, 1e-4, 1e-6)) << "state tensor " << i;
    }
  }
  std::remove(path.c_str());
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<OddNet> model(testing::copy_of(initial), group);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    OddNet other;
    torch::optim::Adam wrong(other->parameters(), torch::optim::AdamOptions(0.01));
    EXPECT_ERROR_SAYS(full_optimizer_state(model, adam, wrong), "of the wrapped module is not among the full "
                      "optimizer's parameters", "from model->module()->parameters()");
    auto params = model->module()->parameters();
    const std::vector<torch::Tensor> first(params.begin(), params.begin() + 1), rest(params.begin() + 1, params.end());
    torch::optim::Adam two_groups({torch::optim::OptimizerParamGroup(first), torch::optim::OptimizerParamGroup(rest)},
                                  torch::optim::AdamOptions(0.01));
    EXPECT_ERROR_SAYS(full_optimizer_state(model, adam, two_groups), "the full optimizer has 2 parameter groups and "
                      "the sharded one 1", "with the sharded one's groups");
    torch::optim::LBFGS lbfgs(model->parameters());
    torch::optim::LBFGS full_lbfgs(params);
    EXPECT_ERROR_SAYS(full_optimizer_state(model, lbfgs, full_lbfgs), "lockstep::full_optimizer_state: the optimizer",
                      "Its state cannot be gathered; save the model alone");
  });
}

// FullShard over NCCL at world size 1: NCCL refuses two ranks on one GPU,
// and FsdpProcesses.FullShardOverGlooWithCudaTensorsOnTwoRanks_CUDA runs two
// over Gloo.
TEST(FullyShardedDataParallel, FullShardOverNcclAtWorldSizeOne_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  torch::manual_seed(6);
  OddNet initial;
  auto group = new_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, "nccl");
  EXPECT_EQ(group.backend(), "nccl");
  testing::check_fullshard_on_gpu(group, initial, testing::kCheck);
}

struct HalfImpl : torch::nn::Module {
  explicit HalfImpl(const torch::Tensor& shared) {
    weight = register_parameter("weight", shared);
    bias = register_parameter("bias", torch::zeros({4}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x.matmul(weight) + bias;
  }
  torch::Tensor weight, bias;
};
TORCH_MODULE(Half);

// body.0 and body.1 share a weight.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    auto shared = torch::randn({4, 4});
    body = register_module("body", torch::nn::Sequential(Half(shared), Half(shared)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return body->forward(x);
  }
  torch::nn::Sequential body{nullptr};
};
TORCH_MODULE(Tied);

TEST(FullyShardedDataParallel, AParameterSharedByTwoUnitsIsAnErrorNamingIt) {
  testing::spawn(2, [](ProcessGroup& group) {
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<Tied>(Tied(), group, ShardingOptions().units({"body.0", "body.1"})),
                      "parameter 'body.0.weight' is also 'body.1.weight'", "two units share it");
    // In one unit it is sharded once, and trains as one parameter.
    Tied net;
    FullyShardedDataParallel<Tied> model(net, group);
    EXPECT_EQ(model->flat_params().at(0).numel, 16 + 4 + 4);
    auto x = torch::ones({2, 4});
    model->forward(x).sum().backward();
    EXPECT_EQ(model->parameters().at(0).grad().numel(), 12);
  });
}

// A tied weight is saved under each of its names, as the bare module's
// save and a state dict have it (Note [Tied parameters in checkpoints]):
// the bare module loads the sharded model's file strictly, the sharded
// model the bare module's, and a sharded checkpoint lists both names, as
// PyTorch's dcp.load into FSDP2's state_dict looks for them.
TEST(FullyShardedDataParallel, ATiedParameterIsSavedAndLoadedUnderEachName) {
  const auto file = testing::scratch("tied.safetensors");
  const auto bare_file = testing::scratch("tied_bare.safetensors");
  const auto dir = testing::scratch("tied_sharded");
  torch::manual_seed(1);
  Tied reference;
  torch::manual_seed(2);
  Tied other;
  save_safetensors(other, bare_file);
  testing::spawn(2, [&](ProcessGroup& group) {
    Tied mine;
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < mine->parameters().size(); ++i) {
        mine->parameters()[i].copy_(reference->parameters()[i]);
      }
    }
    FullyShardedDataParallel<Tied> model(mine, group);
    save_safetensors(model, file);
    torch::optim::SGD sgd(model->parameters(), 0.1);
    save_sharded(model, sgd, dir);
    load_safetensors(model, bare_file); // strict: both names are expected, and the file has both
    auto full = model->summon_full_params();
    EXPECT_TRUE(torch::equal(model->module()->body[0]->named_parameters()["weight"],
                             other->body[0]->named_parameters()["weight"]));
  });
  const auto saved = read_safetensors(file);
  ASSERT_TRUE(saved.contains("body.0.weight") && saved.contains("body.1.weight"));
  EXPECT_TRUE(torch::equal(saved["body.1.weight"], saved["body.0.weight"]));
  EXPECT_TRUE(torch::equal(saved["body.0.weight"], reference->body[0]->named_parameters()["weight"]));
  Tied bare;
  load_safetensors(bare, file); // strict
  EXPECT_TRUE(torch::equal(bare->body[1]->named_parameters()["weight"], saved["body.0.weight"]));
  const auto checkpoint = detail::open_dcp_save(dir);
  EXPECT_EQ(checkpoint.shapes.count("body.0.weight"), 1u);
  EXPECT_EQ(checkpoint.shapes.count("body.1.weight"), 1u);
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Tied> model(Tied(), group);
    torch::optim::SGD sgd(model->parameters(), 0.1);
    load_sharded(model, sgd, dir);
    auto full = model->summon_full_params();
    EXPECT_TRUE(torch::equal(model->module()->body[1]->named_parameters()["weight"], saved["body.0.weight"]));
  });
}

TEST(FullyShardedDataParallel, ADifferentModelOnOneRankIsAnErrorOnEveryRank) {
  testing::spawn(2, [](ProcessGroup& group) { testing::check_model_mismatch(group, kCheck); });
}

} // namespace
} // namespace lockstep
