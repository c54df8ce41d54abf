#pragma once

// lockstep-run's command line, parsed without side effects (no exit, no
// output, no file or network access beyond CLI11's checks), so that a test or
// a fuzzer can call it: bad input is a RunUsageError carrying the message
// lockstep-run prints and its exit code.

#include "pet_variables.h"
#include "rdzv_conf.h"
#include "run_id.h"
#include "slurm_host_list.h"

#include <common/cli_checks.h>
#include <lockstep/version.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep {
namespace tools {

struct RunOptions : RdzvConf { // RdzvConf: what --rdzv-conf sets
  std::string nproc_text = "1"; // --nproc-per-node N, or torchrun's auto, cpu, gpu
  int nproc_per_node = 1;       // N; 1 for a keyword until resolve_nproc_per_node
  std::string nproc_kind;       // auto, cpu or gpu; empty for N
  std::string nnodes_text = "1"; // --nnodes N or MIN:MAX
  int nnodes = 1;                // N; MAX for MIN:MAX
  int min_nodes = 1;
  int node_rank = 0;
  int slurm_step_nodes = 0; // the srun step's node count when its SLURM_NODEID gave node_rank; else 0
  std::string master_addr;
  int master_port = 29500;
  int max_restarts = 0;
  std::string log_dir;
  std::string timeline; // --timeline FILE: the ranks' timelines merged
  double grace_seconds = 3.0;
  double restart_delay = 1.0;
  int timeout_seconds = 0; // 0: the ranks' own (LOCKSTEP_TIMEOUT, else lockstep's default)
  std::string run_id;      // LOCKSTEP_RUN_ID: the same for every attempt
  bool run_id_shared = false; // from --rdzv-id, LOCKSTEP_RUN_ID or Slurm: every node of the job has it
  std::vector<std::string> command;
  // Elastic rendezvous (Note [Elastic rendezvous] in tools/rendezvous.h)
  std::string rdzv_backend; // static or c10d; empty until parse_nnodes picks one
  std::string rdzv_endpoint;
  std::string rdzv_host;
  int rdzv_port = 29400; // torchrun's default
  std::string rdzv_id;
  std::string rdzv_job; // the rendezvous's id (rendezvous_id): --rdzv-id, else Slurm's job and step, else empty
  std::string rdzv_conf;
  double monitor_interval = 0.1;
  // torchrun's flags (Note [torchrun's flags])
  bool standalone = false;
  bool no_python = false;
  std::string local_ranks_filter; // local ranks whose output reaches the console; empty: all
  std::vector<int> local_ranks_shown;
  std::string tee, redirects;
  std::string role = "default"; // ROLE_NAME
  std::string local_addr;       // the address the other nodes reach this node's ranks at (elastic)
  std::vector<std::string> notes; // accepted flags that do nothing here: said once at start

