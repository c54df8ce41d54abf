// lockstep-run with lockstep-train under it: real processes, failures,
// restarts, signals, two nodes on one machine, bad command lines (two hosts: test_two_hosts.cpp).

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/launch.h"
#include "support/processes.h"

#include <examples/checkpoint.h>
#include <examples/idx.h>
#include <examples/models.h>
#include <tools/attempt.h>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <nlohmann/json.hpp>
#include <poll.h>
#include <pty.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <chrono>
#include <thread>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

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

// Under taskset (or a Slurm or cgroup cpuset) the ranks share the cores
// the launcher may use, not all the machine's.
TEST(Launcher, EachRanksThreadsAreItsShareOfTheCoresItMayUse) {
  auto p = testing::run({"/usr/bin/env", "-u", "OMP_NUM_THREADS", "taskset", "-c", "0", LOCKSTEP_RUN,
                         "--nproc-per-node", "1", "--master-port", port(), "/bin/sh", "-c",
                         "echo \"threads $OMP_NUM_THREADS\""},
                        {}, temp("affinity.log"), std::chrono::seconds(60));
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("[rank 0] threads 1\n"), std::string::npos) << p.output;
}

// The nodes of a static job share a run id (lockstep-train's runs/ID, where
// a restart finds its checkpoint) only when given one: --rdzv-id, as
// torchrun's users pass it. Without, each node's is its start time, and
// lockstep-run says so.
TEST(Launcher, StaticNodesTakeTheRunIdFromRdzvIdOrAreWarned) {
  // Node 1's output, with a node 0 of /bin/true beside it: the launchers
  // meet before their ranks start (Note [Static nodes add up their counts]).
  const auto run_node1 = [](const std::vector<std::string>& tail, const std::string& name) {
    const std::string master_port = port();
    std::vector<Process> nodes;
    for (int node : {0, 1}) {
      std::vector<std::string> args{LOCKSTEP_RUN, "--nnodes", "2", "--node-rank", std::to_string(node), "--master-addr",
                                    "127.0.0.1", "--master-port", master_port, "--nproc-per-node", "1"};
      args.insert(args.end(), tail.begin(), tail.end());
      if (node == 0) {
        args.back() = "true";
      }
      nodes.push_back(testing::start(args, {"LOCKSTEP_RUN_ID="}, temp(name + std::to_string(node) + ".log")));
    }
    testing::wait_all(nodes, std::chrono::seconds(60));
    EXPECT_EQ(nodes[0].exit_code, 0) << nodes[0].output;
    return nodes[1];
  };
  auto p = run_node1({"--rdzv-id", "job7", "/bin/sh", "-c", "echo \"id $LOCKSTEP_RUN_ID\""}, "run_id");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("[rank 1] id job7\n"), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("warning"), std::string::npos) << p.output;
  p = run_node1({"/bin/true"}, "no_run_id");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: warning: the run id is this node's start time"), std::string::npos)
      << p.output;
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
  EXPECT_NE(p.output.find("resumed from " + checkpoint + " at step 24 (epoch 2, sample 512 of 1024)"), std::string::npos) << p.output;
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

// A rank that comes after the others' timeout, under lockstep-run's store:
// rank 0 fails naming its rank, the join and what to do, where c10d's store
// said only "Wait timeout".
TEST(Launcher, ARankThatJoinsTooLateGivesAnErrorNamingTheJoin) {
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, {LOCKSTEP_DDP_WORKER, "late_join"}, "late_join",
                  {kOneThread});
  EXPECT_NE(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("lockstep: rank 0 of 2: joining the gloo group failed or did not complete within the "
                          "timeout of 3000 ms"), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("Pass a longer ProcessGroupOptions::timeout"), std::string::npos) << p.output;
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

