// lockstep-bench-amp: training steps (forward, backward, SGD step) of the
// DDP benchmark's MLP and the trainer's CNN, in fp32 and under
// lockstep::AutocastGuard to bfloat16, on this machine's CPU. Each contender
// runs in its own process, rounds alternate the order, and the figures are
// medians with bf16's ratio to fp32. Each row also splits a step into
// forward, backward and optimizer, to show where bf16 gains or loses.
// --fp16 adds autocast to float16 (PyTorch 2.4 or later on the CPU), to show
// what lockstep-train's note on fp16 on a CPU says. Every contender keeps
// freed memory in glibc's heap, as lockstep-train does: otherwise the
// step's page faults, which autocast's casts multiply, are what is timed.
//
//   build/lockstep-bench-amp [--rounds N] [--seconds S] [--model mlp|cnn] [--fp16]

#include <lockstep/lockstep.h>

#include <examples/models.h>
#include <examples/process_settings.h>

#include "bench_cli.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Phases {
  double forward = 0, backward = 0, step = 0; // ms per step, summed then divided
};

// Trains `model` on random data for `seconds` after a warm-up; prints
// "rate R forward F backward B step S" (samples/s, ms per step).
template <typename Model>
void time_contender(Model model, const std::vector<int64_t>& input_shape, torch::ScalarType dtype, double seconds) {
  torch::manual_seed(0);
  auto x = torch::randn(input_shape);
  auto y = torch::randint(0, 10, {input_shape[0]});
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  Phases total;
  auto one_step = [&](Phases& p) {
    sgd.zero_grad();
    auto t = Clock::now();
    torch::Tensor loss;
    {
      std::unique_ptr<lockstep::AutocastGuard> autocast;
      if (dtype != torch::kFloat) {
        autocast = std::make_unique<lockstep::AutocastGuard>(torch::kCPU, dtype);
      }
      loss = torch::cross_entropy_loss(model->forward(x), y);
    }
    p.forward += ms_since(t);
    t = Clock::now();
    loss.backward();
    p.backward += ms_since(t);
    t = Clock::now();
    sgd.step();
    p.step += ms_since(t);
  };
  Phases warmup;
  for (int i = 0; i < 3; ++i) {
    one_step(warmup);
  }
  int64_t steps = 0;
  const auto start = Clock::now();
  while (ms_since(start) < seconds * 1000) {
    one_step(total);
    ++steps;
  }
  const double elapsed = ms_since(start) / 1000;
  std::printf("rate %.3f forward %.3f backward %.3f step %.3f\n", static_cast<double>(steps * input_shape[0]) / elapsed,
              total.forward / steps, total.backward / steps, total.step / steps);
}

struct Row {
  std::string precision;
  std::vector<double> rate, forward, backward, step;
};

void spawn(const std::string& self, const std::string& model, Row& row, double seconds) {
  const std::string command = "'" + self + "' --model " + model + " --contender " + row.precision + " --seconds " +
      std::to_string(seconds);
  FILE* child = popen(command.c_str(), "r");
  TORCH_CHECK(child != nullptr, "lockstep-bench-amp: could not start '", command, "'");
  double r = 0, f = 0, b = 0, s = 0;
  bool found = false;
  char line[256];
  while (std::fgets(line, sizeof(line), child) != nullptr) {
    found = found || std::sscanf(line, "rate %lf forward %lf backward %lf step %lf", &r, &f, &b, &s) == 4;
  }
  const int status = pclose(child);
  TORCH_CHECK(found && status == 0, "lockstep-bench-amp: '", command, "' failed (status ", status, ")");
  row.rate.push_back(r);
  row.forward.push_back(f);
  row.backward.push_back(b);
  row.step.push_back(s);
}

void run_model(const std::string& self, const std::string& model, int rounds, double seconds, bool fp16) {
  std::vector<Row> rows = {{"fp32", {}, {}, {}, {}}, {"bf16", {}, {}, {}, {}}};
  if (fp16) {
    rows.push_back({"fp16", {}, {}, {}, {}});
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < rows.size(); ++i) {
      spawn(self, model, rows[(i + r) % rows.size()], seconds);
    }
  }
  for (const auto& row : rows) {
    std::printf("%-4s %-5s %10.1f samples/s   forward %7.2f ms   backward %7.2f ms   step %6.2f ms   (rounds:",
                model.c_str(), row.precision.c_str(), median(row.rate), median(row.forward), median(row.backward),
                median(row.step));
    for (double v : row.rate) {
      std::printf(" %.0f", v);
    }
    std::printf(")\n");
  }
  for (size_t i = 1; i < rows.size(); ++i) {
    std::printf("%-4s %s / fp32: %.3f (forward %.3f, backward %.3f of fp32's time)\n", model.c_str(),
                rows[i].precision.c_str(), median(rows[i].rate) / median(rows[0].rate),
                median(rows[i].forward) / median(rows[0].forward), median(rows[i].backward) / median(rows[0].backward));
  }
  std::fflush(stdout);
}

} // namespace

int main(int argc, char** argv) {
  lockstep::bench::RoundOptions options;
  bool fp16 = false;
  CLI::App app{"lockstep-bench-amp: training-step throughput in fp32 and under bf16 autocast on the CPU, side by "
               "side in one run (median samples/s and ratio of medians)."};
  lockstep::bench::add_round_options(app, options);
  lockstep::bench::add_model_option(app, options);
  lockstep::bench::add_contender_option(app, options, "Time only this precision, once, in this process (needs --model)",
                                        {"fp32", "bf16", "fp16"});
  app.add_flag("--fp16", fp16, "Also time autocast to float16 (PyTorch 2.4 or later)");
  CLI11_PARSE(app, argc, argv);
  lockstep::examples::keep_freed_memory();
  const std::string& only = options.only;
  const std::string& contender = options.contender;
  try {
    if (!contender.empty()) {
      TORCH_CHECK(!only.empty(), "lockstep-bench-amp: --contender needs --model");
      const auto dtype = contender == "bf16" ? torch::kBFloat16 : contender == "fp16" ? torch::kHalf : torch::kFloat;
      if (only == "mlp") {
        time_contender(lockstep::examples::make_mlp(), {256, 784}, dtype, options.seconds);
      } else {
        time_contender(lockstep::examples::ConvNet(), {128, 1, 28, 28}, dtype, options.seconds);
      }
      return 0;
    }
    std::printf("lockstep-bench-amp: %d rounds of %.1f s per contender, %d intra-op threads, LibTorch %s\n",
                options.rounds, options.seconds, at::get_num_threads(), TORCH_VERSION);
    for (const std::string model : {"mlp", "cnn"}) {
      if (only.empty() || only == model) {
        run_model(lockstep::bench::own_path("lockstep-bench-amp"), model, options.rounds, options.seconds, fp16);
      }
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