  /// Whether the nodes meet in rounds (c10d) rather than by --node-rank (static).
  bool elastic() const {
    return rdzv_backend == "c10d";
  }
};

/// A command line lockstep-run refuses (exit_code common::kUsageError), or --help
/// (exit_code 0, the help text as message).
struct RunUsageError : std::runtime_error {
  RunUsageError(const std::string& message, int exit_code) : std::runtime_error(message), exit_code(exit_code) {}
  int exit_code;
};

// Note [torchrun's flags]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// torchrun's command lines work here unchanged. Its flags that mean
// something here do it: --standalone (one node, which is lockstep-run's
// default), --no-python (lockstep-run always runs PROGRAM itself), --role
// (ROLE_NAME), --local-addr (the address an elastic node gives the others),
// --local-ranks-filter (whose output reaches the console; every rank's still
// reaches --log-dir), --nproc-per-node auto|cpu|gpu. Those that do not
// (--tee and --redirects: every rank's output always reaches the console,
// prefixed, and --log-dir; --local-addr in a static job; some --rdzv-conf
// keys, Note [torchrun's --rdzv-conf keys] in tools/rdzv_conf.h) are
// accepted, and the launcher says so once at start.
inline void describe_torchrun_flags(CLI::App& app, RunOptions& options) {
  app.add_flag("--standalone", options.standalone, "torchrun's one-node job: lockstep-run's default (no --nnodes, "
               "--rdzv-endpoint or --master-addr with it)");
  app.add_flag("--no-python,--no_python", options.no_python, "Accepted for torchrun's command lines: lockstep-run "
               "always runs PROGRAM itself");
  app.add_option("--local-ranks-filter,--local_ranks_filter", options.local_ranks_filter, "Comma-separated local "
                 "ranks whose output reaches the console (all reach --log-dir)");
  app.add_option("--tee,-t", options.tee, "Accepted for torchrun's command lines; no effect: every rank's output "
                 "reaches the console, prefixed, and --log-dir");
  app.add_option("--redirects,-r", options.redirects, "Accepted for torchrun's command lines; no effect (see --tee)");
  app.add_option("--role", options.role, "The ranks' ROLE_NAME")->capture_default_str();
  app.add_option("--local-addr,--local_addr", options.local_addr, "This node's address for the other nodes of an "
                 "elastic job (default: the one that reaches --rdzv-endpoint)");
}

inline void describe_run_options(CLI::App& app, RunOptions& options) {
  // torchrun's underscore spellings are aliases, so that its command lines work.
  app.add_option("--nproc-per-node,--nproc_per_node", options.nproc_text, "Ranks on this node: 1 to 1024, or "
                 "torchrun's gpu (one per visible GPU), cpu (one per usable core), auto (gpu if any, else cpu)")
      ->capture_default_str();
  app.add_option("--nnodes", options.nnodes_text, "Nodes in the job: N, or MIN:MAX for an elastic job (which needs "
                 "--rdzv-endpoint)")->capture_default_str();
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
      ->check(common::number_in(0.0, 3600.0))->capture_default_str();
  app.add_option("--restart-delay", options.restart_delay,
                 "Seconds before the first restart, doubled for each one after (at most 30); in an elastic job, "
                 "before each node joins the round that restarts the job after a failure")
      ->check(common::number_in(0.0, 3600.0))->capture_default_str();
  app.add_option("--timeout", options.timeout_seconds,
                 "Seconds a rank waits for the others (store, connections, each collective) before failing; sets "
                 "LOCKSTEP_TIMEOUT for the ranks. Default: theirs, else 300")
      ->check(CLI::Range(1, 7 * 24 * 3600));
  app.add_option("--rdzv-backend,--rdzv_backend", options.rdzv_backend, "static: the nodes are given --node-rank and "
                 "meet at --master-addr; c10d: they meet in rounds at --rdzv-endpoint, ranks are assigned, and the job "
                 "goes on when nodes leave or join (default: c10d for --nnodes MIN:MAX or with --rdzv-endpoint, else "
                 "static; a static job with --rdzv-endpoint meets there, in place of --master-addr)");
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", options.rdzv_endpoint, "HOST[:PORT] of the rendezvous store: the "
                 "launcher on HOST serves it, the others reach it (default port 29400)");
  app.add_option("--rdzv-id,--rdzv_id", options.rdzv_id, "The job's id, the same on every node, and the ranks' "
                 "LOCKSTEP_RUN_ID (default: Slurm's job and step, else the start time: the first node's in an elastic "
                 "job, each node's own in a static one). An elastic node of another id is refused; without one "
                 "(and outside Slurm), a node whose PROGRAM and ARGS differ from the job's first node's is refused");
  app.add_option("--rdzv-conf,--rdzv_conf", options.rdzv_conf, "KEY=VALUE,...: join_timeout (600 s), "
                 "last_call_timeout (30 s), keep_alive_interval (5 s), keep_alive_max_attempt (3), read_timeout (s, "
                 "each store operation's deadline), is_host (true/false: whether this node serves the store), "
                 "store_type (tcp only); torchrun's close_timeout, heartbeat_timeout and cas_backoff_max_seconds are "
                 "accepted and have no effect. Unlike torchrun's c10d, timeout sets join_timeout, and heartbeat is "
                 "short for keep_alive_interval (not torchrun's heartbeat_timeout)");
  app.add_option("--monitor-interval,--monitor_interval", options.monitor_interval, "Seconds between the elastic "
                 "launcher's looks at the rendezvous store")->check(common::number_in(0.01, 60.0))->capture_default_str();
  describe_torchrun_flags(app, options);
  read_pet_variables(app);
  app.footer("PROGRAM [ARGS...] follow the options; everything from PROGRAM on is PROGRAM's.");
  app.prefix_command(); // everything from PROGRAM on belongs to PROGRAM
}

