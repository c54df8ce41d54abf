// The pure parts of Note [Collectives through shared memory]
// (src/comm/backends/shared_memory_collectives.cpp): which ranks may share
// memory, and how a piece is cut into the ranks' slices.

#include "comm/backends/same_host.h"
#include "comm/backends/shared_memory_collectives.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <string>
#include <vector>

namespace lockstep {
namespace {

using detail::one_host;
using detail::slice_of;

// A peer that died but is not reaped yet is a zombie, to which kill(pid, 0)
// still answers: it counts as exited, so that a wait for it ends at once
// rather than at the timeout.
TEST(SharedMemoryLogic, AZombiePeerHasExited) {
  EXPECT_FALSE(detail::process_exited(static_cast<int>(::getpid())));
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::_exit(0);
  }
  bool exited = false;
  for (int i = 0; i < 200 && !exited; ++i) { // it becomes a zombie within moments
    exited = detail::process_exited(static_cast<int>(child));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(exited);
  EXPECT_EQ(::kill(child, 0), 0) << "not a zombie: the test shows nothing";
  ::waitpid(child, nullptr, 0);
  EXPECT_TRUE(detail::process_exited(static_cast<int>(child)));
}

TEST(SharedMemoryLogic, SharesOnlyWhereEveryRankPublishedTheSameHost) {
  const std::string here = "node1|boot-a|net:[1]|ipc:[2]|mnt:[3]|pid:[4]";
  EXPECT_TRUE(one_host({here + " /lockstep-1-a 1", here + " /lockstep-2-b 2"}));
  EXPECT_TRUE(one_host({here + " /lockstep-1-a 1", here + " /lockstep-2-b 2", here + " /lockstep-3-c 3"}));
  // A rank that could not make its segment, or turned sharing off.
  EXPECT_FALSE(one_host({here + " /lockstep-1-a 1", "off"}));
  EXPECT_FALSE(one_host({"off", here + " /lockstep-1-a 1"}));
  // Another host, another boot, or another network namespace (the network
  // lab's two "hosts" on one machine) is another host to the job.
  EXPECT_FALSE(one_host({here + " /a 1", "node2|boot-a|net:[1]|ipc:[2]|mnt:[3]|pid:[4] /b 2"}));
  EXPECT_FALSE(one_host({here + " /a 1", "node1|boot-b|net:[1]|ipc:[2]|mnt:[3]|pid:[4] /b 2"}));
  EXPECT_FALSE(one_host({here + " /a 1", "node1|boot-a|net:[9]|ipc:[2]|mnt:[3]|pid:[4] /b 2"}));
  EXPECT_FALSE(one_host({here + " /a 1", here + " /b 2", "node1|boot-a|net:[1]|ipc:[2]|mnt:[3]|pid:[7] /c 3"}));
  EXPECT_FALSE(one_host({}));
  EXPECT_FALSE(one_host({""}));
}

TEST(SharedMemoryLogic, ThisProcessHasAnIdentityOfOneWordThatNamesItsNetworkNamespace) {
  const std::string id = detail::host_identity();
  EXPECT_EQ(id.find(' '), std::string::npos) << id;
  EXPECT_NE(id.find("net:["), std::string::npos) << id;
  EXPECT_EQ(id, detail::host_identity());
  EXPECT_TRUE(one_host({id + " /a 1", detail::host_identity() + " /b 2"}));
}

TEST(SharedMemoryLogic, SlicesCoverEveryElementOnceInRankOrder) {
  for (int size : {2, 3, 4, 7}) {
    for (int64_t count : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{6}, int64_t{1000}, int64_t{1001}, int64_t{2097152}}) {
      int64_t next = 0;
      for (int r = 0; r < size; ++r) {
        const auto s = slice_of(count, r, size);
        EXPECT_EQ(s.first, next) << "count " << count << ", rank " << r << " of " << size;
        EXPECT_LE(s.first, s.last);
        EXPECT_LE(s.last - s.first, (count + size - 1) / size);
        next = s.last;
      }
      EXPECT_EQ(next, count) << "count " << count << " over " << size << " ranks";
    }
  }
}

} // namespace
} // namespace lockstep