TEST(InitProcessGroup, StoreThatNeverAnswersEndsTheRankWithinTheTimeout) {
  // A port that accepts connections (the kernel's backlog) but never answers:
  // the store client would wait on it forever.
  testing::ListeningSocket silent;
  ASSERT_TRUE(silent.ok);
  auto p = testing::run(trainer("silent_store"),
                        {"WORLD_SIZE=2", "RANK=1", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(silent.port),
                         "LOCKSTEP_TIMEOUT=2"},
                        temp("silent_store.log"), std::chrono::seconds(60));
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_LT(p.seconds, 10.0) << p.output;
  EXPECT_NE(p.output.find("2000 ms"), std::string::npos) << p.output; // the store's error, or the deadline's
}

// SIGHUP (a closed terminal) stops the job as gracefully as SIGTERM.
void expect_signal_stops_everything(int sig) {
  const std::string marker = "signal" + std::to_string(sig);
  auto args = with_flag(trainer(marker), "--epochs", "1000"); // long enough to be interrupted
  auto p = testing::start(launcher({"--nproc-per-node", "2", "--master-port", port()}, args), {}, temp(marker + ".log"));
  std::this_thread::sleep_for(std::chrono::seconds(4));
  kill(p.pid, sig);
  std::vector<Process> one{p};
  testing::wait_all(one, std::chrono::seconds(30));
  EXPECT_EQ(one[0].exit_code, 128 + sig) << one[0].output;
  EXPECT_NE(one[0].output.find("stopped by signal " + std::to_string(sig)), std::string::npos) << one[0].output;
  EXPECT_TRUE(testing::processes_with(temp(marker)).empty()) << "a rank outlived the launcher";
}

// A rank that saves on SIGTERM and outlasts the grace period is killed:
// the launcher says so, and how to give it longer, rather than end as if
// every rank had stopped cleanly.
TEST(Launcher, ARankKilledAfterTheGracePeriodOnASignalIsNamed) {
  const std::string marker = temp("grace_on_signal");
  const std::string ready = marker + ".ready";
  ::unlink(ready.c_str());
  auto p = testing::start(
      launcher({"--nproc-per-node", "1", "--master-port", port(), "--grace-period", "1"},
               {"/bin/sh", "-c", "trap 'echo saving; sleep 4; echo saved; exit 0' TERM; touch " + ready + "; while :; "
                "do sleep 0.1; done", marker}),
      {}, marker + ".log");
  for (int i = 0; i < 600 && ::access(ready.c_str(), F_OK) != 0; ++i) { // the trap is set
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(p.pid, SIGTERM);
  std::vector<Process> one{p};
  testing::wait_all(one, std::chrono::seconds(30));
  EXPECT_EQ(one[0].exit_code, 128 + SIGTERM) << one[0].output;
  EXPECT_NE(one[0].output.find("saving"), std::string::npos) << one[0].output;
  EXPECT_NE(one[0].output.find("was still running 1.0 s after the signal and was killed with SIGKILL"),
            std::string::npos) << one[0].output;
  EXPECT_NE(one[0].output.find("--grace-period SECONDS"), std::string::npos) << one[0].output;
}

// Once every rank has succeeded, the attempt is over: a look at the round
// (an elastic node's, which may see the round end in that same moment and
// would then run the job again) is not taken.
TEST(Launcher, AnAttemptWhoseRanksAllSucceededAsksNothingMore) {
  tools::RunOptions options;
  options.nproc_per_node = 1;
  options.command = {"/bin/sleep", "1"};
  tools::Placement placement;
  placement.file_store = true;
  tools::Attempt attempt(options, "/bin/sleep", placement);
  int looks = 0;
  const int root_cause = attempt.run([&] {
    if (++looks == 1) { // the first look, 0.1 s in: the rank runs, and ends during this one
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      return true;
    }
    return false; // "the round ended": asked after the rank succeeded, it would stop a finished attempt
  });
  EXPECT_EQ(root_cause, -1);
  EXPECT_LE(looks, 1); // 0 where the rank ended before the first look
}

TEST(Launcher, SigtermIsForwardedAndNothingRemains) {
  expect_signal_stops_everything(SIGTERM);
}

TEST(Launcher, SighupStopsTheJobLikeSigterm) {
  expect_signal_stops_everything(SIGHUP);
}

TEST(Launcher, SigquitStopsTheJobLikeSigterm) {
  expect_signal_stops_everything(SIGQUIT);
}

// `lockstep-run ... | head -n 1`: the launcher's next echo met a closed
// pipe, its SIGPIPE killed it, and every rank died with it.
TEST(Launcher, AReaderThatGoesAwayDoesNotEndTheJob) {
  const std::string done = temp("pipe_done");
  const std::string script = std::string(LOCKSTEP_RUN) + " --nproc-per-node 1 --master-port " + port() +
                             " /bin/sh -c 'echo first; sleep 1; echo second; sleep 1; touch " + done +
                             "' | head -n 1; echo \"launcher exit ${PIPESTATUS[0]}\"";
  auto p = testing::run({"/bin/bash", "-c", script}, {}, temp("pipe.log"), std::chrono::seconds(60));
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("launcher exit 0"), std::string::npos) << p.output;
  EXPECT_EQ(::access(done.c_str(), F_OK), 0) << "the rank did not finish\n" << p.output;
}

