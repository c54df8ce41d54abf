// One rank of FullyShardedDataParallel's multi-process tests: the checks of
// support/fsdp_checks.h, which test_fully_sharded.cpp runs with ranks as
// threads. Started by test_ddp_processes.cpp over Gloo (torchrun's
// variables) and by the Mpi.fsdp_* tests under mpirun
// (LOCKSTEP_TEST_BACKEND=mpi).
//
//   lockstep_fsdp_worker equivalence|no_sync|frozen|mismatch|scaler|clip|cuda
//   lockstep_fsdp_worker checkpoint_save|checkpoint_load|cuda_checkpoint DIR
//
// support/run_worker.h makes the group and reports the checks.

#include <lockstep/lockstep.h>

#include "support/amp_checks.h"
#include "support/fsdp_checks.h"
#include "support/run_worker.h"

#include <cstdio>
#include <functional>
#include <limits>
#include <string>

namespace {

using lockstep::testing::kStrategies;

using lockstep::testing::OddNet;
using lockstep::testing::WorkerContext;
using lockstep::testing::WorkerScenario;

// Every scenario starts from the same seed.
WorkerScenario seeded(std::function<void(WorkerContext&)> scenario, std::string argument = "") {
  return {[scenario](WorkerContext& context) {
            torch::manual_seed(0);
            scenario(context);
          },
          std::move(argument)};
}

void equivalence(WorkerContext& context) {
  OddNet initial;
  for (auto strategy : kStrategies) {
    lockstep::testing::check_matches_reference(context.group, initial, strategy, context.check);
  }
}

void no_sync(WorkerContext& context) {
  OddNet initial;
  for (auto strategy : kStrategies) {
    lockstep::testing::check_no_sync(context.group, initial, strategy, context.check);
  }
}

void frozen(WorkerContext& context) {
  OddNet initial(13, /*use_branch=*/false);
  initial->fc1->weight.set_requires_grad(false);
  for (auto strategy : kStrategies) {
    lockstep::testing::check_matches_reference(context.group, initial, strategy, context.check, 3);
  }
}

// support/amp_checks.h
void scaler(WorkerContext& context) {
  lockstep::testing::check_ddp_scaler_skips_together(context.group, context.check);
  for (auto strategy : kStrategies) {
    lockstep::testing::check_fsdp_scaler_skips_together(context.group, strategy, context.check);
  }
  lockstep::testing::check_fsdp_scaler_without_group_is_refused(context.group, context.check);
}

void clip(WorkerContext& context) {
  OddNet initial;
  for (auto strategy : kStrategies) {
    for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
      lockstep::testing::check_clip_grad_norm(context.group, initial, strategy, norm_type, context.check);
    }
  }
}

// Both ranks on GPU 0 over Gloo: NCCL refuses two ranks on one device.
void cuda(WorkerContext& context) {
  lockstep::testing::check_fullshard_on_gpu(context.group, OddNet(), context.check);
}

void cuda_checkpoint(WorkerContext& context) {
  lockstep::testing::check_state_loads_onto_gpu(context.group, OddNet(), context.argument, context.check);
}

void mismatch(WorkerContext& context) {
  lockstep::testing::check_model_mismatch(context.group, context.check);
}

void sharded_checkpoint(WorkerContext& context, bool save) {
  OddNet initial;
  for (auto strategy : kStrategies) {
    lockstep::testing::check_sharded_checkpoint(context.group, initial, strategy, context.argument, save, context.check);
  }
}

} // namespace

int main(int argc, char** argv) {
  return lockstep::testing::run_worker(
      argc, argv,
      {{"equivalence", seeded(equivalence)},
       {"no_sync", seeded(no_sync)},
       {"frozen", seeded(frozen)},
       {"mismatch", seeded(mismatch)},
       {"scaler", seeded(scaler)},
       {"clip", seeded(clip)},
       {"cuda", seeded(cuda)},
       {"checkpoint_save", seeded([](WorkerContext& context) { sharded_checkpoint(context, true); }, "DIR")},
       {"checkpoint_load", seeded([](WorkerContext& context) { sharded_checkpoint(context, false); }, "DIR")},
       {"cuda_checkpoint", seeded(cuda_checkpoint, "DIR")}});
}
