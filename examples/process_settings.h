#pragma once

// lockstep-train's settings of the whole process, made before any tensor.

#include "blas_check.h"

#include <torch/torch.h>

#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace lockstep {
namespace examples {

// Keeps freed memory in glibc's heap instead of returning every large
// tensor to the kernel: fresh pages fault and are zeroed on each step
// otherwise, which cost 25% of a CNN step on CPU, and two fifths of a bf16
// MLP step under autocast, whose casts allocate anew every step
// (docs/performance.md). The whole process's setting, so the program's.
inline void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// Settings of the whole process, made before any tensor: a fast BLAS, a heap
// that keeps freed memory, and the intra-op thread count.
inline void prepare_process(int threads, bool deterministic) {
  lockstep::examples::require_fast_blas("lockstep-train");
  keep_freed_memory();
  // --threads, else OMP_NUM_THREADS (lockstep-run gives each rank its
  // share), else every core: libtorch's own default can be lower (it asks
  // cpuinfo for physical cores, which fails on some virtual machines).
  // --deterministic: 1, so that every world size computes each micro-batch alike.
  const char* omp = deterministic ? nullptr : std::getenv("OMP_NUM_THREADS");
  at::set_num_threads(threads > 0                            ? threads
                      : deterministic                        ? 1
                      : omp != nullptr && std::atoi(omp) > 0 ? std::atoi(omp)
                                                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

} // namespace examples
} // namespace lockstep
