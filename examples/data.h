#pragma once

// lockstep-train's data: the training and test splits of MNIST-format IDX
// files (examples/idx.h), by default Debian's Fashion-MNIST, or a generated
// dataset of the same shape, which can also be written out as IDX files.

#include "idx.h"

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace lockstep {
namespace examples {

/// Where Debian's dataset-fashion-mnist puts its IDX files: the default data.
constexpr char kFashionMnist[] = "/usr/share/datasets/fashion-mnist";

/// Images and their labels, row by row.
struct Samples {
  torch::Tensor inputs; // [N, 1, 28, 28] float images, or [N, T] int64 tokens
  torch::Tensor labels; // [N] int64 classes, or [N, T] int64 next tokens
};

/// The two splits, and where they came from for the start line ("synthetic",
/// "MNIST-format data at DIR").
struct Dataset {
  Samples train;
  Samples test;
  std::string source;
};

/// What --data, --synthetic, --train-samples and --test-samples ask for.
struct DataOptions {
  std::string dir;          // MNIST-format IDX files; "": kFashionMnist
  bool synthetic = false;   // generated data instead
  int64_t train_size = 12000;
  int64_t test_size = 2000;
  bool first_train = false; // --train-samples given: files are cut to their first train_size rows
  bool first_test = false;  // --test-samples given: likewise
  std::string text;         // --model gpt: the text file; "": Debian's fortunes (text_data.h)
  int64_t context = 128;    // --model gpt: tokens per sequence
};

/// Ten classes, each a random smooth 28x28 prototype; a sample is its class's
/// prototype shifted by up to 3 pixels, scaled, and buried in noise. Learnable
/// by a small CNN in one epoch, far from trivial for a linear model, and the
/// same for a given seed on every run. Returns the training and test splits.
inline std::pair<Samples, Samples> synthetic(int64_t train_size, int64_t test_size, uint64_t seed) {
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
    s.inputs = images * scale + torch::randn({n, 1, 28, 28}) * 1.8;
    return s;
  };
  Samples train = make(train_size);
  Samples test = make(test_size);
  return {train, test};
}

/// The split `prefix` ("train" or "t10k") of the IDX files in `dir`.
inline Samples read_mnist_samples(const std::string& dir, const std::string& prefix) {
  auto [images, labels] = read_mnist_split(dir, prefix);
  return Samples{images, labels};
}

/// The first `n` rows of `all`, which `flag` asked for: more than the files
/// hold is an error, not a quietly smaller run.
inline Samples first_rows(const Samples& all, int64_t n, const char* flag, const char* split, const std::string& dir) {
  const int64_t rows = all.inputs.size(0);
  TORCH_CHECK(n <= rows, "lockstep-train: ", flag, " ", n, " is more than the ", rows, " ", split, " samples in ", dir,
              "; give at most ", rows, ", or leave ", flag, " out to use them all.");
  return Samples{all.inputs.narrow(0, 0, n), all.labels.narrow(0, 0, n)};
}

/// The dataset `options` ask for; `seed` is the generated data's. Without
/// --data or --synthetic, Debian's Fashion-MNIST must be installed.
inline Dataset load_dataset(const DataOptions& options, uint64_t seed) {
  TORCH_CHECK(!(options.synthetic && !options.dir.empty()), "lockstep-train: --synthetic and --data ", options.dir,
              " exclude each other; pick one.");
  Dataset data;
  if (options.synthetic) {
    std::tie(data.train, data.test) = synthetic(options.train_size, options.test_size, seed);
    data.source = "synthetic";
    return data;
  }
  std::string dir = options.dir;
  if (dir.empty()) {
    TORCH_CHECK(::access(kFashionMnist, R_OK) == 0, "lockstep-train: no --data given, and Debian's Fashion-MNIST is "
                "not in ", kFashionMnist, "; install it (apt install dataset-fashion-mnist, as scripts/setup.sh does), "
                "give --data DIR, or --synthetic.");
    dir = kFashionMnist;
  }
  data.train = read_mnist_samples(dir, "train");
  data.test = read_mnist_samples(dir, "t10k");
  data.source = "MNIST-format data at " + dir;
  if (options.first_train) {
    data.train = first_rows(data.train, options.train_size, "--train-samples", "training", dir);
  }
  if (options.first_test) {
    data.test = first_rows(data.test, options.test_size, "--test-samples", "test", dir);
  }
  return data;
}

/// Writes `data` as MNIST's IDX files `dir`/`prefix`-images-idx3-ubyte and
/// -labels-idx1-ubyte (big-endian header; pixels clamped to 3 standard
/// deviations and mapped to bytes 0-255).
inline void write_idx(const Samples& data, const std::string& dir, const std::string& prefix) {
  auto put32 = [](std::ofstream& out, uint32_t v) {
    const unsigned char b[4] = {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16),
                                static_cast<unsigned char>(v >> 8), static_cast<unsigned char>(v)};
    out.write(reinterpret_cast<const char*>(b), 4);
  };
  const auto n = static_cast<uint32_t>(data.inputs.size(0));
  auto pixels = ((data.inputs.clamp(-3, 3) + 3) * (255.0 / 6)).round().to(torch::kUInt8).contiguous();
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
  images.close();
  label_file.close();
  TORCH_CHECK(images && label_file, "lockstep-train: could not write the IDX files in ", dir, " (", std::strerror(errno),
              "). Export into a folder that exists and can be written, with room for 55 MB.");
}

/// Writes the synthetic dataset of `seed` as IDX files in `dir`, at MNIST's
/// own counts (60000 training and 10000 test samples).
inline void export_synthetic(const std::string& dir, uint64_t seed) {
  for (const char* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                           "t10k-labels-idx1-ubyte"}) {
    const std::string gz = dir + "/" + name + ".gz";
    TORCH_CHECK(::access(gz.c_str(), F_OK) != 0, "lockstep-train: --export-mnist: ", gz, " exists, and the export "
                "would write ", name, " beside it: two files for one dataset. Export into another folder.");
  }
  auto [train, test] = synthetic(60000, 10000, seed);
  write_idx(train, dir, "train");
  write_idx(test, dir, "t10k");
}

} // namespace examples
} // namespace lockstep