inline int parse_count(const std::string& text, const std::string& what, const Fail& fail) {
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || value < 1 || value > 65536) {
    fail(what + ": '" + text + "' is not a whole number from 1 to 65536.");
  }
  return static_cast<int>(value);
}

// --nnodes N or MIN:MAX; a range means an elastic job.
inline void parse_nnodes(RunOptions& options, const Fail& fail) {
  const std::string& text = options.nnodes_text;
  const size_t colon = text.find(':');
  const std::string what = "--nnodes " + text;
  options.min_nodes = parse_count(text.substr(0, colon), what, fail);
  options.nnodes = colon == std::string::npos ? options.min_nodes : parse_count(text.substr(colon + 1), what, fail);
  if (options.min_nodes > options.nnodes) {
    fail(what + ": MIN is above MAX; expected MIN:MAX with MIN <= MAX.");
  }
  const bool range = options.min_nodes < options.nnodes;
  if (options.rdzv_backend.empty()) {
    options.rdzv_backend = range || !options.rdzv_endpoint.empty() ? "c10d" : "static";
  } else if (options.rdzv_backend != "static" && options.rdzv_backend != "c10d") {
    fail("--rdzv-backend " + options.rdzv_backend + " is not supported; lockstep-run has static and c10d.");
  } else if (options.rdzv_backend == "static" && range) {
    fail(what + " is a range of nodes, which the static rendezvous cannot take: drop --rdzv-backend static (a range "
         "meets in c10d rounds), or give one number of nodes.");
  }
}

// Note [--node-rank and the rendezvous]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchrun's default rendezvous is static: `--nnodes 2 --node-rank 1
// --rdzv-endpoint host:port` numbers the nodes by hand and meets at the
// endpoint. lockstep-run's default with an endpoint is c10d, whose nodes
// are numbered in the order they join: taking that command line there
// would silently give node 1 GROUP_RANK 0 (and rank 0) if it came first,
// and a node's data shard or checkpoint files follow its number. So an
// explicit --rdzv-backend static is honoured (the endpoint is the master's
// address when --master-addr is not given), and a --node-rank that the
// default c10d would ignore is refused, saying which backend to pick.
inline void check_node_rank(const RunOptions& options, bool node_rank_given, bool backend_given, const Fail& fail) {
  if (options.elastic() && node_rank_given && !backend_given) {
    fail("--node-rank " + std::to_string(options.node_rank) + " with --rdzv-endpoint: by default the nodes meet in "
         "c10d rounds and are numbered in the order they join, so --node-rank would be ignored. Pass --rdzv-backend "
         "static to number the nodes by hand (torchrun's default), or drop --node-rank.");
  }
}

// A node beats from its monitor loop, at most every --monitor-interval,
// and is lost once it has not beaten for keep_alive_interval x
// keep_alive_max_attempt: a loop slower than half that window would have
// live nodes taken for lost, round after round.
inline void check_rendezvous_timing(const RunOptions& options, const Fail& fail) {
  const double window = options.keep_alive_interval * options.keep_alive_max_attempt;
  if (options.keep_alive_interval < 0.001) {
    fail("--rdzv-conf keep_alive_interval=" + std::to_string(options.keep_alive_interval) + " is below 1 ms; give "
         "seconds, for example keep_alive_interval=5.");
  }
  if (2 * options.monitor_interval > window) {
    char text[160];
    std::snprintf(text, sizeof(text), "--monitor-interval %g is more than half the liveness window (%g s: "
                  "keep_alive_interval x keep_alive_max_attempt)", options.monitor_interval, window);
    fail(std::string(text) + ": a node beats once per look, so live nodes would be taken for lost. Lower "
         "--monitor-interval, or raise keep_alive_interval or keep_alive_max_attempt in --rdzv-conf.");
  }
}

