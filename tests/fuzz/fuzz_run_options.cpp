// Fuzz target: lockstep-run's command line (tools/run_options.h). Input: the
// arguments, separated by NUL bytes. A RunUsageError is the right answer to
// a bad command line; anything else is a failure, as is an accepted one that
// breaks what the launcher relies on.

#include <tools/run_options.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"lockstep-run"};
  std::string current;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == '\0') {
      args.push_back(current);
      current.clear();
    } else {
      current += static_cast<char>(data[i]);
    }
  }
  if (!current.empty()) {
    args.push_back(current);
  }
  std::vector<const char*> argv;
  for (const auto& a : args) {
    argv.push_back(a.c_str());
  }
  argv.push_back(nullptr);
  try {
    const auto o = lockstep::tools::parse_run_options(static_cast<int>(args.size()), argv.data());
    if (o.command.empty() || o.nproc_per_node < 1 || o.nnodes < 1 || o.max_restarts < 0 ||
        !(o.grace_seconds >= 0) || !(o.restart_delay >= 0) || o.timeout_seconds < 0) {
      std::abort();
    }
    if (o.elastic()) { // the nodes meet at the rendezvous: no node rank, no master address
      if (o.rdzv_host.empty() || o.rdzv_port < 1 || o.rdzv_port > 65535 || o.min_nodes < 1 || o.min_nodes > o.nnodes ||
          !(o.join_timeout > 0) || !(o.last_call_timeout > 0) || !(o.keep_alive_interval > 0) ||
          o.keep_alive_max_attempt < 1 || !(o.monitor_interval > 0)) {
        std::abort();
      }
    } else if (o.master_addr.empty() || o.node_rank < 0 || o.node_rank >= o.nnodes || o.master_port < 1 ||
               o.master_port > 65535 || o.min_nodes != o.nnodes) {
      std::abort();
    }
  } catch (const lockstep::tools::RunUsageError& e) {
    if (std::string(e.what()).empty()) {
      std::abort(); // an error must say what is wrong
    }
  }
  return 0;
}
