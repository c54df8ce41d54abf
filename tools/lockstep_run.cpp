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
// outlives the launcher even if the launcher is killed with SIGKILL. (The
// signal reaches the rank's own process only: a process a rank started, as a
// shell script's trainer, outlives a launcher killed so, as under torchrun;
// SIGINT, SIGTERM and SIGHUP reach the whole group.) Each
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

#include "attempt.h"
#include "elastic_job.h"
#include "static_meeting.h"

#include <common/process_files.h>

#include <common/sockets.h>

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
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

using lockstep::common::kUsageError;
using lockstep::tools::Attempt;
using lockstep::tools::Clock;
using lockstep::tools::g_launcher_signal;
using lockstep::tools::Options;
using lockstep::tools::Placement;

void on_signal(int sig) {
  g_launcher_signal = sig;
}

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
    // An elastic job's ranks are known only in each round, a static job's
    // of several nodes once they met: check the folder with a file of this launcher's.
    const bool own_file = options.elastic() || options.nnodes > 1;
    const int ranks = own_file ? 1 : options.nproc_per_node;
    for (int local = 0; local < ranks; ++local) {
      const std::string name = own_file
          ? ".lockstep-run-" + std::to_string(::getpid())
          : "rank_" + std::to_string(options.node_rank * options.nproc_per_node + local) + ".log";
      const std::string why = lockstep::common::open_for_append(options.log_dir + "/" + name);
      if (!why.empty()) {
        usage_error("--log-dir " + options.log_dir + ": cannot write " + name + " there (" + why +
                    "); pick another folder.");
      }
      if (own_file) {
        ::unlink((options.log_dir + "/" + name).c_str());
      }
    }
  }
  // The merge is written beside FILE, then renamed onto it: both must work.
  std::string why;
  if (!options.timeline.empty()) {
    const std::string partial = options.timeline + ".partial";
    why = lockstep::common::open_for_append(options.timeline);
    if (why.empty() && (why = lockstep::common::open_for_append(partial)).empty()) {
      ::unlink(partial.c_str());
    }
  }
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

// The GPUs the ranks can see, for --nproc-per-node gpu and auto: those
// CUDA_VISIBLE_DEVICES names when it is set, else the /dev/nvidiaN devices.
int visible_gpus() {
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    const std::string text = visible;
    return text.empty() || text.rfind("-1", 0) == 0 ? 0 : static_cast<int>(std::count(text.begin(), text.end(), ',')) + 1;
  }
  int gpus = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev", error)) {
    const std::string name = entry.path().filename().string();
    gpus += name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
        name.find_first_not_of("0123456789", 6) == std::string::npos;
  }
  return gpus;
}

// A launcher killed with SIGKILL cannot remove its store files and trace
// folders: the next one removes those of launchers that no longer run.
void remove_stale_store_files() {
  lockstep::common::remove_files_of_dead_processes(lockstep::tools::store_file_prefix());
  lockstep::common::remove_files_of_dead_processes(lockstep::tools::trace_dir_prefix());
}

// Where this node's ranks stand in attempt `attempt` of a static job.
Placement static_placement(const Options& options, const lockstep::tools::StaticLayout& layout, int attempt) {
  Placement placement;
  placement.group_rank = options.node_rank;
  placement.group_world_size = options.nnodes;
  placement.rank_offset = layout.rank_offset;
  placement.world_size = layout.world_size;
  placement.restart_count = attempt;
  placement.attempt = attempt;
  placement.master_addr = options.master_addr;
  placement.master_port = options.master_port;
  placement.file_store = options.nnodes == 1;
  return placement;
}

// Seconds the ranks wait for each other: how long the nodes may take to meet.
std::chrono::seconds ranks_timeout(const Options& options) {
  const char* preset = std::getenv("LOCKSTEP_TIMEOUT");
  const long from_env = preset != nullptr ? std::strtol(preset, nullptr, 10) : 0;
  return std::chrono::seconds(options.timeout_seconds > 0 ? options.timeout_seconds : from_env > 0 ? from_env : 300);
}

// This node's ranks among every node's (Note [Static nodes add up their
// counts] in tools/static_meeting.h); nullopt on a signal, or after saying
// why the nodes could not meet.
std::optional<lockstep::tools::StaticLayout> meet_other_nodes(const Options& options) {
  if (options.nnodes == 1) {
    return lockstep::tools::static_layout({options.nproc_per_node}, 0);
  }
  std::optional<lockstep::tools::StaticLayout> layout;
  try {
    layout = lockstep::tools::StaticMeeting(options, ranks_timeout(options), [] { return g_launcher_signal != 0; }).meet();
  } catch (const lockstep::tools::MeetingError& e) {
    std::fprintf(stderr, "lockstep-run: node %d: %s\n", options.node_rank, e.what());
    return std::nullopt;
  } catch (const lockstep::tools::KvError& e) {
    std::fprintf(stderr, "lockstep-run: node %d lost node 0's launcher while the nodes met (%s): node 0 stopped, or "
                 "the link to it failed.\n", options.node_rank, e.what());
    return std::nullopt;
  }
  if (!layout) {
    return std::nullopt; // a signal
  }
  const std::vector<int>& counts = layout->counts;
  if (std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<int>()) != counts.end()) {
    std::fprintf(stderr, "lockstep-run: the nodes start different numbers of ranks (--nproc-per-node of %s): "
                 "WORLD_SIZE is their sum, %d, as under torchrun; this node's ranks are %d to %d.\n",
                 lockstep::tools::describe_counts(counts).c_str(), layout->world_size, layout->rank_offset,
                 layout->rank_offset + options.nproc_per_node - 1);
  }
  return layout;
}

