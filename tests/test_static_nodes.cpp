// Static jobs of several nodes on one machine (--nnodes N --node-rank K,
// one lockstep-run per node): the nodes add up their counts, refuse another
// --nnodes, and keep an outer launcher's store variables from their ranks
// (Note [Static nodes add up their counts]). The rest of lockstep-run is in
// test_launcher.cpp.

#include "support/launch.h"
#include "support/processes.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

// Nodes of 1 and 2 ranks were told WORLD_SIZE 2 and 4, and no rank was 1:
// the ranks waited the whole --timeout. The counts add up, as under
// torchrun (Note [Static nodes add up their counts]).
TEST(Launcher, StaticNodesOfDifferentCountsAddThemUp) {
  const std::string master_port = port();
  std::vector<Process> nodes;
  for (int node = 0; node < 2; ++node) {
    nodes.push_back(testing::start(
        launcher({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", std::to_string(node + 1),
                  "--master-addr", "127.0.0.1", "--master-port", master_port},
                 {"/bin/sh", "-c", "echo \"env $RANK of $WORLD_SIZE, local $LOCAL_RANK of $LOCAL_WORLD_SIZE\""}),
        {}, temp("uneven_nodes" + std::to_string(node) + ".log")));
  }
  testing::wait_all(nodes, kDeadline);
  for (const auto& node : nodes) {
    EXPECT_EQ(node.exit_code, 0) << node.output;
    EXPECT_NE(node.output.find("lockstep-run: the nodes start different numbers of ranks (--nproc-per-node of node 0: "
                               "1, node 1: 2): WORLD_SIZE is their sum, 3, as under torchrun"), std::string::npos)
        << node.output;
  }
  EXPECT_NE(nodes[0].output.find("[rank 0] env 0 of 3, local 0 of 1"), std::string::npos) << nodes[0].output;
  EXPECT_NE(nodes[1].output.find("[rank 1] env 1 of 3, local 0 of 2"), std::string::npos) << nodes[1].output;
  EXPECT_NE(nodes[1].output.find("[rank 2] env 2 of 3, local 1 of 2"), std::string::npos) << nodes[1].output;
}

