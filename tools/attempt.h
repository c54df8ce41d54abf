#pragma once

// One attempt of a job on this node: lockstep-run's ranks started, watched
// and stopped (Note [Launcher lifecycle] in tools/lockstep_run.cpp), and what
// the launcher says about a failed one. Where the attempt's ranks stand in
// the job (Placement) comes from the command line, or from an elastic round
// (tools/elastic_agent.h).

#include "desync_report.h"
#include "ranks.h"
#include "run_options.h"
#include "timeline_merge.h"

#include <common/process_files.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep {
namespace tools {

using Clock = std::chrono::steady_clock;
constexpr auto kSettle = std::chrono::milliseconds(1000); // Attempt::run: before SIGTERM after a failure

/// The signal that asked the launcher to stop (SIGINT, SIGTERM, SIGHUP), or 0.
inline volatile sig_atomic_t g_launcher_signal = 0;

using Options = RunOptions;

constexpr double kMaxRestartDelay = 30.0;

/// Seconds before restart `restart` + 1 (restarts count from 0):
/// --restart-delay, doubled for each restart before it, at most 30. A
/// failure that repeats at once (a busy port, a node still starting)
/// should not burn the restarts in a second.
inline double restart_delay_seconds(const Options& options, int restart) {
  return std::min(options.restart_delay * std::pow(2.0, restart), kMaxRestartDelay);
}

/// Sleeps `seconds` unless a signal comes first; false if one did.
inline bool sleep_unless_signalled(double seconds) {
  const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (g_launcher_signal == 0 && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return g_launcher_signal == 0;
}

/// Where this node's ranks stand in one attempt of the job.
struct Placement {
  int group_rank = 0;       // the node's index
  int group_world_size = 1; // nodes
  int rank_offset = 0;      // the global rank of the node's first rank
  int world_size = 1;
  int restart_count = 0;    // failures so far (TORCHELASTIC_RESTART_COUNT)
  int attempt = 0;          // this launcher's attempts so far: names its files
  std::string master_addr;
  int master_port = 0;
  bool file_store = false;  // one node: the ranks' store is a file (LOCKSTEP_STORE_FILE)
  std::string round_text;   // ", round N" in the logs of an elastic job
};

inline std::string store_file_prefix() {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/lockstep-store-";
}

inline std::string trace_dir_prefix() {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/lockstep-trace-";
}

class Attempt {
 public:
  Attempt(const Options& options, const std::string& program, const Placement& placement)
      : options_(options), program_(program), placement_(placement), restart_count_(placement.restart_count) {
    if (placement_.file_store) {
      // One node: lockstep's init_process_group keeps its store in this file,
      // so nothing listens on the network. A new file per attempt: a restart
      // must not read the keys of the attempt before.
      store_file_ = store_file_prefix() + std::to_string(::getpid()) + "-" + std::to_string(placement_.attempt);
      ::unlink(store_file_.c_str());
    }
    // Where the ranks write their flight records when a collective fails
    // (Note [Flight recorder] in src/comm/flight_recorder.cpp): --log-dir, or a
    // folder of this attempt's own. The caller's LOCKSTEP_TRACE_DIR wins.
    const char* preset = std::getenv("LOCKSTEP_TRACE_DIR");
    if (preset != nullptr && *preset != '\0') {
      trace_dir_ = preset;
    } else if (!options_.log_dir.empty()) {
      trace_dir_ = options_.log_dir;
    } else {
      trace_dir_ = trace_dir_prefix() + std::to_string(::getpid()) + "-" + std::to_string(placement_.attempt);
      own_trace_dir_ = ::mkdir(trace_dir_.c_str(), 0700) == 0;
    }
    for (int local = 0; local < options_.nproc_per_node; ++local) { // a record of the attempt before would mislead
      const int rank = placement_.rank_offset + local;
      ::unlink(lockstep::tools::trace_file(trace_dir_, rank).c_str());
      ::unlink(timeline_part(rank).c_str());
    }
  }
  ~Attempt() {
    if (!all_done()) { // left by an exception (the elastic store lost): no rank outlives its attempt
      signal_all(SIGKILL);
      for (auto& r : ranks_) {
        ::waitpid(r.pid, &r.status, 0);
      }
    }
    if (!store_file_.empty()) {
      ::unlink(store_file_.c_str());
    }
    if (own_trace_dir_) {
      lockstep::common::remove_shallow(trace_dir_);
    }
  }

  // --timeline FILE: this node's ranks' timelines merged; false if FILE
  // could not be written (said). A restart's merge moves the attempt
  // before's FILE aside first, so that FILE is the last attempt's and the
  // failed ones stay beside it.
  bool merge_timeline() const {
    if (options_.timeline.empty()) {
      return true;
    }
    if (placement_.attempt > 0) {
      lockstep::tools::keep_attempt_timeline(options_.timeline, placement_.attempt - 1);
    }
    std::vector<std::pair<int, std::string>> parts;
    for (const auto& r : ranks_) {
      parts.emplace_back(r.global_rank, timeline_part(r.global_rank));
    }
    return lockstep::tools::merge_timelines(parts, options_.timeline);
  }

  // The desync report from the ranks' flight records; nothing when none wrote one.
  void print_desync_report() const {
    std::vector<int> ranks, finished; // finished: exited 0
    for (const auto& r : ranks_) {
      ranks.push_back(r.global_rank);
      if (r.done && !failed(r.status)) {
        finished.push_back(r.global_rank);
      }
    }
    std::vector<int> elsewhere; // the other nodes' ranks
    for (int rank = 0; rank < placement_.world_size; ++rank) {
      if (rank < placement_.rank_offset || rank >= placement_.rank_offset + static_cast<int>(ranks_.size())) {
        elsewhere.push_back(rank);
      }
    }
    const auto lines = lockstep::tools::desync_report(trace_dir_, ranks, elsewhere, finished);
    if (lines.empty()) {
      return;
    }
    std::fprintf(stderr, "lockstep-run: desync report, from the ranks' flight records in %s:\n", trace_dir_.c_str());
    for (const auto& line : lines) {
      std::fprintf(stderr, "  %s\n", line.c_str());
    }
  }

  // Runs the ranks to the end. Returns the index of the root-cause rank, or
  // -1 if every rank succeeded or `keep_going`, asked every 100 ms, said to
  // stop them (elastic rounds: Note [Elastic rendezvous]).
  int run(const std::function<bool()>& keep_going = [] { return true; }) {
    start_ranks();
    int root_cause = -1;
    Clock::time_point stop_at = Clock::time_point::max();
    Clock::time_point stop_deadline = Clock::time_point::max();
    bool stopping = false;
    bool terminated = false;
    while (true) {
      lockstep::tools::pump(ranks_, 100);
      reap();
      if (root_cause < 0 && !stopping) { // a rank that fails once the others are being stopped is not the cause
        root_cause = first_failed();
      }
      if (!stopping && root_cause < 0 && all_done()) {
        break; // every rank succeeded: a round's end seen in the same moment must not undo that
      }
      const int sig = g_launcher_signal;
      const bool told_to_stop = !keep_going();
      if (!stopping && (root_cause >= 0 || sig != 0 || told_to_stop)) {
        stopping = true;
        for (auto& r : ranks_) {
          r.running_at_stop = !r.done;
        }
        // Ranks that fail in the same collective end within moments of each
        // other: give them kSettle to write their flight records before
        // SIGTERM ends them. A signal to the launcher goes on at once.
        stop_at = sig != 0 || (told_to_stop && root_cause < 0) ? Clock::now() : Clock::now() + kSettle;
      }
      if (stopping && !terminated && Clock::now() >= stop_at) {
        terminated = true;
        signal_all(sig != 0 ? sig : SIGTERM);
        stop_deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(options_.grace_seconds * 1000));
      }
      if (all_done()) {
        break;
      }
      if (terminated && Clock::now() >= stop_deadline) {
        for (auto& r : ranks_) {
          r.killed_after_grace = !r.done;
        }
        signal_all(SIGKILL);
        stop_deadline = Clock::time_point::max();
      }
    }
    lockstep::tools::pump(ranks_, 0);
    lockstep::tools::flush_partials(ranks_);
    lockstep::tools::close_pipes(ranks_);
    return root_cause;
  }

  const Rank& rank(int i) const {
    return ranks_[i];
  }

 private:
  // Starts every rank of this node. See Note [Launcher lifecycle].
  void start_ranks() {
    ranks_ = std::vector<Rank>(options_.nproc_per_node);
    ended_ = 0;
    for (int local = 0; local < options_.nproc_per_node; ++local) {
      Rank& r = ranks_[local];
      r.local_rank = local;
      r.global_rank = placement_.rank_offset + local;
      const auto& shown = options_.local_ranks_shown;
      r.shown = shown.empty() || std::find(shown.begin(), shown.end(), local) != shown.end();
      open_log(r);
      lockstep::tools::spawn_rank(r, program_, options_.command, child_environment(r), group_);
    }
  }

  int world_size() const {
    return placement_.world_size;
  }

  // DIR/rank_N.log, when --log-dir is given. Attempts and jobs append to the
  // same file: a header tells them apart.
  void open_log(Rank& r) {
    if (options_.log_dir.empty()) {
      return;
    }
    r.log.open(options_.log_dir + "/rank_" + std::to_string(r.global_rank) + ".log", std::ios::app);
    r.log << "==== lockstep-run " << now_text() << ": attempt " << restart_count_ + 1 << " of at most "
          << options_.max_restarts + 1 << placement_.round_text << ", rank " << r.global_rank << " of " << world_size() << ":";
    for (const auto& a : options_.command) {
      r.log << ' ' << a;
    }
    r.log << " ====" << std::endl;
  }

  // What rank `r` gets on top of the launcher's own environment: torchrun's
  // variables, so that a program written for torchrun runs unchanged, and
  // lockstep's (restart count, store file, run id, timeout). Each rank gets
  // its share of the cores as OMP_NUM_THREADS unless the launcher's
  // environment sets it.
  std::vector<std::pair<std::string, std::string>> child_environment(const Rank& r) const {
    std::vector<std::pair<std::string, std::string>> env{
        {"RANK", std::to_string(r.global_rank)},
        {"LOCAL_RANK", std::to_string(r.local_rank)},
        {"WORLD_SIZE", std::to_string(world_size())},
        {"LOCAL_WORLD_SIZE", std::to_string(options_.nproc_per_node)},
        {"GROUP_RANK", std::to_string(placement_.group_rank)},
        {"GROUP_WORLD_SIZE", std::to_string(placement_.group_world_size)},
        {"ROLE_NAME", options_.role},
        {"ROLE_RANK", std::to_string(r.global_rank)},
        {"ROLE_WORLD_SIZE", std::to_string(world_size())},
        {"MASTER_ADDR", placement_.master_addr},
        {"MASTER_PORT", std::to_string(placement_.master_port)},
        {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count_)},
        {"TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts)},
        {"TORCHELASTIC_RUN_ID", options_.run_id},
        {"LOCKSTEP_RESTART_COUNT", std::to_string(restart_count_)},
        // Set either way, as torchrun sets it: an inherited "True" (this
        // launcher under torchrun's agent) would send the ranks to an agent's
        // store that nobody serves here.
        {"TORCHELASTIC_USE_AGENT_STORE", "False"},
        // Empty (no file) unless this node's ranks share one: an inherited
        // file would split a job of several nodes.
        {"LOCKSTEP_STORE_FILE", store_file_},
    };
    env.emplace_back("LOCKSTEP_TRACE_DIR", trace_dir_);
    if (!options_.timeline.empty()) {
      env.emplace_back("LOCKSTEP_TIMELINE", trace_dir_ + "/lockstep_timeline_rank%r.json"); // the rank fills in %r
    }
    env.emplace_back("LOCKSTEP_RUN_ID", options_.run_id);
    if (options_.timeout_seconds > 0) {
      env.emplace_back("LOCKSTEP_TIMEOUT", std::to_string(options_.timeout_seconds));
    }
    if (std::getenv("OMP_NUM_THREADS") == nullptr) {
      env.emplace_back("OMP_NUM_THREADS", std::to_string(std::max(1, usable_cores() / options_.nproc_per_node)));
    }
    return env;
  }

  // Note [When a rank ended]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~
  // The root cause is the rank that failed first, and a rank that fails
  // because another did (a collective whose peer is gone) follows it within
  // milliseconds. Waking only on output or every 100 ms, the launcher would
  // reap both in one pass and name the lower index. Each rank's pidfd is in
  // pump's poll set instead, so the launcher wakes as each rank ends and
  // numbers the ends in that order.
  void reap() {
    for (auto& r : ranks_) {
      if (!r.done && ::waitpid(r.pid, &r.status, WNOHANG) == r.pid) {
        r.done = true;
        r.end_order = ++ended_;
        if (r.exit_fd >= 0) {
          ::close(r.exit_fd);
          r.exit_fd = -1;
        }
      }
    }
  }

  // The rank that ended first with a failure, or -1.
  int first_failed() const {
    int first = -1;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      const Rank& r = ranks_[i];
      if (r.done && failed(r.status) && (first < 0 || r.end_order < ranks_[first].end_order)) {
        first = static_cast<int>(i);
      }
    }
    return first;
  }

