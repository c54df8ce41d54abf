#pragma once

// Slurm's compressed host lists (SLURM_JOB_NODELIST, SLURM_STEP_NODELIST).

#include <string>

namespace lockstep {
namespace tools {

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

} // namespace tools
} // namespace lockstep
