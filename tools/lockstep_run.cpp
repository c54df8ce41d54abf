// lockstep-run: starts, watches and restarts the ranks of a job, with
// torchrun's environment variables, so a program written for torchrun runs
// unchanged.
//
//   lockstep-run [--nproc-per-node N] [--nnodes M --node-rank R --master-addr A --master-port P]
//                [--max-restarts K] [--log-dir DIR] [--timeout S] [--timeline FILE] PROGRAM [ARGS...]
//
// Note [Launcher lifecycle]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A job is a series of attempts (class Attempt), each of four stages:
//
// Start (start_ranks). The launcher forks N ranks into one new process group,
// with their stdout and stderr on pipes and PR_SET_PDEATHSIG, so that no rank
// outlives the launcher even if the launcher is killed with SIGKILL. Each
// rank gets torchrun's variables (child_environment) and LOCKSTEP_RUN_ID, the
// same for all attempts of the job (the launcher's start time unless it is
// set). On one node, ranks also get LOCKSTEP_STORE_FILE: lockstep's
// init_process_group then keeps its store in that file instead of a
// TCPStore, so nothing listens on the network; each attempt has its own file.
//
// Watch (Attempt::run). One loop polls the pipes, prefixing every line with
// its rank and copying it to --log-dir, and reaps the ranks.
//
// Stop (the same loop). The first rank to fail is the root cause: the
// others get SIGTERM, then SIGKILL after the grace period. The launcher
// prints which rank failed, how, and the last lines of its stderr, and names
// the ranks that had stopped responding (a stalled rank makes the others time
// out and fail first). SIGINT, SIGTERM and SIGHUP sent to the launcher go to
// every rank, and end the job the same way, without a restart.
//
// Restart (main). After a failure, the launcher starts a new attempt of the
// whole group after a doubling delay, up to --max-restarts times, or exits
// non-zero.

#include "desync_report.h"
#include "ranks.h"
#include "run_options.h"
#include "timeline_merge.h"

#include <common/process_files.h>

#include <lockstep/detail/sockets.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <deque>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

using lockstep::common::kUsageError;
constexpr double kMaxRestartDelay = 30.0;
constexpr auto kSettle = std::chrono::milliseconds(1000); // Attempt::run: before SIGTERM after a failure

volatile sig_atomic_t g_signal = 0;

void on_signal(int sig) {
  g_signal = sig;
}

using Options = lockstep::tools::RunOptions;
using lockstep::tools::Rank;
using lockstep::tools::describe_status;
using lockstep::tools::failed;
using lockstep::tools::now_text;

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "lockstep-run: %s\nRun 'lockstep-run --help' for usage.\n", message.c_str());
  std::exit(kUsageError);
}

// --log-dir, made with its parents as torchrun does, and --timeline, both
// checked by opening the files they will hold (common::open_for_append): a
// place no one can write would otherwise lose the logs silently, or the
// timeline at the end of the job.
void prepare_output_paths(const Options& options) {
  if (!options.log_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(options.log_dir, error);
    if (error) {
      usage_error("--log-dir " + options.log_dir + ": cannot create it (" + error.message() + "); pick another folder.");
    }
    for (int local = 0; local < options.nproc_per_node; ++local) {
      const std::string name = "rank_" + std::to_string(options.node_rank * options.nproc_per_node + local) + ".log";
      const std::string why = lockstep::common::open_for_append(options.log_dir + "/" + name);
      if (!why.empty()) {
        usage_error("--log-dir " + options.log_dir + ": cannot write " + name + " there (" + why +
                    "); pick another folder.");
      }
    }
  }
  const std::string why = options.timeline.empty() ? "" : lockstep::common::open_for_append(options.timeline);
  if (!why.empty()) {
    usage_error("--timeline " + options.timeline + ": cannot write it (" + why + "); pick another path.");
  }
}

