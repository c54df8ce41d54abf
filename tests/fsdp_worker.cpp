// One rank of FullyShardedDataParallel's multi-process tests: the checks of
// support/fsdp_checks.h, which test_fully_sharded.cpp runs with ranks as
// threads. Started by test_ddp_processes.cpp over Gloo (torchrun's
// variables) and by the Mpi.fsdp_* tests under mpirun
// (LOCKSTEP_TEST_BACKEND=mpi).
//
//   lockstep_fsdp_worker equivalence|no_sync|frozen|mismatch|scaler|clip|cuda
//   lockstep_fsdp_worker checkpoint_save|checkpoint_load|cuda_checkpoint DIR
//
// Prints "rank R: OK" and exits 0 when every check passed, "rank R: CHECK
// FAILED: ..." for each failed one and exits 1, "rank R: ERROR: ..." and
// exits 3 on an unexpected lockstep error.

#include <lockstep/lockstep.h>

#include "support/amp_checks.h"
#include "support/fsdp_checks.h"

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

namespace {

using lockstep::testing::kStrategies;

bool run(const std::string& scenario, const std::string& dir, lockstep::ProcessGroup& group,
         const lockstep::testing::Check& check) {
  using lockstep::testing::OddNet;
  torch::manual_seed(0);
  if (scenario == "equivalence" || scenario == "no_sync") {
    OddNet initial;
    for (auto strategy : kStrategies) {
      if (scenario == "equivalence") {
        lockstep::testing::check_matches_reference(group, initial, strategy, check);
      } else {
        lockstep::testing::check_no_sync(group, initial, strategy, check);
      }
    }
  } else if (scenario == "frozen") {
    OddNet initial(13, /*use_branch=*/false);
    initial->fc1->weight.set_requires_grad(false);
    for (auto strategy : kStrategies) {
      lockstep::testing::check_matches_reference(group, initial, strategy, check, 3);
    }
  } else if (scenario == "scaler") { // support/amp_checks.h
    lockstep::testing::check_ddp_scaler_skips_together(group, check);
    for (auto strategy : kStrategies) {
      lockstep::testing::check_fsdp_scaler_skips_together(group, strategy, check);
    }
    lockstep::testing::check_fsdp_scaler_without_group_is_refused(group, check);
  } else if (scenario == "clip") {
    OddNet initial;
    for (auto strategy : kStrategies) {
      for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
        lockstep::testing::check_clip_grad_norm(group, initial, strategy, norm_type, check);
      }
    }
  } else if (scenario == "cuda") { // both ranks on GPU 0 over Gloo: NCCL refuses two ranks on one device
    lockstep::testing::check_fullshard_on_gpu(group, OddNet(), check);
  } else if (scenario == "cuda_checkpoint" && !dir.empty()) {
    lockstep::testing::check_state_loads_onto_gpu(group, OddNet(), dir, check);
  } else if (scenario == "mismatch") {
    lockstep::testing::check_model_mismatch(group, check);
  } else if ((scenario == "checkpoint_save" || scenario == "checkpoint_load") && !dir.empty()) {
    OddNet initial;
    for (auto strategy : kStrategies) {
      lockstep::testing::check_sharded_checkpoint(group, initial, strategy, dir, scenario == "checkpoint_save", check);
    }
  } else {
    return false;
  }
  return true;
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s equivalence|no_sync|frozen|mismatch|scaler|clip|cuda|checkpoint_save DIR|checkpoint_load DIR|"
                 "cuda_checkpoint DIR\n",
                 argv[0]);
    return 2;
  }
  int rank = -1;
  int failures = 0;
  try {
    const char* backend = std::getenv("LOCKSTEP_TEST_BACKEND");
    auto group = lockstep::init_process_group(lockstep::ProcessGroupOptions().backend(backend != nullptr ? backend : "gloo"));
    rank = group.rank();
    const lockstep::testing::Check check = [&](bool ok, const std::string& what) {
      if (!ok) {
        std::printf("rank %d: CHECK FAILED: %s\n", rank, what.c_str());
        ++failures;
      }
    };
    if (!run(argv[1], argc == 3 ? argv[2] : "", group, check)) {
      std::fprintf(stderr, "unknown scenario %s\n", argv[1]);
      return 2;
    }
  } catch (const c10::Error& e) {
    std::printf("rank %d: ERROR: %s\n", rank, e.what_without_backtrace());
    std::fflush(stdout);
    return 3;
  }
  if (failures == 0) {
    std::printf("rank %d: OK\n", rank);
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}
