#pragma once

// Process groups for lockstep: a small interface (GroupImpl) behind a
// copyable handle (ProcessGroup), with c10d's Gloo and NCCL process groups as
// backends and a size-1 local group that makes world size 1 free.
// Which backends exist is decided by the build (src/backends/<name>.cpp or
// src/backends/no_<name>.cpp), never by #ifdefs here. To wrap a c10d process
// group of your own, see c10d.h.

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

/// Default timeout of a process group's collectives and store.
constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(5)};

/// Reductions offered by ProcessGroup::allreduce. Avg of integer tensors is
/// the sum divided by size(), rounded down (floor, as Python's //); of bool
/// tensors it is refused. Sum of bool tensors is a logical or, as Max.
enum class ReduceOp { Sum, Avg, Max, Min };

/// The collectives that carry tensors, for GroupImpl::supports.
enum class Collective { Allreduce, Broadcast, AllGather, ReduceScatter };

/// A collective that may still be running.
class Work {
 public:
  virtual ~Work() = default;
  /// Blocks until done. Throws a c10::Error naming the collective, the rank
  /// and the timeout when it fails or times out.
  virtual void wait() = 0;
  /// Whether the backend has begun running it, rather than holding it in a
  /// queue behind others (the flight recorder's "queued"). Backends that
  /// cannot tell, c10d's among them, say true.
  virtual bool started() const {
    return true;
  }
};

/// What a backend implements: the few calls MLX calls a GroupImpl. Tensors
/// are reduced or broadcast in place; `what` names the collective in errors
/// ("allreduce of bucket 2 (5 parameters, 1.0 MiB)"). Every rank calls the
/// same collectives in the same order with tensors of the same shapes.
class GroupImpl {
 public:
  virtual ~GroupImpl() = default;
  /// This process's rank, in [0, size()).
  virtual int rank() const = 0;
  /// Number of ranks.
  virtual int size() const = 0;
  /// "gloo", "nccl", "local".
  virtual std::string backend() const = 0;
  /// How long a collective may take before it is an error.
  virtual std::chrono::milliseconds timeout() const = 0;
  /// Every rank's `tensors` reduced by `op` (Sum, Max or Min: ProcessGroup
  /// does Avg itself), in place on every rank.
  virtual std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op, std::string what) = 0;
  /// Rank `root`'s `tensors` copied into every rank's.
  virtual std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>& tensors, int root, std::string what) = 0;
  /// outputs[r] receives rank r's `input`.
  virtual std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string what) = 0;
  /// Done once every rank has called it.
  virtual std::shared_ptr<Work> barrier(std::string what) = 0;
  /// Rank r's `output` (n elements) receives every rank's
  /// input[r*n, (r+1)*n) reduced by `op` (Sum, Max or Min). Both are
  /// contiguous, of one dtype and device; input has size()*n elements and is
  /// left as it was. This default is an allreduce of a copy of `input`,
  /// twice a ring's traffic: backends that can do better override it.
  virtual std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp op, std::string what);
  /// Whether this backend can run `op` on tensors of `dtype` on `device`.
  /// ProcessGroup asks before every collective: a broadcast or all_gather
  /// of a dtype the backend cannot carry goes bit for bit as one of the same
  /// width that it can; what it cannot do at all is refused at the call.
  virtual bool supports(Collective op, torch::ScalarType dtype, torch::Device device) const {
    (void)op, (void)dtype, (void)device;
    return true;
  }
};

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
  /// "gloo", "nccl", or "local" for the group of one.
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
  /// `input` is left as it was. Each backend moves (size()-1)/size() of the
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

 private:
  std::shared_ptr<GroupImpl> impl_;
};

/// Options of init_process_group. Unset fields come from torchrun's
/// environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
struct ProcessGroupOptions {
  /// This process's rank; -1: $RANK.
  TORCH_ARG(int64_t, rank) = -1;
  /// Number of processes; -1: $WORLD_SIZE.
  TORCH_ARG(int64_t, world_size) = -1;
  /// Address of rank 0's store; "": $MASTER_ADDR.
  TORCH_ARG(std::string, master_addr) = "";
  /// Port of rank 0's store; 0: $MASTER_PORT.
  TORCH_ARG(int64_t, master_port) = 0;
  /// Timeout of the store, of connecting, and of every collective; 0:
  /// $LOCKSTEP_TIMEOUT (seconds) when set, else kDefaultTimeout.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::milliseconds(0);
  /// "gloo", "nccl", "mpi", or "auto": NCCL when the build has it and a GPU
  /// is visible, else MPI when an MPI launcher started the process, else Gloo.
  TORCH_ARG(std::string, backend) = "auto";
};

/// Creates the group: a store, then the backend's process group. World size 1
/// needs no store and no environment beyond it: it is the group of one.
/// Under mpirun, srun or mpiexec (their own variables, and no RANK), rank and
/// size come from the launcher, and the mpi backend needs no store at all.
/// Otherwise the store is, in this order of precedence:
///  - a c10d FileStore at $LOCKSTEP_STORE_FILE, when that is set and
///    options.master_addr() is empty (lockstep-run sets it on one node, so
///    that nothing listens on the network);
///  - torchrun's agent store on MASTER_PORT, when
///    $TORCHELASTIC_USE_AGENT_STORE is "True" (every rank its client, keys
///    under a prefix per restart attempt, $TORCHELASTIC_RESTART_COUNT);
///  - a c10d TCPStore that rank 0 hosts at MASTER_ADDR:MASTER_PORT.
/// The whole call is bounded by the timeout (Note [Initialisation deadline]
/// in src/process_group.cpp): past it, the process ends with an error rather
/// than hang.
ProcessGroup init_process_group(ProcessGroupOptions options = {});

/// A group over a store the caller made (c10d::HashStore for ranks as threads
/// in one process, FileStore, TCPStore).
ProcessGroup new_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const std::string& backend = "gloo",
    std::chrono::milliseconds timeout = kDefaultTimeout);

/// Whether a launcher started this process as one rank of a job: lockstep-run
/// or torchrun (WORLD_SIZE is set), or mpirun, srun or mpiexec (their own
/// variables; see Note [MPI launchers] in src/launch_env.cpp).
bool launched_by_launcher();

/// The backends this build has, e.g. {"gloo", "mpi"}.
std::vector<std::string> available_backends();

} // namespace lockstep
