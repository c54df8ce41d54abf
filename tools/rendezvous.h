#pragma once

// Elastic membership for lockstep-run: the rendezvous rounds and the watch
// over a running round, as pure logic over a KeyValue store and a clock the
// caller passes in, so that tests drive several nodes without threads.
//
// Note [Elastic rendezvous]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The launchers of a job meet in a store that one of them serves on
// --rdzv-endpoint (tools/kv_store.h); all keys are under the job's id
// (Note [The rendezvous's id] in tools/run_id.h). Each
// launcher takes a node id once, from the counter "nodes": the order of the
// ids is the order of the ranks, so the nodes that stay keep their order and
// a node that joins comes after them.
//
// Rounds. The counter "round" is the round that is open or running. A node
// joins round R by taking a place (counter "R/joined") and writing its
// description there ("R/node/<place>": id, ranks, address, a free port). The
// round closes as soon as --nnodes MAX nodes are in, or when last_call has
// passed since MIN were: the first node to see that takes "R/close" and
// writes the members ("R/members", with the failure count "restarts"). A node
// that is not among them, because it came late or the round was full, is
// waiting: it says so ("R/waiting") and joins the next round.
//
// A running round. Every member counts its heartbeat up ("R/hb/<id>") every
// keep_alive_interval; a member whose count has not moved for
// keep_alive_interval x keep_alive_max_attempt is lost. The first member to
// see a lost member, or a waiting node while the round has room, ends the
// round (takes "R/end", writes "R/reason", counts "round" up); every member
// sees "round" move, stops its workers and joins the next round. A member
// whose launcher a signal stopped says so ("R/left/<id>", 128 + N) and is
// gone at once, without the window. A member whose own worker failed waits
// out one liveness window first (unless it is the round's only member): a
// worker that failed because a peer's node died is a change of membership,
// not a failure. Only failures count against --max-restarts ("restarts").
//
// The end. A member whose workers all succeeded says so ("R/done/<id>"); the
// node that serves the store waits for every member to be done, gone or
// lost, then writes "complete" so that waiting nodes exit too (naming the
// members lost or failed before they were done: the job failed); when it is
// itself waiting, each waiting node sees the end in the members' "R/left/<id>"
// (Note [The job ends while a node waits]). A member whose
// worker fails after another is done does not restart: the job failed (Note
// [A failure after the job finished elsewhere] in elastic_agent.h; which
// came first: Note [Which came first, a failure or a member done]). A
// member lost after another is done ends the job as failed, naming it,
// rather than start a round without it. Nor
// does one that gives up after --max-restarts: a node that leaves with a
// failure ends the job on every node (Note [A member that leaves with a
// failure]). The store lives in one launcher: if that node is lost, every
// other node fails with an error that names the store (a replicated store
// would survive it; this one is simple and its failure is loud).

#include "kv_store.h"
#include "rendezvous_records.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace tools {

/// A member's heartbeat as another node follows it: the count last read,
/// and when it last moved.
using Heartbeat = std::pair<int64_t, RdzvClock::time_point>;

/// Reads member `id`'s heartbeat count in `round` into `beat`; whether it
/// has not moved for the liveness window (the member is lost).
inline bool heartbeat_stopped(KeyValue& kv, const RendezvousSettings& s, int64_t round, int64_t id, Heartbeat& beat,
                              RdzvClock::time_point now) {
  const int64_t count = kv.add(s.key(round, "hb/" + std::to_string(id)), 0);
  if (count != beat.first) {
    beat = {count, now};
    return false;
  }
  return now - beat.second > s.liveness_window();
}

/// Why a running round ends.
enum class RoundEnd { kNone, kMembership, kFailure };

inline const char* to_string(RoundEnd reason) {
  return reason == RoundEnd::kFailure ? "failure" : reason == RoundEnd::kMembership ? "membership" : "none";
}

/// Ends `round` for `reason` and opens the next; false when another node
/// ended it first.
inline bool end_round(KeyValue& kv, const RendezvousSettings& s, int64_t round, RoundEnd reason) {
  if (kv.add(s.key(round, "end"), 1) != 1) {
    return false;
  }
  kv.set(s.key(round, "reason"), to_string(reason));
  if (reason == RoundEnd::kFailure) {
    kv.add(s.key("restarts"), 1);
  }
  kv.add(s.key("round"), 1);
  return true;
}

