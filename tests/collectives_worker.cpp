// One rank of the process-group contract tests under a real launcher (the
// Mpi.contract_* and Mpi.size_mismatch_* tests run it under mpirun with
// LOCKSTEP_TEST_BACKEND=mpi, Mpi.contract_open_mpi_* with LOCKSTEP_MPI_SHM=0): the checks of support/collective_contract.h,
// which test_collectives.cpp runs over Gloo with ranks as threads.
//
//   lockstep_collectives_worker contract|size_mismatch
//
// support/run_worker.h makes the group and reports the checks.

#include <lockstep/lockstep.h>

#include "support/collective_contract.h"
#include "support/run_worker.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

namespace {

using lockstep::testing::Check;

// Note [MPI's thread and timeouts]: lockstep initialised MPI, and asked Open
// MPI to yield while idle (mpirun sets no such variable).
void check_what_lockstep_asked_of_open_mpi(const Check& check) {
  const char* yield = std::getenv("OMPI_MCA_mpi_yield_when_idle");
  check(yield != nullptr && std::string(yield) == "1", "Open MPI was asked to yield while idle");
  // Note [MPI's copies on a full host]: through shared memory where this
  // host's ranks are at least its cores, else Open MPI's own choice.
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const bool full = local != nullptr && std::atoi(local) >= static_cast<int>(std::thread::hardware_concurrency());
  const char* copy = std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism");
  check(full ? copy != nullptr && std::string(copy) == "none" : copy == nullptr,
        full ? "Open MPI was asked to copy through shared memory on a host its ranks fill"
             : "Open MPI keeps its own copies on a host with cores to spare");
}

// What the mpi backend refuses, each saying why.
void check_mpi_refusals(lockstep::ProcessGroup& group, const Check& check) {
  // MPI's counts are ints: 2^32 + 8 bytes (never touched: refused before
  // MPI reads them), which a cast made 8, are an error on every rank, not a
  // sum of the first 8.
  auto huge = torch::empty({(int64_t{1} << 32) + 8}, torch::kByte);
  lockstep::testing::check_says(check, lockstep::testing::message_of([&] {
    group.allreduce_async({huge}, lockstep::ReduceOp::Max, "4 GiB")->wait();
  }), {"the mpi backend moves at most 2147483647 elements per rank", "this one has 4294967304"}, "4 GiB");
  // A second group would call MPI from a second thread while this one's
  // does, under MPI_THREAD_SERIALIZED: refused, on this rank alone, before
  // it calls MPI.
  lockstep::testing::check_says(check, lockstep::testing::message_of([&] {
    lockstep::init_process_group(lockstep::ProcessGroupOptions().backend("mpi"));
  }), {"the mpi backend takes one group per process at a time, and one is alive"}, "a second mpi group");
  // A subgroup, which MPI's group setup would wait in for ranks that never
  // come, is refused at once, naming gloo.
  lockstep::testing::check_says(check, lockstep::testing::message_of([&] {
    lockstep::new_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, "mpi");
  }), {"the mpi backend makes the group of all MPI's", "no subgroups", "\"gloo\""}, "an mpi subgroup");
  // How long a wait polls (Note [Polling before a wait]) is read before MPI
  // is asked for anything: a value that is no number of microseconds is
  // refused naming the variable.
  ::setenv("LOCKSTEP_MPI_SPIN_US", "2ms", 1);
  lockstep::testing::check_says(check, lockstep::testing::message_of([&] {
    lockstep::init_process_group(lockstep::ProcessGroupOptions().backend("mpi"));
  }), {"LOCKSTEP_MPI_SPIN_US=2ms is not a whole number of microseconds from 0 to 1000000"}, "a poll time in ms");
  ::unsetenv("LOCKSTEP_MPI_SPIN_US");
  // Tensors on a device MPI does not take are refused saying so, not as a
  // dtype it lacks.
  lockstep::testing::check_says(check, lockstep::testing::message_of([&] {
    group.allreduce_async({torch::empty({2}, torch::kMeta)}, lockstep::ReduceOp::Sum, "meta")->wait();
  }), {"the mpi backend takes no tensors on meta", "Send a copy on the CPU"}, "a meta tensor");
}

