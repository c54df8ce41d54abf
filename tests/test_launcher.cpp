// lockstep-run with lockstep-train under it: real processes, failures,
// restarts, two nodes on one machine, bad command lines; and lockstep-train's
// checkpoints.

#include <lockstep/lockstep.h>

#include "process_util.h"
#include "test_util.h"

#include <examples/checkpoint.h>
#include <examples/idx.h>
#include <examples/models.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <zlib.h>

#include <functional>
#include <map>
#include <random>
#include <regex>

namespace lockstep {
namespace {

using testing::Process;

constexpr auto kDeadline = std::chrono::seconds(180);
// Bitwise comparisons need the same intra-op thread count per rank in every
// run: lockstep-run's default (cores / ranks per node) differs between one
// node of 2 ranks and two nodes of 1.
const std::string kOneThread = "OMP_NUM_THREADS=1";

std::string temp(const std::string& name) {
  static const std::string run_id = std::to_string(getpid()) + "_" + std::to_string(std::random_device{}());
  return ::testing::TempDir() + "lockstep_" + run_id + "_" + name;
}

// A small job: 1024 samples, batch 64, 2 epochs (32 steps at world size 2).
std::vector<std::string> trainer(const std::string& marker, const std::string& checkpoint = "") {
  std::vector<std::string> args{LOCKSTEP_TRAIN, "--train-samples", "1024", "--test-samples", "256", "--batch-size", "64",
                                "--epochs", "2", "--save", temp(marker + ".pt"), "--synthetic", "--out", temp(marker + "_out")};
  if (!checkpoint.empty()) {
    args.insert(args.end(), {"--checkpoint", checkpoint, "--checkpoint-every", "4"});
  }
  return args;
}

std::vector<std::string> launcher(std::vector<std::string> flags, const std::vector<std::string>& program) {
  flags.insert(flags.begin(), LOCKSTEP_RUN);
  flags.insert(flags.end(), program.begin(), program.end());
  return flags;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string final_hash(const std::string& output) {
  std::smatch m;
  return std::regex_search(output, m, std::regex("fnv1a64=([0-9a-f]{16})")) ? m[1].str() : "";
}

Process launch(const std::vector<std::string>& flags, const std::vector<std::string>& program, const std::string& name,
               const std::vector<std::string>& env = {}) {
  return testing::run(launcher(flags, program), env, temp(name + ".log"), kDeadline);
}

std::string port() {
  return std::to_string(testing::free_port());
}

// The last epoch's line: train loss and accuracy, test loss and accuracy.
std::string epoch_figures(const std::string& output) {
  std::smatch m;
  return std::regex_search(output, m, std::regex("epoch 2/2: train loss [0-9.]+, train accuracy [0-9.]+%, test loss "
                                                 "[0-9.]+, test accuracy [0-9.]+%")) ? m[0].str() : "";
}

// The uninterrupted reference: 2 ranks on one node.
const Process& reference_run() {
  static const Process p = [] {
    auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, trainer("reference"), "reference", {kOneThread});
    EXPECT_EQ(p.exit_code, 0) << p.output;
    return p;
  }();
  return p;
}

const std::string& reference_hash() {
  static const std::string hash = final_hash(reference_run().output);
  return hash;
}

// A pid that no process has now: a child that has exited and been reaped.
pid_t dead_pid() {
  const pid_t pid = fork();
  if (pid == 0) {
    _exit(0);
  }
  waitpid(pid, nullptr, 0);
  return pid;
}

TEST(Launcher, RanksGetTorchrunsEnvironmentAndPrefixedOutput) {
  const std::string logs = temp("logs");
  ASSERT_EQ(mkdir(logs.c_str(), 0755), 0);
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--log-dir", logs}, {"/bin/sh", "-c",
      "echo \"env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $TORCHELASTIC_RESTART_COUNT "
      "$OMP_NUM_THREADS\""}, "env");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("[rank 0] env 0 0 2 2 0 127.0.0.1 0 "), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("[rank 1] env 1 1 2 2 0 127.0.0.1 0 "), std::string::npos) << p.output;
  std::ifstream log(logs + "/rank_1.log");
  std::string header, line;
  std::getline(log, header);
  std::getline(log, line);
  EXPECT_EQ(header.rfind("==== lockstep-run ", 0), 0u) << header;
  EXPECT_EQ(line.rfind("env 1 1 2 2", 0), 0u) << line;
}

