#pragma once

// The desync report lockstep-run prints after a failed job: from the ranks'
// flight records (Note [Flight recorder] in src/comm/flight_recorder.cpp), the
// first collective where the ranks disagree or where some never arrived.

#include <common/rank_list.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace lockstep {
namespace tools {

inline std::string trace_file(const std::string& dir, int rank) {
  return dir + "/lockstep_trace_rank" + std::to_string(rank) + ".json";
}

using common::rank_list;

// Whether a rank's last lines say that it gave up waiting for the others in
// a collective or the store: lockstep's "did not complete within", Gloo's
// "Timed out waiting", c10d's stores' "Wait timeout", "Socket Timeout",
// "Read timeout" and "Timeout waiting for key", NCCL's watchdog's
// "collective operation timeout". Not the bare word: a usage error about a
// --timeout or LOCKSTEP_TIMEOUT waited for nobody.
inline bool gave_up_waiting(const std::vector<std::string>& last_lines) {
  for (const auto& line : last_lines) {
    std::string lower = line;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    for (const char* words : {"did not complete within", "timed out", "wait timeout", "socket timeout", "read timeout",
                              "timeout waiting", "operation timeout"}) {
      if (lower.find(words) != std::string::npos) {
        return true;
      }
    }
  }
  return false;
}

// "allreduce (sum) of 4096 Float, allreduce of bucket 2 (3 parameters, 0.0 MiB)"
inline std::string describe_collective(const nlohmann::json& c) {
  std::string text = c.value("op", "?");
  if (!c.value("arg", "").empty()) {
    text += " (" + c.value("arg", "") + ")";
  }
  if (c.value("op", "") != "barrier") {
    text += " of " + std::to_string(c.value("numel", int64_t{0})) + " " + c.value("dtype", "?");
  }
  if (!c.value("what", "").empty() && c.value("what", "") != c.value("op", "")) {
    text += ", " + c.value("what", "");
  }
  return text;
}

// The shape counts too: an allreduce of 4 values is not one of 2 x 2 (the
// ranks' check refuses it, and the report must not call that agreement).
inline bool same_collective(const nlohmann::json& a, const nlohmann::json& b) {
  return a.value("op", "") == b.value("op", "") && a.value("arg", "") == b.value("arg", "") &&
      a.value("dtype", "") == b.value("dtype", "") && a.value("numel", int64_t{0}) == b.value("numel", int64_t{0}) &&
      a.value("shape", nlohmann::json()) == b.value("shape", nlohmann::json());
}

// describe_collective, with the shape where it alone tells `c` from `other`.
inline std::string describe_against(const nlohmann::json& c, const nlohmann::json& other) {
  const std::string text = describe_collective(c);
  if (text != describe_collective(other)) {
    return text;
  }
  return text + " shaped " + c.value("shape", nlohmann::json()).dump();
}

// The earliest collective of `group` that did not complete after the last
// that did (a failure before that was survived), or null.
inline nlohmann::json first_unfinished(const nlohmann::json& group) {
  nlohmann::json first = nullptr;
  for (const auto& c : group.value("collectives", nlohmann::json::array())) {
    if (c.value("state", "") == "completed") {
      first = nullptr;
    } else if (first.is_null()) {
      first = c;
    }
  }
  return first;
}

// `absent` never started the collective `what` names, which the other
// ranks' records (`started`) hold: how long those waited in it.
inline std::string never_started(const std::vector<int>& absent, const std::map<int, nlohmann::json>& started,
                                 const std::string& what) {
  std::vector<int> waiting;
  double waited_s = 0;
  for (const auto& [rank, c] : started) {
    if (c.value("state", "") != "completed") {
      waiting.push_back(rank);
      waited_s = std::max(waited_s, c.value("waited_ms", c.value("duration_ms", 0.0)) / 1000.0);
    }
  }
  char tail[128] = "";
  if (!waiting.empty()) {
    std::snprintf(tail, sizeof(tail), "; %s waited %.1f s in it", rank_list(waiting).c_str(), waited_s);
  }
  return rank_list(absent) + " never started " + what + tail + ".";
}

// Some ranks stopped at collective #`seq`, which the others' records no
// longer hold (each keeps the last LOCKSTEP_TRACE_BUFFER_SIZE): who stopped
// there is known, what the collective was is not.
inline std::string forgotten_collective(const std::map<int, nlohmann::json>& groups, int64_t seq) {
  std::vector<int> stopped;
  for (const auto& [rank, group] : groups) {
    if (group.value("issued", int64_t{0}) == seq) {
      stopped.push_back(rank);
    }
  }
  return rank_list(stopped) + " never started collective #" + std::to_string(seq) +
      ", which the other ranks' flight records no longer hold: they went on past it. Run again with a larger "
      "LOCKSTEP_TRACE_BUFFER_SIZE to see which collective it was.";
}

// "ranks 0 to 3 and 8 to 11": runs of three or more ranks as ranges.
inline std::string rank_ranges(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (size_t k = 0; k < ranks.size();) {
    size_t end = k;
    while (end + 1 < ranks.size() && ranks[end + 1] == ranks[end] + 1) {
      ++end;
    }
    if (end - k >= 2) {
      parts.push_back(std::to_string(ranks[k]) + " to " + std::to_string(ranks[end]));
      k = end + 1;
    } else {
      parts.push_back(std::to_string(ranks[k++]));
    }
  }
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t k = 0; k < parts.size(); ++k) {
    text += (k == 0 ? "" : k + 1 == parts.size() ? " and " : ", ") + parts[k];
  }
  return text;
}

