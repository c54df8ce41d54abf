#pragma once

// The launchers of a static job (--node-rank, several nodes) meet once,
// before their first ranks start, to add up their --nproc-per-node.
//
// Note [Static nodes add up their counts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every rank needs the job's WORLD_SIZE and its own RANK, which depend on
// how many ranks every node starts. torchrun's static rendezvous adds up
// the nodes' counts, as lockstep-run's elastic rounds do; a launcher that
// assumed every node had its own count gave nodes of 1 and 2 ranks world
// sizes 2 and 4, no rank 1, and ranks that waited the whole --timeout.
//
// So node 0's launcher serves a store (tools/kv_store.h) at --master-addr:
// --master-port for the meeting, before its rank 0 takes that port. Each
// node takes its place ("claim/K": a second node with the same --node-rank
// is refused) and writes its count ("nproc/K"); node 0 writes the list once
// every node has ("counts"); each node's first rank is the sum of the
// counts before it. Node 0 closes the store once every node says it has
// read the list ("read/K"), and the other nodes start their ranks only once
// their connection has closed: no rank's store client may reach the
// meeting's store. Node 0 writes its --nnodes first ("nnodes"), and a node
// whose own differs stops with an error before it takes a place, instead of
// starting ranks numbered past WORLD_SIZE. Restarts keep the counts: they
// meet only once.

#include "kv_store.h"
#include "run_options.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace tools {

/// Where one node's ranks stand among every node's.
struct StaticLayout {
  int rank_offset = 0;
  int world_size = 0;
  std::vector<int> counts; // --nproc-per-node of each node, by --node-rank
};

/// Node `node_rank`'s place when the nodes start `counts` ranks each.
inline StaticLayout static_layout(const std::vector<int>& counts, int node_rank) {
  StaticLayout layout;
  layout.counts = counts;
  for (size_t node = 0; node < counts.size(); ++node) {
    layout.rank_offset += static_cast<int>(node) < node_rank ? counts[node] : 0;
    layout.world_size += counts[node];
  }
  return layout;
}

/// "node 0: 1, node 1: 2"
inline std::string describe_counts(const std::vector<int>& counts) {
  std::string text;
  for (size_t node = 0; node < counts.size(); ++node) {
    text += (node == 0 ? "node " : ", node ") + std::to_string(node) + ": " + std::to_string(counts[node]);
  }
  return text;
}

inline std::string encode_counts(const std::vector<int>& counts) {
  std::string text;
  for (int count : counts) {
    text += (text.empty() ? "" : ",") + std::to_string(count);
  }
  return text;
}

inline std::vector<int> decode_counts(const std::string& text) {
  std::vector<int> counts;
  for (size_t start = 0; start < text.size();) {
    const size_t comma = std::min(text.find(',', start), text.size());
    counts.push_back(std::atoi(text.substr(start, comma - start).c_str()));
    start = comma + 1;
  }
  return counts;
}

/// The meeting could not happen: the message says why, and what to do.
struct MeetingError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// One static node's side of Note [Static nodes add up their counts], over
/// a store that node 0 serves. `stop` says a signal came.
class StaticMeeting {
 public:
  using Clock = std::chrono::steady_clock;

  StaticMeeting(const RunOptions& options, std::chrono::seconds wait, std::function<bool()> stop)
      : options_(options), deadline_(Clock::now() + wait), wait_(wait), stop_(std::move(stop)) {}

  /// This node's layout; nullopt on a signal. Throws MeetingError.
  std::optional<StaticLayout> meet() {
    const int me = options_.node_rank;
    std::unique_ptr<KvServer> server;
    if (me == 0) {
      const auto listening = detail::listen_as(options_.master_addr, options_.master_port);
      if (listening.fd < 0) {
        throw MeetingError("cannot listen on --master-addr " + where() + " (" + listening.error + ").");
      }
      server = std::make_unique<KvServer>(listening.fd);
    }
    const auto kv = connect();
    if (!kv) {
      return std::nullopt;
    }
    if (me == 0) {
      kv->set("run_id", options_.run_id_shared ? options_.run_id : ""); // first: a node that reads nnodes finds it
      kv->set("nnodes", std::to_string(options_.nnodes));
    } else if (!check_nnodes(*kv)) {
      return std::nullopt;
    }
    if (kv->add("claim/" + std::to_string(me), 1) != 1) {
      throw MeetingError("another node already gave --node-rank " + std::to_string(me) + " to node 0's launcher at " +
                         where() + ": give each node its own --node-rank, 0 to " + std::to_string(options_.nnodes - 1) +
                         ".");
    }
    kv->set("nproc/" + std::to_string(me), std::to_string(options_.nproc_per_node));
    if (me == 0 && !wait_for_every_node(*kv, "nproc/")) {
      return std::nullopt;
    }
    if (me == 0) {
      kv->set("counts", encode_counts(counts_of(*kv)));
    }
    std::optional<std::string> counts;
    missing_text_ = "node 0's launcher at " + where() + " did not hear from every node";
    while (!(counts = kv->get("counts"))) {
      if (!pause()) {
        return std::nullopt;
      }
    }
    kv->set("read/" + std::to_string(me), "1");
    if (me == 0) {
      wait_for_every_node(*kv, "read/"); // past the deadline, the others' ranks fail on their own
      server.reset();
    } else {
      wait_until_closed(*kv);
    }
    return static_layout(decode_counts(*counts), me);
  }

