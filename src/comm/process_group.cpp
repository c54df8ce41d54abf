#include <lockstep/process_group.h>

#include "comm/backends/backends.h"
#include "comm/backends/shared_memory_segments.h"
#include "comm/collective_args.h"
#include "comm/collective_check.h"
#include "comm/flight_recorder.h"
#include "comm/store.h"
#include "util/timeline_detail.h"
#include "util/torch_compat.h"

#include "comm/launch_env.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/cuda.h>

#include <c10/core/InferenceMode.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

namespace lockstep {
namespace detail {

namespace {

// A group of one: nothing to exchange.
class LocalGroup : public GroupImpl {
 public:
  int rank() const override {
    return 0;
  }
  int size() const override {
    return 1;
  }
  std::string backend() const override {
    return "local";
  }
  std::chrono::milliseconds timeout() const override {
    return kDefaultTimeout;
  }
  std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>&, ReduceOp, std::string) override {
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>&, int, std::string) override {
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string) override {
    TORCH_INTERNAL_ASSERT(outputs.size() == 1);
    outputs[0].copy_(input);
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<Work> barrier(std::string) override {
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp, std::string) override {
    output.copy_(input.view_as(output));
    return std::make_shared<DoneWork>();
  }
};

std::string available_list() {
  std::string list;
  for (const auto& b : available_backends()) {
    list += (list.empty() ? "" : ", ") + ("\"" + b + "\"");
  }
  return list.empty() ? "none" : list;
}

} // namespace
} // namespace detail

namespace {

// Note [Inference tensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Tensors made under c10::InferenceMode may be written in place only under
// it, and a backend writes results on a thread of its own (c10d Gloo's copy
// out of its flat buffer, the Gloo rings' sums), where the caller's mode
// does not hold: "Inplace update to inference tensor outside InferenceMode".
// So a collective whose output is an inference tensor takes a normal tensor
// of its own, made outside the mode, and wait() copies it into the output
// under the mode. all_gather's new tensors are normal tensors, which serve
// inside the mode as well.
torch::Tensor normal_empty(const torch::Tensor& like) {
  c10::InferenceMode normal_tensor(false);
  return torch::empty({like.numel()}, like.options());
}

} // namespace

std::shared_ptr<Work> GroupImpl::reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp op, std::string what) {
  std::vector<torch::Tensor> whole{input.clone()};
  auto work = allreduce(whole, op, std::move(what));
  const int64_t n = output.numel();
  return detail::then(std::move(work), [whole, output, n, r = rank()]() mutable {
    output.copy_(whole[0].view({-1}).narrow(0, r * n, n).view_as(output));
  });
}

ProcessGroup::ProcessGroup() : impl_(std::make_shared<detail::LocalGroup>()) {}

ProcessGroup::ProcessGroup(std::shared_ptr<GroupImpl> impl) {
  TORCH_CHECK(impl != nullptr, "lockstep::ProcessGroup: the group implementation is null.");
  // Every wrapper divides by size() and indexes by rank(): a group of 0
  // would divide by zero, a rank out of range read past the micro-batches.
  TORCH_CHECK(impl->size() >= 1 && impl->rank() >= 0 && impl->rank() < impl->size(), "lockstep::ProcessGroup: the ",
              impl->backend(), " group implementation says it is rank ", impl->rank(), " of ", impl->size(),
              "; a group has at least one rank, and 0 <= rank() < size(): fix its rank() and size().");
  // Note [Ranks agree before they send], then Note [Flight recorder].
  timeline::detail::note_group(impl->rank(), impl->size());
  impl_ = detail::recorded(detail::checked(std::move(impl)));
}

