// The optimizer's state of a FullyShardedDataParallel's shards: reading and
// writing it for save_sharded and load_sharded, and gathering it whole for
// lockstep::full_optimizer_state.

#include "fsdp/optimizer.h"

#include "fsdp/checkpoint_common.h"

#include <lockstep/fully_sharded_data_parallel.h>

#include "fsdp/state.h"
#include "util/torch_compat.h"

#include <map>
#include <sstream>
#include <typeinfo>
#include <unordered_map>

namespace lockstep {
namespace detail {

std::string optimizer_kind(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {
    return "AdamW";
  }
  if (dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr) {
    return "Adam";
  }
  if (dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr) {
    return "SGD";
  }
  if (dynamic_cast<torch::optim::RMSprop*>(&optimizer) != nullptr) {
    return "RMSprop";
  }
  if (dynamic_cast<torch::optim::Adagrad*>(&optimizer) != nullptr) {
    return "Adagrad";
  }
  return typeid(optimizer).name();
}

std::unique_ptr<torch::optim::OptimizerParamState> new_state(torch::optim::Optimizer& optimizer, const char* who,
                                                             const char* advice) {
  const auto kind = optimizer_kind(optimizer);
  if (kind == "AdamW") {
    return std::make_unique<torch::optim::AdamWParamState>();
  }
  if (kind == "Adam") {
    return std::make_unique<torch::optim::AdamParamState>();
  }
  if (kind == "SGD") {
    return std::make_unique<torch::optim::SGDParamState>();
  }
  if (kind == "RMSprop") {
    return std::make_unique<torch::optim::RMSpropParamState>();
  }
  if (kind == "Adagrad") {
    return std::make_unique<torch::optim::AdagradParamState>();
  }
  TORCH_CHECK(false, who, ": the optimizer (", kind, ") is not one whose state can be resharded (Adam, AdamW, SGD, "
              "RMSprop, Adagrad). ", advice);
}

torch::serialize::InputArchive readable(torch::serialize::OutputArchive& archive) {
  std::stringstream bytes;
  archive.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  return in;
}

std::shared_ptr<torch::optim::OptimizerParamState> read_state(torch::optim::Optimizer& optimizer,
                                                              torch::serialize::OutputArchive& state) {
  auto in = readable(state);
  std::shared_ptr<torch::optim::OptimizerParamState> fresh = new_state(optimizer);
  fresh->serialize(in);
  return fresh;
}

void install_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                   const std::shared_ptr<torch::optim::OptimizerParamState>& state) {
  const auto key = optimizer_state_key(optimizer.state(), param);
  if (state == nullptr) {
    optimizer.state().erase(key);
  } else {
    optimizer.state()[key] = state->clone();
  }
}

// Note [Optimizer options in a sharded checkpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch::load of an optimizer, and Python's load_state_dict, restore each
// parameter group's options with its state: a run resumed with another
// learning rate in its constructor steps at the saved one (PyTorch's
// test_zero_redundancy_optimizer.py::test_state_dict). A sharded save does
// the same: rank 0's file holds each group's options, as the optimizer's
// own serialize() writes them, and a load installs them. A save of an
// earlier lockstep has none: the caller's options stay.
void write_group_options(torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive) {
  archive.write("group_count", torch::tensor(static_cast<int64_t>(optimizer.param_groups().size())));
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    torch::serialize::OutputArchive options;
    optimizer.param_groups()[g].options().serialize(options);
    archive.write("group" + std::to_string(g), options);
  }
}

GroupOptions read_group_options(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive,
                                const std::string& file) {
  torch::Tensor count;
  if (!archive.try_read("group_count", count)) {
    return {};
  }
  const auto& groups = optimizer.param_groups();
  TORCH_CHECK(count.item<int64_t>() == static_cast<int64_t>(groups.size()), "lockstep::load_sharded: ", file,
              " holds the options of ", count.item<int64_t>(), " parameter groups, but this optimizer has ",
              groups.size(), ". Make the optimizer with the parameter groups it was saved with.");
  GroupOptions all;
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::InputArchive saved;
    archive.read("group" + std::to_string(g), saved);
    std::shared_ptr<torch::optim::OptimizerOptions> options = groups[g].options().clone();
    options->serialize(saved);
    all.push_back(std::move(options));
  }
  return all;
}

