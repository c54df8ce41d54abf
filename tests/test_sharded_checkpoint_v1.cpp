// Folders in lockstep's earlier sharded format (index.json and
// shard-R-of-W.pt, Note [Sharded checkpoint]) keep loading, so that runs
// saved before the safetensors layout resume. tests/data/sharded_v1 was
// written by that lockstep: Sequential(Linear(6, 2, no bias),
// BatchNorm1d(2)) at 2 ranks, a unit each, with Adam(lr 0.1) after one
// step. It loads at 1, 2 and 3 ranks into exactly what its files hold (read
// here straight from them), and its integrity checks still hold.

#include "../src/util/checked_file.h"
#include <lockstep/lockstep.h>

#include "../src/util/torch_compat.h"

#include "support/errors.h"
#include "support/scratch.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep {
namespace sharded_v1_tests {
namespace {

using Net = torch::nn::Sequential;

torch::Tensor fixture_input() {
  return torch::arange(18, torch::kFloat).view({3, 6}) / 7 - 1;
}

template <typename Model>
void fixture_step(Model& model, torch::optim::Optimizer& adam) {
  adam.zero_grad();
  model->forward(fixture_input()).pow(2).sum().backward();
  adam.step();
}

// A copy of the fixture in this test's scratch folder, for a test to damage.
std::string fixture_copy(const std::string& name) {
  const auto dir = testing::scratch("v1_" + name);
  std::filesystem::copy(std::string(LOCKSTEP_TEST_DATA_DIR) + "/sharded_v1", dir,
                        std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  return dir;
}

std::vector<torch::Tensor> values_of(const Net& net) {
  std::vector<torch::Tensor> values;
  for (const auto& item : net->named_parameters()) {
    values.push_back(item.value().detach().clone());
  }
  for (const auto& item : net->named_buffers()) {
    values.push_back(item.value().clone());
  }
  return values;
}

// The model's parameters and buffers, whole, on every rank.
std::vector<torch::Tensor> values_of(FullyShardedDataParallel<Net>& model) {
  auto full = model->summon_full_params();
  return values_of(model->module());
}

void expect_equal(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(torch::equal(got[i], want[i])) << what << ", tensor " << i << ": " << got[i] << " vs " << want[i];
  }
}

// Adam's exp_avg and exp_avg_sq for each parameter of `net`, from `adam`.
std::vector<torch::Tensor> moments_of(const Net& net, torch::optim::Adam& adam) {
  std::vector<torch::Tensor> moments;
  for (const auto& p : net->parameters()) {
    const auto& state =
        static_cast<torch::optim::AdamParamState&>(*adam.state().at(detail::optimizer_state_key(adam.state(), p)));
    moments.push_back(state.exp_avg().clone());
    moments.push_back(state.exp_avg_sq().clone());
  }
  return moments;
}

// What the fixture's files hold, read straight from them (each a 27-byte
// frame around a LibTorch archive): the parameters and buffers in the
// order values_of gives them, and Adam's moments in moments_of's.
struct Saved {
  std::vector<torch::Tensor> values, moments;
};

Saved saved_in(const std::string& dir) {
  const auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    in.ignore(27);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const auto index = nlohmann::json::parse(read(dir + "/index.json"));
  const int world = index["world_size"].get<int>();
  std::vector<torch::serialize::InputArchive> shards(world);
  for (int r = 0; r < world; ++r) {
    std::istringstream payload(read(dir + "/shard-" + std::to_string(r) + "-of-" + std::to_string(world) + ".pt"));
    shards[r].load_from(payload);
  }
  Saved saved;
  for (size_t f = 0; f < index["flats"].size(); ++f) {
    std::map<std::string, std::vector<torch::Tensor>> parts; // values, exp_avg, exp_avg_sq: each rank's
    for (auto& shard : shards) {
      torch::serialize::InputArchive flat, state;
      shard.read("f" + std::to_string(f), flat);
      flat.read("state", state);
      for (const char* key : {"values", "exp_avg", "exp_avg_sq"}) {
        torch::Tensor part;
        (std::string(key) == "values" ? flat : state).read(key, part);
        parts[key].push_back(part.reshape({-1}));
      }
    }
    int64_t at = 0;
    for (const auto& shape : index["flats"][f]["shapes"]) {
      const auto sizes = shape.get<std::vector<int64_t>>();
      const int64_t numel = c10::multiply_integers(sizes);
      saved.values.push_back(torch::cat(parts["values"]).narrow(0, at, numel).view(sizes));
      saved.moments.push_back(torch::cat(parts["exp_avg"]).narrow(0, at, numel).view(sizes));
      saved.moments.push_back(torch::cat(parts["exp_avg_sq"]).narrow(0, at, numel).view(sizes));
      at += numel;
    }
  }
  torch::serialize::InputArchive whole;
  shards[0].read("whole", whole);
  for (size_t i = 0; i < index["whole"].size(); ++i) {
    torch::Tensor buffer;
    whole.read("w" + std::to_string(i), buffer);
    saved.values.push_back(buffer);
  }
  return saved;
}

// What a load gave: the values, Adam's moments, and the values after one
// more step.
struct Loaded {
  std::vector<torch::Tensor> once, moments, twice;
};

// The folder saved at 2 ranks loads at 1, 2 and 3 into the weights,
// optimizer state and options its files hold, bit for bit, and the next
// step is the same at every world size: bit for bit at 2 ranks, where the
// average of two equal gradients is exact, and within rounding at 3, where
// (g + g + g) / 3 is not g in about one float of seven. The fixture's
// gradients for the Linear weight are nearly zero (the sum of squares after
// BatchNorm hardly depends on it), so their low bits are rounding, which
// depends on the BLAS and the CPU, and Adam scales them to whole steps: at
// 3 ranks a bitwise check would test the averaging's rounding, not the load.
TEST(ShardedCheckpointV1, TheEarlierFormatLoadsAtAnyWorldSize) {
  const auto dir = fixture_copy("any_world");
  const auto saved = saved_in(dir);
  ASSERT_EQ(saved.values.size(), 6u); // 0.weight, 1.weight, 1.bias; BatchNorm's three buffers
  std::vector<Loaded> loads;
  for (int world : {1, 2, 3}) {
    testing::spawn(world, [&](ProcessGroup& group) {
      Net other(torch::nn::Linear(torch::nn::LinearOptions(6, 2).bias(false)), torch::nn::BatchNorm1d(2));
      FullyShardedDataParallel<Net> model(other, group);
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.5));
      load_sharded(model, adam, dir);
      Loaded loaded;
      loaded.once = values_of(model);
      EXPECT_EQ(static_cast<const torch::optim::AdamOptions&>(adam.param_groups()[0].options()).lr(), 0.1);
      torch::optim::Adam full(model->module()->parameters());
      full_optimizer_state(model, adam, full);
      loaded.moments = moments_of(model->module(), full);
      fixture_step(model, adam);
      loaded.twice = values_of(model);
      if (group.rank() == 0) {
        loads.push_back(loaded);
      }
    });
  }
  ASSERT_EQ(loads.size(), 3u);
  for (size_t w = 0; w < loads.size(); ++w) {
    const std::string at = "loaded at " + std::to_string(w + 1) + " ranks";
    expect_equal(loads[w].once, saved.values, at);
    expect_equal(loads[w].moments, saved.moments, at + ", Adam's moments");
    if (w + 1 == 3) {
      ASSERT_EQ(loads[w].twice.size(), loads[0].twice.size());
      for (size_t i = 0; i < loads[w].twice.size(); ++i) {
        EXPECT_TRUE(torch::allclose(loads[w].twice[i], loads[0].twice[i], 1e-5, 1e-7))
            << at << ", after one more step, against 1 rank, tensor " << i << ": " << loads[w].twice[i] << " vs "
            << loads[0].twice[i];
      }
    } else {
      expect_equal(loads[w].twice, loads[0].twice, at + ", after one more step, against 1 rank");
    }
  }
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(Net(torch::nn::Linear(torch::nn::LinearOptions(6, 2).bias(false)),
                                            torch::nn::BatchNorm1d(2)),
                                        group);
    load_sharded(model, dir);
    expect_equal(values_of(model), saved.values, "the weights alone");
  });
}

