#include <lockstep/runtime.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <fstream>
#include <vector>

namespace lockstep {

namespace {

// Every mapped library whose name says BLAS, in map order.
std::vector<std::string> mapped_blas() {
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

} // namespace

std::string loaded_blas() {
  std::string all;
  for (const auto& path : mapped_blas()) {
    all += (all.empty() ? "" : ", ") + path;
  }
  return all;
}

void require_fast_blas(const std::string& who) {
  const std::string blas = loaded_blas();
  TORCH_CHECK(
      blas.find("/blas/libblas") == std::string::npos, who, ": this process loaded the reference BLAS (", blas,
      "), which is about 20x slower than OpenBLAS for matrix products. Run scripts/setup.sh, which installs "
      "libopenblas0-openmp and selects it with update-alternatives.");
}

} // namespace lockstep
