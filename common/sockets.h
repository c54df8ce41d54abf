#pragma once

// Internal: resolving a host and binding a TCP socket, the one way lockstep
// does both: the store's listening socket (src/comm/store.cpp), the address Gloo
// will listen on (src/comm/backends/gloo.cpp), and lockstep-run's check that the
// store's port is free (tools/lockstep_run.cpp). Plain POSIX, nothing of
// LibTorch: the launcher links none.

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
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

/// Whether `address` is a loopback address (127.0.0.0/8, ::1).
inline bool is_loopback(const sockaddr* address) {
  if (address->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(address)->sin_addr.s_addr) >> 24) == 127;
  }
  if (address->sa_family == AF_INET6) {
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr);
  }
  return false;
}

/// The port a bound socket has, or 0.
inline int bound_port(int fd) {
  sockaddr_storage mine{};
  socklen_t size = sizeof(mine);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &size) != 0) {
    return 0;
  }
  return ntohs(mine.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&mine)->sin6_port
                                          : reinterpret_cast<const sockaddr_in*>(&mine)->sin_port);
}

// Note [A server named by a host name]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A server (the store at MASTER_ADDR, the elastic rendezvous at
// --rdzv-endpoint) is named by a host that every machine resolves. Debian's
// /etc/hosts maps a machine's own name to 127.0.1.1 (or 127.0.0.1), while
// the other machines resolve it to a real address: a server bound to what
// the name resolves to on its own machine is then reachable from there
// alone. Its own node joins, the others are refused, and an elastic round
// closes with one node. c10d's TCPStore and torchrun's rendezvous listen on
// every interface, so the same name works under PyTorch. Lockstep binds
// what the name resolves to, which tells whether the server belongs on this
// machine at all, and where that is loopback although the name is not one
// (not "localhost", not a loopback address written out), listens on every
// interface at that port instead. A server named as loopback stays there.

/// Whether `host` names loopback itself: "localhost" (and Debian's
/// ip6-localhost, ip6-loopback) or a loopback address written out.
inline bool names_loopback(const std::string& host) {
  if (host.rfind("localhost", 0) == 0 || host == "ip6-localhost" || host == "ip6-loopback") {
    return true;
  }
  const auto numeric = resolve_tcp(host, 0, AI_NUMERICHOST);
  return numeric.first() != nullptr && is_loopback(numeric.first()->ai_addr);
}

/// A listening socket for a server named `host`:`port` (0: any free port),
/// or fd -1 with the reason when `host` is not an address of this machine
/// or the port is taken. See Note [A server named by a host name].
struct Listening {
  int fd = -1;
  bool every_interface = false;
  std::string error;
};

inline Listening listen_as(const std::string& host, int port) {
  Listening listening;
  const auto addresses = resolve_tcp(host, port);
  if (addresses.first() == nullptr) {
    listening.error = "does not resolve: " + addresses.error;
    return listening;
  }
  Bound bound = bind_first(addresses, /*listen=*/true, /*reuse_address=*/true);
  if (bound.fd < 0) {
    listening.error = bound.error;
    return listening;
  }
  listening.fd = bound.fd;
  if (!is_loopback(bound.address->ai_addr) || names_loopback(host)) {
    return listening;
  }
  const int family = bound.address->ai_family;
  const int chosen_port = bound_port(bound.fd);
  const auto every = resolve_tcp(family == AF_INET6 ? "::" : "0.0.0.0", chosen_port, AI_NUMERICHOST | AI_PASSIVE);
  ::close(bound.fd);
  const Bound wide = bind_first(every, /*listen=*/true, /*reuse_address=*/true);
  if (wide.fd >= 0) {
    listening.fd = wide.fd;
    listening.every_interface = true;
    return listening;
  }
  // Another interface holds the port: serve where the name resolves, as before.
  listening.fd = bind_first(addresses, /*listen=*/true, /*reuse_address=*/true).fd;
  listening.error = listening.fd < 0 ? wide.error : "";
  return listening;
}

} // namespace detail
} // namespace lockstep
