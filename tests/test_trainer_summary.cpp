// lockstep-train's sentences about a run (examples/summary.h): pure
// functions of its settings and state.

#include <examples/resume.h>
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

// A checkpoint of an epoch longer than this run's (more --train-samples)
// was said as "sample 96 of 64".
TEST(TrainerSummary, AResumePastThisRunsEpochSaysTheEpochEnds) {
  const examples::BatchPlan plan{/*samples=*/64, /*batch_size=*/32, /*world_size=*/1, /*rank=*/0, /*seed=*/1};
  TrainingState state;
  state.samples_in_epoch = 32;
  EXPECT_EQ(examples::resumed_position(state, plan), "sample 32 of 64");
  state.samples_in_epoch = 96;
  EXPECT_EQ(examples::resumed_position(state, plan), "sample 96, past the 64 of this run's epoch, which so ends there");
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

// A checkpoint written before a setting was recorded said, on every
// resume, that it had changed; a changed --lr or --warmup-steps was not said.
TEST(TrainerSummary, AResumeSaysTheSettingsItChangesAndNoOthers) {
  const std::string now = "--precision fp16 --loss-scale-growth-interval 2000 --comm-hook powersgd --powersgd-rank 4 "
                          "--powersgd-start 10 --lr 0.1 --momentum 0.9 --schedule cosine --warmup-steps 100";
  EXPECT_EQ(examples::settings_changes("--precision fp16 --comm-hook powersgd --powersgd-rank 4", now), "")
      << "flags an older checkpoint did not record";
  EXPECT_EQ(examples::settings_changes(now, now), "");
  EXPECT_EQ(examples::settings_changes("--precision fp32", "--precision fp32 --sharding full"),
            "; written with no --sharding, and this run goes on with --sharding full")
      << "a flag the older format did record";
  EXPECT_EQ(examples::settings_changes("--precision fp32 --lr 0.1 --schedule step --warmup-steps 100 --gamma 0.5 "
                                       "--step-epochs 1",
                                       "--precision bf16 --lr 0.05 --schedule step --warmup-steps 10 --gamma 0.5 "
                                       "--step-epochs 1"),
            "; written with --precision fp32 --lr 0.1 --warmup-steps 100, and this run goes on with --precision bf16 "
            "--lr 0.05 --warmup-steps 10");
  Config config;
  config.optimizer = "sgd";
  config.lr = 0.05;
  EXPECT_EQ(examples::run_settings(config), "--precision fp32 --lr 0.05 --momentum 0.9 --schedule cosine "
                                            "--warmup-steps 100");
}

// A GPT whose attention did not fit ended on the allocator's line, naming
// bytes and no flag.
TEST(TrainerSummary, RunningOutOfMemoryNamesTheFlagsToLower) {
  Config config;
  config.model = "gpt";
  config.batch_size = 48;
  EXPECT_EQ(examples::out_of_memory_advice("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                                           "memory: you tried to allocate 12884901888 bytes", config, 4096),
            "the run ran out of memory: each rank's activations grow with its share of --batch-size 48, and with the "
            "square of --context 4096 (attention's scores); give a smaller --batch-size or --context, or add "
            "--activation-checkpointing.");
  config.model = "cnn";
  EXPECT_EQ(examples::out_of_memory_advice("std::bad_alloc", config, 128), "the run ran out of memory: each rank's "
            "activations grow with its share of --batch-size 48; give a smaller --batch-size.");
  EXPECT_EQ(examples::out_of_memory_advice("checkpoint x is damaged", config, 128), "");
}

} // namespace
} // namespace lockstep
