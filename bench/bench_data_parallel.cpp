// Training-step throughput: the bare module on every core against
// lockstep::DataParallel with CPU replicas, side by side in one run.
//
//   build/lockstep-bench-dp [--rounds N] [--seconds S] [--replicas R] [--model mlp|cnn] [--device cpu|cuda]
//
// Each round times every contender for about S seconds, in alternating order,
// each CPU contender in a process of its own (this program again, with
// --contender); the report gives the median samples/s of each and ratios of
// medians. Contenders: see cpu_contender(). "ceiling" is one replica's share
// of the batch on one thread, counted as if R replicas ran side by side for
// free: what DataParallel could reach. "threads" is R independent copies of
// the module on R threads of one process, with no DataParallel: what threads
// sharing one process reach. DataParallel and the ceiling run again under
// OMP_WAIT_POLICY=passive, so that libgomp's spinning shows as the gap
// between the two. --device cuda (by hand on a GPU machine) times instead, in one
// process, the bare module on cuda:0, DataParallel over every visible GPU, and
// DistributedDataParallel with world size 1 over NCCL; bench/gpu_python.py is
// the Python peer.

#include <examples/blas_check.h>
#include <examples/models.h>

#include "bench_cli.h"

#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Contender {
  std::string name;
  std::function<void()> step;
  std::vector<double> rates; // samples/s per round
  int threads = 0; // intra-op threads of the timing thread for this contender; 0: as the process has them
  std::function<void()> before = nullptr; // untimed, right before each timing
  int seen_threads = 0; // the timing thread's intra-op threads when it was last timed
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Runs `step` for about `seconds` and returns samples/s. On a GPU, each step
// is waited for, so that the time is the device's and not the queue's.
double time_steps(const std::function<void()>& step, int64_t batch, double seconds, bool cuda) {
  auto run = [&] {
    step();
    if (cuda) {
      torch::cuda::synchronize();
    }
  };
  run(); // warm-up
  int64_t steps = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  do {
    run();
    ++steps;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds);
  return static_cast<double>(steps * batch) / elapsed;
}

// One SGD step of `module` through `forward` on fixed inputs `x`.
std::function<void()> training_step(
    torch::nn::Module& module,
    std::function<torch::Tensor(const torch::Tensor&)> forward,
    torch::Tensor x) {
  auto optimizer = std::make_shared<torch::optim::SGD>(module.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto y = torch::randint(0, 10, {x.size(0)}, torch::TensorOptions().dtype(torch::kLong).device(x.device()));
  return [=] {
    optimizer->zero_grad();
    torch::cross_entropy_loss(forward(x), y).backward();
    optimizer->step();
  };
}

// One CPU contender, by name:
// - bare: the module on every core;
// - threads: R copies of the module, each on its own thread with one
//   intra-op thread, each stepping on its share of the batch;
// - dataparallel: DataParallel over `replicas` CPU replicas;
// - ceiling: one replica's share of the batch on one thread, as if R of them
//   ran side by side with no cost at all (its rate counts the whole batch);
// - bare-after-dp: the bare module timed right after two DataParallel steps on
//   the same thread, what a program that mixes the two gets (Note [CPU
//   replicas and threads]: the caller's threads must come back after each call).
template <typename Net>
Contender cpu_contender(
    const std::string& name,
    const std::function<Net()>& make,
    std::vector<int64_t> sample_shape,
    int64_t batch,
    int replicas) {
  auto inputs = [&](int64_t rows) {
    auto shape = sample_shape;
    shape.insert(shape.begin(), rows);
    return torch::randn(shape);
  };
  auto plain = [&](int64_t rows) {
    Net net = make();
    return training_step(*net, [net](const torch::Tensor& x) mutable { return net->forward(x); }, inputs(rows));
  };
  if (name == "bare") {
    return {name, plain(batch), {}};
  }
  if (name == "ceiling") {
    return {name, plain(batch / replicas), {}, 1};
  }
  if (name == "threads") {
    std::vector<std::function<void()>> steps;
    for (int r = 0; r < replicas; ++r) {
      steps.push_back(plain(batch / replicas));
    }
    return {name, [steps] {
              std::vector<std::thread> threads;
              for (const auto& step : steps) {
                threads.emplace_back([&step] {
                  at::set_num_threads(1);
                  step();
                });
              }
              for (auto& t : threads) {
                t.join();
              }
            }, {}};
  }
  lockstep::DataParallel<Net> dp(make(), lockstep::DataParallelOptions().devices(std::vector<torch::Device>(replicas, torch::kCPU)));
  auto dp_step = training_step(*dp, [dp](const torch::Tensor& x) mutable { return dp(x); }, inputs(batch));
  if (name == "dataparallel") {
    return {name, dp_step, {}};
  }
  TORCH_CHECK(name == "bare-after-dp", "lockstep-bench-dp: no contender '", name, "'");
  return {name, plain(batch), {}, 0, [dp_step] { dp_step(); dp_step(); }};
}

// On GPUs: the bare module on cuda:0, DataParallel over every visible GPU
// (with one GPU, the module itself behind the wrapper), and DDP with world
// size 1 over NCCL (its bucketing and hooks, with a real NCCL allreduce).
template <typename Net>
std::vector<Contender> gpu_contenders_for(const std::function<Net()>& make, std::vector<int64_t> sample_shape, int64_t batch) {
  const torch::Device gpu(torch::kCUDA, 0);
  sample_shape.insert(sample_shape.begin(), batch);
  auto x = torch::randn(sample_shape, gpu);
  auto on_gpu = [&] {
    Net net = make();
    net->to(gpu);
    return net;
  };
  std::vector<Contender> contenders;
  Net bare = on_gpu();
  contenders.push_back({"bare", training_step(*bare, [bare](const torch::Tensor& x) mutable { return bare->forward(x); }, x), {}});
  lockstep::DataParallel<Net> dp(on_gpu());
  contenders.push_back({"dataparallel", training_step(*dp, [dp](const torch::Tensor& x) mutable { return dp(x); }, x), {}});
  auto group = lockstep::new_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, "nccl");
  lockstep::DistributedDataParallel<Net> ddp(on_gpu(), group);
  contenders.push_back({"ddp-nccl", training_step(*ddp, [ddp](const torch::Tensor& x) mutable { return ddp(x); }, x), {}});
  return contenders;
}

