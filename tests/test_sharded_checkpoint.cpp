// save_sharded and load_sharded, ranks as threads: checkpoints that resume
// at another world size and keep buffers and frozen parameters, and what
// goes wrong: a layer of another shape, the files of two saves in one
// folder, a rank that cannot write its file, a save without optimizer
// state, ranks that load different saves, a damaged shard; a full
// optimizer refused on one rank. (Lockstep's earlier format is in
// test_sharded_checkpoint_v1.cpp.)

#include "../src/io/dcp_hf.h"
#include <lockstep/lockstep.h>

#include "../src/util/torch_compat.h"
#include "support/errors.h"
#include "support/fsdp_checks.h"
#include "support/modules.h"
#include "support/scratch.h"
#include "support/threads.h"
#include "support/warnings.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace lockstep {
namespace {

using Net = torch::nn::Sequential;

// One unit (the layer "0") of 12 elements either way, in other shapes.
Net one_layer(bool reshaped) {
  return Net(torch::nn::Linear(torch::nn::LinearOptions(reshaped ? 3 : 6, reshaped ? 4 : 2).bias(false)));
}

std::string checkpoint_dir(const std::string& name) {
  return testing::scratch("ckpt_" + name);
}

// The file rank `rank` of a save at 2 ranks writes.
std::string shard_of(const std::string& dir, int rank) {
  return dir + "/" + detail::dcp_file_name(rank, 0, 1);
}

void save(ProcessGroup& group, const std::string& dir) {
  FullyShardedDataParallel<Net> model(one_layer(false), group);
  torch::optim::Adam adam(model->parameters());
  save_sharded(model, adam, dir);
}

// Ranks saving into folders that differ (disks of each node's own) were
// told the save succeeded; rank 0 now warns, naming a file it cannot see
// (Note [A save into folders that differ]).
TEST(ShardedCheckpoint, ASaveIntoFoldersThatDifferIsSaidOnRankZero) {
  const auto dir = checkpoint_dir("local");
  testing::spawn(2, [&](ProcessGroup& group) {
    const std::string warned =
        testing::warning_text_of([&] { save(group, dir + "_rank" + std::to_string(group.rank())); });
    if (group.rank() == 0) {
      const std::string said = "rank 0 does not see 1 of the 2 files the ranks wrote (the first: " +
                               detail::dcp_file_name(1, 0, 1) + "), so the ranks' folders differ";
      EXPECT_NE(warned.find(said), std::string::npos) << warned;
    } else {
      EXPECT_EQ(warned, "");
    }
  });
  testing::spawn(2, [&](ProcessGroup& group) {
    EXPECT_EQ(testing::warning_text_of([&] { save(group, dir); }), "") << "one folder that every rank shares";
  });
}

TEST(ShardedCheckpoint, ALayerOfAnotherShapeIsAnErrorNamingTheParameter) {
  const auto dir = checkpoint_dir("reshaped");
  testing::spawn(2, [&](ProcessGroup& group) {
    save(group, dir);
    FullyShardedDataParallel<Net> model(one_layer(/*reshaped=*/true), group);
    torch::optim::Adam adam(model->parameters());
    EXPECT_ERROR_SAYS(load_sharded(model, adam, dir), "size mismatch for 0.weight: the checkpoint's is [2, 6], the "
                      "model's [4, 3]", "nothing was loaded");
  });
}

// A save stopped halfway into a folder that held an earlier save: rank 1's
// file is the earlier save's. Every rank refuses, naming the file.
TEST(ShardedCheckpoint, FilesOfTwoSavesAreAnErrorNamingTheFile) {
  const auto earlier = checkpoint_dir("earlier");
  const auto later = checkpoint_dir("later");
  testing::spawn(2, [&](ProcessGroup& group) {
    save(group, earlier);
    save(group, later);
  });
  std::filesystem::copy_file(shard_of(earlier, 1), shard_of(later, 1), std::filesystem::copy_options::overwrite_existing);
  const std::string mixed = shard_of(later, 1) + " belongs to another save than " + later + "/lockstep_save.json";
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(one_layer(false), group);
    torch::optim::Adam adam(model->parameters());
    EXPECT_ERROR_SAYS(load_sharded(model, adam, later), mixed.c_str(), "the folder mixes files of two saves");
  });
}

