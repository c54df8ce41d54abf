// save_safetensors and load_safetensors through the wrappers: DataParallel
// and DistributedDataParallel under the bare module's names, and
// FullyShardedDataParallel collectively, each strategy, across world sizes.

#include <lockstep/lockstep.h>

#include "support/dp_models.h"
#include "support/errors.h"
#include "support/scratch.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>

namespace lockstep {
namespace {

// A model whose units (each direct child) have parameters and buffers, and
// parameters that do not divide evenly over 2 or 3 ranks.
torch::nn::Sequential bn_net() {
  return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::BatchNorm1d(7), torch::nn::Linear(7, 3));
}

torch::nn::Sequential trained_bn_net(int seed) {
  torch::manual_seed(seed);
  auto net = bn_net();
  net->forward(torch::randn({6, 5}));
  return net;
}

// One copy of `net` per rank, made before the ranks start: a module is
// wrapped by one wrapper at a time.
std::vector<torch::nn::Sequential> copies_of(const torch::nn::Sequential& net, int ranks) {
  std::vector<torch::nn::Sequential> copies;
  for (int r = 0; r < ranks; ++r) {
    copies.emplace_back(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone()));
  }
  return copies;
}

void expect_same_state(const torch::OrderedDict<std::string, torch::Tensor>& read, const torch::nn::Module& bare) {
  size_t count = 0;
  for (const auto& list : {bare.named_parameters(), bare.named_buffers()}) {
    for (const auto& item : list) {
      ASSERT_TRUE(read.contains(item.key())) << item.key();
      const auto a = read[item.key()].contiguous();
      const auto b = item.value().contiguous();
      EXPECT_TRUE(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
                  std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0)
          << item.key();
      ++count;
    }
  }
  EXPECT_EQ(read.size(), count);
}

TEST(SafetensorsWrappers, DataParallelSavesAndLoadsUnderTheBareNames) {
  auto bare = trained_bn_net(3);
  const auto path = testing::scratch("dp.safetensors");
  save_safetensors(bare, path);
  DataParallel<torch::nn::Sequential> dp(bn_net(), DataParallelOptions().devices(testing::dp_models::cpus(2)));
  load_safetensors(dp, path);
  expect_same_state(read_safetensors(path), *dp->module());
  dp->eval();
  bare->eval();
  const auto x = torch::randn({4, 5});
  EXPECT_TRUE(torch::equal(dp->forward(x), bare->forward(x)));
  const auto again = testing::scratch("dp_again.safetensors");
  save_safetensors(dp, again);
  expect_same_state(read_safetensors(again), *bare);
}

TEST(SafetensorsWrappers, DistributedDataParallelSavesAndLoadsUnderTheBareNames) {
  auto bare = trained_bn_net(4);
  const auto path = testing::scratch("ddp.safetensors");
  save_safetensors(bare, path);
  testing::spawn(2, [&](ProcessGroup& group) {
    DistributedDataParallel<torch::nn::Sequential> ddp(bn_net(), group);
    load_safetensors(ddp, path);
    expect_same_state(read_safetensors(path), *ddp->module());
  });
}

// Every rank saving the same path wrote the same files at once under two
// save ids, so that a split save's index named one and its files the other
// (Note [One writer of replicas]): rank 0 alone writes.
TEST(SafetensorsWrappers, DistributedDataParallelWritesOnRankZeroAlone) {
  const auto path = testing::scratch("ddp_every_rank.safetensors");
  const auto only_one = testing::scratch("ddp_rank_one.safetensors");
  testing::spawn(2, [&](ProcessGroup& group) {
    DistributedDataParallel<torch::nn::Sequential> ddp(trained_bn_net(4), group);
    save_safetensors(ddp, path, SafetensorsSaveOptions().max_shard_bytes(64));
    if (group.rank() == 1) {
      save_safetensors(ddp, only_one);
    }
    group.barrier();
    expect_same_state(read_safetensors(path), *ddp->module());
  });
  EXPECT_FALSE(std::filesystem::exists(only_one)) << "rank 1 wrote the file";
}