void print_row(const std::string& model, int64_t batch, const std::string& name, const std::vector<double>& rates,
               double base, int threads) {
  const double m = median(rates);
  std::printf("%-5s batch %-4lld %-24s %10.1f samples/s   ratio %.3f   (rounds:", model.c_str(),
              static_cast<long long>(batch), name.c_str(), m, m / base);
  for (double v : rates) {
    std::printf(" %.0f", v);
  }
  std::printf(")   threads %d\n", threads);
}

// GPU contenders share one process: the GPU, not the host's threads, sets
// their speed.
void run_gpu_model(const std::string& model, int64_t batch, int rounds, double seconds) {
  using lockstep::examples::ConvNet;
  auto contenders = model == "mlp" ? gpu_contenders_for<torch::nn::Sequential>(lockstep::examples::make_mlp, {784}, batch)
                                   : gpu_contenders_for<ConvNet>([] { return ConvNet(); }, {1, 28, 28}, batch);
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < contenders.size(); ++i) {
      auto& c = contenders[(i + r) % contenders.size()];
      c.seen_threads = at::get_num_threads();
      c.rates.push_back(time_steps(c.step, batch, seconds, /*cuda=*/true));
    }
  }
  for (const auto& c : contenders) {
    print_row(model, batch, c.name, c.rates, median(contenders[0].rates), c.seen_threads);
  }
}

// A child process: times one CPU contender once and prints "rate R threads T".
void run_one(const std::string& model, const std::string& name, int64_t batch, double seconds, int replicas) {
  using lockstep::examples::ConvNet;
  auto c = model == "mlp" ? cpu_contender<torch::nn::Sequential>(name, lockstep::examples::make_mlp, {784}, batch, replicas)
                          : cpu_contender<ConvNet>(name, [] { return ConvNet(); }, {1, 28, 28}, batch, replicas);
  // Only the ceiling changes the timing thread's count: every other
  // contender runs with what the process has, as a program would.
  if (c.threads > 0) {
    at::set_num_threads(c.threads);
  }
  if (c.before) {
    c.before();
  }
  const int threads = at::get_num_threads();
  std::printf("rate %.3f threads %d\n", time_steps(c.step, batch, seconds, false), threads);
}

// One run of a CPU contender in its own process, so that no contender's
// OpenMP team or heap is another's; `passive` starts it under
// OMP_WAIT_POLICY=passive, which libgomp reads only at start-up.
std::pair<double, int> spawn_one(const std::string& self, const std::string& model, const std::string& name,
                                 bool passive, double seconds, int replicas) {
  const std::string command = std::string(passive ? "OMP_WAIT_POLICY=passive " : "") + "'" + self + "' --model " +
      model + " --contender " + name + " --seconds " + std::to_string(seconds) + " --replicas " +
      std::to_string(replicas);
  FILE* child = popen(command.c_str(), "r");
  TORCH_CHECK(child != nullptr, "lockstep-bench-dp: could not start '", command, "'");
  double rate = 0;
  int threads = 0;
  char line[256];
  bool found = false;
  while (std::fgets(line, sizeof(line), child) != nullptr) {
    found = found || std::sscanf(line, "rate %lf threads %d", &rate, &threads) == 2;
  }
  const int status = pclose(child);
  TORCH_CHECK(found && status == 0, "lockstep-bench-dp: '", command, "' failed (status ", status, ")");
  return {rate, threads};
}

