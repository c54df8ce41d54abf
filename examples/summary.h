#pragma once

// lockstep-train's sentences about a run, from its settings and state
// alone: the summary's sample counts and PowerSGD line, the step count of a
// resumed run, the list of outputs, and the note on a warmup longer than the
// run.

#include "checkpoint.h"
#include "options.h"

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace lockstep {
namespace examples {

/// The run's output files, named within `out_dir` where they lie in it.
inline std::string describe_outputs(const std::string& out_dir, const std::vector<std::string>& outputs) {
  std::string listed;
  for (const auto& o : outputs) {
    const bool inside = o.rfind(out_dir + "/", 0) == 0;
    listed += (listed.empty() ? "" : ", ") + (inside ? o.substr(out_dir.size() + 1) : o);
  }
  return "outputs in " + out_dir + "/: " + listed;
}

/// Whether every training row was trained once per epoch, through every
/// resume and change of world size (TrainingState::sample_counts).
inline std::string describe_sample_counts(const torch::Tensor& counts, int epochs) {
  if (!counts.defined()) {
    return "sample counts: unknown (resumed from a checkpoint written without them, or over other training data)";
  }
  const int64_t low = counts.min().item<int64_t>();
  const int64_t high = counts.max().item<int64_t>();
  if (low == epochs && high == epochs) {
    return "sample counts: each of the " + std::to_string(counts.numel()) + " training samples trained " +
           std::to_string(epochs) + " time(s), once per epoch";
  }
  return "sample counts: the " + std::to_string(counts.numel()) + " training samples trained from " +
         std::to_string(low) + " to " + std::to_string(high) + " time(s), not once per epoch (" +
         std::to_string(epochs) + "): " + std::to_string((counts != epochs).sum().item<int64_t>()) + " differ";
}

/// PowerSGD's compression over the last step (PowerSGD::compression_rate()),
/// and why there was none.
inline std::string describe_compression(double rate, const TrainingState& state, const Config& config) {
  char text[512];
  if (rate == 0) {
    std::snprintf(text, sizeof(text), "PowerSGD compressed nothing: it starts after --powersgd-start %lld steps of "
                  "plain allreduce, and this run ended at step %lld", static_cast<long long>(config.powersgd_start),
                  static_cast<long long>(state.step));
  } else if (rate <= 1.0) {
    std::snprintf(text, sizeof(text), "PowerSGD compressed no gradient: at --powersgd-rank %lld no gradient matrix "
                  "of this model is worth compressing (each would send at least half of what it holds), so every "
                  "bucket went as a plain allreduce; a lower --powersgd-rank compresses",
                  static_cast<long long>(config.powersgd_rank));
  } else {
    std::snprintf(text, sizeof(text), "PowerSGD compression rate %.1f (gradient elements over elements sent, at the "
                  "last step; also in metrics.jsonl)", rate);
  }
  return text;
}

/// What to lower when `message` (a failed run's error) says memory ran
/// out, or "": LibTorch's allocator names bytes, not the flags behind them.
/// `context`: --context, of --model gpt.
inline std::string out_of_memory_advice(const std::string& message, const Config& config, int64_t context) {
  if (message.find("can't allocate memory") == std::string::npos &&
      message.find("CUDA out of memory") == std::string::npos && message.find("bad_alloc") == std::string::npos) {
    return "";
  }
  std::string advice = "the run ran out of memory: each rank's activations grow with its share of --batch-size " +
                       std::to_string(config.batch_size);
  if (config.model == "gpt") {
    advice += ", and with the square of --context " + std::to_string(context) + " (attention's scores)";
  }
  advice += "; give a smaller --batch-size";
  if (config.model == "gpt") {
    advice += " or --context";
  }
  if (config.model != "cnn" && !config.activation_checkpointing) {
    advice += ", or add --activation-checkpointing";
  }
  return advice + ".";
}

/// "12 steps (36 in all)" for a run resumed at step 24 that ended at 36;
/// "36 steps" for one that was not resumed.
inline std::string describe_steps(const TrainingState& state) {
  const std::string trained = std::to_string(state.step - state.resumed_step) + " steps";
  return state.resumed_step > 0 ? trained + " (" + std::to_string(state.step) + " in all)" : trained;
}

/// The note for --warmup-steps past the run's last step, which leave the
/// learning rate short of --lr for the whole run; "" when the warmup ends
/// in time. `per_epoch`: optimizer steps per epoch.
inline std::string warmup_note(const Config& config, int64_t per_epoch) {
  const int64_t total = per_epoch * config.epochs;
  if (config.warmup_steps <= total) {
    return "";
  }
  char text[512];
  std::snprintf(text, sizeof(text), "--warmup-steps %lld is more than the run's %lld steps (%d epoch(s) of %lld), so "
                "the learning rate never reaches --lr %g: it ends at %g. Give --warmup-steps %lld or fewer, or more "
                "--epochs.", static_cast<long long>(config.warmup_steps), static_cast<long long>(total), config.epochs,
                static_cast<long long>(per_epoch), config.lr,
                config.lr * static_cast<double>(total) / static_cast<double>(config.warmup_steps),
                static_cast<long long>(total));
  return text;
}

} // namespace examples
} // namespace lockstep