// Saved at 2 ranks by each strategy, the file is the bare module's, bit for
// bit; loaded at 3 ranks, every rank's summoned parameters are the file's.
TEST(SafetensorsWrappers, FullyShardedSavesTheWholeModelAndLoadsAtAnotherWorldSize) {
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    auto bare = trained_bn_net(5);
    const auto path = testing::scratch("fsdp.safetensors");
    const auto split = testing::scratch("fsdp_split.safetensors");
    testing::spawn(2, [&](ProcessGroup& group) {
      torch::manual_seed(99); // other weights than the bare model's: the wrapper copies rank 0's
      auto net = bn_net();
      torch::NoGradGuard no_grad;
      for (const auto& item : bare->named_parameters()) {
        net->named_parameters()[item.key()].copy_(item.value());
      }
      for (const auto& item : bare->named_buffers()) {
        net->named_buffers()[item.key()].copy_(item.value());
      }
      FullyShardedDataParallel<torch::nn::Sequential> model(net, group, ShardingOptions().strategy(strategy));
      save_safetensors(model, path);
      save_safetensors(model, split, SafetensorsSaveOptions().max_shard_bytes(64));
    });
    expect_same_state(read_safetensors(path), *bare);
    expect_same_state(read_safetensors(split), *bare);
    testing::spawn(3, [&](ProcessGroup& group) {
      FullyShardedDataParallel<torch::nn::Sequential> model(bn_net(), group, ShardingOptions().strategy(strategy));
      load_safetensors(model, split);
      auto full = model->summon_full_params();
      expect_same_state(read_safetensors(path), *model->module());
    });
  }
}

// Rank 0 writes the whole model alone: a path of each rank's own (the
// rank in its name) got rank 0's file and no other, without a word.
TEST(SafetensorsWrappers, FullyShardedRefusesAPathThatDiffersBetweenRanks) {
  const auto base = testing::scratch("fsdp_per_rank");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<torch::nn::Sequential> model(bn_net(), group);
    const auto mine = base + std::to_string(group.rank()) + ".safetensors";
    const auto rank0 = "rank 0 saves to " + base + "0.safetensors, and this rank to another path";
    EXPECT_ERROR_SAYS(save_safetensors(model, mine), group.rank() == 1 ? rank0.c_str() : "rank 1",
                      group.rank() == 1 ? "give every rank the same path" : "save_safetensors");
  });
  EXPECT_FALSE(std::filesystem::exists(base + "0.safetensors")) << "refused before anything is written";
}

TEST(SafetensorsWrappers, FullyShardedLoadFailingOnOneRankFailsOnEveryRankAndLoadsNothing) {
  auto bare = trained_bn_net(6);
  const auto path = testing::scratch("one_rank.safetensors");
  save_safetensors(bare, path);
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<torch::nn::Sequential> model(bn_net(), group);
    torch::Tensor before;
    {
      auto full = model->summon_full_params();
      before = model->module()->named_parameters()["0.weight"].clone();
    }
    const std::string mine = group.rank() == 0 ? path : path + ".absent";
    if (group.rank() == 0) {
      EXPECT_ERROR_SAYS(load_safetensors(model, mine), "load_safetensors(", "on rank 1 failed");
    } else {
      EXPECT_ERROR_SAYS(load_safetensors(model, mine), "there is no such file");
    }
    auto full = model->summon_full_params();
    EXPECT_TRUE(torch::equal(model->module()->named_parameters()["0.weight"], before));
  });
}

// A conversion that would lose a value is refused on every rank of a
// FullyShardedDataParallel, as for a bare module, and loads nothing.
TEST(SafetensorsWrappers, FullyShardedRefusesAConversionThatLosesAValue) {
  auto bare = trained_bn_net(7);
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  for (const auto& item : bare->named_parameters()) {
    tensors.insert(item.key(), item.value().detach().to(torch::kDouble));
  }
  for (const auto& item : bare->named_buffers()) {
    tensors.insert(item.key(), item.value());
  }
  tensors["0.weight"].view({-1})[0] = 1e300;
  const auto path = testing::scratch("too_wide.safetensors");
  write_safetensors(tensors, path);
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<torch::nn::Sequential> model(bn_net(), group);
    torch::Tensor before;
    {
      auto full = model->summon_full_params();
      before = model->module()->named_parameters()["0.weight"].clone();
    }
    EXPECT_ERROR_SAYS(load_safetensors(model, path, SafetensorsLoadOptions().convert_dtypes(true)), "0.weight: 1 of its",
                      "do not fit in Float");
    auto full = model->summon_full_params();
    EXPECT_TRUE(torch::equal(model->module()->named_parameters()["0.weight"], before));
  });
}

