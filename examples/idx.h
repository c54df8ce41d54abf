#pragma once

// MNIST-format IDX files (MNIST, Fashion-MNIST, KMNIST), plain or gzipped,
// read through zlib, which reads plain files as they are. Unlike LibTorch's
// MNIST reader, every file is checked against its own header before its data
// is used: a truncated, padded or foreign file is an error naming the file,
// never uninitialised memory; and any number of rows is accepted, so subsets
// of a dataset work.

#include <torch/torch.h>

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include <sys/stat.h>

namespace lockstep {
namespace examples {

/// A data error: one line naming the file and what is wrong with it.
struct IdxError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// `dir/name`, or `dir/name.gz`: whichever exists. Both is an error: they
/// may hold different data (an --export-mnist into a folder of the real
/// files), and reading either without a word would train on the other's.
inline std::string idx_path(const std::string& dir, const std::string& name) {
  struct stat info {};
  const std::string plain = dir + "/" + name;
  const std::string gz = plain + ".gz";
  const bool has_plain = ::stat(plain.c_str(), &info) == 0;
  const bool has_gz = ::stat(gz.c_str(), &info) == 0;
  if (has_plain && has_gz) {
    throw IdxError(plain + " and " + gz + " both exist, and either could be the data meant; remove (or move) the one "
                   "that is not");
  }
  if (has_plain || has_gz) {
    return has_plain ? plain : gz;
  }
  throw IdxError(plain + "(.gz): no such file; --data needs a directory with MNIST's four IDX files, gzipped or not");
}

using GzFile = std::unique_ptr<gzFile_s, decltype(&::gzclose)>;

// Reads up to `bytes` from `file` (`path`) into `into`; fewer only at the end
// of the file. Returns how many it read.
inline int64_t read_gz(const GzFile& file, const std::string& path, void* into, int64_t bytes) {
  int64_t done = 0;
  while (done < bytes) {
    const auto chunk = static_cast<unsigned>(std::min<int64_t>(bytes - done, 1 << 30));
    const int got = ::gzread(file.get(), static_cast<char*>(into) + done, chunk);
    if (got < 0) {
      int code = 0;
      throw IdxError(path + ": unreadable (" + ::gzerror(file.get(), &code) + ")");
    }
    if (got == 0) {
      break;
    }
    done += got;
  }
  return done;
}

// The shape an IDX header of `dims` dimensions declares, checked: the magic,
// MNIST's 28x28 images, and a row count that could be real.
inline std::vector<int64_t> read_idx_shape(const GzFile& file, const std::string& path, int dims) {
  unsigned char header[4 + 4 * 3];
  const int64_t header_bytes = 4 + 4 * dims;
  if (read_gz(file, path, header, header_bytes) != header_bytes) {
    throw IdxError(path + ": truncated: shorter than an IDX header");
  }
  auto be32 = [&](int i) {
    const unsigned char* b = header + 4 * i;
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  };
  const uint32_t expected_magic = 0x800u + static_cast<uint32_t>(dims);
  if (be32(0) != expected_magic) {
    char found[16];
    std::snprintf(found, sizeof(found), "0x%08x", be32(0));
    throw IdxError(path + ": not an IDX file of " + std::to_string(dims) + " dimension(s) (magic " + found +
                   ", expected 0x" + (dims == 3 ? "00000803" : "00000801") + ")");
  }
  std::vector<int64_t> shape;
  for (int i = 1; i <= dims; ++i) {
    shape.push_back(be32(i));
  }
  if (dims == 3 && (shape[1] != 28 || shape[2] != 28)) {
    throw IdxError(path + ": images are " + std::to_string(shape[1]) + "x" + std::to_string(shape[2]) +
                   "; the model takes MNIST's 28x28");
  }
  constexpr int64_t kMaxRows = int64_t{1} << 24; // 16.7 million: a header claiming more is damaged
  if (shape[0] > kMaxRows) {
    throw IdxError(path + ": the header declares " + std::to_string(shape[0]) + " rows, too many to be real");
  }
  return shape;
}

// The `total` bytes of data after the header of `rows` rows, and nothing
// more. Read in chunks, and the tensor allocated only once the data is
// there: a damaged header can claim up to 13 GB of rows in a file of a few
// bytes.
inline std::vector<uint8_t> read_idx_data(const GzFile& file, const std::string& path, int64_t rows, int64_t total) {
  constexpr int64_t kChunk = int64_t{16} << 20;
  std::vector<uint8_t> bytes;
  int64_t got = 0;
  while (got < total) {
    const int64_t want = std::min(kChunk, total - got);
    bytes.resize(static_cast<size_t>(got + want));
    const int64_t chunk = read_gz(file, path, bytes.data() + got, want);
    got += chunk;
    if (chunk < want) {
      break;
    }
  }
  if (got != total) {
    throw IdxError(path + ": truncated: the header declares " + std::to_string(rows) + " rows (" +
                   std::to_string(total) + " bytes of data) but the file holds " + std::to_string(got) + " bytes");
  }
  char extra = 0;
  if (read_gz(file, path, &extra, 1) != 0) {
    throw IdxError(path + ": longer than its header declares (" + std::to_string(rows) +
                   " rows): damaged, or not an IDX file");
  }
  return bytes;
}

/// The IDX file at `path`: magic 0x0000080N (unsigned bytes, N dimensions),
/// big-endian sizes, then the bytes. `dims` is N: 3 for images (rows, 28,
/// 28), 1 for labels. Returns a uint8 tensor of the header's shape.
inline torch::Tensor read_idx(const std::string& path, int dims) {
  errno = 0;
  GzFile file(::gzopen(path.c_str(), "rb"), ::gzclose);
  if (!file) { // zlib leaves open()'s errno, or 0 where it failed for memory
    throw IdxError(path + ": cannot open it (" + (errno != 0 ? std::strerror(errno) : "out of memory") + ")");
  }
  const auto shape = read_idx_shape(file, path, dims);
  const int64_t row_bytes = dims == 3 ? 28 * 28 : 1;
  const auto bytes = read_idx_data(file, path, shape[0], shape[0] * row_bytes);
  auto data = torch::empty(shape, torch::kUInt8);
  std::copy(bytes.begin(), bytes.end(), data.data_ptr<uint8_t>());
  return data;
}

/// One split of an MNIST-format dataset: images as float (N, 1, 28, 28)
/// normalised with MNIST's mean and standard deviation, labels as int64.
/// `prefix` is "train" or "t10k".
inline std::pair<torch::Tensor, torch::Tensor> read_mnist_split(const std::string& dir, const std::string& prefix) {
  const std::string images_path = idx_path(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = idx_path(dir, prefix + "-labels-idx1-ubyte");
  auto images = read_idx(images_path, 3);
  auto labels = read_idx(labels_path, 1);
  if (images.size(0) != labels.size(0)) {
    throw IdxError(labels_path + ": " + std::to_string(labels.size(0)) + " labels, but " + images_path + " has " +
                   std::to_string(images.size(0)) + " images");
  }
  if (images.size(0) == 0) {
    throw IdxError(images_path + ": no images");
  }
  const int64_t top = labels.numel() > 0 ? labels.max().item<int64_t>() : 0;
  if (top > 9) {
    throw IdxError(labels_path + ": a label is " + std::to_string(top) + "; MNIST-format labels are 0 to 9");
  }
  // MNIST's mean and standard deviation, as in PyTorch's examples.
  auto normalised = (images.unsqueeze(1).to(torch::kFloat) / 255.0 - 0.1307) / 0.3081;
  return {normalised, labels.to(torch::kLong)};
}

} // namespace examples
} // namespace lockstep
