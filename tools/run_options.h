#pragma once

// lockstep-run's command line, parsed without side effects (no exit, no
// output, no file or network access beyond CLI11's checks), so that a test or
// a fuzzer can call it: bad input is a RunUsageError carrying the message
// lockstep-run prints and its exit code.

#include <common/cli_checks.h>

#include <CLI/CLI.hpp>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep {
namespace tools {

struct RunOptions {
  int nproc_per_node = 1;
  std::string nnodes_text = "1"; // --nnodes N or MIN:MAX
  int nnodes = 1;                // N; MAX for MIN:MAX
  int min_nodes = 1;
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
  // Elastic rendezvous (Note [Elastic rendezvous] in tools/rendezvous.h)
  std::string rdzv_backend; // static or c10d; empty until parse_nnodes picks one
  std::string rdzv_endpoint;
  std::string rdzv_host;
  int rdzv_port = 29400; // torchrun's default
  std::string rdzv_id;
  std::string rdzv_conf;
  double join_timeout = 600, last_call_timeout = 30, keep_alive_interval = 5; // seconds, torchrun's defaults
  int keep_alive_max_attempt = 3;
  double monitor_interval = 0.1;

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

inline void describe_run_options(CLI::App& app, RunOptions& options) {
  // torchrun's underscore spellings are aliases, so that its command lines work.
  app.add_option("--nproc-per-node,--nproc_per_node", options.nproc_per_node, "Ranks on this node")->check(CLI::Range(1, 1024))->capture_default_str();
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
      ->check(CLI::Range(0.0, 3600.0))->capture_default_str();
  app.add_option("--restart-delay", options.restart_delay,
                 "Seconds before the first restart, doubled for each one after (at most 30)")
      ->check(CLI::Range(0.0, 3600.0))->capture_default_str();
  app.add_option("--timeout", options.timeout_seconds,
                 "Seconds a rank waits for the others (store, connections, each collective) before failing; sets "
                 "LOCKSTEP_TIMEOUT for the ranks. Default: theirs, else 300")
      ->check(CLI::Range(1, 7 * 24 * 3600));
  app.add_option("--rdzv-backend,--rdzv_backend", options.rdzv_backend, "static: the nodes are given --node-rank and "
                 "meet at --master-addr; c10d: they meet in rounds at --rdzv-endpoint, ranks are assigned, and the job "
                 "goes on when nodes leave or join (default: c10d for --nnodes MIN:MAX or with --rdzv-endpoint, else "
                 "static; a static job with --rdzv-endpoint and no --master-addr meets there)");
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", options.rdzv_endpoint, "HOST[:PORT] of the rendezvous store: the "
                 "launcher on HOST serves it, the others reach it (default port 29400)");
  app.add_option("--rdzv-id,--rdzv_id", options.rdzv_id, "The job's id, the same on every node, and the ranks' "
                 "LOCKSTEP_RUN_ID (default: Slurm's job and step, else the start time: the first node's in an elastic "
                 "job, each node's own in a static one)");
  app.add_option("--rdzv-conf,--rdzv_conf", options.rdzv_conf, "KEY=SECONDS,...: join_timeout (600), last_call_timeout "
                 "(30), keep_alive_interval (5), keep_alive_max_attempt (3, a count)");
  app.add_option("--monitor-interval,--monitor_interval", options.monitor_interval, "Seconds between the elastic "
                 "launcher's looks at the rendezvous store")->check(CLI::Range(0.01, 60.0))->capture_default_str();
  app.footer("PROGRAM [ARGS...] follow the options; everything from PROGRAM on is PROGRAM's.");
  app.prefix_command(); // everything from PROGRAM on belongs to PROGRAM
}

using Fail = std::function<void(const std::string&)>;

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

// One KEY=VALUE of --rdzv-conf.
inline void parse_rdzv_setting(RunOptions& options, const std::string& item, const Fail& fail) {
  const size_t eq = item.find('=');
  const std::string key = item.substr(0, eq);
  const std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
  char* end = nullptr;
  const double number = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || !(number > 0) || number > 7 * 24 * 3600) {
    fail("--rdzv-conf " + item + ": expected KEY=VALUE with a positive number of seconds (a count for "
         "keep_alive_max_attempt).");
  }
  if (key == "join_timeout") {
    options.join_timeout = number;
  } else if (key == "last_call_timeout") {
    options.last_call_timeout = number;
  } else if (key == "keep_alive_interval") {
    options.keep_alive_interval = number;
  } else if (key == "keep_alive_max_attempt" && number == static_cast<int>(number)) {
    options.keep_alive_max_attempt = static_cast<int>(number);
  } else {
    fail("--rdzv-conf " + item + ": unknown key or not a whole count; expected join_timeout, last_call_timeout, "
         "keep_alive_interval (seconds) or keep_alive_max_attempt (a count).");
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
  std::string item;
  for (size_t start = 0; start <= options.rdzv_conf.size() && !options.rdzv_conf.empty();) {
    const size_t comma = options.rdzv_conf.find(',', start);
    parse_rdzv_setting(options, options.rdzv_conf.substr(start, comma - start), fail);
    start = comma == std::string::npos ? options.rdzv_conf.size() + 1 : comma + 1;
  }
  check_rendezvous_timing(options, fail);
  for (unsigned char c : options.rdzv_id) {
    if (std::isspace(c) || std::iscntrl(c)) { // the store's keys are words of its line protocol
      fail("--rdzv-id '" + options.rdzv_id + "' holds a space or a control character; use letters, digits and "
           "punctuation.");
    }
  }
}

/// The first host of a Slurm host list: "node[01-04,07],gpu3" is node01,
/// "rack[1-2]-n[5-6]" is rack1-n5.
inline std::string first_host(const std::string& list) {
  std::string host;
  bool in_brackets = false, first_item = false;
  for (char c : list) {
    if (!in_brackets && c == ',') {
      break;
    }
    if (c == '[' || c == ']') {
      in_brackets = c == '[';
      first_item = in_brackets;
    } else if (!in_brackets) {
      host += c;
    } else if (c == '-' || c == ',') {
      first_item = false;
    } else if (first_item) {
      host += c;
    }
  }
  return host;
}

using GetEnv = std::function<const char*(const char*)>;

/// The job's id, the same for every attempt of it (lockstep-train's default
/// output folder is runs/ID, where a restart finds its checkpoint):
/// --rdzv-id, which torchrun's users give every node (an elastic job takes
/// it too); else LOCKSTEP_RUN_ID; else Slurm's job and step (a requeued job keeps both, two sruns of one
/// allocation differ; the trainer's own id does the same); else the launch
/// time `now`, and on one node this launcher's `pid` too, so that two jobs
/// started in the same second never share a folder (nodes of a static job
/// with none of these have no id in common: lockstep-run warns).
inline std::string default_run_id(const GetEnv& get, const std::string& now, long pid, int nnodes,
                                  const std::string& rdzv_id = "") {
  const auto set = [&](const char* name) {
    const char* v = get(name);
    return v != nullptr && *v != '\0' ? std::string(v) : std::string();
  };
  if (!rdzv_id.empty()) {
    return rdzv_id;
  }
  if (!set("LOCKSTEP_RUN_ID").empty()) {
    return set("LOCKSTEP_RUN_ID");
  }
  if (!set("SLURM_JOB_ID").empty()) {
    return "slurm-" + set("SLURM_JOB_ID") + (set("SLURM_STEP_ID").empty() ? "" : "." + set("SLURM_STEP_ID"));
  }
  return nnodes == 1 ? now + "-" + std::to_string(pid) : now;
}

// Note [lockstep-run under srun]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `srun --ntasks-per-node=1 lockstep-run ...` starts one launcher per node:
// in a Slurm step (SLURM_STEP_ID set), --nnodes, --node-rank and
// --master-addr default to the step's node count, this node's index and the
// first host of the step's node list. A batch script outside srun has
// SLURM_NODEID too, but no step: there lockstep-run is one node, as anywhere.
inline void apply_slurm_step(RunOptions& options, const CLI::App& app, const GetEnv& get, const Fail& fail) {
  const char* nodes = get("SLURM_STEP_NUM_NODES") ? get("SLURM_STEP_NUM_NODES") : get("SLURM_NNODES");
  const char* node_id = get("SLURM_NODEID");
  const char* list = get("SLURM_STEP_NODELIST") ? get("SLURM_STEP_NODELIST") : get("SLURM_JOB_NODELIST");
  if (get("SLURM_STEP_ID") == nullptr || nodes == nullptr || node_id == nullptr || list == nullptr || options.elastic()) {
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
  }
  if (app.count("--master-addr") == 0) {
    options.master_addr = first_host(list);
  }
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
  const bool backend_given = !options.rdzv_backend.empty();
  parse_nnodes(options, fail);
  apply_slurm_step(options, app, get, fail);
  if (!backend_given) {
    options.rdzv_backend.clear(); // picked again from what Slurm's step added
  }
  parse_nnodes(options, fail);
  check_node_rank(options, app.count("--node-rank") > 0, backend_given, fail); // Note [--node-rank and the rendezvous]
  if (options.elastic()) {
    parse_rendezvous(options, fail);
    return options;
  }
  if (options.master_addr.empty() && !options.rdzv_endpoint.empty()) {
    parse_rendezvous(options, fail); // a static job meeting at --rdzv-endpoint, as torchrun's
    options.master_addr = options.rdzv_host;
    options.master_port = options.rdzv_port;
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