// A load that fails on one rank changes nothing on any (Note [A load
// changes all or nothing]): rank 0's files are good, yet it loads nothing,
// since rank 1 failed; otherwise a caller that goes on after the error
// would hold different models on its ranks.
TEST(ShardedCheckpoint, AFailedLoadChangesNothingOnAnyRank) {
  const auto earlier = checkpoint_dir("unchanged_earlier");
  const auto later = checkpoint_dir("unchanged_later");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(one_layer(false), group);
    torch::optim::Adam adam(model->parameters(), 0.1);
    auto step = [&] {
      adam.zero_grad();
      model(torch::ones({3, 6})).pow(2).sum().backward();
      adam.step();
    };
    step();
    save_sharded(model, adam, earlier);
    step();
    save_sharded(model, adam, later);
    group.barrier();
    if (group.rank() == 0) {
      std::filesystem::copy_file(shard_of(earlier, 1), shard_of(later, 1),
                                 std::filesystem::copy_options::overwrite_existing);
    }
    group.barrier();
    step();
    const auto shard = model->parameters()[0].detach().clone();
    ASSERT_EQ(adam.state().size(), 1u);
    const auto& moments = static_cast<torch::optim::AdamParamState&>(*adam.state().begin()->second);
    const auto exp_avg = moments.exp_avg().clone();
    const auto step_count = moments.step();
    EXPECT_THROW(load_sharded(model, adam, later), c10::Error);
    EXPECT_TRUE(torch::equal(model->parameters()[0], shard)) << "rank " << group.rank() << "'s shard changed";
    ASSERT_EQ(adam.state().size(), 1u);
    const auto& after = static_cast<torch::optim::AdamParamState&>(*adam.state().begin()->second);
    EXPECT_TRUE(torch::equal(after.exp_avg(), exp_avg)) << "rank " << group.rank() << "'s Adam state changed";
    EXPECT_EQ(after.step(), step_count);
  });
}

// LBFGS's state cannot be resharded: load_sharded refuses it, so
// save_sharded does at once, before it writes anything, rather than let a
// run write checkpoints it could never resume from.
TEST(ShardedCheckpoint, AnOptimizerWhoseStateCannotBeReshardedIsRefusedBeforeAnyFileIsWritten) {
  const auto dir = checkpoint_dir("lbfgs");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(one_layer(false), group);
    torch::optim::LBFGS lbfgs(model->parameters());
    EXPECT_ERROR_SAYS(save_sharded(model, lbfgs, dir), "lockstep::save_sharded: the optimizer (",
                      "is not one whose state can be resharded", "Save a full checkpoint under summon_full_params()");
  });
  EXPECT_FALSE(std::filesystem::exists(shard_of(dir, 0)));
  EXPECT_FALSE(std::filesystem::exists(dir + "/lockstep_save.json"));
}

// Rank 1 cannot write its file (a folder that is not empty stands in its
// place): every rank ends with an error at once, none waits for the
// collective timeout.
TEST(ShardedCheckpoint, ARankThatCannotWriteIsAnErrorOnEveryRank) {
  const auto dir = checkpoint_dir("unwritable");
  std::filesystem::create_directories(shard_of(dir, 1) + "/inside");
  const std::string named = "save_sharded of " + dir + " on rank 1 failed";
  const std::string own = "cannot remove the earlier save's " + shard_of(dir, 1);
  testing::spawn(2, [&](ProcessGroup& group) {
    if (group.rank() == 1) {
      EXPECT_ERROR_SAYS(save(group, dir), own.c_str());
    } else {
      EXPECT_ERROR_SAYS(save(group, dir), named.c_str(), "its own error names the file");
    }
  }, std::chrono::seconds(20));
}

// A checkpoint saved before the optimizer's first step holds no optimizer
// state. Loading it into an optimizer that has stepped drops that
// optimizer's moments and step count, as load_state_dict does, so the next
// step is the first step's again.
TEST(ShardedCheckpoint, ASaveBeforeTheFirstStepLoadsAsNoOptimizerState) {
  const auto dir = checkpoint_dir("before_step");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(one_layer(false), group);
    torch::optim::Adam adam(model->parameters(), 0.1);
    auto step = [&] {
      adam.zero_grad();
      model(torch::ones({3, 6})).pow(2).sum().backward();
      adam.step();
    };
    save_sharded(model, adam, dir);
    step();
    const auto first = model->parameters()[0].detach().clone();
    step();
    load_sharded(model, adam, dir);
    EXPECT_TRUE(adam.state().empty()) << "the stepped optimizer's state outlived the load";
    step();
    EXPECT_TRUE(torch::equal(model->parameters()[0], first)) << "the step after the load is not the first step";
  });
}