// Note [A member that leaves with a failure]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A member that leaves the job writes its exit code ("R/left/<id>"). 0: its
// part finished. 128 + N: signal N stopped its launcher (scancel, a
// preempted machine); that node is gone as a lost one is (at once, not
// after the liveness window), and the others may go on without it in a new
// round, as torchrun's do (its agent keeps
// the rendezvous open on a signal). Any other code is a failure that no
// round can undo: the node gave up after --max-restarts, its ranks
// failed after another member had finished (Note [A failure after the job
// finished elsewhere] in elastic_agent.h), or it saw a member lost after
// another had finished. Such a node ends the job for
// every node, as torchrun's agent closes the rendezvous (launcher/api.py's
// shutdown): it writes the job's end ("complete", naming the nodes that
// failed, and "why",
// the cause in words) so that waiting nodes stop at once, and each member
// still running sees its code, stops its ranks and exits 1, rather than
// wait for its heartbeat to go quiet, take it for lost and run the job
// again without it. The first end written stands ("closing").

/// How a member left the job, from the exit code it wrote. See Note [A
/// member that leaves with a failure].
enum class Departure { kFinished, kStopped, kFailed };

inline Departure departure_of(const std::string& code) {
  if (code == "0") {
    return Departure::kFinished;
  }
  return std::atoi(code.c_str()) > 128 ? Departure::kStopped : Departure::kFailed;
}

/// Writes the job's end for every node unless another node wrote it first:
/// `failed`, the group ranks of the nodes that failed ("" when the job
/// succeeded), and `why`, the failure's cause in words (or "").
inline void close_job(KeyValue& kv, const RendezvousSettings& s, const std::string& failed, const std::string& why) {
  if (kv.add(s.key("closing"), 1) != 1) {
    return;
  }
  if (!failed.empty() && !why.empty()) {
    kv.set(s.key("why"), why); // before "complete": a node that reads "complete" finds it
  }
  kv.set(s.key("complete"), failed.empty() ? kJobSucceeded : failed);
}

/// One node's way into a round, a step at a time: poll() until it returns
/// the node's assignment. A node left out of a round waits for the next.
class RoundJoin {
 public:
  enum class Status { kPending, kJoined, kJobComplete, kJobFailed };

  RoundJoin(KeyValue& kv, const RendezvousSettings& settings, NodeDesc me, RdzvClock::time_point now)
      : kv_(kv), s_(settings), me_(std::move(me)) {
    enter(kv_.add(s_.key("round"), 0), now);
  }

  /// One step. kJoined: assignment() holds the round; kJobComplete: the job
  /// finished while this node waited; kJobFailed: it ended with a failure
  /// on failed_nodes(). Throws RendezvousError after join_timeout.
  Status poll(RdzvClock::time_point now) {
    if (const auto complete = kv_.get(s_.key("complete"))) { // kJobSucceeded, or the nodes that failed
      failed_nodes_ = *complete == kJobSucceeded ? "" : *complete;
      why_ = failed_nodes_.empty() ? "" : kv_.get(s_.key("why")).value_or("");
      return failed_nodes_.empty() ? Status::kJobComplete : Status::kJobFailed;
    }
    if (waiting_) {
      const int64_t current = kv_.add(s_.key("round"), 0);
      if (current != round_) {
        enter(current, now);
        return Status::kPending;
      }
      return ended_without_this_node(now);
    }
    auto members = kv_.get(s_.key(round_, "members"));
    if (!members) {
      maybe_close(now);
      members = kv_.get(s_.key(round_, "members"));
    }
    if (members) {
      assignment_ = assign(RoundRecord::decode(round_, *members), me_.id);
      if (assignment_.group_rank >= 0) {
        return Status::kJoined;
      }
      wait_for_next_round();
      return Status::kPending;
    }
    if (joined_ < s_.min_nodes && now - round_started_ > s_.join_timeout) { // with MIN in, the last call closes it
      throw RendezvousError("round " + std::to_string(round_) + " of the rendezvous did not close within join_timeout (" +
                            std::to_string(s_.join_timeout.count() / 1000) + " s): " + std::to_string(joined_) + " of " +
                            "at least " + std::to_string(s_.min_nodes) + " node(s) joined. Start the missing nodes, or " +
                            "lower MIN in --nnodes MIN:MAX.");
    }
    return Status::kPending;
  }

  const Assignment& assignment() const {
    return assignment_;
  }
  int64_t round() const {
    return round_;
  }
  bool waiting() const {
    return waiting_;
  }
  /// After kJobFailed: the group ranks of the nodes that left the job with a
  /// failure, in its last round ("0, 2").
  const std::string& failed_nodes() const {
    return failed_nodes_;
  }
  /// After kJobFailed: why, in words, when the node that ended it said so.
  const std::string& why() const {
    return why_;
  }

