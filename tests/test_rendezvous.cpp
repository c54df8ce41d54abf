// The elastic rendezvous as pure logic (Note [Elastic rendezvous] in
// tools/rendezvous.h): several nodes driven a step at a time over one
// in-memory store, with a clock the test moves. No threads, no sockets.

#include <tools/desync_report.h>
#include <tools/rendezvous.h>
#include <tools/static_meeting.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {
namespace {

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

NodeDesc node(MemoryKeyValue& kv, const RendezvousSettings& s, int nproc = 1) {
  NodeDesc d;
  d.id = kv.add(s.key("nodes"), 1);
  d.nproc = nproc;
  d.addr = "10.0.0." + std::to_string(d.id);
  d.port = 1000 + static_cast<int>(d.id);
  return d;
}

// Polls every join once at `now`; the assignments of those that joined.
std::vector<Assignment> poll_all(std::vector<std::unique_ptr<RoundJoin>>& joins, RdzvClock::time_point now) {
  std::vector<Assignment> joined;
  for (auto& j : joins) {
    if (j->poll(now) == Status::kJoined) {
      joined.push_back(j->assignment());
    }
  }
  return joined;
}

TEST(KvStore, WireProtocolAddsSetsGetsAndRefusesNonsense) {
  MemoryKeyValue kv;
  EXPECT_EQ(kv.serve("ADD a 2"), "V 2");
  EXPECT_EQ(kv.serve("ADD a 3"), "V 5");
  EXPECT_EQ(kv.serve("ADD a 0"), "V 5");
  EXPECT_EQ(kv.serve("SET b 1,2 and more"), "OK");
  EXPECT_EQ(kv.serve("GET b"), "V 1,2 and more");
  EXPECT_EQ(kv.serve("GET c"), "NONE");
  EXPECT_EQ(kv.serve("ADD b 1"), "ERR not a counter");
  EXPECT_EQ(kv.serve("ADD a x"), "ERR not a counter");
  EXPECT_EQ(kv.serve("ADD"), "ERR no key");
  EXPECT_EQ(kv.serve("DROP a"), "ERR unknown operation DROP");
  EXPECT_EQ(kv.serve("GET a"), "V 5");
}

// The node that serves the endpoint reaches its own host name over
// loopback where /etc/hosts maps the name to 127.0.1.1 (Debian's default):
// the others must get the name, by which they reached it, not their own
// loopback as MASTER_ADDR.
TEST(Rendezvous, ANodeReachingTheEndpointOverLoopbackGivesTheEndpointsHost) {
  EXPECT_EQ(tools::reachable_address("127.0.1.1", "node0.cluster"), "node0.cluster");
  EXPECT_EQ(tools::reachable_address("::1", "node0.cluster"), "node0.cluster");
  EXPECT_EQ(tools::reachable_address("::ffff:127.0.0.1", "node0"), "node0");
  EXPECT_EQ(tools::reachable_address("127.0.0.1", "127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(tools::reachable_address("10.1.2.3", "node0.cluster"), "10.1.2.3");
  EXPECT_EQ(tools::reachable_address("fd00::5", "node0"), "fd00::5");
}

TEST(Rendezvous, RoundClosesAtOnceWhenMaxNodesJoinAndRanksFollowTheNodeOrder) {
  MemoryKeyValue kv;
  const auto s = settings(1, 2);
  const auto t0 = RdzvClock::now();
  const NodeDesc a = node(kv, s, 2), b = node(kv, s, 1);
  std::vector<std::unique_ptr<RoundJoin>> joins;
  joins.push_back(std::make_unique<RoundJoin>(kv, s, b, t0)); // b arrives first: the order is still a, b
  joins.push_back(std::make_unique<RoundJoin>(kv, s, a, t0));
  const auto joined = poll_all(joins, t0);
  ASSERT_EQ(joined.size(), 2u);
  const Assignment& of_b = joined[0];
  const Assignment& of_a = joined[1];
  EXPECT_EQ(of_a.group_rank, 0);
  EXPECT_EQ(of_a.rank_offset, 0);
  EXPECT_EQ(of_b.group_rank, 1);
  EXPECT_EQ(of_b.rank_offset, 2);
  EXPECT_EQ(of_b.world_size, 3);
  EXPECT_EQ(of_b.group_world_size, 2);
  EXPECT_EQ(of_b.master_addr, "10.0.0.1"); // node a's address and port: its rank 0 hosts the workers' store
  EXPECT_EQ(of_b.master_port, 1001);
  EXPECT_EQ(of_b.round, 0);
  EXPECT_EQ(of_b.restarts, 0);
}

TEST(Rendezvous, BelowMaxTheRoundClosesOnlyAfterTheLastCall) {
  MemoryKeyValue kv;
  const auto s = settings(2, 3);
  const auto t0 = RdzvClock::now();
  std::vector<std::unique_ptr<RoundJoin>> joins;
  joins.push_back(std::make_unique<RoundJoin>(kv, s, node(kv, s), t0));
  EXPECT_TRUE(poll_all(joins, t0 + milliseconds(5000)).empty()) << "one node is below MIN: no round";
  joins.push_back(std::make_unique<RoundJoin>(kv, s, node(kv, s), t0 + milliseconds(5000)));
  EXPECT_TRUE(poll_all(joins, t0 + milliseconds(5000)).empty()) << "MIN is in: the last call (1 s) begins";
  EXPECT_TRUE(poll_all(joins, t0 + milliseconds(5900)).empty()) << "MIN is in, but the last call has not passed";
  const auto joined = poll_all(joins, t0 + milliseconds(6000)); // the first to see it pass closes the round
  ASSERT_EQ(joined.size(), 2u);
  EXPECT_EQ(joined[0].world_size, 2);
}

TEST(Rendezvous, LastCallLongerThanTheJoinTimeoutStillClosesTheRound) {
  MemoryKeyValue kv;
  auto s = settings(1, 2);
  s.join_timeout = milliseconds(500); // below the last call (1 s): MIN is in, so it does not apply
  const auto t0 = RdzvClock::now();
  RoundJoin join(kv, s, node(kv, s), t0);
  EXPECT_EQ(join.poll(t0), Status::kPending);
  EXPECT_EQ(join.poll(t0 + milliseconds(700)), Status::kPending);
  EXPECT_EQ(join.poll(t0 + milliseconds(1000)), Status::kJoined);
}

TEST(Rendezvous, RoundBelowMinFailsAfterTheJoinTimeoutSayingHowManyCame) {
  MemoryKeyValue kv;
  const auto s = settings(3, 3);
  const auto t0 = RdzvClock::now();
  RoundJoin join(kv, s, node(kv, s), t0);
  EXPECT_EQ(join.poll(t0 + milliseconds(9000)), Status::kPending);
  try {
    join.poll(t0 + milliseconds(10001));
    ADD_FAILURE() << "no error after the join timeout";
  } catch (const RendezvousError& e) {
    EXPECT_STREQ(e.what(), "round 0 of the rendezvous did not close within join_timeout (10 s): 1 of at least 3 "
                           "node(s) joined. Start the missing nodes, or lower MIN in --nnodes MIN:MAX.");
  }
}

// A node that took its place but has not described itself yet (or died
// between the two) does not count toward MIN: the round stays open, instead
// of closing with one node of a 2:2 job, and fails after join_timeout if
// the node never comes.
TEST(Rendezvous, APlaceTakenButNotDescribedDoesNotCloseTheRoundBelowMin) {
  MemoryKeyValue kv;
  const auto s = settings(2, 2);
  const auto t0 = RdzvClock::now();
  RoundJoin join(kv, s, node(kv, s), t0);
  kv.add(s.key(0, "joined"), 1); // the second node's place, without its description
  EXPECT_EQ(join.poll(t0), Status::kPending);
  EXPECT_EQ(join.poll(t0 + milliseconds(5000)), Status::kPending);
  EXPECT_FALSE(kv.get(s.key(0, "members"))) << "the round closed with one node of a 2:2 job";
  try {
    join.poll(t0 + milliseconds(10001));
    ADD_FAILURE() << "no error after the join timeout";
  } catch (const RendezvousError& e) {
    EXPECT_NE(std::string(e.what()).find("1 of at least 2 node(s) joined"), std::string::npos) << e.what();
  }
}

// Round 0 closes with nodes 1 and 2. Node 3 comes late: it waits, the
// members see it, end the round as a change of membership, and round 1
// closes at once with all three, in id order.
TEST(Rendezvous, LateNodeWaitsAndTheMembersStartARoundWithIt) {
  MemoryKeyValue kv;
  const auto s = settings(2, 3);
  auto now = RdzvClock::now();
  std::vector<NodeDesc> nodes{node(kv, s), node(kv, s), node(kv, s)};
  std::vector<std::unique_ptr<RoundJoin>> joins;
  joins.push_back(std::make_unique<RoundJoin>(kv, s, nodes[0], now));
  joins.push_back(std::make_unique<RoundJoin>(kv, s, nodes[1], now));
  poll_all(joins, now);
  now += milliseconds(1500);
  poll_all(joins, now);
  auto round0 = poll_all(joins, now);
  ASSERT_EQ(round0.size(), 2u);
  RoundWatch watch0(kv, s, round0[0], nodes[0].id, now), watch1(kv, s, round0[1], nodes[1].id, now);
  EXPECT_EQ(watch0.check(now), Verdict::kHealthy);

  auto late = std::make_unique<RoundJoin>(kv, s, nodes[2], now);
  EXPECT_EQ(late->poll(now), Status::kPending);
  EXPECT_TRUE(late->waiting());
  EXPECT_EQ(watch1.check(now), Verdict::kNodeWaiting);
  EXPECT_EQ(watch1.end(RoundEnd::kMembership, milliseconds(100)), RoundEnd::kMembership);
  EXPECT_EQ(watch0.check(now), Verdict::kRoundOver);
  EXPECT_EQ(watch0.reason_of(milliseconds(100)), RoundEnd::kMembership);

  joins.clear();
  joins.push_back(std::make_unique<RoundJoin>(kv, s, nodes[1], now));
  joins.push_back(std::make_unique<RoundJoin>(kv, s, nodes[0], now));
  EXPECT_EQ(late->poll(now), Status::kPending); // sees round 1 open and takes its place
  joins.push_back(std::move(late));
  poll_all(joins, now);
  const auto round1 = poll_all(joins, now);
  ASSERT_EQ(round1.size(), 3u);
  for (const auto& a : round1) {
    EXPECT_EQ(a.round, 1);
    EXPECT_EQ(a.world_size, 3);
    EXPECT_EQ(a.restarts, 0) << "a change of membership is not a restart";
  }
  EXPECT_EQ(round1[0].group_rank, 1);
  EXPECT_EQ(round1[1].group_rank, 0);
  EXPECT_EQ(round1[2].group_rank, 2);
}

// Two nodes in a round: the one that stops beating is lost after the
// liveness window, not before; one that said it is done never is.
TEST(Rendezvous, SilentMemberIsLostAfterTheLivenessWindowAndADoneOneNever) {
  MemoryKeyValue kv;
  const auto s = settings(2, 2);
  auto now = RdzvClock::now();
  std::vector<std::unique_ptr<RoundJoin>> joins;
  const NodeDesc a = node(kv, s), b = node(kv, s);
  joins.push_back(std::make_unique<RoundJoin>(kv, s, a, now));
  joins.push_back(std::make_unique<RoundJoin>(kv, s, b, now));
  const auto joined = poll_all(joins, now);
  ASSERT_EQ(joined.size(), 2u);
  RoundWatch watch_a(kv, s, joined[0], a.id, now), watch_b(kv, s, joined[1], b.id, now);
  for (int i = 0; i < 10; ++i) { // both beat for a second
    now += milliseconds(100);
    EXPECT_EQ(watch_a.check(now), Verdict::kHealthy);
    EXPECT_EQ(watch_b.check(now), Verdict::kHealthy);
  }
  now += milliseconds(250); // a sees b's last beat
  EXPECT_EQ(watch_a.check(now), Verdict::kHealthy);
  now += milliseconds(300); // b has been silent for the window (300 ms), not more
  EXPECT_EQ(watch_a.check(now), Verdict::kHealthy);
  now += milliseconds(1);
  EXPECT_EQ(watch_a.check(now), Verdict::kMemberLost);
  EXPECT_EQ(watch_a.lost(), b.id);

  watch_b.mark_done(); // had b said it was done, a would not lose it
  now += milliseconds(1000);
  EXPECT_EQ(watch_a.check(now), Verdict::kMembersDone);
  EXPECT_TRUE(watch_a.others_finished(now));
}

// The store's node, done, waits for the others: three members of which one
// says it is done, one leaves, and one falls silent. Once the silent one is
// lost, every other member has finished, and only it vanished unfinished.
TEST(Rendezvous, AMemberLostBeforeItWasDoneIsToldFromOnesThatFinished) {
  MemoryKeyValue kv;
  const auto s = settings(3, 3);
  auto now = RdzvClock::now();
  std::vector<std::unique_ptr<RoundJoin>> joins;
  const NodeDesc a = node(kv, s), b = node(kv, s), c = node(kv, s);
  for (const auto& n : {a, b, c}) {
    joins.push_back(std::make_unique<RoundJoin>(kv, s, n, now));
  }
  const auto joined = poll_all(joins, now);
  ASSERT_EQ(joined.size(), 3u);
  RoundWatch watch_a(kv, s, joined[0], a.id, now), watch_b(kv, s, joined[1], b.id, now);
  watch_a.mark_done();
  watch_b.mark_done();
  kv.set(s.key(joined[0].round, "left/" + std::to_string(c.id)), "0");
  EXPECT_TRUE(watch_a.others_finished(now));
  now += s.liveness_window() + milliseconds(1);
  EXPECT_TRUE(watch_a.vanished_members(now).empty()) << "done and left are finished, however silent";

  MemoryKeyValue kv2;
  joins.clear();
  const NodeDesc e = node(kv2, s), f = node(kv2, s), g = node(kv2, s);
  for (const auto& n : {e, f, g}) {
    joins.push_back(std::make_unique<RoundJoin>(kv2, s, n, now));
  }
  const auto round = poll_all(joins, now);
  ASSERT_EQ(round.size(), 3u);
  RoundWatch watch_e(kv2, s, round[0], e.id, now), watch_f(kv2, s, round[1], f.id, now);
  watch_e.mark_done();
  watch_f.mark_done(); // g beats no more
  EXPECT_FALSE(watch_e.others_finished(now)) << "g may still be running";
  EXPECT_TRUE(watch_e.vanished_members(now).empty());
  now += s.liveness_window() + milliseconds(1);
  EXPECT_TRUE(watch_e.others_finished(now));
  EXPECT_EQ(watch_e.vanished_members(now), std::vector<int64_t>{g.id});
}

// A failure counts once however many members end the round for it, and the
// next round's members read the count; a change of membership does not count.
TEST(Rendezvous, OnlyFailuresCountAsRestartsAndTheFirstReasonWins) {
  MemoryKeyValue kv;
  const auto s = settings(2, 2);
  auto now = RdzvClock::now();
  const NodeDesc a = node(kv, s), b = node(kv, s);
  for (int round = 0; round < 3; ++round) {
    std::vector<std::unique_ptr<RoundJoin>> joins;
    joins.push_back(std::make_unique<RoundJoin>(kv, s, a, now));
    joins.push_back(std::make_unique<RoundJoin>(kv, s, b, now));
    const auto joined = poll_all(joins, now);
    ASSERT_EQ(joined.size(), 2u);
    EXPECT_EQ(joined[0].round, round);
    EXPECT_EQ(joined[0].restarts, round == 0 ? 0 : 1);
    RoundWatch watch_a(kv, s, joined[0], a.id, now), watch_b(kv, s, joined[1], b.id, now);
    const RoundEnd first = round == 0 ? RoundEnd::kFailure : RoundEnd::kMembership;
    const RoundEnd second = round == 0 ? RoundEnd::kMembership : RoundEnd::kFailure;
    EXPECT_EQ(watch_a.end(first, milliseconds(100)), first);
    EXPECT_EQ(watch_b.end(second, milliseconds(100)), first) << "the member that ended the round first says why";
  }
  EXPECT_EQ(kv.add(s.key("restarts"), 0), 1);
}

TEST(Rendezvous, FullRoundLeavesTheNodeAboveMaxWaitingUntilEveryMemberHasLeft) {
  MemoryKeyValue kv;
  const auto s = settings(1, 2);
  const auto now = RdzvClock::now();
  std::vector<NodeDesc> nodes{node(kv, s), node(kv, s), node(kv, s)};
  std::vector<std::unique_ptr<RoundJoin>> joins;
  for (const auto& n : nodes) {
    joins.push_back(std::make_unique<RoundJoin>(kv, s, n, now));
  }
  const auto joined = poll_all(joins, now);
  ASSERT_EQ(joined.size(), 2u);
  EXPECT_TRUE(joins[2]->waiting());
  RoundWatch watch(kv, s, joined[0], nodes[0].id, now);
  EXPECT_EQ(watch.check(now), Verdict::kHealthy) << "the round is full: a waiting node does not end it";
  // The node that serves the store writes "complete" once it finished as a
  // member; when it is the one waiting, the members' own exits end the job
  // for it (Note [The job ends while a node waits]).
  const auto left = [&](int64_t id, const char* code) {
    kv.set(s.key(joined[0].round, "left/" + std::to_string(id)), code);
  };
  left(nodes[0].id, "0");
  EXPECT_EQ(joins[2]->poll(now), Status::kPending) << "one member still runs";
  left(nodes[1].id, "1");
  EXPECT_EQ(joins[2]->poll(now), Status::kJobFailed);
  EXPECT_EQ(joins[2]->failed_nodes(), "1") << "its GROUP_RANK, not its node id (" << nodes[1].id << ")";
  left(nodes[1].id, "0");
  EXPECT_EQ(joins[2]->poll(now), Status::kJobComplete);
}

// Members that vanish without a code (machines lost, launchers killed) are
// followed by their heartbeats (Note [The job ends while a node waits]): a
// waiting node that serves the store does not wait for good.
TEST(Rendezvous, WaitingNodeEndsTheRoundWhenEveryMemberVanishesAndRunsWithoutThem) {
  MemoryKeyValue kv;
  const auto s = settings(1, 2);
  const auto start = RdzvClock::now();
  std::vector<NodeDesc> nodes{node(kv, s), node(kv, s), node(kv, s)};
  std::vector<std::unique_ptr<RoundJoin>> joins;
  for (const auto& n : nodes) {
    joins.push_back(std::make_unique<RoundJoin>(kv, s, n, start));
  }
  const auto joined = poll_all(joins, start);
  ASSERT_EQ(joined.size(), 2u);
  ASSERT_TRUE(joins[2]->waiting());
  RoundWatch first(kv, s, joined[0], nodes[0].id, start);
  RoundWatch second(kv, s, joined[1], nodes[1].id, start);
  EXPECT_EQ(joins[2]->poll(start), Status::kPending);
  // Both members beat for a while, then vanish at once.
  const auto beating = start + milliseconds(500);
  first.beat_if_due(beating);
  second.beat_if_due(beating);
  EXPECT_EQ(joins[2]->poll(beating), Status::kPending);
  EXPECT_EQ(joins[2]->poll(beating + s.liveness_window()), Status::kPending);
  EXPECT_EQ(kv.add(s.key("round"), 0), 0) << "silent for the liveness window, not longer: not gone yet";
  const auto gone = beating + s.liveness_window() + milliseconds(1);
  EXPECT_EQ(joins[2]->poll(gone), Status::kPending);
  EXPECT_EQ(kv.add(s.key("round"), 0), 1) << "the waiting node ends the round the vanished members left";
  EXPECT_EQ(kv.get(s.key(0, "reason")).value_or(""), "membership");
  EXPECT_EQ(first.check(gone), Verdict::kRoundOver) << "a member that comes back sees the round over";
  // It joins the next round, which runs without them once the last call passed (MIN is 1).
  EXPECT_EQ(joins[2]->poll(gone), Status::kPending);
  EXPECT_FALSE(joins[2]->waiting());
  EXPECT_EQ(joins[2]->poll(gone), Status::kPending) << "MIN is in: the last call starts";
  ASSERT_EQ(joins[2]->poll(gone + s.last_call), Status::kJoined);
  EXPECT_EQ(joins[2]->assignment().round, 1);
  EXPECT_EQ(joins[2]->assignment().members, std::vector<int64_t>{nodes[2].id});
  EXPECT_EQ(kv.add(s.key("restarts"), 0), 0) << "a lost member is a change of membership, not a failure";
}

TEST(Rendezvous, WaitingNodeEndsAJobAMemberFinishedWhenTheOtherVanishesUnfinished) {
  MemoryKeyValue kv;
  const auto s = settings(1, 2);
  const auto start = RdzvClock::now();
  std::vector<NodeDesc> nodes{node(kv, s), node(kv, s), node(kv, s)};
  std::vector<std::unique_ptr<RoundJoin>> joins;
  for (const auto& n : nodes) {
    joins.push_back(std::make_unique<RoundJoin>(kv, s, n, start));
  }
  const auto joined = poll_all(joins, start);
  ASSERT_EQ(joined.size(), 2u);
  ASSERT_TRUE(joins[2]->waiting());
  kv.set(s.key(0, "done/" + std::to_string(nodes[0].id)), "1");
  kv.set(s.key(0, "left/" + std::to_string(nodes[0].id)), "0");
  EXPECT_EQ(joins[2]->poll(start), Status::kPending) << "the other member may still finish";
  const auto gone = start + s.liveness_window() + milliseconds(1);
  EXPECT_EQ(joins[2]->poll(gone), Status::kJobFailed);
  EXPECT_EQ(joins[2]->failed_nodes(), "1") << "its GROUP_RANK, not its node id (" << nodes[1].id << ")";
  EXPECT_EQ(kv.add(s.key("round"), 0), 0) << "a job that finished is not restarted";
}

TEST(Rendezvous, WaitingNodeLearnsThatTheJobCompleted) {
  MemoryKeyValue kv;
  const auto s = settings(1, 1);
  const auto now = RdzvClock::now();
  RoundJoin first(kv, s, node(kv, s), now);
  ASSERT_EQ(first.poll(now), Status::kJoined);
  RoundJoin late(kv, s, node(kv, s), now);
  EXPECT_EQ(late.poll(now), Status::kPending);
  kv.set(s.key("complete"), tools::kJobSucceeded);
  EXPECT_EQ(late.poll(now), Status::kJobComplete);
  kv.set(s.key("complete"), "0, 2"); // the group ranks of the nodes that left with a failure
  EXPECT_EQ(late.poll(now), Status::kJobFailed);
  EXPECT_EQ(late.failed_nodes(), "0, 2");
  kv.set(s.key("complete"), "1"); // group rank 1 failed: not a success
  EXPECT_EQ(late.poll(now), Status::kJobFailed);
  EXPECT_EQ(late.failed_nodes(), "1");
}

// --- one store, one job (Note [One store, one job] in tools/kv_store.h) --------

// A store that never answers, or answers another protocol: another program.
struct ForeignStore : tools::KeyValue {
  int64_t add(const std::string&, int64_t) override {
    throw tools::KvError("the rendezvous store at h:7: no answer within 2000 ms");
  }
  void set(const std::string&, const std::string&) override {
    throw tools::KvError("the rendezvous store at h:7: no answer within 2000 ms");
  }
  std::optional<std::string> get(const std::string&) override {
    throw tools::KvError("the rendezvous store at h:7: no answer within 2000 ms");
  }
};

// A second job at the first one's port met in its store, and died with it.
TEST(KvStore, AStoreServesTheJobThatStartedItAndRefusesAnother) {
  MemoryKeyValue kv;
  kv.set(tools::kServedJobKey, "train-a");
  EXPECT_EQ(tools::check_served_job(kv, "train-a", "h:7"), "");
  EXPECT_EQ(tools::check_served_job(kv, "train-b", "h:7"),
            "--rdzv-endpoint h:7 already serves the rendezvous of job 'train-a', and this node is of job 'train-b': "
            "two jobs cannot share one rendezvous store (it ends with the job that serves it). Give this job a port of "
            "its own in --rdzv-endpoint, or --rdzv-id train-a if this node belongs to that job.");
  kv.set(tools::kServedJobKey, "");
  EXPECT_EQ(tools::check_served_job(kv, "", "h:7"), "") << "the nodes of a job without --rdzv-id meet";
  EXPECT_NE(tools::check_served_job(kv, "train-b", "h:7").find("serves the rendezvous of a job without --rdzv-id, and "
                                                                "this node is of job 'train-b'"), std::string::npos);
  EXPECT_EQ(tools::kServedJobKey.find('/'), std::string::npos) << "every job's keys hold a '/'";
}

// A port held by another program: the launcher waited 15 s, then said "the
// launcher ... has stopped".
TEST(KvStore, AProgramThatIsNotAStoreIsNamedAsSuch) {
  ForeignStore foreign;
  EXPECT_EQ(tools::check_served_job(foreign, "job", "h:7"),
            "--rdzv-endpoint h:7 is held by a program that is not a lockstep-run rendezvous store (the rendezvous "
            "store at h:7: no answer within 2000 ms); pick a free port for --rdzv-endpoint.");
  MemoryKeyValue silent; // answers, but names no job
  EXPECT_EQ(tools::check_served_job(silent, "job", "h:7"),
            "--rdzv-endpoint h:7 is held by a program that is not a lockstep-run rendezvous store (it names no job); "
            "pick a free port for --rdzv-endpoint.");
}

// --- a static job's nodes add up their counts (Note [Static nodes add up their counts]) --

// Nodes of 1 and 2 ranks were told WORLD_SIZE 2 and 4, and none was rank 1.
TEST(StaticMeeting, NodesOfDifferentCountsAddThemUpAsTorchrun) {
  const auto first = tools::static_layout({1, 2}, 0);
  const auto second = tools::static_layout({1, 2}, 1);
  EXPECT_EQ(first.world_size, 3);
  EXPECT_EQ(second.world_size, 3);
  EXPECT_EQ(first.rank_offset, 0);
  EXPECT_EQ(second.rank_offset, 1);
  EXPECT_EQ(tools::static_layout({2, 3, 1}, 2).rank_offset, 5);
  EXPECT_EQ(tools::describe_counts({1, 2}), "node 0: 1, node 1: 2");
  EXPECT_EQ(tools::decode_counts(tools::encode_counts({4, 1, 16})), (std::vector<int>{4, 1, 16}));
}

// --- GROUP_RANK numbers the nodes in every message ---------------------------------

// The logs said "node 1 joins" and "this node is node 0" of the same node.
TEST(Rendezvous, MessagesNumberTheMembersByGroupRank) {
  MemoryKeyValue kv;
  const auto s = settings(3, 3);
  const auto now = RdzvClock::now();
  std::vector<NodeDesc> nodes{node(kv, s), node(kv, s), node(kv, s)};
  std::vector<std::unique_ptr<RoundJoin>> joins;
  for (const auto& n : nodes) {
    joins.push_back(std::make_unique<RoundJoin>(kv, s, n, now));
  }
  const auto joined = poll_all(joins, now);
  ASSERT_EQ(joined.size(), 3u);
  EXPECT_EQ(joined[0].group_rank_of(nodes[0].id), 0) << "node ids count from 1";
  EXPECT_EQ(joined[0].group_rank_of(nodes[2].id), 2);
  EXPECT_EQ(joined[0].group_rank_of(99), -1);
  EXPECT_EQ(joined[0].group_ranks({nodes[0].id, nodes[2].id}), "0, 2");
}

// --- the desync report of one node of several (Note [A report from one node's records]) --

nlohmann::json collective(int64_t seq, const std::string& state) {
  nlohmann::json c = {{"seq", seq}, {"op", "allreduce"}, {"arg", "sum"}, {"dtype", "Float"}, {"numel", 4},
                      {"what", "allreduce"}, {"state", state}};
  c[state == "started" ? "waited_ms" : "duration_ms"] = 3000.0;
  return c;
}

nlohmann::json flight_record(const std::vector<nlohmann::json>& collectives, int64_t issued) {
  return {{"groups", {{{"issued", issued}, {"collectives", collectives}}}}};
}

// Rank 0 on the other node died: this node's ranks 2 and 3 waited in #1.
// The report said "every rank started" and blamed the connection.
TEST(DesyncReport, RanksOfOtherNodesAreNamedAsMissingNotTheLinkBlamed) {
  const auto stuck = flight_record({collective(0, "completed"), collective(1, "started")}, 2);
  const auto lines = tools::desync_report({{2, stuck}, {3, stuck}}, {2, 3}, {0, 1});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "every rank of this node started collective #1 (allreduce (sum) of 4 Float), and it did not "
                      "complete on ranks 2 and 3; ranks 0 and 1 ran on other nodes, so they are not in these records: "
                      "one of them may have died or stalled there. See the output of their nodes' launchers (the root "
                      "cause and desync report there).");
  EXPECT_EQ(lines[0].find("connection"), std::string::npos);
  const auto agreed = flight_record({collective(0, "completed")}, 1);
  const auto last = tools::desync_report({{4, agreed}}, {4}, {0, 1, 2, 3, 5});
  EXPECT_NE(last.back().find("ranks 0 to 3 and 5 ran on other nodes, so they are not in these records; see their "
                             "nodes' launchers."), std::string::npos) << last.back();
  EXPECT_NE(tools::desync_report({{0, stuck}, {1, stuck}}, {0, 1})[0].find("the connection between them failed"),
            std::string::npos) << "one node holds every rank: the link it is";
}

} // namespace
} // namespace lockstep
