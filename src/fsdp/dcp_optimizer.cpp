// A FullyShardedDataParallel optimizer's state in PyTorch's distributed
// checkpoint layout: written beside the weights by
// save_sharded(model, optimizer, dir) and read by load_sharded, at any
// world size, from lockstep's folders and from PyTorch's.

#include "fsdp/dcp_optimizer.h"

#include "fsdp/flat_boxes.h"
#include "util/torch_compat.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <map>
#include <unordered_map>

namespace lockstep {
namespace detail {

// Note [Optimizer state in the DCP layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch's get_optimizer_state_dict keys the state by the parameters'
// names, and dcp.save flattens it to state.<name>.<key>: state.0.weight.
// exp_avg. A state tensor laid out as the flat shard (Adam's exp_avg, SGD's
// momentum_buffer) is cut into the same boxes as the shard's weights and
// saved under those names, so that Python's dcp.load reads it into an
// optimizer of a plain module or of FSDP2, at any world size. The step
// count, one per flat shard here, one per parameter there, is saved for
// each parameter by rank 0 as a 0-d int64 tensor state.<name>.step
// (PyTorch's own is float32, which counts exactly only to 2^24; dcp.load
// converts it). What is not a tensor, the optimizer's type and each
// parameter group's options with its parameters' names, as PyTorch's
// param_groups hold them, goes in lockstep_save.json under "optimizer": the
// layout has no place for it (PyTorch's writer puts such values in front of
// a file's header, which no reader can then open). A load reads each
// parameter's state where the folder has it, zeros for a parameter that
// has none beside one that has (PyTorch's optimizer keeps no state for a
// parameter that never had a gradient), and the step that they all share.

namespace {

constexpr char kStep[] = "step";

using ParamState = std::shared_ptr<torch::optim::OptimizerParamState>;

// The state keys an optimizer with these options needs to step without
// making them: its step reads them.
std::vector<std::string> required_keys(const torch::optim::OptimizerOptions& options) {
  if (const auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    return adam->amsgrad() ? std::vector<std::string>{kStep, "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
                           : std::vector<std::string>{kStep, "exp_avg", "exp_avg_sq"};
  }
  if (const auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    return adamw->amsgrad() ? std::vector<std::string>{kStep, "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
                            : std::vector<std::string>{kStep, "exp_avg", "exp_avg_sq"};
  }
  if (const auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    return sgd->momentum() != 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  }
  if (const auto* rmsprop = dynamic_cast<const torch::optim::RMSpropOptions*>(&options)) {
    std::vector<std::string> keys{kStep, "square_avg"};
    if (rmsprop->momentum() > 0) {
      keys.emplace_back("momentum_buffer");
    }
    if (rmsprop->centered()) {
      keys.emplace_back("grad_avg");
    }
    return keys;
  }
  return {kStep, "sum"}; // Adagrad; new_state refuses the others first
}

// The group each of the optimizer's tensors is in.
std::unordered_map<const void*, size_t> group_index(torch::optim::Optimizer& optimizer) {
  std::unordered_map<const void*, size_t> group;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    for (const auto& p : optimizer.param_groups()[g].params()) {
      group.emplace(p.unsafeGetTensorImpl(), g);
    }
  }
  return group;
}

// Each parameter group's parameters, by the wrapped module's names (the
// flat shards' parameters), as PyTorch's param_groups list them.
std::vector<std::vector<std::string>> group_names(torch::optim::Optimizer& optimizer,
                                                  const std::vector<FlatParam*>& flats, const char* who) {
  std::unordered_map<const void*, const FlatParam*> flat_of;
  for (const auto* flat : flats) {
    flat_of.emplace(flat->shard.unsafeGetTensorImpl(), flat);
  }
  std::vector<std::vector<std::string>> names(optimizer.param_groups().size());
  for (size_t g = 0; g < names.size(); ++g) {
    for (const auto& p : optimizer.param_groups()[g].params()) {
      const auto flat = flat_of.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(flat != flat_of.end(), who, ": parameter group ", g, " of the optimizer holds a tensor of shape ",
                  p.sizes(), " that is not one of the model's shards. Make the optimizer from model->parameters().");
      names[g].insert(names[g].end(), flat->second->names.begin(), flat->second->names.end());
    }
  }
  return names;
}

nlohmann::json json_of(const c10::IValue& value, const std::string& key) {
  if (value.isDouble()) {
    return value.toDouble();
  }
  if (value.isInt()) {
    return value.toInt();
  }
  if (value.isBool()) {
    return value.toBool();
  }
  if (value.isNone()) {
    return nullptr;
  }
  TORCH_CHECK(value.isTuple(), "lockstep::save_sharded: the optimizer's option '", key, "' is a ", value.tagKind(),
              ", which the checkpoint's record cannot hold.");
  nlohmann::json items = nlohmann::json::array();
  for (const auto& item : value.toTupleRef().elements()) {
    items.push_back(json_of(item, key));
  }
  return items;
}

c10::IValue ivalue_of(const nlohmann::json& value) {
  if (value.is_number_float()) {
    return value.get<double>();
  }
  if (value.is_number_integer()) {
    return value.get<int64_t>();
  }
  if (value.is_boolean()) {
    return value.get<bool>();
  }
  if (value.is_array()) { // betas
    std::vector<c10::IValue> items;
    for (const auto& item : value) {
      items.push_back(ivalue_of(item));
    }
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return c10::IValue();
}

nlohmann::json options_json(const torch::optim::OptimizerOptions& options) {
  torch::serialize::OutputArchive archive;
  options.serialize(archive);
  auto saved = readable(archive);
  nlohmann::json json = nlohmann::json::object();
  for (const auto& key : saved.keys()) {
    c10::IValue value;
    saved.read(key, value);
    json[key] = json_of(value, key);
  }
  return json;
}

} // namespace

std::string optimizer_state_name(const std::string& parameter, const std::string& key) {
  return "state." + parameter + "." + key;
}

bool is_optimizer_state_name(const std::string& name, const std::vector<std::string>& parameters) {
  const auto dot = name.rfind('.');
  return name.compare(0, 6, "state.") == 0 && dot != std::string::npos && dot > 6 &&
      std::find(parameters.begin(), parameters.end(), name.substr(6, dot - 6)) != parameters.end();
}

std::vector<BoxSource> optimizer_state_boxes(torch::optim::Optimizer& optimizer, const std::vector<FlatParam*>& flats,
                                             int rank, bool sharded) {
  std::vector<BoxSource> boxes;
  for (const auto* flat : flats) {
    const auto it = optimizer.state().find(optimizer_state_key(optimizer.state(), flat->shard));
    if (it == optimizer.state().end()) {
      continue; // before the first step, on every rank alike
    }
    torch::serialize::OutputArchive archive;
    it->second->serialize(archive);
    auto saved = readable(archive);
    for (const auto& key : saved.keys()) {
      c10::IValue value;
      saved.read(key, value);
      if (value.isTensor() && value.toTensor().numel() == flat->layout.shard) {
        auto more = shard_boxes_of(*flat, value.toTensor(), rank, sharded,
                                   [&](size_t j) { return optimizer_state_name(flat->names[j], key); });
        boxes.insert(boxes.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
      } else if (value.isInt() && rank == 0) {
        const auto count = torch::tensor(value.toInt(), torch::kLong);
        for (const auto& name : flat->names) {
          boxes.push_back({optimizer_state_name(name, key), torch::kLong, whole_box(count), [count] { return count; }});
        }
      } else {
        TORCH_CHECK(value.isInt() || value.isNone(), "lockstep::save_sharded: the optimizer's state '", key,
                    "' for '", flat->names.front(), "' is neither a tensor of its shard's size nor a count, and has "
                    "no place in the checkpoint.");
      }
    }
  }
  return boxes;
}

nlohmann::json optimizer_record(torch::optim::Optimizer& optimizer, const std::vector<FlatParam*>& flats) {
  const auto names = group_names(optimizer, flats, "lockstep::save_sharded");
  nlohmann::json groups = nlohmann::json::array();
  for (size_t g = 0; g < names.size(); ++g) {
    auto group = options_json(optimizer.param_groups()[g].options());
    group["params"] = names[g];
    groups.push_back(std::move(group));
  }
  return {{"optimizer", {{"type", optimizer_kind(optimizer)}, {"param_groups", std::move(groups)}}}};
}

namespace {

// The state is kept by parameter name, so a group's parameters may come in
// another order (the flats of other units list them in another).
void check_same_parameters(std::vector<std::string> saved, std::vector<std::string> here, size_t group,
                           const std::string& where) {
  std::sort(saved.begin(), saved.end());
  std::sort(here.begin(), here.end());
  std::vector<std::string> only_saved, only_here;
  std::set_difference(saved.begin(), saved.end(), here.begin(), here.end(), std::back_inserter(only_saved));
  std::set_difference(here.begin(), here.end(), saved.begin(), saved.end(), std::back_inserter(only_here));
  TORCH_CHECK(only_saved.empty() && only_here.empty(), where, ": parameter group ", group, " ",
              only_saved.empty() ? "did not hold '" + only_here.front() + "', which this optimizer's does"
                                 : "held '" + only_saved.front() + "', which this optimizer's does not",
              " (", only_saved.size(), " saved parameters are not here, and ", only_here.size(), " here were not "
              "saved). Make the optimizer with the parameter groups it was saved with.");
}

// Each group's options as the record holds them, checked against this
// optimizer's groups (Note [Optimizer options in a sharded checkpoint]).
GroupOptions recorded_options(torch::optim::Optimizer& optimizer, const nlohmann::json& saved,
                              const std::vector<FlatParam*>& flats, const std::string& where) {
  const auto names = group_names(optimizer, flats, "lockstep::load_sharded");
  GroupOptions all;
  try {
    const auto& groups = saved.at("param_groups");
    TORCH_CHECK(groups.size() == names.size(), where, " holds the options of ", groups.size(), " parameter groups, "
                "but this optimizer has ", names.size(), ". Make the optimizer with the parameter groups it was saved "
                "with.");
    for (size_t g = 0; g < names.size(); ++g) {
      check_same_parameters(groups[g].at("params").get<std::vector<std::string>>(), names[g], g, where);
      torch::serialize::OutputArchive archive;
      for (const auto& [key, value] : groups[g].items()) {
        if (key != "params") {
          archive.write(key, ivalue_of(value));
        }
      }
      auto in = readable(archive);
      std::shared_ptr<torch::optim::OptimizerOptions> options = optimizer.param_groups()[g].options().clone();
      options->serialize(in);
      all.push_back(std::move(options));
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, where, ": its \"optimizer\" is damaged (", e.what(), "). Load an earlier checkpoint.");
  }
  return all;
}

// Which state keys the checkpoint holds, and for which of `flat`'s parameters.
std::map<std::string, std::vector<bool>> held_keys(const DcpCheckpoint& checkpoint, const FlatParam& flat) {
  std::map<std::string, std::vector<bool>> held;
  for (size_t j = 0; j < flat.names.size(); ++j) {
    const auto prefix = optimizer_state_name(flat.names[j], "");
    for (auto it = checkpoint.shapes.lower_bound(prefix);
         it != checkpoint.shapes.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
      const auto key = it->first.substr(prefix.size());
      if (key.find('.') == std::string::npos) { // not a deeper parameter's ("state.a.b.exp_avg" beside "a")
        held[key].resize(flat.names.size());
        held[key][j] = true;
      }
    }
  }
  return held;
}

// The step count that the parameters of `flat` share.
int64_t read_step(const DcpCheckpoint& checkpoint, const FlatParam& flat, const std::vector<bool>& which) {
  std::optional<double> step;
  std::string first;
  for (size_t j = 0; j < which.size(); ++j) {
    if (!which[j]) {
      continue;
    }
    const auto name = optimizer_state_name(flat.names[j], kStep);
    TORCH_CHECK(checkpoint.shapes.at(name).empty(), checkpoint.dir, ": ", name, " is of shape ",
                c10::IntArrayRef(checkpoint.shapes.at(name)), "; a step count is a single number.");
    auto value = torch::zeros({}, torch::kDouble);
    read_box(checkpoint, name, Box{}, value);
    const double count = value.item<double>();
    TORCH_CHECK(count >= 0 && std::floor(count) == count, checkpoint.dir, ": ", name, " is ", count,
                ", not a step count.");
    TORCH_CHECK(!step || *step == count, checkpoint.dir, ": ", name, " is ", count, " but ", first, " is ", *step,
                ". Lockstep steps the parameters of unit '", flat.unit, "' together; load the weights alone "
                "(load_sharded(model, dir)), or make that unit's parameters share a step.");
    step = count;
    first = name;
  }
  return static_cast<int64_t>(*step);
}

// The optimizer's state for shard index `rank`'s range of `flat`; nullptr
// where the checkpoint has none for any of its parameters.
ParamState stage_flat_state(torch::optim::Optimizer& optimizer, const DcpCheckpoint& checkpoint, const FlatParam& flat,
                            int rank, const torch::optim::OptimizerOptions& options) {
  const auto held = held_keys(checkpoint, flat);
  if (held.empty()) {
    return nullptr;
  }
  for (size_t j = 0; j < flat.names.size(); ++j) {
    const auto has = std::find_if(held.begin(), held.end(), [&](const auto& key) { return key.second[j]; });
    for (const auto& key : required_keys(options)) {
      const auto found = held.find(key);
      TORCH_CHECK(has == held.end() || (found != held.end() && found->second[j]), checkpoint.dir,
                  " holds optimizer state for '", flat.names[j], "' (", has->first, ") but not its ", key, ", which ",
                  optimizer_kind(optimizer), " with these options needs. Load it with the optimizer and options that "
                  "saved it, or load the weights alone (load_sharded(model, dir)).");
    }
  }
  torch::serialize::OutputArchive state;
  const int64_t begin = std::min(rank * flat.layout.shard, flat.layout.numel);
  const int64_t end = std::min(begin + flat.layout.shard, flat.layout.numel);
  for (const auto& [key, which] : held) {
    if (key == kStep) {
      state.write(key, c10::IValue(read_step(checkpoint, flat, which)));
      continue;
    }
    for (size_t j = 0; j < which.size(); ++j) {
      const auto name = optimizer_state_name(flat.names[j], key);
      TORCH_CHECK(!which[j] || checkpoint.shapes.at(name) == flat.shapes[j], checkpoint.dir, ": ", name, " is of shape ",
                  c10::IntArrayRef(checkpoint.shapes.at(name)), ", but its parameter's is ",
                  c10::IntArrayRef(flat.shapes[j]), ". Load it into the model that saved it.");
    }
    auto values = torch::zeros({flat.layout.shard}, flat.shard.options().device(torch::kCPU));
    for_each_box(flat, begin, end, [&](size_t j, const Box& box, int64_t at) {
      if (which[j]) {
        read_box(checkpoint, optimizer_state_name(flat.names[j], key), box,
                 values.narrow(0, at, box.numel()).view(box.sizes));
      }
    });
    state.write(key, values.to(flat.shard.device()));
  }
  return read_state(optimizer, state);
}

} // namespace

StagedOptimizer stage_optimizer_load(torch::optim::Optimizer& optimizer, const DcpCheckpoint& checkpoint,
                                     const std::vector<FlatParam*>& flats, int rank) {
  new_state(optimizer); // the types whose state can be resharded
  StagedOptimizer staged;
  const auto& record = checkpoint.record;
  if (record.is_object() && record.contains("optimizer")) {
    const std::string where = checkpoint.dir + "/" + kDcpSaveRecord;
    const auto saved_kind = record["optimizer"].value("type", std::string());
    TORCH_CHECK(saved_kind == optimizer_kind(optimizer), "lockstep::load_sharded: ", where, " holds the state of ",
                saved_kind, ", but this optimizer is ", optimizer_kind(optimizer), ": that state would fill the wrong "
                "fields. Load it with ", saved_kind, ".");
    staged.groups = recorded_options(optimizer, record["optimizer"], flats, where);
  }
  const auto group = group_index(optimizer);
  for (const auto* flat : flats) {
    const auto g = group.find(flat->shard.unsafeGetTensorImpl());
    TORCH_CHECK(g != group.end(), "lockstep::load_sharded: the shard of unit '", flat->unit, "' is not among the "
                "optimizer's parameters. Make the optimizer from model->parameters().");
    const auto& options = staged.groups.empty() ? optimizer.param_groups()[g->second].options() : *staged.groups[g->second];
    staged.states.emplace_back(flat->shard, stage_flat_state(optimizer, checkpoint, *flat, rank, options));
  }
  return staged;
}

void install_optimizer(torch::optim::Optimizer& optimizer, const StagedOptimizer& staged) {
  for (const auto& [shard, state] : staged.states) {
    install_state(optimizer, shard, state);
  }
  install_group_options(optimizer, staged.groups);
}

} // namespace detail
} // namespace lockstep