void expect_failure_stops_the_job(const std::string& fault, const std::string& how) {
  const std::string marker = "fault_" + fault;
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, trainer(marker), marker, {"LOCKSTEP_FAULT=" + fault});
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_LT(p.seconds, 20.0) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: rank 1 (local rank 1, pid "), std::string::npos) << p.output;
  EXPECT_NE(p.output.find(how), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("last lines of rank 1's stderr:\n  lockstep-train: LOCKSTEP_FAULT: rank 1 stops at step 5"),
            std::string::npos) << p.output;
  EXPECT_TRUE(testing::processes_with(temp(marker)).empty()) << "a process of the job outlived the launcher";
}

TEST(Launcher, RankExitingWithCode3StopsTheJob) {
  expect_failure_stops_the_job("1:5", "failed: exit code 3");
}

TEST(Launcher, RankKilledWithSigkillStopsTheJob) {
  expect_failure_stops_the_job("1:5:kill", "failed: killed by signal 9 (SIGKILL)");
}

// --- under torchrun ---------------------------------------------------------

// PyTorch's own launcher (python -m torch.distributed.run) of the Python that
// owns this LibTorch, 2 ranks of lockstep-train, with the given rendezvous.
// --redirects/--tee: Debian's 1.13 torchrun needs them on Python 3.11.
Process torchrun(const std::vector<std::string>& rendezvous, const std::string& name) {
  std::vector<std::string> args{LOCKSTEP_PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--redirects", "1", "--tee", "1", "--log_dir", temp(name + "_torchrun_logs")};
  args.insert(args.end(), rendezvous.begin(), rendezvous.end());
  args.push_back("--no_python");
  auto program = trainer(name);
  args.insert(args.end(), program.begin(), program.end());
  return testing::run(args, {kOneThread}, temp(name + ".log"), kDeadline);
}

TEST(Torchrun, StaticRendezvousMatchesLockstepRun) {
  // torchrun's agent hosts the store on MASTER_PORT and says so
  // (TORCHELASTIC_USE_AGENT_STORE=True): rank 0 must not start another.
  auto p = torchrun({"--master_addr", "127.0.0.1", "--master_port", port()}, "torchrun_static");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_EQ(final_hash(p.output), reference_hash()) << p.output;
}

TEST(Torchrun, StandaloneMatchesLockstepRun) {
  auto p = torchrun({"--standalone"}, "torchrun_standalone");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_EQ(final_hash(p.output), reference_hash()) << p.output;
}

TEST(Torchrun, C10dRendezvousMatchesLockstepRun) {
  auto p = torchrun({"--nnodes", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:" + port()},
                    "torchrun_c10d");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_EQ(final_hash(p.output), reference_hash()) << p.output;
}

TEST(Launcher, RestartResumesFromTheCheckpointBitwise) {
  const std::string checkpoint = temp("restart.ckpt");
  const std::string logs = temp("restart_logs");
  ASSERT_EQ(mkdir(logs.c_str(), 0755), 0);
  // Rank 1 fails in the last epoch (steps 16 to 31), after the checkpoint at step 24.
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--max-restarts", "1", "--log-dir", logs},
                  trainer("restart", checkpoint), "restart", {"LOCKSTEP_FAULT=1:26", kOneThread});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("restarting every rank in 1.0 s (restart 1 of 1)"), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("resumed from " + checkpoint + " at step 24 (epoch 2, batch 8)"), std::string::npos) << p.output;
  EXPECT_EQ(final_hash(p.output), reference_hash()) << p.output;
  EXPECT_FALSE(reference_hash().empty());
  // The resumed epoch's figures count the rows before the failure too.
  EXPECT_EQ(epoch_figures(p.output), epoch_figures(reference_run().output)) << p.output;
  EXPECT_FALSE(epoch_figures(p.output).empty()) << p.output;
  // Each attempt starts with a header in the logs.
  const std::string text = read_text(logs + "/rank_1.log");
  EXPECT_NE(text.find(": attempt 1 of at most 2, rank 1 of 2: " LOCKSTEP_TRAIN), std::string::npos) << text;
  EXPECT_LT(text.find(": attempt 1 of"), text.find(": attempt 2 of at most 2")) << text;
}

TEST(Launcher, StalledRankIsNamedNotTheRankThatTimedOut) {
  // Rank 1 stalls, deaf to SIGTERM; rank 0 times out waiting for it and fails first.
  auto p = launch({"--nproc-per-node", "2", "--master-port", port(), "--timeout", "3", "--grace-period", "1"},
                  trainer("stall"), "stall", {"LOCKSTEP_FAULT=1:5:hang"});
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_LT(p.seconds, 30.0) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: rank 0 (local rank 0, pid "), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("within the group's timeout of 3000 ms"), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("had stopped responding: it ignored SIGTERM and was killed with SIGKILL after the 1.0 s grace "
                          "period. Rank 0 failed first only because it gave up waiting for it"),
            std::string::npos) << p.output;
  EXPECT_TRUE(testing::processes_with(temp("stall")).empty()) << "a rank outlived the launcher";
}