// Ranks that ran on other nodes, whose records this launcher cannot read:
// "ranks 0 and 1 ran on other nodes, so they are not in these records".
inline std::string other_nodes_text(const std::vector<int>& elsewhere) {
  return rank_ranges(elsewhere) + (elsewhere.size() == 1 ? " ran on another node, so it is" : " ran on other nodes, so "
      "they are") + " not in these records";
}

// One group's records indexed by rank and sequence number, with the range of
// numbers that every rank's record still holds.
struct SeqRecords {
  std::map<int, std::map<int64_t, nlohmann::json>> by_seq;
  int64_t lo = 0;
  int64_t hi = -1;
  int64_t fewest = -1; // issued by the rank that issued the fewest
};

inline SeqRecords index_by_seq(const std::map<int, nlohmann::json>& groups) {
  SeqRecords records;
  for (const auto& [rank, group] : groups) {
    auto& mine = records.by_seq[rank];
    const int64_t issued = group.value("issued", int64_t{0});
    int64_t first = issued;
    for (const auto& c : group.value("collectives", nlohmann::json::array())) {
      mine[c.value("seq", int64_t{0})] = c;
      first = std::min(first, c.value("seq", int64_t{0}));
    }
    records.lo = std::max(records.lo, first); // below it, some rank's buffer has forgotten
    records.hi = std::max(records.hi, issued - 1);
    records.fewest = records.fewest < 0 ? issued : std::min(records.fewest, issued);
  }
  return records;
}

// Collective #s started by every rank in `present` and not completed on
// some: the transport's fault when `everyone` ran here, else maybe a rank
// `elsewhere`'s. Empty when it completed everywhere.
inline std::string unfinished_text(SeqRecords& records, int64_t s, const std::vector<int>& present,
                                   const std::string& what, bool everyone, const std::vector<int>& elsewhere) {
  std::vector<int> unfinished;
  for (int r : present) {
    if (records.by_seq[r][s].value("state", "") != "completed") {
      unfinished.push_back(r);
    }
  }
  if (!unfinished.empty() && everyone && !elsewhere.empty()) {
    return "every rank of this node started " + what + ", and it did not complete on " + rank_list(unfinished) +
        "; " + other_nodes_text(elsewhere) + ": one of them may have died or stalled there. See the output of "
        "their nodes' launchers (the root cause and desync report there).";
  }
  if (!unfinished.empty() && everyone) {
    return "every rank started " + what + ", and it did not complete on " + rank_list(unfinished) +
        ": the ranks agree, so the connection between them failed or was too slow (see the errors above).";
  }
  return "";
}

// Where the ranks part at collective #s, or "" if they agree on it.
inline std::string desync_at(SeqRecords& records, int64_t s, const std::map<int, nlohmann::json>& groups, bool everyone,
                             const std::vector<int>& elsewhere) {
  std::vector<int> absent;
  std::vector<int> present;
  for (const auto& [rank, group] : groups) {
    (s < group.value("issued", int64_t{0}) ? present : absent).push_back(rank);
  }
  if (present.empty()) {
    return "";
  }
  const auto& first = records.by_seq[present[0]][s];
  const std::string what = "collective #" + std::to_string(s) + " (" + describe_collective(first) + ")";
  if (!absent.empty()) {
    std::map<int, nlohmann::json> started; // the present ranks' record of #s
    for (int r : present) {
      started[r] = records.by_seq[r][s];
    }
    return never_started(absent, started, what);
  }
  for (size_t k = 1; k < present.size(); ++k) {
    const auto& other = records.by_seq[present[k]][s];
    if (!same_collective(first, other)) {
      return "rank " + std::to_string(present[0]) + " ran " + describe_against(first, other) + " as #" +
          std::to_string(s) + " where rank " + std::to_string(present[k]) + " ran " + describe_against(other, first) +
          ": the ranks issued different collectives from here on.";
    }
  }
  return unfinished_text(records, s, present, what, everyone, elsewhere);
}

