// Compiled when LibTorch lacks c10d's Gloo process group.

#include "comm/backends/backends.h"

namespace lockstep {
namespace detail {

bool gloo_available() {
  return false;
}

std::shared_ptr<GroupImpl> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>&,
    int,
    int,
    std::chrono::milliseconds,
    const std::string&,
    int) {
  TORCH_INTERNAL_ASSERT(false, "make_gloo_group called in a build without Gloo");
}

} // namespace detail
} // namespace lockstep
