#pragma once

// lockstep-train's outputs besides the model: metrics.jsonl, one JSON record
// per line (nlohmann-json), and curves.png, drawn by gnuplot from a script
// the trainer writes next to it (curves.gp, data included), so the picture
// can be redrawn or restyled by hand.

#include <common/process_files.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace examples {

/// Appends records to `path`. A resumed run first drops the records past the
/// step it resumes from: the failed attempt trained those steps, and this one
/// trains them again.
class MetricsLog {
 public:
  MetricsLog() = default;
  MetricsLog(const std::string& path, int64_t resumed_step) : path_(path) {
    std::vector<std::string> kept;
    struct stat info {};
    std::ifstream in;
    if (::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode)) { // a device or a pipe has no records to keep
      in.open(path);
    }
    for (std::string line; std::getline(in, line);) {
      const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!record.is_discarded() && record.value("step", int64_t{0}) <= resumed_step) {
        kept.push_back(line);
      }
    }
    out_.open(path, std::ios::trunc);
    TORCH_CHECK(out_.good(), "lockstep-train: cannot write ", path, ".");
    for (const auto& line : kept) {
      out_ << line << '\n';
    }
    flush();
  }
  bool enabled() const {
    return out_.is_open();
  }
  void write(const nlohmann::json& record) {
    if (enabled()) {
      out_ << record.dump() << '\n';
      flush();
    }
  }
  const std::string& path() const {
    return path_;
  }

 private:
  // A record that did not reach the file is an error, not a gap in the
  // metrics that nothing mentions.
  void flush() {
    out_.flush();
    TORCH_CHECK(out_.good(), "lockstep-train: could not write ", path_, " (", std::strerror(errno),
                "; is the disk full?). Free some space and run again: it resumes from the checkpoint.");
  }

  std::string path_;
  std::ofstream out_;
};

// A record's number under `key`; NaN where it has none, or where the value
// was not finite (nlohmann-json writes NaN and infinity as null).
inline double number_of(const nlohmann::json& record, const char* key) {
  const auto it = record.find(key);
  return it != record.end() && it->is_number() ? it->get<double>() : std::nan("");
}

// A record's training speed: samples (images) or tokens (--model gpt) a second.
inline double speed_of(const nlohmann::json& record) {
  return record.contains("tokens_per_second") ? number_of(record, "tokens_per_second")
                                              : number_of(record, "samples_per_second");
}

// Whether the PNG file at `path` is whole: it ends with the IEND chunk. A
// program that ran out of disk (gnuplot among them) may leave a cut one and
// still exit with 0.
inline bool png_is_whole(const std::string& path) {
  static const unsigned char kEnd[12] = {0, 0, 0, 0, 'I', 'E', 'N', 'D', 0xAE, 0x42, 0x60, 0x82};
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in || in.tellg() < static_cast<std::streamoff>(8 + sizeof(kEnd))) {
    return false;
  }
  unsigned char tail[sizeof(kEnd)] = {};
  in.seekg(-static_cast<std::streamoff>(sizeof(kEnd)), std::ios::end);
  in.read(reinterpret_cast<char*>(tail), sizeof(tail));
  return in.good() && std::memcmp(tail, kEnd, sizeof(kEnd)) == 0;
}

