// Compiled when LibTorch has c10d's Gloo process group; no_gloo.cpp otherwise.

#include "comm/backends/backends.h"
#include "comm/backends/gloo_rings.h"
#include "comm/backends/shared_memory_collectives.h"
#include "comm/planned_collective.h"
#include "util/caller_stream.h"
#include "util/torch_compat.h"

#include <common/sockets.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <functional>
#include <cstdlib>
#include <sstream>
#include <utility>
#include <vector>

namespace lockstep {
namespace detail {
namespace {

// Note [Gloo's address]
// ~~~~~~~~~~~~~~~~~~~~~
// Each Gloo rank listens on one address and publishes it in the store; the
// others connect to it. Without GLOO_SOCKET_IFNAME, c10d takes the first
// address of the machine's host name that it can bind, and Debian maps the
// host name to 127.0.1.1 (or 127.0.0.1) in /etc/hosts. On one machine that
// works; across machines the other ranks connect to their own loopback, so
// one rank dies with "Connection refused" while another waits for it.
// Before connecting, every rank therefore publishes the address it will
// listen on and whether MASTER_ADDR is an address of its own machine; if a
// rank listens on loopback while some rank is on another machine, all of
// them fail together, saying what to set.

std::string to_text(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = "?";
  const void* raw = address->sa_family == AF_INET6
      ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr)
      : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(address)->sin_addr);
  ::inet_ntop(address->sa_family, raw, text, sizeof(text));
  return text;
}

struct Endpoint {
  std::string address; // where this rank's Gloo listens
  bool loopback = false;
  bool master_is_local = false; // MASTER_ADDR is an address of this machine
};

// The first of `host`'s addresses that this machine can bind, as c10d and
// Gloo choose it; found = false if none.
bool first_bindable(const std::string& host, Endpoint& endpoint) {
  const auto addresses = resolve_tcp(host, 0);
  const Bound bound = bind_first(addresses, /*listen=*/false, /*reuse_address=*/false);
  if (bound.fd < 0) {
    return false;
  }
  endpoint.address = to_text(bound.address->ai_addr);
  endpoint.loopback = is_loopback(bound.address->ai_addr);
  ::close(bound.fd);
  return true;
}

// What Gloo will listen on, found the way c10d finds it for `ifname`, or
// for this machine's host name.
Endpoint local_endpoint(const char* ifname, const std::string& master_addr) {
  Endpoint endpoint;
  Endpoint master;
  endpoint.master_is_local = first_bindable(master_addr, master);
  if (ifname != nullptr) {
    ifaddrs* all = nullptr;
    if (::getifaddrs(&all) == 0) {
      for (const ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
        if (i->ifa_addr != nullptr && (i->ifa_addr->sa_family == AF_INET || i->ifa_addr->sa_family == AF_INET6) &&
            ifname == std::string(i->ifa_name)) {
          endpoint.address = to_text(i->ifa_addr);
          endpoint.loopback = is_loopback(i->ifa_addr);
          break;
        }
      }
      ::freeifaddrs(all);
    }
    return endpoint;
  }
  char hostname[HOST_NAME_MAX + 1] = {};
  ::gethostname(hostname, sizeof(hostname) - 1);
  if (!first_bindable(hostname, endpoint)) {
    endpoint.address = "127.0.0.1"; // c10d's fallback
    endpoint.loopback = true;
  }
  return endpoint;
}

std::string key_of(int rank) {
  return "lockstep/gloo_endpoint/" + std::to_string(rank);
}

// Note [Naming the lost peer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When a collective fails across machines, Gloo says only that data stopped
// coming ("Timed out waiting 10000ms for recv operation", "pair closure"),
// not from whom, and every rank's error would read alike whether a peer
// crashed or the cable was pulled. So on a failed collective each rank knocks
// on every other machine of the job: a TCP connection attempt to its Gloo
// address at MASTER_PORT, all at once, for at most kProbeTimeout. Any answer,
// a refusal included, means that machine and the network to it are up;
// silence means one of them is down, and the error names those ranks and
// addresses. This runs only on the error path, and only for jobs that span
// machines (their ranks published their addresses; see Note [Gloo's address]).
constexpr auto kProbeTimeout = std::chrono::seconds(2);

// Whether something at `address`:`port` answers a connection attempt, a
// refusal included, within the deadline. Several at once: one socket each.
std::vector<bool> answers(const std::vector<std::string>& addresses, int port) {
  std::vector<bool> answered(addresses.size(), false);
  std::vector<int> fds(addresses.size(), -1);
  for (size_t i = 0; i < addresses.size(); ++i) {
    const auto resolved = resolve_tcp(addresses[i], port, AI_NUMERICHOST | AI_NUMERICSERV);
    const addrinfo* found = resolved.first();
    if (found == nullptr) {
      continue;
    }
    const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
      const int rc = ::connect(fd, found->ai_addr, found->ai_addrlen);
      if (rc == 0 || errno == ECONNREFUSED) {
        answered[i] = true;
        ::close(fd);
      } else if (errno == EINPROGRESS) {
        fds[i] = fd;
      } else {
        ::close(fd); // no route: this machine's end of the link is down
      }
    }
  }
  const auto until = std::chrono::steady_clock::now() + kProbeTimeout;
  for (;;) {
    std::vector<pollfd> waiting;
    std::vector<size_t> which;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i] >= 0) {
        waiting.push_back({fds[i], POLLOUT, 0});
        which.push_back(i);
      }
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (waiting.empty() || left.count() <= 0) {
      break;
    }
    if (::poll(waiting.data(), waiting.size(), static_cast<int>(left.count())) <= 0) {
      continue; // EINTR, or the deadline: the loop checks it
    }
    for (size_t k = 0; k < waiting.size(); ++k) {
      if (waiting[k].revents == 0) {
        continue;
      }
      const size_t i = which[k];
      int error = 0;
      socklen_t length = sizeof(error);
      ::getsockopt(fds[i], SOL_SOCKET, SO_ERROR, &error, &length);
      answered[i] = error == 0 || error == ECONNREFUSED;
      ::close(fds[i]);
      fds[i] = -1;
    }
  }
  for (int fd : fds) {
    if (fd >= 0) {
      ::close(fd);
    }
  }
  return answered;
}

