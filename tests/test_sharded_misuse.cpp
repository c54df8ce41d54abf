// FullyShardedDataParallel used in ways that cannot work: each is a clear
// error on every rank, and the model stays usable; never a crash, and never
// parameters that silently hold other values. Ranks as threads.

#include "../src/util/checked_file.h"
#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/scratch.h"
#include "support/fsdp_checks.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

namespace lockstep {
namespace {

using Net = torch::nn::Sequential;

using testing::kStrategies;

Net two_layers() {
  torch::manual_seed(0);
  return Net(torch::nn::Linear(5, 3), torch::nn::Linear(3, 2));
}

std::vector<torch::Tensor> full_params(FullyShardedDataParallel<Net>& model) {
  auto full = model->summon_full_params();
  std::vector<torch::Tensor> out;
  for (const auto& p : model->module()->parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  bool equal = a.size() == b.size();
  for (size_t i = 0; equal && i < a.size(); ++i) {
    equal = torch::equal(a[i], b[i]);
  }
  return equal;
}

std::string misuse_dir(const std::string& name) {
  return testing::scratch("misuse_" + name);
}

void adam_step(FullyShardedDataParallel<Net>& model, torch::optim::Optimizer& optimizer) {
  optimizer.zero_grad();
  model(torch::ones({4, 5})).sum().backward();
  optimizer.step();
}

// A summon_full_params block that throws after replacing parameters (a
// torch::load of another model's file replaces each, then misses a name),
// one by a tensor of another shape: ending the guard must not throw from
// its destructor while the exception unwinds, which would end the process.
// The caller's exception goes on, nothing is written back, and the model
// trains on.
TEST(ShardedMisuse, ASummonEndedByAnExceptionKeepsTheShardsAndRethrows) {
  for (auto strategy : kStrategies) {
    testing::spawn(2, [strategy](ProcessGroup& group) {
      FullyShardedDataParallel<Net> model(two_layers(), group, ShardingOptions().strategy(strategy));
      const auto before = full_params(model);
      try {
        auto full = model->summon_full_params();
        full.writeback(true);
        torch::NoGradGuard no_grad;
        auto params = model->module()->named_parameters();
        params["0.bias"].set_data(torch::ones({3}));
        params["0.weight"].set_data(torch::zeros({7, 7}));
        throw std::runtime_error("the block failed");
      } catch (const std::runtime_error& e) {
        EXPECT_EQ(std::string(e.what()), "the block failed");
      }
      EXPECT_TRUE(same(full_params(model), before)) << "a block that threw wrote its edits back";
      torch::optim::Adam adam(model->parameters(), 0.1);
      adam_step(model, adam);
      EXPECT_FALSE(same(full_params(model), before)) << "the model does not train after the failed block";
    });
  }
}

// A sparse Embedding's gradient cannot be sharded: refused at construction,
// naming the layer, where backward failed inside ATen ("reshape is not
// implemented for sparse tensors") and left the wrapper unusable. Frozen,
// it takes no gradient, and is wrapped.
TEST(ShardedMisuse, ASparseEmbeddingIsRefusedNamingIt) {
  testing::spawn(2, [](ProcessGroup& group) {
    auto sparse = [] {
      return Net(torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)), torch::nn::Linear(4, 2));
    };
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<Net>(sparse(), group), "'0' is an Embedding with sparse(true)",
                      "sparse(false)");
    auto frozen = sparse();
    frozen[0]->as<torch::nn::Embedding>()->weight.set_requires_grad(false);
    FullyShardedDataParallel<Net> model(frozen, group);
    model->forward(torch::tensor({1, 2, 3}, torch::kLong)).sum().backward();
  });
}

