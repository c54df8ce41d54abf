// How a wait on a Gloo collective polls before it sleeps (Note [Polling
// before a wait] in src/comm/backends/gloo.cpp), without threads: the poll
// asks until its condition holds, and not at all without a time to poll.

#include <lockstep/detail/c10d_group.h>

#include <gtest/gtest.h>

#include <chrono>

namespace lockstep {
namespace {

TEST(WaitPolling, PollsUntilTheConditionHoldsAndNotAtAllWithoutATime) {
  int asked = 0;
  detail::poll_for(std::chrono::seconds(60), [&] { return ++asked == 3; });
  EXPECT_EQ(asked, 3) << "it stops once the condition holds, long before its time";
  asked = 0;
  detail::poll_for(std::chrono::microseconds(0), [&] { return ++asked > 0; });
  EXPECT_EQ(asked, 0) << "no time to poll: the wait sleeps at once";
  const auto start = std::chrono::steady_clock::now();
  detail::poll_for(std::chrono::milliseconds(20), [] { return false; });
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(20))
      << "a condition that never holds is asked for the whole time";
}

} // namespace
} // namespace lockstep
