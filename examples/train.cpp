// lockstep-train: trains a small convolutional classifier with
// lockstep::DataParallel on CPU replicas (or GPUs when there are some).
//
//   lockstep-train                     # synthetic data, deterministic by --seed
//   lockstep-train --data DIR          # MNIST IDX files, as torch::data::datasets::MNIST reads them
//   lockstep-train --help

#include "models.h"

#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

struct Split {
  torch::Tensor images; // [N, 1, 28, 28], float
  torch::Tensor labels; // [N], int64
};

// Ten classes, each a random smooth 28x28 prototype; a sample is its class's
// prototype shifted by up to 3 pixels, scaled, and buried in noise. Learnable
// by a small CNN in one epoch, far from trivial for a linear model, and the
// same for a given seed on every run.
std::pair<Split, Split> synthetic(int64_t train_size, int64_t test_size, uint64_t seed) {
  torch::manual_seed(seed);
  auto prototypes = torch::nn::functional::interpolate(
      torch::randn({10, 1, 7, 7}),
      torch::nn::functional::InterpolateFuncOptions().size(std::vector<int64_t>{28, 28}).mode(torch::kBilinear).align_corners(false));
  prototypes = (prototypes - prototypes.mean()) / prototypes.std();
  auto make = [&](int64_t n) {
    Split s;
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
  Split train = make(train_size);
  Split test = make(test_size);
  return {train, test};
}

Split load_mnist(const std::string& dir, torch::data::datasets::MNIST::Mode mode) {
  torch::data::datasets::MNIST mnist(dir, mode);
  // MNIST's mean and standard deviation, as in PyTorch's examples.
  return Split{(mnist.images() - 0.1307) / 0.3081, mnist.targets().to(torch::kLong)};
}

// Writes `data` as MNIST's IDX files (big-endian header, bytes 0-255).
void write_idx(const Split& data, const std::string& dir, const std::string& prefix) {
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
class Progress {
 public:
  Progress(int64_t total, int epoch, int epochs) : total_(total), epoch_(epoch), epochs_(epochs), start_(Clock::now()) {
    tty_ = isatty(fileno(stderr)) != 0;
  }
  void update(int64_t done, double loss, double accuracy) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    const double rate = elapsed > 0 ? done / elapsed : 0;
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
  int64_t total_;
  int epoch_, epochs_;
  Clock::time_point start_;
  bool tty_;
  int next_percent_ = 0;
};

template <typename Model>
double accuracy_on(Model& model, const Split& data, int64_t batch_size) {
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

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-train: trains a small CNN classifier with lockstep::DataParallel on CPU replicas"};
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
  app.add_option("--data", data_dir, "Directory with MNIST's IDX files (train-images-idx3-ubyte, ...). Default: a synthetic dataset")
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
                 "the counts LibTorch's MNIST reader expects) and exit")
      ->check(CLI::ExistingDirectory);
  app.add_option("--save", save_path, "Save the trained model here (torch::save; loads into a bare model)");
  CLI11_PARSE(app, argc, argv);

  try {
    lockstep::require_fast_blas("lockstep-train");
    // Keep freed memory in the heap instead of returning every large tensor
    // to the kernel: fresh pages fault and are zeroed on each step otherwise,
    // which cost 25% of a CNN step on CPU here (docs/performance.md).
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    // Every core: libtorch's own default can be lower (it asks cpuinfo for
    // physical cores, which fails on some virtual machines).
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));

    Split train, test;
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
      train = load_mnist(data_dir, torch::data::datasets::MNIST::Mode::kTrain);
      test = load_mnist(data_dir, torch::data::datasets::MNIST::Mode::kTest);
      source = "MNIST at " + data_dir;
      // Given explicitly, the sample counts take the first N of each split.
      if (train_option->count() > 0) {
        train = Split{train.images.narrow(0, 0, std::min(train_size, train.images.size(0))),
                      train.labels.narrow(0, 0, std::min(train_size, train.labels.size(0)))};
      }
      if (test_option->count() > 0) {
        test = Split{test.images.narrow(0, 0, std::min(test_size, test.images.size(0))),
                     test.labels.narrow(0, 0, std::min(test_size, test.labels.size(0)))};
      }
    }

    torch::manual_seed(seed);
    lockstep::examples::ConvNet net;
    auto options = lockstep::DataParallelOptions();
    if (replicas > 0) {
      options.devices(std::vector<torch::Device>(replicas, torch::Device(torch::kCPU)));
    }
    lockstep::DataParallel<lockstep::examples::ConvNet> model(net, options);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));

    std::string devices;
    for (const auto& d : model->devices()) {
      devices += (devices.empty() ? "" : ",") + d.str();
    }
    std::fprintf(stderr, "lockstep-train: %s data, %lld train / %lld test samples, devices [%s], batch %lld\n",
                 source.c_str(), static_cast<long long>(train.images.size(0)), static_cast<long long>(test.images.size(0)),
                 devices.c_str(), static_cast<long long>(batch_size));

    const int64_t n = train.images.size(0);
    const auto start = Clock::now();
    double last_loss = NAN, train_accuracy = NAN;
    auto generator = at::detail::createCPUGenerator(seed);
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      auto order = torch::randperm(n, generator, torch::kLong);
      Progress progress(n, epoch, epochs);
      double loss_sum = 0;
      int64_t correct = 0, seen = 0;
      for (int64_t i = 0; i < n; i += batch_size) {
        const int64_t b = std::min(batch_size, n - i);
        auto index = order.narrow(0, i, b);
        auto x = train.images.index_select(0, index);
        auto y = train.labels.index_select(0, index);
        optimizer.zero_grad();
        auto logits = model(x);
        auto loss = torch::cross_entropy_loss(logits, y);
        loss.backward();
        optimizer.step();
        loss_sum += loss.item<double>() * b;
        correct += logits.argmax(1).eq(y).sum().item<int64_t>();
        seen += b;
        progress.update(seen, loss_sum / seen, static_cast<double>(correct) / seen);
      }
      last_loss = loss_sum / seen;
      train_accuracy = static_cast<double>(correct) / seen;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const double test_accuracy = accuracy_on(model, test, 512);
    if (!save_path.empty()) {
      torch::save(model, save_path);
    }
    std::printf(
        "lockstep-train: %d epoch(s) in %.1f s, %.0f samples/s on %zu replica(s); loss %.4f, train accuracy %.1f%%, "
        "test accuracy %.1f%%\n",
        epochs, seconds, epochs * n / seconds, model->devices().size(), last_loss, 100 * train_accuracy,
        100 * test_accuracy);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace()); // already says who raised it
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-train: %s\n", e.what());
    return 1;
  }
  return 0;
}
