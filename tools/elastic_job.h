#pragma once

// An elastic job on this node (--rdzv-backend c10d, --nnodes MIN:MAX): the
// rendezvous store served or reached at --rdzv-endpoint, the checks that
// this node belongs to the job there, and the agent (tools/elastic_agent.h).

#include "elastic_agent.h"
#include "job_record.h"
#include "kv_store.h"

#include <common/cli_checks.h>
#include <common/sockets.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

namespace lockstep {
namespace tools {

/// The store's server, when --rdzv-endpoint is an address of this machine
/// and its port is free; nullptr when another launcher serves it. A host
/// name that resolves to loopback here listens on every interface (Note [A
/// server named by a host name]). The store names its job (Note [One store,
/// one job]).
inline std::unique_ptr<KvServer> serve_rendezvous(const Options& options) {
  if (options.is_host == 0) {
    return nullptr; // --rdzv-conf is_host=false
  }
  const auto listening = detail::listen_as(options.rdzv_host, options.rdzv_port);
  if (listening.fd < 0 && options.is_host == 1) {
    throw RendezvousError("--rdzv-conf is_host=true, but this node cannot serve the store at --rdzv-endpoint " +
                          options.rdzv_host + ":" + std::to_string(options.rdzv_port) + " (" + listening.error +
                          "): give an address of this machine and a free port, or drop is_host.");
  }
  if (listening.fd < 0) {
    return nullptr; // not this machine's address, or its port is taken: the store's launcher is elsewhere
  }
  return std::make_unique<KvServer>(listening.fd, std::map<std::string, std::string>{{kServedJobKey, options.rdzv_job}});
}

/// Whether --rdzv-endpoint is an address of this machine whose port something
/// already holds: another launcher of the job, or another program.
inline bool endpoint_port_taken_here(const Options& options) {
  const auto bound = detail::bind_first(detail::resolve_tcp(options.rdzv_host, options.rdzv_port), /*listen=*/false,
                                        /*reuse_address=*/true);
  if (bound.fd >= 0) {
    ::close(bound.fd);
    return false;
  }
  return bound.error_code == EADDRINUSE;
}

// A store on this machine answers within milliseconds: what holds the port
// and says nothing for this long is not one.
constexpr Millis kLocalStoreAnswer{2000};

/// The terms this node asks of its job (Note [The job's first node sets its terms]).
inline JobTerms job_terms(const Options& options) {
  JobTerms terms;
  terms.min_nodes = options.min_nodes;
  terms.max_nodes = options.nnodes;
  terms.max_restarts = options.max_restarts;
  terms.restart_delay_ms = std::llround(options.restart_delay * 1000.0);
  terms.command = options.command;
  return terms;
}

/// A client of the store at --rdzv-endpoint, waiting up to join_timeout for
/// the launcher that serves it to start. Throws KvError.
inline std::unique_ptr<KvClient> connect_to_store(const Options& options, Millis store_timeout) {
  const auto deadline = Clock::now() + seconds_to_ms(options.join_timeout);
  for (bool said = false;;) { // the node that serves the store may start after this one
    try {
      return std::make_unique<KvClient>(options.rdzv_host, options.rdzv_port, store_timeout);
    } catch (const KvError& e) {
      if (Clock::now() > deadline || g_launcher_signal != 0) {
        throw;
      }
      if (!said) {
        std::fprintf(stderr, "lockstep-run: waiting up to join_timeout (%.0f s) for the store at %s:%d, which the "
                     "launcher on that machine serves: %s\n", options.join_timeout, options.rdzv_host.c_str(),
                     options.rdzv_port, e.what());
        said = true;
      }
      std::this_thread::sleep_for(Millis(200));
    }
  }
}

/// An elastic job on this node: serves the rendezvous store if
/// --rdzv-endpoint is here, then runs the agent. A store of another job, a
/// port held by another program, or a job whose terms differ from this
/// node's, is refused at once (exit 2, Note [One store, one job], Note [The
/// job's first node sets its terms]); every later store failure is an
/// error that names the store.
inline int run_elastic(const Options& options, const std::string& program) {
  const auto store_timeout = options.read_timeout > 0 ? seconds_to_ms(options.read_timeout)
      : std::max(Millis(2000), seconds_to_ms(options.keep_alive_interval * options.keep_alive_max_attempt));
  try {
    const auto server = serve_rendezvous(options);
    const bool taken_here = server == nullptr && options.is_host != 0 && endpoint_port_taken_here(options);
    const auto kv = connect_to_store(options, store_timeout);
    kv->set_timeout(taken_here ? std::min(kLocalStoreAnswer, store_timeout) : store_timeout);
    std::optional<std::string> refused = check_served_job(*kv, options.rdzv_job, kv->where());
    kv->set_timeout(store_timeout);
    if (refused->empty()) {
      refused = agree_on_terms(*kv, rendezvous_settings(options), job_terms(options), options.rdzv_job.empty(),
                               kv->where(), Clock::now() + seconds_to_ms(options.join_timeout),
                               [] { return g_launcher_signal != 0; });
    }
    if (!refused) {
      std::fprintf(stderr, "lockstep-run: stopped by signal %d while it waited for the job's first node to record the "
                   "job's terms at %s.\n", static_cast<int>(g_launcher_signal), kv->where().c_str());
      return 128 + g_launcher_signal;
    }
    if (!refused->empty()) {
      std::fprintf(stderr, "lockstep-run: %s\nRun 'lockstep-run --help' for usage.\n", refused->c_str());
      return common::kUsageError;
    }
    ElasticAgent agent(options, program, *kv, server != nullptr);
    return agent.run();
  } catch (const KvError& e) {
    if (g_launcher_signal != 0) { // a Ctrl-C while it waited for the store: not a lost store
      std::fprintf(stderr, "lockstep-run: stopped by signal %d while it waited for the rendezvous store at %s:%d.\n",
                   static_cast<int>(g_launcher_signal), options.rdzv_host.c_str(), options.rdzv_port);
      return 128 + g_launcher_signal;
    }
    std::fprintf(stderr, "lockstep-run: %s. The launcher on --rdzv-endpoint %s:%d serves the rendezvous: it has "
                 "stopped, or this node lost its link to it, so the job cannot go on here.\n", e.what(),
                 options.rdzv_host.c_str(), options.rdzv_port);
  } catch (const RendezvousError& e) {
    std::fprintf(stderr, "lockstep-run: %s\n", e.what());
  }
  return 1;
}

} // namespace tools
} // namespace lockstep
