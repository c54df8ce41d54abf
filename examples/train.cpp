// lockstep-train: trains a small convolutional classifier with
// lockstep::DataParallel on CPU replicas (or GPUs when there are some), or,
// under lockstep-run, with DistributedDataParallel, one process per rank.
//
//   lockstep-train                     # synthetic data, deterministic by --seed
//   lockstep-train --data DIR          # MNIST-format IDX files (MNIST, Fashion-MNIST, KMNIST), gzipped or not
//   lockstep-run --nproc-per-node 2 lockstep-train --checkpoint run.ckpt
//   lockstep-train --help

#include "checkpoint.h"
#include "idx.h"
#include "models.h"

#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

struct Samples {
  torch::Tensor images; // [N, 1, 28, 28], float
  torch::Tensor labels; // [N], int64
};

// Ten classes, each a random smooth 28x28 prototype; a sample is its class's
// prototype shifted by up to 3 pixels, scaled, and buried in noise. Learnable
// by a small CNN in one epoch, far from trivial for a linear model, and the
// same for a given seed on every run.
std::pair<Samples, Samples> synthetic(int64_t train_size, int64_t test_size, uint64_t seed) {
  torch::manual_seed(seed);
  auto prototypes = torch::nn::functional::interpolate(
      torch::randn({10, 1, 7, 7}),
      torch::nn::functional::InterpolateFuncOptions().size(std::vector<int64_t>{28, 28}).mode(torch::kBilinear).align_corners(false));
  prototypes = (prototypes - prototypes.mean()) / prototypes.std();
  auto make = [&](int64_t n) {
    Samples s;
    s.labels = torch::randint(0, 10, {n}, torch::kLong);
    auto images = prototypes.index_select(0, s.labels).clone();
    auto shifts = torch::randint(-3, 4, {n, 2}, torch::kLong);
    auto accessor = shifts.accessor<int64_t, 2>();
    for (int64_t i = 0; i < n; ++i) {
      images[i] = torch::roll(images[i], {accessor[i][0], accessor[i][1]}, {1, 2});
    }
    auto scale = torch::rand({n, 1, 1, 1}) * 0.8 + 0.6;
    s.images = images * scale + torch::randn({n, 1, 28, 28}) * 1.8;
    return s;
  };
  Samples train = make(train_size);
  Samples test = make(test_size);
  return {train, test};
}

Samples load_mnist(const std::string& dir, const std::string& prefix) {
  auto [images, labels] = lockstep::examples::read_mnist_split(dir, prefix);
  return Samples{images, labels};
}

// Writes `data` as MNIST's IDX files (big-endian header, bytes 0-255).
void write_idx(const Samples& data, const std::string& dir, const std::string& prefix) {
  auto put32 = [](std::ofstream& out, uint32_t v) {
    const unsigned char b[4] = {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16),
                                static_cast<unsigned char>(v >> 8), static_cast<unsigned char>(v)};
    out.write(reinterpret_cast<const char*>(b), 4);
  };
  const auto n = static_cast<uint32_t>(data.images.size(0));
  auto pixels = ((data.images.clamp(-3, 3) + 3) * (255.0 / 6)).round().to(torch::kUInt8).contiguous();
  std::ofstream images(dir + "/" + prefix + "-images-idx3-ubyte", std::ios::binary);
  put32(images, 0x803);
  put32(images, n);
  put32(images, 28);
  put32(images, 28);
  images.write(reinterpret_cast<const char*>(pixels.data_ptr<uint8_t>()), pixels.numel());
  auto labels = data.labels.to(torch::kUInt8).contiguous();
  std::ofstream label_file(dir + "/" + prefix + "-labels-idx1-ubyte", std::ios::binary);
  put32(label_file, 0x801);
  put32(label_file, n);
  label_file.write(reinterpret_cast<const char*>(labels.data_ptr<uint8_t>()), labels.numel());
  TORCH_CHECK(images && label_file, "lockstep-train: could not write the IDX files in ", dir);
}

std::string clock_time(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) {
    return "--:--";
  }
  const auto s = static_cast<long>(seconds + 0.5);
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%ld:%02ld", s / 60, s % 60);
  return buffer;
}

