// Compiled when LibTorch has c10d's Gloo process group; src/no_gloo.cpp otherwise.

#include "backends.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>

namespace lockstep {
namespace detail {

bool gloo_available() {
  return true;
}

std::shared_ptr<GroupImpl> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& hostname) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // GLOO_SOCKET_IFNAME picks the interface, as for PyTorch. Otherwise a job
  // whose store is on loopback stays on loopback; on several machines, the
  // store's address is node 0's, so each rank binds to its own machine's
  // default address instead (its hostname's, as PyTorch does).
  const bool loopback = hostname == "localhost" || hostname == "::1" || hostname.rfind("127.", 0) == 0;
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (loopback) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  options->threads = 2;
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  // LibTorch 1.x's ProcessGroupGloo is a c10d::ProcessGroup, 2.x's a c10d::Backend:
  // C10dGroup takes either.
  return std::make_shared<C10dGroup<c10d::ProcessGroupGloo>>(std::move(group), "gloo", timeout);
}

} // namespace detail
} // namespace lockstep
