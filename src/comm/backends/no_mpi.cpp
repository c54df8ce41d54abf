// Compiled when the build found no MPI library.

#include "comm/backends/backends.h"

namespace lockstep {
namespace detail {

bool mpi_available() {
  return false;
}

std::shared_ptr<GroupImpl> make_mpi_group(int, int, std::chrono::milliseconds) {
  TORCH_INTERNAL_ASSERT(false, "make_mpi_group called in a build without MPI");
}

} // namespace detail
} // namespace lockstep
