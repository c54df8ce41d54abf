#pragma once

// lockstep-run's command line, parsed without side effects (no exit, no
// output, no file or network access beyond CLI11's checks), so that a test or
// a fuzzer can call it: bad input is a RunUsageError carrying the message
// lockstep-run prints and its exit code.

#include <common/cli_checks.h>

#include <CLI/CLI.hpp>

#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep {
namespace tools {

struct RunOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;
  int master_port = 29500;
  int max_restarts = 0;
  std::string log_dir;
  std::string timeline; // --timeline FILE: the ranks' timelines merged
  double grace_seconds = 3.0;
  double restart_delay = 1.0;
  int timeout_seconds = 0; // 0: the ranks' own (LOCKSTEP_TIMEOUT, else lockstep's default)
  std::string run_id;      // LOCKSTEP_RUN_ID: the same for every attempt
  std::vector<std::string> command;
};

/// A command line lockstep-run refuses (exit_code common::kUsageError), or --help
/// (exit_code 0, the help text as message).
struct RunUsageError : std::runtime_error {
  RunUsageError(const std::string& message, int exit_code) : std::runtime_error(message), exit_code(exit_code) {}
  int exit_code;
};

inline void describe_run_options(CLI::App& app, RunOptions& options) {
  // torchrun's underscore spellings are aliases, so that its command lines work.
  app.add_option("--nproc-per-node,--nproc_per_node", options.nproc_per_node, "Ranks on this node")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--nnodes", options.nnodes, "Nodes in the job")->check(CLI::Range(1, 65536))->capture_default_str();
  app.add_option("--node-rank,--node_rank", options.node_rank, "This node's index, 0 to nnodes-1")->check(common::non_negative())->capture_default_str();
  app.add_option("--master-addr,--master_addr", options.master_addr,
                 "Address of node 0, where rank 0 hosts the store; required with --nnodes > 1 (default 127.0.0.1: loopback only)");
  app.add_option("--master-port,--master_port", options.master_port, "Port of the store on node 0")->check(CLI::Range(1, 65535))->capture_default_str();
  app.add_option("--max-restarts,--max_restarts", options.max_restarts, "Restarts of the whole group after a failure")
      ->check(CLI::Range(0, 1000))->capture_default_str();
  app.add_option("--log-dir,--log_dir", options.log_dir, "Also write each rank's output to DIR/rank_N.log (DIR is "
                 "created, with its parents, as torchrun does)");
  app.add_option("--timeline", options.timeline, "Have the ranks record a timeline (LOCKSTEP_TIMELINE) and merge "
                 "this node's into FILE, a Chrome trace (Perfetto, chrome://tracing)");
  app.add_option("--grace-period", options.grace_seconds, "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(CLI::Range(0.0, 3600.0))->capture_default_str();
  app.add_option("--restart-delay", options.restart_delay,
                 "Seconds before the first restart, doubled for each one after (at most 30)")
      ->check(CLI::Range(0.0, 3600.0))->capture_default_str();
  app.add_option("--timeout", options.timeout_seconds,
                 "Seconds a rank waits for the others (store, connections, each collective) before failing; sets "
                 "LOCKSTEP_TIMEOUT for the ranks. Default: theirs, else 300")
      ->check(CLI::Range(1, 7 * 24 * 3600));
  app.footer("PROGRAM [ARGS...] follow the options; everything from PROGRAM on is PROGRAM's.");
  app.prefix_command(); // everything from PROGRAM on belongs to PROGRAM
}

/// The options of `argv` (argv[0] is the program's name), checked against
/// each other. Throws RunUsageError.
inline RunOptions parse_run_options(int argc, const char* const* argv) {
  RunOptions options;
  CLI::App app{"lockstep-run: starts N ranks of PROGRAM with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
               "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT), prefixes their "
               "output with their rank, stops the job when one fails, and restarts it up to --max-restarts times."};
  describe_run_options(app, options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) { // --help
      throw RunUsageError(app.help(), 0);
    }
    throw RunUsageError(e.what(), common::kUsageError);
  }
  auto fail = [](const std::string& message) { throw RunUsageError(message, common::kUsageError); };
  options.command = app.remaining(); // prefix_command leaves PROGRAM and its arguments there
  if (!options.command.empty() && options.command[0] == "--") {
    options.command.erase(options.command.begin()); // "--" ends the options, as for torchrun
  } else if (!options.command.empty() && options.command[0].rfind("-", 0) == 0) {
    // prefix_command takes the first unknown argument for PROGRAM
    fail("unknown option " + options.command[0] + " (options come before PROGRAM).");
  }
  if (options.command.empty()) {
    fail("PROGRAM is missing.");
  }
  if (options.node_rank >= options.nnodes) {
    fail("--node-rank " + std::to_string(options.node_rank) + " is out of range for --nnodes " +
         std::to_string(options.nnodes) + "; expected 0 to " + std::to_string(options.nnodes - 1) + ".");
  }
  if (options.master_addr.empty()) {
    if (options.nnodes > 1) {
      fail("--nnodes " + std::to_string(options.nnodes) + " needs --master-addr: the address of node 0 that every node "
           "can reach.");
    }
    options.master_addr = "127.0.0.1"; // one node: the store stays on loopback
  }
  return options;
}

} // namespace tools
} // namespace lockstep
