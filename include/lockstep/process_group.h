#pragma once

/// \file
/// Process groups for lockstep: a copyable handle (ProcessGroup) over a
/// backend (GroupImpl, in backend.h), with c10d's Gloo and NCCL process
/// groups and lockstep's MPI as backends, and a size-1 local group that makes
/// world size 1 free. Which backends exist is decided by the build
/// (`src/comm/backends/<name>.cpp` or `src/comm/backends/no_<name>.cpp`), never by
/// `#ifdef`s here. To wrap a c10d process group of your own, see c10d.h.

#include <lockstep/backend.h>
#include <lockstep/process_group_options.h>

#include <torch/arg.h>
#include <torch/types.h>

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep {

/// A process group: which rank this process is among how many, and the
/// collectives between them. Cheap to copy; copies share the group. The
/// default one is a group of one, whose collectives return at once, so code
/// written for many ranks runs unchanged on one.
class ProcessGroup {
 public:
  /// A group of one: every collective returns at once.
  ProcessGroup();
  /// A group over a backend of your own.
  explicit ProcessGroup(std::shared_ptr<GroupImpl> impl);

  /// This process's rank, in [0, size()).
  int rank() const {
    return impl_->rank();
  }
  /// Number of ranks.
  int size() const {
    return impl_->size();
  }
  /// "gloo", "nccl", "mpi", or "local" for the group of one; a custom
  /// backend's own name (GroupImpl::backend).
  std::string backend() const {
    return impl_->backend();
  }
  /// How long a collective may take before it is an error on this rank.
  std::chrono::milliseconds timeout() const {
    return impl_->timeout();
  }

  /// Starts reducing `tensors` over all ranks, in place, tensor by tensor:
  /// tensors[i] of every rank are reduced together into every rank's
  /// tensors[i]. The result is there once wait() returns. Avg is the sum
  /// divided by size() (see ReduceOp). `what` names the collective in errors.
  /// The list holds one or more dense tensors of one dtype on one device,
  /// of any shapes (the same on every rank); anything else is refused here,
  /// on this rank, before anything is sent. Every rank must pass tensors of
  /// the same sizes: where they do not, every rank's wait() throws, naming
  /// both sizes, and nothing is sent.
  std::shared_ptr<Work> allreduce_async(
      std::vector<torch::Tensor> tensors,
      ReduceOp op = ReduceOp::Sum,
      std::string what = "allreduce") const;
  /// Starts copying root's `tensors` into every rank's, tensor by tensor;
  /// the same rules as allreduce_async.
  std::shared_ptr<Work> broadcast_async(std::vector<torch::Tensor> tensors, int root = 0, std::string what = "broadcast")
      const;

  /// Starts a reduce-scatter: with n = output.numel(), rank r's `output`
  /// receives the reduction by `op` of every rank's input elements
  /// [r*n, (r+1)*n). `input` holds size()*n elements of output's dtype, on
  /// its device; both are dense and contiguous (the shape does not matter).
  /// `output` may be this rank's slice of `input` (in place, as NCCL's);
  /// `input` is otherwise left as it was. Each backend moves (size()-1)/size() of the
  /// input per rank, as a ring does, not an allreduce's twice that.
  std::shared_ptr<Work> reduce_scatter_async(
      torch::Tensor output,
      torch::Tensor input,
      ReduceOp op = ReduceOp::Sum,
      std::string what = "reduce_scatter") const;
  /// Starts an all-gather into one flat tensor: rank r's `input` lands in
  /// output elements [r*n, (r+1)*n), n = input.numel(). The same rules as
  /// reduce_scatter_async.
  std::shared_ptr<Work> all_gather_into_async(torch::Tensor output, torch::Tensor input, std::string what = "all_gather")
      const;

  /// Reduces `tensor` over all ranks, in place, and waits.
  void allreduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) const;
  /// Copies root's `tensor` into every rank's, and waits.
  void broadcast(torch::Tensor& tensor, int root = 0) const;
  /// Every rank's `tensor`, in rank order. Shapes must match on all ranks.
  std::vector<torch::Tensor> all_gather(const torch::Tensor& tensor) const;
  /// Returns once every rank has called it.
  void barrier() const;
  /// Whether this group runs `op` on tensors of `dtype` on `device`: as the
  /// backend does, or for a broadcast or all_gather, bit for bit through a
  /// type of the same width (bool as bytes, bfloat16 as 16-bit values).
  bool supports(Collective op, torch::ScalarType dtype, torch::Device device = torch::kCPU) const;
  /// Whether an allreduce with ReduceOp::Avg of `dtype` (float or double;
  /// false for any other) on `device` is divided by the backend as it
  /// reduces (GroupImpl::averages), rather than in a pass over the whole
  /// tensor once the sum is done. A caller that would divide its tensor
  /// before a Sum then saves that pass by asking for Avg instead.
  bool averages_in_backend(torch::ScalarType dtype, torch::Device device = torch::kCPU) const;
  /// Whether the backend starts a collective for little beside its bytes
  /// (GroupImpl::cheap_collective_starts).
  bool cheap_collective_starts() const;
  /// Memory every rank can reach, where the backend has it
  /// (GroupImpl::shared_buffers): a collective, called by every rank with no
  /// collective in flight; empty on every rank where it cannot be had.
  std::vector<torch::Tensor> shared_buffers(const std::vector<int64_t>& bytes) const;
  /// Whether this handle and `other` are one group (copies of one handle).
  bool same_group_as(const ProcessGroup& other) const {
    return impl_ == other.impl_;
  }

 private:
  std::shared_ptr<GroupImpl> impl_;
};