// The earlier format's own checks: a damaged file, shards of another save
// than the index's, an index of another format or without what a save
// writes, and a layer of another shape, each an error naming it.
TEST(ShardedCheckpointV1, TheEarlierFormatsChecksStillHold) {
  const auto load_says = [](const std::string& dir, const std::string& says, bool reshaped = false) {
    testing::spawn(2, [&](ProcessGroup& group) {
      FullyShardedDataParallel<Net> model(
          Net(torch::nn::Linear(torch::nn::LinearOptions(reshaped ? 3 : 6, reshaped ? 4 : 2).bias(false)),
              torch::nn::BatchNorm1d(2)),
          group);
      torch::optim::Adam adam(model->parameters());
      EXPECT_ERROR_SAYS(load_sharded(model, adam, dir), says.c_str());
    });
  };
  const auto damaged = fixture_copy("damaged");
  for (const char* shard : {"/shard-0-of-2.pt", "/shard-1-of-2.pt"}) { // each rank reads its own
    std::fstream file(damaged + shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(100);
    file.put('\x7f');
  }
  load_says(damaged, "-of-2.pt is damaged: its checksum does not match its content");
  const auto index_with = [](const std::string& dir, const std::string& text) {
    detail::write_checked_file(dir + "/index.json", "LOCKSTEP-SHARD\n", text, "test");
  };
  const auto mixed = fixture_copy("mixed");
  auto index = nlohmann::json::parse(std::ifstream(mixed + "/index.json").ignore(27));
  index["save_id"] = index["save_id"].get<int64_t>() + 1;
  index_with(mixed, index.dump());
  load_says(mixed, "-of-2.pt was written by another save than " + mixed + "/index.json");
  const auto format = fixture_copy("format");
  index_with(format, "{\"format\": 2, \"world_size\": 2}\n");
  load_says(format, format + "/index.json is of format 2, and this lockstep reads format 1");
  index_with(format, "{\"format\": 1}\n");
  load_says(format, format + "/index.json lacks what save_sharded writes");
  load_says(fixture_copy("reshaped"), "'s parameter 0 was '0.weight' of shape [2, 6], but here it is '0.weight' of "
            "shape [4, 3]", /*reshaped=*/true);
}

} // namespace
} // namespace sharded_v1_tests
} // namespace lockstep
