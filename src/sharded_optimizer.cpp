// The optimizer's state of a FullyShardedDataParallel's shards: reading and
// writing it for save_sharded and load_sharded, and gathering it whole for
// lockstep::full_optimizer_state.

#include "sharded_optimizer.h"

#include <lockstep/fully_sharded_data_parallel.h>

#include "sharded_state.h"
#include "torch_compat.h"

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
                          torch::optim::Optimizer& full) {
  const auto sharded_group = group_of(optimizer);
  const auto full_group = group_of(full);
  TORCH_CHECK(full.param_groups().size() == optimizer.param_groups().size(), "lockstep::full_optimizer_state: the "
              "full optimizer has ", full.param_groups().size(), " parameter groups and the sharded one ",
              optimizer.param_groups().size(), ". Make the full optimizer with the sharded one's groups, each over the "
              "module parameters whose shards are in that group.");
  for (const auto* flat : flats) {
    const auto shard = sharded_group.find(flat->shard.unsafeGetTensorImpl());
    for (size_t j = 0; j < flat->params.size(); ++j) {
      const auto held = full_group.find(flat->params[j].unsafeGetTensorImpl());
      TORCH_CHECK(held != full_group.end(), "lockstep::full_optimizer_state: parameter '", flat->names[j],
                  "' of the wrapped module is not among the full optimizer's parameters. Make the full optimizer from "
                  "model->module()->parameters(), as a bare model's optimizer is made.");
      TORCH_CHECK(shard == sharded_group.end() || shard->second == held->second, "lockstep::full_optimizer_state: "
                  "parameter '", flat->names[j], "' of the wrapped module is in the full optimizer's parameter group ",
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
  // Every rank gathers: one whose optimizers are refused must not leave the
  // others waiting in the gather (rank 0 alone saves the result, so the
  // others' full optimizer is easily an afterthought).
  on_every_rank(group_, control_device_of(group_, flats()), "full_optimizer_state", [&] {
    TORCH_CHECK(optimizer_kind(full) == optimizer_kind(optimizer), "lockstep::full_optimizer_state: the full optimizer "
                "is ", optimizer_kind(full), " but the sharded one is ", optimizer_kind(optimizer), ": its state would "
                "fill the wrong fields. Make the full optimizer of the sharded one's type.");
    new_state(optimizer, "lockstep::full_optimizer_state",
              "Its state cannot be gathered; save the model alone, under summon_full_params().");
    check_full_optimizer(flats(), optimizer, full);
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

} // namespace detail
} // namespace lockstep