TEST(Launcher, StoreFilesOfDeadLaunchersAreRemoved) {
  const std::string tmp = temp("store_tmp");
  ASSERT_EQ(mkdir(tmp.c_str(), 0755), 0);
  const std::string stale = tmp + "/lockstep-store-" + std::to_string(dead_pid()) + "-0";
  const std::string live = tmp + "/lockstep-store-" + std::to_string(getpid()) + "-0";
  std::ofstream(stale) << "x";
  std::ofstream(live) << "x";
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, {"/bin/true"}, "store_tmp", {"TMPDIR=" + tmp});
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(access(stale.c_str(), F_OK), 0) << "a dead launcher's store file is left";
  EXPECT_EQ(access(live.c_str(), F_OK), 0) << "a running launcher's store file was removed";
}

// Two nodes of one rank each on this machine, node N running program(N); waits for both.
std::vector<Process> run_two_nodes(const std::string& name, const std::function<std::vector<std::string>(int)>& program) {
  const std::string master_port = port();
  std::vector<Process> nodes;
  for (int node = 0; node < 2; ++node) {
    nodes.push_back(testing::start(
        launcher({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "1", "--master-addr",
                  "127.0.0.1", "--master-port", master_port},
                 program(node)),
        {kOneThread}, temp(name + std::to_string(node) + ".log")));
  }
  testing::wait_all(nodes, kDeadline);
  return nodes;
}

TEST(Launcher, TwoNodesOnOneMachineMatchOneNode) {
  auto nodes = run_two_nodes("node", [](int node) { return trainer("node" + std::to_string(node)); });
  ASSERT_EQ(nodes[0].exit_code, 0) << nodes[0].output << nodes[1].output;
  ASSERT_EQ(nodes[1].exit_code, 0) << nodes[0].output << nodes[1].output;
  EXPECT_EQ(final_hash(nodes[0].output), reference_hash()) << nodes[0].output;
}

TEST(Launcher, NodesResumingFromDifferentCheckpointsFailTogether) {
  // Two machines without a shared disk: node 0 finds rank 0's checkpoint,
  // node 1 has none at its own path.
  const std::string checkpoint = temp("node0_only.ckpt");
  auto first = testing::run(trainer("node0_only_first", checkpoint), {kOneThread}, temp("node0_only_first.log"), kDeadline);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto nodes = run_two_nodes("node_ckpt", [&](int node) {
    return trainer("node_ckpt" + std::to_string(node), node == 0 ? checkpoint : temp("nowhere.ckpt"));
  });
  for (const auto& node : nodes) {
    EXPECT_NE(node.exit_code, 0) << node.output;
    EXPECT_NE(node.output.find("rank 1 started from scratch (no checkpoint found) but rank 0 resumed at step"),
              std::string::npos) << node.output;
  }
}

TEST(Launcher, TwoNodesRestartTogetherAfterARankFails) {
  // Rank 1 (node 1) fails; node 0's rank sees the broken connection and fails
  // too; each launcher restarts its node and the new attempts meet again at
  // the store. Same final parameters as the uninterrupted run.
  const std::string master_port = port();
  const std::string checkpoint = temp("nodes_restart.ckpt");
  std::vector<Process> nodes;
  for (int node = 0; node < 2; ++node) {
    nodes.push_back(testing::start(
        launcher({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "1", "--master-addr",
                  "127.0.0.1", "--master-port", master_port, "--max-restarts", "1"},
                 trainer("nodes_restart" + std::to_string(node), checkpoint)),
        {kOneThread, "LOCKSTEP_FAULT=1:10"}, temp("nodes_restart" + std::to_string(node) + ".log")));
  }
  testing::wait_all(nodes, kDeadline);
  ASSERT_EQ(nodes[0].exit_code, 0) << nodes[0].output << nodes[1].output;
  ASSERT_EQ(nodes[1].exit_code, 0) << nodes[0].output << nodes[1].output;
  EXPECT_NE(nodes[1].output.find("rank 1 (local rank 0, pid "), std::string::npos) << nodes[1].output;
  EXPECT_EQ(final_hash(nodes[0].output), reference_hash()) << nodes[0].output;
}

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
  std::vector<std::string> node(int host, const std::vector<std::string>& program, const std::string& master_port) const {
    auto args = launcher({"--nnodes", "2", "--node-rank", std::to_string(host), "--nproc-per-node", "1", "--master-addr",
                          address(0), "--master-port", master_port},
                         program);
    args.insert(args.begin(), {ip(), "netns", "exec", prefix_ + (host == 0 ? "a" : "b")});
    return args;
  }

 private:
  std::string prefix_;
  bool ready_ = false;
};

