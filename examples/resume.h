#pragma once

// lockstep-train's resume: where a run starts from its checkpoint, and what
// it says when the checkpoint was written by a run with other settings.

#include "checkpoint.h"
#include "options.h"
#include "sampling.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace examples {

// What differs between the run that wrote a checkpoint and this one, in
// words ("" if nothing): each changes the data order from here on.
inline std::string resume_differences(const TrainingState& there, const BatchPlan& here, const DataSignature& data) {
  std::string said;
  if (there.world_size != here.world_size) {
    said += "; written over " + std::to_string(there.world_size) + " rank(s): the data order goes on unchanged";
  }
  if (there.batch_size != 0 && there.batch_size != here.batch_size) { // format 2 kept no batch size
    said += "; written with --batch-size " + std::to_string(there.batch_size) + ": the rest of the epoch goes on in "
            "batches of " + std::to_string(here.batch_size);
  }
  if (there.data.rows == 0) { // format 2 kept no signature
    return said;
  }
  if (there.data.rows != data.rows || there.data.checksum != data.checksum) {
    said += "; written over other training data (" + std::to_string(there.data.rows) + " samples of another content, "
            "seed " + std::to_string(there.data.seed) + "; here " + std::to_string(data.rows) + ", seed " +
            std::to_string(data.seed) + ": another --data or --text, --train-samples, or --seed with --synthetic), so "
            "the rest of the run trains on this data";
  } else if (there.data.seed != data.seed) {
    said += "; written with --seed " + std::to_string(there.data.seed) + ", so the data order differs from here on";
  }
  return said;
}

// The settings a checkpoint keeps to say when a resume changes them
// (TrainingState::settings): "--flag value" pairs. --optimizer is not among
// them: another one is refused (read_whole_checkpoint).
inline std::string run_settings(const Config& config) {
  std::string settings = "--precision " + config.precision;
  if (config.precision == "fp16") {
    settings += " --loss-scale-growth-interval " + std::to_string(config.growth_interval);
  }
  if (!config.sharding.empty()) {
    settings += " --sharding " + config.sharding;
  }
  if (config.comm_hook == "powersgd") { // Note [PowerSGD state of another rank]: the Q's start anew
    settings += " --comm-hook powersgd --powersgd-rank " + std::to_string(config.powersgd_rank) + " --powersgd-start " +
                std::to_string(config.powersgd_start);
  } else if (config.comm_hook != "none") {
    settings += " --comm-hook " + config.comm_hook;
  }
  const auto number = [](double value) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", value);
    return std::string(text);
  };
  settings += " --lr " + number(config.lr);
  if (config.optimizer == "sgd") {
    settings += " --momentum " + number(config.momentum);
  }
  settings += " --schedule " + config.schedule + " --warmup-steps " + std::to_string(config.warmup_steps);
  if (config.schedule == "step") {
    settings += " --gamma " + number(config.gamma) + " --step-epochs " + std::to_string(config.step_epochs);
  }
  return settings;
}

// run_settings' "--flag value" pairs, in order.
inline std::vector<std::pair<std::string, std::string>> settings_pairs(const std::string& settings) {
  std::vector<std::pair<std::string, std::string>> pairs;
  std::istringstream words(settings);
  for (std::string flag, value; words >> flag >> value;) {
    pairs.emplace_back(flag, value);
  }
  return pairs;
}

