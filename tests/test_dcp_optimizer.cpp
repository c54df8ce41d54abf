// The optimizer's state in PyTorch's distributed checkpoint layout, ranks
// as threads: saved beside the weights under PyTorch's names
// (state.<parameter>.exp_avg), loaded at another world size bit for bit;
// a folder without lockstep's record, as PyTorch writes it, loads too; and
// what such a folder may get wrong is an error naming it.

#include <lockstep/lockstep.h>

#include "../src/util/torch_compat.h"

#include "support/errors.h"
#include "support/scratch.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace lockstep {
namespace dcp_optimizer_tests {
namespace {

using Net = torch::nn::Sequential;

Net bn_net() {
  return Net(torch::nn::Linear(5, 7), torch::nn::BatchNorm1d(7), torch::nn::Linear(7, 3));
}

// Adam's state for each parameter of `net`: exp_avg, exp_avg_sq, step.
struct Moments {
  std::vector<torch::Tensor> tensors;
  std::vector<int64_t> steps;
};

Moments moments_of(torch::nn::Module& net, torch::optim::Adam& adam) {
  Moments moments;
  for (const auto& p : net.parameters()) {
    const auto& state =
        static_cast<torch::optim::AdamParamState&>(*adam.state().at(detail::optimizer_state_key(adam.state(), p)));
    moments.tensors.push_back(state.exp_avg().clone());
    moments.tensors.push_back(state.exp_avg_sq().clone());
    moments.steps.push_back(state.step());
  }
  return moments;
}

// The whole state of a FullyShardedDataParallel's Adam, gathered.
template <typename Model>
Moments gathered(Model& model, torch::optim::Adam& adam) {
  torch::optim::Adam full(model->module()->parameters());
  full_optimizer_state(model, adam, full);
  return moments_of(*model->module(), full);
}

void expect_same(const Moments& got, const Moments& want, const std::string& where) {
  ASSERT_EQ(got.tensors.size(), want.tensors.size()) << where;
  for (size_t i = 0; i < got.tensors.size(); ++i) {
    EXPECT_TRUE(torch::equal(got.tensors[i], want.tensors[i])) << where << ", state tensor " << i;
  }
  EXPECT_EQ(got.steps, want.steps) << where;
}

TEST(DcpOptimizer, AdamsStateSavedAtTwoRanksLoadsAtThreeUnderPyTorchsNames) {
  const auto dir = testing::scratch("dcp_adam");
  torch::manual_seed(3);
  const auto initial = bn_net();
  const auto input = torch::randn({6, 5});
  std::vector<Net> nets;
  for (int r = 0; r < 2; ++r) {
    nets.push_back(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone()));
  }
  Moments saved;
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(nets[group.rank()], group);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01).betas({0.8, 0.9}));
    for (int step = 0; step < 2; ++step) {
      adam.zero_grad();
      model(input).pow(2).sum().backward();
      adam.step();
    }
    save_sharded(model, adam, dir);
    auto all = gathered(model, adam);
    if (group.rank() == 0) {
      saved = all;
    }
  });
  ASSERT_EQ(saved.steps, std::vector<int64_t>(6, 2));
  std::map<std::string, torch::Tensor> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".safetensors") {
      for (const auto& item : read_safetensors(entry.path().string())) {
        files[item.key()] = item.value();
      }
    }
  }
  ASSERT_TRUE(files.count("state.0.weight.exp_avg") && files.count("state.2.bias.exp_avg_sq"));
  EXPECT_EQ(files.at("state.1.weight.step").dim(), 0);
  EXPECT_EQ(files.at("state.1.weight.step").item<int64_t>(), 2);
  const auto record = nlohmann::json::parse(std::ifstream(dir + "/lockstep_save.json"));
  EXPECT_EQ(record["optimizer"]["type"], "Adam");
  EXPECT_EQ(record["optimizer"]["param_groups"][0]["lr"], 0.01);
  EXPECT_EQ(record["optimizer"]["param_groups"][0]["betas"], nlohmann::json::array({0.8, 0.9}));
  EXPECT_EQ(record["optimizer"]["param_groups"][0]["params"],
            nlohmann::json::array({"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"}));
  testing::spawn(3, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(bn_net(), group);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.5));
    load_sharded(model, adam, dir);
    expect_same(gathered(model, adam), saved, "rank " + std::to_string(group.rank()));
    const auto& options = static_cast<const torch::optim::AdamOptions&>(adam.param_groups()[0].options());
    EXPECT_EQ(options.lr(), 0.01);
    EXPECT_EQ(std::get<0>(options.betas()), 0.8);
    load_sharded(model, dir); // the weights alone: the state beside them is not unexpected
  });
}

