// Two hosts on this machine (network namespaces joined by a veth pair):
// Gloo's address, what listens where, a cut link and a resume across them.

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/launch.h"
#include "support/processes.h"

#include <examples/checkpoint.h>
#include <examples/idx.h>
#include <examples/models.h>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <zlib.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

// Two machines on this one: two network namespaces joined by a veth pair
// whose ends are both called lsnet0 (10.77.0.1 and .2). Each has its own
// loopback, and the host name resolves to a loopback address in both, as
// Debian's /etc/hosts makes it. Needs root and iproute2.
class TwoHosts {
 public:
  TwoHosts() : prefix_("lst" + std::to_string(getpid() % 1000000)) {
    const std::string a = prefix_ + "a", b = prefix_ + "b";
    const std::string setup = "ip netns add " + a + " && ip netns add " + b + " && ip link add " + a +
        " type veth peer name " + b + " && ip link set " + a + " netns " + a + " && ip link set " + b + " netns " + b;
    std::string per_host;
    for (int host = 0; host < 2; ++host) {
      const std::string ns = host == 0 ? a : b;
      per_host += " && ip -n " + ns + " link set " + ns + " name lsnet0 && ip -n " + ns + " addr add " + address(host) +
          "/24 dev lsnet0 && ip -n " + ns + " link set lsnet0 up && ip -n " + ns + " link set lo up";
    }
    ready_ = std::system(("(" + setup + per_host + ") >/dev/null 2>&1").c_str()) == 0;
  }
  ~TwoHosts() {
    const std::string teardown = "(ip netns del " + prefix_ + "a; ip netns del " + prefix_ + "b) >/dev/null 2>&1";
    std::system(teardown.c_str()); // deleting a namespace deletes its end of the veth pair, and so the pair
  }
  bool ready() const {
    return ready_;
  }
  static std::string ip() {
    for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
      if (access(path, X_OK) == 0) {
        return path;
      }
    }
    return "ip";
  }
  static std::string address(int host) {
    return "10.77.0." + std::to_string(host + 1);
  }
  // Node `host` of a two-node job of one rank per node, on its own machine.
  std::vector<std::string> node(int host, const std::vector<std::string>& program, const std::string& master_port,
                                const std::vector<std::string>& flags = {}) const {
    std::vector<std::string> all{"--nnodes", "2", "--node-rank", std::to_string(host), "--nproc-per-node", "1",
                                 "--master-addr", address(0), "--master-port", master_port};
    all.insert(all.end(), flags.begin(), flags.end());
    auto args = launcher(all, program);
    args.insert(args.begin(), {ip(), "netns", "exec", name(host)});
    return args;
  }
  std::string name(int host) const {
    return prefix_ + (host == 0 ? "a" : "b");
  }
  // Cuts (or mends) the cable: host 0's end of the link goes down (up).
  void set_link(bool up) const {
    const std::string command = ip() + " -n " + name(0) + " link set lsnet0 " + (up ? "up" : "down");
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
  }
  // The TCP sockets listening on `host` now, as "address:port".
  std::vector<std::string> listening(int host) const {
    std::vector<std::string> found;
    FILE* out = ::popen((ip() + " netns exec " + name(host) + " ss -ltnH 2>/dev/null").c_str(), "r");
    char line[512];
    while (out != nullptr && std::fgets(line, sizeof(line), out) != nullptr) {
      std::istringstream fields(line);
      std::string state, receive, send, local;
      fields >> state >> receive >> send >> local;
      found.push_back(local);
    }
    if (out != nullptr) {
      ::pclose(out);
    }
    return found;
  }

 private:
  std::string prefix_;
  bool ready_ = false;
};

// Starts one node per host, node N running program(NAME + N) and logging to
// temp(NAME + N + ".log"); `flags` go to both launchers.
std::vector<Process> start_on_two_hosts(
    const TwoHosts& hosts,
    const std::string& name,
    const std::string& master_port,
    const std::vector<std::string>& env,
    const std::function<std::vector<std::string>(const std::string&)>& program,
    const std::vector<std::string>& flags = {}) {
  std::vector<Process> nodes;
  for (int host = 0; host < 2; ++host) {
    const std::string node = name + std::to_string(host);
    nodes.push_back(testing::start(hosts.node(host, program(node), master_port, flags), env, temp(node + ".log")));
  }
  return nodes;
}

std::vector<Process> run_on_two_hosts(const TwoHosts& hosts, const std::string& name, const std::vector<std::string>& env) {
  auto nodes = start_on_two_hosts(hosts, name, port(), env, [](const std::string& node) { return trainer(node); });
  testing::wait_all(nodes, std::chrono::seconds(90));
  return nodes;
}

