// load_sharded of a folder in lockstep's earlier sharded format (one
// framed LibTorch archive per rank and an index), at any world size, so that
// runs saved before the safetensors layout (src/fsdp/dcp_checkpoint.cpp)
// resume.

#include <lockstep/fully_sharded_data_parallel.h>

#include "util/checked_file.h"

#include "fsdp/flat_param.h"
#include "fsdp/checkpoint_common.h"
#include "fsdp/optimizer.h"
#include "fsdp/state.h"

#include <torch/optim.h>
#include <torch/serialize.h>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <unordered_map>

namespace lockstep {
namespace detail {

// Note [Sharded checkpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The earlier format, which load_sharded still reads: DIR/index.json names
// the world size that saved, the save's id, and per flat parameter its
// unit, dtype, element count, shard size and parameter names.
// DIR/shard-R-of-W.pt is rank R's LibTorch archive: per flat parameter f,
// "f<f>.values" (its padded shard) and "f<f>.state" (the optimizer's state
// for it, as the optimizer's own serialize() writes it). What is not sharded
// (buffers such as BatchNorm's running statistics, and frozen parameters)
// is the same on every rank after the constructor's broadcast; rank 0's
// file holds it as "whole.w<i>", named in the index's "whole" list, and
// every rank loads it from there, with the optimizer's parameter groups'
// options under "groups" (Note [Optimizer options in a sharded
// checkpoint]). Each file is framed
// as the trainer's checkpoints are (magic, length, CRC-32; written to a
// temporary file, synced and renamed), so a damaged one is an error naming
// it before LibTorch reads it. To load at another world size, each rank
// computes the range of every flat buffer it now owns and copies it out of
// the old shards that overlap it; state tensors with the old shard's
// element count are resharded the same way, and scalars (Adam's step) are
// taken as they are, being the same on every rank.

namespace {

// An entry's key in a version-1 shard's archive: "f3" for flat parameter 3,
// "w0" for the first whole tensor. (Built by appending: GCC 12 warns,
// wrongly, of an overflow in "f" + std::to_string(n) once inlined.)
std::string archive_key(char kind, size_t index) {
  std::string key(1, kind);
  key += std::to_string(index);
  return key;
}

constexpr char kMagic[] = "LOCKSTEP-SHARD\n";
constexpr size_t kMagicSize = sizeof(kMagic) - 1;

std::string read_framed(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.is_open(), "lockstep::load_sharded: cannot open ", path, " (", std::strerror(errno),
              "). The folder must hold every file that save_sharded wrote.");
  std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(file.size() >= kMagicSize + 12 && file.compare(0, kMagicSize, kMagic) == 0, "lockstep::load_sharded: ",
              path, " is not a shard that save_sharded wrote (truncated, or another file). Restore it from a copy.");
  uint64_t length = 0;
  uint32_t crc = 0;
  for (int i = 0; i < 8; ++i) {
    length |= uint64_t{static_cast<unsigned char>(file[kMagicSize + i])} << (8 * i);
  }
  for (int i = 0; i < 4; ++i) {
    crc |= uint32_t{static_cast<unsigned char>(file[kMagicSize + 8 + i])} << (8 * i);
  }
  const size_t held = file.size() - kMagicSize - 12;
  TORCH_CHECK(length == held, "lockstep::load_sharded: ", path, " is damaged: its header declares ", length,
              " bytes but it holds ", held, ". Restore it from a copy.");
  TORCH_CHECK(crc32_matches(file.data() + kMagicSize + 12, held, crc), "lockstep::load_sharded: ", path,
              " is damaged: its checksum does not match its content. Restore it from a copy.");
  file.erase(0, kMagicSize + 12);
  return file;
}

std::string shard_file(const std::string& dir, int rank, int world) {
  return dir + "/shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".pt";
}


// Old shards, read once each.
class OldShards {
 public:
  // `save_id`: the index's, which each of the save's files carries, or nullopt
  // for an index written before saves had one.
  OldShards(std::string dir, int world, std::optional<int64_t> save_id)
      : dir_(std::move(dir)), world_(world), save_id_(save_id) {}
  torch::serialize::InputArchive& archive(int rank) {
    auto it = archives_.find(rank);
    if (it == archives_.end()) {
      const auto path = shard_file(dir_, rank, world_);
      std::istringstream payload(read_framed(path));
      it = archives_.emplace(rank, torch::serialize::InputArchive()).first;
      it->second.load_from(payload);
      torch::Tensor id;
      TORCH_CHECK(!save_id_ || (it->second.try_read("save_id", id) && id.item<int64_t>() == *save_id_),
                  "lockstep::load_sharded: ", path, " was written by another save than ", dir_, "/index.json: the "
                  "folder holds files of two saves (a file copied in from another run's folder, or a save stopped "
                  "halfway in a folder that held an earlier one), which cannot be loaded together. Load a folder "
                  "whose files one save wrote; save to a new folder each time and remove the old one after.");
    }
    return it->second;
  }
  int world() const {
    return world_;
  }