// Started with SIGCHLD ignored (exec keeps that), the launcher never saw
// a rank end: the kernel reaped it, and the launcher waited for good.
TEST(Launcher, AnInheritedIgnoredSigchldDoesNotHangTheLauncher) {
  const std::string script = "import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); "
                             "os.execv(sys.argv[1], sys.argv[1:])";
  auto p = testing::run({"/usr/bin/env", "python3", "-c", script, LOCKSTEP_RUN, "--nproc-per-node", "2",
                         "--master-port", port(), "/bin/sh", "-c", "[ \"$RANK\" = 1 ] && exit 3; exit 0"},
                        {}, temp("sigchld.log"), std::chrono::seconds(60));
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_LT(p.seconds, 30.0) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: rank 1 (local rank 1, pid "), std::string::npos) << p.output;
}

// Rank 1 fails; rank 0 fails 30 ms later, as a rank whose peer is gone
// does. Rank 1 holds its pipes open through a child, so only its exit
// tells that it ended. The root cause is rank 1, the first to end, not the
// lower index.
TEST(Launcher, TheRankThatFailedFirstIsTheRootCauseWhateverItsIndex) {
  const std::string flag = temp("first_failed");
  const std::string program = "if [ \"$RANK\" = 1 ]; then (sleep 5 &); touch " + flag + "; exit 3; fi; "
                              "while [ ! -e " + flag + " ]; do sleep 0.01; done; sleep 0.03; exit 4";
  auto p = testing::run({LOCKSTEP_RUN, "--nproc-per-node", "2", "--master-port", port(), "/bin/sh", "-c", program}, {},
                        temp("first_failed.log"), std::chrono::seconds(60));
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: rank 1 (local rank 1, pid "), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("lockstep-run: rank 0 (local rank 0, pid "), std::string::npos) << p.output;
}

TEST(Launcher, AcceptsTorchrunsSpellingsAndDoubleDash) {
  auto p = launch({"--nproc_per_node", "2", "--master_port", port(), "--"}, {"/bin/sh", "-c", "echo rank=$RANK"},
                  "spellings");
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("rank=1"), std::string::npos) << p.output;
}

// torchrun's command lines, flags included (Note [torchrun's flags]).
TEST(Launcher, TorchrunsFlagsWorkAndThoseWithoutEffectSaySoOnce) {
  auto p = launch({"--standalone", "--master-port", port(), "--nproc-per-node", "2", "--tee", "3", "--redirects", "3", "--role", "trainer",
                   "--local-ranks-filter", "1", "--no-python"},
                  {"/bin/sh", "-c", "echo \"role $ROLE_NAME rank $RANK\""}, "torchrun_flags");
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("[rank 1] role trainer rank 1"), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("[rank 0]"), std::string::npos) << "--local-ranks-filter 1 shows rank 1 alone: " << p.output;
  const std::string note = "lockstep-run: note: --tee has no effect: every rank's stdout and stderr reach the console";
  ASSERT_NE(p.output.find(note), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find(note, p.output.find(note) + 1), std::string::npos) << "said once: " << p.output;
  EXPECT_NE(p.output.find("lockstep-run: note: --redirects has no effect"), std::string::npos) << p.output;
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
  auto args = with_flag(trainer(marker), "--epochs", "1000"); // still running when the launcher dies
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

// Each attempt's pipes are closed at its end, even when a child of the rank
// (here one in a session of its own) still holds them open: the launcher's
// open files stay the same from attempt to attempt (they grew by 2 each).
// The rank counts them a moment after it starts: right after fork the
// launcher still holds the pipes' write ends and has yet to open the rank's
// pidfd, so an early count depends on which process ran first.
TEST(Launcher, EveryAttemptsPipesAreClosedAtItsEnd) {
  auto p = launch({"--nproc-per-node", "1", "--master-port", port(), "--max-restarts", "3", "--restart-delay", "0"},
                  {"/bin/sh", "-c", "sleep 0.3; echo fds=$(ls /proc/$PPID/fd | wc -l) >&2; setsid sleep 2 & exit 1"},
                  "pipes");
  EXPECT_NE(p.exit_code, 0) << p.output;
  std::vector<std::string> counts;
  const std::regex fds("\\[rank 0\\] fds=([0-9]+)");
  for (auto it = std::sregex_iterator(p.output.begin(), p.output.end(), fds); it != std::sregex_iterator(); ++it) {
    counts.push_back((*it)[1].str());
  }
  ASSERT_EQ(counts.size(), 4u) << p.output;
  for (const auto& count : counts) {
    EXPECT_EQ(count, counts[0]) << p.output;
  }
}

// Under a terminal (an interactive shell), a rank that reads stdin was
// stopped by SIGTTIN with its process group, and the launcher waited for
// good, silently. It now reads end of file and the job ends.
TEST(Launcher, ARankReadingATerminalDoesNotFreezeTheJob) {
  auto argv = launcher({"--nproc-per-node", "1", "--master-port", port()},
                       {"/bin/sh", "-c", "read x; echo read-status=$?"});
  std::vector<char*> args;
  for (auto& a : argv) {
    args.push_back(a.data());
  }
  args.push_back(nullptr);
  int terminal = -1;
  const pid_t pid = forkpty(&terminal, nullptr, nullptr, nullptr);
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execv(args[0], args.data());
    _exit(127);
  }
  std::string output;
  bool ended = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!ended && std::chrono::steady_clock::now() < until) {
    ended = waitpid(pid, nullptr, WNOHANG) == pid;
    pollfd ready{terminal, POLLIN, 0};
    char buffer[4096];
    if (poll(&ready, 1, 100) > 0) { // keep the terminal drained
      const ssize_t n = read(terminal, buffer, sizeof(buffer));
      output.append(buffer, n > 0 ? static_cast<size_t>(n) : 0);
    }
  }
  if (!ended) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  close(terminal);
  EXPECT_TRUE(ended) << "the launcher still waits for a rank stopped reading the terminal: " << output;
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
  testing::ListeningSocket someone;
  ASSERT_TRUE(someone.ok);
  const std::string taken = std::to_string(someone.port);
  auto p = launch({"--master-port", taken, "/bin/true"}, {}, "taken");
  EXPECT_EQ(p.exit_code, 2) << p.output;
  EXPECT_NE(p.output.find("port " + taken + " on 127.0.0.1 is already in use; pick another with --master-port"),
            std::string::npos) << p.output;
}

} // namespace
} // namespace lockstep
