// The store of init_process_group: Note [Store address].

#include "comm/store.h"

#include "util/torch_compat.h"

#include <common/sockets.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>

namespace lockstep {
namespace detail {
namespace {

// Note [Store address]
// ~~~~~~~~~~~~~~~~~~~~
// Rank 0's TCPStore hands out every rank's connection details, so it should
// listen only where the ranks reach it: MASTER_ADDR (every interface where
// MASTER_ADDR is a host name this machine maps to loopback: Note [A server
// named by a host name] in sockets.h). c10d's TCPStore binds
// every interface by itself; PyTorch 2.x lets it take a socket we bound
// instead (TCPStoreOptions::masterListenFd), and so we do. LibTorch 1.13
// cannot, and listens on every interface at MASTER_PORT.

// MASTER_ADDR's TCP addresses, or an error at once: a name that does not
// resolve would otherwise have the store retry it for the whole timeout.
Addresses resolve_master(const std::string& host, uint16_t port, int64_t rank) {
  auto addresses = resolve_tcp(host, port);
  TORCH_CHECK(addresses.first() != nullptr, "lockstep: rank ", rank, ": MASTER_ADDR ", host, " does not resolve (",
              addresses.error, "); expected the host name or IP address of rank 0's machine, reachable from every rank.");
  return addresses;
}

// A TCP socket listening for host:port (Note [A server named by a host
// name]), or an error naming both.
int listen_on(const std::string& host, uint16_t port) {
  resolve_master(host, port, 0);
  const Listening listening = listen_as(host, port);
  TORCH_CHECK(listening.fd >= 0, "cannot listen on ", host, ":", port, ": ", listening.error);
  return listening.fd;
}

} // namespace

c10::intrusive_ptr<c10d::Store> make_store(const LaunchEnv& env, const ProcessGroupOptions& options) {
  // lockstep-run on one node names a file for the store: then nothing listens
  // on the network at all (see docs/design.md on TCPStore's binding).
  const char* store_file = std::getenv("LOCKSTEP_STORE_FILE");
  if (store_file != nullptr && *store_file != '\0' && options.master_addr().empty()) {
    auto store = c10::make_intrusive<c10d::FileStore>(store_file, static_cast<int>(env.world_size));
    store->setTimeout(env.timeout); // c10d's default is 300 s, whatever the group's timeout
    return store;
  }
  // Under torchrun's static rendezvous (and its c10d rendezvous in 2.x), the
  // agent already hosts a TCPStore on MASTER_PORT and says so: then every
  // rank is its client, as PyTorch's env:// is, and keys live under a prefix
  // per restart attempt, because the agent's store outlives the attempts.
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0 && !env.agent_store;
  store_options.numWorkers = static_cast<size_t>(env.world_size);
  store_options.waitWorkers = true;
  store_options.timeout = env.timeout;
  resolve_master(env.master_addr, store_options.port, env.rank);
  if (store_options.isServer && !kStoreTakesListenSocket) {
    std::cerr << "lockstep: warning: rank 0's store listens on every interface at port " << env.master_port
              << ", not only on MASTER_ADDR " << env.master_addr << ": LibTorch " << TORCH_VERSION
              << "'s TCPStore cannot be bound to one address (PyTorch 2.x's can). On a shared network, keep the port "
              << "closed to other machines.\n";
  }
  c10::intrusive_ptr<c10d::Store> store;
  const auto start = std::chrono::steady_clock::now();
  try {
    if (store_options.isServer && kStoreTakesListenSocket) {
      // Listen on MASTER_ADDR only, not on every interface (Note [Store address]).
      set_listen_socket(store_options, listen_on(env.master_addr, store_options.port));
    }
    store = make_tcp_store(env.master_addr, store_options);
  } catch (const std::exception& e) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    const bool timed_out = waited >= env.timeout;
    TORCH_CHECK(false, "lockstep: rank ", env.rank, " could not ", store_options.isServer ? "start" : "reach",
                env.agent_store ? " torchrun's agent store" : " the store", " at ", env.master_addr, ":", env.master_port,
                timed_out ? " within " : " (failed after ", timed_out ? env.timeout.count() : waited.count(),
                timed_out                ? " ms: did every rank start, and can it reach MASTER_ADDR?): "
                    : store_options.isServer ? " ms: is the port free?): "
                    : env.agent_store        ? " ms: torchrun's agent serves it; is it running?): "
                                             : " ms: rank 0 serves the store; has it started, or did it exit?): ",
                e.what());
  }
  if (env.agent_store) {
    store = c10::make_intrusive<c10d::PrefixStore>("lockstep/attempt_" + std::to_string(env.restart_count), store);
  }
  return store;
}

} // namespace detail
} // namespace lockstep
