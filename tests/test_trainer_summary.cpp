// lockstep-train's sentences about a run (examples/summary.h): pure
// functions of its settings and state.

#include <examples/summary.h>

#include <gtest/gtest.h>

#include <string>

namespace lockstep {
namespace {

using examples::Config;
using examples::TrainingState;

TEST(TrainerSummary, AResumedRunCountsItsOwnSteps) {
  TrainingState state;
  state.step = 36;
  EXPECT_EQ(examples::describe_steps(state), "36 steps");
  state.resumed_step = 24;
  EXPECT_EQ(examples::describe_steps(state), "12 steps (36 in all)");
}

TEST(TrainerSummary, AWarmupPastTheRunIsSaidWithWhereTheRateEnds) {
  Config config;
  config.epochs = 2;
  config.lr = 0.1;
  config.warmup_steps = 100;
  EXPECT_EQ(examples::warmup_note(config, 16), "--warmup-steps 100 is more than the run's 32 steps (2 epoch(s) of 16), "
            "so the learning rate never reaches --lr 0.1: it ends at 0.032. Give --warmup-steps 32 or fewer, or more "
            "--epochs.");
  config.warmup_steps = 32;
  EXPECT_EQ(examples::warmup_note(config, 16), "");
}

TEST(TrainerSummary, PowerSGDsLineSaysWhyNothingWasCompressed) {
  Config config;
  config.powersgd_rank = 1024;
  config.powersgd_start = 100;
  TrainingState state;
  state.step = 32;
  EXPECT_EQ(examples::describe_compression(0, state, config).rfind("PowerSGD compressed nothing: it starts after "
                                                                   "--powersgd-start 100 steps", 0), 0u);
  EXPECT_EQ(examples::describe_compression(1.0, state, config).rfind("PowerSGD compressed no gradient: at "
                                                                     "--powersgd-rank 1024", 0), 0u);
  EXPECT_EQ(examples::describe_compression(12.34, state, config).rfind("PowerSGD compression rate 12.3 ", 0), 0u);
}

} // namespace
} // namespace lockstep
