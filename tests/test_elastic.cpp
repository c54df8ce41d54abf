// Elastic jobs on one machine: lockstep-run launchers at --nnodes MIN:MAX
// meeting at one --rdzv-endpoint, with lockstep-train under them. Ports of
// TorchElastic's agent tests (test_double_agent_fault_tolerance,
// test_double_agent_elastic), a node that joins, a failure that counts, the
// store's host lost, and torchrun's own elastic agent running lockstep.

#include "support/elastic_job.h"
#include "support/launch.h"
#include "support/processes.h"

#include <tools/kv_store.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

std::string sample_counts(const std::string& output) {
  std::smatch m;
  return std::regex_search(output, m, std::regex("sample counts: [^\n]*")) ? m[0].str() : "";
}

const std::string kEverySampleTwice = "sample counts: each of the 8192 training samples trained 2 time(s), once per epoch";

// The same job uninterrupted: 2 ranks on one node.
const std::string& uninterrupted_hash() {
  static const std::string hash = [] {
    auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, long_trainer("elastic_reference"),
                    "elastic_reference", {kOneThread});
    EXPECT_EQ(p.exit_code, 0) << p.output;
    return final_hash(p.output);
  }();
  return hash;
}

// test_double_agent_fault_tolerance: two nodes of a 2:2 job; one is killed
// mid-run and started again. Both finish, and the job is the uninterrupted
// one bit for bit: the new round resumes from the checkpoint at world size 2.
TEST(Elastic, DoubleAgentFaultTolerance) {
  ElasticJob job("fault_tolerance", "2:2");
  job.start_host();
  job.start_node();
  ASSERT_TRUE(wait_for_file(job.checkpoint(), 60)) << "the job never wrote its first checkpoint";
  kill_node(job.nodes[1]);
  job.nodes.erase(job.nodes.begin() + 1);
  job.start_node();
  testing::wait_all(job.nodes, kDeadline);
  for (const auto& node : job.nodes) {
    EXPECT_EQ(node.exit_code, 0) << node.output;
  }
  const std::string& survivor = job.nodes[0].output;
  EXPECT_TRUE(std::regex_search(survivor, std::regex("lockstep-run: node [0-9]+ is lost: no heartbeat for 1.0 s")))
      << survivor;
  EXPECT_NE(survivor.find("the membership changed; not counted as a restart."), std::string::npos) << survivor;
  EXPECT_NE(survivor.find("round 1: 2 node(s), 2 rank(s)"), std::string::npos) << survivor;
  const std::string both = survivor + job.nodes[1].output; // rank 0 is on either
  EXPECT_NE(both.find("lockstep-train: resumed from " + job.checkpoint()), std::string::npos) << both;
  EXPECT_EQ(sample_counts(both), kEverySampleTwice) << both;
  EXPECT_EQ(final_hash(both), uninterrupted_hash()) << both;
  EXPECT_FALSE(uninterrupted_hash().empty());
}

// Starts `job`'s two nodes, kills the second once the first checkpoint is
// written, and waits for the first to finish alone.
void lose_a_node(ElasticJob& job) {
  job.start_host();
  job.start_node();
  ASSERT_TRUE(wait_for_file(job.checkpoint(), 60)) << "the job never wrote its first checkpoint";
  kill_node(job.nodes[1]);
  testing::wait_all(job.nodes, kDeadline);
}

// test_double_agent_elastic: a 1:2 job loses a node for good; the other
// finishes alone, from the checkpoint, at world size 1, and says so.
TEST(Elastic, DoubleAgentElasticShrinksToTheSurvivor) {
  ElasticJob job("elastic_shrink", "1:2");
  ASSERT_NO_FATAL_FAILURE(lose_a_node(job));
  const std::string& survivor = job.nodes[0].output;
  EXPECT_EQ(job.nodes[0].exit_code, 0) << survivor;
  EXPECT_NE(survivor.find("lockstep-run: membership changed: world size 2 -> 1"), std::string::npos) << survivor;
  EXPECT_NE(survivor.find("round 1: 1 node(s), 1 rank(s)"), std::string::npos) << survivor;
  EXPECT_NE(survivor.find("restarts so far: 0"), std::string::npos) << survivor;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(survivor, m, std::regex("membership change: world size 2 -> 1 at step ([0-9]+); the "
                                                        "global batch stays 64 \\(64 rows per rank\\)"))) << survivor;
  EXPECT_EQ(sample_counts(survivor), kEverySampleTwice) << survivor;
  // metrics.jsonl keeps the change as an event.
  std::ifstream metrics(temp("elastic_shrink_out") + "/metrics.jsonl");
  int events = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record["kind"] == "membership") {
      ++events;
      EXPECT_EQ(record["old_world_size"], 2);
      EXPECT_EQ(record["new_world_size"], 1);
      EXPECT_EQ(record["step"].get<int64_t>(), std::stoll(m[1].str()));
    }
  }
  EXPECT_EQ(events, 1);
}

