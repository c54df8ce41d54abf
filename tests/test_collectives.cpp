// ProcessGroup's contract (process_group.h) over Gloo, ranks as threads: the
// checks of support/collective_contract.h, which collectives_worker.cpp runs
// over MPI under mpirun (the Mpi.contract_* tests).

#include <lockstep/lockstep.h>

#include "support/collective_contract.h"
#include "support/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <string>

namespace lockstep {
namespace {

// Runs `checks` on `size` ranks; a failed check fails the test, naming the rank.
void on_ranks(int size, void (*checks)(const ProcessGroup&, const testing::Check&),
              std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  std::mutex mutex;
  testing::spawn(
      size,
      [&](ProcessGroup& group) {
        checks(group, [&](bool ok, const std::string& what) {
          std::lock_guard<std::mutex> lock(mutex);
          EXPECT_TRUE(ok) << "rank " << group.rank() << " of " << group.size() << ": " << what;
        });
      },
      timeout);
}

TEST(ProcessGroupContract, SeveralTensorsAreReducedAndBroadcastOneByOne) {
  on_ranks(4, testing::check_several_tensors);
  on_ranks(3, testing::check_several_tensors);
}

TEST(ProcessGroupContract, IntegerAverageRoundsDownAndBoolAverageIsRefused) {
  for (int size : {1, 2, 3, 4}) {
    on_ranks(size, testing::check_integer_average);
  }
}

TEST(ProcessGroupContract, EmptyListIsRefusedAtTheCall) {
  on_ranks(1, testing::check_empty_list);
  on_ranks(2, testing::check_empty_list);
}

TEST(ProcessGroupContract, LocalRefusalDoesNotReadAsATimeout) {
  on_ranks(1, testing::check_local_refusal);
  on_ranks(2, testing::check_local_refusal);
}

TEST(ProcessGroupContract, BFloat16AndBoolTravelExactlyOrAreRefusedAtTheCall) {
  on_ranks(1, testing::check_bfloat16_and_bool);
  on_ranks(3, testing::check_bfloat16_and_bool);
}

TEST(ProcessGroupContract, AllGatherWorksInInferenceMode) {
  on_ranks(1, testing::check_all_gather_in_inference_mode);
  on_ranks(2, testing::check_all_gather_in_inference_mode);
}

} // namespace
} // namespace lockstep