// Adam's state read into SGD's would leave SGD's momentum buffer undefined
// (the next step fails inside LibTorch), and the other way round trips an
// internal assert: the type is recorded and checked.
TEST(ShardedCheckpoint, AnotherOptimizerTypeIsAnErrorNamingBoth) {
  const auto dir = checkpoint_dir("other_optimizer");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(one_layer(false), group);
    torch::optim::Adam adam(model->parameters());
    model(torch::ones({2, 6})).sum().backward();
    adam.step();
    save_sharded(model, adam, dir);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    EXPECT_ERROR_SAYS(load_sharded(model, sgd, dir), "holds the state of Adam, but this optimizer is SGD",
                      "Load it with Adam.");
    torch::optim::SGD full(model->module()->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    EXPECT_ERROR_SAYS(full_optimizer_state(model, adam, full), "the full optimizer is SGD but the sharded one is Adam",
                      "Make the full optimizer of the sharded one's type");
  });
}

// Each rank loads the folder it is given: two whole folders of different
// saves (a node's copy one checkpoint behind) loaded together, one model
// stitched from shards of two steps (Note [One save on every rank]).
TEST(ShardedCheckpoint, RanksThatLoadDifferentSavesAreAnErrorOnEveryRank) {
  const auto older = checkpoint_dir("older");
  const auto newer = checkpoint_dir("newer");
  testing::spawn(2, [&](ProcessGroup& group) {
    save(group, older);
    save(group, newer);
    FullyShardedDataParallel<Net> model(one_layer(false), group);
    torch::optim::Adam adam(model->parameters());
    const auto before = model->parameters()[0].detach().clone();
    EXPECT_ERROR_SAYS(load_sharded(model, adam, group.rank() == 0 ? older : newer),
                      "rank 1 loaded another save than rank 0", "Every rank must load the same checkpoint");
    EXPECT_TRUE(torch::equal(model->parameters()[0], before)) << "a refused load changed the shards";
  });
}

// Only rank 0 saves the gathered state, so another rank's full optimizer is
// easily an afterthought: refused there, it left rank 0 waiting in the
// gather until the timeout.
TEST(ShardedCheckpoint, AFullOptimizerRefusedOnOneRankIsAnErrorOnEveryRank) {
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        FullyShardedDataParallel<Net> model(one_layer(false), group);
        torch::optim::Adam adam(model->parameters());
        model(torch::ones({2, 6})).sum().backward();
        adam.step();
        auto unrelated = one_layer(false);
        torch::optim::Adam full(group.rank() == 0 ? model->module()->parameters() : unrelated->parameters());
        if (group.rank() == 1) {
          EXPECT_ERROR_SAYS(full_optimizer_state(model, adam, full), "is not among the full optimizer's parameters");
        } else {
          EXPECT_ERROR_SAYS(full_optimizer_state(model, adam, full), "full_optimizer_state on rank 1 failed",
                            "says which optimizer or parameter is wrong");
        }
      },
      std::chrono::seconds(10));
}

// A caller that records the id save_sharded returned (the trainer's
// checkpoint file) has a folder of another save refused on every rank,
// before anything is loaded; a missing folder is named as such, not as a
// missing index.json.
TEST(ShardedCheckpoint, AFolderOfAnotherSaveThanTheCallerNamesIsRefused) {
  const auto first = checkpoint_dir("named_first");
  const auto second = checkpoint_dir("named_second");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(one_layer(false), group);
    torch::optim::Adam adam(model->parameters());
    const int64_t first_id = save_sharded(model, adam, first);
    const int64_t second_id = save_sharded(model, adam, second);
    EXPECT_NE(first_id, second_id);
    const auto before = model->parameters()[0].detach().clone();
    const std::string says = second + " holds save " + std::to_string(second_id) + ", not save " +
        std::to_string(first_id) + " that the caller names";
    EXPECT_ERROR_SAYS(load_sharded(model, adam, second, first_id), says.c_str(), "written by another save");
    EXPECT_TRUE(torch::equal(model->parameters()[0], before)) << "a refused load changed the shards";
    load_sharded(model, adam, second, second_id);
    const std::string missing = "lockstep::load_sharded: the folder " + first + "_gone is missing";
    EXPECT_ERROR_SAYS(load_sharded(model, adam, first + "_gone"), missing.c_str());
  });
}

