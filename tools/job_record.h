#pragma once

// What every node of an elastic job must agree on, recorded in the
// rendezvous store by the job's first node and checked by each node that
// comes after (Note [The job's first node sets its terms]).

#include "kv_store.h"
#include "rendezvous_records.h"

#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace tools {

// Note [The job's first node sets its terms]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// As a static job's nodes compare their --nnodes with node 0's (Note
// [Static nodes add up their counts] in tools/static_meeting.h), an elastic
// job's nodes must agree on theirs: else a node of --nnodes 1 runs the job
// alone, and one of --nnodes 2 at the same endpoint waits behind it and
// exits 0, "nothing to do", having run nothing. So the first node to reach the store (it takes "job/claim") writes the
// job's terms ("job"): --nnodes MIN:MAX, --max-restarts, --restart-delay
// (nodes that back off for different times after a failure would close a
// round at MIN without the slowest, which then forces another), and its PROGRAM
// and ARGS as given (not the path PATH finds: it may differ between the
// machines of one job). Every later node reads them before it takes a node
// id, and is refused at once (exit 2) where its own differ, told both. The
// program is compared only when the job has no id at all (Note [The
// rendezvous's id] in tools/run_id.h): then it is what tells two jobs at
// one endpoint apart. With an id, the nodes of one job may run different
// commands (srun --multi-prog), and a job of another id is refused
// already (Note [One store, one job]).

/// The terms of an elastic job.
struct JobTerms {
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;
  /// --restart-delay in whole milliseconds: nodes that back off for
  /// different times before a restart would meet in different rounds.
  int64_t restart_delay_ms = 1000;
  std::vector<std::string> command; // PROGRAM and ARGS, as given

  /// "1:2 0 1000 PROGRAM ARGS": each word of the command escaped, so that the
  /// record is one line of the store's protocol whatever the arguments hold.
  std::string encode() const {
    std::string text = std::to_string(min_nodes) + ":" + std::to_string(max_nodes) + " " + std::to_string(max_restarts) +
        " " + std::to_string(restart_delay_ms);
    for (const auto& word : command) {
      text += " " + escape(word);
    }
    return text;
  }
  /// Throws RendezvousError on text that encode() did not write.
  static JobTerms decode(const std::string& text) {
    const auto words = split_record(text, ' ');
    const size_t colon = words[0].find(':');
    if (words.size() < 3 || colon == std::string::npos) {
      throw malformed_record("job", text, "expected MIN:MAX, --max-restarts, --restart-delay and the program");
    }
    JobTerms terms;
    terms.min_nodes = static_cast<int>(record_number(words[0].substr(0, colon), "job", text));
    terms.max_nodes = static_cast<int>(record_number(words[0].substr(colon + 1), "job", text));
    terms.max_restarts = static_cast<int>(record_number(words[1], "job", text));
    terms.restart_delay_ms = record_number(words[2], "job", text);
    for (size_t i = 3; i < words.size(); ++i) {
      terms.command.push_back(unescape(words[i]));
    }
    return terms;
  }

  /// "1:2", or "2" for MIN = MAX: as --nnodes is given.
  std::string nnodes() const {
    return min_nodes == max_nodes ? std::to_string(max_nodes) : std::to_string(min_nodes) + ":" + std::to_string(max_nodes);
  }
  /// The command as a shell line would show it, cut after 200 characters.
  std::string shown_command() const {
    std::string text;
    for (const auto& word : command) {
      const bool quote = word.empty() || word.find_first_of(" \t") != std::string::npos;
      text += (text.empty() ? "" : " ") + (quote ? "\"" + word + "\"" : word);
    }
    return text.size() > 200 ? text.substr(0, 200) + "..." : text;
  }