std::vector<Process> run_on_two_hosts(const TwoHosts& hosts, const std::string& name, const std::vector<std::string>& env) {
  const std::string master_port = port();
  std::vector<Process> nodes;
  for (int host = 0; host < 2; ++host) {
    nodes.push_back(testing::start(hosts.node(host, trainer(name + std::to_string(host)), master_port), env,
                                   temp(name + std::to_string(host) + ".log")));
  }
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

TEST(InitProcessGroup, StoreThatNeverAnswersEndsTheRankWithinTheTimeout) {
  // A port that accepts connections (the kernel's backlog) but never answers:
  // the store client would wait on it forever.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  auto p = testing::run(trainer("silent_store"),
                        {"WORLD_SIZE=2", "RANK=1", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(ntohs(address.sin_port)),
                         "LOCKSTEP_TIMEOUT=2"},
                        temp("silent_store.log"), std::chrono::seconds(60));
  close(fd);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_LT(p.seconds, 10.0) << p.output;
  EXPECT_NE(p.output.find("2000 ms"), std::string::npos) << p.output; // the store's error, or the deadline's
}

// SIGHUP (a closed terminal) stops the job as gracefully as SIGTERM.
void expect_signal_stops_everything(int sig) {
  const std::string marker = "signal" + std::to_string(sig);
  auto args = trainer(marker);
  args[8] = "1000"; // --epochs: long enough to be interrupted
  auto p = testing::start(launcher({"--nproc-per-node", "2", "--master-port", port()}, args), {}, temp(marker + ".log"));
  std::this_thread::sleep_for(std::chrono::seconds(4));
  kill(p.pid, sig);
  std::vector<Process> one{p};
  testing::wait_all(one, std::chrono::seconds(30));
  EXPECT_EQ(one[0].exit_code, 128 + sig) << one[0].output;
  EXPECT_NE(one[0].output.find("stopped by signal " + std::to_string(sig)), std::string::npos) << one[0].output;
  EXPECT_TRUE(testing::processes_with(temp(marker)).empty()) << "a rank outlived the launcher";
}

TEST(Launcher, SigtermIsForwardedAndNothingRemains) {
  expect_signal_stops_everything(SIGTERM);
}

TEST(Launcher, SighupStopsTheJobLikeSigterm) {
  expect_signal_stops_everything(SIGHUP);
}

TEST(Launcher, AcceptsTorchrunsSpellingsAndDoubleDash) {
  auto p = launch({"--nproc_per_node", "2", "--master_port", port(), "--"}, {"/bin/sh", "-c", "echo rank=$RANK"},
                  "spellings");
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("rank=1"), std::string::npos) << p.output;
}

TEST(Launcher, FaultInjectionFiresOnTheFirstTorchrunAttemptOnly) {
  auto args = trainer("fault_once");
  auto first = testing::run(args, {"LOCKSTEP_FAULT=0:2", "TORCHELASTIC_RESTART_COUNT=0"}, temp("fault0.log"), kDeadline);
  EXPECT_EQ(first.exit_code, 3) << first.output;
  auto later = testing::run(args, {"LOCKSTEP_FAULT=0:2", "TORCHELASTIC_RESTART_COUNT=1"}, temp("fault1.log"), kDeadline);
  EXPECT_EQ(later.exit_code, 0) << later.output;
}

// Whether a TCP socket listens on `port` (any address), from /proc/net/tcp*.
bool listening_on(const std::string& port) {
  char hex[8];
  std::snprintf(hex, sizeof(hex), ":%04X", std::stoi(port));
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      if (state == "0A" && local.size() >= 5 && local.compare(local.size() - 5, 5, hex) == 0) {
        return true;
      }
    }
  }
  return false;
}

