#pragma once

// Process groups for lockstep: a small interface (GroupImpl) behind a
// copyable handle (ProcessGroup), with c10d's Gloo and NCCL process groups as
// backends and a size-1 local group that makes world size 1 free.
// Which backends exist is decided by the build (src/backend_*.cpp or
// src/no_*.cpp), never by #ifdefs here.

#include <torch/arg.h>
#include <torch/types.h>

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep {

/// Default timeout of a process group's collectives and store.
constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(5)};

/// Reductions offered by ProcessGroup::allreduce.
enum class ReduceOp { Sum, Avg, Max, Min };

/// A collective that may still be running.
class Work {
 public:
  virtual ~Work() = default;
  /// Blocks until done. Throws a c10::Error naming the collective, the rank
  /// and the timeout when it fails or times out.
  virtual void wait() = 0;
};

/// What a backend implements. Tensors are reduced or broadcast in place.
class GroupImpl {
 public:
  virtual ~GroupImpl() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  /// Sum of every rank's `tensors`, in place. `what` names it in errors.
  virtual std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op, std::string what) = 0;
  virtual std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>& tensors, int root, std::string what) = 0;
  /// outputs[r] receives rank r's `input`.
  virtual std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string what) = 0;
  virtual std::shared_ptr<Work> barrier(std::string what) = 0;
};

/// A process group: which rank this process is among how many, and the
/// collectives between them. Cheap to copy; copies share the group.
class ProcessGroup {
 public:
  /// A group of one: every collective returns at once.
  ProcessGroup();
  explicit ProcessGroup(std::shared_ptr<GroupImpl> impl);

  /// Wraps a c10d process group the caller made: a c10d::ProcessGroupGloo or
  /// ProcessGroupNCCL over their own store (a c10d::Backend in PyTorch 2.x, a
  /// c10d::ProcessGroup in 1.13), or a c10d::ProcessGroup. Any c10d type with
  /// c10d's allreduce, broadcast, allgather and barrier will do.
  template <typename C10dType>
  static ProcessGroup from_c10d(c10::intrusive_ptr<C10dType> group);

  int rank() const {
    return impl_->rank();
  }
  int size() const {
    return impl_->size();
  }
  std::string backend() const {
    return impl_->backend();
  }
  std::chrono::milliseconds timeout() const {
    return impl_->timeout();
  }
  GroupImpl& impl() const {
    return *impl_;
  }

  /// Reduces `tensor` over all ranks, in place. Avg is a sum then a division
  /// (Gloo has no AVG).
  void allreduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) const;
  /// Copies root's `tensor` into every rank's.
  void broadcast(torch::Tensor& tensor, int root = 0) const;
  /// Every rank's `tensor`, in rank order. Shapes must match on all ranks.
  std::vector<torch::Tensor> all_gather(const torch::Tensor& tensor) const;
  /// Returns once every rank has called it.
  void barrier() const;

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
  /// "gloo", "nccl", or "auto": NCCL when the build has it and a GPU is
  /// visible, else Gloo.
  TORCH_ARG(std::string, backend) = "auto";
};

/// Creates the group: a c10d TCPStore (rank 0 hosts it) and the backend's
/// process group. World size 1 needs no store and no environment beyond it.
ProcessGroup init_process_group(ProcessGroupOptions options = {});

/// A group over a store the caller made (c10d::HashStore for ranks as threads
/// in one process, FileStore, TCPStore).
ProcessGroup new_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const std::string& backend = "gloo",
    std::chrono::milliseconds timeout = kDefaultTimeout);

/// The backends this build has, e.g. {"gloo"}.
std::vector<std::string> available_backends();

namespace detail {

/// torchrun's variables, parsed. A variable that is unset or malformed is a
/// c10::Error naming it and the expected form.
struct LaunchEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  int64_t local_world_size = 1;
  std::string master_addr;
  int64_t master_port = 0;
  /// torchrun's agent already hosts the store on MASTER_PORT
  /// (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects as a client.
  bool agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT: which attempt of the job this is.
  int64_t restart_count = 0;
  /// The options' timeout, else LOCKSTEP_TIMEOUT's, else kDefaultTimeout.
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

/// `get` looks a variable up (nullptr: unset). Only what `options` leaves
/// unset is read; world size 1 needs neither address nor port.
LaunchEnv parse_launch_env(const ProcessGroupOptions& options, const std::function<const char*(const char*)>& get);

/// Parses a whole decimal number in [low, high]; `name` and `form` word the error.
int64_t parse_int(const std::string& name, const char* value, int64_t low, int64_t high, const char* form);

} // namespace detail
} // namespace lockstep

// ProcessGroup::from_c10d's definition: it needs c10d's types.
#include <lockstep/detail/c10d_group.h>
