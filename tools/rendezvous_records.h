#pragma once

// The records of lockstep-run's elastic rendezvous (Note [Elastic
// rendezvous] in tools/rendezvous.h): its settings, a node as the others see
// it, a closed round, and where one node stands in it.

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep {
namespace tools {

using RdzvClock = std::chrono::steady_clock;

/// A rendezvous that cannot go on: a clear error for every node.
struct RendezvousError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// --nnodes MIN:MAX, --rdzv-id and --rdzv-conf's timings (torchrun's names).
struct RendezvousSettings {
  int min_nodes = 1;
  int max_nodes = 1;
  std::string id = "none";
  std::chrono::milliseconds join_timeout{600000};
  std::chrono::milliseconds last_call{30000};
  std::chrono::milliseconds keep_alive_interval{5000};
  int keep_alive_max_attempt = 3;

  std::chrono::milliseconds liveness_window() const {
    return keep_alive_interval * keep_alive_max_attempt;
  }
  std::string key(const std::string& name) const {
    return id + "/" + name;
  }
  std::string key(int64_t round, const std::string& name) const {
    return id + "/r" + std::to_string(round) + "/" + name;
  }
};

// Note [Records that do not parse]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The records are text that other launchers wrote into the store: a node
// of another lockstep-run version, or a program that is not one, can leave
// text that does not parse. Every node reads it, the one that serves the
// store too, so an exception the launcher does not catch
// (std::invalid_argument) would abort them all; decode throws
// RendezvousError, which each launcher reports and exits 1 on.

/// `text` split at every `separator` ("a,,b": "a", "", "b").
inline std::vector<std::string> split_record(const std::string& text, char separator) {
  std::vector<std::string> fields;
  size_t start = 0;
  for (size_t at; (at = text.find(separator, start)) != std::string::npos; start = at + 1) {
    fields.push_back(text.substr(start, at - start));
  }
  fields.push_back(text.substr(start));
  return fields;
}

inline RendezvousError malformed_record(const std::string& what, const std::string& text, const std::string& why) {
  return RendezvousError("the rendezvous store holds a " + what + " record that does not parse ('" + text + "': " +
                         why + "): a launcher of another lockstep-run version, or another program, wrote it. Give "
                         "every node the same lockstep-run, and this job an --rdzv-endpoint port of its own.");
}

/// A whole number of `text`'s; throws RendezvousError on anything else.
inline int64_t record_number(const std::string& field, const std::string& what, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(field.c_str(), &end, 10);
  if (field.empty() || *end != '\0' || errno != 0 || value < 0 || value > (int64_t{1} << 40)) {
    throw malformed_record(what, text, "'" + field + "' is not a count");
  }
  return value;
}

/// A node as the others see it: its id, its ranks, the address it reaches
/// the store from, and a free port there for its workers' store.
struct NodeDesc {
  int64_t id = 0;
  int nproc = 1;
  std::string addr;
  int port = 0;

  std::string encode() const {
    return std::to_string(id) + "," + std::to_string(nproc) + "," + addr + "," + std::to_string(port);
  }
  /// Throws RendezvousError on text that encode() did not write.
  static NodeDesc decode(const std::string& text) {
    const auto fields = split_record(text, ',');
    if (fields.size() != 4) {
      throw malformed_record("node", text, "expected 4 fields (id,ranks,address,port), found " +
                             std::to_string(fields.size()));
    }
    NodeDesc d;
    d.id = record_number(fields[0], "node", text);
    d.nproc = static_cast<int>(record_number(fields[1], "node", text));
    d.addr = fields[2];
    d.port = static_cast<int>(record_number(fields[3], "node", text));
    return d;
  }
};

/// A closed round: its members in rank order, and the failures so far.
struct RoundRecord {
  int64_t round = 0;
  int64_t restarts = 0;
  std::vector<NodeDesc> nodes;

  std::string encode() const {
    std::string text = std::to_string(restarts);
    for (const auto& n : nodes) {
      text += ";" + n.encode();
    }
    return text;
  }
  /// Throws RendezvousError on text that encode() did not write.
  static RoundRecord decode(int64_t round, const std::string& text) {
    const auto fields = split_record(text, ';');
    RoundRecord r;
    r.round = round;
    r.restarts = record_number(fields[0], "round", text);
    for (size_t i = 1; i < fields.size(); ++i) {
      r.nodes.push_back(NodeDesc::decode(fields[i]));
    }
    return r;
  }
};

/// Where one node stands in a closed round: what its workers are told.
struct Assignment {
  int64_t round = 0;
  int64_t restarts = 0;
  int group_rank = -1; // -1: not a member
  int group_world_size = 0;
  int rank_offset = 0; // the global rank of its first worker
  int world_size = 0;
  std::string master_addr; // group rank 0's address and port: rank 0's store
  int master_port = 0;
  std::vector<int64_t> members; // by group rank

  /// Member `id`'s group rank (GROUP_RANK) in this round, or -1: the
  /// launchers' messages number nodes so, never by their ids.
  int group_rank_of(int64_t id) const {
    const auto it = std::find(members.begin(), members.end(), id);
    return it == members.end() ? -1 : static_cast<int>(it - members.begin());
  }
  /// "0, 2": the group ranks of members `ids`.
  std::string group_ranks(const std::vector<int64_t>& ids) const {
    std::string text;
    for (int64_t id : ids) {
      text += (text.empty() ? "" : ", ") + std::to_string(group_rank_of(id));
    }
    return text;
  }
};

/// "complete" for a job whose every member finished; else the group ranks
/// of those that failed, in the last round.
inline const std::string kJobSucceeded = "ok";

/// The address a node gives the others for its ranks, from the numeric
/// address it reaches the endpoint's host from. A loopback one means that
/// the endpoint is this machine, whose name may map to 127.0.1.1 here (as
/// Debian's /etc/hosts does): the others would each reach their own
/// loopback. They reach this machine by the endpoint's host, as they did for
/// the rendezvous, so that is its address (torchrun gives its host name too).
inline std::string reachable_address(const std::string& local_numeric, const std::string& endpoint_host) {
  const bool loopback = local_numeric.rfind("127.", 0) == 0 || local_numeric == "::1" ||
      local_numeric.rfind("::ffff:127.", 0) == 0;
  return loopback ? endpoint_host : local_numeric;
}

inline Assignment assign(const RoundRecord& record, int64_t node_id) {
  Assignment a;
  a.round = record.round;
  a.restarts = record.restarts;
  a.group_world_size = static_cast<int>(record.nodes.size());
  for (size_t i = 0; i < record.nodes.size(); ++i) {
    const NodeDesc& n = record.nodes[i];
    if (n.id == node_id) {
      a.group_rank = static_cast<int>(i);
      a.rank_offset = a.world_size;
    }
    a.world_size += n.nproc;
    a.members.push_back(n.id);
  }
  if (!record.nodes.empty()) {
    a.master_addr = record.nodes[0].addr;
    a.master_port = record.nodes[0].port;
  }
  return a;
}

} // namespace tools
} // namespace lockstep