 private:
  // Note [The job ends while a node waits]: "complete" is written by the
  // node that serves the store, once it finished as a member, or by a node
  // that left with a failure (Note [A member that leaves with a failure]).
  // When the store's node is the one waiting (it joined after MAX others)
  // and every member finished, nobody writes it; so a waiting node reads
  // the round it waits behind itself, and the job has ended once every
  // member of that round has left it (each writes
  // left/ID with its exit code). Members that restart move to a new round,
  // which the waiting node then joins. Members can also vanish without a
  // code (their machines lost, their launchers killed): the waiting node
  // follows their heartbeats as members follow each other's, and a member
  // silent for the liveness window is gone. When every member has left or
  // is gone, the job has ended (failed on the codes that are not 0 and on
  // those gone unfinished) if any member left or finished; if all vanished
  // without a word, the waiting node takes their loss as a change of
  // membership, as a member would: it ends the round and joins the next,
  // which runs without them or, short of MIN nodes, ends at join_timeout
  // with that error.
  Status ended_without_this_node(RdzvClock::time_point now) {
    const auto members = kv_.get(s_.key(round_, "members"));
    if (!members) {
      return Status::kPending;
    }
    std::string failed;
    bool running = false; // some member neither left nor is gone
    bool said = false;    // some member left with a code or said it is done
    const auto nodes = RoundRecord::decode(round_, *members).nodes;
    for (size_t group_rank = 0; group_rank < nodes.size(); ++group_rank) {
      const NodeDesc& n = nodes[group_rank];
      const std::string id = std::to_string(n.id);
      const auto left = kv_.get(s_.key(round_, "left/" + id));
      const bool done = kv_.get(s_.key(round_, "done/" + id)).has_value();
      auto& beat = member_beats_.try_emplace(n.id, Heartbeat{-1, now}).first->second;
      // Every member's count is read at every poll, so that each is gone one window after it fell silent.
      const bool gone = heartbeat_stopped(kv_, s_, round_, n.id, beat, now);
      running = running || (!left && !gone);
      said = said || left || done;
      if (left ? *left != "0" : !done) {
        failed += (failed.empty() ? "" : ", ") + std::to_string(group_rank);
      }
    }
    if (running) {
      return Status::kPending;
    }
    if (!said) {
      end_round(kv_, s_, round_, RoundEnd::kMembership); // the next poll joins the next round
      return Status::kPending;
    }
    failed_nodes_ = failed;
    return failed.empty() ? Status::kJobComplete : Status::kJobFailed;
  }

  void enter(int64_t round, RdzvClock::time_point now) {
    round_ = round;
    round_started_ = now;
    min_seen_.reset();
    waiting_ = false;
    if (kv_.get(s_.key(round_, "members"))) { // closed already: wait for the next
      wait_for_next_round();
      return;
    }
    place_ = kv_.add(s_.key(round_, "joined"), 1);
    kv_.set(s_.key(round_, "node/" + std::to_string(place_)), me_.encode());
  }

  void wait_for_next_round() {
    waiting_ = true;
    member_beats_.clear();
    kv_.add(s_.key(round_, "waiting"), 1);
  }

  // Closes the round if it is full, or if last_call has passed since MIN joined.
  void maybe_close(RdzvClock::time_point now) {
    joined_ = kv_.add(s_.key(round_, "joined"), 0);
    if (joined_ >= s_.min_nodes && !min_seen_) {
      min_seen_ = now;
    }
    const bool full = joined_ >= s_.max_nodes;
    if (!full && !(min_seen_ && now - *min_seen_ >= s_.last_call)) {
      return;
    }
    // A node between taking its place and describing itself (or one that
    // died there) is left for the next round; but the round closes only
    // with MIN nodes described, or it would run below MIN (until join_timeout).
    std::vector<NodeDesc> described;
    for (int64_t place = 1; place <= std::min<int64_t>(joined_, s_.max_nodes); ++place) {
      if (const auto desc = kv_.get(s_.key(round_, "node/" + std::to_string(place)))) {
        described.push_back(NodeDesc::decode(*desc));
      }
    }
    if (static_cast<int64_t>(described.size()) < s_.min_nodes) {
      joined_ = static_cast<int64_t>(described.size());
      return;
    }
    if (kv_.add(s_.key(round_, "close"), 1) != 1) {
      return; // another node closes it
    }
    RoundRecord record;
    record.round = round_;
    record.restarts = kv_.add(s_.key("restarts"), 0);
    record.nodes = std::move(described);
    std::sort(record.nodes.begin(), record.nodes.end(), [](const NodeDesc& a, const NodeDesc& b) { return a.id < b.id; });
    kv_.set(s_.key(round_, "members"), record.encode());
  }

