#pragma once

// Ranks named in an error message: "rank 2", "ranks 0 and 3", "ranks 0, 1
// and 3". Shared by the library (join's refusals) and lockstep-run (the
// desync report), included as <common/rank_list.h>.

#include <string>
#include <vector>

namespace lockstep {
namespace common {

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t k = 0; k < ranks.size(); ++k) {
    text += (k == 0 ? "" : k + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[k]);
  }
  return text;
}

} // namespace common
} // namespace lockstep
