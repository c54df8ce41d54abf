#pragma once

// Peak memory of a device, for the benchmarks: the caching allocator's peak
// of allocated bytes on a GPU, the process's peak resident set on the CPU.
// CMake picks the source: device_memory_cuda.cpp for a CUDA build of
// LibTorch, device_memory_host.cpp otherwise.

#include <torch/types.h>

#include <sys/resource.h>

namespace lockstep {
namespace bench {

/// The process's peak resident set, in MiB.
inline double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0; // KiB on Linux
}

/// Starts `device`'s peak anew (a GPU's; the CPU's resident peak cannot be).
void reset_peak_device_memory(torch::Device device);

/// `device`'s peak memory in MiB since the last reset.
double peak_device_memory_mb(torch::Device device);

} // namespace bench
} // namespace lockstep