// --rdzv-endpoint HOST[:PORT] ([IPV6]:PORT) and --rdzv-conf.
inline void parse_rendezvous(RunOptions& options, const Fail& fail) {
  std::string endpoint = options.rdzv_endpoint;
  if (endpoint.empty()) {
    if (options.nnodes > 1) {
      fail("--nnodes " + options.nnodes_text + " needs --rdzv-endpoint HOST[:PORT]: the address of the node that "
           "serves the rendezvous, which every node can reach.");
    }
    endpoint = "127.0.0.1";
  }
  std::string port;
  if (endpoint[0] == '[') {
    const size_t close = endpoint.find(']');
    options.rdzv_host = endpoint.substr(1, close == std::string::npos ? std::string::npos : close - 1);
    port = close != std::string::npos && close + 1 < endpoint.size() && endpoint[close + 1] == ':' ? endpoint.substr(close + 2) : "";
  } else {
    const size_t colon = endpoint.rfind(':');
    const bool has_port = colon != std::string::npos && endpoint.find(':') == colon;
    options.rdzv_host = has_port ? endpoint.substr(0, colon) : endpoint;
    port = has_port ? endpoint.substr(colon + 1) : "";
  }
  if (options.rdzv_host.empty()) {
    fail("--rdzv-endpoint " + endpoint + " has no host; expected HOST[:PORT].");
  }
  if (!port.empty()) {
    char* end = nullptr;
    const long value = std::strtol(port.c_str(), &end, 10);
    if (*end != '\0' || value < 1 || value > 65535) {
      fail("--rdzv-endpoint " + endpoint + ": port '" + port + "' is not a port number (1 to 65535).");
    }
    options.rdzv_port = static_cast<int>(value);
  }
  parse_rdzv_conf(options.rdzv_conf, options, options.notes, fail);
  check_rendezvous_timing(options, fail);
  for (unsigned char c : options.rdzv_id) {
    if (std::isspace(c) || std::iscntrl(c)) { // the store's keys are words of its line protocol
      fail("--rdzv-id '" + options.rdzv_id + "' holds a space or a control character; use letters, digits and "
           "punctuation.");
    }
  }
}

// Note [lockstep-run under srun]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `srun --ntasks-per-node=1 lockstep-run ...` starts one launcher per node:
// in a Slurm step (SLURM_STEP_ID set), --nnodes, --node-rank and
// --master-addr default to the step's node count, this node's index and the
// first host of the step's node list. A batch script outside srun has
// SLURM_NODEID too, but no step: there lockstep-run is one node, as anywhere.
// --standalone asks for a job of this node alone: the step's values, which
// would make it one node of several, are not applied.
inline void apply_slurm_step(RunOptions& options, const CLI::App& app, const GetEnv& get, const Fail& fail) {
  const char* nodes = get("SLURM_STEP_NUM_NODES") ? get("SLURM_STEP_NUM_NODES") : get("SLURM_NNODES");
  const char* node_id = get("SLURM_NODEID");
  const char* list = get("SLURM_STEP_NODELIST") ? get("SLURM_STEP_NODELIST") : get("SLURM_JOB_NODELIST");
  if (get("SLURM_STEP_ID") == nullptr || nodes == nullptr || node_id == nullptr || list == nullptr || options.elastic() ||
      options.standalone) {
    return;
  }
  const char* tasks = get("SLURM_STEP_NUM_TASKS") ? get("SLURM_STEP_NUM_TASKS") : get("SLURM_NTASKS");
  if (tasks != nullptr && std::string(tasks) != nodes) {
    fail(std::string("under srun, lockstep-run starts each node's ranks itself, so it runs once per node (srun "
         "--ntasks-per-node=1 lockstep-run --nproc-per-node N ...); this step has ") + tasks + " tasks on " + nodes +
         " node(s).");
  }
  if (app.count("--nnodes") == 0) {
    options.nnodes_text = nodes;
  }
  if (app.count("--node-rank") == 0) {
    char* end = nullptr;
    const long id = std::strtol(node_id, &end, 10);
    if (*node_id == '\0' || *end != '\0' || id < 0 || id >= 65536) {
      fail(std::string("SLURM_NODEID=") + node_id + " is not a node index; give --node-rank.");
    }
    options.node_rank = static_cast<int>(id);
    options.slurm_step_nodes = std::atoi(nodes);
  }
  if (app.count("--master-addr") == 0) {
    options.master_addr = first_host(list);
  }
}

