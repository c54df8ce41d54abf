// lockstep::save_sharded and load_sharded: a FullyShardedDataParallel's
// weights, and its optimizer's state (src/fsdp/dcp_optimizer.cpp), as
// PyTorch's distributed checkpoint writes them with
// HuggingFaceStorageWriter(dir, save_distributed=True) (src/io/dcp_hf.h), so
// that Python's dcp.load reads them at any world size, and a folder that
// FSDP2 wrote loads here at any other. Folders in lockstep's earlier format
// load by src/fsdp/checkpoint_v1.cpp.

#include "fsdp/checkpoint_common.h"
#include "fsdp/dcp_optimizer.h"
#include "fsdp/flat_boxes.h"
#include "fsdp/optimizer.h"
#include "fsdp/state.h"
#include "io/dcp_hf.h"

#include <c10/util/accumulate.h>
#include <torch/utils.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

namespace lockstep {
namespace detail {

std::vector<BoxSource> ShardedCore::State::shard_boxes() const {
  std::vector<BoxSource> boxes;
  const int rank = group.rank();
  for (const auto& flat : flats) {
    auto more = shard_boxes_of(flat, flat.shard, rank, sharded(), [&](size_t j) { return flat.names[j]; });
    boxes.insert(boxes.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  }
  if (rank == 0) {
    for (const auto& [name, tensor] : whole) {
      boxes.push_back({name, tensor.scalar_type(), whole_box(tensor), [t = tensor] { return host_bytes(t); }});
    }
  }
  for (const auto& [alias, first] : aliases) { // Note [Tied parameters in checkpoints]
    const auto [f, j] = locate(first);
    if (f == kNone) {
      const auto& tensor = whole[j].second;
      if (rank == 0) {
        boxes.push_back({alias, tensor.scalar_type(), whole_box(tensor), [tensor] { return host_bytes(tensor); }});
      }
      continue;
    }
    const auto& flat = flats[f];
    for (auto& box : shard_boxes_of(flat, flat.shard, rank, sharded(), [&](size_t k) { return flat.names[k]; })) {
      if (box.name == first) {
        box.name = alias;
        boxes.push_back(std::move(box));
      }
    }
  }
  return boxes;
}

namespace {

// Note [A save into folders that differ]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Ranks on several nodes that save to a path on each node's own disk write
// a checkpoint that no load can read as it stands: rank 0's record lists
// every rank's files, and each folder holds its own rank's alone. Saving to
// local disks and gathering the files afterwards is a deliberate workflow
// (a fast local disk, then a copy to shared storage), so rank 0 warns,
// naming what it cannot see, rather than failing the save.
void warn_of_unseen_files(const std::string& dir, const std::vector<std::string>& files, const std::string& who) {
  std::vector<std::string> unseen;
  for (const auto& file : files) {
    std::error_code error; // a file that cannot be looked at counts as seen: only one that is not there is said
    if (!std::filesystem::exists(std::filesystem::path(dir) / file, error) && !error) {
      unseen.push_back(file);
    }
  }
  if (!unseen.empty()) {
    TORCH_WARN(who, ": rank 0 does not see ", unseen.size(), " of the ", files.size(), " files the ranks wrote (the "
               "first: ", unseen.front(), "), so the ranks' folders differ, as on disks of each node's own. "
               "load_sharded reads every file from one folder: copy each rank's files into ", dir, " before loading, "
               "or save to storage that every node shares.");
  }
}

} // namespace

int64_t ShardedCore::save_sharded(torch::optim::Optimizer* optimizer, const std::string& dir) const {
  auto& s = *state_;
  CollectiveTag tag(model_tag(s.model, 0)); // Note [Collective tags]: two models' calls never pair
  TORCH_CHECK(!s.summoned, s.where(), "save_sharded() inside summon_full_params(): the shards take the guard's edits "
              "only when it ends, so the checkpoint would hold the parameters as they were before it beside buffers "
              "and frozen parameters as they are now. End the guard first.");
  const std::string who = s.where() + "save_sharded(" + dir + ")";
  const auto device = control_device_of(group_, flats());
  const int rank = group_.rank();
  nlohmann::json more = nlohmann::json::object();
  on_every_rank(group_, device, "save_sharded of " + dir, [&] {
    if (optimizer != nullptr) { // a checkpoint that no load could read is refused before anything is removed
      new_state(*optimizer, "lockstep::save_sharded");
      more = optimizer_record(*optimizer, flats());
    }
    check_no_other_checkpoint(dir, who);
  });
  on_every_rank(group_, device, "save_sharded of " + dir, [&] { clear_dcp_save(dir, rank, group_.size(), who); });
  const int64_t id = new_save_id(group_, device);
  std::vector<std::string> files;
  on_every_rank(group_, device, "save_sharded of " + dir, [&] {
    auto boxes = s.shard_boxes();
    if (optimizer != nullptr) {
      auto state = optimizer_state_boxes(*optimizer, flats(), rank, sharded());
      boxes.insert(boxes.end(), std::make_move_iterator(state.begin()), std::make_move_iterator(state.end()));
    }
    files = write_dcp_boxes(dir, rank, boxes, {{"lockstep_save_id", std::to_string(id)}}, who);
  });
  auto counts = torch::zeros({group_.size()}, torch::kLong);
  counts[rank] = static_cast<int64_t>(files.size());
  counts = counts.to(device);
  group_.allreduce(counts, ReduceOp::Sum);
  counts = counts.cpu();
  on_every_rank(group_, device, "save_sharded of " + dir, [&] {
    if (rank != 0) {
      return;
    }
    std::vector<std::string> all;
    for (int r = 0; r < group_.size(); ++r) {
      const auto n = static_cast<size_t>(counts[r].item<int64_t>());
      for (size_t k = 0; k < n; ++k) {
        all.push_back(dcp_file_name(r, k, n));
      }
    }
    warn_of_unseen_files(dir, all, who);
    write_dcp_save_record(dir, std::to_string(id), all, more, who);
  });
  return id;
}

namespace {

// The id lockstep's record gives the save; 0 for a folder PyTorch wrote.
int64_t save_id_of(const DcpCheckpoint& checkpoint) {
  if (!checkpoint.record.is_object()) {
    return 0;
  }
  const auto id = checkpoint.record.value("lockstep_save_id", std::string());
  try {
    return std::stoll(id);
  } catch (const std::exception&) {
    TORCH_CHECK(false, checkpoint.dir, "/", kDcpSaveRecord, ": the save id \"", id, "\" is not a number. Load an "
                "earlier checkpoint, or save again.");
  }
}

} // namespace

// Note [Loading between forward and backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Inside summon_full_params the guard's end would copy the summoned values
// over what was loaded (writeback), or leave the module's parameters at the
// old ones until then: an error. After a forward whose backward has not
// come, the load is allowed (the forward may have been a prediction whose
// graph was dropped), but what the forward gathered is forgotten, so that
// the next forward gathers the loaded values, and a backward of that
// forward, which would give the loaded parameters gradients computed at
// the old ones, is an error (ShardedCore::State::refuse_unforwarded).
// summon_full_params() after such a forward does the same (a validation
// forward in grad mode, then a full checkpoint): its guard may write
// edits back.
void ShardedCore::load_sharded(torch::optim::Optimizer* optimizer, const std::string& dir,
                               std::optional<int64_t> expected_save_id) {
  auto& s = *state_;
  CollectiveTag tag(model_tag(s.model, 0)); // Note [Collective tags]: two models' calls never pair
  TORCH_CHECK(!s.summoned, s.where(), "load_sharded() inside summon_full_params(): the guard's end would overwrite "
              "(writeback) or hide what it loads. End the guard first.");
  const auto device = control_device_of(group_, flats());
  if (is_lockstep_v1_folder_on_every_rank(group_, device, dir)) {
    load_sharded_v1(optimizer, dir, expected_save_id);
    return;
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  StagedOptimizer staged;
  int64_t save_id = 0;
  on_every_rank(group_, device, "load_sharded of " + dir, [&] {
    const auto checkpoint = open_dcp_save(dir);
    save_id = save_id_of(checkpoint);
    TORCH_CHECK(!expected_save_id || save_id == *expected_save_id, "lockstep::load_sharded: ", dir, " holds save ",
                save_id, ", not save ", *expected_save_id, " that the caller names: the folder was written by "
                "another save (another run's folder, or one written over since). Load the folder that this save "
                "wrote, or start from scratch.");
    copies = s.stage_dcp_load(checkpoint);
    if (optimizer != nullptr) {
      staged = stage_optimizer_load(*optimizer, checkpoint, flats(), sharded() ? group_.rank() : 0);
    }
  });
  check_same_save(group_, device, save_id, dir);
  s.drop_forward("load_sharded()");
  torch::NoGradGuard no_grad;
  for (const auto& [live, loaded] : copies) {
    live.detach().copy_(loaded);
  }
  if (optimizer != nullptr) {
    install_optimizer(*optimizer, staged);
  }
}

namespace {

// Missing names, unexpected ones, then shapes and dtypes, as
// load_safetensors checks them; the optimizer's state beside the weights
// (state.<name>.<key>) is not unexpected.
void check_covers(const DcpCheckpoint& checkpoint, const std::vector<std::string>& names,
                  const std::vector<std::vector<int64_t>>& shapes, const std::vector<torch::ScalarType>& dtypes) {
  std::string missing, unexpected, errors;
  const auto list = [](std::string& names, const std::string& name) {
    names += (names.empty() ? "\"" : ", \"") + name + "\"";
  };
  for (size_t i = 0; i < names.size(); ++i) {
    const auto shape = checkpoint.shapes.find(names[i]);
    if (shape == checkpoint.shapes.end()) {
      list(missing, names[i]);
    } else if (shape->second != shapes[i]) {
      errors += "\n\tsize mismatch for " + names[i] + ": the checkpoint's is " + c10::str(c10::IntArrayRef(shape->second)) +
          ", the model's " + c10::str(c10::IntArrayRef(shapes[i])) + ".";
    } else if (checkpoint.dtypes.at(names[i]) != dtypes[i]) {
      errors += "\n\tdtype mismatch for " + names[i] + ": the checkpoint has " +
          c10::toString(checkpoint.dtypes.at(names[i])) + ", the model " + c10::toString(dtypes[i]) + ".";
    }
  }
  for (const auto& [name, shape] : checkpoint.shapes) {
    if (std::find(names.begin(), names.end(), name) == names.end() && !is_optimizer_state_name(name, names)) {
      list(unexpected, name);
    }
  }
  if (!unexpected.empty()) {
    errors = "\n\tUnexpected key(s) in the checkpoint: " + unexpected + "." + errors;
  }
  if (!missing.empty()) {
    errors = "\n\tMissing key(s) in the checkpoint: " + missing + "." + errors;
  }
  TORCH_CHECK(errors.empty(), "Error(s) in loading ", checkpoint.dir, " (nothing was loaded):", errors);
}

} // namespace

// This rank's new shards, read box by box from the checkpoint, and the
// whole tensors: checked, not yet copied in.
std::vector<std::pair<torch::Tensor, torch::Tensor>> ShardedCore::State::stage_dcp_load(
    const DcpCheckpoint& checkpoint) const {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<torch::ScalarType> dtypes;
  for (const auto& flat : flats) {
    names.insert(names.end(), flat.names.begin(), flat.names.end());
    shapes.insert(shapes.end(), flat.shapes.begin(), flat.shapes.end());
    dtypes.insert(dtypes.end(), flat.names.size(), flat.dtype);
  }
  for (const auto& [name, tensor] : whole) {
    names.push_back(name);
    shapes.push_back(tensor.sizes().vec());
    dtypes.push_back(tensor.scalar_type());
  }
  // Note [Tied parameters in checkpoints]: another name is checked where the
  // checkpoint has it, and read where the checkpoint lacks the first.
  std::map<std::string, std::string> read_from;
  for (const auto& [alias, first] : aliases) {
    if (checkpoint.shapes.count(alias) != 0) {
      const auto i = static_cast<size_t>(std::find(names.begin(), names.end(), first) - names.begin());
      TORCH_INTERNAL_ASSERT(i < names.size());
      if (checkpoint.shapes.count(first) == 0 && read_from.count(first) == 0) {
        read_from[first] = alias;
        names[i] = alias;
        continue;
      }
      names.push_back(alias);
      shapes.push_back(shapes[i]);
      dtypes.push_back(dtypes[i]);
    }
  }
  check_covers(checkpoint, names, shapes, dtypes);
  const auto source = [&](const std::string& name) -> const std::string& {
    const auto found = read_from.find(name);
    return found == read_from.end() ? name : found->second;
  };
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  const int rank = sharded() ? group.rank() : 0;
  for (const auto& flat : flats) {
    auto shard = flat.shard.detach().cpu().clone();
    const int64_t begin = std::min(rank * flat.layout.shard, flat.layout.numel);
    const int64_t end = std::min(begin + flat.layout.shard, flat.layout.numel);
    for_each_box(flat, begin, end, [&](size_t j, const Box& box, int64_t at) {
      read_box(checkpoint, source(flat.names[j]), box, shard.narrow(0, at, box.numel()).view(box.sizes));
    });
    copies.emplace_back(flat.shard, shard);
  }
  for (const auto& [name, tensor] : whole) {
    auto loaded = torch::empty_like(tensor, torch::TensorOptions().device(torch::kCPU));
    read_box(checkpoint, source(name), whole_box(tensor), loaded);
    copies.emplace_back(tensor, loaded);
  }
  return copies;
}

} // namespace detail
} // namespace lockstep