// Note [Average]
// ~~~~~~~~~~~~~~
// ReduceOp::Avg is a sum, then a division by the group's size once the sum is
// done, one way for every backend, so that every backend rounds the same:
// Gloo has no AVG, and MPI none. ProcessGroup divides, or, for float and
// double where GroupImpl::averages says so, the backend divides each slice
// it sums, with the same rounding (Note [An average divided where it is
// summed] in src/comm/backends/shared_memory_collectives.cpp). Integers are divided
// rounding down (floor, as Python's //): the type stays, as it does for
// every other reduction, and a sum of -1 over two ranks averages to -1, not
// 0. A bool has no average; its Sum is a logical or, its Max (as NCCL's c10d
// makes it), so that no backend adds bytes into values a bool cannot hold.
// float16 divides first (as NCCL's own average of 16-bit types does, and
// FSDP's gradient pre-division): two ranks' 40000 sum to inf in float16,
// whose largest value is 65504, and inf / 2 stays inf. bfloat16 has float32's
// range, and keeps the division after the sum. Integers narrower than
// int64 are summed in int64, where the backend has it: two ranks' 200 as
// uint8 sum to 400, which wraps, though their average, 200, fits.

std::shared_ptr<Work> ProcessGroup::allreduce_async(std::vector<torch::Tensor> tensors, ReduceOp op, std::string what) const {
  detail::check_tensor_list(*impl_, tensors, what);
  if (tensors[0].scalar_type() == torch::kBool) {
    if (op == ReduceOp::Avg) {
      detail::refuse(*impl_, what, "ReduceOp::Avg of Bool tensors has no meaning. Use Max (true where any rank has "
                     "true) or Min (true where every rank has true), or average a copy in a number type.");
    }
    op = op == ReduceOp::Sum ? ReduceOp::Max : op; // Note [Average]
  }
  const auto carrier = detail::carrier_or_refuse(*impl_, Collective::Allreduce, tensors[0], what);
  detail::CallerView caller(tensors, static_cast<int64_t>(op)); // Note [The caller's collective]
  auto packed = detail::pack(tensors, carrier);
  const bool first = detail::divides_first(tensors[0], op);
  if (first) {
    detail::divide_first(packed, size());
  } else if (detail::widens(tensors[0], op) &&
             impl_->supports(Collective::Allreduce, torch::kLong, tensors[0].device())) {
    detail::widen(packed);
  }
  std::vector<torch::Tensor> sent{packed.sent};
  // The backend divides as it sums where it can (GroupImpl::averages): a
  // float sum divided after is the same bits either way.
  const bool backend_divides = op == ReduceOp::Avg && packed.sent.numel() > 0 &&
                               averages_in_backend(packed.sent.scalar_type(), packed.sent.device());
  const bool divide_after = op == ReduceOp::Avg && !first && !backend_divides;
  auto work = impl_->allreduce(sent, op == ReduceOp::Avg && !backend_divides ? ReduceOp::Sum : op, std::move(what));
  return detail::finish_after(std::move(work), std::move(packed), divide_after ? size() : 0);
}

