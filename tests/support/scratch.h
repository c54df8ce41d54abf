#pragma once

// Where a test process keeps its files: one folder of its own under gtest's
// TempDir() (TEST_TMPDIR, else /tmp), removed when the process ends with
// every test passed, kept (and named on stderr) when one failed or
// LOCKSTEP_KEEP_TEST_FILES=1, so that a failure can be read afterwards and
// a passing suite leaves nothing behind.

#include "util/checked_file.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>

namespace lockstep {
namespace testing {

class ScratchFolder {
 public:
  ScratchFolder()
      : owner_(::getpid()),
        path_(::testing::TempDir() + "lockstep_" + std::to_string(owner_) + "_" +
              std::to_string(std::random_device{}())) {
    if (::mkdir(path_.c_str(), 0700) != 0) {
      throw std::runtime_error("cannot make the test's folder " + path_ + ": " + std::strerror(errno));
    }
  }
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;

  // Runs at exit, after gtest's results are final (its UnitTest was made
  // before this folder, so it outlives it). A rank forked from the test
  // process exits too, and must leave the folder to the test.
  ~ScratchFolder() {
    if (::getpid() != owner_) {
      return;
    }
    const char* keep = std::getenv("LOCKSTEP_KEEP_TEST_FILES");
    if (::testing::UnitTest::GetInstance()->Passed() && !(keep && std::string(keep) == "1")) {
      lockstep::detail::remove_tree(path_);
    } else {
      std::fprintf(stderr, "test: files kept in %s\n", path_.c_str());
    }
  }

  const std::string& path() const { return path_; }

 private:
  pid_t owner_;
  std::string path_;
};

/// The path of `name` in this test process's own folder.
inline std::string scratch(const std::string& name) {
  static const ScratchFolder folder;
  return folder.path() + "/" + name;
}

} // namespace testing
} // namespace lockstep
