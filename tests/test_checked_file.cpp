// Checked files (the trainer's and sharded checkpoints): a write the disk
// refuses, and folders removed without following links.

#include "../src/util/checked_file.h"

#include "support/errors.h"
#include "support/scratch.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <csignal>
#include <string>

#include <sys/resource.h>
#include <unistd.h>

namespace lockstep {
namespace {

using testing::error_of;

// A write the disk refuses (here the file-size limit, as a full disk would)
// is an error that names the file, and leaves the old file as it was and
// no partial temporary file to hold the space the next save needs.
TEST(CheckedFile, AWriteTheDiskRefusesLeavesTheOldFileAndNoTemporary) {
  namespace fs = std::filesystem;
  const auto dir = testing::scratch("checked_file");
  fs::create_directories(dir);
  const auto path = dir + "/state.bin";
  detail::write_checked_file(path, "MAGIC\n", "old", "writer");
  const auto old_size = fs::file_size(path);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = 4096;
  const auto handler = std::signal(SIGXFSZ, SIG_IGN); // else the kernel's signal ends the process
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const auto message = testing::error_of([&] {
    detail::write_checked_file(path, "MAGIC\n", std::string(1 << 20, 'x'), "writer");
  });
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, handler);
  EXPECT_NE(message.find("writer: cannot write " + path + ".tmp."), std::string::npos) << message;
  EXPECT_EQ(fs::file_size(path), old_size);
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename(), "state.bin") << "left behind";
  }
}

// Note [The wheel's std::filesystem]: folders are removed with nftw.
TEST(RemoveTree, RemovesNestedFoldersButNotWhatALinkPointsTo) {
  namespace fs = std::filesystem;
  const auto root = testing::scratch("remove_tree");
  const auto outside = root + "_outside";
  ASSERT_TRUE(detail::remove_tree(root));
  ASSERT_TRUE(detail::remove_tree(outside));
  fs::create_directories(root + "/a/b");
  fs::create_directories(outside);
  std::ofstream(root + "/a/b/file") << "x";
  std::ofstream(root + "/top") << "y";
  std::ofstream(outside + "/kept") << "z";
  fs::create_directory_symlink(outside, root + "/a/link");
  EXPECT_TRUE(detail::remove_tree(root));
  EXPECT_FALSE(fs::exists(root));
  EXPECT_TRUE(fs::exists(outside + "/kept")) << "followed a link out of the folder";
  EXPECT_TRUE(detail::remove_tree(root)) << "nothing there is not an error";
  std::ofstream(root) << "a file";
  EXPECT_TRUE(detail::remove_tree(root));
  EXPECT_FALSE(fs::exists(root));
  EXPECT_TRUE(detail::remove_tree(outside));
}

} // namespace
} // namespace lockstep