TEST(Launcher, KillingTheLauncherTakesEveryRankWithIt) {
  const std::string marker = "orphans";
  auto args = trainer(marker);
  args[8] = "1000"; // --epochs: still running when the launcher dies
  const std::string master_port = port();
  auto p = testing::start(launcher({"--nproc-per-node", "2", "--master-port", master_port}, args), {}, temp("orphans.log"));
  std::this_thread::sleep_for(std::chrono::seconds(3));
  ASSERT_EQ(testing::processes_with(temp(marker)).size(), 3u); // the launcher and its two ranks
  EXPECT_FALSE(listening_on(master_port)) << "one node: the store is a file, nothing listens on --master-port";
  kill(p.pid, SIGKILL);
  std::vector<Process> one{p};
  testing::wait_all(one, std::chrono::seconds(10));
  for (int i = 0; i < 50 && !testing::processes_with(temp(marker)).empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(testing::processes_with(temp(marker)).empty()) << "a rank outlived a launcher killed with SIGKILL";
}

TEST(Launcher, BadCommandLinesAreOneLineErrors) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases{
      {{"--bogus", "/bin/true"}, "lockstep-run: unknown option --bogus"},
      {{"--nproc-per-node", "0", "/bin/true"}, "--nproc-per-node"},
      {{"no-such-program-here"}, "program 'no-such-program-here' not found in PATH"},
      {{"--nnodes", "2", "--node-rank", "1", "/bin/true"}, "needs --master-addr"},
      {{"--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "/bin/true"}, "--node-rank 2 is out of range"},
      {{}, "PROGRAM is missing"},
  };
  for (const auto& c : cases) {
    auto p = launch(c.args, {}, "bad");
    EXPECT_EQ(p.exit_code, 2) << p.output;
    EXPECT_NE(p.output.find(c.message), std::string::npos) << p.output;
    EXPECT_NE(p.output.find("Run 'lockstep-run --help' for usage."), std::string::npos) << p.output;
  }
  // A port someone else listens on.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string taken = std::to_string(ntohs(addr.sin_port));
  auto p = launch({"--master-port", taken, "/bin/true"}, {}, "taken");
  close(fd);
  EXPECT_EQ(p.exit_code, 2) << p.output;
  EXPECT_NE(p.output.find("port " + taken + " on 127.0.0.1 is already in use; pick another with --master-port"),
            std::string::npos) << p.output;
}

// --- IDX data files ---------------------------------------------------------------

// Writes an MNIST-format split of n rows into dir, gzipped or not; the images'
// header may declare more rows than are written (a truncated file).
void write_split(const std::string& dir, const std::string& prefix, uint32_t n, bool gz, uint32_t declared = 0) {
  auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                       static_cast<char>(v)};
  };
  std::mt19937 random(n);
  std::string images = be32(0x803) + be32(declared > 0 ? declared : n) + be32(28) + be32(28);
  std::string labels = be32(0x801) + be32(n);
  for (uint32_t i = 0; i < n; ++i) {
    const int label = static_cast<int>(i % 10);
    labels += static_cast<char>(label);
    for (int p = 0; p < 28 * 28; ++p) { // a learnable pattern: a bright band whose row is the label
      images += static_cast<char>(p / 28 / 3 == label ? 200 + random() % 50 : random() % 40);
    }
  }
  for (const auto& [name, bytes] : {std::make_pair(prefix + "-images-idx3-ubyte", images),
                                    std::make_pair(prefix + "-labels-idx1-ubyte", labels)}) {
    if (gz) {
      gzFile file = gzopen((dir + "/" + name + ".gz").c_str(), "wb");
      gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
      gzclose(file);
    } else {
      std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
    }
  }
}

Process train_on(const std::string& dir, const std::string& name) {
  return testing::run({LOCKSTEP_TRAIN, "--data", dir, "--batch-size", "50", "--epochs", "1", "--out", dir + "/out"}, {},
                      temp(name + ".log"),
                      kDeadline);
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = temp(name);
  EXPECT_EQ(mkdir(dir.c_str(), 0755), 0);
  return dir;
}

TEST(TrainerData, SmallerAndGzippedIdxFilesAreAccepted) {
  // 600/200 rows, not MNIST's 60000/10000; the test split gzipped.
  const std::string dir = fresh_dir("idx_subset");
  write_split(dir, "train", 600, false);
  write_split(dir, "t10k", 200, true);
  auto p = train_on(dir, "idx_subset");
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("600 train / 200 test samples"), std::string::npos) << p.output;
}

TEST(TrainerData, TruncatedIdxFilesAreOneLineErrorsNamingTheFile) {
  struct Case {
    std::string name;
    bool gz;
    uint32_t declared;
  };
  for (const auto& c : {Case{"idx_cut_plain", false, 400}, Case{"idx_cut_gz", true, 400}, Case{"idx_header_only", false, 1}}) {
    const std::string dir = fresh_dir(c.name);
    write_split(dir, "train", c.name == "idx_header_only" ? 0 : 200, c.gz, c.declared);
    write_split(dir, "t10k", 100, false);
    auto p = train_on(dir, c.name);
    const std::string file = dir + "/train-images-idx3-ubyte" + (c.gz ? ".gz" : "");
    EXPECT_EQ(p.exit_code, 1) << p.output;
    EXPECT_NE(p.output.find("lockstep-train: " + file + ": truncated: the header declares " + std::to_string(c.declared) +
                            " rows"),
              std::string::npos)
        << p.output;
  }
}

