#pragma once

// lockstep-run --timeline: the ranks' Chrome-trace files merged into one.

#include <common/path_tag.h>

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

// Moves attempt `attempt` (this launcher's, from 0)'s merged timeline
// aside, before the next attempt's takes its path; nothing if that attempt
// wrote none.
inline void keep_attempt_timeline(const std::string& path, int attempt) {
  const std::string kept = lockstep::common::with_tag(path, ".attempt" + std::to_string(attempt));
  if (std::rename(path.c_str(), kept.c_str()) == 0) {
    std::fprintf(stderr, "lockstep-run: the timeline of attempt %d is now %s\n", attempt, kept.c_str());
  } else if (errno != ENOENT) {
    std::fprintf(stderr, "lockstep-run: --timeline %s: cannot keep attempt %d's timeline as %s (%s); the next "
                 "attempt's replaces it.\n", path.c_str(), attempt, kept.c_str(), std::strerror(errno));
  }
}

// --timeline FILE: the ranks' timelines (rank, file), one process track
// each, merged into `out` with times from the earliest event (Note
// [Timeline] in src/util/timeline.cpp). Written whole and renamed into place. The
// ranks' counts of events left out past their cap are kept, and said. False
// if `out` could not be written (said).
inline bool merge_timelines(const std::vector<std::pair<int, std::string>>& parts, const std::string& out_path) {
  nlohmann::json events = nlohmann::json::array();
  nlohmann::json dropped = nlohmann::json::object();
  std::string notes;
  size_t read = 0;
  for (const auto& [rank, path] : parts) {
    std::ifstream in(path);
    auto part = in ? nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false) : nlohmann::json();
    if (!part.is_object() || !part.contains("traceEvents")) {
      notes += "; no timeline from rank " + std::to_string(rank) + ": it wrote none (it was stopped before it "
               "could, or records no timeline)";
      continue;
    }
    ++read;
    for (auto& e : part["traceEvents"]) {
      events.push_back(std::move(e));
    }
    if (part.contains("lockstep_dropped_events")) {
      dropped[std::to_string(rank)] = part["lockstep_dropped_events"];
      notes += "; rank " + std::to_string(rank) + " left out " + part["lockstep_dropped_events"].dump() +
               " events past its cap";
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
  nlohmann::json merged = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  if (!dropped.empty()) {
    merged["lockstep_dropped_events"] = std::move(dropped); // by rank
  }
  const std::string partial = out_path + ".partial";
  errno = 0;
  std::ofstream out(partial);
  out << merged.dump() << "\n";
  out.close();
  if (!out || std::rename(partial.c_str(), out_path.c_str()) != 0) {
    std::fprintf(stderr, "lockstep-run: --timeline %s: cannot write it (%s).\n", out_path.c_str(),
                 errno != 0 ? std::strerror(errno) : "write failed");
    std::remove(partial.c_str());
    return false;
  }
  std::fprintf(stderr, "lockstep-run: timeline of %zu rank(s) in %s (open it in https://ui.perfetto.dev or "
               "chrome://tracing)%s\n", read, out_path.c_str(), notes.c_str());
  return true;
}

} // namespace tools
} // namespace lockstep
