#pragma once

// Internal: resolving a host and binding a TCP socket, the one way lockstep
// does both: the store's listening socket (src/store.cpp), the address Gloo
// will listen on (src/backends/gloo.cpp), and lockstep-run's check that the
// store's port is free (tools/lockstep_run.cpp). Plain POSIX, nothing of
// LibTorch: the launcher links none.

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

namespace lockstep {
namespace detail {

/// A host's TCP addresses, as getaddrinfo gives them; empty, with the
/// resolver's reason in `error`, when the name does not resolve.
struct Addresses {
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list{nullptr, ::freeaddrinfo};
  std::string error;
  const addrinfo* first() const {
    return list.get();
  }
};

/// `host`'s TCP addresses for `port` (0: any); `flags` are getaddrinfo's
/// (AI_NUMERICHOST | AI_NUMERICSERV for an address that must not be looked up).
inline Addresses resolve_tcp(const std::string& host, int port, int flags = 0) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  Addresses addresses;
  const int rc = ::getaddrinfo(host.c_str(), port > 0 ? service.c_str() : nullptr, &hints, &found);
  if (rc != 0 || found == nullptr) {
    addresses.error = rc != 0 ? ::gai_strerror(rc) : "no address";
    return addresses;
  }
  addresses.list.reset(found);
  return addresses;
}

/// A socket bound to the first of `addresses` that binds (and listening,
/// with `listen`), or fd -1 with the last failure's errno and text. With
/// `reuse_address`, a port in TIME_WAIT binds (SO_REUSEADDR), as a server's
/// does.
struct Bound {
  int fd = -1;
  const addrinfo* address = nullptr; // the one bound, owned by `addresses`
  int error_code = 0;
  std::string error = "no address";
};

inline Bound bind_first(const Addresses& addresses, bool listen, bool reuse_address) {
  Bound bound;
  for (const addrinfo* a = addresses.first(); a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      bound.error_code = errno;
      bound.error = std::strerror(errno);
      continue;
    }
    const int on = 1;
    if (reuse_address) {
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    }
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && (!listen || ::listen(fd, SOMAXCONN) == 0)) {
      bound.fd = fd;
      bound.address = a;
      return bound;
    }
    bound.error_code = errno;
    bound.error = std::strerror(errno);
    ::close(fd);
  }
  return bound;
}

} // namespace detail
} // namespace lockstep