// lockstep-train --deterministic on 8192 samples, batches of 4 micro-batches.
std::vector<std::string> deterministic_trainer(const std::string& name) {
  auto args = long_trainer(name);
  args.insert(args.end(), {"--deterministic", "--micro-batch-size", "16"});
  return args;
}

// The hash of deterministic_trainer's job on 2 ranks that nothing interrupts.
const std::string& deterministic_hash() {
  static const std::string hash = [] {
    const auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, deterministic_trainer("deterministic_whole"),
                          "deterministic_whole", {kOneThread});
    EXPECT_EQ(p.exit_code, 0) << p.output;
    EXPECT_FALSE(final_hash(p.output).empty()) << p.output;
    return final_hash(p.output);
  }();
  return hash;
}

// Note [The same bits at any world size]: under lockstep-train
// --deterministic, the job that lost a node and went on alone from its
// checkpoint ends with the parameters of a job that never lost one.
TEST(Elastic, DeterministicShrinkEndsWithTheUninterruptedParameters) {
  ElasticJob job("deterministic_shrink", "1:2");
  job.program = deterministic_trainer(job.name);
  ASSERT_NO_FATAL_FAILURE(lose_a_node(job));
  const std::string& survivor = job.nodes[0].output;
  ASSERT_EQ(job.nodes[0].exit_code, 0) << survivor;
  EXPECT_NE(survivor.find("membership change: world size 2 -> 1"), std::string::npos) << survivor;
  EXPECT_EQ(final_hash(survivor), deterministic_hash()) << survivor;
}

// The same when a node joins a job that runs alone: it grows to 2 ranks
// from the checkpoint, and ends with the uninterrupted job's parameters.
TEST(Elastic, DeterministicGrowthEndsWithTheUninterruptedParameters) {
  ElasticJob job("deterministic_grow", "1:2");
  job.program = deterministic_trainer(job.name);
  job.start_host();
  ASSERT_TRUE(wait_for_file(job.checkpoint(), 60)) << "the job never wrote its first checkpoint";
  job.start_node();
  testing::wait_all(job.nodes, kDeadline);
  const std::string& first = job.nodes[0].output;
  ASSERT_EQ(job.nodes[0].exit_code, 0) << first;
  EXPECT_NE(first.find("membership change: world size 1 -> 2 at step"), std::string::npos) << first;
  EXPECT_EQ(final_hash(first), deterministic_hash()) << first;
}

// A node that arrives while a 1:2 job runs alone waits; the running node
// sees it and starts a round with both.
TEST(Elastic, NodeJoiningARunningJobGrowsIt) {
  ElasticJob job("elastic_grow", "1:2");
  job.start_host();
  ASSERT_TRUE(wait_for_file(job.checkpoint(), 60)) << "the job never wrote its first checkpoint";
  job.start_node();
  testing::wait_all(job.nodes, kDeadline);
  for (const auto& node : job.nodes) {
    EXPECT_EQ(node.exit_code, 0) << node.output;
  }
  const std::string& first = job.nodes[0].output;
  EXPECT_NE(first.find("lockstep-run: a node waits to join; starting a new round with it."), std::string::npos) << first;
  EXPECT_NE(first.find("membership change: world size 1 -> 2 at step"), std::string::npos) << first;
  EXPECT_NE(job.nodes[1].output.find("round 0 runs without this node; waiting for the next round."), std::string::npos)
      << job.nodes[1].output;
  EXPECT_EQ(sample_counts(first), kEverySampleTwice) << first;
}

