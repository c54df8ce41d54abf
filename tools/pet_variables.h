#pragma once

// torchrun's PET_ variables, which fill lockstep-run's options that the
// command line leaves out.

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

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

// The options' words of `argv` (argv[0] is the program's name), as CLI11
// reads them for `app`: up to "--", or to PROGRAM, the first word that is
// neither an option nor an option's value. PROGRAM's own arguments are not
// lockstep-run's.
inline std::vector<std::string> option_words(const CLI::App& app, int argc, const char* const* argv) {
  std::vector<std::string> words;
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word.size() < 2 || word[0] != '-' || word == "--") {
      break;
    }
    words.push_back(word);
    const CLI::Option* option = app.get_option_no_throw(word.substr(0, word.find('=')));
    if (option != nullptr && option->get_type_size_max() > 0 && word.find('=') == std::string::npos) {
      ++i; // its value
    }
  }
  return words;
}

// Whether `words` (option_words) name `option`: --name, --name=V, -x or -xV.
inline bool given_in(const CLI::Option& option, const std::vector<std::string>& words) {
  for (const auto& word : words) {
    for (const auto& name : option.get_lnames()) {
      if (word == "--" + name || word.rfind("--" + name + "=", 0) == 0) {
        return true;
      }
    }
    for (const auto& name : option.get_snames()) {
      if (word.rfind("-" + name, 0) == 0 && word.rfind("--", 0) != 0) {
        return true;
      }
    }
  }
  return false;
}

// A refusal of an option that the environment gave names the variable
// after the flag: the command line the user looks at does not hold the
// value. `app` describes the options, with read_pet_variables.
inline std::string name_pet_source(const std::string& message, const CLI::App& app, int argc, const char* const* argv) {
  const auto words = option_words(app, argc, argv);
  for (const CLI::Option* option : app.get_options()) {
    const std::string variable = option->get_envname();
    if (variable.empty() || std::getenv(variable.c_str()) == nullptr || given_in(*option, words)) {
      continue;
    }
    for (const auto& name : option->get_lnames()) {
      const std::string flag = "--" + name;
      if (message.rfind(flag, 0) == 0 && message.size() > flag.size() &&
          (message[flag.size()] == ' ' || message[flag.size()] == ':')) {
        return flag + " (from " + variable + ")" + message.substr(flag.size());
      }
    }
  }
  return message;
}

} // namespace tools
} // namespace lockstep