std::shared_ptr<Work> ProcessGroup::broadcast_async(std::vector<torch::Tensor> tensors, int root, std::string what) const {
  TORCH_CHECK(root >= 0 && root < size(), "lockstep::ProcessGroup::broadcast: root ", root, " is not a rank of a group of ",
              size(), ".");
  detail::check_tensor_list(*impl_, tensors, what);
  const auto carrier = detail::carrier_or_refuse(*impl_, Collective::Broadcast, tensors[0], what);
  detail::CallerView caller(tensors, -1);
  auto packed = detail::pack(tensors, carrier);
  std::vector<torch::Tensor> sent{packed.sent};
  auto work = impl_->broadcast(sent, root, std::move(what));
  return detail::finish_after(std::move(work), std::move(packed), 0);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_async(torch::Tensor output, torch::Tensor input, ReduceOp op,
                                                         std::string what) const {
  detail::check_flat_pair(*impl_, input, output, what);
  if (output.scalar_type() == torch::kBool) {
    if (op == ReduceOp::Avg) {
      detail::refuse(*impl_, what, "ReduceOp::Avg of Bool tensors has no meaning. Use Max or Min.");
    }
    op = op == ReduceOp::Sum ? ReduceOp::Max : op; // Note [Average]
  }
  const auto carrier = detail::carrier_or_refuse(*impl_, Collective::ReduceScatter, output, what);
  detail::CallerView caller({input}, static_cast<int64_t>(op));
  // An output inside the input (this rank's slice of it, the in-place form
  // NCCL takes) would be written while the backend still reads that slice,
  // and an inference tensor cannot be written on a backend's thread (Note
  // [Inference tensors]): the result goes to a tensor of its own, copied
  // into the output at wait().
  const bool wide =
      detail::widens(input, op) && impl_->supports(Collective::ReduceScatter, torch::kLong, input.device());
  const bool in_place = output.is_alias_of(input) || output.is_inference() || wide;
  auto target = wide ? torch::empty({output.numel()}, output.options().dtype(torch::kLong)) // copied back flat
                     : in_place ? normal_empty(output) : output;
  auto sent_out = carrier == target.scalar_type() || wide ? target : target.view(carrier);
  const bool first = detail::divides_first(input, op);
  torch::Tensor divided;
  if (first || wide) {
    torch::NoGradGuard no_grad;
    divided = wide ? input.to(torch::kLong) : input / size(); // Note [Average]; the input keeps its values
  }
  const auto& in = first || wide ? divided : input;
  auto sent_in = carrier == in.scalar_type() || wide ? in : in.view(carrier);
  auto work = impl_->reduce_scatter(sent_out, sent_in, op == ReduceOp::Avg ? ReduceOp::Sum : op, std::move(what));
  detail::Packed packed;
  packed.tensors = {output};
  packed.flat = target;
  packed.copied = in_place;
  packed.sent = sent_out;
  return detail::finish_after(std::move(work), std::move(packed), op == ReduceOp::Avg && !first ? size() : 0);
}

std::shared_ptr<Work> ProcessGroup::all_gather_into_async(torch::Tensor output, torch::Tensor input, std::string what)
    const {
  detail::check_flat_pair(*impl_, output, input, what);
  const auto carrier = detail::carrier_or_refuse(*impl_, Collective::AllGather, input, what);
  detail::CallerView caller({input}, -1);
  const int64_t n = input.numel();
  // An input inside the output anywhere but at this rank's place could be
  // overwritten by another rank's part before it is sent (Open MPI's
  // all-gather of two ranks receives first): it is sent from a copy. At its
  // own place (the in-place form) it is already where it goes.
  if (input.is_alias_of(output) &&
      !(input.is_contiguous() && input.data_ptr() == output.view({-1}).narrow(0, rank() * n, n).data_ptr())) {
    input = input.clone();
  }
  detail::Packed packed; // Note [Inference tensors]: an inference output is gathered into a tensor of its own
  packed.tensors = {output};
  packed.flat = output.is_inference() ? normal_empty(output) : output.view({-1});
  packed.copied = output.is_inference();
  auto flat = (carrier == output.scalar_type() ? packed.flat : packed.flat.view(carrier)).view({-1});
  auto sent_input = (carrier == input.scalar_type() ? input : input.view(carrier)).view({-1});
  std::vector<torch::Tensor> outputs;
  for (int r = 0; r < size(); ++r) {
    outputs.push_back(flat.narrow(0, r * n, n));
  }
  return detail::finish_after(impl_->all_gather(outputs, sent_input, std::move(what)), std::move(packed), 0);
}

void ProcessGroup::allreduce(torch::Tensor& tensor, ReduceOp op) const {
  allreduce_async({tensor}, op)->wait();
}

void ProcessGroup::broadcast(torch::Tensor& tensor, int root) const {
  broadcast_async({tensor}, root)->wait();
}

std::vector<torch::Tensor> ProcessGroup::all_gather(const torch::Tensor& tensor) const {
  const std::string what = "all_gather";
  detail::check_tensor_list(*impl_, {tensor}, what);
  const auto carrier = detail::carrier_or_refuse(*impl_, Collective::AllGather, tensor, what);
  c10::InferenceMode normal_tensors(false); // Note [Inference tensors]
  std::vector<torch::Tensor> outputs;
  std::vector<torch::Tensor> sent;
  for (int r = 0; r < size(); ++r) {
    outputs.push_back(torch::empty_like(tensor, torch::MemoryFormat::Contiguous));
    sent.push_back(carrier == tensor.scalar_type() ? outputs.back() : outputs.back().view(carrier));
  }
  auto input = tensor.contiguous();
  auto sent_input = carrier == input.scalar_type() ? input : input.view(carrier);
  detail::CallerView caller({tensor}, -1);
  impl_->all_gather(sent, sent_input, what)->wait();
  return outputs;
}

void ProcessGroup::barrier() const {
  impl_->barrier("barrier")->wait();
}

bool ProcessGroup::supports(Collective op, torch::ScalarType dtype, torch::Device device) const {
  return detail::carrier_of(*impl_, op, dtype, device) != torch::ScalarType::Undefined;
}

bool ProcessGroup::averages_in_backend(torch::ScalarType dtype, torch::Device device) const {
  // Float and double only: a planned collective's words, and DDP's flag, go
  // in times the group's size, which only they give back exactly.
  return (dtype == torch::kFloat || dtype == torch::kDouble) && impl_->averages(dtype, device);
}

bool ProcessGroup::cheap_collective_starts() const {
  return impl_->cheap_collective_starts();
}

std::vector<torch::Tensor> ProcessGroup::shared_buffers(const std::vector<int64_t>& bytes) const {
  return impl_->shared_buffers(bytes); // a collective: every rank goes in, whatever its sizes
}

bool launched_by_launcher() {
  auto get = [](const char* name) { return std::getenv(name); };
  return get("WORLD_SIZE") != nullptr || detail::find_mpi_launcher(get) != nullptr;
}

int64_t launched_local_rank() {
  return detail::local_rank_of([](const char* name) { return std::getenv(name); });
}

namespace {

// Note [Backend table]
// ~~~~~~~~~~~~~~~~~~~~
// Every backend lockstep knows: its name, whether this build has it
// (src/comm/backends/<name>.cpp or no_<name>.cpp), whether it needs
// init_process_group's store (MPI's launcher connects the ranks itself),
// when and how eagerly "auto" picks it, and how to make it. The rest of this
// file asks the table, never a backend's name.
struct BackendArgs {
  c10::intrusive_ptr<c10d::Store> store; // none for a backend that needs none
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout = kDefaultTimeout;
  std::string master_addr;
  int master_port = 0;
};

struct Backend {
  const char* name;
  bool (*available)();
  bool needs_store;
  int auto_order; // "auto" asks the backends in this order, lowest first
  bool (*auto_picks)(bool mpi_launched);
  std::shared_ptr<GroupImpl> (*make)(const BackendArgs& a);
};

const std::vector<Backend>& backend_table() {
  static const std::vector<Backend> table{
      {"gloo", detail::gloo_available, true, 2, [](bool) { return true; },
       [](const BackendArgs& a) {
         return detail::make_gloo_group(a.store, a.rank, a.size, a.timeout, a.master_addr, a.master_port);
       }},
      {"nccl", detail::nccl_available, true, 0, [](bool) { return torch::cuda::is_available(); },
       [](const BackendArgs& a) { return detail::make_nccl_group(a.store, a.rank, a.size, a.timeout); }},
      {"mpi", detail::mpi_available, false, 1, [](bool mpi_launched) { return mpi_launched; },
       [](const BackendArgs& a) { return detail::make_mpi_group(a.rank, a.size, a.timeout); }},
  };
  return table;
}

// `name`, or for "auto" the first available backend that picks itself
// (NCCL with a GPU, MPI under an MPI launcher, else Gloo); an error listing
// what this build has otherwise.
const Backend& find_backend(const std::string& name, bool mpi_launched) {
  const Backend* found = nullptr;
  for (const auto& b : backend_table()) {
    const bool fits = name == "auto" ? b.auto_picks(mpi_launched) : name == b.name;
    if (b.available() && fits && (found == nullptr || b.auto_order < found->auto_order)) {
      found = &b;
    }
  }
  TORCH_CHECK(found != nullptr, "lockstep: backend \"", name, "\" is not available in this build; available: ",
              detail::available_list(), ", or \"auto\".");
  return *found;
}

} // namespace

std::vector<std::string> available_backends() {
  std::vector<std::string> names;
  for (const auto& b : backend_table()) {
    if (b.available()) {
      names.push_back(b.name);
    }
  }
  return names;
}

namespace {

// Note [Initialisation deadline]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Joining a group (init_process_group, new_group) is several waits, each
// with the group's timeout: the store's connection, the backend's rendezvous
// keys, its connections; over MPI, MPI_Comm_dup, which has no timeout at
// all. When the rank it waits for died partway through, or never joins, the
// waits add up, and some versions of the store client and of Gloo do not
// give up at all. A rank must never outlive the timeout, so a watchdog
// thread bounds the whole join: past the timeout (plus a moment for the
// waits' own, more precise errors), it says so and ends the process, as
// NCCL's watchdog does; a thread blocked inside c10d or MPI cannot be
// interrupted any other way.
class InitDeadline {
 public:
  // `longer` says how to give the join more time.
  InitDeadline(const char* what, int64_t rank, std::chrono::milliseconds timeout, const char* longer)
      : thread_([this, what, rank, timeout, longer] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!done_changed_.wait_for(lock, timeout + kMargin, [this] { return done_; })) {
            std::fprintf(stderr,
                         "lockstep: rank %lld: %s did not complete within the timeout of %lld ms "
                         "(+%lld ms); ending this process so that it does not hang. Another rank failed, never "
                         "started or never joined: its own error says why. %s\n",
                         static_cast<long long>(rank), what, static_cast<long long>(timeout.count()),
                         static_cast<long long>(kMargin.count()), longer);
            std::fflush(stderr);
            detail::unlink_joining_segments(); // Note [Segments of a group that is joining]
            std::_Exit(1);
          }
        }) {}
  ~InitDeadline() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    done_changed_.notify_all();
    thread_.join();
  }

 private:
  static constexpr std::chrono::milliseconds kMargin{2000};
  std::mutex mutex_;
  std::condition_variable done_changed_;
  bool done_ = false;
  std::thread thread_; // last: started once the rest exists
};