// The text Note [Naming the lost peer] adds to a failed collective's error.
std::string probe_peers(const std::vector<Endpoint>& all, int rank, int port) {
  std::vector<std::string> addresses; // the other machines, once each
  std::vector<std::vector<int>> ranks_at;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r].address == all[rank].address) {
      continue;
    }
    const auto it = std::find(addresses.begin(), addresses.end(), all[r].address);
    if (it == addresses.end()) {
      addresses.push_back(all[r].address);
      ranks_at.push_back({r});
    } else {
      ranks_at[it - addresses.begin()].push_back(r);
    }
  }
  if (addresses.empty()) {
    return "";
  }
  const auto answered = answers(addresses, port);
  std::string lost; // "rank 1 at 10.0.0.2; ranks 2, 3 at 10.0.0.3"
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (!answered[i]) {
      lost += (lost.empty() ? "" : "; ") + std::string(ranks_at[i].size() == 1 ? "rank " : "ranks ");
      for (size_t k = 0; k < ranks_at[i].size(); ++k) {
        lost += (k > 0 ? ", " : "") + std::to_string(ranks_at[i][k]);
      }
      lost += " at " + addresses[i];
    }
  }
  const std::string waited = std::to_string(kProbeTimeout.count()) + " s";
  if (lost.empty()) {
    return "Every other machine of the job answered a connection attempt within " + waited +
        ", so the network is up: a rank stopped, crashed or is stuck.";
  }
  return "Lost peer: no answer within " + waited + " from " + lost + ": that machine, or the network between it and " +
      "this one (" + all[rank].address + "), is down.";
}