// Rank 0's node must be able to listen on the store's address and port.
void check_port_free(const std::string& addr, int port) {
  const auto addresses = lockstep::detail::resolve_tcp(addr, port);
  if (addresses.first() == nullptr) {
    usage_error("--master-addr " + addr + " does not resolve to an address of this machine.");
  }
  const auto bound = lockstep::detail::bind_first(addresses, /*listen=*/false, /*reuse_address=*/true);
  if (bound.fd >= 0) {
    ::close(bound.fd);
    return;
  }
  if (bound.error_code == EADDRINUSE) {
    usage_error("port " + std::to_string(port) + " on " + addr + " is already in use; pick another with --master-port.");
  }
  usage_error("cannot listen on " + addr + ":" + std::to_string(port) + " (" + bound.error +
              "); on several nodes, --master-addr must be an address of node 0.");
}

std::string store_file_prefix() {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/lockstep-store-";
}

std::string trace_dir_prefix() {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/lockstep-trace-";
}

// A launcher killed with SIGKILL cannot remove its store files and trace
// folders: the next one removes those of launchers that no longer run.
void remove_stale_store_files() {
  lockstep::common::remove_files_of_dead_processes(store_file_prefix());
  lockstep::common::remove_files_of_dead_processes(trace_dir_prefix());
}

class Attempt {
 public:
  Attempt(const Options& options, const std::string& program, int restart_count)
      : options_(options), program_(program), restart_count_(restart_count) {
    if (options_.nnodes == 1) {
      // One node: lockstep's init_process_group keeps its store in this file,
      // so nothing listens on the network. A new file per attempt: a restart
      // must not read the keys of the attempt before.
      store_file_ = store_file_prefix() + std::to_string(::getpid()) + "-" + std::to_string(restart_count);
      ::unlink(store_file_.c_str());
    }
    // Where the ranks write their flight records when a collective fails
    // (Note [Flight recorder] in src/flight_recorder.cpp): --log-dir, or a
    // folder of this attempt's own. The caller's LOCKSTEP_TRACE_DIR wins.
    const char* preset = std::getenv("LOCKSTEP_TRACE_DIR");
    if (preset != nullptr && *preset != '\0') {
      trace_dir_ = preset;
    } else if (!options_.log_dir.empty()) {
      trace_dir_ = options_.log_dir;
    } else {
      trace_dir_ = trace_dir_prefix() + std::to_string(::getpid()) + "-" + std::to_string(restart_count);
      own_trace_dir_ = ::mkdir(trace_dir_.c_str(), 0700) == 0;
    }
    for (int local = 0; local < options_.nproc_per_node; ++local) { // a record of the attempt before would mislead
      const int rank = options_.node_rank * options_.nproc_per_node + local;
      ::unlink(lockstep::tools::trace_file(trace_dir_, rank).c_str());
      ::unlink(timeline_part(rank).c_str());
    }
  }
  ~Attempt() {
    if (!store_file_.empty()) {
      ::unlink(store_file_.c_str());
    }
    if (own_trace_dir_) {
      lockstep::common::remove_shallow(trace_dir_);
    }
  }

  // --timeline FILE: this node's ranks' timelines merged; false if FILE
  // could not be written (said).
  bool merge_timeline() const {
    if (options_.timeline.empty()) {
      return true;
    }
    std::vector<std::pair<int, std::string>> parts;
    for (const auto& r : ranks_) {
      parts.emplace_back(r.global_rank, timeline_part(r.global_rank));
    }
    return lockstep::tools::merge_timelines(parts, options_.timeline);
  }

  // The desync report from the ranks' flight records; nothing when none wrote one.
  void print_desync_report() const {
    std::vector<int> ranks;
    for (const auto& r : ranks_) {
      ranks.push_back(r.global_rank);
    }
    const auto lines = lockstep::tools::desync_report(trace_dir_, ranks);
    if (lines.empty()) {
      return;
    }
    std::fprintf(stderr, "lockstep-run: desync report, from the ranks' flight records in %s:\n", trace_dir_.c_str());
    for (const auto& line : lines) {
      std::fprintf(stderr, "  %s\n", line.c_str());
    }
  }