 private:
  // Two jobs on one --master-addr:--master-port (two sruns of one
  // allocation, both on the first host's default port) would meet as one,
  // mixing their programs: a node whose job id (--rdzv-id, LOCKSTEP_RUN_ID
  // or Slurm's job and step) differs from node 0's is refused. Ids made of
  // a start time differ between nodes anyway, and are not compared.
  void check_same_job(KvClient& kv) const {
    const std::string theirs = kv.get("run_id").value_or("");
    if (!options_.run_id_shared || theirs.empty() || theirs == options_.run_id) {
      return;
    }
    throw MeetingError("node 0's launcher at " + where() + " runs job '" + theirs + "', but this node is of job '" +
                       options_.run_id + "' (the ids of --rdzv-id, LOCKSTEP_RUN_ID or Slurm's job and step): two jobs "
                       "meet at one address. Give each job its own --master-port; or, if these nodes are one job, "
                       "give every node the same --rdzv-id (or LOCKSTEP_RUN_ID).");
  }

  // Whether this node is of node 0's job (check_same_job) and its --nnodes
  // is node 0's: its ranks would otherwise be numbered past WORLD_SIZE, or
  // count nodes that never come. False on a signal; throws where they differ.
  bool check_nnodes(KvClient& kv) {
    std::optional<std::string> theirs;
    missing_text_ = "node 0's launcher at " + where() + " did not say how many nodes the job has";
    while (!(theirs = kv.get("nnodes"))) {
      if (!pause()) {
        return false;
      }
    }
    check_same_job(kv); // node 0 wrote the job's id before --nnodes
    if (std::atoi(theirs->c_str()) != options_.nnodes) {
      throw MeetingError("node 0's launcher at " + where() + " runs a job of " + *theirs + " nodes (its --nnodes), "
                         "but this node has --nnodes " + std::to_string(options_.nnodes) + ": give every node the "
                         "same --nnodes.");
    }
    return true;
  }

  std::string where() const {
    return options_.master_addr + ":" + std::to_string(options_.master_port);
  }

  // False on a signal; throws at the deadline.
  bool pause() {
    if (stop_()) {
      return false;
    }
    if (Clock::now() > deadline_) {
      throw MeetingError("the nodes did not all meet within " + std::to_string(wait_.count()) + " s (--timeout): " +
                         missing_text_ + ". Start every node, 0 to " +
                         std::to_string(options_.nnodes - 1) + ", with the same --nnodes, --master-addr and "
                         "--master-port.");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return true;
  }

  // Node 0's store, once it listens (the other nodes may start first).
  std::unique_ptr<KvClient> connect() {
    while (true) {
      try {
        return std::make_unique<KvClient>(options_.master_addr, options_.master_port, std::chrono::seconds(10));
      } catch (const KvError& e) {
        if (options_.node_rank == 0) {
          throw MeetingError(std::string("node 0 cannot reach its own meeting store: ") + e.what());
        }
        missing_text_ = "node 0's launcher never answered at " + where() + " (the last try: " + e.what() + ")";
        if (!pause()) {
          return nullptr;
        }
      }
    }
  }

  bool wait_for_every_node(KvClient& kv, const std::string& prefix) {
    for (int node = 1; node < options_.nnodes;) {
      if (kv.get(prefix + std::to_string(node))) {
        ++node;
        continue;
      }
      missing_text_ = "node " + std::to_string(node) + " never reached node 0's launcher at " + where();
      if (prefix == "read/" && Clock::now() > deadline_) {
        return false;
      }
      if (!pause()) {
        return false;
      }
    }
    return true;
  }

  std::vector<int> counts_of(KvClient& kv) {
    std::vector<int> counts;
    for (int node = 0; node < options_.nnodes; ++node) {
      counts.push_back(std::atoi(kv.get("nproc/" + std::to_string(node)).value_or("0").c_str()));
    }
    return counts;
  }

  // Until node 0 has closed its store (this node's connection ends), for 10 s at most.
  void wait_until_closed(KvClient& kv) {
    const auto until = Clock::now() + std::chrono::seconds(10);
    try {
      while (Clock::now() < until && !stop_()) {
        kv.get("counts");
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const KvError&) {
      // closed: node 0's rank 0 may take the port
    }
  }

  const RunOptions& options_;
  Clock::time_point deadline_;
  std::chrono::seconds wait_;
  std::function<bool()> stop_;
  std::string missing_text_;
};

} // namespace tools
} // namespace lockstep