// Each rank reads its own folder (node-local storage): one missing on rank 1
// alone, or of the earlier format on rank 1 alone, fails on every rank, and
// the ranks' next collectives still pair.
TEST(ShardedCheckpoint, AFolderMissingOrOfAnotherFormatOnOneRankFailsOnEveryRank) {
  const auto dir = checkpoint_dir("one_rank");
  const auto v1_look = checkpoint_dir("one_rank_v1");
  std::filesystem::create_directories(v1_look);
  std::ofstream(v1_look + "/index.json") << "{}";
  testing::spawn(
      2,
      [&](ProcessGroup& group) {
        FullyShardedDataParallel<Net> model(one_layer(false), group);
        torch::optim::Adam adam(model->parameters());
        save_sharded(model, adam, dir);
        const bool one = group.rank() == 1;
        const std::string missing = "the folder " + dir + "_not_here is missing";
        const std::string named = "load_sharded of " + dir + " on rank 1 failed";
        if (one) {
          EXPECT_ERROR_SAYS(load_sharded(model, adam, dir + "_not_here"), missing.c_str());
        } else {
          EXPECT_ERROR_SAYS(load_sharded(model, adam, dir), named.c_str());
        }
        EXPECT_ERROR_SAYS(load_sharded(model, adam, one ? v1_look : dir), "rank 1's folder holds lockstep's earlier "
                          "sharded format (index.json), rank 0's PyTorch's distributed checkpoint layout");
        const auto out = model->forward(torch::ones({1, 6}));
        EXPECT_EQ(out.sizes(), (std::vector<int64_t>{1, 2})) << "the ranks' collectives no longer pair";
        load_sharded(model, adam, dir);
      },
      std::chrono::seconds(20));
}

// PyTorch's readers take every .safetensors file of the folder, and its
// default one the .metadata: a save refuses a folder holding either, naming
// the file, before anything is removed; and a load of PyTorch's default
// layout names it instead of calling the folder empty.
TEST(ShardedCheckpoint, ASaveIntoAFolderOfAnotherCheckpointIsRefused) {
  for (const std::string other : {"model.safetensors", ".metadata", "__0_0.distcp"}) {
    const auto dir = checkpoint_dir("other_" + std::to_string(other.size()));
    testing::spawn(2, [&](ProcessGroup& group) { save(group, dir); });
    std::ofstream(dir + "/" + other) << "not ours";
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<Net> model(one_layer(false), group);
      torch::optim::Adam adam(model->parameters());
      const std::string says = dir + " holds " + other + ", which is not a file of a lockstep save";
      EXPECT_ERROR_SAYS(save_sharded(model, adam, dir), says.c_str(), "Save into an empty folder");
    });
    EXPECT_TRUE(std::filesystem::exists(shard_of(dir, 1))) << "the refused save removed the earlier one";
  }
  const auto pytorch = checkpoint_dir("pytorch_default");
  std::filesystem::create_directories(pytorch);
  std::ofstream(pytorch + "/.metadata") << "pickle";
  std::ofstream(pytorch + "/__0_0.distcp") << "bytes";
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(one_layer(false), group);
    torch::optim::Adam adam(model->parameters());
    EXPECT_ERROR_SAYS(load_sharded(model, adam, pytorch), "PyTorch's default distributed checkpoint",
                      "HuggingFaceStorageWriter");
  });
}

// A save record is lockstep's own: a name in it that is not a shard file
// beside it (a path out of the folder) is refused, not opened.
TEST(ShardedCheckpoint, ARecordNamingAFileOutsideItsFolderIsRefused) {
  const auto dir = checkpoint_dir("record_escape");
  testing::spawn(2, [&](ProcessGroup& group) { save(group, dir); });
  const auto record_path = dir + "/" + detail::kDcpSaveRecord;
  auto record = nlohmann::json::parse(std::ifstream(record_path));
  record["files"][0] = "../" + record["files"][0].get<std::string>();
  std::ofstream(record_path) << record.dump();
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(one_layer(false), group);
    torch::optim::Adam adam(model->parameters());
    EXPECT_ERROR_SAYS(load_sharded(model, adam, dir), "which is not a shard file of a lockstep save in its folder");
  });
}

