// The MPI library as the mpi backend (mpi.cpp) uses it. Compiled with
// mpi.cpp when the build found an MPI library.

#include "comm/backends/mpi_library.h"

#include "comm/launch_env.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <thread>

namespace lockstep {
namespace detail {
namespace {

std::atomic<bool> g_aborting{false};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !mpi_aborting()) {
    MPI_Finalize();
  }
}

// Note [MPI's copies on a full host]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Between ranks of one host, Open MPI moves a large message with one copy
// made by the receiver from the sender's memory (CMA, process_vm_readv), or
// with two, through shared memory, in pieces that the sender writes while
// the receiver reads. Where the host's ranks are at least its cores, so that
// no core is idle to make the one copy, the two in pieces were faster: DDP
// over MPI ran 1.07 to 1.09 x the steps per second on the MLP (buckets of 4
// and 3 MB) with LibTorch 1.13, and 1.03 x with 2.15, 2 ranks on 2 cores;
// 0.99 to 1.03 x on the deep model (docs/performance.md). So lockstep asks
// Open MPI for the copies through shared memory there, unless the
// environment already says (OMPI_MCA_btl_vader_single_copy_mechanism, or
// btl_sm_ in Open MPI 5). With cores to spare, Open MPI's choice stands.
void copy_through_shared_memory_on_a_full_host() {
  const int64_t ranks = mpi_ranks_on_this_host([](const char* name) { return std::getenv(name); });
  const unsigned cores = std::thread::hardware_concurrency();
  if (ranks > 0 && cores > 0 && ranks >= static_cast<int64_t>(cores)) {
    ::setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", /*overwrite=*/0);
    ::setenv("OMPI_MCA_btl_sm_single_copy_mechanism", "none", /*overwrite=*/0);
  }
}

} // namespace

void begin_mpi_abort() {
  g_aborting = true;
}

bool mpi_aborting() {
  return g_aborting.load();
}

int init_mpi() {
  static std::once_flag once;
  static int world = 0;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (initialized) {
      MPI_Query_thread(&provided);
    } else {
      ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0); // Note [MPI's thread and timeouts]
      copy_through_shared_memory_on_a_full_host();
      TORCH_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) == MPI_SUCCESS,
                  "lockstep: MPI_Init_thread failed; is this process started by mpirun or srun?");
      std::atexit(finalize_at_exit);
    }
    TORCH_CHECK(provided >= MPI_THREAD_SERIALIZED, "lockstep: this MPI library grants thread level ", provided,
                " but the mpi backend needs MPI_THREAD_SERIALIZED (", MPI_THREAD_SERIALIZED,
                "): its collectives run on a communication thread. If your program calls MPI_Init itself, call "
                "MPI_Init_thread with MPI_THREAD_SERIALIZED or higher instead.");
    MPI_Comm_size(MPI_COMM_WORLD, &world);
  });
  return world;
}

int mpi_count(const torch::Tensor& t, const std::string& what, int rank) {
  TORCH_CHECK(t.numel() <= std::numeric_limits<int>::max(), "lockstep: rank ", rank, ": ", what, ": the mpi backend "
              "moves at most ", std::numeric_limits<int>::max(), " elements per rank in one collective (MPI's counts "
              "are ints), but this one has ", t.numel(), ". Split the tensor into parts below that, or use the gloo "
              "backend.");
  return static_cast<int>(t.numel());
}

MPI_Datatype mpi_type(const torch::Tensor& t, const std::string& what, int rank) {
  switch (t.scalar_type()) {
    case torch::kFloat:
      return MPI_FLOAT;
    case torch::kDouble:
      return MPI_DOUBLE;
    case torch::kInt:
      return MPI_INT32_T;
    case torch::kLong:
      return MPI_INT64_T;
    case torch::kShort:
      return MPI_INT16_T;
    case torch::kChar:
      return MPI_INT8_T;
    case torch::kByte:
      return MPI_UINT8_T;
    case torch::kBool:
      return MPI_C_BOOL;
    default:
      TORCH_CHECK(false, "lockstep: rank ", rank, ": ", what, ": the mpi backend cannot send ", t.scalar_type(),
                  " tensors (MPI has no 16-bit float types). Cast to float32 first; the fp16_compress and "
                  "bf16_compress hooks do so by themselves over MPI.");
  }
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return MPI_SUM;
    case ReduceOp::Max:
      return MPI_MAX;
    case ReduceOp::Min:
      return MPI_MIN;
    case ReduceOp::Avg:
      break; // averaged through shared memory, or a sum (Note [Average])
  }
  TORCH_INTERNAL_ASSERT(false, "ReduceOp::Avg reached MPI itself");
}

std::string mpi_error(int rc) {
  if (rc == MPI_SUCCESS) {
    return {};
  }
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  return std::string(text, length);
}

std::vector<std::string> all_gather_strings(MPI_Comm comm, int size, const std::string& mine) {
  int length = static_cast<int>(mine.size());
  std::vector<int> lengths(size), offsets(size);
  MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    offsets[r] = total;
    total += lengths[r];
  }
  std::vector<char> all(std::max(total, 1));
  MPI_Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(), MPI_CHAR, comm);
  std::vector<std::string> strings;
  for (int r = 0; r < size; ++r) {
    strings.emplace_back(all.data() + offsets[r], lengths[r]);
  }
  return strings;
}

} // namespace detail
} // namespace lockstep