// The state is kept by parameter name: a save whose units list a group's
// parameters in another order loads; a group of other parameters is
// refused, naming one.
TEST(DcpOptimizer, AGroupsParametersInAnotherOrderLoadAndOtherParametersAreNamed) {
  const auto dir = testing::scratch("dcp_units");
  torch::manual_seed(4);
  const auto initial = bn_net();
  Moments saved;
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone()), group,
                                        ShardingOptions().units({"0"}));
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    model(torch::randn({4, 5})).pow(2).sum().backward();
    adam.step();
    save_sharded(model, adam, dir);
    auto all = gathered(model, adam);
    if (group.rank() == 0) {
      saved = all;
    }
  });
  testing::spawn(1, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(bn_net(), group);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.5));
    load_sharded(model, adam, dir);
    expect_same(gathered(model, adam), saved, "one unit");
  });
  const auto two_groups = [](auto& model) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const auto& flat : model->parameters()) {
      groups.emplace_back(std::vector<torch::Tensor>{flat});
    }
    return groups;
  };
  const auto grouped = testing::scratch("dcp_units_groups");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(bn_net(), group, ShardingOptions().units({"0"}));
    torch::optim::Adam adam(two_groups(model), torch::optim::AdamOptions(0.01));
    save_sharded(model, adam, grouped);
    FullyShardedDataParallel<Net> other(bn_net(), group, ShardingOptions().units({"2"}));
    torch::optim::Adam other_adam(two_groups(other), torch::optim::AdamOptions(0.01));
    EXPECT_ERROR_SAYS(load_sharded(other, other_adam, grouped), "parameter group 0 held '2.bias', which this "
                      "optimizer's does not (2 saved parameters are not here, and 2 here were not saved)");
  });
}

// A folder as PyTorch's dcp.save writes an FSDP2 model's and Adam's state
// ({**model.state_dict(), "state": optimizer_state["state"]}), here one
// plain file: its state loads, with the step as float32, and the caller's
// options stay; without exp_avg_sq, Adam could not step, and it is refused.
TEST(DcpOptimizer, PyTorchsLayoutLoadsWithoutARecord) {
  const auto dir = testing::scratch("dcp_pytorch_adam");
  std::filesystem::create_directory(dir);
  torch::manual_seed(5);
  auto source = bn_net();
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  Moments want;
  for (const auto& list : {source->named_parameters(), source->named_buffers()}) {
    for (const auto& item : list) {
      tensors.insert(item.key(), item.value().detach());
    }
  }
  for (const auto& item : source->named_parameters()) {
    want.tensors.push_back(torch::randn(item.value().sizes()));
    want.tensors.push_back(torch::rand(item.value().sizes()));
    want.steps.push_back(7);
    tensors.insert("state." + item.key() + ".exp_avg", want.tensors[want.tensors.size() - 2]);
    tensors.insert("state." + item.key() + ".exp_avg_sq", want.tensors.back());
    tensors.insert("state." + item.key() + ".step", torch::tensor(7.0F));
  }
  write_safetensors(tensors, dir + "/model.safetensors");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(bn_net(), group);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.25));
    load_sharded(model, adam, dir);
    expect_same(gathered(model, adam), want, "rank " + std::to_string(group.rank()));
    EXPECT_EQ(static_cast<const torch::optim::AdamOptions&>(adam.param_groups()[0].options()).lr(), 0.25);
  });
  tensors.erase("state.2.bias.exp_avg_sq");
  write_safetensors(tensors, dir + "/model.safetensors");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(bn_net(), group);
    torch::optim::Adam adam(model->parameters());
    EXPECT_ERROR_SAYS(load_sharded(model, adam, dir), "holds optimizer state for '2.bias' (exp_avg) but not its "
                      "exp_avg_sq, which Adam with these options needs");
  });
  tensors.insert("state.2.bias.exp_avg_sq", want.tensors.back());
  tensors["state.2.bias.step"] = torch::tensor(8.0F);
  write_safetensors(tensors, dir + "/model.safetensors");
  testing::spawn(2, [&](ProcessGroup& group) {
    FullyShardedDataParallel<Net> model(bn_net(), group);
    torch::optim::Adam adam(model->parameters());
    EXPECT_ERROR_SAYS(load_sharded(model, adam, dir), "state.2.bias.step is 8 but state.2.weight.step is 7",
                      "steps the parameters of unit '2' together");
  });
}

} // namespace
} // namespace dcp_optimizer_tests
} // namespace lockstep
