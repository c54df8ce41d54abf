// Timelines' pure logic (Note [Timeline] in src/util/timeline.cpp): where each
// rank's file goes, where lockstep-run keeps a restarted job's earlier ones,
// and how a track's overlapping spans are laid out in lanes.

#include "util/timeline_detail.h"

#include <common/path_tag.h>

#include <gtest/gtest.h>

#include <filesystem>

namespace lockstep {
namespace {

using timeline::detail::lanes_for;
using timeline::detail::rank_path;
using timeline::detail::unwritable_because;
using common::with_tag;

// Said at start (the recorder is made when the rank starts), where it was
// found only at exit, after the run, with no reason given.
TEST(TimelinePaths, APathThatCannotBeWrittenSaysWhy) {
  const auto folder = std::filesystem::temp_directory_path().string();
  EXPECT_EQ(unwritable_because(folder + "/timeline.json"), "");
  EXPECT_EQ(unwritable_because(folder), folder + " is a folder");
  EXPECT_EQ(unwritable_because("/no/such/folder/t.json"), "the folder /no/such/folder of /no/such/folder/t.json does "
                                                          "not exist");
}

// Every rank of a job tags the path it is given: a folder became the files
// <folder>.rank0 and <folder>.rank1 beside it, without a word.
TEST(TimelinePaths, AFolderIsRefusedAsSuchUnderEveryWorldSize) {
  using timeline::detail::rank_file_problem;
  const auto folder = std::filesystem::temp_directory_path().string();
  for (int world_size : {1, 2}) {
    EXPECT_EQ(rank_file_problem(folder, 1 % world_size, world_size),
              folder + " is a folder; name a file in it, e.g. " + folder + "/timeline.json");
  }
  EXPECT_EQ(rank_file_problem(folder + "/timeline.json", 1, 2), "");
  EXPECT_EQ(rank_file_problem("/no/such/folder/t.json", 0, 2), "the folder /no/such/folder of /no/such/folder/t.rank0.json "
                                                              "does not exist");
}

TEST(TimelinePaths, TheRankFillsInEveryPercentR) {
  EXPECT_EQ(rank_path("/tmp/t%r.json", 3, 4), "/tmp/t3.json");
  EXPECT_EQ(rank_path("/tmp/r%r/t%r.json", 1, 2), "/tmp/r1/t1.json");
  EXPECT_EQ(rank_path("/tmp/t%r.json", 0, 1), "/tmp/t0.json");
}

// Every rank of a job reads the same LOCKSTEP_TIMELINE: one path would leave
// one rank's file, the others' overwritten.
TEST(TimelinePaths, APathWithoutTheRankGetsItWhenSeveralRanksShareIt) {
  EXPECT_EQ(rank_path("/tmp/t.json", 1, 2), "/tmp/t.rank1.json");
  EXPECT_EQ(rank_path("/tmp/t", 0, 2), "/tmp/t.rank0");
  EXPECT_EQ(rank_path("/tmp/v1.2/t", 1, 2), "/tmp/v1.2/t.rank1"); // a dot in a folder is no extension
  EXPECT_EQ(rank_path(".hidden", 1, 2), ".hidden.rank1");
  EXPECT_EQ(rank_path("/tmp/t.json", 0, 1), "/tmp/t.json"); // one rank: the path as given
}

TEST(TimelinePaths, TagsGoBeforeTheExtension) {
  EXPECT_EQ(with_tag("runs/timeline.json", ".attempt0"), "runs/timeline.attempt0.json");
  EXPECT_EQ(with_tag("timeline", ".attempt2"), "timeline.attempt2");
  EXPECT_EQ(with_tag("a.b/timeline", ".attempt1"), "a.b/timeline.attempt1");
}

// Buckets launched one after another and waited for later overlap partly;
// Perfetto drops such events of one track, so they go to lanes.
TEST(TimelineLanes, SpansThatOverlapGoToLanesOfTheirOwn) {
  EXPECT_EQ(lanes_for({{0, 10}, {5, 15}, {12, 20}}), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(lanes_for({{0, 10}, {10, 20}, {20, 30}}), (std::vector<int>{0, 0, 0})); // touching is apart
  EXPECT_EQ(lanes_for({{0, 30}, {1, 29}, {2, 28}}), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(lanes_for({{12, 20}, {0, 10}, {5, 15}}), (std::vector<int>{0, 0, 1})); // recorded in end order
  EXPECT_TRUE(lanes_for({}).empty());
}

} // namespace
} // namespace lockstep
