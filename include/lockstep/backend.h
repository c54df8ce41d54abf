#pragma once

/// \file
/// What a backend author implements: GroupImpl, the few calls a process group
/// is made of, and the Work handle its collectives return. ProcessGroup
/// (process_group.h) wraps a GroupImpl and adds what every backend shares:
/// argument checks, Avg, the flight recorder and the agreement check. The
/// backends of this build are listed in one table (Note [Backend table] in
/// src/comm/process_group.cpp); a group of your own goes in with
/// ProcessGroup(std::make_shared<YourGroup>(...)).

#include <torch/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {

/// Default timeout of a process group's collectives and store.
constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(5)};

/// Reductions offered by ProcessGroup::allreduce. Avg of integer tensors is
/// the sum divided by size(), rounded down (floor, as Python's //), with the
/// sum taken in int64 for narrower integers, so that an average that fits
/// its type is exact; of bool tensors it is refused. Sum of bool tensors is a logical or, as Max.
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

/// What a backend implements: the few calls a process group is made of (as
/// in MLX, whose name for it this is). Tensors
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
  /// Its name: "gloo", "nccl", "mpi", "local", or your own.
  virtual std::string backend() const = 0;
  /// How long a collective may take before it is an error.
  virtual std::chrono::milliseconds timeout() const = 0;
  /// Every rank's `tensors` reduced by `op` (Sum, Max or Min; Avg only
  /// where averages() says so, as ProcessGroup does it otherwise), in place
  /// on every rank.
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
  /// Whether allreduce() takes ReduceOp::Avg of a non-empty contiguous tensor
  /// of `dtype`, float or double (ProcessGroup asks for no other), on `device`
  /// itself: the sum in rank order, then divided by size() (Tensor::div_), the
  /// same bits as ProcessGroup's own Avg (Note [Average] in
  /// src/comm/process_group.cpp), but divided in the backend's own pass over
  /// the memory, and only the part each rank reduces (Note [An average divided
  /// where it is summed] in src/comm/backends/shared_memory_collectives.cpp).
  /// This default does not.
  virtual bool averages(torch::ScalarType dtype, torch::Device device) const {
    (void)dtype, (void)device;
    return false;
  }
  /// Whether starting a collective costs little beside moving its bytes
  /// (shared memory, NCCL's kernels), rather than a network round trip and
  /// thread hops (Gloo over TCP). FullyShardedDataParallel then cuts its
  /// collectives finer, so that compute waits less for each (Note [Shard
  /// buckets]).
  virtual bool cheap_collective_starts() const {
    return false;
  }
  /// Memory that every rank of the group can reach: on each rank, one
  /// zeroed uint8 tensor of bytes[i] bytes for each i. An allreduce of
  /// exactly one of them (its whole memory, viewed as any dtype) then reduces
  /// the ranks' copies where they lie, with no copy through a staging area
  /// (Note [Buffers every rank can reach] in
  /// src/comm/backends/shared_memory_buffers.cpp). A collective: every rank
  /// calls it in the same place, with no collective of the group in flight.
  /// Empty on every rank where the backend cannot, the ranks' sizes differ,
  /// one is not positive, or there is no room; the caller then allocates as
  /// usual. This default cannot.
  virtual std::vector<torch::Tensor> shared_buffers(const std::vector<int64_t>& bytes) {
    (void)bytes;
    return {};
  }
  /// Whether a collective on `device` can only ever complete against a
  /// collective of the same kind on the other ranks: one that meets another
  /// kind moves no bytes and fails, at the timeout or, where the backend
  /// sees the other's kind, at once. Gloo's does, each kind having slots of
  /// its own (and shared memory, between ranks on one host, a header), and
  /// so does lockstep's MPI group between ranks of one host, through the same
  /// shared memory; MPI between hosts and NCCL match collectives by their
  /// order alone, and must keep false. Where true, the collectives of a bucket
  /// plan that every rank agreed on are sent without the check before each
  /// (Note [Planned collectives] in src/comm/planned_collective.cpp).
  virtual bool pairs_collectives_by_kind(torch::Device device) const {
    (void)device;
    return false;
  }
};

} // namespace lockstep