// --nproc-per-node N, or auto, cpu, gpu (resolve_nproc_per_node counts them).
inline void parse_nproc_per_node(RunOptions& options, const Fail& fail) {
  const std::string& text = options.nproc_text;
  if (text == "auto" || text == "cpu" || text == "gpu") {
    options.nproc_kind = text;
    return;
  }
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || value < 1 || value > 1024) {
    fail("--nproc-per-node " + text + ": expected a number of ranks from 1 to 1024, or auto, cpu or gpu.");
  }
  options.nproc_per_node = static_cast<int>(value);
}

/// Resolves --nproc-per-node auto|cpu|gpu (torchrun's meanings) on a
/// machine with `gpus` visible GPUs and `cores` usable cores.
inline void resolve_nproc_per_node(RunOptions& options, int gpus, int cores, const Fail& fail) {
  if (options.nproc_kind.empty()) {
    return;
  }
  if (options.nproc_kind == "gpu" && gpus < 1) {
    fail("--nproc-per-node gpu: this machine shows no GPU (none in CUDA_VISIBLE_DEVICES, or no /dev/nvidiaN); give a "
         "number of ranks, or cpu.");
  }
  const int count = options.nproc_kind == "gpu" || (options.nproc_kind == "auto" && gpus > 0) ? gpus : cores;
  options.nproc_per_node = std::max(1, std::min(count, 1024));
}

/// --local-ranks-filter against this node's ranks, once resolve_nproc_per_node
/// has counted them: a filter that names none of them would hide every
/// rank's output, so it is refused; one that names some that do not exist
/// gets a note (with --nproc-per-node auto, nodes may differ).
inline void check_local_ranks_filter(RunOptions& options, const Fail& fail) {
  std::vector<int> missing;
  for (const int rank : options.local_ranks_shown) {
    if (rank >= options.nproc_per_node) {
      missing.push_back(rank);
    }
  }
  if (missing.empty()) {
    return;
  }
  std::string listed;
  for (const int rank : missing) {
    listed += (listed.empty() ? "" : ",") + std::to_string(rank);
  }
  const std::string ranks = "this node runs " + std::to_string(options.nproc_per_node) + " rank(s), local ranks 0 to " +
      std::to_string(options.nproc_per_node - 1);
  if (missing.size() == options.local_ranks_shown.size()) {
    fail("--local-ranks-filter " + options.local_ranks_filter + " names no rank of this node (" + ranks +
         "), so no rank's output would reach the console; name local ranks from 0 to " +
         std::to_string(options.nproc_per_node - 1) + ", or leave the flag out to see them all.");
  }
  options.notes.push_back("--local-ranks-filter " + options.local_ranks_filter + ": " + ranks + "; " + listed +
                          (missing.size() == 1 ? " is not one of them." : " are not among them."));
}