// One parameter, x = [1], whose gradient is 1.
struct ScalarImpl : torch::nn::Module {
  ScalarImpl() : x(register_parameter("x", torch::ones({1}))) {}
  torch::Tensor forward(const torch::Tensor& input) {
    return (x * input).sum();
  }
  torch::Tensor x;
};
TORCH_MODULE(Scalar);

// PyTorch's test_zero_redundancy_optimizer.py::test_state_dict, ported: a
// load restores the parameter groups' options, as torch::load of an
// optimizer and Python's load_state_dict do ("We should be using LR1 and
// not LR2 after reloading"); the caller's constructor options are replaced.
TEST(ShardedCheckpoint, TheOptimizersOptionsAreRestoredAsTorchLoadDoes) {
  for (int world : {1, 2}) {
    const auto dir = checkpoint_dir("options_" + std::to_string(world));
    testing::spawn(world, [&](ProcessGroup& group) {
      FullyShardedDataParallel<Scalar> model(Scalar(), group);
      const auto x = [&] {
        auto full = model->summon_full_params();
        return model->module()->x.item<double>();
      };
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      model(torch::ones({1})).backward();
      sgd.step();
      EXPECT_NEAR(x(), 0.9, 1e-7);
      save_sharded(model, sgd, dir);
      torch::optim::SGD reloaded(model->parameters(), torch::optim::SGDOptions(0.01));
      load_sharded(model, reloaded, dir);
      const auto& options = static_cast<const torch::optim::SGDOptions&>(reloaded.param_groups()[0].options());
      EXPECT_EQ(options.lr(), 0.1) << "world size " << world << ": the constructor's lr outlived the load";
      EXPECT_EQ(options.momentum(), 0.9) << "world size " << world;
      reloaded.zero_grad();
      model(torch::ones({1})).backward();
      reloaded.step();
      EXPECT_NEAR(x(), 0.71, 1e-6) << "world size " << world;
    });
  }
}

using testing::OddNet;
using testing::kStrategies;

// Steps [first, last) of the global batch on this rank's share, with Adam;
// between, the state comes from `load` and goes to `save` when not empty.
void train_steps(ProcessGroup& group, OddNet initial, ShardingStrategy strategy, int first, int last,
                 const std::string& load, const std::string& save, OddNet* result = nullptr) {
  FullyShardedDataParallel<OddNet> model(testing::copy_of(initial), group, ShardingOptions().strategy(strategy));
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  if (!load.empty()) {
    load_sharded(model, adam, load);
  }
  testing::train_shares(model, adam, group, first, last);
  if (!save.empty()) {
    save_sharded(model, adam, save);
  }
  if (result != nullptr && group.rank() == 0) {
    auto full = model->summon_full_params();
    testing::copy_values(*model->module(), **result);
  } else if (result != nullptr) {
    auto full = model->summon_full_params();
  }
}

TEST(FullyShardedDataParallel, ShardedCheckpointsResumeAtAnotherWorldSize) {
  torch::manual_seed(4);
  OddNet initial;
  auto reference = testing::train_reference(initial, 4, 12);
  for (auto strategy : kStrategies) {
    for (auto sizes : {std::make_pair(2, 3), std::make_pair(3, 2)}) {
      SCOPED_TRACE(std::string(testing::name_of(strategy)) + ": saved at " + std::to_string(sizes.first) +
                   " ranks, loaded at " + std::to_string(sizes.second));
      const std::string dir = testing::scratch("fsdp_sharded");
      testing::spawn(sizes.first, [&](ProcessGroup& group) { train_steps(group, initial, strategy, 0, 2, "", dir); });
      OddNet resumed;
      testing::spawn(sizes.second, [&](ProcessGroup& group) {
        train_steps(group, initial, strategy, 2, 4, dir, "", &resumed);
      });
      testing::expect_params_close(*resumed, *reference, 1e-5, 1e-5);
    }
  }
}

