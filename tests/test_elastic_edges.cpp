// Elastic jobs at their edges (Note [Elastic rendezvous] in
// tools/rendezvous.h): a node lost after another finished, a failure before
// another finished, nodes that disagree on the job or belong to another,
// an address that cannot be one, and signals while a node joins or runs.
// lockstep-run nodes on one machine, with shell programs for ranks.

#include "support/elastic_job.h"
#include "support/launch.h"
#include "support/processes.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace {
namespace elastic_edges { // its own scope under unity builds (Note [Unity test builds])

using namespace testing::jobs;
using testing::Process;

// Three nodes of a 1:3 job: one finishes, then another's launcher is
// killed while the third still runs. The third took the loss for a change
// of membership, ran its part again alone and exited 0, though the killed
// node's part never finished (Note [A failure after the job finished
// elsewhere]): the job failed, and the third says which node was lost.
TEST(Elastic, ANodeLostAfterAnotherFinishedFailsTheJobRatherThanRunAgainAlone) {
  ElasticJob job("elastic_lost_after_done", "1:3");
  job.rdzv_conf = "last_call_timeout=30,keep_alive_interval=0.25,keep_alive_max_attempt=4,join_timeout=60"; // closes at 3
  const std::string running = temp("elastic_lost_after_done_running");
  ::unlink(running.c_str());
  job.program = {"/bin/sh", "-c", "case \"$ROLE\" in host) sleep 12;; done) exit 0;; lost) touch " + running +
                                  "; sleep 60;; esac"};
  job.start_node({"ROLE=host"});
  ASSERT_TRUE(wait_for_listener(job.endpoint));
  job.start_node({"ROLE=done"});
  job.start_node({"ROLE=lost"});
  ASSERT_TRUE(wait_for_file(running, 60)) << "the round never ran";
  std::this_thread::sleep_for(std::chrono::seconds(1)); // the node whose rank exits at once is done
  kill_node(job.nodes[2]);
  std::vector<Process> left{job.nodes[0], job.nodes[1]};
  testing::wait_all(left, kDeadline);
  const std::string& host = left[0].output;
  EXPECT_EQ(left[1].exit_code, 0) << left[1].output;
  EXPECT_EQ(left[0].exit_code, 1) << host;
  EXPECT_TRUE(std::regex_search(host, std::regex("lockstep-run: node [12] was lost \\(no heartbeat for 1.0 s\\) before its "
                                                 "ranks finished, after node\\(s\\) [12] had finished the job: a new "
                                                 "round cannot bring the finished nodes back, so the job failed")))
      << host;
  EXPECT_EQ(host.find("round 1"), std::string::npos) << "it ran the job again alone: " << host;
  EXPECT_LT(left[0].seconds, 11) << "its rank (12 s) was not stopped: " << host;
}

// A node of --nnodes 2 at the endpoint of a job of --nnodes 1 waited
// behind it, then exited 0, "nothing to do", having run nothing (Note [The
// job's first node sets its terms]): it is refused at once, told both.
TEST(Elastic, ANodeOfAnotherNnodesThanTheJobsFirstNodeIsRefused) {
  ElasticJob job("elastic_other_nnodes", "1");
  job.program = {"/bin/sh", "-c", "sleep 4"};
  job.start_host();
  const auto other = launch({"--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", job.endpoint, "--rdzv-id",
                             job.name, "--rdzv-conf", job.rdzv_conf}, job.program, "elastic_other_nnodes_second");
  testing::wait_all(job.nodes, kDeadline);
  EXPECT_EQ(job.nodes[0].exit_code, 0) << job.nodes[0].output;
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("lockstep-run: this node has --nnodes 2, but the job at --rdzv-endpoint " + job.endpoint +
                              " was started with --nnodes 1 by its first node: give every node of the job the same "
                              "--nnodes."), std::string::npos) << other.output;
  EXPECT_EQ(other.output.find("round"), std::string::npos) << other.output;
  EXPECT_LT(other.seconds, 3) << "it waited for the job to end: " << other.output;
}

