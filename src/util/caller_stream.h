#pragma once

// Internal: the caller's current stream, carried to the threads of lockstep's
// own that start its collectives (Note [The caller's stream]).

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Optional.h>

namespace lockstep {
namespace detail {

// Note [The caller's stream]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Collectives start on threads of lockstep's own: the agreement check's
// (src/comm/collective_check.cpp) and Gloo's ring (src/comm/backends/gloo.cpp), where
// the current stream is the device's default. NCCL and Gloo's CUDA path
// order a collective after the current stream of the thread that starts
// it, and so do the ring's copies between device and host: work the caller
// queued on another stream (under a CUDAStreamGuard, or a backward whose
// forward ran on a side stream) would not be waited for, and the collective
// could read gradients or parameters before they are written. So each
// collective takes the stream current where it was called, and starts
// under it. Waiting needs nothing: the caller waits on its own thread.
//
// DataParallel's replicas run on threads of lockstep's own too
// (src/dp/worker_pool.cpp), and read what the caller queued: the input, the
// parameters it just changed. Each replica runs under the streams current
// on every device of the step where the step was called (a copy between
// devices runs on its source device's stream), as PyTorch's parallel_apply
// does on its replica's device; so its results are ordered before whatever
// the caller queues next.

/// The calling thread's current stream on `device`; none on the CPU.
inline c10::optional<c10::Stream> caller_stream(c10::Device device) {
  if (device.is_cpu() || !c10::impl::hasDeviceGuardImpl(device.type())) {
    return c10::nullopt;
  }
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

} // namespace detail
} // namespace lockstep