// Whether a failure at #s was survived: a collective issued after it
// failed completed. Completing needs every rank, so one rank's record
// proves it for all; issued after: started once #s had ended on that rank
// (one issued before #s's wait threw, and waited for first, proves
// nothing). The record, written anew at each failure (Note [Every failure
// dumps] in src/comm/flight_recorder.cpp), may still hold such a failure.
inline bool survived(SeqRecords& records, int64_t s) {
  for (auto& [rank, mine] : records.by_seq) {
    const auto failed = mine.find(s);
    if (failed == mine.end() || failed->second.value("state", "") != "failed") {
      continue;
    }
    const double ended = failed->second.value("started_unix_ms", 0.0) + failed->second.value("duration_ms", 0.0);
    for (auto later = std::next(failed); later != mine.end(); ++later) {
      if (later->second.value("state", "") == "completed" &&
          later->second.value("started_unix_ms", 0.0) >= static_cast<double>(static_cast<int64_t>(ended))) {
        return true;
      }
    }
  }
  return false;
}

// One group's records, by rank: the first sequence number where they part.
// Empty when they agree. `everyone`: no rank's record is missing, so a
// collective that every record started and none finished is the transport's
// fault, unless ranks ran `elsewhere` (on other nodes): one of those may
// have died or stalled, and only their own launcher's records say.
inline std::string find_desync(const std::map<int, nlohmann::json>& groups, bool everyone,
                               const std::vector<int>& elsewhere = {}) {
  auto records = index_by_seq(groups);
  if (records.fewest < records.lo && records.fewest <= records.hi) {
    return forgotten_collective(groups, records.fewest);
  }
  for (int64_t s = records.lo; s <= records.hi; ++s) {
    auto found = desync_at(records, s, groups, everyone, elsewhere);
    if (!found.empty() && !survived(records, s)) {
      return found;
    }
  }
  return "";
}

// The report's lines: `ranks` are the ranks this launcher ran, `elsewhere`
// those of the other nodes (Note [A report from one node's records]).
// Empty when no rank wrote one.
//
// Note [A report from one node's records]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each launcher reads its own node's records alone. When a rank of another
// node dies, this node's ranks agree with each other and wait in the same
// collective: from these records alone that reads as a failed link. So the
// report names the ranks it has no record of, and sends the reader to
// their launchers' output rather than blaming the connection.
// Why `missing` (which left no record) never joined: `finished` ranks exited
// normally, so they issued fewer collectives than the others; the rest were
// stopped or died.
inline std::string why_absent(const std::vector<int>& missing, const std::vector<int>& finished) {
  std::vector<int> done, stopped;
  for (int r : missing) {
    (std::find(finished.begin(), finished.end(), r) != finished.end() ? done : stopped).push_back(r);
  }
  std::string text;
  if (!done.empty()) {
    text = rank_list(done) + " exited" + " normally (code 0) without it, having "
        "issued fewer collectives than the others: a loop of another length, an early return, or fewer batches "
        "there (lockstep's join() handles uneven inputs)";
  }
  if (!stopped.empty()) {
    text += (text.empty() ? "" : "; ") + rank_list(stopped) + " left no record of " +
        (stopped.size() == 1 ? "its" : "their") + " last collectives, so " +
        (stopped.size() == 1 ? "it was" : "they were") + " stopped or died before any collective failed there (" +
        (stopped.size() == 1 ? "its" : "their") + " own output says which)";
  }
  return text + ".";
}

