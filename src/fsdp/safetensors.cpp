// lockstep::save_safetensors and load_safetensors of a
// FullyShardedDataParallel: the whole model in one safetensors file (or an
// index and its files) under the bare module's names, written by rank 0 and
// read by every rank for its own shards.

#include "comm/rank0_text.h"
#include "fsdp/checkpoint_common.h"
#include "fsdp/state.h"
#include "io/safetensors_file.h"

#include <c10/util/accumulate.h>
#include <torch/utils.h>

#include <algorithm>
#include <filesystem>
#include <numeric>

namespace lockstep {
namespace detail {

namespace {

// Note [Saving sharded weights as safetensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every rank plans the same files from the same names, shapes and dtypes,
// then asks for each tensor's bytes in the order rank 0 writes them. A
// parameter's bytes come from its flat buffer, all-gathered when its first
// parameter is asked for, in its own dtype (not param_dtype's), and kept
// only until another flat's is: the peak is one unit, not the model. Rank 0
// writes; the others take part in the same all-gathers and drop the bytes.
// If rank 0's writing fails, it still joins the all-gathers left, so that
// no rank waits for it, and the verdict (on_every_rank) ends the save with
// an error on every rank.
SafetensorsSource source(const std::string& name, torch::ScalarType dtype, std::vector<int64_t> shape,
                         std::function<torch::Tensor()> bytes) {
  SafetensorsSource source;
  source.entry.name = name;
  source.entry.dtype = dtype;
  source.entry.shape = std::move(shape);
  source.bytes = std::move(bytes);
  return source;
}

} // namespace

torch::Tensor ShardedCore::State::gathered_in_own_dtype(OneFlat& cache, size_t f) {
  if (cache.f != f) {
    cache.full = torch::Tensor();
    const auto& flat = flats[f];
    torch::NoGradGuard no_grad;
    torch::Tensor full = flat.shard.detach();
    if (sharded()) {
      full = torch::empty({flat.layout.padded}, flat.options());
      group.all_gather_into_async(full, flat.shard.detach().contiguous(),
                                  "all_gather of " + bucket_name({f}) + " for save_safetensors")
          ->wait();
    }
    cache.full = full.to(torch::kCPU);
    cache.f = f;
  }
  return cache.full;
}

// Note [Tied parameters in checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A parameter registered under two names (an embedding tied to the output
// layer) is planned once, under its first name. A module's state dict holds
// it under each name, and PyTorch's loaders look for each: load_state_dict
// and dcp.load into FSDP2's state_dict (safetensors' load_model wants one,
// and takes the other only with strict=False). So
// save_safetensors and save_sharded write it under every name, as the bare
// module's save_safetensors does; load_safetensors reads every name it finds
// (strict, it wants one of them, as the bare module's does: Note [Tied
// parameters in safetensors files]); load_sharded reads its first name and
// takes the others where the checkpoint has them, or reads another where
// the checkpoint lacks the first, so that a folder saved with any of them
// loads.
std::pair<size_t, size_t> ShardedCore::State::locate(const std::string& first) const {
  for (size_t f = 0; f < flats.size(); ++f) {
    const auto& names = flats[f].names;
    const auto it = std::find(names.begin(), names.end(), first);
    if (it != names.end()) {
      return {f, static_cast<size_t>(it - names.begin())};
    }
  }
  for (size_t w = first_frozen; w < whole.size(); ++w) {
    if (whole[w].first == first) {
      return {kNone, w};
    }
  }
  TORCH_INTERNAL_ASSERT(false, "parameter '", first, "' is in no flat and not frozen");
}

std::vector<SafetensorsSource> ShardedCore::State::safetensors_sources(const std::string& who) {
  std::vector<SafetensorsSource> sources;
  auto cache = std::make_shared<OneFlat>();
  const auto add_parameter = [&](const std::string& name, size_t f, size_t j) {
    const auto& flat = flats[f];
    safetensors_dtype_name(flat.dtype, who + ": parameter '" + name + "'");
    sources.push_back(source(name, flat.dtype, flat.shapes[j], [this, cache, f, j] {
      const auto& flat = flats[f];
      const int64_t numel = c10::multiply_integers(flat.shapes[j]);
      return gathered_in_own_dtype(*cache, f).narrow(0, flat.offsets[j], numel).view(flat.shapes[j]);
    }));
  };
  const auto add_whole = [&](const std::string& name, const torch::Tensor& tensor) {
    safetensors_dtype_name(tensor.scalar_type(), who + ": '" + name + "'");
    check_has_bytes(tensor, who + ": '" + name + "'");
    sources.push_back(
        source(name, tensor.scalar_type(), tensor.sizes().vec(), [tensor = tensor] { return host_bytes(tensor); }));
  };
  for (size_t f = 0; f < flats.size(); ++f) {
    for (size_t j = 0; j < flats[f].params.size(); ++j) {
      add_parameter(flats[f].names[j], f, j);
    }
  }
  for (const auto& [name, tensor] : whole) {
    add_whole(name, tensor);
  }
  for (const auto& [alias, first] : aliases) { // Note [Tied parameters in checkpoints]
    const auto [f, j] = locate(first);
    f == kNone ? add_whole(alias, whole[j].second) : add_parameter(alias, f, j);
  }
  return sources;
}

void ShardedCore::save_safetensors(const std::string& path, const SafetensorsSaveOptions& options) const {
  auto& s = *state_;
  CollectiveTag tag(model_tag(s.model, 0)); // Note [Collective tags]: two models' calls never pair
  TORCH_CHECK(!s.summoned, s.where(), "save_safetensors(", path, ") inside summon_full_params(): the shards "
              "take the guard's edits only when it ends, so the file would hold the parameters as they were before "
              "it beside buffers as they are now. End the guard first.");
  const std::string who = s.where() + "save_safetensors(" + path + ")";
  const auto device = control_device_of(group_, flats());
  // Rank 0 writes the file alone: another rank's path would be dropped without a word. Checked before anything
  // that could fail on one rank alone.
  const std::string mine = std::filesystem::path(path).lexically_normal().string();
  const std::string rank0_path = rank0_text(group_, mine, device, "the check that every rank saves to one path");
  on_every_rank(group_, device, "save_safetensors(" + path + ")", [&] {
    TORCH_CHECK(rank0_path == mine, who, ": rank 0 saves to ", rank0_path, ", and this rank to another path. Rank 0 "
                "gathers the whole model and writes it alone, so this rank's path would get no file: give every rank "
                "the same path, and copy rank 0's file where else it is needed.");
  }, "is on that rank");
  auto sources = s.safetensors_sources(who);
  const auto plan = plan_safetensors_save(sources, path, options, who);
  auto calls = std::make_shared<size_t>(0);
  for (auto& source : sources) {
    source.bytes = [inner = std::move(source.bytes), calls] {
      ++*calls;
      return inner();
    };
  }
  std::vector<size_t> sequence;
  for (const auto& file : plan.files) {
    sequence.insert(sequence.end(), file.order.begin(), file.order.end());
  }
  auto take_part_from = [&](size_t k) {
    for (; k < sequence.size(); ++k) {
      sources[sequence[k]].bytes();
    }
  };
  on_every_rank(group_, device, "save_safetensors(" + path + ")", [&] {
    if (group_.rank() != 0) {
      take_part_from(0);
      return;
    }
    try {
      write_safetensors_save(plan, sources, who);
    } catch (...) {
      take_part_from(*calls);
      throw;
    }
  }, "is on that rank");
}

void ShardedCore::load_safetensors(const std::string& path, const SafetensorsLoadOptions& options) {
  auto& s = *state_;
  CollectiveTag tag(model_tag(s.model, 0)); // Note [Collective tags]: two models' calls never pair
  TORCH_CHECK(!s.summoned, s.where(), "load_safetensors() inside summon_full_params(): the guard's end would "
              "overwrite (writeback) or hide what it loads. End the guard first.");
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies; // (live, loaded)
  on_every_rank(group_, control_device_of(group_, flats()), "load_safetensors(" + path + ")",
                [&] { copies = s.stage_safetensors_load(path, options); }, "is on that rank");
  s.drop_forward("load_safetensors()");
  torch::NoGradGuard no_grad;
  for (const auto& [live, loaded] : copies) {
    live.detach().copy_(loaded);
  }
}

// Each flat's shard on this rank, from the bytes of the parameters it
// covers (and no others), and the whole tensors: checked, not yet copied.
std::vector<std::pair<torch::Tensor, torch::Tensor>> ShardedCore::State::stage_safetensors_load(
    const std::string& path, const SafetensorsLoadOptions& options) {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<torch::ScalarType> dtypes;
  std::vector<std::pair<size_t, size_t>> flat_of; // (flat, parameter), or (kNone, index into whole)
  for (size_t f = 0; f < flats.size(); ++f) {
    for (size_t j = 0; j < flats[f].params.size(); ++j) {
      names.push_back(flats[f].names[j]);
      shapes.push_back(flats[f].shapes[j]);
      dtypes.push_back(flats[f].dtype);
      flat_of.emplace_back(f, j);
    }
  }
  for (size_t w = 0; w < whole.size(); ++w) {
    names.push_back(whole[w].first);
    shapes.push_back(whole[w].second.sizes().vec());
    dtypes.push_back(whole[w].second.scalar_type());
    flat_of.emplace_back(kNone, w);
  }
  std::vector<size_t> same_as(names.size());
  std::iota(same_as.begin(), same_as.end(), size_t{0});
  for (const auto& [alias, first] : aliases) { // Note [Tied parameters in checkpoints]
    const auto [f, j] = locate(first);
    same_as.push_back(static_cast<size_t>(std::find(names.begin(), names.end(), first) - names.begin()));
    names.push_back(alias);
    shapes.push_back(f == kNone ? whole[j].second.sizes().vec() : flats[f].shapes[j]);
    dtypes.push_back(f == kNone ? whole[j].second.scalar_type() : flats[f].dtype);
    flat_of.emplace_back(f, j);
  }
  const auto set = open_safetensors_set(path);
  const auto match = match_state(names, shapes, dtypes, set, options, path, same_as);
  const int rank = sharded() ? group.rank() : 0;
  std::vector<torch::Tensor> shards;
  for (const auto& flat : flats) {
    shards.push_back(flat.shard.detach().cpu().clone());
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  for (const auto& [i, where] : match.pairs) {
    const auto loaded = read_as(set, *where, dtypes[i], path);
    const auto [f, j] = flat_of[i];
    if (f == kNone) {
      copies.emplace_back(whole[j].second, loaded);
      continue;
    }
    const auto& flat = flats[f];
    const int64_t begin = std::max<int64_t>(flat.offsets[j], rank * flat.layout.shard);
    const int64_t end = std::min<int64_t>(flat.offsets[j] + loaded.numel(), (rank + 1) * flat.layout.shard);
    if (begin < end) {
      shards[f].narrow(0, begin - rank * flat.layout.shard, end - begin)
          .copy_(loaded.reshape({-1}).narrow(0, begin - flat.offsets[j], end - begin));
    }
  }
  for (size_t f = 0; f < flats.size(); ++f) {
    copies.emplace_back(flats[f].shard, shards[f]);
  }
  return copies;
}

} // namespace detail
} // namespace lockstep
