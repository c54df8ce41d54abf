#pragma once

// Which BLAS this process runs on. Debian's LibTorch calls whatever
// libblas.so.3 update-alternatives selects, and the reference BLAS is about
// 20x slower than OpenBLAS for matrix products: a trainer or a benchmark on
// it measures the BLAS, not data parallelism. The trainer and both
// benchmarks call require_fast_blas() first. It is no part of the library:
// which BLAS a program loads is its own business.

#include <c10/util/Exception.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

namespace lockstep {
namespace examples {

/// Every mapped library whose name says BLAS, in the order of
/// /proc/self/maps, each once.
inline std::vector<std::string> mapped_blas() {
  std::vector<std::string> found;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) {
      continue;
    }
    std::string path = line.substr(slash);
    if ((path.find("libblas") != std::string::npos || path.find("libopenblas") != std::string::npos) &&
        std::find(found.begin(), found.end(), path) == found.end()) {
      found.push_back(std::move(path));
    }
  }
  return found;
}

/// The paths of the BLAS libraries this process loaded, comma-separated, or
/// "" if none is mapped (a LibTorch with MKL linked in, as the pip wheel).
inline std::string loaded_blas() {
  std::string all;
  for (const auto& path : mapped_blas()) {
    all += (all.empty() ? "" : ", ") + path;
  }
  return all;
}

/// Throws a c10::Error if this process runs on Debian's reference BLAS.
/// `who` names the caller in the message.
inline void require_fast_blas(const std::string& who) {
  const std::string blas = loaded_blas();
  TORCH_CHECK(
      blas.find("/blas/libblas") == std::string::npos, who, ": this process loaded the reference BLAS (", blas,
      "), which is about 20x slower than OpenBLAS for matrix products. Run scripts/setup.sh, which installs "
      "libopenblas0-openmp and selects it with update-alternatives.");
}

} // namespace examples
} // namespace lockstep