void install_group_options(torch::optim::Optimizer& optimizer, const GroupOptions& options) {
  for (size_t g = 0; g < options.size(); ++g) {
    optimizer.param_groups()[g].set_options(options[g]->clone());
  }
}

namespace {

// Which of the optimizer's parameter groups holds each of its tensors.
std::unordered_map<const void*, size_t> group_of(torch::optim::Optimizer& optimizer) {
  std::unordered_map<const void*, size_t> group;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    for (const auto& p : optimizer.param_groups()[g].params()) {
      group.emplace(p.unsafeGetTensorImpl(), g);
    }
  }
  return group;
}

// `full` holds every parameter of the wrapped module (or its state would be
// set but never used), each in the group
// whose index its shard has in `optimizer`, so that the groups' options
// (lr, betas, weight decay) can be copied across: a full optimizer made
// with its own options would save those, and a bare optimizer on 2.x
// would load them over its own.
void check_full_optimizer(const std::vector<FlatParam*>& flats, torch::optim::Optimizer& optimizer,
                          torch::optim::Optimizer& full, const std::string& who) {
  const auto sharded_group = group_of(optimizer);
  const auto full_group = group_of(full);
  TORCH_CHECK(full.param_groups().size() == optimizer.param_groups().size(), who, ": the full optimizer has ", full.param_groups().size(), " parameter groups and the sharded one ",
              optimizer.param_groups().size(), ". Make the full optimizer with the sharded one's groups, each over the "
              "module parameters whose shards are in that group.");
  for (const auto* flat : flats) {
    const auto shard = sharded_group.find(flat->shard.unsafeGetTensorImpl());
    for (size_t j = 0; j < flat->params.size(); ++j) {
      const auto held = full_group.find(flat->params[j].unsafeGetTensorImpl());
      TORCH_CHECK(held != full_group.end(), who, ": parameter '", flat->names[j],
                  "' of the wrapped module is not among the full optimizer's parameters. Make the full optimizer from "
                  "model->module()->parameters(), as a bare model's optimizer is made.");
      TORCH_CHECK(shard == sharded_group.end() || shard->second == held->second, who, ": parameter '", flat->names[j], "' of the wrapped module is in the full optimizer's parameter group ",
                  held->second, " but its shard is in the sharded optimizer's group ", shard->second, ". Make the full "
                  "optimizer with the sharded one's groups, in the same order.");
    }
  }
}

} // namespace

// Note [Full optimizer state]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each state tensor with the shard's element count (Adam's exp_avg, SGD's
// momentum) is all-gathered into the padded whole and cut into the
// parameters' shapes; other entries (Adam's step) are the same on every
// rank and are copied. The result is keyed by the wrapped module's
// parameters, so the full optimizer serializes as a bare model's does;
// each parameter group takes the sharded group's options (its current lr).
void ShardedCore::full_optimizer_state(torch::optim::Optimizer& optimizer, torch::optim::Optimizer& full) const {
  CollectiveTag tag(model_tag(state_->model, 0)); // Note [Collective tags]: two models' calls never pair
  // Every rank gathers: one whose optimizers are refused must not leave the
  // others waiting in the gather (rank 0 alone saves the result, so the
  // others' full optimizer is easily an afterthought).
  on_every_rank(group_, control_device_of(group_, flats()), "full_optimizer_state", [&] {
    TORCH_CHECK(optimizer_kind(full) == optimizer_kind(optimizer), "lockstep::full_optimizer_state: the full optimizer "
                "is ", optimizer_kind(full), " but the sharded one is ", optimizer_kind(optimizer), ": its state would "
                "fill the wrong fields. Make the full optimizer of the sharded one's type.");
    new_state(optimizer, "lockstep::full_optimizer_state",
              "Its state cannot be gathered; save the model alone, under summon_full_params().");
    check_full_optimizer(flats(), optimizer, full, "lockstep::full_optimizer_state");
  }, "says which optimizer or parameter is wrong");
  for (size_t g = 0; g < full.param_groups().size(); ++g) {
    full.param_groups()[g].set_options(optimizer.param_groups()[g].options().clone());
  }
  for (const auto* flat : flats()) {
    auto it = optimizer.state().find(optimizer_state_key(optimizer.state(), flat->shard));
    if (it == optimizer.state().end()) {
      continue; // before the first step, on every rank alike
    }
    torch::serialize::OutputArchive mine;
    it->second->serialize(mine);
    auto saved = readable(mine);
    std::vector<std::pair<std::string, torch::Tensor>> gathered; // the whole flat, or as it is
    std::vector<std::pair<std::string, c10::IValue>> values;
    for (const auto& key : saved.keys()) {
      torch::Tensor tensor;
      if (saved.try_read(key, tensor) && tensor.numel() == flat->layout.shard) {
        auto whole = tensor.reshape({-1});
        if (sharded()) {
          whole = torch::empty({flat->layout.padded}, tensor.options());
          group_.all_gather_into_async(whole, tensor.reshape({-1}).contiguous(), "full_optimizer_state")->wait();
        }
        gathered.emplace_back(key, whole);
      } else if (tensor.defined()) {
        values.emplace_back(key, tensor);
      } else {
        c10::IValue value;
        saved.read(key, value);
        values.emplace_back(key, value);
      }
    }
    for (size_t j = 0; j < flat->params.size(); ++j) {
      torch::serialize::OutputArchive state;
      const int64_t numel = c10::multiply_integers(flat->shapes[j]);
      for (const auto& [key, whole] : gathered) {
        state.write(key, whole.narrow(0, flat->offsets[j], numel).view(flat->shapes[j]).clone());
      }
      for (const auto& [key, value] : values) {
        state.write(key, value);
      }
      install_state(full, flat->params[j], read_state(full, state));
    }
  }
}

