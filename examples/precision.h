#pragma once

// lockstep-train's --precision: the autocast guard around each forward, and
// the GradScaler of fp16, whose state travels in the checkpoint as the
// bytes of its archive (TrainingState::grad_scaler).

#include "checkpoint.h"
#include "options.h"

#include <lockstep/lockstep.h>

#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

namespace lockstep {
namespace examples {

// The autocast dtype of --precision; Float for fp32 (no autocast).
inline torch::ScalarType precision_dtype(const Config& config) {
  return config.precision == "bf16" ? torch::kBFloat16 : config.precision == "fp16" ? torch::kHalf : torch::kFloat;
}

// While it lives, forward runs in --precision on `device`; nothing for fp32.
inline std::unique_ptr<lockstep::AutocastGuard> autocast_for(const Config& config, torch::Device device) {
  const auto dtype = precision_dtype(config);
  if (dtype == torch::kFloat) {
    return nullptr;
  }
  return std::make_unique<lockstep::AutocastGuard>(device.type(), dtype);
}

// Whether this CPU has instructions for `dtype`'s arithmetic (Linux's
// /proc/cpuinfo flags): AVX512-BF16 or AMX for bf16, AVX512-FP16 or AMX-FP16
// for fp16. Without them LibTorch's kernels emulate it, and an autocast step
// is several times slower than fp32's (docs/performance.md).
inline bool cpu_computes_natively(torch::ScalarType dtype) {
  std::ifstream in("/proc/cpuinfo");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto has = [&](const char* flag) { return text.find(std::string(" ") + flag) != std::string::npos; };
  return dtype == torch::kBFloat16 ? has("avx512_bf16") || has("amx_bf16") : has("avx512_fp16") || has("amx_fp16");
}

// Says so when --precision asks the CPU for arithmetic it emulates. fp16
// is said whatever the CPU's flags: LibTorch's CPU float16 kernels are
// slower than its fp32 and bf16 ones even where AVX512-FP16 and AMX exist
// (docs/performance.md's AMP table: there the CNN's step takes 86 times
// fp32's, its backward 183 times, and the MLP's 1.1 times; without
// AVX512-FP16 the MLP's takes 33 times).
inline void say_if_emulated(const Config& config, torch::Device device, bool lead) {
  const auto dtype = precision_dtype(config);
  if (lead && dtype == torch::kHalf && device.is_cpu()) {
    std::fprintf(stderr, "lockstep-train: note: --precision fp16 on a CPU is slow: LibTorch's CPU float16 kernels "
                 "take longer than fp32's, whatever the CPU: a CNN's step 86 times longer even with AVX512-FP16 and "
                 "AMX, where bf16 is faster than fp32. Use --precision bf16 on a CPU; fp16 is for GPUs.\n");
    return;
  }
  if (lead && dtype != torch::kFloat && device.is_cpu() && !cpu_computes_natively(dtype)) {
    std::fprintf(stderr, "lockstep-train: note: this CPU has no %s instructions (%s), so LibTorch emulates "
                 "--precision %s, and a step takes several times longer than in fp32\n",
                 config.precision.c_str(), dtype == torch::kBFloat16 ? "AVX512-BF16 or AMX" : "AVX512-FP16 or AMX-FP16",
                 config.precision.c_str());
  }
}

// fp16's scaler (a pass-through otherwise), resumed from `state` with this
// run's --loss-scale-growth-interval. The ranks
// agree on overflow over `group`: FullyShardedDataParallel's ranks each see
// only their shard of the gradients (Note [Mixed precision]).
inline std::unique_ptr<lockstep::GradScaler> make_scaler(const Config& config, const lockstep::ProcessGroup& group,
                                                         const TrainingState& state) {
  auto scaler = std::make_unique<lockstep::GradScaler>(
      lockstep::GradScalerOptions().enabled(config.precision == "fp16").growth_interval(config.growth_interval).group(group));
  if (scaler->is_enabled() && !state.grad_scaler.empty()) {
    std::istringstream bytes(state.grad_scaler);
    torch::serialize::InputArchive archive;
    archive.load_from(bytes);
    scaler->load(archive);
    scaler->set_growth_interval(config.growth_interval); // this run's flag (a change is said: run_settings)
  }
  return scaler;
}

// The scaler's archive as bytes, for TrainingState::grad_scaler.
inline std::string scaler_bytes(const lockstep::GradScaler& scaler) {
  if (!scaler.is_enabled()) {
    return "";
  }
  torch::serialize::OutputArchive archive;
  scaler.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

} // namespace examples
} // namespace lockstep