std::vector<Endpoint> check_endpoints_reachable(
    c10d::Store& store,
    int rank,
    int size,
    const Endpoint& mine,
    const char* ifname,
    const std::string& master_addr,
    std::chrono::milliseconds timeout) {
  std::ostringstream text;
  text << mine.loopback << ' ' << mine.master_is_local << ' ' << mine.address;
  const std::string value = text.str();
  store.set(key_of(rank), std::vector<uint8_t>(value.begin(), value.end()));
  std::vector<Endpoint> all(size);
  int remote = -1; // a rank whose machine is not MASTER_ADDR's
  int on_loopback = -1;
  for (int r = 0; r < size; ++r) {
    const auto bytes = store.get(key_of(r));
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    in >> all[r].loopback >> all[r].master_is_local >> all[r].address;
    if (!all[r].master_is_local && remote < 0) {
      remote = r;
    }
    if (all[r].loopback && on_loopback < 0) {
      on_loopback = r;
    }
  }
  if (on_loopback >= 0 && remote >= 0) {
    // Every rank reaches this verdict from the same endpoints. Each leaves
    // only once all have read them (or the timeout passed): the store may
    // live in a process that this error ends (rank 0's, or its launcher), and
    // a rank still reading would see only a closed connection.
    const std::string read_key = "lockstep/gloo_endpoints_read";
    const auto until = std::chrono::steady_clock::now() + timeout;
    try {
      store.add(read_key, 1);
      while (store.add(read_key, 0) < size && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } catch (const std::exception&) {
      // The store is gone: nobody is left to wait for.
    }
  }
  TORCH_CHECK(
      on_loopback < 0 || remote < 0, "lockstep: rank ", rank, ": rank ", on_loopback,
      "'s Gloo would listen on the loopback address ", all[on_loopback].address,
      ifname != nullptr ? std::string(" of GLOO_SOCKET_IFNAME=") + ifname
                        : std::string(", its host name's address (see /etc/hosts),"),
      " but rank ", remote, " runs on another machine than MASTER_ADDR ", master_addr,
      " and could not reach it. Set GLOO_SOCKET_IFNAME to the network interface that connects the machines (for "
      "example GLOO_SOCKET_IFNAME=eth0, the same name on every machine; 'ip -brief address' lists them), or map the "
      "host name to a routable address.");
  return all;
}

// Note [Every rank has connected]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// c10d's Gloo group connects each pair of ranks in its constructor
// (connectFullMesh), and a pair's two ends do not finish together: the end
// that connects is done once the kernel completes the TCP handshake, while
// the listening end still waits for its loop thread to accept, and its own
// thread to see the pair connected. A peer that closes the pair in between
// makes that wait throw "Connection closed by peer" out of the constructor.
// So a rank that made its group and dropped it at once (no collective, or
// only ones refused before anything was sent) would fail another rank's
// join, although both did everything right. Each rank therefore leaves the join
// through a Gloo barrier, which no rank passes before every rank has entered
// it, that is, has returned from connectFullMesh: no rank closes a pair that
// another is still connecting. A pair sends only once its receiver has said
// it is ready (Note [Receive before sending]), so each of the barrier's
// messages arrives before its sender can leave and close; a close afterwards
// fails only a later call on that pair, as a peer that is gone must. (Over
// the store instead, a rank could still wait on it when the rank whose
// process holds it returns and ends.)

// c10d's Gloo group, with the dtypes its type switch has: Gloo copies and
// adds through one C++ type per dtype, and has none for the others (Short,
// complex types; BFloat16 and Bool before PyTorch 2.2).
class GlooGroup final : public C10dGroup<c10d::ProcessGroupGloo>, public CarriesPlanWords {
 public:
  GlooGroup(c10::intrusive_ptr<c10d::ProcessGroupGloo> group, std::chrono::milliseconds timeout, Diagnose diagnose,
            std::unique_ptr<SharedMemoryCollectives> shm, std::chrono::microseconds spin)
      : C10dGroup(std::move(group), "gloo", timeout, std::move(diagnose)), shm_(std::move(shm)) {
    spin_before_waits(spin); // Note [Polling before a wait]
  }
  ~GlooGroup() override {
    if (shm_) {
      shm_->stop(); // the ring thread, joined below, may wait in one
    }
  }
  // Note [Collectives through shared memory], where every rank is on this
  // host; c10d's Gloo allreduce otherwise. Either pairs only with allreduces.
  std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op, std::string what) override {
    if (!shm_ || tensors.size() != 1 || !SharedMemoryCollectives::fits(tensors[0], op)) {
      return C10dGroup::allreduce(tensors, op, std::move(what));
    }
    return on_ring_thread([shm = shm_.get(), tensor = tensors[0], op] { shm->allreduce(tensor, op); }, std::move(what));
  }
  // Note [Buffers every rank can reach], made on the ring thread, among the
  // collectives.
  std::vector<torch::Tensor> shared_buffers(const std::vector<int64_t>& bytes) override {
    if (!shm_) {
      return {};
    }
    auto made = std::make_shared<std::vector<torch::Tensor>>();
    on_ring_thread([shm = shm_.get(), bytes, made] { *made = shm->share(bytes); },
                   "the allocation of buffers in shared memory")->wait();
    return *made;
  }
  std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>& tensors, int root, std::string what) override {
    if (!shm_ || tensors.size() != 1 || !SharedMemoryCollectives::fits(tensors[0])) {
      return C10dGroup::broadcast(tensors, root, std::move(what));
    }
    return on_ring_thread([shm = shm_.get(), tensor = tensors[0], root] { shm->broadcast(tensor, root); },
                          std::move(what));
  }
  // An allreduce is c10d's, on Gloo's allreduce slots: it pairs only with
  // allreduces. Lockstep's rings (all-gathers and reduce-scatters) use
  // send and receive slots of their own. Through shared memory, every
  // collective's header says its kind, and one that meets another kind
  // fails. CUDA tensors go through c10d's staging copies, which this has not
  // been shown for, so they keep the check.
  bool pairs_collectives_by_kind(torch::Device device) const override {
    return device.is_cpu();
  }
  bool averages(torch::ScalarType dtype, torch::Device device) const override {
    return SharedMemoryCollectives::averages(shm_.get(), dtype, device);
  }
  bool supports(Collective, torch::ScalarType dtype, torch::Device device) const override {
    if (!device.is_cpu() && !device.is_cuda()) {
      return false;
    }
    switch (dtype) {
      case torch::kFloat:
      case torch::kDouble:
      case torch::kHalf:
      case torch::kChar:
      case torch::kByte:
      case torch::kInt:
      case torch::kLong:
        return true;
      case torch::kBFloat16:
      case torch::kBool:
        return kGlooCarriesBFloat16AndBool;
      default:
        return false;
    }
  }
  // Note [Gloo's reduce-scatter]; CPU tensors only, as Gloo's send takes.
  std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string what) override {
    // Small gathers (the agreement check's fingerprints) go through shared
    // memory where the ranks share a host, else c10d's: the ring's thread hop
    // would cost more than the copy saves.
    constexpr int64_t kRingBytes = 256 * 1024;
    const bool small = input.numel() * input.element_size() < kRingBytes;
    if (!ring_fits(outputs, input) || (small && !(shm_ && SharedMemoryCollectives::fits(input)))) {
      return C10dGroup::all_gather(outputs, input, std::move(what));
    }
    return ring_all_gather_work(outputs, input, std::move(what), {});
  }
  // Note [Gloo's reduce-scatter].
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp op, std::string what)
      override {
    return planned_reduce_scatter(output, input, op, std::move(what), {});
  }
  // Note [Planned rings]: the rings carry them, on the CPU, as they run there.
  bool carries_plan_words(torch::Device device) const override {
    return device.is_cpu();
  }
  std::shared_ptr<Work> planned_all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string what,
                                           torch::Tensor words) override {
    TORCH_INTERNAL_ASSERT(ring_fits(outputs, input), "a planned all-gather that the ring cannot run");
    return ring_all_gather_work(outputs, input, std::move(what), std::move(words));
  }
  std::shared_ptr<Work> planned_reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp op, std::string what,
                                               torch::Tensor words) override {
    if (output.numel() == 0 || size() == 1) {
      TORCH_INTERNAL_ASSERT(!words.defined(), "a planned reduce-scatter that sends nothing");
      output.copy_(input.view_as(output));
      return std::make_shared<DoneWork>();
    }
    if (shm_ && SharedMemoryCollectives::fits(input, op) && SharedMemoryCollectives::fits(output, op)) {
      return on_ring_thread([shm = shm_.get(), output, input, op, words] { shm->reduce_scatter(output, input, op, words); },
                            std::move(what));
    }
    const int first_tag = next_tags();
    const auto stream = caller_stream(input.device());
    return on_ring_thread([group = &c10d_group(), output, input, op, first_tag, stream, words] {
      c10::OptionalStreamGuard on(stream); // Note [The caller's stream]: the copies to and from the device
      ring_reduce_scatter(*group, output, input, op, first_tag, words);
    }, std::move(what));
  }

 private:
  // Whether the all-gather ring can run it: CPU tensors, one contiguous
  // output per rank of the input's size and dtype.
  bool ring_fits(const std::vector<torch::Tensor>& outputs, const torch::Tensor& input) const {
    bool fits = input.device().is_cpu() && input.is_contiguous() && static_cast<int>(outputs.size()) == size();
    for (const auto& out : outputs) {
      fits = fits && out.device().is_cpu() && out.is_contiguous() && out.numel() == input.numel() &&
          out.scalar_type() == input.scalar_type();
    }
    return fits;
  }
  // Through shared memory where it can (Note [Collectives through shared memory]).
  std::shared_ptr<Work> ring_all_gather_work(std::vector<torch::Tensor>& outputs, torch::Tensor& input,
                                             std::string what, torch::Tensor words) {
    if (shm_ && SharedMemoryCollectives::fits(input)) {
      return on_ring_thread([shm = shm_.get(), outputs, input, words] { shm->all_gather(outputs, input, words); },
                            std::move(what));
    }
    const int first_tag = next_tags();
    return on_ring_thread([group = &c10d_group(), outputs, input, first_tag, words] {
      ring_all_gather(*group, outputs, input, first_tag, words);
    }, std::move(what));
  }
  // Runs `collective` after the ones before it on the group's own thread.
  std::shared_ptr<Work> on_ring_thread(std::function<void()> collective, std::string what) {
    auto done = ring_.run(timed_where_it_runs(std::move(collective), what));
    return std::make_shared<RingWork>(std::move(done), std::move(what), rank(), size(), timeout(), diagnose(),
                                      spin_before_waits());
  }
  // The first of the next ring's tags_per_ring().
  int next_tags() {
    constexpr int64_t kRingTags = 1 << 20; // tags stay positive and apart from the rings before
    return static_cast<int>((rings_++ * tags_per_ring(size())) % kRingTags);
  }

  int64_t rings_ = 0;
  std::unique_ptr<SharedMemoryCollectives> shm_;
  RingThread ring_; // after shm_: its thread, which uses shm_, ends first
};

} // namespace