// torchrun's flags (Note [torchrun's flags]) that need a check or a note.
inline void apply_torchrun_flags(RunOptions& options, const CLI::App& app, const Fail& fail) {
  if (options.standalone && (options.nnodes_text != "1" || !options.rdzv_endpoint.empty() ||
                             !options.master_addr.empty() || !options.rdzv_backend.empty())) {
    fail("--standalone is a job of one node on its own; drop --nnodes, --rdzv-endpoint, --rdzv-backend and "
         "--master-addr, or drop --standalone.");
  }
  for (size_t start = 0; start < options.local_ranks_filter.size() + 1 && !options.local_ranks_filter.empty();) {
    const size_t comma = std::min(options.local_ranks_filter.find(',', start), options.local_ranks_filter.size());
    const std::string item = options.local_ranks_filter.substr(start, comma - start);
    char* end = nullptr;
    const long rank = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || rank < 0 || rank > 1023) {
      fail("--local-ranks-filter " + options.local_ranks_filter + ": '" + item + "' is not a local rank; expected "
           "local ranks from 0 separated by commas, for example 0 or 0,1.");
    }
    options.local_ranks_shown.push_back(static_cast<int>(rank));
    start = comma + 1;
  }
  for (const char* flag : {"--tee", "--redirects"}) {
    if (app.count(flag) > 0) {
      options.notes.push_back(std::string(flag) + " has no effect: every rank's stdout and stderr reach the console "
                              "with a [rank N] prefix, and --log-dir's rank_N.log when it is given.");
    }
  }
}

// --local-addr (or PET_LOCAL_ADDR) is the address the other nodes reach
// this node's ranks at, and goes into the rendezvous's records, whose
// fields ',' and ';' separate: a host name or an address has none of
// these, nor spaces or control characters.
inline void check_local_addr(const RunOptions& options, const Fail& fail) {
  const std::string& addr = options.local_addr;
  for (unsigned char c : addr) {
    if (c == ',' || c == ';' || std::isspace(c) || std::iscntrl(c)) {
      fail("--local-addr '" + addr + "' holds a comma, a semicolon, a space or a control character; give a host name or "
           "an IP address of this machine that the other nodes reach, for example 10.0.0.5.");
    }
  }
}

// --local-addr names an elastic node's address; a static job's ranks meet at --master-addr.
inline void note_static_local_addr(RunOptions& options) {
  if (!options.elastic() && !options.local_addr.empty()) {
    options.notes.push_back("--local-addr has no effect in a static job: its ranks meet at --master-addr.");
  }
}

// Parses `argv` into the options `app` describes; --help and --version, and
// what CLI11 refuses, end here as a RunUsageError.
inline void parse_into_options(CLI::App& app, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForVersion& e) {
    throw RunUsageError(std::string(e.what()) + "\n", 0);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) { // --help
      throw RunUsageError(app.help(), 0);
    }
    throw RunUsageError(e.what(), common::kUsageError);
  }
}

// PROGRAM and its arguments: what the options leave over.
inline void take_program(RunOptions& options, const CLI::App& app, const Fail& fail) {
  options.command = app.remaining(); // prefix_command leaves PROGRAM and its arguments there
  if (!options.command.empty() && options.command[0] == "--") {
    options.command.erase(options.command.begin()); // "--" ends the options, as for torchrun
  } else if (!options.command.empty() && (options.command[0] == "-m" || options.command[0] == "--module")) {
    fail(options.command[0] + " runs a Python module under torchrun; lockstep-run runs a program as given (as "
         "torchrun --no-python does): name the interpreter, as in `lockstep-run ... python3 -m MODULE`.");
  } else if (!options.command.empty() && options.command[0].rfind("-", 0) == 0) {
    // prefix_command takes the first unknown argument for PROGRAM
    fail("unknown option " + options.command[0] + " (options come before PROGRAM).");
  }
  if (options.command.empty()) {
    fail("PROGRAM is missing.");
  }
}