// A rank that fails is a failure, not a change of membership: it counts
// against --max-restarts, on every node, and the restarted round (restart
// count 1) runs without the injected fault.
TEST(Elastic, RankFailureCountsAsARestartOnEveryNode) {
  ElasticJob job("elastic_failure", "2:2");
  job.extra = {"--max-restarts", "1"};
  job.start_node({"LOCKSTEP_FAULT=1:6"});
  job.start_node({"LOCKSTEP_FAULT=1:6"});
  testing::wait_all(job.nodes, kDeadline);
  for (const auto& node : job.nodes) {
    EXPECT_EQ(node.exit_code, 0) << node.output;
    EXPECT_NE(node.output.find("restarting every rank in a new round (restart 1 of 1)"), std::string::npos) << node.output;
    EXPECT_NE(node.output.find("round 1: 2 node(s), 2 rank(s)"), std::string::npos) << node.output;
    EXPECT_NE(node.output.find("(restarts so far: 1)"), std::string::npos) << node.output;
  }
  // Rank 0, on either node, reports the counts.
  EXPECT_EQ(sample_counts(job.nodes[0].output + job.nodes[1].output), kEverySampleTwice)
      << job.nodes[0].output << job.nodes[1].output;
}

// A rank that fails after another node has finished the job (a crash at
// exit, a last write) cannot be restarted: that node is gone. The failing
// node exits 1 rather than restart, wait for a round nobody joins, find the
// job complete and exit 0; the node that serves the store reports it too.
TEST(Elastic, AFailureAfterAnotherNodeFinishedFailsTheJob) {
  ElasticJob job("elastic_late_failure", "2:2");
  job.extra = {"--max-restarts", "2"};
  job.program = {"/bin/sh", "-c", "if [ -n \"$LATE_FAILURE\" ]; then sleep 2; exit 3; fi"};
  job.start_host();
  job.start_node({"LATE_FAILURE=1"});
  testing::wait_all(job.nodes, kDeadline);
  const auto& host = job.nodes[0];
  const auto& failing = job.nodes[1];
  EXPECT_EQ(failing.exit_code, 1) << failing.output;
  EXPECT_NE(failing.output.find("after node(s) 0 had finished the job; a restart cannot bring them back"),
            std::string::npos) << failing.output << "(nodes are numbered by GROUP_RANK)";
  EXPECT_EQ(failing.output.find("restarting every rank"), std::string::npos) << failing.output;
  EXPECT_EQ(host.exit_code, 1) << host.output;
  EXPECT_NE(host.output.find("node(s) 1 left the job before theirs had (a failure, or a signal: see their logs); the job "
                             "failed."),
            std::string::npos) << host.output;
}

// The same with a third node still running (1:3): the failing node leaves
// the job with a failure, and the node still running stops its ranks and
// fails with it, rather than take the silent node for lost and run the job
// again without it (exit 0).
TEST(Elastic, ANodeThatLeftWithAFailureEndsTheJobOnTheNodesStillRunning) {
  ElasticJob job("elastic_left_failed", "1:3");
  job.rdzv_conf = "last_call_timeout=30,keep_alive_interval=0.25,keep_alive_max_attempt=4,join_timeout=60"; // closes at 3
  job.extra = {"--max-restarts", "0"};
  job.program = {"/bin/sh", "-c", "case \"$ROLE\" in host) sleep 10;; fail) sleep 2; exit 1;; esac"};
  job.start_node({"ROLE=host"});
  ASSERT_TRUE(wait_for_listener(job.endpoint));
  job.start_node({"ROLE=done"});
  job.start_node({"ROLE=fail"});
  testing::wait_all(job.nodes, kDeadline);
  const auto& host = job.nodes[0];
  EXPECT_EQ(job.nodes[1].exit_code, 0) << job.nodes[1].output;
  EXPECT_EQ(job.nodes[2].exit_code, 1) << job.nodes[2].output;
  EXPECT_EQ(host.exit_code, 1) << host.output;
  EXPECT_TRUE(std::regex_search(host.output, std::regex("lockstep-run: node [12] left the job with a failure \\(exit "
                                                        "code 1; see its log\\): the job failed, so this node stops "
                                                        "its ranks"))) << host.output;
  EXPECT_EQ(host.output.find("is lost"), std::string::npos) << host.output;
  EXPECT_EQ(host.output.find("round 1"), std::string::npos) << host.output;
  EXPECT_LT(host.seconds, 9) << "its rank (10 s) was not stopped: " << host.output;
}

// The node of `job` that waited behind a round it was left out of.
const Process* waiting_node(const ElasticJob& job) {
  for (const auto& node : job.nodes) {
    if (node.output.find("round 0 runs without this node; waiting for the next round.") != std::string::npos) {
      return &node;
    }
  }
  return nullptr;
}