// Backs off before restart `attempt + 1` (restart_delay_seconds). False if
// a signal came meanwhile.
bool wait_before_restart(const Options& options, int attempt) {
  const double delay = lockstep::tools::restart_delay_seconds(options, attempt);
  std::fprintf(stderr, "lockstep-run: restarting every rank in %.1f s (restart %d of %d).\n", delay, attempt + 1,
               options.max_restarts);
  if (!lockstep::tools::sleep_unless_signalled(delay)) {
    std::fprintf(stderr, "lockstep-run: stopped by signal %d before restarting.\n", static_cast<int>(g_launcher_signal));
    return false;
  }
  return true;
}

// A job of --nnodes N fixed nodes, each told its --node-rank: restarted as
// a whole after a failure, up to --max-restarts times.
int run_static(const Options& options, const std::string& program) {
  const auto layout = meet_other_nodes(options);
  if (!layout) {
    return g_launcher_signal != 0 ? 128 + g_launcher_signal : 1;
  }
  for (int attempt = 0;; ++attempt) {
    Attempt run(options, program, static_placement(options, *layout, attempt));
    const int root_cause = run.run();
    const bool timeline_written = run.merge_timeline();
    if (g_launcher_signal != 0) {
      std::fprintf(stderr, "lockstep-run: stopped by signal %d; every rank was stopped.\n", static_cast<int>(g_launcher_signal));
      lockstep::tools::print_killed_on_signal(run, options.nproc_per_node, options.grace_seconds);
      return 128 + g_launcher_signal;
    }
    if (root_cause < 0) {
      return timeline_written ? 0 : 1;
    }
    lockstep::tools::print_root_cause(run.rank(root_cause));
    lockstep::tools::print_stalled_ranks(run, root_cause, options.nproc_per_node, options.grace_seconds);
    run.print_desync_report();
    if (attempt >= options.max_restarts) {
      if (options.max_restarts > 0) {
        std::fprintf(stderr, "lockstep-run: giving up after %d restart(s).\n", options.max_restarts);
      }
      return 1;
    }
    if (!wait_before_restart(options, attempt)) {
      return 128 + g_launcher_signal;
    }
  }
}

// The job's id (LOCKSTEP_RUN_ID for the ranks), and whether every node has
// it; warns where a static job's nodes have only their start times.
void set_run_id(Options& options) {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%d-%H%M%S", std::localtime(&now));
  options.run_id =
      lockstep::tools::default_run_id(std::getenv, text, static_cast<long>(::getpid()), options.nnodes, options.rdzv_id);
  options.run_id_shared = lockstep::tools::run_id_shared(std::getenv, options.rdzv_id);
  if (!options.elastic() && options.nnodes > 1 && !options.run_id_shared) {
    std::fprintf(stderr, "lockstep-run: warning: the run id is this node's start time (%s), which the other nodes do "
                 "not share: lockstep-train's ranks would look for their checkpoint in different runs/ID folders. "
                 "Give every node the same --rdzv-id (or LOCKSTEP_RUN_ID).\n", text);
  }
}

} // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = lockstep::tools::parse_run_options(argc, argv, [](const char* name) { return std::getenv(name); });
  } catch (const lockstep::tools::RunUsageError& e) {
    if (e.exit_code == 0) {
      std::fputs(e.what(), stdout);
      return 0;
    }
    usage_error(e.what());
  }
  const auto fail = [&](const std::string& message) {
    usage_error(lockstep::tools::name_pet_source(message, argc, argv));
  };
  lockstep::tools::resolve_nproc_per_node(options, visible_gpus(), lockstep::tools::usable_cores(), fail);
  lockstep::tools::check_local_ranks_filter(options, fail);
  for (const auto& note : options.notes) { // accepted flags that do nothing here (Note [torchrun's flags])
    std::fprintf(stderr, "lockstep-run: note: %s\n", note.c_str());
  }
  const std::string program = lockstep::common::find_program(options.command[0]);
  if (program.empty()) {
    usage_error(lockstep::common::program_missing_message(options.command[0],
                                                          lockstep::common::in_this_directory(options.command[0])));
  }
  if (!options.elastic() && options.node_rank == 0) {
    check_port_free(options.master_addr, options.master_port);
  }
  prepare_output_paths(options);

  struct sigaction action {};
  action.sa_handler = on_signal;
  ::sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGHUP, &action, nullptr); // a closed terminal: stop as gracefully as for SIGTERM
  ::sigaction(SIGQUIT, &action, nullptr); // as torchrun does
  // A reader of our output that went away (`lockstep-run ... | head`) must
  // not end the launcher, whose death would SIGKILL every rank: the echo
  // fails, the job goes on. A handler, not SIG_IGN, which the ranks would
  // inherit across exec.
  struct sigaction pipe_action {};
  pipe_action.sa_handler = [](int) {};
  ::sigemptyset(&pipe_action.sa_mask);
  ::sigaction(SIGPIPE, &pipe_action, nullptr);
  // SIGCHLD ignored by whoever started us (exec keeps an ignored signal)
  // has the kernel reap the ranks itself: waitpid would never see one end,
  // and the launcher, SIGTERM included, would wait for good. The ranks get
  // the default back too.
  ::signal(SIGCHLD, SIG_DFL);

  set_run_id(options);
  remove_stale_store_files();
  return options.elastic() ? lockstep::tools::run_elastic(options, program) : run_static(options, program);
}