TEST(TrainerData, ForeignOrMissingFilesAreOneLineErrors) {
  const std::string dir = fresh_dir("idx_foreign");
  write_split(dir, "train", 100, false);
  std::ofstream(dir + "/t10k-images-idx3-ubyte") << "this is not an IDX file at all";
  std::ofstream(dir + "/t10k-labels-idx1-ubyte") << "neither is this one";
  auto p = train_on(dir, "idx_foreign");
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find(dir + "/t10k-images-idx3-ubyte: not an IDX file"), std::string::npos) << p.output;
  auto missing = train_on(fresh_dir("idx_nowhere"), "idx_nowhere"); // an empty directory
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("idx_nowhere/train-images-idx3-ubyte(.gz): no such file"), std::string::npos)
      << missing.output;
}

TEST(TrainerData, BadOutputPathsAndUnevenBatchesAreRefusedUpFront) {
  auto args = trainer("bad_paths");
  args.insert(args.end(), {"--checkpoint", temp("no_such_folder") + "/run.ckpt"});
  auto p = testing::run(args, {}, temp("bad_paths.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("--checkpoint " + temp("no_such_folder") + "/run.ckpt: cannot write into"), std::string::npos)
      << p.output;
  EXPECT_EQ(p.output.find("epoch 1/"), std::string::npos) << "trained before refusing: " << p.output;

  auto uneven = trainer("uneven");
  uneven[6] = "65"; // --batch-size over 2 ranks
  auto q = launch({"--nproc-per-node", "2", "--master-port", port()}, uneven, "uneven", {kOneThread});
  EXPECT_NE(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("--batch-size 65 does not split evenly over 2 ranks"), std::string::npos) << q.output;
}

// --- checkpoints -------------------------------------------------------------------

// --- the main job's data: Debian's Fashion-MNIST ------------------------------

const std::string kFashionMnist = "/usr/share/datasets/fashion-mnist";

// The first `n` rows of Fashion-MNIST's `prefix` split, written into `dir` as
// IDX files of n rows, gzipped or not; the images file cut in half if `cut`.
void slice_fashion_mnist(const std::string& dir, const std::string& prefix, uint32_t n, bool gz, bool cut = false) {
  for (const auto& [kind, header, row] : {std::make_tuple("images-idx3-ubyte", 16, 28 * 28),
                                          std::make_tuple("labels-idx1-ubyte", 8, 1)}) {
    const std::string name = prefix + "-" + kind;
    gzFile in = gzopen((kFashionMnist + "/" + name + ".gz").c_str(), "rb");
    ASSERT_NE(in, nullptr) << kFashionMnist << " is missing: scripts/setup.sh installs dataset-fashion-mnist";
    std::string bytes(static_cast<size_t>(header + n * row), '\0');
    ASSERT_EQ(gzread(in, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
    gzclose(in);
    for (int i = 0; i < 4; ++i) { // the row count, big-endian, after the magic number
      bytes[4 + i] = static_cast<char>(n >> (24 - 8 * i));
    }
    if (cut && row > 1) {
      bytes.resize(bytes.size() / 2);
    }
    if (gz) {
      gzFile out = gzopen((dir + "/" + name + ".gz").c_str(), "wb");
      gzwrite(out, bytes.data(), static_cast<unsigned>(bytes.size()));
      gzclose(out);
    } else {
      std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
    }
  }
}

TEST(FashionMnist, PlainAndGzippedSlicesTrainAndACutFileIsNamed) {
  const std::string dir = fresh_dir("fashion_slices");
  slice_fashion_mnist(dir, "train", 300, false);
  slice_fashion_mnist(dir, "t10k", 100, true);
  auto p = train_on(dir, "fashion_slices");
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("300 train / 100 test samples"), std::string::npos) << p.output;
  slice_fashion_mnist(dir, "train", 300, false, /*cut=*/true);
  auto cut = train_on(dir, "fashion_cut");
  EXPECT_EQ(cut.exit_code, 1) << cut.output;
  EXPECT_NE(cut.output.find(dir + "/train-images-idx3-ubyte: truncated"), std::string::npos) << cut.output;
}

TEST(FashionMnist, TwoRankEvaluationEqualsOneProcessOnTheSavedModel) {
  const std::string out = temp("fashion_out");
  // 301 test images: the ranks' shares differ by one.
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()},
                  {LOCKSTEP_TRAIN, "--train-samples", "640", "--test-samples", "301", "--batch-size", "64", "--epochs",
                   "2", "--log-every", "4", "--eval-every", "6", "--out", out},
                  "fashion");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("MNIST-format data at " + kFashionMnist), std::string::npos) << p.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(p.output, m, std::regex("test accuracy [0-9.]+% \\(([0-9]+) of 301 test images, over 2 "
                                                        "rank\\(s\\)\\)"))) << p.output;
  const int64_t correct = std::stoll(m[1].str());

  // One process, the saved model, the same 301 images.
  examples::ConvNet net;
  torch::load(net, out + "/model.pt");
  net->eval();
  auto [images, labels] = examples::read_mnist_split(kFashionMnist, "t10k");
  torch::NoGradGuard no_grad;
  auto predicted = net(images.narrow(0, 0, 301)).argmax(1);
  EXPECT_EQ(predicted.eq(labels.narrow(0, 0, 301)).sum().item<int64_t>(), correct);

  // metrics.jsonl: 20 steps, a training record every 4, an evaluation at
  // steps 6, 12 and 18, and one record per epoch.
  std::map<std::string, std::vector<nlohmann::json>> records;
  std::istringstream lines(read_text(out + "/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    auto record = nlohmann::json::parse(line); // throws, failing the test, if malformed
    records[record.at("kind").get<std::string>()].push_back(record);
  }
  ASSERT_EQ(records["train"].size(), 5u);
  ASSERT_EQ(records["eval"].size(), 3u);
  ASSERT_EQ(records["epoch"].size(), 2u);
  EXPECT_EQ(records["eval"][1].at("step").get<int64_t>(), 12);
  EXPECT_NEAR(records["train"][0].at("lr").get<double>(), 0.1 * 4 / 100, 1e-12); // warmup: step 4 of 100
  EXPECT_DOUBLE_EQ(records["epoch"][1].at("test_accuracy").get<double>(), correct / 301.0);
  EXPECT_GT(records["epoch"][1].at("samples_per_second").get<double>(), 0);
  struct stat info {};
  ASSERT_EQ(stat((out + "/curves.png").c_str(), &info), 0) << p.output;
  EXPECT_GT(info.st_size, 1000);
  EXPECT_NE(p.output.find("outputs in " + out + "/: metrics.jsonl, model.pt, checkpoint.ckpt, curves.png"),
            std::string::npos) << p.output;
}