// A third node of a 2:2 job waits; a member fails after the other finished.
// The job failed: the waiting node says so and exits 1, not "completed" and 0.
TEST(Elastic, ANodeWaitingWhenTheJobFailsAfterAnotherFinishedExitsWithTheFailure) {
  ElasticJob job("elastic_wait_late_failure", "2:2");
  job.program = {"/bin/sh", "-c", "if [ \"$ROLE\" = host ]; then sleep 1; exit 0; fi; sleep 3; exit 1"};
  job.start_node({"ROLE=host"});
  ASSERT_TRUE(wait_for_listener(job.endpoint));
  job.start_node();
  std::this_thread::sleep_for(std::chrono::milliseconds(500)); // round 0 closes with the first two
  job.start_node();
  testing::wait_all(job.nodes, kDeadline);
  const Process* waiting = waiting_node(job);
  ASSERT_NE(waiting, nullptr) << job.nodes[1].output << job.nodes[2].output;
  EXPECT_EQ(waiting->exit_code, 1) << waiting->output;
  EXPECT_NE(waiting->output.find("the job ended while this node waited to join: node(s) 1 left it with a failure (a "
                                 "rank failed after node(s) 0 had finished the job); see their logs."),
            std::string::npos) << waiting->output;
  EXPECT_EQ(waiting->output.find("the job completed"), std::string::npos) << waiting->output;
  EXPECT_EQ(job.nodes[0].exit_code, 1) << job.nodes[0].output;
}

// Starts a 2:2 job of three nodes whose ranks all fail after 2 s, with no
// restarts: the first two make round 0, the third waits behind it.
void give_up_with_a_node_waiting(ElasticJob& job) {
  job.extra = {"--max-restarts", "0"};
  job.program = {"/bin/sh", "-c", "sleep 2; exit 1"};
  job.start_host();
  job.start_node();
  std::this_thread::sleep_for(std::chrono::milliseconds(500)); // round 0 closes with the first two
  job.start_node();
  testing::wait_all(job.nodes, kDeadline);
}

// What a node waiting behind a job that gave up says.
const std::regex kGaveUpWhileWaiting("the job ended while this node waited to join: node\\(s\\) [01] left it with a "
                                     "failure \\(gave up after 0 restart\\(s\\) of --max-restarts 0\\); see "
                                     "their logs.");

// The members of a 2:2 job fail with no restarts left and give up while a
// third node waits, under a store that outlives them (here the test's; the
// launcher serving it could be the waiting node). The waiting node stops at
// once and says why, rather than wait join_timeout (60 s here) in a round
// nobody joins and blame the nodes that did not.
TEST(Elastic, ANodeWaitingWhenTheJobGivesUpStopsAtOnceSayingWhy) {
  ElasticJob job("elastic_wait_give_up", "2:2");
  job.rdzv_conf = kQuickRendezvous + ",is_host=false";
  const int store_port = std::stoi(job.endpoint.substr(job.endpoint.rfind(':') + 1));
  const auto bound = detail::bind_first(detail::resolve_tcp("127.0.0.1", store_port), true, true);
  ASSERT_GE(bound.fd, 0);
  tools::KvServer store(bound.fd, {{tools::kServedJobKey, job.name}});
  give_up_with_a_node_waiting(job);
  const Process* waiting = waiting_node(job);
  ASSERT_NE(waiting, nullptr) << job.nodes[0].output << job.nodes[1].output << job.nodes[2].output;
  EXPECT_EQ(waiting->exit_code, 1) << waiting->output;
  EXPECT_TRUE(std::regex_search(waiting->output, kGaveUpWhileWaiting)) << waiting->output;
  EXPECT_EQ(waiting->output.find("join_timeout"), std::string::npos) << waiting->output;
  EXPECT_LT(waiting->seconds, 20) << waiting->output;
}

// The same when the launcher that serves the store is a member that gives
// up: the waiting node reads why before the store goes, rather than fail on
// the lost store.
TEST(Elastic, ANodeWaitingWhenTheStoresNodeGivesUpHearsWhy) {
  ElasticJob job("elastic_wait_host_gives_up", "2:2");
  give_up_with_a_node_waiting(job);
  const Process* waiting = waiting_node(job);
  ASSERT_NE(waiting, nullptr) << job.nodes[0].output << job.nodes[1].output << job.nodes[2].output;
  EXPECT_EQ(waiting->exit_code, 1) << waiting->output;
  EXPECT_TRUE(std::regex_search(waiting->output, kGaveUpWhileWaiting)) << waiting->output;
  EXPECT_EQ(waiting->output.find("rendezvous store at"), std::string::npos) << waiting->output;
}