std::vector<std::string> files_starting(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) {
      names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

// x W + b, with W given.
struct ProjectionImpl : torch::nn::Module {
  explicit ProjectionImpl(const torch::Tensor& w) {
    weight = register_parameter("weight", w);
    bias = register_parameter("bias", torch::randn({w.size(1)}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x.matmul(weight) + bias;
  }
  torch::Tensor weight, bias;
};
TORCH_MODULE(Projection);

// An embedding tied to the output layer: one weight, 'embed.weight' and
// 'head.weight'.
struct TiedHeadImpl : torch::nn::Module {
  TiedHeadImpl() {
    const auto shared = torch::randn({4, 4});
    embed = register_module("embed", Projection(shared));
    head = register_module("head", Projection(shared));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::tanh(embed(x)));
  }
  Projection embed{nullptr}, head{nullptr};
};
TORCH_MODULE(TiedHead);

// TiedHead's names but 'embed.weight'.
struct OtherNameImpl : torch::nn::Module {
  OtherNameImpl() {
    embed = register_module("embed", std::make_shared<torch::nn::Module>());
    bias = embed->register_parameter("bias", torch::randn({4}));
    head = register_module("head", Projection(torch::randn({4, 4})));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(x + bias);
  }
  std::shared_ptr<torch::nn::Module> embed;
  torch::Tensor bias;
  Projection head{nullptr};
};
TORCH_MODULE(OtherName);

// safetensors' save_model, and Hugging Face's files, hold a tied weight
// under one of its names; its load_model takes them strictly (Note [Tied
// parameters in safetensors files]). So do the bare module's load and
// FullyShardedDataParallel's, whichever name the file has; one with none of
// them still misses both. load_sharded reads a folder that has only the
// other name.
TEST(SafetensorsWrappers, ATiedWeightLoadsStrictlyFromAFileWithOneOfItsNames) {
  torch::manual_seed(3);
  TiedHead source;
  const auto named = source->named_parameters();
  for (const std::string kept : {"embed.weight", "head.weight"}) {
    SCOPED_TRACE(kept);
    const auto file = testing::scratch("tied_" + kept + ".safetensors");
    torch::OrderedDict<std::string, torch::Tensor> tensors;
    for (const auto& name : {kept, std::string("embed.bias"), std::string("head.bias")}) {
      tensors.insert(name, named[name]);
    }
    write_safetensors(tensors, file);
    TiedHead bare;
    load_safetensors(bare, file);
    EXPECT_TRUE(torch::equal(bare->head->weight, named["embed.weight"]));
    EXPECT_TRUE(torch::equal(bare->embed->bias, named["embed.bias"]));
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<TiedHead> model(TiedHead(), group, ShardingOptions().units({""}));
      load_safetensors(model, file);
      auto full = model->summon_full_params();
      EXPECT_TRUE(torch::equal(model->module()->embed->weight, named["embed.weight"]));
    });
  }
  const auto biases = testing::scratch("tied_biases.safetensors");
  write_safetensors(torch::OrderedDict<std::string, torch::Tensor>(
                        {{"embed.bias", named["embed.bias"]}, {"head.bias", named["head.bias"]}}),
                    biases);
  TiedHead bare;
  EXPECT_ERROR_SAYS(load_safetensors(bare, biases), "Missing key(s) in state_dict: \"embed.weight\", \"head.weight\"");

  // A sharded folder of a model whose only weight is 'head.weight'.
  const auto dir = testing::scratch("tied_other_name");
  testing::spawn(2, [&](ProcessGroup& group) {
    OtherName other;
    std::map<std::string, torch::Tensor> values; // the same on every rank: the threads share the generator
    {
      torch::NoGradGuard no_grad;
      double i = 0;
      for (auto& item : other->named_parameters()) {
        item.value().copy_(torch::sin(torch::arange(item.value().numel(), torch::kFloat) + ++i).view_as(item.value()));
        values[item.key()] = item.value().detach().clone();
      }
    }
    FullyShardedDataParallel<OtherName> saved(other, group);
    saved->save_sharded(dir);
    FullyShardedDataParallel<TiedHead> model(TiedHead(), group, ShardingOptions().units({""}));
    model->load_sharded(dir);
    auto full = model->summon_full_params();
    EXPECT_TRUE(torch::equal(model->module()->embed->weight, values["head.weight"]));
    EXPECT_TRUE(torch::equal(model->module()->embed->bias, values["embed.bias"]));
  });
}