// Note [Collectives through shared memory]: ranks of one host map every
// rank's segment (unlinked, so "(deleted)"), unless LOCKSTEP_MPI_SHM=0; and
// a collective larger than a segment comes out whole on every rank.
void check_mpi_transport(lockstep::ProcessGroup& group, const Check& check) {
  const char* env = std::getenv("LOCKSTEP_MPI_SHM");
  const bool wanted = !(env != nullptr && std::string(env) == "0");
  std::ifstream maps("/proc/self/maps");
  int segments = 0;
  for (std::string line; std::getline(maps, line);) {
    segments += line.find("/dev/shm/lockstep-") != std::string::npos ? 1 : 0;
  }
  check(segments == (wanted ? group.size() : 0),
        wanted ? "every rank's segment is mapped" : "no segment is mapped with LOCKSTEP_MPI_SHM=0");
  const int64_t n = 3 << 20; // 12 MiB of floats: pieces of the 8 MiB segments
  auto t = torch::arange(n, torch::kFloat).fmod_(1024).add_(group.rank());
  group.allreduce(t);
  const int size = group.size();
  const auto expected = torch::arange(n, torch::kFloat).fmod_(1024).mul_(size).add_(size * (size - 1) / 2);
  check(torch::equal(t, expected), "a 12 MiB allreduce sums every element on every rank");
  auto b = torch::full({n}, static_cast<float>(group.rank()));
  group.broadcast(b, size - 1);
  check(torch::equal(b, torch::full({n}, static_cast<float>(size - 1))), "a 12 MiB broadcast from the last rank");
}

// Once the group is gone, a new one can be made, though a Work of its
// collectives is still held.
void check_mpi_group_made_again(lockstep::ProcessGroup& group, const Check& check) {
  auto kept = torch::ones({2});
  auto work = group.allreduce_async({kept}, lockstep::ReduceOp::Sum, "a collective whose Work is kept");
  work->wait();
  const int size = group.size();
  group = lockstep::ProcessGroup();
  lockstep::testing::attempt(check, "a new mpi group once the first is destroyed", [&] {
    group = lockstep::init_process_group(lockstep::ProcessGroupOptions().backend("mpi"));
    auto t = torch::ones({2});
    group.allreduce(t);
    check(torch::equal(t, torch::full({2}, static_cast<float>(size))), "the new mpi group sums");
  });
}

void contract(lockstep::testing::WorkerContext& context) {
  auto& group = context.group;
  const auto& check = context.check;
  lockstep::testing::check_several_tensors(group, check);
  lockstep::testing::check_integer_average(group, check);
  lockstep::testing::check_empty_list(group, check);
  lockstep::testing::check_local_refusal(group, check);
  lockstep::testing::check_bfloat16_and_bool(group, check);
  lockstep::testing::check_collectives_in_inference_mode(group, check);
  lockstep::testing::check_in_place_and_parameters(group, check);
  if (group.backend() == "mpi") {
    check_what_lockstep_asked_of_open_mpi(check);
    check_mpi_refusals(group, check);
    check_mpi_transport(group, check);
    check_mpi_group_made_again(group, check);
  }
}

void size_mismatch(lockstep::testing::WorkerContext& context) {
  lockstep::testing::check_size_mismatch(context.group, context.check);
  lockstep::testing::check_meaning_mismatch(context.group, context.check);
}

} // namespace

int main(int argc, char** argv) {
  lockstep::testing::WorkerScenario mismatched{size_mismatch};
  mismatched.timeout = std::chrono::seconds(10);
  return lockstep::testing::run_worker(argc, argv, {{"contract", {contract}}, {"size_mismatch", mismatched}});
}