bool gloo_available() {
  return true;
}

std::shared_ptr<GroupImpl> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& master_addr,
    int master_port) {
  const auto spin = wait_spin("LOCKSTEP_GLOO_SPIN_US", "a Gloo collective"); // fails before any rank connects
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // GLOO_SOCKET_IFNAME picks the interface, as for PyTorch. Otherwise a job
  // whose store is on loopback stays on loopback; on several machines, the
  // store's address is node 0's, so each rank binds to its own machine's
  // default address instead (its hostname's, as PyTorch does).
  const bool loopback = master_addr == "localhost" || master_addr == "::1" || master_addr.rfind("127.", 0) == 0;
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && *ifname == '\0') {
    ifname = nullptr;
  }
  Diagnose diagnose;
  if (!loopback) {
    auto all = check_endpoints_reachable(*store, rank, size, local_endpoint(ifname, master_addr), ifname, master_addr, timeout);
    diagnose = std::make_shared<const std::function<std::string()>>(
        [all = std::move(all), rank, master_port] { return probe_peers(all, rank, master_port); });
  }
  if (ifname != nullptr) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (loopback) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  options->threads = 2;
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  if (size > 1) {
    group->barrier()->wait(); // Note [Every rank has connected]
  }
  auto shm = SharedMemoryCollectives::connect(*store, rank, size, timeout);
  // LibTorch 1.x's ProcessGroupGloo is a c10d::ProcessGroup, 2.x's a c10d::Backend:
  // C10dGroup takes either.
  return std::make_shared<GlooGroup>(std::move(group), timeout, std::move(diagnose), std::move(shm), spin);
}

} // namespace detail
} // namespace lockstep