  bool all_done() const {
    for (const auto& r : ranks_) {
      if (!r.done) {
        return false;
      }
    }
    return true;
  }

  void signal_all(int sig) {
    if (group_ > 0) {
      ::kill(-group_, sig); // every rank, and whatever they started
    }
  }

  const Options& options_;
  std::string program_;
  Placement placement_;
  int restart_count_;
  std::vector<Rank> ranks_;
  int ended_ = 0; // ranks of this attempt reaped so far
  pid_t group_ = 0;
  std::string store_file_;
  std::string trace_dir_;
  bool own_trace_dir_ = false;

  std::string timeline_part(int rank) const {
    return trace_dir_ + "/lockstep_timeline_rank" + std::to_string(rank) + ".json";
  }
};

inline void print_root_cause(const Rank& r) {
  std::fprintf(stderr, "lockstep-run: rank %d (local rank %d, pid %d) failed: %s\n", r.global_rank, r.local_rank, r.pid,
               describe_status(r.status).c_str());
  if (!r.err_tail.empty()) {
    std::fprintf(stderr, "lockstep-run: last lines of rank %d's stderr:\n", r.global_rank);
    for (const auto& line : r.err_tail) {
      std::fprintf(stderr, "  %s\n", line.c_str());
    }
  } else {
    std::fprintf(stderr, "lockstep-run: rank %d wrote nothing to stderr.\n", r.global_rank);
  }
}