/// Creates the group: a store, then the backend's process group. World size 1
/// needs no store and no environment beyond it: it is the group of one.
/// Under mpirun, srun or mpiexec (their own variables, and no RANK), rank and
/// size come from the launcher, and the mpi backend needs no store at all.
/// There, RANK and WORLD_SIZE from the environment that cannot be a launch
/// inside the launcher's (a smaller world, or as large with another rank),
/// without torchrun's TORCHELASTIC_RUN_ID, are refused: most often they are
/// left from another run (Note [Stale RANK and WORLD_SIZE]).
/// Otherwise the store is, in this order of precedence:
///  - a c10d FileStore at $LOCKSTEP_STORE_FILE, when that is set and
///    options.master_addr() is empty (lockstep-run sets it on one node, so
///    that nothing listens on the network);
///  - torchrun's agent store on MASTER_PORT, when
///    $TORCHELASTIC_USE_AGENT_STORE is "True" (every rank its client, keys
///    under a prefix per restart attempt, $TORCHELASTIC_RESTART_COUNT);
///  - a c10d TCPStore that rank 0 hosts at MASTER_ADDR:MASTER_PORT.
///
/// The whole call is bounded by the timeout (Note [Initialisation deadline]
/// in src/comm/process_group.cpp): past it, the process ends with an error rather
/// than hang.
ProcessGroup init_process_group(ProcessGroupOptions options = {});

/// A group over a store the caller made (c10d::HashStore for ranks as threads
/// in one process, FileStore, TCPStore). Over a TCPStore, Gloo listens on
/// this machine's address toward the store's host, as under
/// init_process_group (GLOO_SOCKET_IFNAME picks the interface); over the
/// others, on loopback. Every process that makes groups over one store must
/// be a rank of each of them, and make them in the same order (Note [One
/// store, several groups]): groups of different members, such as pairs
/// {0, 1} and {2, 3} of a job, each take a store of their own, for example
/// c10::make_intrusive<c10d::PrefixStore>("pair_" + std::to_string(pair),
/// store). Over one shared store, ranks of different pairs can meet and form
/// a group between them, without an error. As init_process_group, joining is
/// bounded by `timeout` (Note [Initialisation deadline]): past it, the
/// process ends with an error rather than hang; for ranks that are threads of
/// one process, that ends all of them.
ProcessGroup new_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const std::string& backend = "gloo",
    std::chrono::milliseconds timeout = kDefaultTimeout);

/// Whether a launcher started this process as one rank of a job: lockstep-run
/// or torchrun (WORLD_SIZE is set), or mpirun, srun or mpiexec (their own
/// variables; see Note [MPI launchers] in src/comm/launch_env.cpp).
bool launched_by_launcher();

/// This rank's index among the job's ranks on its host, as its launcher
/// says: LOCAL_RANK (lockstep-run, torchrun), or under mpirun, srun or
/// mpiexec their own variable (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID,
/// MPI_LOCALRANKID), read where init_process_group reads that launcher's rank.
/// -1 where none says. Pick a rank's GPU with it: the global rank modulo the
/// GPUs per host is another GPU's index when ranks are placed round-robin
/// over hosts (`mpirun --map-by node`).
int64_t launched_local_rank();

/// The backends this build has, e.g. {"gloo", "mpi"}.
std::vector<std::string> available_backends();

} // namespace lockstep