// Note [One store, several groups]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// c10d's Gloo and NCCL groups, and Gloo's endpoint check here, publish their
// rendezvous under fixed keys (each rank's address as "0", "1", ...). A
// second group over the store of a first (a group made again after a
// failure, as the errors advise; init_process_group again over the
// launcher's store file) read the first one's addresses and connected to
// listeners that were gone: an error, or a hang until the timeout, by
// timing. As Python's torch.distributed prefixes each group's keys with its
// name, each group here takes the next number of its rank's own count on
// the store: ranks that make their groups in the same order, as they must,
// agree on it.
c10::intrusive_ptr<c10d::Store> store_of_next_group(const c10::intrusive_ptr<c10d::Store>& store, int rank) {
  const int64_t number = store->add("lockstep/groups_of_rank_" + std::to_string(rank), 1);
  return c10::make_intrusive<c10d::PrefixStore>("lockstep/group_" + std::to_string(number), store);
}

// The TCPStore under any PrefixStores (a program's own prefix per job or
// group): it still says where the job lives.
const c10d::TCPStore* tcp_store_under(c10::intrusive_ptr<c10d::Store> store) {
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get())) {
    store = prefixed->getUnderlyingStore();
  }
  return dynamic_cast<const c10d::TCPStore*>(store.get()); // kept alive by the caller's store
}