// A module with nothing to train wrapped without a word, and its first
// forward crashed (a bucket of no flat): refused at construction, on every
// rank, under every strategy, as DistributedDataParallel refuses it.
TEST(ShardedMisuse, AModuleWithNothingToTrainIsRefused) {
  testing::spawn(2, [](ProcessGroup& group) {
    for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
      const auto options = ShardingOptions().strategy(strategy);
      EXPECT_ERROR_SAYS(FullyShardedDataParallel<Net>(Net(torch::nn::ReLU()), group, options),
                        "the module has no parameter that requires a gradient");
      Net frozen(torch::nn::Linear(4, 3));
      for (auto& p : frozen->parameters()) {
        p.set_requires_grad(false);
      }
      EXPECT_ERROR_SAYS(FullyShardedDataParallel<Net>(frozen, group, options),
                        "the module has no parameter that requires a gradient", "run a frozen one bare");
    }
  });
}

// A seed of base + rank gave each rank's micro-batches other dropout masks
// in deterministic mode, and other units or strategies failed at the first
// collective or the timeout: every rank refuses at construction, saying
// what it has.
TEST(ShardedMisuse, ShardingOptionsThatDifferBetweenRanksAreRefusedOnEveryRank) {
  const auto net = [] { return Net(torch::nn::Linear(4, 4), torch::nn::Dropout(0.5), torch::nn::Linear(4, 2)); };
  testing::spawn(2, [&](ProcessGroup& group) {
    const auto options = ShardingOptions().deterministic(true).micro_batches(2).seed(7 + group.rank());
    const auto mine = "This rank (" + std::to_string(group.rank()) + ") has: strategy=FullShard";
    const auto seed = "seed=" + std::to_string(7 + group.rank());
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<Net>(net(), group, options), "rank 1's ShardingOptions differ from "
                      "rank 0's", mine.c_str(), seed.c_str());
  });
  testing::spawn(2, [&](ProcessGroup& group) {
    const auto strategy = group.rank() == 0 ? ShardingStrategy::FullShard : ShardingStrategy::ShardGradOp;
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<Net>(net(), group, ShardingOptions().strategy(strategy)),
                      "ShardingOptions differ");
  });
}

// to() after wrapping moved or cast only the shards, and the step then
// failed far from the cause: refused, unless it changes nothing.
TEST(ShardedMisuse, MovingOrCastingAfterWrappingIsRefused) {
  testing::spawn(2, [](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(Net(torch::nn::Linear(4, 3)), group);
    model->to(torch::kCPU);
    model->to(torch::kFloat);
    EXPECT_ERROR_SAYS(model->to(torch::kDouble), "to(Double) after wrapping",
                      "Move or cast the module before wrapping it");
    EXPECT_ERROR_SAYS(model->to(torch::Device(torch::kCUDA, 0), torch::kFloat), "to(cuda:0, Float) after wrapping");
    EXPECT_EQ(model->parameters()[0].scalar_type(), torch::kFloat);
    // With a frozen parameter beside the shards, the frozen one would part ways with them too.
    Net partly_frozen(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
    partly_frozen[0]->as<torch::nn::Linear>()->weight.set_requires_grad(false);
    FullyShardedDataParallel<Net> frozen_too(partly_frozen, group);
    EXPECT_ERROR_SAYS(frozen_too->to(torch::kDouble), "to(Double) after wrapping");
    EXPECT_EQ(partly_frozen[0]->as<torch::nn::Linear>()->weight.scalar_type(), torch::kFloat) << "the frozen weight";
  });
}

TEST(ShardedMisuse, LoadShardedInsideSummonFullParamsIsAnError) {
  const auto dir = misuse_dir("summon");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(two_layers(), group);
    torch::optim::Adam adam(model->parameters(), 0.1);
    save_sharded(model, adam, dir);
    adam_step(model, adam);
    const auto stepped = full_params(model);
    {
      auto full = model->summon_full_params();
      full.writeback(true); // its end would copy the stepped values over the loaded ones
      EXPECT_ERROR_SAYS(load_sharded(model, adam, dir), "load_sharded() inside summon_full_params()",
                        "End the guard first");
    }
    EXPECT_TRUE(same(full_params(model), stepped));
  });
}