 private:
  std::string dir_;
  int world_;
  std::optional<int64_t> save_id_;
  std::map<int, torch::serialize::InputArchive> archives_;
};

// The saved flat parameter holds the same parameters, in the same order and
// shapes: as many elements in another layout (two layers swapped) would load
// each one's values into the other.
void check_same_parameters(const nlohmann::json& saved, const FlatParam& flat, const std::string& index_path, size_t f) {
  const auto names = saved.at("names").get<std::vector<std::string>>();
  const auto shapes = saved.contains("shapes") ? saved.at("shapes").get<std::vector<std::vector<int64_t>>>() : flat.shapes;
  for (size_t j = 0; j < std::max(names.size(), flat.names.size()); ++j) {
    const bool same = j < names.size() && j < flat.names.size() && names[j] == flat.names[j] &&
        j < shapes.size() && shapes[j] == flat.shapes[j];
    TORCH_CHECK(same, "lockstep::load_sharded: ", index_path, ": flat parameter ", f, "'s parameter ", j, " was '",
                j < names.size() ? names[j] : std::string("(none)"), "' of shape ",
                j < shapes.size() ? c10::IntArrayRef(shapes[j]) : c10::IntArrayRef(), ", but here it is '",
                j < flat.names.size() ? flat.names[j] : std::string("(none)"), "' of shape ",
                j < flat.shapes.size() ? c10::IntArrayRef(flat.shapes[j]) : c10::IntArrayRef(),
                ". Load it into the model that saved it, with the same layers in the same order.");
  }
}

// Elements [begin, end) of flat parameter f's `key` (a tensor of the old
// shard's size in each old file, or of a sub-archive's `sub`), zeros past
// `numel` (the padding).
torch::Tensor old_range(OldShards& old, size_t f, const std::string& key, int64_t old_shard, int64_t numel,
                        int64_t begin, int64_t end, const torch::TensorOptions& options) {
  auto out = torch::zeros({end - begin}, options);
  for (int q = 0; q < old.world(); ++q) {
    const int64_t from = std::max(begin, q * old_shard);
    const int64_t to = std::min({end, (q + 1) * old_shard, numel});
    if (from >= to) {
      continue;
    }
    torch::serialize::InputArchive flat;
    old.archive(q).read(archive_key('f', f), flat);
    torch::Tensor values;
    if (key == "values") {
      flat.read("values", values);
    } else {
      torch::serialize::InputArchive state;
      flat.read("state", state);
      state.read(key, values);
    }
    out.narrow(0, from - begin, to - from).copy_(values.reshape({-1}).narrow(0, from - q * old_shard, to - from));
  }
  return out;
}

// The optimizer's state for flat parameter f's new range [begin, end), out
// of the old shards' (Note [Sharded checkpoint]); nullptr for none.
std::shared_ptr<torch::optim::OptimizerParamState> reshard_state(OldShards& old, size_t f, const FlatParam& flat,
                                                                 int64_t old_shard, int64_t begin, int64_t end,
                                                                 torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive first;
  old.archive(0).read(archive_key('f', f), first);
  torch::serialize::InputArchive saved_state;
  if (!first.try_read("state", saved_state)) {
    // Saved before the optimizer's first step: as load_state_dict, the
    // optimizer starts again from no state, not from the one it has now.
    return nullptr;
  }
  torch::serialize::OutputArchive state;
  for (const auto& key : saved_state.keys()) {
    torch::Tensor tensor;
    if (saved_state.try_read(key, tensor) && tensor.numel() == old_shard) {
      // On this rank's device, not on the one rank 0 saved from (as load_state_dict).
      state.write(key, old_range(old, f, key, old_shard, flat.layout.numel, begin, end,
                                 tensor.options().device(flat.shard.device())));
    } else if (tensor.defined()) {
      state.write(key, tensor);
    } else {
      c10::IValue value;
      saved_state.read(key, value);
      state.write(key, value);
    }
  }
  return read_state(optimizer, state);
}

// Tensors a load copies into live ones: (live, loaded).
using Copies = std::vector<std::pair<torch::Tensor, torch::Tensor>>;

// Buffers and frozen parameters out of rank 0's file (Note [Sharded
// checkpoint]), each checked against the live tensor it replaces, into `copies`.
void stage_whole(OldShards& old, const nlohmann::json& index, const std::string& index_path,
                 const std::vector<std::pair<std::string, torch::Tensor>>& whole, Copies& copies) {
  std::vector<std::string> names;
  for (const auto& named : whole) {
    names.push_back(named.first);
  }
  const auto saved = index.value("whole", std::vector<std::string>{});
  TORCH_CHECK(saved == names, "lockstep::load_sharded: ", index_path, " holds ", saved.size(),
              " buffers and frozen parameters, but this model has ", names.size(), " (",
              names.empty() ? std::string("none") : "'" + names.front() + "', ...", "). Load it into the model that "
              "saved it, with the same parameters frozen.");
  if (whole.empty()) {
    return;
  }
  torch::serialize::InputArchive rest;
  old.archive(0).read("whole", rest);
  for (size_t i = 0; i < whole.size(); ++i) {
    torch::Tensor value;
    rest.read(archive_key('w', i), value);
    const auto& live = whole[i].second;
    TORCH_CHECK(value.sizes() == live.sizes() && value.scalar_type() == live.scalar_type(), "lockstep::load_sharded: ",
                index_path, ": '", whole[i].first, "' was ", value.sizes(), " ", value.scalar_type(), " but here it is ",
                live.sizes(), " ", live.scalar_type(), ". Load it into the model that saved it.");
    copies.emplace_back(live, value);
  }
}

} // namespace

namespace {

constexpr int kIndexFormat = 1;

// The index.json of the folder `dir` that save_sharded wrote, in a format
// this lockstep reads.
nlohmann::json read_index(const std::string& index_path) {
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(read_framed(index_path));
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "lockstep::load_sharded: ", index_path, " is not an index that save_sharded wrote: ", e.what());
  }
  const auto format = index.is_object() ? index.value("format", nlohmann::json()) : nlohmann::json();
  TORCH_CHECK(format == kIndexFormat, "lockstep::load_sharded: ", index_path, " is of format ", format.dump(),
              ", and this lockstep reads format ", kIndexFormat, ": another version of lockstep wrote it. Load it with "
              "that version.");
  return index;
}

} // namespace

