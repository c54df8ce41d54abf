#pragma once

// lockstep-train's --comm-hook: how DistributedDataParallel reduces each
// bucket, and PowerSGD's state in the trainer's checkpoint. PowerSGD's error
// feedback is each rank's own, so every rank's state goes into rank 0's
// checkpoint, and each rank takes its own back on resuming.

#include "checkpoint.h"
#include "options.h"

#include <lockstep/lockstep.h>

#include <torch/torch.h>

#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep {
namespace examples {

struct TrainerHook {
  lockstep::CommHook hook;                  // empty: the built-in allreduce
  std::optional<lockstep::PowerSGD> powersgd; // --comm-hook powersgd: its state, to save and load
  std::string description;                  // ", PowerSGD (rank 4, from step 10)"; "" for none
};

inline TrainerHook make_comm_hook(const Config& config) {
  TrainerHook made;
  if (config.comm_hook == "fp16") {
    made.hook = lockstep::comm_hooks::fp16_compress;
    made.description = ", fp16-compressed gradients";
  } else if (config.comm_hook == "bf16") {
    made.hook = lockstep::comm_hooks::bf16_compress;
    made.description = ", bf16-compressed gradients";
  } else if (config.comm_hook == "powersgd") {
    made.powersgd = lockstep::comm_hooks::powersgd(
        lockstep::PowerSGDOptions().rank(config.powersgd_rank).start_iteration(config.powersgd_start).seed(config.seed));
    made.hook = *made.powersgd;
    made.description = ", PowerSGD (rank " + std::to_string(config.powersgd_rank) + ", from step " +
                       std::to_string(config.powersgd_start) + ")";
  }
  return made;
}

// Every rank's `mine`, in rank order, on every rank.
inline std::vector<std::string> all_gather_bytes(const lockstep::ProcessGroup& group, torch::Device device,
                                                 const std::string& mine) {
  auto lengths = group.all_gather(torch::tensor({static_cast<int64_t>(mine.size())}).to(device));
  int64_t longest = 0;
  for (const auto& l : lengths) {
    longest = std::max(longest, l.item<int64_t>());
  }
  auto padded = torch::zeros({longest}, torch::kUInt8);
  std::copy(mine.begin(), mine.end(), padded.data_ptr<uint8_t>());
  auto all = group.all_gather(padded.to(device));
  std::vector<std::string> out;
  for (size_t r = 0; r < all.size(); ++r) {
    auto bytes = all[r].cpu();
    const auto* data = bytes.data_ptr<uint8_t>();
    out.emplace_back(data, data + lengths[r].item<int64_t>());
  }
  return out;
}

// Every rank's PowerSGD state, as bytes (a collective: every rank calls it).
inline std::vector<std::string> powersgd_states(const lockstep::PowerSGD& powersgd,
                                                const lockstep::ProcessGroup& group, torch::Device device) {
  torch::serialize::OutputArchive archive;
  powersgd.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return all_gather_bytes(group, device, bytes.str());
}

// This rank's PowerSGD state from a checkpoint written by `state.world_size`
// ranks: its own when the world size is the same; otherwise rank 0's
// iteration and warm start without error feedback, which belongs to ranks
// that are gone (`report`: say so).
inline void load_powersgd(lockstep::PowerSGD& powersgd, const TrainingState& state, int rank, int world_size,
                          bool report) {
  if (state.comm_hook_states.empty()) {
    if (report) {
      std::fprintf(stderr, "lockstep-train: the checkpoint holds no PowerSGD state (written without --comm-hook "
                   "powersgd): compression starts after %lld more steps of plain allreduce\n",
                   static_cast<long long>(powersgd.options().start_iteration()));
    }
    return;
  }
  const bool same = static_cast<int64_t>(state.comm_hook_states.size()) == world_size;
  const std::string& bytes = state.comm_hook_states[same ? rank : 0];
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  if (same) {
    powersgd.load(archive);
    return;
  }
  powersgd.load_shared(archive);
  if (report) {
    std::fprintf(stderr, "lockstep-train: the checkpoint's PowerSGD error feedback belongs to %zu ranks; over %d it "
                 "starts from zero (the iteration and warm start go on)\n", state.comm_hook_states.size(), world_size);
  }
}

} // namespace examples
} // namespace lockstep