// A model with buffers (BatchNorm's running statistics) and a frozen layer,
// neither of which is sharded.
torch::nn::Sequential net_with_buffers(int64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(5, 7), torch::nn::BatchNorm1d(7), torch::nn::Linear(7, 3));
  net[0]->as<torch::nn::Linear>()->weight.set_requires_grad(false);
  return net;
}

TEST(FullyShardedDataParallel, ShardedCheckpointsKeepBuffersAndFrozenParameters) {
  const std::string dir = testing::scratch("fsdp_buffers");
  std::vector<torch::Tensor> saved; // rank 0's buffers and frozen weight when it saved
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<torch::nn::Sequential> model(net_with_buffers(1), group);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    auto x = torch::randn({4, 5}, torch::TensorOptions().dtype(torch::kFloat)) + group.rank();
    torch::mse_loss(model->forward(x), torch::zeros({4, 3})).backward();
    sgd.step();
    save_sharded(model, sgd, dir);
    if (group.rank() == 0) {
      for (const auto& b : model->module()->buffers()) {
        saved.push_back(b.clone());
      }
      saved.push_back(model->module()[0]->as<torch::nn::Linear>()->weight.clone());
    }
  });
  ASSERT_EQ(saved.size(), 4u); // running mean, variance, batch count; the frozen weight
  ASSERT_FALSE(torch::equal(saved[0], torch::zeros_like(saved[0]))); // the step moved the running mean
  testing::spawn(3, [&](ProcessGroup& group) {
    FullyShardedDataParallel<torch::nn::Sequential> model(net_with_buffers(2), group); // other values everywhere
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    load_sharded(model, sgd, dir);
    auto buffers = model->module()->buffers();
    for (size_t i = 0; i < buffers.size(); ++i) {
      EXPECT_TRUE(torch::equal(buffers[i], saved[i])) << "rank " << group.rank() << ", buffer " << i;
    }
    EXPECT_TRUE(torch::equal(model->module()[0]->as<torch::nn::Linear>()->weight, saved[3])) << "rank " << group.rank();
  });
  testing::spawn(2, [&](ProcessGroup& group) {
    // The same parameters, but a BatchNorm without running statistics.
    torch::nn::Sequential other(torch::nn::Linear(5, 7),
                                torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(7).track_running_stats(false)),
                                torch::nn::Linear(7, 3));
    other[0]->as<torch::nn::Linear>()->weight.set_requires_grad(false);
    FullyShardedDataParallel<torch::nn::Sequential> model(other, group);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    EXPECT_ERROR_SAYS(load_sharded(model, sgd, dir), "Unexpected key(s) in the checkpoint: \"1.num_batches_tracked\", "
                      "\"1.running_mean\", \"1.running_var\".", "nothing was loaded");
  });
}

TEST(FullyShardedDataParallel, ADamagedShardIsAnErrorNamingTheFile) {
  torch::manual_seed(5);
  OddNet initial;
  const std::string dir = testing::scratch("fsdp_damaged");
  testing::spawn(2, [&](ProcessGroup& group) {
    train_steps(group, initial, ShardingStrategy::FullShard, 0, 1, "", dir);
  });
  // The last byte of rank 1's file: data of a tensor that rank 1 reads back.
  std::string shard;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("shard-00002-model-00001-", 0) == 0) {
      shard = entry.path().string();
    }
  }
  ASSERT_FALSE(shard.empty());
  {
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-1, std::ios::end);
    const char byte = static_cast<char>(file.get() ^ 0xff);
    file.seekp(-1, std::ios::end);
    file.put(byte);
  }
  // Rank 1 reads the damaged tensor; rank 0 learns that rank 1 could not load.
  testing::spawn(2, [&](ProcessGroup& group) {
    if (group.rank() == 1) {
      EXPECT_ERROR_SAYS(train_steps(group, initial, ShardingStrategy::FullShard, 0, 0, dir, ""), shard.c_str(),
                        "is damaged: its checksum does not match");
    } else {
      EXPECT_ERROR_SAYS(train_steps(group, initial, ShardingStrategy::FullShard, 0, 0, dir, ""),
                        "on rank 1 failed", "its own error names the file");
    }
  });
}

} // namespace
} // namespace lockstep