  KeyValue& kv_;
  const RendezvousSettings& s_;
  NodeDesc me_;
  RdzvClock::time_point round_started_;
  std::optional<RdzvClock::time_point> min_seen_;
  int64_t round_ = 0;
  int64_t place_ = 0;
  int64_t joined_ = 0;
  bool waiting_ = false;
  std::string failed_nodes_;
  std::string why_;
  Assignment assignment_;
  std::map<int64_t, Heartbeat> member_beats_; // while waiting: the members of round_
};

// Note [Which came first, a failure or a member done]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A member whose rank failed waits one liveness window before it calls the
// failure one (Note [Elastic rendezvous]); a member whose ranks finish in
// that window did not finish the job before the failure: the round had
// failed already, and a restart reruns every node's part (a rank that
// fails at t=1 s and a node done at t=8 s is a failure to restart, not a
// failure after the job finished). Only a member done before the failure
// makes it one that no restart can undo (Note [A failure after the job
// finished elsewhere] in elastic_agent.h). The nodes' clocks are not one
// clock, so the store orders the two: one counter per round ("R/outcome"),
// to which a failure adds 1 and a member done adds kDoneWeight, in one
// atomic ADD each. The sum before a node's own ADD says what came first:
// a failing member reads how many members were done before it, a member
// done reads whether a failure came before it. That member then does not
// say it is done ("R/done/<id>"): it waits, beating, for the round's end
// and goes on with the others into the next round.
constexpr int64_t kDoneWeight = int64_t{1} << 32;

/// A member's watch over its running round: its own heartbeat, the others',
/// nodes waiting to join, and the round's end. check() is one step.
class RoundWatch {
 public:
  /// kMemberLost: a member is gone (silent for the liveness window, or its
  /// launcher stopped by a signal), and no member is done: a new round can
  /// go on without it. kLostAfterDone: the same after a member was done:
  /// the job failed, as no round can bring the finished member back.
  enum class Verdict { kHealthy, kRoundOver, kMemberLost, kNodeWaiting, kMembersDone, kMemberFailed, kLostAfterDone };

  RoundWatch(KeyValue& kv, const RendezvousSettings& settings, const Assignment& a, int64_t me, RdzvClock::time_point now)
      : kv_(kv), s_(settings), a_(a), me_(me) {
    for (int64_t id : a_.members) {
      if (id != me_) {
        beats_[id] = {-1, now};
      }
    }
    beat(now);
  }

  /// This member's heartbeat, when one is due.
  void beat_if_due(RdzvClock::time_point now) {
    if (now >= next_beat_) {
      beat(now);
    }
  }

  Verdict check(RdzvClock::time_point now) {
    beat_if_due(now);
    if (kv_.add(s_.key("round"), 0) != a_.round) {
      return Verdict::kRoundOver;
    }
    bool any_done = false;
    int64_t lost = -1;
    for (auto& [id, beat] : beats_) {
      const auto left = kv_.get(s_.key(a_.round, "left/" + std::to_string(id)));
      if (left && departure_of(*left) == Departure::kFailed) { // Note [A member that leaves with a failure]
        failed_ = {id, *left};
        return Verdict::kMemberFailed;
      }
      const bool done = kv_.get(s_.key(a_.round, "done/" + std::to_string(id))).has_value();
      any_done = any_done || done;
      // Every member's count is read at every check, so that each is lost one window after it fell silent;
      // a member whose launcher a signal stopped is gone at once.
      const bool silent = heartbeat_stopped(kv_, s_, a_.round, id, beat, now);
      if ((silent || (left && departure_of(*left) == Departure::kStopped)) && !done && lost < 0) {
        lost = id;
      }
    }
    if (lost >= 0) {
      lost_ = lost;
      return any_done ? Verdict::kLostAfterDone : Verdict::kMemberLost;
    }
    if (any_done) {
      return Verdict::kMembersDone; // the job is ending: no new round for joiners
    }
    if (a_.group_world_size < s_.max_nodes && kv_.add(s_.key(a_.round, "waiting"), 0) > 0) {
      return Verdict::kNodeWaiting;
    }
    return Verdict::kHealthy;
  }

  /// A rank of this member failed: says so in the round's order (Note
  /// [Which came first, a failure or a member done]) and returns how many
  /// members were done before it.
  int64_t record_failure() {
    return (kv_.add(s_.key(a_.round, "outcome"), 1) - 1) / kDoneWeight;
  }