// After a signal to the launcher: each rank still running the grace period
// after it was passed on, and so killed with SIGKILL. A rank that saves a
// checkpoint on SIGTERM (a preempted Slurm job) lost it: said, with the flag
// that gives it longer.
inline void print_killed_on_signal(const Attempt& run, int world_on_node, double grace_seconds) {
  for (int i = 0; i < world_on_node; ++i) {
    const Rank& r = run.rank(i);
    if (r.killed_after_grace) {
      std::fprintf(stderr,
                   "lockstep-run: rank %d (pid %d) was still running %.1f s after the signal and was killed with "
                   "SIGKILL; whatever it did on the signal (saving a checkpoint) did not finish. Give it longer with "
                   "--grace-period SECONDS (torchrun waits 30).\n",
                   r.global_rank, r.pid, grace_seconds);
    }
  }
}

// The first rank to fail is not always the culprit: a rank that stalls makes
// the others time out and fail first. Name the ranks that were still running.
inline void print_stalled_ranks(const Attempt& run, int root_cause, int world_on_node, double grace_seconds) {
  const Rank& first = run.rank(root_cause);
  const bool waited = gave_up_waiting({first.err_tail.begin(), first.err_tail.end()});
  for (int i = 0; i < world_on_node; ++i) {
    const Rank& r = run.rank(i);
    if (i == root_cause || !r.running_at_stop) {
      continue;
    }
    if (r.killed_after_grace) {
      std::fprintf(stderr,
                   "lockstep-run: rank %d (pid %d) had stopped responding: it ignored SIGTERM and was killed with "
                   "SIGKILL after the %.1f s grace period.%s\n",
                   r.global_rank, r.pid, grace_seconds,
                   waited ? (" Rank " + std::to_string(first.global_rank) +
                             " failed first only because it gave up waiting for it: look at this rank first.").c_str()
                          : "");
    } else if (waited) {
      std::fprintf(stderr,
                   "lockstep-run: rank %d was still running when rank %d gave up waiting in a collective: it may be "
                   "the rank that stalled (it stopped on SIGTERM).\n",
                   r.global_rank, first.global_rank);
    }
  }
}


} // namespace tools
} // namespace lockstep