void ShardedCore::load_sharded_v1(torch::optim::Optimizer* optimizer, const std::string& dir,
                                  std::optional<int64_t> expected_save_id) {
  std::function<void()> commit;
  int64_t save_id = 0;
  const auto device = control_device_of(group_, flats());
  on_every_rank(group_, device, "load_sharded of " + dir, [&] {
    try {
      commit = stage_load(optimizer, dir, save_id);
      TORCH_CHECK(!expected_save_id || save_id == *expected_save_id, "lockstep::load_sharded: ", dir, " holds save ",
                  save_id, ", not save ", *expected_save_id, " that the caller names: the folder was written by "
                  "another save (another run's folder, or one written over since). Load the folder that this save "
                  "wrote, or start from scratch.");
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "lockstep::load_sharded: ", dir, "/index.json lacks what save_sharded writes (", e.what(),
                  "): it was not written by save_sharded. Load a folder that save_sharded wrote.");
    }
  });
  check_same_save(group_, device, save_id, dir);
  state_->drop_forward("load_sharded()");
  commit();
}

// Note [A load changes all or nothing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A load that fails (a damaged or mismatched file on any rank, a buffer of
// another shape found last) must leave every rank's shards, optimizer
// state and buffers as they were: a caller that catches the error and
// tries an older checkpoint, or starts afresh, would otherwise train on a
// mix of two models, different on each rank. So every file is read and
// every check made into new tensors first (the shards' and the state's
// size again, for the moment of the load), the ranks learn that all got
// through (on_every_rank), and only then is anything copied in.
std::function<void()> ShardedCore::stage_load(torch::optim::Optimizer* optimizer, const std::string& dir,
                                              int64_t& save_id) {
  const std::string index_path = dir + "/index.json";
  const nlohmann::json index = read_index(index_path);
  save_id = index.value("save_id", int64_t{0});
  const auto all = flats();
  TORCH_CHECK(index.at("flats").size() == all.size(), "lockstep::load_sharded: ", index_path, " holds ",
              index.at("flats").size(), " flat parameters, but this model has ", all.size(),
              ". Load it into the model that saved it, wrapped with the same units.");
  if (optimizer != nullptr) {
    const auto saved_kind = index.value("optimizer", optimizer_kind(*optimizer)); // older indexes have none
    TORCH_CHECK(saved_kind == optimizer_kind(*optimizer), "lockstep::load_sharded: ", index_path, " holds the state of ",
                saved_kind, ", but this optimizer is ", optimizer_kind(*optimizer), ": that state would fill the wrong "
                "fields. Load it with ", saved_kind, ".");
  }
  OldShards old(dir, index.at("world_size").get<int>(),
                index.contains("save_id") ? std::optional<int64_t>(index.at("save_id").get<int64_t>()) : std::nullopt);
  const int rank = sharded() ? group_.rank() : 0;
  torch::NoGradGuard no_grad;
  Copies copies;
  std::vector<std::pair<torch::Tensor, std::shared_ptr<torch::optim::OptimizerParamState>>> states;
  for (size_t f = 0; f < all.size(); ++f) {
    auto& flat = *all[f];
    const auto& saved = index.at("flats")[f];
    TORCH_CHECK(saved.at("unit").get<std::string>() == flat.unit && saved.at("numel").get<int64_t>() == flat.layout.numel &&
                    saved.at("dtype").get<std::string>() == c10::toString(flat.dtype),
                "lockstep::load_sharded: ", index_path, ": flat parameter ", f, " was unit '",
                saved.at("unit").get<std::string>(), "' of ", saved.at("numel").get<int64_t>(), " ",
                saved.at("dtype").get<std::string>(), " elements, but here it is unit '", flat.unit, "' of ",
                flat.layout.numel, " ", c10::toString(flat.dtype), ". Load it into the model that saved it.");
    check_same_parameters(saved, flat, index_path, f);
    const int64_t old_shard = saved.at("shard").get<int64_t>();
    const int64_t begin = rank * flat.layout.shard;
    const int64_t end = begin + flat.layout.shard;
    copies.emplace_back(flat.shard, old_range(old, f, "values", old_shard, flat.layout.numel, begin, end, flat.options()));
    if (optimizer != nullptr) {
      states.emplace_back(flat.shard, reshard_state(old, f, flat, old_shard, begin, end, *optimizer));
    }
  }
  stage_whole(old, index, index_path, whole(), copies);
  torch::serialize::InputArchive saved_groups;
  const auto groups = optimizer != nullptr && old.archive(0).try_read("groups", saved_groups)
      ? read_group_options(*optimizer, saved_groups, shard_file(dir, 0, old.world()))
      : GroupOptions{};
  return [optimizer, copies = std::move(copies), states = std::move(states), groups] {
    torch::NoGradGuard no_grad;
    for (const auto& [live, loaded] : copies) {
      live.detach().copy_(loaded);
    }
    for (const auto& [shard, state] : states) {
      install_state(*optimizer, shard, state);
    }
    if (optimizer != nullptr) {
      install_group_options(*optimizer, groups);
    }
  };
}

} // namespace detail
} // namespace lockstep