 private:
  // Spaces, '%' and bytes outside printable ASCII become %XX.
  static std::string escape(const std::string& word) {
    static const char* kHex = "0123456789ABCDEF";
    std::string out = word.empty() ? "%" : ""; // the empty word: a lone '%'
    for (unsigned char c : word) {
      if (c > ' ' && c < 0x7f && c != '%') {
        out += static_cast<char>(c);
      } else {
        out += std::string("%") + kHex[c >> 4] + kHex[c & 15];
      }
    }
    return out;
  }
  static std::string unescape(const std::string& word) {
    const auto hex = [](char c) { return c <= '9' ? c - '0' : c - 'A' + 10; };
    std::string out;
    for (size_t i = 0; i < word.size(); ++i) {
      if (word[i] != '%') {
        out += word[i];
      } else if (i + 2 < word.size()) { // %XX; a lone '%' is the empty word
        out += static_cast<char>(hex(word[i + 1]) * 16 + hex(word[i + 2]));
        i += 2;
      }
    }
    return out;
  }
};

/// 1500 ms as "1.5", as --restart-delay is given: to the millisecond.
inline std::string seconds_text(int64_t ms) {
  std::string text = std::to_string(ms / 1000);
  if (ms % 1000 != 0) {
    char fraction[8];
    std::snprintf(fraction, sizeof(fraction), ".%03lld", static_cast<long long>(ms % 1000));
    text += fraction;
    text.erase(text.find_last_not_of('0') + 1);
  }
  return text;
}

/// Empty when `mine` may join the job whose terms `recorded` are; else
/// the message that refuses this node, naming both. `where` is the
/// endpoint; `compare_command`: whether the job has no id (Note [The job's
/// first node sets its terms]).
inline std::string compare_terms(const JobTerms& recorded, const JobTerms& mine, bool compare_command,
                                 const std::string& where) {
  if (compare_command && recorded.command != mine.command) {
    return "another job serves the rendezvous at --rdzv-endpoint " + where + ": its first node runs '" +
        recorded.shown_command() + "', this node '" + mine.shown_command() + "', and neither job has an id (no "
        "--rdzv-id, no Slurm job). Give each job its own --rdzv-id, or its own --rdzv-endpoint port; if these nodes "
        "are one job, give every node the same --rdzv-id.";
  }
  const std::string job = "the job at --rdzv-endpoint " + where + " was started with ";
  if (recorded.min_nodes != mine.min_nodes || recorded.max_nodes != mine.max_nodes) {
    return "this node has --nnodes " + mine.nnodes() + ", but " + job + "--nnodes " + recorded.nnodes() + " by its "
        "first node: give every node of the job the same --nnodes.";
  }
  if (recorded.max_restarts != mine.max_restarts) {
    return "this node has --max-restarts " + std::to_string(mine.max_restarts) + ", but " + job + "--max-restarts " +
        std::to_string(recorded.max_restarts) + " by its first node: give every node of the job the same "
        "--max-restarts.";
  }
  if (recorded.restart_delay_ms != mine.restart_delay_ms) {
    return "this node has --restart-delay " + seconds_text(mine.restart_delay_ms) + ", but " + job + "--restart-delay " +
        seconds_text(recorded.restart_delay_ms) + " by its first node: give every node of the job the same "
        "--restart-delay.";
  }
  return "";
}

/// This node's side of Note [The job's first node sets its terms]: ""
/// when it may join, else the refusal. Waits for the first node to write
/// the terms until `deadline`, or until `stop` says a signal came (then
/// nullopt). Throws RendezvousError at the deadline, KvError if the store fails.
inline std::optional<std::string> agree_on_terms(KeyValue& kv, const RendezvousSettings& s, const JobTerms& mine,
                                                 bool compare_command, const std::string& where,
                                                 RdzvClock::time_point deadline, const std::function<bool()>& stop) {
  if (kv.add(s.key("job/claim"), 1) == 1) {
    kv.set(s.key("job"), mine.encode());
    return std::string();
  }
  std::optional<std::string> recorded;
  while (!(recorded = kv.get(s.key("job")))) {
    if (stop()) {
      return std::nullopt;
    }
    if (RdzvClock::now() > deadline) {
      throw RendezvousError("the job's first node at --rdzv-endpoint " + where + " did not record the job's "
                            "--nnodes and program within join_timeout: it stopped as it started. Start it again.");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return compare_terms(JobTerms::decode(*recorded), mine, compare_command, where);
}

} // namespace tools
} // namespace lockstep