TEST(FashionMnist, WithoutGnuplotTheMetricsStayAndOneLineSaysWhy) {
  const std::string out = temp("no_gnuplot_out");
  auto p = testing::run({LOCKSTEP_TRAIN, "--train-samples", "256", "--test-samples", "100", "--epochs", "1", "--out", out},
                        {"PATH=/nonexistent"}, temp("no_gnuplot.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("lockstep-train: gnuplot is not installed, so no curves.png (install gnuplot-nox"),
            std::string::npos) << p.output;
  EXPECT_NE(access((out + "/curves.png").c_str(), F_OK), 0);
  EXPECT_NE(read_text(out + "/metrics.jsonl").find("\"kind\":\"epoch\""), std::string::npos);
  EXPECT_NE(read_text(out + "/curves.gp").find("plot $test"), std::string::npos);
}

TEST(Checkpoint, KilledSavesTemporariesAreRemovedAndAFinishedRunSaysSo) {
  const std::string checkpoint = temp("finished.ckpt");
  const std::string stale = checkpoint + ".tmp." + std::to_string(dead_pid());
  const std::string live = checkpoint + ".tmp." + std::to_string(getpid());
  std::ofstream(stale) << "x";
  std::ofstream(live) << "x";
  auto args = trainer("finished", checkpoint);
  auto p = testing::run(args, {}, temp("finished1.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(access(stale.c_str(), F_OK), 0) << "a killed save's temporary file is left";
  EXPECT_EQ(access(live.c_str(), F_OK), 0) << "a running save's temporary file was removed";
  // Run again: nothing is left to train, and it says so instead of "loss nan".
  auto again = testing::run(args, {}, temp("finished2.log"), kDeadline);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("nothing to train: the checkpoint " + checkpoint + " is of a finished run (2 of 2 epoch(s), "
                              "32 steps); raise --epochs"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("nan"), std::string::npos) << again.output;
  EXPECT_EQ(final_hash(again.output), final_hash(p.output)) << again.output;
}

TEST(TrainerData, NoTrainingBatchIsAnError) {
  auto args = trainer("no_batch");
  args[2] = "1"; // --train-samples: one row for two ranks
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, args, "no_batch");
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("epoch 1 has no training batch (1 training samples)"), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("nan"), std::string::npos) << p.output;
}

TEST(Checkpoint, CorruptOrForeignFilesAreClearErrors) {
  const std::string garbage = temp("garbage.ckpt");
  std::ofstream(garbage) << "not a checkpoint";
  auto p = testing::run(trainer("garbage", garbage), {}, temp("garbage.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("checkpoint " + garbage + " is unreadable"), std::string::npos) << p.output;

  const std::string foreign = temp("foreign.ckpt");
  examples::ConvNet net;
  torch::save(net, foreign);
  p = testing::run(trainer("foreign", foreign), {}, temp("foreign.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("is not a lockstep-train checkpoint"), std::string::npos) << p.output;
}

TEST(Checkpoint, AnotherModelsShapesAreAClearError) {
  // Names match the trainer's model, one shape does not: LibTorch's load alone
  // would take it silently.
  const std::string path = temp("other_shapes.ckpt");
  examples::ConvNet net;
  net->fc2->weight.set_data(torch::zeros({5, 128}));
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  examples::save_checkpoint(path, *net, optimizer, examples::TrainingState{});
  auto p = testing::run(trainer("other_shapes", path), {}, temp("other_shapes.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("does not match this model: 'fc2.weight' is [5, 128] float there but [10, 128] float here"),
            std::string::npos) << p.output;
}

TEST(Checkpoint, DamagedContentIsAClearError) {
  const std::string path = temp("damaged.ckpt");
  examples::ConvNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  examples::save_checkpoint(path, *net, optimizer, examples::TrainingState{});
  // Flip bytes in the middle of the file: inside fc1.weight, most of its bytes.
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(0, std::ios::end);
  const auto size = static_cast<std::streamoff>(file.tellg());
  for (std::streamoff at = size / 2; at < size / 2 + 64; ++at) {
    file.seekg(at);
    const char c = static_cast<char>(file.get() ^ 0x5a);
    file.seekp(at);
    file.put(c);
  }
  file.close();
  auto p = testing::run(trainer("damaged", path), {}, temp("damaged.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_TRUE(p.output.find("checkpoint " + path + " is damaged") != std::string::npos ||
              p.output.find("checkpoint " + path + " is unreadable") != std::string::npos)
      << p.output;
}

TEST(Checkpoint, DataParallelRunResumesUnderTheLauncher) {
  const std::string checkpoint = temp("cross.ckpt");
  auto one_epoch = trainer("cross1", checkpoint);
  one_epoch[8] = "1"; // --epochs
  auto p = testing::run(one_epoch, {}, temp("cross1.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("DataParallel on [cpu,cpu]"), std::string::npos) << p.output;
  auto q = launch({"--nproc-per-node", "2", "--master-port", port()}, trainer("cross2", checkpoint), "cross2");
  ASSERT_EQ(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("resumed from " + checkpoint + " at step 16 (epoch 2, batch 0); written with another world size"),
            std::string::npos) << q.output;
  EXPECT_NE(q.output.find("DistributedDataParallel over 2 ranks"), std::string::npos) << q.output;
}

TEST(Checkpoint, ModelFilesMoveBetweenBareDataParallelAndDdp) {
  const std::string path = temp("model.pt");
  auto same = [](examples::ConvNet& a, examples::ConvNet& b) {
    auto pa = a->parameters();
    auto pb = b->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      if (!torch::equal(pa[i], pb[i])) {
        return false;
      }
    }
    return true;
  };
  examples::ConvNet bare, dp_net, ddp_net;
  DataParallel<examples::ConvNet> dp(dp_net, DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  DistributedDataParallel<examples::ConvNet> ddp(ddp_net, ProcessGroup());

  torch::save(ddp, path); // DDP -> bare and DataParallel
  torch::load(bare, path);
  torch::load(dp, path);
  EXPECT_TRUE(same(bare, ddp_net));
  EXPECT_TRUE(same(dp_net, ddp_net));

  examples::ConvNet other;
  torch::save(other, path); // bare -> DDP
  torch::load(ddp, path);
  EXPECT_TRUE(same(ddp_net, other));

  examples::ConvNet third;
  DataParallel<examples::ConvNet> dp3(third, DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  torch::save(dp3, path); // DataParallel -> DDP
  torch::load(ddp, path);
  EXPECT_TRUE(same(ddp_net, third));
}

} // namespace
} // namespace lockstep