// The backend's group. A wait for the other ranks that ran out, or a peer's
// connection that broke, is said as such, naming the rank and what to do:
// c10d's store says only "Wait timeout", and Gloo throws its own IoException.
// Other errors (a wrong GLOO_SOCKET_IFNAME, a CUDA error) pass unchanged.
std::shared_ptr<GroupImpl> join(const Backend& backend, const BackendArgs& args, const std::string& longer) {
  const auto about_peers = [](const std::string& cause) {
    for (const char* word : {"imeout", "timed out", "Connection", "connection"}) {
      if (cause.find(word) != std::string::npos) {
        return true;
      }
    }
    return false;
  };
  std::string cause;
  try {
    return backend.make(args);
  } catch (const c10::Error& e) {
    cause = e.what_without_backtrace();
    if (cause.rfind("lockstep", 0) == 0 || !about_peers(cause)) {
      throw; // ours name the rank and the fix already; the rest are not about the other ranks
    }
  } catch (const std::exception& e) {
    cause = e.what();
    if (!about_peers(cause)) {
      throw;
    }
  }
  TORCH_CHECK(false, "lockstep: rank ", args.rank, " of ", args.size, ": joining the ", backend.name, " group failed "
              "or did not complete within the timeout of ", args.timeout.count(), " ms: another rank failed, never "
              "started or started too late; its own error says why. ", longer, " Cause: ", cause);
}

} // namespace

