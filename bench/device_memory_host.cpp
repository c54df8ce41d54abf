// device_memory.h on a CPU-only LibTorch: the process's resident peak.

#include "device_memory.h"

#include <c10/util/Exception.h>

namespace lockstep {
namespace bench {

void reset_peak_device_memory(torch::Device device) {
  TORCH_CHECK(!device.is_cuda(), "this LibTorch has no CUDA: no GPU memory to measure on ", device);
}

double peak_device_memory_mb(torch::Device device) {
  TORCH_CHECK(!device.is_cuda(), "this LibTorch has no CUDA: no GPU memory to measure on ", device);
  return peak_rss_mb();
}

} // namespace bench
} // namespace lockstep