TEST(TwoHosts, LoopbackGlooAddressFailsOnEveryRankNamingGlooSocketIfname) {
  TwoHosts hosts;
  if (!hosts.ready()) {
    GTEST_SKIP() << "cannot create network namespaces here (needs root and iproute2)";
  }
  // Without GLOO_SOCKET_IFNAME each rank's Gloo listens on its host name's
  // loopback address, which the other machine cannot reach.
  auto nodes = run_on_two_hosts(hosts, "loopback_hosts", {kOneThread, "LOCKSTEP_TIMEOUT=30"});
  for (const auto& node : nodes) {
    EXPECT_EQ(node.exit_code, 1) << node.output;
    EXPECT_LT(node.seconds, 20.0) << node.output;
    EXPECT_NE(node.output.find("'s Gloo would listen on the loopback address"), std::string::npos) << node.output;
    EXPECT_NE(node.output.find("Set GLOO_SOCKET_IFNAME to the network interface"), std::string::npos) << node.output;
  }
}

TEST(TwoHosts, GlooSocketIfnameTrainsAcrossThemLikeOneNode) {
  TwoHosts hosts;
  if (!hosts.ready()) {
    GTEST_SKIP() << "cannot create network namespaces here (needs root and iproute2)";
  }
  auto nodes = run_on_two_hosts(hosts, "ifname_hosts", {kOneThread, "GLOO_SOCKET_IFNAME=lsnet0"});
  ASSERT_EQ(nodes[0].exit_code, 0) << nodes[0].output << nodes[1].output;
  ASSERT_EQ(nodes[1].exit_code, 0) << nodes[0].output << nodes[1].output;
  EXPECT_EQ(final_hash(nodes[0].output), reference_hash()) << nodes[0].output;
}

// new_group over a TCPStore the program made: Gloo listens toward the
// store's host, as under init_process_group. It listened on 127.0.0.1,
// which the other machine cannot reach, and each rank's connection failed
// only at the timeout, naming neither the address nor GLOO_SOCKET_IFNAME.
TEST(TwoHosts, NewGroupOverATcpStoreListensTowardTheStoresHost) {
  TwoHosts hosts;
  if (!hosts.ready()) {
    GTEST_SKIP() << "cannot create network namespaces here (needs root and iproute2)";
  }
  const auto worker = [](const std::string&) { return std::vector<std::string>{LOCKSTEP_DDP_WORKER, "tcp_store"}; };
  // Here each host name resolves to loopback: a clear error on both ranks,
  // also when the program wraps its TCPStore in a PrefixStore (which hid
  // it: Gloo bound to 127.0.0.1 and failed at the timeout with its own error).
  for (const std::string prefix : {"", "job7/"}) {
    std::vector<std::string> env{kOneThread};
    if (!prefix.empty()) {
      env.push_back("LOCKSTEP_TEST_STORE_PREFIX=" + prefix);
    }
    auto nodes = start_on_two_hosts(hosts, "tcp_store_loopback", port(), env, worker);
    testing::wait_all(nodes, std::chrono::seconds(60));
    for (const auto& node : nodes) {
      EXPECT_NE(node.exit_code, 0) << prefix << node.output;
      EXPECT_LT(node.seconds, 9.0) << "not before the 10 s timeout: " << prefix << node.output;
      EXPECT_NE(node.output.find("'s Gloo would listen on the loopback address"), std::string::npos) << node.output;
      EXPECT_NE(node.output.find("Set GLOO_SOCKET_IFNAME to the network interface"), std::string::npos)
          << node.output;
    }
  }
  auto nodes =
      start_on_two_hosts(hosts, "tcp_store_ifname", port(), {kOneThread, "GLOO_SOCKET_IFNAME=lsnet0"}, worker);
  testing::wait_all(nodes, std::chrono::seconds(60));
  for (const auto& node : nodes) {
    EXPECT_EQ(node.exit_code, 0) << node.output;
    EXPECT_NE(node.output.find(": OK"), std::string::npos) << node.output;
  }
}

