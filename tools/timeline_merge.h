#pragma once

// lockstep-run --timeline: the ranks' Chrome-trace files merged into one.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace tools {

// --timeline FILE: the ranks' timelines (rank, file), one process track
// each, merged into `out` with times from the earliest event (Note
// [Timeline] in src/timeline.cpp). False if `out` could not be written
// (said).
inline bool merge_timelines(const std::vector<std::pair<int, std::string>>& parts, const std::string& out_path) {
  nlohmann::json events = nlohmann::json::array();
  std::vector<int> missing;
  for (const auto& [rank, path] : parts) {
    std::ifstream in(path);
    auto part = in ? nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false) : nlohmann::json();
    if (!part.is_object() || !part.contains("traceEvents")) {
      missing.push_back(rank);
      continue;
    }
    for (auto& e : part["traceEvents"]) {
      events.push_back(std::move(e));
    }
  }
  int64_t origin = INT64_MAX;
  for (const auto& e : events) {
    if (e.contains("ts")) {
      origin = std::min(origin, e["ts"].get<int64_t>());
    }
  }
  for (auto& e : events) {
    if (e.contains("ts")) {
      e["ts"] = e["ts"].get<int64_t>() - origin;
    }
  }
  errno = 0;
  std::ofstream out(out_path);
  out << nlohmann::json({{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}).dump() << "\n";
  out.close();
  if (!out) {
    std::fprintf(stderr, "lockstep-run: --timeline %s: cannot write it (%s).\n", out_path.c_str(),
                 errno != 0 ? std::strerror(errno) : "write failed");
    return false;
  }
  std::string note;
  for (int r : missing) {
    note += (note.empty() ? "; no timeline from rank " : ", ") + std::to_string(r);
  }
  std::fprintf(stderr, "lockstep-run: timeline of %zu rank(s) in %s (open it in https://ui.perfetto.dev or "
               "chrome://tracing)%s\n", parts.size() - missing.size(), out_path.c_str(),
               note.empty() ? "" : (note + ": it was stopped before it could write one").c_str());
  return true;
}

} // namespace tools
} // namespace lockstep