// Note [Full optimizer state], the other way: each state tensor of a
// parameter's own shape is laid out as the flat parameter lays out the
// parameters, padded, and this rank's range is cut out of it; other entries
// (Adam's step) come from the flat's first parameter with state. A flat
// none of whose parameters has state gets none (saved before the first
// step). No collective but the checks' agreement: every rank holds `full`.
void ShardedCore::shard_full_optimizer_state(torch::optim::Optimizer& full, torch::optim::Optimizer& optimizer) {
  const char* who = "lockstep::shard_full_optimizer_state";
  on_every_rank(group_, control_device_of(group_, flats()), "shard_full_optimizer_state", [&] {
    TORCH_CHECK(optimizer_kind(full) == optimizer_kind(optimizer), who, ": the full optimizer is ",
                optimizer_kind(full), " but the sharded one is ", optimizer_kind(optimizer), ": its state would fill "
                "the wrong fields. Make the sharded optimizer of the full one's type.");
    new_state(optimizer, who, "Its state cannot be sharded; load the model alone, under summon_full_params().");
    check_full_optimizer(flats(), optimizer, full, who);
  }, "says which optimizer or parameter is wrong");
  for (size_t g = 0; g < full.param_groups().size(); ++g) {
    optimizer.param_groups()[g].set_options(full.param_groups()[g].options().clone());
  }
  for (const auto* flat : flats()) {
    std::map<std::string, torch::Tensor> wholes;
    torch::serialize::OutputArchive state;
    bool found = false;
    for (size_t j = 0; j < flat->params.size(); ++j) {
      auto it = full.state().find(optimizer_state_key(full.state(), flat->params[j]));
      if (it == full.state().end()) {
        continue;
      }
      torch::serialize::OutputArchive mine;
      it->second->serialize(mine);
      auto saved = readable(mine);
      const int64_t numel = c10::multiply_integers(flat->shapes[j]);
      for (const auto& key : saved.keys()) {
        torch::Tensor tensor;
        if (saved.try_read(key, tensor) && tensor.numel() == numel) {
          auto& whole = wholes[key];
          if (!whole.defined()) {
            whole = torch::zeros({flat->layout.padded}, tensor.options().device(flat->shard.device()));
          }
          whole.narrow(0, flat->offsets[j], numel).copy_(tensor.reshape({-1}));
        } else if (!found) {
          c10::IValue value;
          saved.read(key, value);
          state.write(key, value);
        }
      }
      found = true;
    }
    if (!found) {
      continue;
    }
    const int64_t start = sharded() ? group_.rank() * flat->layout.shard : 0;
    for (const auto& [key, whole] : wholes) {
      state.write(key, whole.narrow(0, start, flat->layout.shard).clone());
    }
    install_state(optimizer, flat->shard, read_state(optimizer, state));
  }
}

} // namespace detail
} // namespace lockstep
