#pragma once

// A tag in a file name, before its extension: the timeline's per-rank files
// ("t.rank1.json") and lockstep-run's per-attempt ones ("t.attempt0.json").
// Shared by the library and lockstep-run, included as <common/path_tag.h>.

#include <string>

namespace lockstep {
namespace common {

/// `path` with `tag` before its file name's extension: ("t.json", ".rank1")
/// gives "t.rank1.json"; a name without an extension gets it at the end.
inline std::string with_tag(std::string path, const std::string& tag) {
  const size_t name = path.find_last_of('/') + 1; // 0 without a folder
  const size_t dot = path.find_last_of('.');
  return path.insert(dot != std::string::npos && dot > name ? dot : path.size(), tag);
}

} // namespace common
} // namespace lockstep
