// The command-line checks both tools share (common/cli_checks.h): refusals
// in words.

#include <tools/run_options.h>

#include <CLI/CLI.hpp>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace lockstep {
namespace {

using testing::error_of;

// The message CLI11 gives for `value` on an option checked by `check`; empty if it takes it.
std::string refusal(const CLI::Validator& check, const std::string& value) {
  CLI::App app;
  double number = 0;
  app.add_option("--n", number)->check(check);
  const char* argv[] = {"prog", "--n", value.c_str()};
  try {
    app.parse(3, argv);
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

TEST(CliChecks, RefusalsSayWhatIsWrongInWords) {
  EXPECT_EQ(refusal(common::positive(), "0"), "--n: must be greater than 0, got 0");
  EXPECT_EQ(refusal(common::positive(), "-2.5"), "--n: must be greater than 0, got -2.5");
  EXPECT_EQ(refusal(common::positive(), "1e5000"), "--n: expected a number greater than 0, got '1e5000'");
  EXPECT_EQ(refusal(common::positive(), "inf"), "--n: expected a number greater than 0, got 'inf'");
  EXPECT_EQ(refusal(common::positive(), "abc"), "--n: expected a number greater than 0, got 'abc'");
  EXPECT_EQ(refusal(common::positive(), "0.001"), "");
  EXPECT_EQ(refusal(common::non_negative(), "-1"), "--n: must be 0 or more, got -1");
  EXPECT_EQ(refusal(common::non_negative(), "nan"), "--n: expected a number 0 or more, got 'nan'");
  EXPECT_EQ(refusal(common::non_negative(), "0"), "");
}

// CLI::Range let NaN through (--gamma nan trained to NaN; --grace-period nan
// waited "nan s").
TEST(CliChecks, ARangeRefusesNanAndWhatLiesOutside) {
  EXPECT_EQ(refusal(common::number_in(0.0, 1.0), "nan"), "--n: must be a number from 0 to 1, got nan");
  EXPECT_EQ(refusal(common::number_in(0.0, 1.0), "1.5"), "--n: must be a number from 0 to 1, got 1.5");
  EXPECT_EQ(refusal(common::number_in(0.01, 60.0), "inf"), "--n: must be a number from 0.01 to 60, got inf");
  EXPECT_EQ(refusal(common::number_in(0.0, 1.0), "x"), "--n: must be a number from 0 to 1, got x");
  EXPECT_EQ(refusal(common::number_in(0.0, 1.0), "0.5"), "");
  EXPECT_EQ(refusal(common::number_in(0.0, 1.0), "1"), "");
}

TEST(CliChecks, LauncherRefusesANegativeNodeRankInWords) {
  const char* argv[] = {"lockstep-run", "--node-rank", "-1", "prog"};
  try {
    tools::parse_run_options(4, argv);
    ADD_FAILURE() << "--node-rank -1 was accepted";
  } catch (const tools::RunUsageError& e) {
    EXPECT_EQ(e.exit_code, common::kUsageError);
    EXPECT_NE(std::string(e.what()).find("--node-rank: must be 0 or more, got -1"), std::string::npos) << e.what();
  }
}

} // namespace
} // namespace lockstep
