#pragma once

// The command line that lockstep-bench-dp and lockstep-bench-amp share: both
// time contenders side by side, each in a process of its own (the program
// again, with --model and --contender), for --rounds rounds of --seconds
// each.

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <string>
#include <vector>

namespace lockstep {
namespace bench {

struct RoundOptions {
  int rounds = 5;
  double seconds = 2.0;
  std::string only;      // --model: only this one (empty: both)
  std::string contender; // time only this one, once, in this process
};

// --rounds and --seconds.
inline void add_round_options(CLI::App& app, RoundOptions& options) {
  app.add_option("--rounds", options.rounds, "Rounds; each times every contender once")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seconds", options.seconds, "Seconds per contender and round")->check(CLI::PositiveNumber)
      ->capture_default_str();
}

inline void add_model_option(CLI::App& app, RoundOptions& options) {
  app.add_option("--model", options.only, "Only this model (default: both)")->check(CLI::IsMember({"mlp", "cnn"}));
}

// --contender, one of `names`; `what` says what it times.
inline void add_contender_option(CLI::App& app, RoundOptions& options, const std::string& what,
                                 const std::vector<std::string>& names) {
  app.add_option("--contender", options.contender, what)->check(CLI::IsMember(names));
}

// This program's own file, to start it again for each contender; `program`
// names it in the error.
inline std::string own_path(const std::string& program) {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  TORCH_CHECK(n > 0, program, ": cannot read /proc/self/exe");
  return std::string(path, static_cast<size_t>(n));
}

} // namespace bench
} // namespace lockstep
