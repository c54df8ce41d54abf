#pragma once

// lockstep-run's --rdzv-conf KEY=VALUE,...: the elastic rendezvous's
// timings and store, under torchrun's keys (Note [torchrun's --rdzv-conf
// keys]). Parsed without side effects: bad input goes to `fail`.

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace lockstep {
namespace tools {

using Fail = std::function<void(const std::string&)>;

/// What --rdzv-conf sets (seconds unless said). torchrun's defaults.
struct RdzvConf {
  double join_timeout = 600, last_call_timeout = 30, keep_alive_interval = 5;
  int keep_alive_max_attempt = 3;
  double read_timeout = 0; // seconds a store operation may take; 0: the liveness window, at least 2 s
  int is_host = -1;        // 1 serve the store, 0 never, -1 if the endpoint is here
};

// Note [torchrun's --rdzv-conf keys]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchrun's c10d rendezvous reads join_timeout, last_call_timeout,
// close_timeout, heartbeat_timeout, keep_alive_interval,
// keep_alive_max_attempt and cas_backoff_max_seconds (dynamic_rendezvous.py),
// and is_host, read_timeout and store_type (c10d_rendezvous_backend.py);
// torchrun's command lines carry them, so each is taken here:
// - the same meaning here: join_timeout, last_call_timeout,
//   keep_alive_interval, keep_alive_max_attempt, is_host, read_timeout (the
//   deadline of one store operation; torchrun's is its TCPStore's), and
//   store_type=tcp, the one store lockstep-run has (store_type=file is
//   refused: there is no file store to give);
// - no effect here, said once at start: close_timeout (a round closes at
//   MAX nodes, or last_call_timeout after MIN), heartbeat_timeout (the
//   deadline of one heartbeat's store operation: here read_timeout bounds
//   it, as every operation), cas_backoff_max_seconds (the backoff between
//   compare-and-set retries; this store's counters are atomic, no retry);
// - two names differ from torchrun's, as --help says: `timeout` sets
//   join_timeout (torchrun's launcher always passes it, and only its
//   static and etcd rendezvous read it: how long the nodes wait for each
//   other), and `heartbeat` is lockstep-run's short name for
//   keep_alive_interval (not torchrun's heartbeat_timeout).

/// --rdzv-conf's keys, lockstep-run's aliases to the name they set.
inline std::string rdzv_conf_key(const std::string& key) {
  if (key == "timeout") {
    return "join_timeout";
  }
  if (key == "heartbeat") {
    return "keep_alive_interval";
  }
  return key;
}

inline std::string lower_case(const std::string& text) {
  std::string lower;
  for (unsigned char c : text) {
    lower += static_cast<char>(std::tolower(c));
  }
  return lower;
}

// --rdzv-conf is_host=VALUE, as torchrun reads it.
inline int parse_is_host(const std::string& item, const std::string& value, const Fail& fail) {
  const std::string lower = lower_case(value);
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "y") {
    return 1;
  }
  if (lower == "0" || lower == "false" || lower == "no" || lower == "n") {
    return 0;
  }
  fail("--rdzv-conf " + item + ": expected is_host=true or is_host=false (1 or 0).");
  return -1;
}

// --rdzv-conf store_type=VALUE: torchrun's tcp or file; lockstep-run's store is TCP.
inline void check_store_type(const std::string& item, const std::string& value, const Fail& fail) {
  std::string type = lower_case(value);
  type.erase(0, type.find_first_not_of(" \t"));
  type.erase(type.find_last_not_of(" \t") + 1);
  if (type == "file") {
    fail("--rdzv-conf " + item + ": lockstep-run's rendezvous store is served over TCP at --rdzv-endpoint, and it has "
         "no file store; drop store_type, or give store_type=tcp.");
  } else if (type != "tcp") {
    fail("--rdzv-conf " + item + ": expected store_type=tcp (torchrun's default, and lockstep-run's only store).");
  }
}

// What a key that has no effect here says (Note [torchrun's --rdzv-conf keys]).
inline std::string no_effect_note(const std::string& key) {
  if (key == "close_timeout") {
    return "--rdzv-conf close_timeout has no effect: a lockstep-run round closes when --nnodes MAX nodes joined, or "
           "last_call_timeout after MIN did.";
  }
  if (key == "heartbeat_timeout") {
    return "--rdzv-conf heartbeat_timeout has no effect: a heartbeat is one store operation, which read_timeout bounds "
           "as every other.";
  }
  return "--rdzv-conf cas_backoff_max_seconds has no effect: lockstep-run's rendezvous store counts atomically, so "
         "no write is retried.";
}

// The number of `item`'s VALUE: seconds above 0 (from 0 where `zero_ok`),
// or a whole count where `count`.
inline double rdzv_conf_number(const std::string& item, const std::string& value, bool count, bool zero_ok,
                               const Fail& fail) {
  char* end = nullptr;
  const double number = std::strtod(value.c_str(), &end);
  const bool in_range = !value.empty() && *end == '\0' && (number > 0 || (zero_ok && number == 0)) &&
      number <= 7 * 24 * 3600;
  if (!in_range || (count && number != std::floor(number))) {
    fail("--rdzv-conf " + item + (count ? ": expected a whole count from 1 to 604800." : zero_ok ? ": expected a "
         "number of seconds from 0 to 604800 (7 days)." : ": expected a number of seconds above 0 and at most 604800 "
         "(7 days)."));
  }
  return number;
}

// One KEY=VALUE of --rdzv-conf, whose key (after the aliases) is `key`.
inline void parse_rdzv_setting(RdzvConf& conf, std::vector<std::string>& notes, const std::string& item,
                               const std::string& key, const std::string& value, const Fail& fail) {
  if (key == "is_host") {
    conf.is_host = parse_is_host(item, value, fail);
    return;
  }
  if (key == "store_type") {
    check_store_type(item, value, fail);
    return;
  }
  const bool count = key == "keep_alive_max_attempt";
  const bool no_effect = key == "close_timeout" || key == "heartbeat_timeout" || key == "cas_backoff_max_seconds";
  const bool known = count || no_effect || key == "join_timeout" || key == "last_call_timeout" ||
      key == "keep_alive_interval" || key == "read_timeout";
  if (!known) {
    fail("--rdzv-conf " + item + ": unknown key; expected join_timeout (or timeout), last_call_timeout, "
         "keep_alive_interval (or heartbeat), keep_alive_max_attempt, read_timeout, is_host, store_type, or "
         "torchrun's close_timeout, heartbeat_timeout or cas_backoff_max_seconds (accepted, no effect).");
  }
  const double number = rdzv_conf_number(item, value, count, key == "cas_backoff_max_seconds", fail);
  if (key == "join_timeout") {
    conf.join_timeout = number;
  } else if (key == "last_call_timeout") {
    conf.last_call_timeout = number;
  } else if (key == "keep_alive_interval") {
    conf.keep_alive_interval = number;
  } else if (key == "read_timeout") {
    conf.read_timeout = number;
  } else if (count) {
    conf.keep_alive_max_attempt = static_cast<int>(number);
  } else {
    notes.push_back(no_effect_note(key));
  }
}

/// --rdzv-conf `text` into `conf`: each key once (an alias counts as its
/// key), no empty item; keys without effect add a note.
inline void parse_rdzv_conf(const std::string& text, RdzvConf& conf, std::vector<std::string>& notes,
                            const Fail& fail) {
  std::vector<std::string> seen;
  int index = 0;
  for (size_t start = 0; start <= text.size() && !text.empty(); ++index) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    start = comma + 1;
    if (item.empty()) {
      fail("--rdzv-conf " + text + ": item " + std::to_string(index + 1) + " is empty; expected KEY=VALUE items "
           "separated by single commas.");
    }
    const size_t eq = item.find('=');
    const std::string key = rdzv_conf_key(item.substr(0, eq));
    for (const auto& earlier : seen) {
      if (rdzv_conf_key(earlier) == key) {
        fail("--rdzv-conf " + text + ": " + (earlier == item.substr(0, eq) ? key + " is given twice" : earlier +
             " and " + item.substr(0, eq) + " both set " + key) + "; give it once.");
      }
    }
    seen.push_back(item.substr(0, eq));
    parse_rdzv_setting(conf, notes, item, key, eq == std::string::npos ? "" : item.substr(eq + 1), fail);
  }
}

} // namespace tools
} // namespace lockstep