// A save inside the guard would write the shards as they were before it
// (the guard's end copies edits into them) beside buffers as they are now.
TEST(ShardedMisuse, SaveShardedInsideSummonFullParamsIsAnError) {
  const auto dir = misuse_dir("summon_save");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(two_layers(), group);
    torch::optim::Adam adam(model->parameters(), 0.1);
    auto full = model->summon_full_params();
    full.writeback(true);
    EXPECT_ERROR_SAYS(save_sharded(model, adam, dir), "save_sharded() inside summon_full_params()",
                      "End the guard first");
  });
  EXPECT_FALSE(std::filesystem::exists(dir + "/index.json"));
}

// The same for save_safetensors: the file would hold the weights as they
// were before the guard, not the edits made in it.
TEST(ShardedMisuse, SaveSafetensorsInsideSummonFullParamsIsAnError) {
  const auto path = misuse_dir("summon_safetensors") + "/model.safetensors";
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(two_layers(), group);
    auto full = model->summon_full_params();
    full.writeback(true);
    torch::NoGradGuard no_grad;
    model->module()->parameters()[0].fill_(1);
    EXPECT_ERROR_SAYS(save_safetensors(model, path), "save_safetensors(", "inside summon_full_params()",
                      "End the guard first");
  });
  EXPECT_FALSE(std::filesystem::exists(path));
}

// A load between a forward and its backward: that backward would give the
// loaded parameters gradients taken at the old ones, so it is an error; a
// forward after the load trains from the loaded values, exactly as if the
// earlier forward had never run.
TEST(ShardedMisuse, ABackwardOfAForwardMadeBeforeLoadShardedIsAnError) {
  for (auto strategy : kStrategies) {
    const auto dir = misuse_dir("forward");
    testing::spawn(2, [&](ProcessGroup& group) {
      const auto options = ShardingOptions().strategy(strategy);
      FullyShardedDataParallel<Net> model(two_layers(), group, options);
      torch::optim::Adam adam(model->parameters(), 0.1);
      save_sharded(model, adam, dir);
      adam_step(model, adam);

      auto stale = model(torch::ones({4, 5})).sum();
      load_sharded(model, adam, dir);
      EXPECT_ERROR_SAYS(stale.backward(), "received a gradient from a forward made before load_sharded()",
                        "Run forward again after it");
      adam_step(model, adam);

      FullyShardedDataParallel<Net> fresh(two_layers(), group, options);
      torch::optim::Adam fresh_adam(fresh->parameters(), 0.1);
      load_sharded(fresh, fresh_adam, dir);
      adam_step(fresh, fresh_adam);
      EXPECT_TRUE(same(full_params(model), full_params(fresh))) << "the step after the load used stale values";
    });
  }
}

// A summon after a forward whose backward has not come (a validation pass
// in grad mode, then a full checkpoint) was refused with advice to call it
// after a backward that never comes. It is allowed, as a load is: the
// guard holds the current values, that forward's backward is an error, and
// training goes on as if the forward had never run.
TEST(ShardedMisuse, ASummonAfterAForwardWithoutItsBackwardHoldsTheCurrentValues) {
  for (auto strategy : kStrategies) {
    // Made before the threads: two_layers() seeds the generator they share.
    const std::vector<Net> nets{two_layers(), two_layers(), two_layers(), two_layers()};
    testing::spawn(2, [&](ProcessGroup& group) {
      const auto options = ShardingOptions().strategy(strategy);
      FullyShardedDataParallel<Net> model(nets[2 * group.rank()], group, options);
      torch::optim::Adam adam(model->parameters(), 0.1);
      FullyShardedDataParallel<Net> plain(nets[2 * group.rank() + 1], group, options);
      torch::optim::Adam plain_adam(plain->parameters(), 0.1);
      adam_step(model, adam);
      adam_step(plain, plain_adam);

      auto validation = model(torch::ones({4, 5})).sum();
      EXPECT_TRUE(same(full_params(model), full_params(plain))) << "the summon after a forward";
      EXPECT_ERROR_SAYS(validation.backward(), "received a gradient from a forward made before summon_full_params()",
                        "Run forward again after it");
      adam_step(model, adam);
      adam_step(plain, plain_adam);
      EXPECT_TRUE(same(full_params(model), full_params(plain))) << "the step after the summon";
    });
  }
}