// Runs `program` `argument` in the folder `dir`, without a shell (no name is
// ever parsed as a command); returns its exit status (-1 when it could not
// start) and what it wrote on stdout and stderr.
inline std::pair<int, std::string> run_in(const std::string& dir, const std::string& program,
                                          const std::string& argument) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    return {-1, std::string("no pipe: ") + std::strerror(errno)};
  }
  const pid_t pid = ::fork();
  if (pid == 0) { // only async-signal-safe calls until exec
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    if (::chdir(dir.c_str()) == 0) {
      ::execl(program.c_str(), program.c_str(), argument.c_str(), static_cast<char*>(nullptr));
    }
    static const char kFailed[] = "could not enter the folder or start the program\n";
    (void)!::write(STDERR_FILENO, kFailed, sizeof(kFailed) - 1);
    ::_exit(127);
  }
  if (pid < 0) {
    const std::string why = std::string("no process: ") + std::strerror(errno);
    ::close(fds[0]);
    ::close(fds[1]);
    return {-1, why};
  }
  ::close(fds[1]);
  std::string output;
  char buffer[512];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof(buffer))) != 0;) {
    if (n > 0) {
      output.append(buffer, static_cast<size_t>(n));
    } else if (errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) {
    return {-1, "killed by signal " + std::to_string(WTERMSIG(status)) + "; " + output};
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

// Writes `dir`/curves.gp with the data, and runs gnuplot on it in `dir`:
// "" when curves.png was drawn whole, else why not. `train_data`: epoch,
// loss, samples/s per line; `test`: epoch, test loss, test accuracy (%).
inline std::string draw_curves(const std::string& dir, const std::string& train_data, const std::string& test) {
  if (test.empty()) {
    return "no evaluation finished with a finite test loss, so no curves";
  }
  const std::string script = dir + "/curves.gp", png = dir + "/curves.png";
  std::ofstream gp(script);
  gp << "# Written by lockstep-train; redraw in this folder with: gnuplot curves.gp\n"
     << "$train << EOD\n" << train_data << "EOD\n"
     << "$test << EOD\n" << test << "EOD\n"
     << "set terminal pngcairo size 1200,400 font 'sans,10'\n"
     << "set output 'curves.png'\n"
     << "set multiplot layout 1,3\n"
     << "set grid\nset xlabel 'epoch'\nset xrange [0:*]\nset key top right\n"
     << "set title 'loss'\n"
     << "plot $train using 1:2 with lines lw 1.5 title 'train', $test using 1:2 with linespoints lw 2 pt 7 title 'test'\n"
     << "set title 'test accuracy (%)'\nset key off\n"
     << "plot $test using 1:3 with linespoints lw 2 pt 7 lc 3\n"
     << "set title 'training samples (or tokens) a second, all ranks'\nset yrange [0:*]\n"
     << "plot $train using 1:3 with lines lw 1.5 lc 4\n"
     << "unset multiplot\n";
  gp.close();
  if (!gp) {
    return "could not write " + script + " (" + std::strerror(errno) + "; is the disk full?), so no curves.png";
  }
  std::string gnuplot = common::find_program("gnuplot");
  if (gnuplot.empty()) {
    return "gnuplot is not installed, so no curves.png (install gnuplot-nox, as scripts/setup.sh does, then run "
           "gnuplot curves.gp in " + dir + ")";
  }
  char cwd[4096];
  if (gnuplot[0] != '/' && ::getcwd(cwd, sizeof(cwd)) != nullptr) { // a relative PATH entry; gnuplot runs in `dir`
    gnuplot = std::string(cwd) + "/" + gnuplot;
  }
  const auto [status, output] = run_in(dir, gnuplot, "curves.gp");
  if (status != 0) {
    return "gnuplot failed on " + script + " (exit status " + std::to_string(status) + "): " + output;
  }
  if (!png_is_whole(png)) {
    ::unlink(png.c_str());
    return "gnuplot left " + png + " missing or cut short (is the disk full?), so it was removed; run gnuplot "
           "curves.gp in " + dir + " to draw it again";
  }
  return "";
}

/// What plot_curves drew.
struct Curves {
  std::string missing; // "" when curves.png was drawn, else a one-line note on why not
  // The step of the first record whose training loss was not finite (NaN
  // or infinite); -1 when every loss was. Its points are left out.
  int64_t first_non_finite_step = -1;
};

/// Draws `dir`/curves.png from `dir`/metrics.jsonl: the training loss
/// (every --log-every steps) and the test loss, the test accuracy, and the
/// training speed, against epochs. Points whose value is not finite are
/// left out, and the first such training loss is noted.
inline Curves plot_curves(const std::string& dir) {
  Curves curves;
  std::ostringstream train, test, epochs;
  std::ifstream in(dir + "/metrics.jsonl");
  const auto point = [](std::ostringstream& out, double x, double y, double z) {
    if (std::isfinite(y) && std::isfinite(z)) {
      out << x << ' ' << y << ' ' << z << '\n';
    }
  };
  for (std::string line; std::getline(in, line);) {
    const auto r = nlohmann::json::parse(line, nullptr, false);
    if (r.is_discarded()) {
      continue;
    }
    const std::string kind = r.value("kind", "");
    const double x = number_of(r, "epochs_done");
    const double loss = number_of(r, kind == "train" ? "loss" : "train_loss");
    if ((kind == "train" || kind == "epoch") && !std::isfinite(loss) && curves.first_non_finite_step < 0) {
      curves.first_non_finite_step = r.value("step", int64_t{0});
    }
    if (kind == "train") {
      point(train, x, loss, speed_of(r));
    } else if (kind == "epoch" || kind == "eval") {
      point(test, x, number_of(r, "test_loss"), 100 * number_of(r, "test_accuracy"));
    }
    if (kind == "epoch") {
      point(epochs, x, loss, speed_of(r));
    }
  }
  curves.missing = draw_curves(dir, train.str().empty() ? epochs.str() : train.str(), test.str());
  return curves;
}

} // namespace examples
} // namespace lockstep