// Two jobs without --rdzv-id at one endpoint (one machine's default port)
// met as one: each node ran its own program as a rank of the other's job
// (Note [The rendezvous's id]). Their programs tell them apart; the nodes
// of one job without an id still meet.
TEST(Elastic, TwoJobsWithoutAnIdAtOneEndpointAreToldApartByTheirPrograms) {
  std::string endpoint = "127.0.0.1:" + port();
  auto flags = [&endpoint](const std::string& nnodes) {
    return std::vector<std::string>{"--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                                    "--rdzv-conf", kQuickRendezvous};
  };
  const std::vector<std::string> no_id{kOneThread, "SLURM_JOB_ID="}; // under Slurm too: no job id
  std::vector<Process> first{testing::start(launcher(flags("1:2"), {"/bin/sh", "-c", "sleep 4; echo first job"}), no_id,
                                            temp("elastic_no_id_first.log"))};
  ASSERT_TRUE(wait_for_listener(endpoint));
  const auto second = launch(flags("1:2"), {"/bin/sh", "-c", "echo second job"}, "elastic_no_id_second", no_id);
  testing::wait_all(first, kDeadline);
  EXPECT_EQ(first[0].exit_code, 0) << first[0].output;
  EXPECT_EQ(second.exit_code, 2) << second.output;
  EXPECT_NE(second.output.find("lockstep-run: another job serves the rendezvous at --rdzv-endpoint " + endpoint +
                               ": its first node runs '/bin/sh -c \"sleep 4; echo first job\"', this node '/bin/sh -c "
                               "\"echo second job\"', and neither job has an id"), std::string::npos) << second.output;
  EXPECT_EQ(second.output.find("[rank"), std::string::npos) << "it ran in the other job: " << second.output;
  EXPECT_EQ(first[0].output.find("round 0: 2 node(s)"), std::string::npos) << first[0].output;

  endpoint = "127.0.0.1:" + port(); // one job of two nodes, neither with an id
  std::vector<Process> pair;
  for (int i = 0; i < 2; ++i) {
    pair.push_back(testing::start(launcher(flags("2:2"), {"/bin/true"}), no_id,
                                  temp("elastic_no_id_pair" + std::to_string(i) + ".log")));
  }
  testing::wait_all(pair, kDeadline);
  for (const auto& node : pair) {
    EXPECT_EQ(node.exit_code, 0) << node.output;
    EXPECT_NE(node.output.find("round 0: 2 node(s), 2 rank(s)"), std::string::npos) << node.output;
  }
}

// A --local-addr that cannot be an address would break the rendezvous's
// records, which separate fields with ',' and ';': it is a usage error
// (exit 2) at start, on the node given it, and no other node is harmed.
TEST(Elastic, ALocalAddrThatCannotBeAnAddressIsAUsageErrorNotACrash) {
  for (const std::string bad : {"host;x", "b,x"}) {
    const auto p = launch({"--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:" + port(), "--rdzv-conf",
                           "last_call_timeout=0.5", "--local-addr", bad}, {"/bin/true"}, "elastic_bad_local_addr");
    EXPECT_EQ(p.exit_code, 2) << p.output;
    EXPECT_NE(p.output.find("lockstep-run: --local-addr '" + bad + "' holds a comma, a semicolon, a space or a control "
                            "character"), std::string::npos) << p.output;
    EXPECT_EQ(p.output.find("terminate called"), std::string::npos) << p.output;
  }
}

// Rank 1 fails at 1 s, rank 0 on the other node finishes at 3 s, within the
// failing node's liveness window. That was read as a failure after the
// job had finished: no restart, both nodes exit 1. The failure came first
// (Note [Which came first, a failure or a member done]): the round
// restarts on both nodes, and the job finishes.
TEST(Elastic, AFailureBeforeAnotherNodeFinishedIsRestartedOnEveryNode) {
  ElasticJob job("elastic_failure_first", "2:2");
  job.rdzv_conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4,join_timeout=60"; // window 4 s
  job.extra = {"--max-restarts", "1"};
  job.program = {"/bin/sh", "-c", "if [ \"$ROLE\" = fail ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 1; "
                                  "exit 3; fi; sleep 3"};
  job.start_node({"ROLE=finish"});
  ASSERT_TRUE(wait_for_listener(job.endpoint));
  job.start_node({"ROLE=fail"});
  testing::wait_all(job.nodes, kDeadline);
  for (const auto& node : job.nodes) {
    EXPECT_EQ(node.exit_code, 0) << node.output;
    EXPECT_NE(node.output.find("restarting every rank in a new round (restart 1 of 1)"), std::string::npos)
        << node.output;
    EXPECT_NE(node.output.find("round 1: 2 node(s), 2 rank(s)"), std::string::npos) << node.output;
    EXPECT_EQ(node.output.find("had finished the job"), std::string::npos) << node.output;
  }
  EXPECT_NE(job.nodes[0].output.find("this node's ranks finished, but a rank of another node had failed before in "
                                     "this round"), std::string::npos) << job.nodes[0].output;
  EXPECT_NE(job.nodes[1].output.find("lockstep-run: waiting up to 5.0 s (a liveness window) before counting this "
                                     "failure"), std::string::npos) << job.nodes[1].output;
}

// A rank failure on the round's only node waited a liveness window and a
// keep-alive interval (20 s at torchrun's defaults), saying nothing, for
// a node to lose; and --restart-delay did nothing in an elastic job.
TEST(Elastic, AFailureOnTheOnlyNodeCountsAtOnceAndTheRestartWaitsTheRestartDelay) {
  const auto p = launch({"--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:" + port(),
                         "--rdzv-id", "elastic_alone_fails", "--rdzv-conf", "last_call_timeout=0.5", "--max-restarts",
                         "1", "--restart-delay", "2"},
                        {"/bin/sh", "-c", "[ \"$TORCHELASTIC_RESTART_COUNT\" = 1 ] || exit 3"}, "elastic_alone_fails");
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: restarting every rank in a new round (restart 1 of 1) in 2.0 s "
                          "(--restart-delay)."), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("waiting up to"), std::string::npos) << "no other node to lose: " << p.output;
  EXPECT_GE(p.seconds, 2) << p.output;
  EXPECT_LT(p.seconds, 12) << p.output;
}

