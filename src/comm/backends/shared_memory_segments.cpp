// Segments in /dev/shm for the collectives between ranks of one host (Note
// [Collectives through shared memory] in shared_memory_collectives.cpp):
// mapping one, and unlinking those of a group that is joining.

#include "comm/backends/shared_memory_segments.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <random>
#include <sstream>

namespace lockstep {
namespace detail {

// Note [Segments of a group that is joining]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A segment's name stays in /dev/shm until someone unlinks it. connect
// unlinks its own and every peer's published segment on the way out, made or
// not: once every rank has mapped the segments their names have no use, and
// a peer that died after publishing would leave its own. While a group
// joins, the names are registered here too, so that a process ended by the
// join's deadline (std::_Exit, which runs no destructor) unlinks them first.
namespace {

std::mutex g_joining_mutex;
std::vector<std::string> g_joining;

} // namespace

JoiningSegments::~JoiningSegments() {
  std::lock_guard<std::mutex> lock(g_joining_mutex);
  for (const auto& name : names_) {
    ::shm_unlink(name.c_str());
    g_joining.erase(std::find(g_joining.begin(), g_joining.end(), name));
  }
}

void JoiningSegments::add(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_joining_mutex);
  names_.push_back(name);
  g_joining.push_back(name);
}

void unlink_joining_segments() {
  std::unique_lock<std::mutex> lock(g_joining_mutex, std::try_to_lock);
  if (!lock.owns_lock()) {
    return; // another thread is in the middle of a change: not worth a wait at the end
  }
  for (const auto& name : g_joining) {
    ::shm_unlink(name.c_str());
  }
}

std::string new_segment_name() {
  std::random_device device;
  std::ostringstream out;
  out << "/lockstep-" << ::getpid() << "-" << std::hex << device() << device();
  return out.str();
}

void* map_segment(const std::string& name, int64_t bytes, bool create) {
  const int fd = ::shm_open(name.c_str(), create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
  if (fd < 0) {
    return nullptr;
  }
  void* at = nullptr;
  // posix_fallocate reserves the pages now: a full /dev/shm fails here, not
  // with SIGBUS in the middle of a step.
  if (!create || ::posix_fallocate(fd, 0, bytes) == 0) {
    at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  at = at == MAP_FAILED ? nullptr : at;
  if (create && at == nullptr) {
    ::shm_unlink(name.c_str()); // no rank will map it
  }
  return at;
}

} // namespace detail
} // namespace lockstep
