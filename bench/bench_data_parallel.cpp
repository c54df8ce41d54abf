// Training-step throughput: the bare module on every core against
// lockstep::DataParallel with CPU replicas, side by side in one run.
//
//   build/lockstep-bench-dp [--rounds N] [--seconds S] [--replicas R] [--model mlp|cnn] [--device cpu|cuda]
//
// Each round times every contender for about S seconds, in alternating order;
// the report gives the median samples/s of each and the ratio of medians.
// "ceiling" is one replica's share of the batch on one thread, counted as if
// R replicas ran side by side for free: what DataParallel could reach.
// --device cuda (scripts/gpu-check) times instead the bare module on cuda:0,
// DataParallel over every visible GPU, and DistributedDataParallel with world
// size 1 over NCCL; bench/gpu_python.py is the Python peer.

#include <examples/blas_check.h>
#include <examples/models.h>

#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
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

// The bare module on every core, DataParallel on `replicas` CPU replicas, and
// the ceiling for R replicas: one replica's share of the batch on one thread,
// as if R of them ran side by side with no cost at all.
template <typename Net>
std::vector<Contender> contenders_for(
    const std::function<Net()>& make,
    std::vector<int64_t> sample_shape,
    int64_t batch,
    int replicas) {
  auto inputs = [&](int64_t rows) {
    auto shape = sample_shape;
    shape.insert(shape.begin(), rows);
    return torch::randn(shape);
  };
  std::vector<Contender> contenders;
  Net bare = make();
  contenders.push_back({"bare", training_step(*bare, [bare](const torch::Tensor& x) mutable { return bare->forward(x); }, inputs(batch)), {}});
  lockstep::DataParallel<Net> dp(make(), lockstep::DataParallelOptions().devices(std::vector<torch::Device>(replicas, torch::kCPU)));
  contenders.push_back({"dataparallel", training_step(*dp, [dp](const torch::Tensor& x) mutable { return dp(x); }, inputs(batch)), {}});
  Net single = make();
  contenders.push_back({"ceiling", training_step(*single, [single](const torch::Tensor& x) mutable { return single->forward(x); }, inputs(batch / replicas)), {}, 1});
  // The bare module again, timed right after DataParallel steps on the same
  // thread: what a program that mixes the two gets (Note [CPU replicas and
  // threads]: the caller's threads must come back after each call).
  Net after = make();
  auto dp_step = contenders[1].step;
  contenders.push_back({"bare-after-dp", training_step(*after, [after](const torch::Tensor& x) mutable { return after->forward(x); }, inputs(batch)), {}, 0,
                        [dp_step] { dp_step(); dp_step(); }});
  return contenders;
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

void run_model(const std::string& model, int64_t batch, int rounds, double seconds, int replicas, bool cuda) {
  using lockstep::examples::ConvNet;
  auto contenders = model == "mlp"
      ? (cuda ? gpu_contenders_for<torch::nn::Sequential>(lockstep::examples::make_mlp, {784}, batch)
              : contenders_for<torch::nn::Sequential>(lockstep::examples::make_mlp, {784}, batch, replicas))
      : (cuda ? gpu_contenders_for<ConvNet>([] { return ConvNet(); }, {1, 28, 28}, batch)
              : contenders_for<ConvNet>([] { return ConvNet(); }, {1, 28, 28}, batch, replicas));
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < contenders.size(); ++i) {
      auto& c = contenders[(i + r) % contenders.size()];
      // Only the ceiling changes the timing thread's count, and puts it back:
      // every other contender runs with what the process has, as a program would.
      if (c.threads > 0) {
        at::set_num_threads(c.threads);
      }
      if (c.before) {
        c.before();
      }
      c.seen_threads = at::get_num_threads();
      c.rates.push_back(time_steps(c.step, batch, seconds, cuda)); // ceiling: batch/R rows x R replicas
      if (c.threads > 0) {
        at::set_num_threads(cores);
      }
    }
  }
  const double base = median(contenders[0].rates);
  for (const auto& c : contenders) {
    const double m = median(c.rates);
    std::printf("%-5s batch %-4lld %-14s %10.1f samples/s   ratio %.3f   (rounds:", model.c_str(),
                static_cast<long long>(batch), c.name.c_str(), m, m / base);
    for (double v : c.rates) {
      std::printf(" %.0f", v);
    }
    std::printf(")   threads %d\n", c.seen_threads);
  }
}

} // namespace

int main(int argc, char** argv) {
  int rounds = 5;
  double seconds = 2.0;
  int replicas = 2;
  std::string only;
  std::string device = "cpu";
  CLI::App app{"lockstep-bench-dp: training-step throughput of the bare module against lockstep::DataParallel, "
               "side by side in one run (median samples/s and ratio of medians)."};
  app.add_option("--rounds", rounds, "Rounds; each times every contender once")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seconds", seconds, "Seconds per contender and round")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--replicas", replicas, "DataParallel's CPU replicas")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--model", only, "Only this model (default: both)")->check(CLI::IsMember({"mlp", "cnn"}));
  app.add_option("--device", device, "cpu: CPU replicas; cuda: every visible GPU, and DDP over NCCL")
      ->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {
      return app.exit(e); // --help
    }
    std::fprintf(stderr, "lockstep-bench-dp: %s\nusage: %s [--rounds N] [--seconds S] [--replicas R] [--model mlp|cnn] "
                 "[--device cpu|cuda]\n", e.what(), argv[0]);
    return 2;
  }
  try {
    lockstep::examples::require_fast_blas("lockstep-bench-dp");
    // "All cores" explicitly: libtorch's own default can be lower (it asks
    // cpuinfo for physical cores, which fails on some virtual machines).
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    torch::manual_seed(0);
    const bool cuda = device == "cuda";
    if (cuda) {
      TORCH_CHECK(torch::cuda::is_available(), "lockstep-bench-dp --device cuda: this process sees no CUDA device.");
      std::printf("%d CUDA device(s); DataParallel uses all of them\n", static_cast<int>(torch::cuda::device_count()));
    } else {
      std::printf("threads %d, BLAS %s, %d CPU replicas\n", at::get_num_threads(), lockstep::examples::loaded_blas().c_str(), replicas);
    }
    if (only.empty() || only == "mlp") {
      run_model("mlp", 256, rounds, seconds, replicas, cuda);
    }
    if (only.empty() || only == "cnn") {
      run_model("cnn", 128, rounds, seconds, replicas, cuda);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
