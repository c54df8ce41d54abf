#pragma once

// torchrun's PET_ variables, which fill lockstep-run's options that the
// command line leaves out.

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <string>

namespace lockstep {
namespace tools {

// Note [torchrun's PET_ variables]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchrun takes each option it is not given from PET_<NAME> (PET_NNODES,
// PET_NODE_RANK, ...), and Kubeflow's PyTorchJob starts every pod's torchrun
// with only those set: without them, each pod would run a job of its own,
// silently. So lockstep-run does the same for torchrun's options; the
// command line wins, as torchrun's does.
inline void read_pet_variables(CLI::App& app) {
  for (const std::string name : {"nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port",
                                  "max_restarts", "log_dir", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
                                  "monitor_interval", "role", "local_addr", "local_ranks_filter", "tee", "redirects"}) {
    std::string variable = "PET_" + name;
    std::transform(variable.begin(), variable.end(), variable.begin(), [](unsigned char c) { return std::toupper(c); });
    app.get_option("--" + name)->envname(variable);
  }
}

} // namespace tools
} // namespace lockstep
