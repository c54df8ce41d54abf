// lockstep-train's LOCKSTEP_FAULT (examples/fault.h): what it asks for, and
// every malformed value refused with the form it expects.

#include <examples/fault.h>

#include "support/errors.h"

#include <gtest/gtest.h>

#include <string>

namespace lockstep {
namespace {

TEST(TrainerFault, ParsesRankStepAndWhatToDo) {
  auto fault = examples::parse_fault("1:30");
  EXPECT_EQ(fault.rank, 1);
  EXPECT_EQ(fault.step, 30);
  EXPECT_EQ(fault.action, "exit");
  EXPECT_EQ(fault.exit_code, 3);
  EXPECT_EQ(examples::parse_fault("0:2:kill").action, "kill");
  EXPECT_EQ(examples::parse_fault("0:2:hang").action, "hang");
  EXPECT_EQ(examples::parse_fault("0:2:255").exit_code, 255);
}

TEST(TrainerFault, AMalformedValueIsRefusedWithTheFormItExpects) {
  // An exit code of 0 would look like success, and one past 255 or below 1
  // would exit with another code than the one given.
  for (const std::string spec : {"0:2:foo", "0:2:0", "0:2:-1", "0:2:300", "0:2:3:4", "1", "", "x:2", "1:-5", "1:2:",
                                 ":2", "1:2x"}) {
    const std::string named = "LOCKSTEP_FAULT=\"" + spec + "\" is malformed";
    EXPECT_ERROR_SAYS(examples::parse_fault(spec), named.c_str(), "Expected RANK:STEP[:CODE]");
  }
}

} // namespace
} // namespace lockstep