// CPU contenders, each round in alternating order, each run in its own
// process; dataparallel and ceiling also under OMP_WAIT_POLICY=passive, so
// that the share of libgomp's spinning stays visible.
void run_cpu_model(const std::string& self, const std::string& model, int64_t batch, int rounds, double seconds,
                   int replicas) {
  struct Run {
    std::string name;
    bool passive;
    std::vector<double> rates;
    int threads = 0;
  };
  std::vector<Run> runs = {{"bare", false, {}}, {"dataparallel", false, {}}, {"ceiling", false, {}},
                           {"bare-after-dp", false, {}}, {"dataparallel", true, {}}, {"ceiling", true, {}},
                           {"threads", false, {}}};
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < runs.size(); ++i) {
      auto& run = runs[(i + r) % runs.size()];
      auto [rate, threads] = spawn_one(self, model, run.name, run.passive, seconds, replicas);
      run.rates.push_back(rate);
      run.threads = threads;
    }
  }
  const double base = median(runs[0].rates);
  for (const auto& run : runs) {
    print_row(model, batch, run.name + (run.passive ? " (passive)" : ""), run.rates, base, run.threads);
  }
  std::printf("%-5s dataparallel / ceiling: %.3f   with OMP_WAIT_POLICY=passive: %.3f   threads / ceiling: %.3f\n",
              model.c_str(), median(runs[1].rates) / median(runs[2].rates),
              median(runs[4].rates) / median(runs[5].rates), median(runs[6].rates) / median(runs[2].rates));
  std::fflush(stdout);
}

struct Options : lockstep::bench::RoundOptions {
  int replicas = 2;
  std::string device = "cpu";
};

// Parses the command line into `options`; returns -1 to go on, else the
// exit code (0 after --help, 2 for a refused command line).
int parse_options(int argc, char** argv, Options& options) {
  CLI::App app{"lockstep-bench-dp: training-step throughput of the bare module against lockstep::DataParallel, "
               "side by side in one run (median samples/s and ratio of medians)."};
  lockstep::bench::add_round_options(app, options);
  app.add_option("--replicas", options.replicas, "DataParallel's CPU replicas")->check(CLI::PositiveNumber)
      ->capture_default_str();
  lockstep::bench::add_model_option(app, options);
  app.add_option("--device", options.device, "cpu: CPU replicas; cuda: every visible GPU, and DDP over NCCL")
      ->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  lockstep::bench::add_contender_option(app, options, "Time only this CPU contender, once, in this process (needs --model)",
                                        {"bare", "dataparallel", "ceiling", "bare-after-dp", "threads"});
  try {
    app.parse(argc, argv);
    if (!options.contender.empty() && (options.only.empty() || options.device != "cpu")) {
      throw CLI::ValidationError("--contender", "needs --model and the cpu device");
    }
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {
      return app.exit(e); // --help
    }
    std::fprintf(stderr, "lockstep-bench-dp: %s\nusage: %s [--rounds N] [--seconds S] [--replicas R] [--model mlp|cnn] "
                 "[--device cpu|cuda] [--contender NAME]\n", e.what(), argv[0]);
    return 2;
  }
  return -1;
}

constexpr int64_t kMlpBatch = 256;
constexpr int64_t kCnnBatch = 128;

// Every contender of each model (or of --model's), round after round.
void run_all(const Options& options) {
  const bool cuda = options.device == "cuda";
  if (cuda) {
    TORCH_CHECK(torch::cuda::is_available(), "lockstep-bench-dp --device cuda: this process sees no CUDA device.");
    std::printf("%d CUDA device(s); DataParallel uses all of them\n", static_cast<int>(torch::cuda::device_count()));
  } else {
    std::printf("threads %d, BLAS %s, %d CPU replicas; each contender in its own process\n", at::get_num_threads(),
                lockstep::examples::loaded_blas().c_str(), options.replicas);
  }
  const std::string self = lockstep::bench::own_path("lockstep-bench-dp");
  for (const auto& [model, batch] : {std::make_pair(std::string("mlp"), kMlpBatch), std::make_pair(std::string("cnn"), kCnnBatch)}) {
    if (!options.only.empty() && options.only != model) {
      continue;
    }
    if (cuda) {
      run_gpu_model(model, batch, options.rounds, options.seconds);
    } else {
      run_cpu_model(self, model, batch, options.rounds, options.seconds, options.replicas);
    }
  }
}

} // namespace

int main(int argc, char** argv) {
  Options options;
  if (const int exit_code = parse_options(argc, argv, options); exit_code >= 0) {
    return exit_code;
  }
  try {
    lockstep::examples::require_fast_blas("lockstep-bench-dp");
    // "All cores" explicitly: libtorch's own default can be lower (it asks
    // cpuinfo for physical cores, which fails on some virtual machines).
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    torch::manual_seed(0);
    if (!options.contender.empty()) {
      run_one(options.only, options.contender, options.only == "mlp" ? kMlpBatch : kCnnBatch, options.seconds,
              options.replicas);
      return 0;
    }
    run_all(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