// A SIGTERM to the node that serves the store while every node's ranks run
// stops it within moments: it does not wait two liveness windows (30 s at
// torchrun's defaults) for the other nodes to leave.
TEST(Elastic, ASignalToTheStoresNodeStopsItAtOnce) {
  ElasticJob job("elastic_signal_host", "2:2");
  job.rdzv_conf = "last_call_timeout=1,join_timeout=60"; // keep-alive: torchrun's 5 s x 3
  const std::string running = temp("elastic_signal_host_running");
  ::unlink((running + "0").c_str());
  ::unlink((running + "1").c_str());
  job.program = {"/bin/sh", "-c", "touch " + running + "$RANK; sleep 60"};
  job.start_host();
  job.start_node();
  ASSERT_TRUE(wait_for_file(running + "0", 60) && wait_for_file(running + "1", 60)) << "the round never ran";
  std::vector<Process> host{job.nodes[0]};
  const double signalled_at = std::chrono::duration<double>(std::chrono::steady_clock::now() - host[0].start).count();
  kill(host[0].pid, SIGTERM);
  testing::wait_all(host, kDeadline);
  kill_node(job.nodes[1]);
  EXPECT_EQ(host[0].exit_code, 128 + SIGTERM) << host[0].output;
  EXPECT_NE(host[0].output.find("lockstep-run: stopped by signal 15"), std::string::npos) << host[0].output;
  EXPECT_LT(host[0].seconds - signalled_at, 5) << host[0].output;
}

// The node that serves the store finished its ranks and waits for the other
// node's; a SIGTERM then (scancel, a time limit) ends it with 143, not the
// 0 of a completed job, and the other node, losing the store, fails too.
TEST(Elastic, ASignalToTheStoresNodeWaitingForTheOthersIsAFailure) {
  ElasticJob job("elastic_stopped_host", "2:2");
  job.program = {"/bin/sh", "-c", "[ \"$ROLE\" = host ] && exit 0; sleep 30"};
  job.start_node({"ROLE=host"});
  ASSERT_TRUE(wait_for_listener(job.endpoint));
  job.start_node();
  std::this_thread::sleep_for(std::chrono::seconds(4)); // the round runs; the host's rank is done
  kill(job.nodes[0].pid, SIGTERM);
  testing::wait_all(job.nodes, kDeadline);
  EXPECT_EQ(job.nodes[0].exit_code, 128 + SIGTERM) << job.nodes[0].output;
  EXPECT_NE(job.nodes[0].output.find("the job did not complete"), std::string::npos) << job.nodes[0].output;
  EXPECT_NE(job.nodes[1].exit_code, 0) << job.nodes[1].output;
}