// A launcher stopped while it waited to join its first round said "every
// rank was stopped": none had started.
TEST(Elastic, ASignalWhileWaitingToJoinSaysNoRankHadStarted) {
  ElasticJob job("elastic_signal_joining", "2:2");
  job.program = {"/bin/true"};
  job.start_host();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  kill(job.nodes[0].pid, SIGTERM);
  testing::wait_all(job.nodes, kDeadline);
  EXPECT_EQ(job.nodes[0].exit_code, 128 + SIGTERM) << job.nodes[0].output;
  EXPECT_NE(job.nodes[0].output.find("lockstep-run: stopped by signal 15 while this node waited to join a round; no "
                                     "rank had started."), std::string::npos) << job.nodes[0].output;
  EXPECT_EQ(job.nodes[0].output.find("every rank was stopped"), std::string::npos) << job.nodes[0].output;
}

// A node whose launcher a signal stops (scancel, a preempted machine) says
// so as it leaves; the others waited the liveness window (15 s at
// torchrun's defaults) before a round without it.
TEST(Elastic, ANodeStoppedByASignalIsLostAtOnce) {
  ElasticJob job("elastic_signalled_member", "1:2");
  job.rdzv_conf = "last_call_timeout=1,join_timeout=60"; // keep-alive: torchrun's 5 s x 3
  const std::string running = temp("elastic_signalled_member_running");
  ::unlink((running + "0").c_str());
  ::unlink((running + "1").c_str());
  job.program = {"/bin/sh", "-c", "[ \"$GROUP_WORLD_SIZE\" = 1 ] && exit 0; touch " + running + "$RANK; sleep 60"};
  job.start_host();
  job.start_node();
  ASSERT_TRUE(wait_for_file(running + "0", 60) && wait_for_file(running + "1", 60)) << "the round never ran";
  const double signalled_at =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - job.nodes[0].start).count();
  kill(job.nodes[1].pid, SIGTERM);
  testing::wait_all(job.nodes, kDeadline);
  EXPECT_EQ(job.nodes[1].exit_code, 128 + SIGTERM) << job.nodes[1].output;
  EXPECT_EQ(job.nodes[0].exit_code, 0) << job.nodes[0].output;
  EXPECT_NE(job.nodes[0].output.find("lockstep-run: node 1 is lost: its launcher was stopped by signal 15; starting a "
                                     "new round without it."), std::string::npos)
      << job.nodes[0].output;
  EXPECT_LT(job.nodes[0].seconds - signalled_at, 10) << job.nodes[0].output;
}

} // namespace elastic_edges
} // namespace
} // namespace lockstep