// A node told --nnodes 3 --node-rank 2 beside a job of 2 nodes: its rank
// would be 2 of WORLD_SIZE 2. It stops, naming both counts; the job of 2
// runs.
TEST(Launcher, AStaticNodeWithAnotherNnodesIsRefusedNamingBoth) {
  const std::string master_port = port();
  std::vector<Process> nodes;
  for (int node : {0, 2, 1}) { // node 1 last: the meeting lasts until it comes, so node 2 meets node 0 first
    if (node == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    nodes.push_back(testing::start(
        launcher({"--nnodes", node == 2 ? "3" : "2", "--node-rank", std::to_string(node), "--nproc-per-node", "1",
                  "--master-addr", "127.0.0.1", "--master-port", master_port},
                 {"/bin/sh", "-c", "echo \"env $RANK of $WORLD_SIZE\""}),
        {}, temp("nnodes_differ" + std::to_string(node) + ".log")));
  }
  std::swap(nodes[1], nodes[2]); // by --node-rank
  testing::wait_all(nodes, kDeadline);
  EXPECT_EQ(nodes[0].exit_code, 0) << nodes[0].output;
  EXPECT_EQ(nodes[1].exit_code, 0) << nodes[1].output;
  EXPECT_NE(nodes[2].exit_code, 0) << nodes[2].output;
  EXPECT_NE(nodes[2].output.find("runs a job of 2 nodes (its --nnodes), but this node has --nnodes 3: give every node "
                                 "the same --nnodes."), std::string::npos) << nodes[2].output;
  EXPECT_EQ(nodes[2].output.find("[rank"), std::string::npos) << "a rank started: " << nodes[2].output;
}

// Two jobs at one address (two sruns of one allocation on the first host's
// default port): a node of the second job met the first's node 0 and ran as
// its rank 1. It is refused, naming both jobs, before any rank starts.
TEST(Launcher, AStaticNodeOfAnotherJobIsRefusedNamingBoth) {
  const std::string master_port = port();
  auto node = [&](int rank, const std::string& job) {
    return testing::start(launcher({"--nnodes", "2", "--node-rank", std::to_string(rank), "--nproc-per-node", "1",
                                    "--master-addr", "127.0.0.1", "--master-port", master_port, "--rdzv-id", job},
                                   {"/bin/sh", "-c", "echo \"env $RANK of $WORLD_SIZE\""}),
                          {}, temp("other_job_" + job + std::to_string(rank) + ".log"));
  };
  std::vector<Process> first{node(0, "jobA")};
  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::vector<Process> intruder{node(1, "jobB")};
  testing::wait_all(intruder, kDeadline);
  EXPECT_NE(intruder[0].exit_code, 0) << intruder[0].output;
  EXPECT_NE(intruder[0].output.find("runs job 'jobA', but this node is of job 'jobB'"), std::string::npos)
      << intruder[0].output;
  EXPECT_NE(intruder[0].output.find("Give each job its own --master-port"), std::string::npos) << intruder[0].output;
  EXPECT_EQ(intruder[0].output.find("[rank"), std::string::npos) << "a rank started: " << intruder[0].output;
  std::vector<Process> second{node(1, "jobA")}; // node 0 still waits for its own node 1
  testing::wait_all(second, kDeadline);
  testing::wait_all(first, kDeadline);
  EXPECT_EQ(first[0].exit_code, 0) << first[0].output;
  EXPECT_EQ(second[0].exit_code, 0) << second[0].output;
  EXPECT_NE(second[0].output.find("[rank 1] env 1 of 2"), std::string::npos) << second[0].output;
}

// A mistyped --master-addr waited out --timeout and then said only that
// node 0 never answered, not that its name does not resolve.
TEST(Launcher, AStaticNodeSaysWhyNodeZeroCouldNotBeReached) {
  auto node = testing::run(launcher({"--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr",
                                     "nosuchhost.invalid", "--master-port", port(), "--timeout", "2"},
                                    {"/bin/true"}),
                           {}, temp("unresolved_master.log"), kDeadline);
  EXPECT_NE(node.exit_code, 0) << node.output;
  EXPECT_NE(node.output.find("node 0's launcher never answered at nosuchhost.invalid:"), std::string::npos)
      << node.output;
  EXPECT_NE(node.output.find("(the last try: cannot resolve nosuchhost.invalid: "), std::string::npos) << node.output;
}

// Variables inherited from an outer launcher (lockstep-run under torchrun's
// agent, or a shell that ran a one-node job) must not reach the ranks of a
// job of two nodes: an agent's store that nobody serves here, or one node's
// store file, and every rank waited the whole --timeout.
TEST(Launcher, InheritedStoreVariablesDoNotReachTheRanks) {
  const std::string master_port = port();
  std::vector<Process> nodes;
  for (int node = 0; node < 2; ++node) {
    nodes.push_back(testing::start(
        launcher({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "1", "--master-addr",
                  "127.0.0.1", "--master-port", master_port},
                 {"/bin/sh", "-c", "echo \"stores [$TORCHELASTIC_USE_AGENT_STORE] [$LOCKSTEP_STORE_FILE]\""}),
        {"TORCHELASTIC_USE_AGENT_STORE=True", "LOCKSTEP_STORE_FILE=" + temp("stale_store")},
        temp("inherited_store" + std::to_string(node) + ".log")));
  }
  testing::wait_all(nodes, kDeadline);
  for (const auto& node : nodes) {
    EXPECT_EQ(node.exit_code, 0) << node.output;
    EXPECT_NE(node.output.find("stores [False] []"), std::string::npos) << node.output;
  }
}

} // namespace
} // namespace lockstep
