// The errors of a collective (include/lockstep/detail/collective_errors.h).

#include <lockstep/detail/collective_errors.h>

#include <c10/util/Exception.h>

namespace lockstep {
namespace detail {

[[noreturn]] void throw_collective_error(
    const std::string& what,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& cause,
    const Diagnose& diagnose) {
  const std::string diagnosis = diagnose ? (*diagnose)() : std::string();
  TORCH_CHECK(
      false, "lockstep: rank ", rank, " of ", size, ": ", what, " failed or did not complete within the group's timeout of ",
      timeout.count(), " ms. Another rank may have stopped, crashed or be stuck elsewhere; its own error says why. "
      "Cause: ", cause, diagnosis.empty() ? "" : (!cause.empty() && cause.back() == '.' ? " " : ". "), diagnosis);
}

[[noreturn]] void throw_refusal(
    const std::string& what,
    int rank,
    int size,
    const std::string& backend,
    const std::string& cause) {
  TORCH_CHECK(false, "lockstep: rank ", rank, " of ", size, ": ", what, ": refused on this rank before anything was sent (",
              backend, " backend): ", cause);
}

} // namespace detail
} // namespace lockstep
