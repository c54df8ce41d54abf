// lockstep::save_sharded(model, dir) and load_sharded(model, dir): a
// FullyShardedDataParallel's weights as PyTorch's distributed checkpoint
// writes them with HuggingFaceStorageWriter(dir, save_distributed=True)
// (src/io/dcp_hf.h), so that Python's dcp.load reads them at any world size,
// and a folder that FSDP2 wrote loads here at any other.

#include "fsdp/optimizer.h"
#include "fsdp/state.h"
#include "io/dcp_hf.h"

#include <c10/util/accumulate.h>
#include <torch/utils.h>

#include <algorithm>

namespace lockstep {
namespace detail {

namespace {

// What part of a flat buffer's elements this rank holds and saves: its
// shard; all of it on rank 0 under NoShard (every rank holds the same).
std::pair<int64_t, int64_t> saved_range(const FlatParam& flat, int rank, bool sharded) {
  if (!sharded) {
    return rank == 0 ? std::make_pair(int64_t{0}, flat.layout.numel) : std::make_pair(int64_t{0}, int64_t{0});
  }
  const int64_t begin = std::min(rank * flat.layout.shard, flat.layout.numel);
  return {begin, std::min(begin + flat.layout.shard, flat.layout.numel)};
}

// Calls fn(j, box, at) for each box of each parameter of `flat` within
// elements [begin, end) of the flat buffer; `at` is the box's first
// element's place in that range (Note [A flat shard as boxes]).
template <typename Fn>
void for_each_box(const FlatParam& flat, int64_t begin, int64_t end, Fn fn) {
  for (size_t j = 0; j < flat.params.size(); ++j) {
    const int64_t first = flat.offsets[j];
    const int64_t last = first + c10::multiply_integers(flat.shapes[j]);
    const int64_t from = std::max(first, begin);
    const int64_t to = std::min(last, end);
    if (from >= to) {
      continue;
    }
    int64_t at = from - begin;
    for (auto& box : boxes_of_range(flat.shapes[j], from - first, to - first)) {
      const int64_t numel = box.numel();
      fn(j, std::move(box), at);
      at += numel;
    }
  }
}

Box whole_box(const torch::Tensor& tensor) {
  Box box;
  box.sizes = tensor.sizes().vec();
  box.offsets.assign(box.sizes.size(), 0);
  return box;
}

} // namespace

std::vector<BoxSource> ShardedCore::State::shard_boxes() const {
  std::vector<BoxSource> boxes;
  const int rank = group.rank();
  for (const auto& flat : flats) {
    const auto [begin, end] = saved_range(flat, rank, sharded());
    const torch::Tensor shard = flat.shard;
    const int64_t shard_begin = sharded() ? begin : 0;
    for_each_box(flat, begin, end, [&](size_t j, Box box, int64_t at) {
      const int64_t start = begin - shard_begin + at;
      const auto sizes = box.sizes;
      boxes.push_back({flat.names[j], flat.dtype, std::move(box), [shard, start, sizes] {
                         torch::NoGradGuard no_grad;
                         return shard.detach().narrow(0, start, c10::multiply_integers(sizes)).cpu().contiguous().view(sizes);
                       }});
    });
  }
  if (rank == 0) {
    for (const auto& [name, tensor] : whole) {
      boxes.push_back({name, tensor.scalar_type(), whole_box(tensor), [tensor = tensor] {
                         torch::NoGradGuard no_grad;
                         return tensor.detach().cpu().contiguous();
                       }});
    }
  }
  return boxes;
}

void ShardedCore::save_sharded_weights(const std::string& dir) const {
  auto& s = *state_;
  TORCH_CHECK(!s.summoned, s.where(), "save_sharded() inside summon_full_params(): the shards take the guard's edits "
              "only when it ends. End the guard first.");
  const std::string who = s.where() + "save_sharded(" + dir + ")";
  const auto device = control_device_of(group_, flats());
  const int rank = group_.rank();
  on_every_rank(group_, device, "save_sharded of " + dir, [&] { clear_dcp_save(dir, rank, group_.size(), who); });
  const std::string id = std::to_string(new_save_id(group_, device));
  std::vector<std::string> files;
  on_every_rank(group_, device, "save_sharded of " + dir,
                [&] { files = write_dcp_boxes(dir, rank, s.shard_boxes(), {{"lockstep_save_id", id}}, who); });
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
    write_dcp_save_record(dir, id, all, who);
  });
}

void ShardedCore::load_sharded_weights(const std::string& dir) {
  auto& s = *state_;
  TORCH_CHECK(!s.summoned, s.where(), "load_sharded() inside summon_full_params(): the guard's end would overwrite "
              "(writeback) or hide what it loads. End the guard first.");
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  on_every_rank(group_, control_device_of(group_, flats()), "load_sharded of " + dir,
                [&] { copies = s.stage_dcp_load(open_dcp_save(dir)); });
  if (s.forwarded) { // Note [Loading between forward and backward]
    Unwatched unwatched;
    if (s.sharded()) {
      s.forget_gathered();
    }
    s.forwarded = false;
    s.forward_dropped_by = "load_sharded()";
  }
  torch::NoGradGuard no_grad;
  for (const auto& [live, loaded] : copies) {
    live.detach().copy_(loaded);
  }
}

namespace {

// Missing names, then shapes and dtypes, as load_safetensors checks them;
// names the checkpoint has beyond the model's are left alone, as
// PyTorch's dcp.load leaves them (the optimizer's state may be beside).
void check_covers(const DcpCheckpoint& checkpoint, const std::vector<std::string>& names,
                  const std::vector<std::vector<int64_t>>& shapes, const std::vector<torch::ScalarType>& dtypes) {
  std::string missing, errors;
  for (size_t i = 0; i < names.size(); ++i) {
    const auto shape = checkpoint.shapes.find(names[i]);
    if (shape == checkpoint.shapes.end()) {
      missing += (missing.empty() ? "\"" : ", \"") + names[i] + "\"";
    } else if (shape->second != shapes[i]) {
      errors += "\n\tsize mismatch for " + names[i] + ": the checkpoint's is " + c10::str(c10::IntArrayRef(shape->second)) +
          ", the model's " + c10::str(c10::IntArrayRef(shapes[i])) + ".";
    } else if (checkpoint.dtypes.at(names[i]) != dtypes[i]) {
      errors += "\n\tdtype mismatch for " + names[i] + ": the checkpoint has " +
          c10::toString(checkpoint.dtypes.at(names[i])) + ", the model " + c10::toString(dtypes[i]) + ".";
    }
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
  check_covers(checkpoint, names, shapes, dtypes);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  const int rank = sharded() ? group.rank() : 0;
  for (const auto& flat : flats) {
    auto shard = flat.shard.detach().cpu().clone();
    const int64_t begin = rank * flat.layout.shard;
    const int64_t end = std::min(begin + flat.layout.shard, flat.layout.numel);
    for_each_box(flat, begin, end, [&](size_t j, const Box& box, int64_t at) {
      read_box(checkpoint, flat.names[j], box, shard.narrow(0, at, box.numel()).view(box.sizes));
    });
    copies.emplace_back(flat.shard, shard);
  }
  for (const auto& [name, tensor] : whole) {
    auto loaded = torch::empty_like(tensor, torch::TensorOptions().device(torch::kCPU));
    read_box(checkpoint, name, whole_box(tensor), loaded);
    copies.emplace_back(tensor, loaded);
  }
  return copies;
}

} // namespace detail
} // namespace lockstep