// Ctrl-C to a node still waiting for the store (its host not started yet)
// stops it as a signal does, 128 + SIGINT, not as a lost store (exit 1).
// Its wait named the store's endpoint only inside a garbled sentence.
TEST(Elastic, ASignalWhileWaitingForTheStoreStopsTheNodeAsASignal) {
  const std::string endpoint = "127.0.0.1:" + port();
  auto node = testing::start(launcher({"--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                                       "--rdzv-id", "waiting", "--rdzv-conf", "is_host=false,join_timeout=60"},
                                      {"/bin/true"}),
                             {kOneThread}, temp("elastic_waiting.log"));
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  kill(node.pid, SIGINT);
  std::vector<Process> nodes{node};
  testing::wait_all(nodes, kDeadline);
  EXPECT_EQ(nodes[0].exit_code, 128 + SIGINT) << nodes[0].output;
  EXPECT_NE(nodes[0].output.find("stopped by signal 2 while it waited for the rendezvous store at " + endpoint),
            std::string::npos) << nodes[0].output;
  // The wait itself names the store, then why the last try failed.
  EXPECT_NE(nodes[0].output.find("waiting up to join_timeout (60 s) for the store at " + endpoint + ", which the "
                                 "launcher on that machine serves: "), std::string::npos) << nodes[0].output;
}

// The node that serves the store finished its ranks; the other node's
// machine then dies (its launcher SIGKILLed) before its ranks finish. Its
// part of the job never finished: the store's node names it and exits 1.
TEST(Elastic, ANodeLostBeforeItsRanksFinishedFailsTheJob) {
  ElasticJob job("elastic_vanished", "2:2");
  job.program = {"/bin/sh", "-c", "[ \"$ROLE\" = host ] && exit 0; sleep 30"};
  job.start_node({"ROLE=host"});
  ASSERT_TRUE(wait_for_listener(job.endpoint));
  job.start_node();
  std::this_thread::sleep_for(std::chrono::seconds(4)); // the round runs; the host's rank is done
  kill_node(job.nodes[1]);
  job.nodes.pop_back();
  testing::wait_all(job.nodes, kDeadline);
  const std::string& host = job.nodes[0].output;
  EXPECT_EQ(job.nodes[0].exit_code, 1) << host;
  // Nodes are numbered by GROUP_RANK in every message: the lost node is 1 (its node id, 2, is not shown).
  EXPECT_NE(host.find("lockstep-run: this node joins round 0 of the rendezvous at " + job.endpoint), std::string::npos)
      << host;
  EXPECT_NE(host.find("this node is node 0, ranks 0 to 0"), std::string::npos) << host;
  EXPECT_NE(host.find("this node's ranks finished, but node(s) 1 stopped answering (no heartbeat for 1.0 s) before "
                      "saying theirs had; their part of the job did not finish, so the job failed."),
            std::string::npos)
      << host;
}

TEST(Elastic, FailureBeyondMaxRestartsEndsEveryNode) {
  ElasticJob job("elastic_give_up", "2:2");
  job.start_node({"LOCKSTEP_FAULT=1:6"});
  job.start_node({"LOCKSTEP_FAULT=1:6"});
  testing::wait_all(job.nodes, kDeadline);
  for (const auto& node : job.nodes) {
    EXPECT_EQ(node.exit_code, 1) << node.output;
    EXPECT_NE(node.output.find("lockstep-run: giving up after 0 restart(s)."), std::string::npos) << node.output;
  }
}

// Two jobs at one --rdzv-endpoint met in the first one's store, and the
// second died when the first ended (Note [One store, one job]): the second
// is refused at start, told which job holds the port.
TEST(Elastic, ASecondJobAtTheSameEndpointIsRefusedNamingTheFirst) {
  ElasticJob first("elastic_first_job", "1:2");
  first.program = {"/bin/sh", "-c", "sleep 30"};
  first.start_host();
  auto second = launch({"--nnodes", "1:2", "--rdzv-endpoint", first.endpoint, "--rdzv-id", "elastic_second_job"},
                       {"/bin/true"}, "elastic_second_job");
  kill_node(first.nodes[0]);
  EXPECT_EQ(second.exit_code, 2) << second.output;
  EXPECT_NE(second.output.find("lockstep-run: --rdzv-endpoint " + first.endpoint + " already serves the rendezvous "
                               "of job 'elastic_first_job', and this node is of job 'elastic_second_job': two jobs "
                               "cannot share one rendezvous store"), std::string::npos) << second.output;
  EXPECT_EQ(second.output.find("round"), std::string::npos) << "it never joined a round of the other job: "
                                                            << second.output;
}

// A port held by another program: the launcher waited for the store's
// timeout, then said the launcher serving the rendezvous had stopped.
TEST(Elastic, AnEndpointPortHeldByAnotherProgramIsRefusedAtStart) {
  testing::ListeningSocket someone; // accepts connections, never answers
  ASSERT_TRUE(someone.ok);
  const std::string endpoint = "127.0.0.1:" + std::to_string(someone.port);
  auto p = launch({"--nnodes", "1:2", "--rdzv-endpoint", endpoint}, {"/bin/true"}, "elastic_taken_port");
  EXPECT_EQ(p.exit_code, 2) << p.output;
  EXPECT_NE(p.output.find("lockstep-run: --rdzv-endpoint " + endpoint + " is held by a program that is not a "
                          "lockstep-run rendezvous store ("), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("pick a free port for --rdzv-endpoint."), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("has stopped"), std::string::npos) << p.output;
}

// The store lives in the launcher on --rdzv-endpoint: when that node is
// lost, the other fails within the store's timeout, naming the store.
TEST(Elastic, LosingTheRendezvousHostEndsEveryNodeNamingTheStore) {
  ElasticJob job("elastic_host_lost", "1:2");
  job.start_host();
  job.start_node();
  ASSERT_TRUE(wait_for_file(job.checkpoint(), 60)) << "the job never wrote its first checkpoint";
  kill_node(job.nodes[0]);
  job.nodes.erase(job.nodes.begin());
  testing::wait_all(job.nodes, std::chrono::seconds(30));
  const std::string& other = job.nodes[0].output;
  EXPECT_EQ(job.nodes[0].exit_code, 1) << other;
  EXPECT_NE(other.find("lockstep-run: the rendezvous store at " + job.endpoint + ": "), std::string::npos) << other;
  EXPECT_NE(other.find("serves the rendezvous: it has stopped, or this node lost its link to it"), std::string::npos)
      << other;
  EXPECT_LT(job.nodes[0].seconds, 60) << other;
  EXPECT_TRUE(testing::processes_with(temp("elastic_host_lost")).empty()) << "a rank outlived its launcher";
}

// A store client whose server is gone fails within its timeout, and says
// where the store was.
TEST(Elastic, StoreClientFailsWithinItsTimeoutWhenTheServerStops) {
  const int store_port = testing::free_port();
  const auto bound = detail::bind_first(detail::resolve_tcp("127.0.0.1", store_port), true, true);
  ASSERT_GE(bound.fd, 0);
  auto server = std::make_unique<tools::KvServer>(bound.fd);
  tools::KvClient client("127.0.0.1", store_port, std::chrono::milliseconds(1000));
  EXPECT_EQ(client.add("k", 2), 2);
  client.set("v", "x y");
  EXPECT_EQ(client.get("v").value_or(""), "x y");
  EXPECT_FALSE(client.get("none").has_value());
  server.reset();
  const auto start = std::chrono::steady_clock::now();
  try {
    client.add("k", 1);
    ADD_FAILURE() << "the store answered after its server stopped";
  } catch (const tools::KvError& e) {
    EXPECT_NE(std::string(e.what()).find("the rendezvous store at 127.0.0.1:" + std::to_string(store_port) + ": "),
              std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0);
}

int parent_of(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')'); // after the command's name, which may hold spaces
  int ppid = -1;
  char state = 0;
  std::sscanf(text.c_str() + (close == std::string::npos ? 0 : close + 1), " %c %d", &state, &ppid);
  return ppid;
}

// torchrun's own elastic agent (c10d rendezvous, --nnodes 1:2) running
// lockstep-train: two agents of one rank each, one killed mid-run; the
// survivor's agent restarts its rank at world size 1, which resumes.
TEST(Torchrun, ElasticAgentRunsLockstepWorkersAndSurvivesALostNode) {
  const std::string endpoint = "127.0.0.1:" + port();
  const std::string name = "torchrun_elastic";
  std::vector<Process> agents;
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> args{LOCKSTEP_PYTHON, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "1",
                                  "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", name,
                                  "--rdzv_conf", "last_call_timeout=10", // both agents make the first round
                                  "--max_restarts", "3", "--monitor_interval", "0.2", "--redirects", "1", "--tee", "1",
                                  "--log_dir", temp(name + "_logs" + std::to_string(i)), "--no_python"};
    const auto program = long_trainer(name);
    args.insert(args.end(), program.begin(), program.end());
    agents.push_back(testing::start(args, {kOneThread}, temp(name + std::to_string(i) + ".log")));
    ASSERT_TRUE(i > 0 || wait_for_listener(endpoint)) << "the first agent never hosted the store";
  }
  ASSERT_TRUE(wait_for_file(temp(name + ".ckpt"), 90)) << "the job never wrote its first checkpoint";
  // The agent and its worker, as on a lost machine (torchrun starts its
  // workers in sessions of their own, and they outlive a killed agent).
  for (const int pid : testing::processes_with(temp(name))) {
    if (parent_of(pid) == agents[1].pid) {
      kill(pid, SIGKILL);
    }
  }
  kill(agents[1].pid, SIGKILL);
  waitpid(agents[1].pid, nullptr, 0);
  agents.pop_back();
  testing::wait_all(agents, kDeadline);
  const std::string& survivor = agents[0].output;
  EXPECT_EQ(agents[0].exit_code, 0) << survivor;
  EXPECT_NE(survivor.find("membership change: world size 2 -> 1 at step"), std::string::npos) << survivor;
  EXPECT_EQ(sample_counts(survivor), kEverySampleTwice) << survivor;
}

} // namespace
} // namespace lockstep
