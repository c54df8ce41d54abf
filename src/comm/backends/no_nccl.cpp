// Compiled when LibTorch lacks c10d's NCCL process group (a CPU build).

#include "comm/backends/backends.h"

namespace lockstep {
namespace detail {

bool nccl_available() {
  return false;
}

std::shared_ptr<GroupImpl> make_nccl_group(const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds) {
  TORCH_INTERNAL_ASSERT(false, "make_nccl_group called in a build without NCCL");
}

} // namespace detail
} // namespace lockstep