// One line, redrawn in place on a terminal; every 10% as plain lines otherwise.
// Rows are every rank's; a resumed epoch starts at `resumed` rows, which
// count towards the bar but not towards the speed.
class Progress {
 public:
  Progress(int64_t total, int64_t resumed, int epoch, int epochs, bool enabled)
      : total_(total), resumed_(resumed), epoch_(epoch), epochs_(epochs), start_(Clock::now()), enabled_(enabled) {
    tty_ = isatty(fileno(stderr)) != 0;
  }
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
    std::fprintf(stderr, "%sepoch %d/%d [%s] %3d%% loss %.4f acc %5.1f%% %7.0f samples/s ETA %s%s",
                 tty_ ? "\r" : "", epoch_, epochs_, bar.c_str(), percent, loss, 100 * accuracy, rate,
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
  int next_percent_ = 0;
};

template <typename Model>
double accuracy_on(Model& model, const Samples& data, int64_t batch_size) {
  torch::NoGradGuard no_grad;
  model->eval();
  int64_t correct = 0;
  for (int64_t i = 0; i < data.images.size(0); i += batch_size) {
    const int64_t n = std::min(batch_size, data.images.size(0) - i);
    auto logits = model(data.images.narrow(0, i, n));
    correct += logits.argmax(1).eq(data.labels.narrow(0, i, n)).sum().template item<int64_t>();
  }
  model->train();
  return static_cast<double>(correct) / data.images.size(0);
}

struct Config {
  int epochs;
  int64_t batch_size;
  std::string checkpoint_path;
  int64_t checkpoint_every;
  std::string save_path;
};

// Equal hashes mean bitwise-equal models (the restart tests compare them).
uint64_t parameter_hash(torch::nn::Module& module) {
  return lockstep::examples::content_hash(lockstep::examples::model_tensors(module));
}

lockstep::examples::TrainingState resume(
    const Config& config,
    lockstep::examples::ConvNet& net,
    torch::optim::Optimizer& optimizer,
    int world_size,
    bool report) {
  lockstep::examples::TrainingState state;
  state.world_size = world_size;
  if (config.checkpoint_path.empty() || !lockstep::examples::load_checkpoint(config.checkpoint_path, *net, optimizer, state)) {
    return state;
  }
  if (report) {
    std::fprintf(stderr, "lockstep-train: resumed from %s at step %lld (epoch %lld, batch %lld)%s\n",
                 config.checkpoint_path.c_str(), static_cast<long long>(state.step), static_cast<long long>(state.epoch + 1),
                 static_cast<long long>(state.batch_in_epoch),
                 state.world_size != world_size ? "; written with another world size, so the data order differs from here on" : "");
  }
  state.world_size = world_size;
  return state;
}

// Every rank must resume from the same state, or the ranks would train on
// different data positions (DDP broadcasts rank 0's parameters, which hides a
// different model but not a different position). Each rank shares what it
// resumed from; all fail together, naming the ranks, if they differ.
void check_ranks_resumed_alike(
    const lockstep::ProcessGroup& group,
    const Config& config,
    const lockstep::examples::TrainingState& state,
    bool resumed,
    torch::nn::Module& net,
    torch::optim::Optimizer& optimizer) {
  using namespace lockstep::examples;
  auto mine = torch::cat({torch::tensor({static_cast<int64_t>(resumed), state.step, state.epoch, state.batch_in_epoch}),
                          hash_tensor(content_hash(model_tensors(net))).reshape({1}),
                          hash_tensor(optimizer_hash(optimizer)).reshape({1})});
  auto all = group.all_gather(mine);
  auto describe = [&](int r) {
    auto v = all[r].accessor<int64_t, 1>();
    return v[0] == 0 ? std::string("started from scratch (no checkpoint found)")
                     : "resumed at step " + std::to_string(v[1]) + " (epoch " + std::to_string(v[2] + 1) + ", batch " +
                         std::to_string(v[3]) + ")";
  };
  for (int r = 1; r < group.size(); ++r) {
    const bool same_position = torch::equal(all[r].narrow(0, 0, 4), all[0].narrow(0, 0, 4));
    const bool same_state = all[0][0].item<int64_t>() == 0 || torch::equal(all[r], all[0]);
    TORCH_CHECK(same_position && same_state, "lockstep-train: rank ", r, " ", describe(r),
                same_position ? " with a different model or optimizer state" : "", " but rank 0 ", describe(0),
                ". Every rank must read the same checkpoint: on several machines, put --checkpoint on storage every "
                "node shares, or copy rank 0's file to each node (this rank's --checkpoint is ", config.checkpoint_path,
                ").");
  }
}

// LOCKSTEP_FAULT=RANK:STEP[:CODE]: see --help.
void maybe_inject_fault(int rank, int64_t step) {
  static const char* spec = std::getenv("LOCKSTEP_FAULT");
  if (spec == nullptr) {
    return;
  }
  // The first attempt only, under lockstep-run or torchrun.
  for (const char* name : {"LOCKSTEP_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}) {
    const char* restarts = std::getenv(name);
    if (restarts != nullptr && std::atoi(restarts) != 0) {
      return;
    }
  }
  int fault_rank = -1;
  long long fault_step = -1;
  char code[16] = "3";
  const int fields = std::sscanf(spec, "%d:%lld:%15s", &fault_rank, &fault_step, code);
  TORCH_CHECK(fields >= 2, "lockstep-train: LOCKSTEP_FAULT=\"", spec, "\" is malformed; expected RANK:STEP[:CODE], e.g. 1:30 or 1:30:kill.");
  if (fault_rank != rank || fault_step != step) {
    return;
  }
  std::fprintf(stderr, "lockstep-train: LOCKSTEP_FAULT: rank %d stops at step %lld (%s)\n", rank, fault_step,
               std::strcmp(code, "kill") == 0 ? "SIGKILL" : code);
  std::fflush(stderr);
  if (std::strcmp(code, "kill") == 0) {
    std::raise(SIGKILL);
  }
  if (std::strcmp(code, "hang") == 0) {
    // A stalled rank: deaf to SIGTERM, only SIGKILL ends it.
    std::signal(SIGTERM, SIG_IGN);
    while (true) {
      ::pause();
    }
  }
  std::_Exit(std::atoi(code));
}

// Sums the ranks' tallies (a tiny allreduce under DDP; as is with one process).
using Combine = std::function<lockstep::examples::Tally(const lockstep::examples::Tally&)>;

template <typename Model, typename Batches>
int train_and_report(
    Model& model,
    lockstep::examples::ConvNet& net,
    torch::optim::SGD& optimizer,
    const Samples& train,
    const Samples& test,
    Batches& batches,
    const Combine& combine,
    const Config& config,
    lockstep::examples::TrainingState state,
    int rank,
    int world_size,
    const std::string& setup) {
  using lockstep::examples::Tally;
  const bool lead = rank == 0;
  if (state.epoch >= config.epochs) {
    if (lead) {
      std::printf("lockstep-train: nothing to train: the checkpoint %s is of a finished run (%lld of %d epoch(s), %lld "
                  "steps); raise --epochs to train on, or point --checkpoint elsewhere to start afresh.\n",
                  config.checkpoint_path.c_str(), static_cast<long long>(state.epoch), config.epochs,
                  static_cast<long long>(state.step));
      std::printf("lockstep-train: test accuracy %.1f%% of the checkpoint's model\n",
                  100 * accuracy_on(net, test, 512));
      std::printf("lockstep-train: final parameters fnv1a64=%016llx\n",
                  static_cast<unsigned long long>(parameter_hash(*net)));
    }
    return 0;
  }
  const auto start = Clock::now();
  int64_t samples = 0; // trained in this process's run, over every rank
  Tally last_epoch;
  auto checkpoint = [&] {
    if (lead && !config.checkpoint_path.empty()) {
      lockstep::examples::save_checkpoint(config.checkpoint_path, *net, optimizer, state);
    }
  };
  for (; state.epoch < config.epochs; ++state.epoch, state.batch_in_epoch = 0, state.epoch_tally = Tally{}) {
    const auto epoch_batches = batches(state.epoch);
    const auto batch_count = static_cast<int64_t>(epoch_batches.size());
    Tally rows_of_epoch;
    for (const auto& b : epoch_batches) {
      rows_of_epoch.rows += b.size(0);
    }
    // Every rank folds its batches into the epoch's tally at the same steps:
    // about 50 times an epoch, at checkpoints, and at the epoch's end.
    const int64_t report_every = std::max<int64_t>(1, batch_count / 50);
    Tally& done = state.epoch_tally; // every rank's rows up to the last fold (restored when resumed)
    Tally pending;                   // this rank's rows since
    const int64_t resumed_rows = done.rows;
    Progress progress(combine(rows_of_epoch).rows, resumed_rows, static_cast<int>(state.epoch + 1), config.epochs, lead);
    auto fold = [&] {
      done += combine(pending);
      pending = Tally{};
      progress.update(done.rows, done.loss_sum / std::max<int64_t>(1, done.rows),
                      static_cast<double>(done.correct) / std::max<int64_t>(1, done.rows));
    };
    for (; state.batch_in_epoch < batch_count; ++state.batch_in_epoch) {
      maybe_inject_fault(rank, state.step);
      const auto& index = epoch_batches[state.batch_in_epoch];
      auto x = train.images.index_select(0, index);
      auto y = train.labels.index_select(0, index);
      optimizer.zero_grad();
      auto logits = model(x);
      auto loss = torch::cross_entropy_loss(logits, y);
      loss.backward();
      optimizer.step();
      ++state.step;
      const int64_t b = index.size(0);
      pending += Tally{loss.template item<double>() * b, logits.argmax(1).eq(y).sum().template item<int64_t>(), b};
      const bool save = state.step % config.checkpoint_every == 0;
      if (save || (state.batch_in_epoch + 1) % report_every == 0 || state.batch_in_epoch + 1 == batch_count) {
        fold();
      }
      if (save) {
        ++state.batch_in_epoch; // the checkpoint says where to go on
        checkpoint();
        --state.batch_in_epoch;
      }
    }
    TORCH_CHECK(done.rows > 0, "lockstep-train: epoch ", state.epoch + 1, " has no training batch (", train.images.size(0),
                " training samples); give more samples.");
    samples += done.rows - resumed_rows;
    last_epoch = done;
  }
  checkpoint();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!lead) {
    return 0;
  }
  // The bare module: no collective, so rank 0 can evaluate alone.
  const double test_accuracy = accuracy_on(net, test, 512);
  if (!config.save_path.empty()) {
    torch::save(net, config.save_path);
  }
  std::printf(
      "lockstep-train: %d epoch(s), %lld steps in %.1f s, %.0f samples/s over all %d rank(s) (%.0f per rank) with %s; "
      "last epoch's loss %.4f, train accuracy %.1f%%; test accuracy %.1f%%\n",
      config.epochs, static_cast<long long>(state.step), seconds, samples / std::max(seconds, 1e-9), world_size,
      samples / std::max(seconds, 1e-9) / world_size, setup.c_str(), last_epoch.loss_sum / last_epoch.rows,
      100.0 * last_epoch.correct / last_epoch.rows, 100 * test_accuracy);
  std::printf("lockstep-train: final parameters fnv1a64=%016llx\n", static_cast<unsigned long long>(parameter_hash(*net)));
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-train: trains a small CNN classifier with lockstep::DataParallel on CPU replicas, or with "
               "DistributedDataParallel under lockstep-run"};
  std::string data_dir;
  int epochs = 1;
  int64_t batch_size = 128;
  double lr = 0.02;
  double momentum = 0.9;
  int replicas = 2;
  uint64_t seed = 1;
  int64_t train_size = 12000;
  int64_t test_size = 2000;
  std::string save_path;
  std::string export_dir;
  std::string checkpoint_path;
  int64_t checkpoint_every = 50;
  app.add_option("--data", data_dir, "Directory with MNIST-format IDX files (train-images-idx3-ubyte, ..., gzipped or not: MNIST, Fashion-MNIST, KMNIST), any number of rows. Default: a synthetic dataset")
      ->check(CLI::ExistingDirectory);
  app.add_option("--epochs", epochs, "Passes over the training set")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", batch_size, "Global batch size, split between replicas")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", lr, "SGD learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--momentum", momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app.add_option("--replicas", replicas, "CPU replicas (0: lockstep::default_devices(): every GPU, or one CPU replica without one)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--seed", seed, "Seed of the synthetic data, the model and the shuffling")->capture_default_str();
  auto* train_option = app.add_option("--train-samples", train_size, "Training samples: synthetic ones to make, or the first N of --data")
      ->check(CLI::PositiveNumber)->capture_default_str();
  auto* test_option = app.add_option("--test-samples", test_size, "Test samples: synthetic ones to make, or the first N of --data")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--export-mnist", export_dir,
                 "Write the synthetic dataset as MNIST IDX files into this existing directory (60000/10000 samples, "
                 "MNIST's own counts) and exit")
      ->check(CLI::ExistingDirectory);
  app.add_option("--save", save_path, "Save the trained model here (torch::save; loads into a bare model)");
  app.add_option("--checkpoint", checkpoint_path,
                 "Checkpoint file: resumed from when it exists, written (by rank 0, atomically) every --checkpoint-every "
                 "steps and at the end");
  app.add_option("--checkpoint-every", checkpoint_every, "Optimizer steps between checkpoints")
      ->check(CLI::PositiveNumber)->capture_default_str();
  int timeout_seconds = 0;
  app.add_option("--timeout", timeout_seconds,
                 "Under DDP: seconds to wait for the other ranks (store, connections, each collective) before failing. "
                 "Default: LOCKSTEP_TIMEOUT, else 300")
      ->check(CLI::Range(1, 7 * 24 * 3600));
  app.footer(
      "Under lockstep-run (or torchrun: WORLD_SIZE set), each process is one rank of DistributedDataParallel and reads "
      "its share of each batch through LibTorch's DistributedRandomSampler; otherwise one process trains with "
      "DataParallel on --replicas CPU replicas.\n"
      "Fault injection, for tests and demos: LOCKSTEP_FAULT=RANK:STEP[:CODE] makes rank RANK exit with CODE (default "
      "3; 'kill' for SIGKILL; 'hang' to stall, ignoring SIGTERM) when it reaches optimizer step STEP, on the first attempt only (LOCKSTEP_RESTART_COUNT and "
      "TORCHELASTIC_RESTART_COUNT 0 or unset).");
  CLI11_PARSE(app, argc, argv);

  try {
    lockstep::require_fast_blas("lockstep-train");
    // Keep freed memory in the heap instead of returning every large tensor
    // to the kernel: fresh pages fault and are zeroed on each step otherwise,
    // which cost 25% of a CNN step on CPU here (docs/performance.md).
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    // OMP_NUM_THREADS when set (lockstep-run gives each rank its share);
    // otherwise every core: libtorch's own default can be lower (it asks
    // cpuinfo for physical cores, which fails on some virtual machines).
    const char* omp = std::getenv("OMP_NUM_THREADS");
    at::set_num_threads(omp != nullptr && std::atoi(omp) > 0 ? std::atoi(omp)
                                                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));

    // Checked now, not at the first write: a missing folder would cost the run.
    for (const auto& [flag, path] : {std::make_pair("--save", save_path), std::make_pair("--checkpoint", checkpoint_path)}) {
      if (path.empty()) {
        continue;
      }
      const auto slash = path.find_last_of('/');
      const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
      TORCH_CHECK(::access(dir.c_str(), W_OK) == 0, "lockstep-train: ", flag, " ", path, ": cannot write into ", dir,
                  " (", std::strerror(errno), "); create the folder first, or pick another path.");
    }

    if (!checkpoint_path.empty()) {
      lockstep::examples::remove_stale_temporaries(checkpoint_path);
    }

    Samples train, test;
    std::string source;
    if (!export_dir.empty()) {
      std::tie(train, test) = synthetic(60000, 10000, seed);
      write_idx(train, export_dir, "train");
      write_idx(test, export_dir, "t10k");
      std::printf("lockstep-train: wrote the synthetic dataset (seed %llu) as MNIST IDX files in %s\n",
                  static_cast<unsigned long long>(seed), export_dir.c_str());
      return 0;
    }
    if (data_dir.empty()) {
      std::tie(train, test) = synthetic(train_size, test_size, seed);
      source = "synthetic";
    } else {
      train = load_mnist(data_dir, "train");
      test = load_mnist(data_dir, "t10k");
      source = "MNIST at " + data_dir;
      // Given explicitly, the sample counts take the first N of each split.
      auto first = [](const Samples& all, int64_t n) {
        n = std::min(n, all.images.size(0));
        return Samples{all.images.narrow(0, 0, n), all.labels.narrow(0, 0, n)};
      };
      if (train_option->count() > 0) {
        train = first(train, train_size);
      }
      if (test_option->count() > 0) {
        test = first(test, test_size);
      }
    }

    torch::manual_seed(seed);
    lockstep::examples::ConvNet net;
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));
    Config config{epochs, batch_size, checkpoint_path, checkpoint_every, save_path};
    // Under lockstep-run (or torchrun), one process per rank with
    // DistributedDataParallel; otherwise one process with DataParallel.
    if (std::getenv("WORLD_SIZE") != nullptr) {
      auto group = lockstep::init_process_group(
          lockstep::ProcessGroupOptions().timeout(std::chrono::seconds(timeout_seconds))); // 0: LOCKSTEP_TIMEOUT
      TORCH_CHECK(batch_size % group.size() == 0, "lockstep-train: --batch-size ", batch_size, " does not split evenly over ",
                  group.size(), " ranks; pick a multiple of ", group.size(), " (each rank takes batch-size / ranks rows).");
      auto state = resume(config, net, optimizer, group.size(), group.rank() == 0);
      check_ranks_resumed_alike(group, config, state, state.step > 0 || state.epoch > 0, *net, optimizer);
      lockstep::DistributedDataParallel<lockstep::examples::ConvNet> model(net, group);
      torch::data::samplers::DistributedRandomSampler sampler(
          static_cast<size_t>(train.images.size(0)), static_cast<size_t>(group.size()), static_cast<size_t>(group.rank()),
          /*allow_duplicates=*/false);
      const int64_t per_rank = batch_size / group.size();
      auto batches = [&sampler, per_rank](int64_t epoch) {
        sampler.set_epoch(static_cast<size_t>(epoch));
        sampler.reset();
        std::vector<torch::Tensor> out;
        while (auto indices = sampler.next(static_cast<size_t>(per_rank))) {
          std::vector<int64_t> as_int(indices->begin(), indices->end());
          out.push_back(torch::tensor(as_int, torch::kLong));
        }
        return out;
      };
      if (group.rank() == 0) {
        std::fprintf(stderr, "lockstep-train: %s data, %lld train / %lld test samples, DistributedDataParallel over %d "
                     "ranks (%s), batch %lld (%lld per rank)\n", source.c_str(), static_cast<long long>(train.images.size(0)),
                     static_cast<long long>(test.images.size(0)), group.size(), group.backend().c_str(),
                     static_cast<long long>(batch_size), static_cast<long long>(per_rank));
      }
      // Loss and accuracy sums as doubles: exact for any count below 2^53.
      auto combine = [&group](const lockstep::examples::Tally& mine) {
        auto sums = torch::tensor({mine.loss_sum, static_cast<double>(mine.correct), static_cast<double>(mine.rows)},
                                  torch::kFloat64);
        group.allreduce(sums);
        auto s = sums.accessor<double, 1>();
        return lockstep::examples::Tally{s[0], static_cast<int64_t>(s[1]), static_cast<int64_t>(s[2])};
      };
      return train_and_report(model, net, optimizer, train, test, batches, combine, config, state, group.rank(), group.size(),
                              "DistributedDataParallel over " + std::to_string(group.size()) + " ranks");
    }
    auto state = resume(config, net, optimizer, 1, true);
    auto options = lockstep::DataParallelOptions();
    if (replicas > 0) {
      options.devices(std::vector<torch::Device>(replicas, torch::Device(torch::kCPU)));
    }
    lockstep::DataParallel<lockstep::examples::ConvNet> model(net, options);
    const int64_t n = train.images.size(0);
    auto batches = [n, batch_size, seed](int64_t epoch) {
      // One shuffle per epoch from (seed, epoch): a resumed run sees the same order.
      auto order = torch::randperm(n, at::detail::createCPUGenerator(seed * 1000003 + epoch), torch::kLong);
      std::vector<torch::Tensor> out;
      for (int64_t i = 0; i < n; i += batch_size) {
        out.push_back(order.narrow(0, i, std::min(batch_size, n - i)));
      }
      return out;
    };
    std::string devices;
    for (const auto& d : model->devices()) {
      devices += (devices.empty() ? "" : ",") + d.str();
    }
    std::fprintf(stderr, "lockstep-train: %s data, %lld train / %lld test samples, DataParallel on [%s], batch %lld\n",
                 source.c_str(), static_cast<long long>(n), static_cast<long long>(test.images.size(0)), devices.c_str(),
                 static_cast<long long>(batch_size));
    auto alone = [](const lockstep::examples::Tally& mine) { return mine; };
    return train_and_report(model, net, optimizer, train, test, batches, alone, config, state, 0, 1,
                            "DataParallel on " + std::to_string(model->devices().size()) + " replica(s)");
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace()); // already says who raised it
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-train: %s\n", e.what());
    return 1;
  }
  return 0;
}