// save_sharded(model, dir): PyTorch's distributed checkpoint layout, each
// rank its shards as boxes; loaded at another world size, bit for bit.
TEST(DcpCheckpoint, SavedAtTwoRanksLoadsAtThreeEachStrategy) {
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    auto bare = trained_bn_net(7);
    const auto dir = testing::scratch("dcp_two");
    const auto nets = copies_of(bare, 2);
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<torch::nn::Sequential> model(nets[group.rank()], group,
                                                             ShardingOptions().strategy(strategy));
      save_sharded(model, dir);
    });
    EXPECT_TRUE(std::filesystem::exists(dir + "/lockstep_save.json"));
    EXPECT_FALSE(files_starting(dir, "shard-00001-model-").empty());
    testing::spawn(3, [&](ProcessGroup& group) {
      FullyShardedDataParallel<torch::nn::Sequential> model(bn_net(), group, ShardingOptions().strategy(strategy));
      load_sharded(model, dir);
      auto full = model->summon_full_params();
      torch::OrderedDict<std::string, torch::Tensor> expected;
      for (const auto& list : {bare->named_parameters(), bare->named_buffers()}) {
        for (const auto& item : list) {
          expected.insert(item.key(), item.value());
        }
      }
      expect_same_state(expected, *model->module());
    });
  }
}

void save_two_ranks(const std::string& dir, int seed) {
  const auto nets = copies_of(trained_bn_net(seed), 2);
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<torch::nn::Sequential> model(nets[group.rank()], group);
    save_sharded(model, dir);
  });
}

std::string load_error(const std::string& dir) {
  std::string error;
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<torch::nn::Sequential> model(bn_net(), group);
    const auto mine = testing::error_of([&] { load_sharded(model, dir); });
    if (group.rank() == 0) {
      error = mine;
    }
  });
  return error;
}

TEST(DcpCheckpoint, ASaveStoppedBeforeItsRecordNeverLoads) {
  const auto dir = testing::scratch("dcp_stopped");
  save_two_ranks(dir, 8);
  std::filesystem::remove(dir + "/lockstep_save.json");
  EXPECT_NE(load_error(dir).find("was written by a lockstep save that did not finish"), std::string::npos);
}

TEST(DcpCheckpoint, AFileOfAnotherSaveIsAnErrorNamingIt) {
  const auto first = testing::scratch("dcp_first");
  const auto second = testing::scratch("dcp_second");
  save_two_ranks(first, 9);
  save_two_ranks(second, 10);
  const auto names = files_starting(first, "shard-00002-");
  ASSERT_FALSE(names.empty());
  std::filesystem::copy_file(second + "/" + names[0], first + "/" + names[0],
                             std::filesystem::copy_options::overwrite_existing);
  const auto error = load_error(first);
  EXPECT_NE(error.find(names[0] + " belongs to another save"), std::string::npos) << error;
}

TEST(DcpCheckpoint, AFileMissingFromTheRecordIsAnErrorNamingIt) {
  const auto dir = testing::scratch("dcp_missing");
  save_two_ranks(dir, 11);
  const auto names = files_starting(dir, "shard-00002-");
  ASSERT_FALSE(names.empty());
  std::filesystem::remove(dir + "/" + names.back());
  EXPECT_NE(load_error(dir).find("cannot open the safetensors file " + dir + "/" + names.back()), std::string::npos);
}

// A folder without Lockstep's record, as PyTorch writes it: a tensor whose
// boxes leave elements out is an error naming it, not a silent hole.
TEST(DcpCheckpoint, BoxesThatLeaveAHoleAreAnErrorNamingTheTensor) {
  const auto dir = testing::scratch("dcp_hole");
  std::filesystem::create_directory(dir);
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  tensors.insert("w", torch::zeros({2, 5}));
  write_safetensors(tensors, dir + "/a.safetensors", {{"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [5, 0]}})"}});
  EXPECT_NE(load_error(dir).find("the boxes of tensor 'w' hold 10 of its 35 elements"), std::string::npos);
}

} // namespace
} // namespace lockstep
