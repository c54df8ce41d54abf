// device_memory.h on a CUDA build of LibTorch: the caching allocator's counters.

#include "device_memory.h"

#include <c10/cuda/CUDACachingAllocator.h>

namespace lockstep {
namespace bench {

void reset_peak_device_memory(torch::Device device) {
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
  }
}

double peak_device_memory_mb(torch::Device device) {
  if (!device.is_cuda()) {
    return peak_rss_mb();
  }
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return static_cast<double>(stats.allocated_bytes[all].peak) / (1024.0 * 1024.0);
}

} // namespace bench
} // namespace lockstep