  /// This member's ranks all succeeded: it says it is done, unless a
  /// member's rank failed before (then false: the round failed, and this
  /// member goes on into the next with the others).
  bool mark_done() {
    if ((kv_.add(s_.key(a_.round, "outcome"), kDoneWeight) - kDoneWeight) % kDoneWeight != 0) {
      return false;
    }
    kv_.set(s_.key(a_.round, "done/" + std::to_string(me_)), "1");
    return true;
  }

  /// Whether every other member is done, has left the job, or is lost.
  bool others_finished(RdzvClock::time_point now) {
    for (auto& [id, beat] : beats_) {
      if (standing(id, beat, now) == Standing::kRunning) {
        return false;
      }
    }
    return true;
  }

  /// The other members lost without saying they were done or leaving: their
  /// machines or launchers died, and their part of the job did not finish.
  std::vector<int64_t> vanished_members(RdzvClock::time_point now) {
    std::vector<int64_t> vanished;
    for (auto& [id, beat] : beats_) {
      if (standing(id, beat, now) == Standing::kVanished) {
        vanished.push_back(id);
      }
    }
    return vanished;
  }

  /// The other members that left the job with a code other than 0 (a
  /// failure, or a signal) before saying they were done: their part of the
  /// job did not finish.
  std::vector<int64_t> failed_members() const {
    std::vector<int64_t> failed;
    for (const auto& entry : beats_) {
      const auto left = kv_.get(s_.key(a_.round, "left/" + std::to_string(entry.first)));
      if (left && *left != "0" && !kv_.get(s_.key(a_.round, "done/" + std::to_string(entry.first)))) {
        failed.push_back(entry.first);
      }
    }
    return failed;
  }

  /// The other members whose ranks all succeeded.
  std::vector<int64_t> done_members() const {
    std::vector<int64_t> done;
    for (const auto& entry : beats_) {
      if (kv_.get(s_.key(a_.round, "done/" + std::to_string(entry.first)))) {
        done.push_back(entry.first);
      }
    }
    return done;
  }

  /// Ends the round for `reason` unless another member ended it first, and
  /// returns the reason it ended for (waiting up to `timeout` for the first
  /// member to write it).
  RoundEnd end(RoundEnd reason, std::chrono::milliseconds timeout) {
    return end_round(kv_, s_, a_.round, reason) ? reason : reason_of(timeout);
  }

  /// Why the round ended (someone else ended it).
  RoundEnd reason_of(std::chrono::milliseconds timeout) {
    const auto deadline = RdzvClock::now() + timeout;
    while (true) {
      if (const auto text = kv_.get(s_.key(a_.round, "reason"))) {
        return *text == "failure" ? RoundEnd::kFailure : RoundEnd::kMembership;
      }
      if (RdzvClock::now() > deadline) {
        throw RendezvousError("round " + std::to_string(a_.round) + " was ended, but no node said why within " +
                              std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  /// After kMemberLost or kLostAfterDone: the member gone.
  int64_t lost() const {
    return lost_;
  }
  /// After kMemberLost or kLostAfterDone: the code it left with, when its
  /// launcher said goodbye (a signal); empty when it fell silent.
  std::string lost_code() const {
    return kv_.get(s_.key(a_.round, "left/" + std::to_string(lost_))).value_or("");
  }
  /// After kMemberFailed: the member that left with a failure, and its code.
  const std::pair<int64_t, std::string>& failed() const {
    return failed_;
  }

 private:
  enum class Standing { kRunning, kFinished, kVanished };

  Standing standing(int64_t id, Heartbeat& beat, RdzvClock::time_point now) {
    const bool stopped = heartbeat_stopped(kv_, s_, a_.round, id, beat, now);
    if (kv_.get(s_.key(a_.round, "done/" + std::to_string(id))) ||
        kv_.get(s_.key(a_.round, "left/" + std::to_string(id)))) {
      return Standing::kFinished;
    }
    return stopped ? Standing::kVanished : Standing::kRunning;
  }

  void beat(RdzvClock::time_point now) {
    kv_.add(s_.key(a_.round, "hb/" + std::to_string(me_)), 1);
    next_beat_ = now + s_.keep_alive_interval;
  }

  KeyValue& kv_;
  const RendezvousSettings& s_;
  Assignment a_;
  int64_t me_;
  std::map<int64_t, Heartbeat> beats_;
  RdzvClock::time_point next_beat_;
  int64_t lost_ = -1;
  std::pair<int64_t, std::string> failed_{-1, ""};
};

} // namespace tools
} // namespace lockstep