// What a resume changes of the `recorded` settings (run_settings) with this
// run's, `now`, in words: the changed flags on each side, "no --flag" where
// a side lacks one; "" when nothing changed. A flag that older checkpoints
// did not record is no change when `recorded` lacks it.
inline std::string settings_changes(const std::string& recorded, const std::string& now) {
  static const std::set<std::string> kRecordedLater = {"--loss-scale-growth-interval", "--powersgd-start", "--lr",
                                                        "--momentum", "--schedule", "--warmup-steps", "--gamma",
                                                        "--step-epochs"};
  const auto there = settings_pairs(recorded), here = settings_pairs(now);
  const auto value_in = [](const std::vector<std::pair<std::string, std::string>>& pairs, const std::string& flag) {
    for (const auto& [f, v] : pairs) {
      if (f == flag) {
        return std::optional<std::string>(v);
      }
    }
    return std::optional<std::string>();
  };
  std::vector<std::string> flags; // every flag of either side, in the order of `now`, then of `recorded`
  for (const auto& pairs : {here, there}) {
    for (const auto& pair : pairs) {
      if (std::find(flags.begin(), flags.end(), pair.first) == flags.end()) {
        flags.push_back(pair.first);
      }
    }
  }
  std::string was, is;
  for (const auto& flag : flags) {
    const auto old_value = value_in(there, flag), new_value = value_in(here, flag);
    if (old_value == new_value || (!old_value && kRecordedLater.count(flag) != 0)) {
      continue;
    }
    was += (was.empty() ? "" : " ") + (old_value ? flag + " " + *old_value : "no " + flag);
    is += (is.empty() ? "" : " ") + (new_value ? flag + " " + *new_value : "no " + flag);
  }
  return was.empty() ? "" : "; written with " + was + ", and this run goes on with " + is;
}

// `state` as this run writes it into its checkpoints.
inline TrainingState this_run(TrainingState state, const BatchPlan& plan, const DataSignature& data,
                              const Config& config) {
  state.settings = run_settings(config);
  if (state.step == 0 && state.epoch == 0) {
    state.sample_counts = torch::zeros({plan.samples}, torch::kInt32);
  } else if (state.sample_counts.defined() && state.sample_counts.numel() != plan.samples) {
    state.sample_counts = torch::Tensor(); // counts of other training data: this run's are unknown
  }
  if (state.sample_counts.defined()) {
    state.unsynced_counts = torch::zeros_like(state.sample_counts);
  }
  state.world_size = plan.world_size;
  state.batch_size = plan.batch_size;
  state.data = data;
  return state;
}

// Where in its epoch a resume starts, in words: "sample 96 of 192", or, for
// a checkpoint of a longer epoch (more --train-samples), that the epoch
// ends there.
inline std::string resumed_position(const TrainingState& state, const BatchPlan& plan) {
  const int64_t rows = epoch_extent(plan).first;
  const std::string at = "sample " + std::to_string(state.samples_in_epoch);
  if (state.samples_in_epoch <= rows) {
    return at + " of " + std::to_string(rows);
  }
  return at + ", past the " + std::to_string(rows) + " of this run's epoch, which so ends there";
}

// Where training starts: the checkpoint's position when `load` finds one
// (and loads the model and optimizer), else the beginning. With `report`,
// the line that says so goes to stderr, or, with `report_later`, there, for
// a caller that loads more before the resume has succeeded.
inline TrainingState resume(
    const Config& config,
    const BatchPlan& plan,
    const DataSignature& data,
    bool report,
    const std::function<bool(TrainingState&)>& load,
    std::string* report_later = nullptr) {
  TrainingState state;
  if (config.checkpoint_path.empty() || !load(state)) {
    return this_run(state, plan, data, config);
  }
  state.resumed_world_size = state.world_size;
  state.resumed_step = state.step;
  if (report) {
    char line[512];
    std::snprintf(line, sizeof(line), "lockstep-train: resumed from %s at step %lld (epoch %lld, %s)",
                  config.checkpoint_path.c_str(), static_cast<long long>(state.step),
                  static_cast<long long>(state.epoch + 1), resumed_position(state, plan).c_str());
    std::string said = line + resume_differences(state, plan, data);
    if (!state.settings.empty()) {
      said += settings_changes(state.settings, run_settings(config));
    }
    said += "\n";
    if (report_later != nullptr) {
      *report_later = said;
    } else {
      std::fputs(said.c_str(), stderr);
    }
  }
  return this_run(state, plan, data, config);
}

} // namespace examples
} // namespace lockstep