// Between steps the module of a live wrapper holds empty tensors: a second
// wrapper over it planned units of no elements and failed in its forward
// on a shape (Note [A module wrapped twice]). Once the first is gone, a
// NoShard module, which keeps its values, can be wrapped again.
TEST(ShardedMisuse, WrappingTheModuleOfALiveWrapperAgainIsAnErrorNamingAParameter) {
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) {
      const auto options = ShardingOptions().strategy(strategy);
      auto model = std::make_unique<FullyShardedDataParallel<Net>>(two_layers(), group, options);
      const auto again = [&] { FullyShardedDataParallel<Net> twice((*model)->module(), group, options); };
      EXPECT_ERROR_SAYS(again(), "parameter '0.weight' belongs to another FullyShardedDataParallel that is still alive",
                        "under summon_full_params() into a new module");
      if (strategy == ShardingStrategy::NoShard) { // whose module keeps its values: it can be wrapped again
        auto net = two_layers();
        { FullyShardedDataParallel<Net> first(net, group, options); }
        EXPECT_NO_THROW(FullyShardedDataParallel<Net>(net, group, options)) << "the first wrapper is gone";
      }
    });
  }
}

// A model holding a wrapper, as PyTorch's auto-wrap nests them.
struct OuterImpl : torch::nn::Module {
  explicit OuterImpl(FullyShardedDataParallel<torch::nn::Linear> inner)
      : block(register_module("block", std::move(inner))), head(register_module("head", torch::nn::Linear(3, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return head(block(x));
  }
  FullyShardedDataParallel<torch::nn::Linear> block;
  torch::nn::Linear head;
};
TORCH_MODULE(Outer);

// The outer wrapper sharded the inner one's shards, and the inner one's
// next all-gather read the storage the outer one had freed: SIGSEGV, with
// no message. Nesting is refused at construction, naming the path and the
// units that do what nesting does (Note [Nested wrappers]); the root may be
// named among the units, and alone it is the only one.
TEST(ShardedMisuse, AWrapperInsideTheModuleToWrapIsRefusedNamingTheUnitsToUse) {
  testing::spawn(2, [](ProcessGroup& group) {
    FullyShardedDataParallel<torch::nn::Linear> inner(torch::nn::Linear(5, 3), group);
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<Outer>(Outer(inner), group),
                      "the module to wrap holds, at 'block', a FullyShardedDataParallel. Wrappers do not nest",
                      "ShardingOptions().units({\"block\", ...})");
    FullyShardedDataParallel<Net> root_only(two_layers(), group, ShardingOptions().units({""}));
    ASSERT_EQ(root_only->flat_params().size(), 1u);
    EXPECT_EQ(root_only->flat_params()[0].unit, "");
    FullyShardedDataParallel<Net> with_root(two_layers(), group, ShardingOptions().units({"", "1"}));
    EXPECT_EQ(with_root->flat_params().size(), 2u);
    EXPECT_EQ(root_only(torch::ones({4, 5})).sizes(), (std::vector<int64_t>{4, 2}));
  });
}

// Parameters of one rank on two devices (here the CPU and the meta device,
// which every build has) would run the gradient hooks on two of autograd's
// device threads at once: refused on every rank, naming the devices.
TEST(ShardedMisuse, ParametersOnTwoDevicesAreAnErrorOnEveryRank) {
  testing::spawn(2, [](ProcessGroup& group) {
    auto net = two_layers();
    net->ptr(1)->register_parameter("extra", torch::empty({2}, torch::TensorOptions().device(torch::kMeta)));
    EXPECT_ERROR_SAYS(FullyShardedDataParallel<Net>(net, group), "'s parameters are on 2 devices",
                      "('0.weight' on cpu, '1.extra' on meta)", "Move the module to one device");
  });
}

// torch::save of the wrapper would write this rank's shards under names
// such as "root:Float", and rank 0's file would load silently into every
// rank's shard. Both are refused, saying how to checkpoint.
TEST(ShardedMisuse, TorchSaveAndLoadOfTheWrapperAreErrorsSayingWhatToUse) {
  const auto dir = misuse_dir("torch_save");
  std::filesystem::create_directories(dir);
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<Net> model(two_layers(), group, ShardingOptions().strategy(strategy));
      const auto path = dir + "/model" + std::to_string(group.rank()) + ".pt";
      EXPECT_ERROR_SAYS(torch::save(model, path), "torch::save of the wrapper itself is refused",
                        "model->summon_full_params()", "lockstep::save_sharded");
      torch::save(two_layers(), path);
      const auto before = full_params(model);
      EXPECT_ERROR_SAYS(torch::load(model, path), "torch::load of the wrapper itself is refused", "full.writeback(true)");
      EXPECT_TRUE(same(full_params(model), before));
    });
  }
}

