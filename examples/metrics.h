#pragma once

// lockstep-train's outputs besides the model: metrics.jsonl, one JSON record
// per line (nlohmann-json), and curves.png, drawn by gnuplot from a script
// the trainer writes next to it (curves.gp, data included), so the picture
// can be redrawn or restyled by hand.

#include <common/process_files.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
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
    std::ifstream in(path);
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
    out_.flush();
  }
  bool enabled() const {
    return out_.is_open();
  }
  void write(const nlohmann::json& record) {
    if (enabled()) {
      out_ << record.dump() << '\n';
      out_.flush();
    }
  }
  const std::string& path() const {
    return path_;
  }

 private:
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

// Writes `dir`/curves.gp with the data, and runs gnuplot on it: "" when
// curves.png was drawn, else why not. `train_data`: epoch, loss, samples/s
// per line; `test`: epoch, test loss, test accuracy (%).
inline std::string draw_curves(const std::string& dir, const std::string& train_data, const std::string& test) {
  if (test.empty()) {
    return "no evaluation finished with a finite test loss, so no curves";
  }
  const std::string script = dir + "/curves.gp";
  std::ofstream gp(script);
  gp << "# Written by lockstep-train; redraw with: gnuplot " << script << "\n"
     << "$train << EOD\n" << train_data << "EOD\n"
     << "$test << EOD\n" << test << "EOD\n"
     << "set terminal pngcairo size 1200,400 font 'sans,10'\n"
     << "set output '" << dir << "/curves.png'\n"
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
  if (common::find_program("gnuplot").empty()) {
    return "gnuplot is not installed, so no curves.png (install gnuplot-nox, as scripts/setup.sh does, then run: "
           "gnuplot " + script + ")";
  }
  const std::string command = "gnuplot '" + script + "' 2>&1";
  std::FILE* pipe = ::popen(command.c_str(), "r");
  std::string output;
  char buffer[512];
  while (pipe != nullptr && std::fgets(buffer, sizeof(buffer), pipe) != nullptr) {
    output += buffer;
  }
  const int status = pipe != nullptr ? ::pclose(pipe) : -1;
  if (status != 0) {
    return "gnuplot failed on " + script + ": " + output;
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