// Whether `text` appears in `path` within `seconds`.
bool appears(const std::string& path, const std::string& text, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    if (read_text(path).find(text) != std::string::npos) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

TEST(TwoHosts, NothingListensBeyondTheAddressTheJobWasGiven) {
  TwoHosts hosts;
  if (!hosts.ready()) {
    GTEST_SKIP() << "cannot create network namespaces here (needs root and iproute2)";
  }
  // Every listening socket on either host, sampled all through a job.
  const std::string master_port = port();
  auto nodes = start_on_two_hosts(hosts, "exposure", master_port, {kOneThread, "GLOO_SOCKET_IFNAME=lsnet0"},
                                  [](const std::string& node) { return trainer(node); });
  std::atomic<bool> done{false};
  std::set<std::string> seen[2];
  std::thread sampler([&] {
    while (!done) {
      for (int host = 0; host < 2; ++host) {
        for (const auto& local : hosts.listening(host)) {
          seen[host].insert(local);
        }
      }
    }
  });
  testing::wait_all(nodes, std::chrono::seconds(90));
  done = true;
  sampler.join();
  ASSERT_EQ(nodes[0].exit_code, 0) << nodes[0].output << nodes[1].output;
  ASSERT_EQ(nodes[1].exit_code, 0) << nodes[0].output << nodes[1].output;
  ASSERT_FALSE(seen[0].empty()) << "the store on host 0 was never seen listening";
  for (int host = 0; host < 2; ++host) {
    for (const auto& local : seen[host]) {
      const bool store = host == 0 && local.substr(local.rfind(':') + 1) == master_port;
      if (store && TORCH_VERSION_MAJOR < 2) {
        // LibTorch 1.13's TCPStore cannot be bound to one address; rank 0 warns.
        EXPECT_NE(nodes[0].output.find("rank 0's store listens on every interface at port " + master_port),
                  std::string::npos) << nodes[0].output;
        continue;
      }
      EXPECT_EQ(local.rfind(TwoHosts::address(host) + ":", 0), 0u)
          << "host " << host << " listens on " << local << ", not only on " << TwoHosts::address(host);
    }
  }
}

TEST(TwoHosts, LinkCutEndsBothSidesNamingTheLostPeer) {
  TwoHosts hosts;
  if (!hosts.ready()) {
    GTEST_SKIP() << "cannot create network namespaces here (needs root and iproute2)";
  }
  auto nodes = start_on_two_hosts(hosts, "link_cut", port(), {kOneThread, "GLOO_SOCKET_IFNAME=lsnet0", "LOCKSTEP_TIMEOUT=8"},
                                  [](const std::string& node) { return with_flag(trainer(node), "--epochs", "1000"); });
  ASSERT_TRUE(appears(nodes[0].log, "epoch 1/1000", 60)) << read_text(nodes[0].log);
  hosts.set_link(false);
  const auto cut = std::chrono::steady_clock::now();
  testing::wait_all(nodes, std::chrono::seconds(60));
  for (int host = 0; host < 2; ++host) {
    const auto& node = nodes[host];
    const int peer = 1 - host;
    EXPECT_EQ(node.exit_code, 1) << node.output;
    // The timeout (8 s), the probe (2 s), the launcher's settling (1 s), and slack for a loaded machine.
    const double after_cut = std::chrono::duration<double>(node.start - cut).count() + node.seconds;
    EXPECT_LT(after_cut, 25.0) << node.output;
    EXPECT_NE(node.output.find("Lost peer: no answer within 2 s from rank " + std::to_string(peer) + " at " +
                               TwoHosts::address(peer)), std::string::npos) << node.output;
    EXPECT_TRUE(testing::processes_with(temp("link_cut" + std::to_string(host))).empty())
        << "a process of host " << host << "'s job outlived its launcher";
  }
}

TEST(TwoHosts, JobResumesFromItsCheckpointWhenTheLinkComesBack) {
  TwoHosts hosts;
  if (!hosts.ready()) {
    GTEST_SKIP() << "cannot create network namespaces here (needs root and iproute2)";
  }
  // Long enough to cut the link in the middle: 6 epochs, against the same job on one node.
  auto job = [](const std::string& name, const std::string& checkpoint) {
    return with_flag(trainer(name, checkpoint), "--epochs", "6");
  };
  auto reference = launch({"--nproc-per-node", "2", "--master-port", port()},
                          job("link_back_reference", temp("link_back_reference.ckpt")), "link_back_reference", {kOneThread});
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string checkpoint = temp("link_back.ckpt");
  auto nodes = start_on_two_hosts(hosts, "link_back", port(), {kOneThread, "GLOO_SOCKET_IFNAME=lsnet0", "LOCKSTEP_TIMEOUT=8"},
                                  [&](const std::string& node) { return job(node, checkpoint); },
                                  {"--max-restarts", "3", "--restart-delay", "0.5"});
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (access(checkpoint.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(access(checkpoint.c_str(), F_OK), 0) << read_text(nodes[0].log);
  hosts.set_link(false);
  for (const auto& node : nodes) {
    EXPECT_TRUE(appears(node.log, "lockstep-run: restarting every rank", 40)) << read_text(node.log);
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));
  hosts.set_link(true);
  testing::wait_all(nodes, std::chrono::seconds(120));
  ASSERT_EQ(nodes[0].exit_code, 0) << nodes[0].output << nodes[1].output;
  ASSERT_EQ(nodes[1].exit_code, 0) << nodes[0].output << nodes[1].output;
  EXPECT_NE(nodes[0].output.find("lockstep-train: resumed from " + checkpoint), std::string::npos) << nodes[0].output;
  EXPECT_EQ(final_hash(nodes[0].output), final_hash(reference.output)) << nodes[0].output;
}

} // namespace
} // namespace lockstep