ProcessGroup new_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const std::string& backend,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "lockstep::new_group: rank ", rank, " is out of range for size ",
              size, ".");
  detail::check_timeout(timeout, "new_group's timeout");
  const Backend& chosen = find_backend(backend, false);
  TORCH_CHECK(store || !chosen.needs_store, "lockstep::new_group: the store is null, and the ", chosen.name,
              " backend meets through one; pass the store the ranks share (a c10d::TCPStore, FileStore or HashStore).");
  // A TCPStore says where the job lives, also under a PrefixStore: Gloo
  // binds toward its host, as under init_process_group, so that ranks on
  // other machines reach it. Any other store (HashStore, FileStore) is one
  // machine's: loopback.
  BackendArgs args{store, rank, size, timeout, "127.0.0.1", 0};
  if (const auto* tcp = tcp_store_under(store)) {
    args.master_addr = tcp->getHost();
    args.master_port = tcp->getPort();
  }
  // Note [Initialisation deadline]
  InitDeadline deadline("new_group", rank, timeout, "Pass new_group a longer timeout to wait longer.");
  if (chosen.needs_store) {
    args.store = store_of_next_group(store, rank);
  }
  return ProcessGroup(join(chosen, args, "Pass new_group a longer timeout to wait longer."));
}

ProcessGroup init_process_group(ProcessGroupOptions options) {
  const auto env = detail::parse_launch_env(options, [](const char* name) { return std::getenv(name); });
  const Backend& backend = find_backend(options.backend(), env.mpi_launcher != nullptr);
  if (env.world_size == 1) {
    return ProcessGroup();
  }
  detail::set_process_rank(static_cast<int>(env.rank));
  // Note [Initialisation deadline]
  const char* longer = options.timeout().count() > 0 ? "Pass a longer ProcessGroupOptions::timeout to wait longer."
                                                     : "Set LOCKSTEP_TIMEOUT (seconds) for a longer wait.";
  InitDeadline deadline("init_process_group", env.rank, env.timeout, longer);
  BackendArgs args{{}, static_cast<int>(env.rank), static_cast<int>(env.world_size), env.timeout, env.master_addr,
                   static_cast<int>(env.master_port)};
  if (backend.needs_store) {
    TORCH_CHECK(env.mpi_launcher == nullptr || (!env.master_addr.empty() && env.master_port > 0), "lockstep: rank ",
                env.rank, ": started by ", env.mpi_launcher, ", the ", backend.name, " backend needs a store, and ",
                env.master_addr.empty() ? "MASTER_ADDR" : "MASTER_PORT", " is not set: set MASTER_ADDR and MASTER_PORT "
                "for every rank (mpirun -x MASTER_ADDR=host -x MASTER_PORT=port), or use the mpi backend (\"auto\" "
                "picks it).");
    args.store = store_of_next_group(detail::make_store(env, options), args.rank);
  }
  return ProcessGroup(join(backend, args, longer));
}

} // namespace lockstep