  // Runs the ranks to the end. Returns the index of the root-cause rank, or
  // -1 if every rank succeeded.
  int run() {
    start_ranks();
    int root_cause = -1;
    Clock::time_point stop_at = Clock::time_point::max();
    Clock::time_point stop_deadline = Clock::time_point::max();
    bool stopping = false;
    bool terminated = false;
    while (true) {
      lockstep::tools::pump(ranks_, 100);
      reap();
      if (root_cause < 0) {
        for (size_t i = 0; i < ranks_.size(); ++i) {
          if (ranks_[i].done && failed(ranks_[i].status)) {
            root_cause = static_cast<int>(i);
            break;
          }
        }
      }
      const int sig = g_signal;
      if (!stopping && (root_cause >= 0 || sig != 0)) {
        stopping = true;
        for (auto& r : ranks_) {
          r.running_at_stop = !r.done;
        }
        // Ranks that fail in the same collective end within moments of each
        // other: give them kSettle to write their flight records before
        // SIGTERM ends them. A signal to the launcher goes on at once.
        stop_at = sig != 0 ? Clock::now() : Clock::now() + kSettle;
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
    return root_cause;
  }

  const Rank& rank(int i) const {
    return ranks_[i];
  }

 private:
  // Starts every rank of this node. See Note [Launcher lifecycle].
  void start_ranks() {
    ranks_ = std::vector<Rank>(options_.nproc_per_node);
    for (int local = 0; local < options_.nproc_per_node; ++local) {
      Rank& r = ranks_[local];
      r.local_rank = local;
      r.global_rank = options_.node_rank * options_.nproc_per_node + local;
      open_log(r);
      lockstep::tools::spawn_rank(r, program_, options_.command, child_environment(r), group_);
    }
  }

  int world_size() const {
    return options_.nnodes * options_.nproc_per_node;
  }

  // DIR/rank_N.log, when --log-dir is given. Attempts and jobs append to the
  // same file: a header tells them apart.
  void open_log(Rank& r) {
    if (options_.log_dir.empty()) {
      return;
    }
    r.log.open(options_.log_dir + "/rank_" + std::to_string(r.global_rank) + ".log", std::ios::app);
    r.log << "==== lockstep-run " << now_text() << ": attempt " << restart_count_ + 1 << " of at most "
          << options_.max_restarts + 1 << ", rank " << r.global_rank << " of " << world_size() << ":";
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
        {"GROUP_RANK", std::to_string(options_.node_rank)},
        {"ROLE_RANK", std::to_string(r.global_rank)},
        {"MASTER_ADDR", options_.master_addr},
        {"MASTER_PORT", std::to_string(options_.master_port)},
        {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count_)},
        {"TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts)},
        {"LOCKSTEP_RESTART_COUNT", std::to_string(restart_count_)},
    };
    if (!store_file_.empty()) {
      env.emplace_back("LOCKSTEP_STORE_FILE", store_file_);
    }
    env.emplace_back("LOCKSTEP_TRACE_DIR", trace_dir_);
    if (!options_.timeline.empty()) {
      env.emplace_back("LOCKSTEP_TIMELINE", timeline_part(r.global_rank));
    }
    env.emplace_back("LOCKSTEP_RUN_ID", options_.run_id);
    if (options_.timeout_seconds > 0) {
      env.emplace_back("LOCKSTEP_TIMEOUT", std::to_string(options_.timeout_seconds));
    }
    if (std::getenv("OMP_NUM_THREADS") == nullptr) {
      const long cores = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
      env.emplace_back("OMP_NUM_THREADS", std::to_string(std::max(1L, cores / options_.nproc_per_node)));
    }
    return env;
  }

  void reap() {
    for (auto& r : ranks_) {
      if (!r.done && ::waitpid(r.pid, &r.status, WNOHANG) == r.pid) {
        r.done = true;
      }
    }
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
  int restart_count_;
  std::vector<Rank> ranks_;
  pid_t group_ = 0;
  std::string store_file_;
  std::string trace_dir_;
  bool own_trace_dir_ = false;

  std::string timeline_part(int rank) const {
    return trace_dir_ + "/lockstep_timeline_rank" + std::to_string(rank) + ".json";
  }
};

// Whether the rank's last words say it gave up waiting for the others.
bool gave_up_waiting(const Rank& r) {
  for (const auto& line : r.err_tail) {
    std::string lower = line;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lower.find("timeout") != std::string::npos || lower.find("timed out") != std::string::npos ||
        lower.find("did not complete within") != std::string::npos) {
      return true;
    }
  }
  return false;
}

void print_root_cause(const Rank& r) {
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

// The first rank to fail is not always the culprit: a rank that stalls makes
// the others time out and fail first. Name the ranks that were still running.
void print_stalled_ranks(const Attempt& run, int root_cause, int world_on_node, double grace_seconds) {
  const Rank& first = run.rank(root_cause);
  const bool waited = gave_up_waiting(first);
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

} // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = lockstep::tools::parse_run_options(argc, argv);
  } catch (const lockstep::tools::RunUsageError& e) {
    if (e.exit_code == 0) {
      std::fputs(e.what(), stdout);
      return 0;
    }
    usage_error(e.what());
  }
  const std::string program = lockstep::common::find_program(options.command[0]);
  if (program.empty()) {
    usage_error("program '" + options.command[0] + "' not found" +
                (options.command[0].find('/') == std::string::npos ? " in PATH" : "") + " or not executable.");
  }
  if (options.node_rank == 0) {
    check_port_free(options.master_addr, options.master_port);
  }
  prepare_output_paths(options);

