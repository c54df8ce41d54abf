// How a job's rounds end, as pure logic over one in-memory store (Note
// [Elastic rendezvous] in tools/rendezvous.h): a member lost after another
// finished, a member stopped by a signal, which came first of a failure and
// a member done, records that do not parse, and the job's terms (Note [The
// job's first node sets its terms] in tools/job_record.h).

#include <tools/job_record.h>
#include <tools/rendezvous.h>

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lockstep {
namespace {
namespace rendezvous_edges { // its own scope under unity builds (Note [Unity test builds])

using tools::Assignment;
using tools::MemoryKeyValue;
using tools::NodeDesc;
using tools::RdzvClock;
using tools::RendezvousError;
using tools::RendezvousSettings;
using tools::RoundEnd;
using tools::RoundJoin;
using tools::RoundWatch;
using Status = RoundJoin::Status;
using Verdict = RoundWatch::Verdict;
using std::chrono::milliseconds;

RendezvousSettings settings(int min_nodes, int max_nodes) {
  RendezvousSettings s;
  s.min_nodes = min_nodes;
  s.max_nodes = max_nodes;
  s.id = "test";
  s.join_timeout = milliseconds(10000);
  s.last_call = milliseconds(1000);
  s.keep_alive_interval = milliseconds(100);
  s.keep_alive_max_attempt = 3;
  return s;
}

NodeDesc node(MemoryKeyValue& kv, const RendezvousSettings& s) {
  NodeDesc d;
  d.id = kv.add(s.key("nodes"), 1);
  d.addr = "10.0.0." + std::to_string(d.id);
  d.port = 1000 + static_cast<int>(d.id);
  return d;
}

// Every node of `nodes` joins the round open in `kv`, which closes at once
// (they are MAX); their assignments, in the order of `nodes`.
std::vector<Assignment> join_all(MemoryKeyValue& kv, const RendezvousSettings& s, const std::vector<NodeDesc>& nodes,
                                 RdzvClock::time_point now) {
  std::vector<std::unique_ptr<RoundJoin>> joins;
  for (const auto& n : nodes) {
    joins.push_back(std::make_unique<RoundJoin>(kv, s, n, now));
  }
  std::vector<Assignment> joined;
  for (auto& j : joins) {
    if (j->poll(now) == Status::kJoined) {
      joined.push_back(j->assignment());
    }
  }
  return joined;
}

// Three members (1:3); one finished the job, then another fell silent. A
// round without the silent one reran the survivor's part alone and
// reported success, though the silent node's part never finished: the
// loss is a job failure once a member is done.
TEST(Rendezvous, AMemberLostAfterAnotherWasDoneIsNoChangeOfMembership) {
  MemoryKeyValue kv;
  const auto s = settings(1, 3);
  auto now = RdzvClock::now();
  const NodeDesc a = node(kv, s), b = node(kv, s), c = node(kv, s);
  const auto joined = join_all(kv, s, {a, b, c}, now);
  ASSERT_EQ(joined.size(), 3u);
  RoundWatch watch_a(kv, s, joined[0], a.id, now), watch_b(kv, s, joined[1], b.id, now),
      watch_c(kv, s, joined[2], c.id, now);
  EXPECT_EQ(watch_a.check(now), Verdict::kHealthy);
  EXPECT_TRUE(watch_c.mark_done());
  now += milliseconds(100);
  watch_b.beat_if_due(now); // b's last beat
  EXPECT_EQ(watch_a.check(now), Verdict::kMembersDone);
  now += s.liveness_window() + milliseconds(1);
  EXPECT_EQ(watch_a.check(now), Verdict::kLostAfterDone);
  EXPECT_EQ(watch_a.lost(), b.id);
  EXPECT_EQ(watch_a.lost_code(), "") << "b fell silent; it said nothing";
}

// A member whose launcher a signal stopped writes its exit code (128 + N)
// as it leaves: the others took it for lost only after the liveness window
// (15 s at torchrun's defaults), not at once.
TEST(Rendezvous, AMemberStoppedByASignalIsLostAtOnce) {
  MemoryKeyValue kv;
  const auto s = settings(1, 2);
  const auto now = RdzvClock::now();
  const NodeDesc a = node(kv, s), b = node(kv, s);
  const auto joined = join_all(kv, s, {a, b}, now);
  ASSERT_EQ(joined.size(), 2u);
  RoundWatch watch_a(kv, s, joined[0], a.id, now);
  EXPECT_EQ(watch_a.check(now), Verdict::kHealthy);
  kv.set(s.key(0, "left/" + std::to_string(b.id)), "143");
  EXPECT_EQ(watch_a.check(now), Verdict::kMemberLost) << "within the window, but gone: it said so";
  EXPECT_EQ(watch_a.lost(), b.id);
  EXPECT_EQ(watch_a.lost_code(), "143");
}

// Note [Which came first, a failure or a member done]: a rank that failed
// at 1 s, and a node whose ranks finished at 8 s, within the failing
// node's liveness window, was read as a failure after the job finished:
// no restart, both nodes exit 1. The store orders the two.
TEST(Rendezvous, AFailureBeforeAMemberWasDoneIsRestartedAndOneAfterIsNot) {
  MemoryKeyValue kv;
  const auto s = settings(3, 3);
  const auto now = RdzvClock::now();
  const NodeDesc a = node(kv, s), b = node(kv, s), c = node(kv, s);
  auto joined = join_all(kv, s, {a, b, c}, now);
  ASSERT_EQ(joined.size(), 3u);
  RoundWatch watch_a(kv, s, joined[0], a.id, now), watch_b(kv, s, joined[1], b.id, now);
  EXPECT_EQ(watch_b.record_failure(), 0) << "nobody was done before b's failure";
  EXPECT_FALSE(watch_a.mark_done()) << "a finished after b's failure: the round failed";
  EXPECT_FALSE(kv.get(s.key(0, "done/" + std::to_string(a.id)))) << "a does not say it is done";
  EXPECT_EQ(watch_a.check(now), Verdict::kHealthy) << "no member is done: the round may still restart";
  EXPECT_EQ(watch_b.end(RoundEnd::kFailure, milliseconds(100)), RoundEnd::kFailure);
  EXPECT_EQ(watch_a.check(now), Verdict::kRoundOver);

  joined = join_all(kv, s, {a, b, c}, now); // round 1: a finishes first, then b and c fail
  ASSERT_EQ(joined.size(), 3u);
  RoundWatch again_a(kv, s, joined[0], a.id, now), again_b(kv, s, joined[1], b.id, now),
      again_c(kv, s, joined[2], c.id, now);
  EXPECT_TRUE(again_a.mark_done());
  EXPECT_EQ(again_b.record_failure(), 1) << "a was done before b's failure: the job failed";
  EXPECT_EQ(again_c.record_failure(), 1);
  EXPECT_EQ(again_b.done_members(), std::vector<int64_t>{a.id});
}

// Records that do not parse (a node of another version, or another program
// at the endpoint) are rendezvous errors that say what the store holds and
// what was expected, on every launcher, the one serving the store too.
TEST(Rendezvous, RecordsThatDoNotParseAreRendezvousErrors) {
  EXPECT_EQ(NodeDesc::decode("3,2,10.0.0.3,4001").addr, "10.0.0.3");
  EXPECT_EQ(tools::RoundRecord::decode(1, "2;1,1,a,5;2,1,b,6").nodes.size(), 2u);
  for (const std::string bad : {"1,1,b,x,5", "1,1,host", "x,1,a,5", "1,,a,5", "", "1,1,a,99999999999999999999"}) {
    EXPECT_THROW(NodeDesc::decode(bad), RendezvousError) << bad;
  }
  for (const std::string bad : {"0;1,1,host;x,5", "x;1,1,a,5", "", "0;"}) {
    EXPECT_THROW(tools::RoundRecord::decode(0, bad), RendezvousError) << bad;
  }
  try {
    NodeDesc::decode("1,1,b,x,5");
    ADD_FAILURE() << "a record of five fields was taken";
  } catch (const RendezvousError& e) {
    EXPECT_NE(std::string(e.what()).find("the rendezvous store holds a node record that does not parse ('1,1,b,x,5': "
                                         "expected 4 fields (id,ranks,address,port), found 5)"), std::string::npos)
        << e.what();
  }
}

// --- the job's terms (Note [The job's first node sets its terms] in tools/job_record.h) --

tools::JobTerms terms(int min_nodes, int max_nodes, int max_restarts, std::vector<std::string> command) {
  tools::JobTerms t;
  t.min_nodes = min_nodes;
  t.max_nodes = max_nodes;
  t.max_restarts = max_restarts;
  t.command = std::move(command);
  return t;
}

std::optional<std::string> agree(MemoryKeyValue& kv, const tools::JobTerms& mine, bool no_id) {
  return tools::agree_on_terms(kv, settings(1, 2), mine, no_id, "h:7", RdzvClock::now(), [] { return false; });
}

// A node of --nnodes 2 waited behind a job of --nnodes 1 and exited 0,
// "nothing to do"; two jobs without --rdzv-id at one endpoint merged.
TEST(JobTerms, ANodeWhoseTermsDifferFromTheFirstNodesIsRefusedNamingBoth) {
  MemoryKeyValue kv;
  const auto first = terms(1, 1, 0, {"python3", "train.py"});
  EXPECT_EQ(agree(kv, first, true), "") << "the first node records its terms";
  EXPECT_EQ(agree(kv, first, true), "") << "a node of the same job";
  EXPECT_EQ(agree(kv, terms(2, 2, 0, {"python3", "train.py"}), true),
            "this node has --nnodes 2, but the job at --rdzv-endpoint h:7 was started with --nnodes 1 by its first "
            "node: give every node of the job the same --nnodes.");
  EXPECT_EQ(agree(kv, terms(1, 1, 3, {"python3", "train.py"}), true),
            "this node has --max-restarts 3, but the job at --rdzv-endpoint h:7 was started with --max-restarts 0 by "
            "its first node: give every node of the job the same --max-restarts.");
  auto slower = first;
  slower.restart_delay_ms = 2500;
  EXPECT_EQ(agree(kv, slower, true),
            "this node has --restart-delay 2.5, but the job at --rdzv-endpoint h:7 was started with --restart-delay 1 "
            "by its first node: give every node of the job the same --restart-delay.");
  EXPECT_EQ(agree(kv, terms(1, 2, 0, {"python3", "eval.py", "--name", "a b"}), true),
            "another job serves the rendezvous at --rdzv-endpoint h:7: its first node runs 'python3 train.py', this "
            "node 'python3 eval.py --name \"a b\"', and neither job has an id (no --rdzv-id, no Slurm job). Give each "
            "job its own --rdzv-id, or its own --rdzv-endpoint port; if these nodes are one job, give every node the "
            "same --rdzv-id.");
  EXPECT_EQ(agree(kv, terms(1, 1, 0, {"python3", "eval.py"}), false), "")
      << "with an id, the nodes of one job may run different commands (srun --multi-prog)";
  // Any argument survives the store's line protocol.
  auto odd = terms(2, 5, 7, {"sh", "-c", "echo 'a  b'\n%41;,", "", "\t"});
  odd.restart_delay_ms = 250;
  const auto back = tools::JobTerms::decode(odd.encode());
  EXPECT_EQ(back.command, odd.command);
  EXPECT_EQ(back.nnodes(), "2:5");
  EXPECT_EQ(back.max_restarts, 7);
  EXPECT_EQ(back.restart_delay_ms, 250);
  EXPECT_EQ(tools::seconds_text(1234567), "1234.567"); // told apart from 1234.568
  EXPECT_EQ(tools::seconds_text(250), "0.25");
  EXPECT_EQ(tools::seconds_text(0), "0");
  EXPECT_EQ(odd.encode().find('\n'), std::string::npos);
  EXPECT_THROW(tools::JobTerms::decode("two 0 x"), RendezvousError);
}

} // namespace rendezvous_edges
} // namespace
} // namespace lockstep