// The records without those written before a collective they do not hold
// that another rank's record shows completed, started after the first was
// written: a rank writes at a failure, so one that survived a failure and
// then stopped or exited keeps a record of that failure, and it must have
// issued that later collective too.
inline std::map<int, nlohmann::json> current_records(const std::map<int, nlohmann::json>& records) {
  std::map<int, nlohmann::json> current;
  for (const auto& [rank, record] : records) {
    const auto mine = record.value("groups", nlohmann::json::array());
    const int64_t dumped = record.value("dumped_unix_ms", int64_t{0});
    bool stale = false;
    for (const auto& [other, theirs] : records) {
      const auto groups = theirs.value("groups", nlohmann::json::array());
      for (size_t g = 0; g < std::min(mine.size(), groups.size()) && !stale; ++g) {
        const int64_t issued = mine[g].value("issued", int64_t{0});
        for (const auto& c : groups[g].value("collectives", nlohmann::json::array())) {
          stale = stale || (c.value("state", "") == "completed" && c.value("seq", int64_t{0}) >= issued &&
                            c.value("started_unix_ms", int64_t{0}) > dumped);
        }
      }
    }
    if (!stale) {
      current[rank] = record;
    }
  }
  return current;
}

inline std::vector<std::string> desync_report(const std::map<int, nlohmann::json>& all_records,
                                              const std::vector<int>& ranks, const std::vector<int>& elsewhere = {},
                                              const std::vector<int>& finished = {}) {
  std::vector<std::string> lines;
  const auto records = current_records(all_records);
  if (records.empty()) {
    return lines;
  }
  std::vector<int> missing;
  for (int r : ranks) {
    if (records.count(r) == 0) {
      missing.push_back(r);
    }
  }
  size_t groups = 0;
  for (const auto& [rank, record] : records) {
    groups = std::max(groups, record.value("groups", nlohmann::json::array()).size());
  }
  for (size_t g = 0; g < groups; ++g) {
    std::map<int, nlohmann::json> group;
    for (const auto& [rank, record] : records) {
      const auto all = record.value("groups", nlohmann::json::array());
      if (g < all.size()) {
        group[rank] = all[g];
      }
    }
    const std::string prefix = groups > 1 ? "group " + std::to_string(g) + ": " : "";
    const auto finding = find_desync(group, missing.empty(), elsewhere);
    if (!finding.empty()) {
      lines.push_back(prefix + finding);
      return lines;
    }
    if (missing.empty()) {
      continue;
    }
    // The ranks with a record agree; the others left none. Where the first
    // of those with a record got stuck is where the others are missing.
    for (const auto& [rank, record] : group) {
      const auto stuck = first_unfinished(record);
      if (stuck.is_null()) {
        continue;
      }
      char waited[64];
      std::snprintf(waited, sizeof(waited), "%.1f s", stuck.value("waited_ms", stuck.value("duration_ms", 0.0)) / 1000.0);
      lines.push_back(prefix + "rank " + std::to_string(rank) + " waited " + waited + " in collective #" +
                      std::to_string(stuck.value("seq", int64_t{0})) + " (" + describe_collective(stuck) + "), which " +
                      rank_list(missing) + " never joined: " + why_absent(missing, finished));
      return lines;
    }
  }
  for (int r : missing) {
    const bool done = std::find(finished.begin(), finished.end(), r) != finished.end();
    lines.push_back("rank " + std::to_string(r) + (done ? " exited normally (code 0) and left no flight record."
                                                         : " left no flight record: it was stopped or died before a "
                                                           "collective failed on it (its own output says which)."));
  }
  lines.push_back("the flight records agree: every rank that wrote one ran the same collectives, and each "
                  "completed; the failure was not in a collective (see the root cause above)." +
                  (elsewhere.empty() ? std::string() : " " + other_nodes_text(elsewhere) + "; see their nodes' launchers."));
  return lines;
}

// Reads the records of `ranks` from `dir`. A file that does not parse counts
// as no record, with a line saying so.
inline std::vector<std::string> desync_report(const std::string& dir, const std::vector<int>& ranks,
                                              const std::vector<int>& elsewhere = {},
                                              const std::vector<int>& finished = {}) {
  std::map<int, nlohmann::json> records;
  std::vector<std::string> unreadable;
  for (int r : ranks) {
    std::ifstream in(trace_file(dir, r));
    if (!in) {
      continue;
    }
    auto record = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded() || !record.is_object()) {
      unreadable.push_back(trace_file(dir, r) + " is not a flight record (unreadable JSON); ignored.");
      continue;
    }
    records[r] = std::move(record);
  }
  auto lines = desync_report(records, ranks, elsewhere, finished);
  lines.insert(lines.begin(), unreadable.begin(), unreadable.end());
  return lines;
}

} // namespace tools
} // namespace lockstep