  struct sigaction action {};
  action.sa_handler = on_signal;
  ::sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGHUP, &action, nullptr); // a closed terminal: stop as gracefully as for SIGTERM

  // One id for the whole job, so that a restarted program finds what the
  // attempt before wrote (lockstep-train's default output folder).
  const char* run_id = std::getenv("LOCKSTEP_RUN_ID");
  if (run_id != nullptr && *run_id != '\0') {
    options.run_id = run_id;
  } else {
    const std::time_t now = std::time(nullptr);
    char text[32];
    std::strftime(text, sizeof(text), "%Y%m%d-%H%M%S", std::localtime(&now));
    options.run_id = text;
  }
  remove_stale_store_files();
  for (int attempt = 0;; ++attempt) {
    Attempt run(options, program, attempt);
    const int root_cause = run.run();
    const bool timeline_written = run.merge_timeline();
    if (g_signal != 0) {
      std::fprintf(stderr, "lockstep-run: stopped by signal %d; every rank was stopped.\n", static_cast<int>(g_signal));
      return 128 + g_signal;
    }
    if (root_cause < 0) {
      return timeline_written ? 0 : 1;
    }
    print_root_cause(run.rank(root_cause));
    print_stalled_ranks(run, root_cause, options.nproc_per_node, options.grace_seconds);
    run.print_desync_report();
    if (attempt >= options.max_restarts) {
      if (options.max_restarts > 0) {
        std::fprintf(stderr, "lockstep-run: giving up after %d restart(s).\n", options.max_restarts);
      }
      return 1;
    }
    // Back off, doubling up to a limit: a failure that repeats at once (a busy
    // port, a node still starting) should not burn the restarts in a second.
    const double delay = std::min(options.restart_delay * std::pow(2.0, attempt), kMaxRestartDelay);
    std::fprintf(stderr, "lockstep-run: restarting every rank in %.1f s (restart %d of %d).\n", delay, attempt + 1,
                 options.max_restarts);
    const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(delay * 1000));
    while (g_signal == 0 && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (g_signal != 0) {
      std::fprintf(stderr, "lockstep-run: stopped by signal %d before restarting.\n", static_cast<int>(g_signal));
      return 128 + g_signal;
    }
  }
}