// Which parameters train is fixed at wrapping: freezing one later left it in
// its shard, stepped by momentum from zero gradients; unfreezing one left it
// out of the shards, its gradient unaveraged. Both are errors at the next
// forward, naming the parameter.
TEST(ShardedMisuse, ChangingWhichParametersTrainAfterWrappingIsAnError) {
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) {
      auto net = two_layers();
      net[1]->as<torch::nn::LinearImpl>()->bias.set_requires_grad(false);
      FullyShardedDataParallel<Net> model(net, group, ShardingOptions().strategy(strategy));
      torch::optim::Adam adam(model->parameters(), 0.1);
      adam_step(model, adam);
      auto params = model->module()->named_parameters();
      params["0.weight"].set_requires_grad(false);
      EXPECT_ERROR_SAYS(model(torch::ones({4, 5})), "parameter '0.weight' of the wrapped module stopped requiring",
                        "Set requires_grad before wrapping");
      params["0.weight"].set_requires_grad(true);
      params["1.bias"].set_requires_grad(true);
      EXPECT_ERROR_SAYS(model(torch::ones({4, 5})), "parameter '1.bias' of the wrapped module started requiring",
                        "would not be averaged");
      params["1.bias"].set_requires_grad(false);
      adam_step(model, adam);
    });
  }
}

// A second backward through a retained graph is refused at the gradient of
// the outputs, before autograd adds anything to a parameter (it failed in
// LibTorch's shape check, adding to a resting parameter's empty gradient),
// and the steps after it are those of a model that never ran it.
TEST(ShardedMisuse, ASecondBackwardThroughARetainedGraphIsAnErrorAndTheNextStepIsRight) {
  for (auto strategy : kStrategies) {
    testing::spawn(2, [&](ProcessGroup& group) {
      const auto options = ShardingOptions().strategy(strategy);
      auto net = two_layers(); // one init for both: the ranks' threads share the seed
      Net copy(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone()));
      FullyShardedDataParallel<Net> model(net, group, options), plain(copy, group, options);
      torch::optim::Adam adam(model->parameters(), 0.1), plain_adam(plain->parameters(), 0.1);
      auto loss = model(torch::ones({4, 5})).sum();
      loss.backward({}, /*retain_graph=*/true);
      EXPECT_ERROR_SAYS(loss.backward(), "a second backward through a retained graph",
                        "sum the losses into one backward");
      adam.step();
      adam_step(model, adam);
      plain(torch::ones({4, 5})).sum().backward();
      plain_adam.step();
      adam_step(plain, plain_adam);
      EXPECT_TRUE(same(full_params(model), full_params(plain)));
    });
  }
}

} // namespace
} // namespace lockstep
