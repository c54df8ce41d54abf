// Whether the ranks of a group share a host, and whether a process of this
// host has exited.

#include "comm/backends/same_host.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <fstream>
#include <iterator>
#include <sstream>

namespace lockstep {
namespace detail {

namespace {

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string namespace_of(const char* kind) {
  char target[256] = {};
  const std::string link = std::string("/proc/self/ns/") + kind;
  const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string("?");
}

} // namespace

std::string host_identity() {
  char host[HOST_NAME_MAX + 1] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string id = std::string(host) + "|" + read_first_line("/proc/sys/kernel/random/boot_id");
  for (const char* kind : {"net", "ipc", "mnt", "pid"}) {
    id += '|';
    id += namespace_of(kind);
  }
  std::replace(id.begin(), id.end(), ' ', '_');
  return id;
}

bool one_host(const std::vector<std::string>& published) {
  std::string first;
  for (const auto& entry : published) {
    std::istringstream in(entry);
    std::string identity;
    in >> identity;
    if (identity.empty() || identity == "off" || (!first.empty() && identity != first)) {
      return false;
    }
    first = identity;
  }
  return !published.empty();
}

bool process_exited(int pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
    return true;
  }
  // A zombie, under a parent that reaps its children late (a Python
  // subprocess waiting on its ranks in order): state Z or X in its stat,
  // after the command name, which may hold spaces and parentheses.
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && (stat[close + 2] == 'Z' || stat[close + 2] == 'X');
}

} // namespace detail
} // namespace lockstep
