// Scenarios of lockstep_ddp_worker (tests/ddp_worker.cpp runs them): ranks
// that disagree on a collective, for the checks that refuse it, the flight
// records each rank writes and lockstep-run's desync report from them.

#include "support/worker.h"

#include <lockstep/lockstep.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>

namespace lockstep {
namespace testing {

// Rank 0 averages where the others sum. The ranks' check refuses it on
// every rank; the flight records must show the reduction each caller asked
// for, which reaches the backend as a sum either way.
void desync_avg(const ProcessGroup& group) {
  auto t = torch::ones({4});
  group.allreduce(t);
  group.allreduce(t, group.rank() == 0 ? ReduceOp::Avg : ReduceOp::Sum);
}

// A disagreement refused and survived (the ranks stay paired), then rank 1
// skips an allreduce: the flight records and the desync report must tell of
// the second failure, where only the first was ever written.
void desync_after_caught(const ProcessGroup& group) {
  auto t = torch::ones({4});
  expect_error(group, [&] {
    auto own = torch::ones({group.rank() == 0 ? 4 : 5});
    group.allreduce(own);
  }, {"ranks disagree"});
  for (int i = 0; i < 3; ++i) {
    group.allreduce(t);
  }
  if (group.rank() != 1) {
    group.allreduce(t);
  }
  group.barrier();
}

// Under LOCKSTEP_DEBUG=detail: rank 1 runs another shape, or another
// operation, than the others; every rank must throw naming both.
void desync_detail(const ProcessGroup& group, bool other_op) {
  auto t = torch::ones({4});
  group.allreduce(t); // agreed: #0
  expect_error(group, [&] {
    if (group.rank() != 1) {
      group.allreduce(t);
    } else if (other_op) {
      group.broadcast(t, 0);
    } else {
      auto longer = torch::ones({5});
      group.allreduce(longer);
    }
  }, {"LOCKSTEP_DEBUG=detail: ranks disagree on collective #1: rank 0 runs allreduce (sum) of [4] Float but rank 1 runs ",
      other_op ? "broadcast from rank 0 of [4] Float" : "allreduce (sum) of [5] Float"});
}

// Two groups of the same processes: the world's, and one in the reverse
// order (its rank 1 - the process's, over a FileStore in
// LOCKSTEP_TRACE_DIR), where the ranks disagree on an allreduce's length.
// Once beside the world's group, refused and survived; once more after the
// world's group is gone, which ends the process. Each rank's summary must
// show the reversed group's collectives, and its record file and desync
// report its own rank, not its rank in the group that failed.
void desync_in_a_second_group(const ProcessGroup&) {
  auto world = std::make_unique<ProcessGroup>(
      init_process_group(ProcessGroupOptions().backend("gloo").timeout(std::chrono::seconds(3))));
  const int rank = world->rank();
  const int size = world->size();
  const char* dir = std::getenv("LOCKSTEP_TRACE_DIR");
  TORCH_CHECK(dir != nullptr, "desync_in_a_second_group runs under lockstep-run --log-dir");
  auto reversed = new_group(c10::make_intrusive<c10d::FileStore>(std::string(dir) + "/reversed_group_store", size),
                            size - 1 - rank, size, "gloo", std::chrono::seconds(3));
  auto t = torch::ones({4});
  world->allreduce(t);
  reversed.allreduce(t);
  const auto disagree = [&] {
    auto own = torch::ones({rank == 0 ? 4 : 5});
    reversed.allreduce(own);
  };
  expect_error(reversed, disagree, {"ranks disagree"});
  world.reset();
  reversed.allreduce(t);
  disagree();
}

} // namespace testing
} // namespace lockstep
