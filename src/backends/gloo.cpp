// Compiled when LibTorch has c10d's Gloo process group; no_gloo.cpp otherwise.

#include "backends.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <sstream>

namespace lockstep {
namespace detail {
namespace {

// Note [Gloo's address]
// ~~~~~~~~~~~~~~~~~~~~~
// Each Gloo rank listens on one address and publishes it in the store; the
// others connect to it. Without GLOO_SOCKET_IFNAME, c10d takes the first
// address of the machine's host name that it can bind, and Debian maps the
// host name to 127.0.1.1 (or 127.0.0.1) in /etc/hosts. On one machine that
// works; across machines the other ranks connect to their own loopback, so
// one rank dies with "Connection refused" while another waits for it.
// Before connecting, every rank therefore publishes the address it will
// listen on and whether MASTER_ADDR is an address of its own machine; if a
// rank listens on loopback while some rank is on another machine, all of
// them fail together, saying what to set.

bool is_loopback(const sockaddr* address) {
  if (address->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(address)->sin_addr.s_addr) >> 24) == 127;
  }
  if (address->sa_family == AF_INET6) {
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr);
  }
  return false;
}

std::string to_text(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = "?";
  const void* raw = address->sa_family == AF_INET6
      ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr)
      : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(address)->sin_addr);
  ::inet_ntop(address->sa_family, raw, text, sizeof(text));
  return text;
}

struct Endpoint {
  std::string address; // where this rank's Gloo listens
  bool loopback = false;
  bool master_is_local = false; // MASTER_ADDR is an address of this machine
};

// The first of `host`'s addresses that this machine can bind, as c10d and
// Gloo choose it; found = false if none.
bool first_bindable(const std::string& host, Endpoint& endpoint) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) {
    return false;
  }
  bool bound = false;
  for (const addrinfo* a = found; a != nullptr && !bound; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      continue;
    }
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0) {
      endpoint.address = to_text(a->ai_addr);
      endpoint.loopback = is_loopback(a->ai_addr);
      bound = true;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return bound;
}

// What Gloo will listen on, found the way c10d finds it for `ifname`, or
// for this machine's host name.
Endpoint local_endpoint(const char* ifname, const std::string& master_addr) {
  Endpoint endpoint;
  Endpoint master;
  endpoint.master_is_local = first_bindable(master_addr, master);
  if (ifname != nullptr) {
    ifaddrs* all = nullptr;
    if (::getifaddrs(&all) == 0) {
      for (const ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
        if (i->ifa_addr != nullptr && (i->ifa_addr->sa_family == AF_INET || i->ifa_addr->sa_family == AF_INET6) &&
            ifname == std::string(i->ifa_name)) {
          endpoint.address = to_text(i->ifa_addr);
          endpoint.loopback = is_loopback(i->ifa_addr);
          break;
        }
      }
      ::freeifaddrs(all);
    }
    return endpoint;
  }
  char hostname[HOST_NAME_MAX + 1] = {};
  ::gethostname(hostname, sizeof(hostname) - 1);
  if (!first_bindable(hostname, endpoint)) {
    endpoint.address = "127.0.0.1"; // c10d's fallback
    endpoint.loopback = true;
  }
  return endpoint;
}

std::string key_of(int rank) {
  return "lockstep/gloo_endpoint/" + std::to_string(rank);
}

void check_endpoints_reachable(
    c10d::Store& store,
    int rank,
    int size,
    const Endpoint& mine,
    const char* ifname,
    const std::string& master_addr) {
  std::ostringstream text;
  text << mine.loopback << ' ' << mine.master_is_local << ' ' << mine.address;
  const std::string value = text.str();
  store.set(key_of(rank), std::vector<uint8_t>(value.begin(), value.end()));
  std::vector<Endpoint> all(size);
  int remote = -1; // a rank whose machine is not MASTER_ADDR's
  int on_loopback = -1;
  for (int r = 0; r < size; ++r) {
    const auto bytes = store.get(key_of(r));
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    in >> all[r].loopback >> all[r].master_is_local >> all[r].address;
    if (!all[r].master_is_local && remote < 0) {
      remote = r;
    }
    if (all[r].loopback && on_loopback < 0) {
      on_loopback = r;
    }
  }
  TORCH_CHECK(
      on_loopback < 0 || remote < 0, "lockstep: rank ", rank, ": rank ", on_loopback,
      "'s Gloo would listen on the loopback address ", all[on_loopback].address,
      ifname != nullptr ? std::string(" of GLOO_SOCKET_IFNAME=") + ifname
                        : std::string(", its host name's address (see /etc/hosts),"),
      " but rank ", remote, " runs on another machine than MASTER_ADDR ", master_addr,
      " and could not reach it. Set GLOO_SOCKET_IFNAME to the network interface that connects the machines (for "
      "example GLOO_SOCKET_IFNAME=eth0, the same name on every machine; 'ip -brief address' lists them), or map the "
      "host name to a routable address.");
}

} // namespace

bool gloo_available() {
  return true;
}

std::shared_ptr<GroupImpl> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& master_addr) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // GLOO_SOCKET_IFNAME picks the interface, as for PyTorch. Otherwise a job
  // whose store is on loopback stays on loopback; on several machines, the
  // store's address is node 0's, so each rank binds to its own machine's
  // default address instead (its hostname's, as PyTorch does).
  const bool loopback = master_addr == "localhost" || master_addr == "::1" || master_addr.rfind("127.", 0) == 0;
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && *ifname == '\0') {
    ifname = nullptr;
  }
  if (!loopback) {
    check_endpoints_reachable(*store, rank, size, local_endpoint(ifname, master_addr), ifname, master_addr);
  }
  if (ifname != nullptr) {
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
