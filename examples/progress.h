#pragma once

// lockstep-train's progress bar on stderr: one line per epoch, redrawn in
// place on a terminal, or a plain line every 10% otherwise (a log file, or
// lockstep-run's pipes).

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace lockstep {
namespace examples {

/// `seconds` as M:SS, or "--:--" when unknown.
inline std::string clock_time(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) {
    return "--:--";
  }
  const auto s = static_cast<long>(seconds + 0.5);
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%ld:%02ld", s / 60, s % 60);
  return buffer;
}

/// The progress of one epoch: rows done of every rank, running loss and
/// accuracy, speed and time left. A resumed epoch starts at `resumed` rows,
/// which count towards the bar but not towards the speed.
class Progress {
 public:
  using Clock = std::chrono::steady_clock;

  /// A bar that draws nothing unless `enabled` (rank 0 draws it); its rows
  /// are `unit` (samples, or tokens) in its speed.
  Progress(int64_t total, int64_t resumed, int epoch, int epochs, bool enabled, const char* unit = "samples")
      : total_(total), resumed_(resumed), epoch_(epoch), epochs_(epochs), start_(Clock::now()), enabled_(enabled),
        unit_(unit) {
    tty_ = isatty(fileno(stderr)) != 0;
  }

  /// Shows `done` rows of the total, at mean loss `loss` and `accuracy` (0-1).
  void update(int64_t done, double loss, double accuracy) {
    if (!enabled_ || total_ == 0) {
      return;
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    const double rate = elapsed > 0 ? (done - resumed_) / elapsed : 0;
    const double eta = rate > 0 ? (total_ - done) / rate : NAN;
    const int percent = static_cast<int>(100 * done / total_);
    if (!tty_ && percent < next_percent_ && done < total_) {
      return;
    }
    next_percent_ = (percent / 10 + 1) * 10;
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * done / total_);
    std::string bar(filled, '=');
    if (filled < kWidth) {
      bar += '>';
      bar += std::string(kWidth - filled - 1, ' ');
    }
    std::fprintf(stderr, "%sepoch %d/%d [%s] %3d%% loss %.4f acc %5.1f%% %7.0f %s/s ETA %s%s",
                 tty_ ? "\r" : "", epoch_, epochs_, bar.c_str(), percent, loss, 100 * accuracy, rate, unit_,
                 clock_time(eta).c_str(), tty_ ? "" : "\n");
    if (tty_ && done == total_) {
      std::fprintf(stderr, "\n");
    }
    std::fflush(stderr);
  }

 private:
  int64_t total_, resumed_;
  int epoch_, epochs_;
  Clock::time_point start_;
  bool tty_;
  bool enabled_;
  const char* unit_;
  int next_percent_ = 0;
};

} // namespace examples
} // namespace lockstep