// A static job's meeting point: --master-addr, or --rdzv-endpoint as
// torchrun takes it, or loopback for one node.
inline void check_static_meeting(RunOptions& options, const Fail& fail) {
  if (!options.rdzv_endpoint.empty()) { // a static job meeting at --rdzv-endpoint, as torchrun's, which it prefers
    const std::string given = options.master_addr;
    const int given_port = options.master_port;
    parse_rendezvous(options, fail);
    if (!given.empty() && (given != options.rdzv_host || given_port != options.rdzv_port)) {
      options.notes.push_back("a static job with --rdzv-endpoint meets there, as torchrun's: at " + options.rdzv_host +
                              ":" + std::to_string(options.rdzv_port) + ", not at the master address " + given + ":" +
                              std::to_string(given_port) + ".");
    }
    options.master_addr = options.rdzv_host;
    options.master_port = options.rdzv_port;
  }
  if (!options.rdzv_conf.empty()) {
    options.notes.push_back("--rdzv-conf has no effect in a static job: its nodes wait --timeout for each other.");
  }
  if (options.node_rank >= options.nnodes && options.slurm_step_nodes > 0) {
    fail("SLURM_NODEID=" + std::to_string(options.node_rank) + " (this node's index in the srun step of " +
         std::to_string(options.slurm_step_nodes) + " node(s)) is lockstep-run's default --node-rank, and it is out of "
         "range for --nnodes " + std::to_string(options.nnodes) + ". Under srun, leave --nnodes out (it is then the "
         "step's node count) or give the step's " + std::to_string(options.slurm_step_nodes) + "; for a job of this "
         "node alone on each machine, pass --standalone.");
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
}

// parse_run_options' checks, in order; each refusal throws RunUsageError.
inline void check_run_options(RunOptions& options, CLI::App& app, int argc, const char* const* argv, const GetEnv& get) {
  parse_into_options(app, argc, argv);
  auto fail = [](const std::string& message) { throw RunUsageError(message, common::kUsageError); };
  take_program(options, app, fail);
  parse_nproc_per_node(options, fail);
  apply_torchrun_flags(options, app, fail);
  const bool backend_given = !options.rdzv_backend.empty();
  parse_nnodes(options, fail);
  apply_slurm_step(options, app, get, fail);
  if (!backend_given) {
    options.rdzv_backend.clear(); // picked again from what Slurm's step added
  }
  parse_nnodes(options, fail);
  check_node_rank(options, app.count("--node-rank") > 0, backend_given, fail); // Note [--node-rank and the rendezvous]
  check_local_addr(options, fail);
  note_static_local_addr(options);
  if (options.elastic()) {
    parse_rendezvous(options, fail);
    options.rdzv_job = rendezvous_id(options.rdzv_id, get);
  } else {
    check_static_meeting(options, fail);
  }
}

/// `message`, a refusal of `argv`'s options made after parse_run_options
/// (resolve_nproc_per_node's, check_local_ranks_filter's), naming the PET_
/// variable that gave the option, if one did.
inline std::string name_pet_source(const std::string& message, int argc, const char* const* argv) {
  RunOptions scratch;
  CLI::App app;
  describe_run_options(app, scratch);
  return name_pet_source(message, app, argc, argv);
}

/// The options of `argv` (argv[0] is the program's name), checked against
/// each other, with Slurm's defaults from `get` (Note [lockstep-run under
/// srun]). Throws RunUsageError.
inline RunOptions parse_run_options(int argc, const char* const* argv, const GetEnv& get = [](const char*) -> const char* {
  return nullptr;
}) {
  RunOptions options;
  CLI::App app{"lockstep-run: starts N ranks of PROGRAM with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
               "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT), prefixes their "
               "output with their rank, stops the job when one fails, and restarts it up to --max-restarts times."};
  describe_run_options(app, options);
  app.set_version_flag("--version", std::string("lockstep-run ") + LOCKSTEP_VERSION);
  try {
    check_run_options(options, app, argc, argv, get);
  } catch (const RunUsageError& e) {
    if (e.exit_code == 0) {
      throw;
    }
    throw RunUsageError(name_pet_source(e.what(), app, argc, argv), e.exit_code);
  }
  return options;
}

} // namespace tools
} // namespace lockstep
