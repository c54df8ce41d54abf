#pragma once

// lockstep-run's elastic agent (--rdzv-backend c10d, --nnodes MIN:MAX): this
// node's side of Note [Elastic rendezvous], round after round, with an
// Attempt of its ranks in each.

#include "attempt.h"
#include "kv_store.h"
#include "rendezvous.h"

#include <common/sockets.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <map>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace tools {

using Millis = std::chrono::milliseconds;

inline Millis seconds_to_ms(double seconds) {
  return Millis(static_cast<int64_t>(seconds * 1000));
}

inline RendezvousSettings rendezvous_settings(const Options& options) {
  RendezvousSettings s;
  s.min_nodes = options.min_nodes;
  s.max_nodes = options.nnodes;
  s.id = options.rdzv_job.empty() ? "job" : options.rdzv_job; // Note [The rendezvous's id] in tools/run_id.h
  s.join_timeout = seconds_to_ms(options.join_timeout);
  s.last_call = seconds_to_ms(options.last_call_timeout);
  s.keep_alive_interval = seconds_to_ms(options.keep_alive_interval);
  s.keep_alive_max_attempt = options.keep_alive_max_attempt;
  return s;
}

/// The address this machine reaches `host` from (a UDP "connection" sends
/// nothing), or `host` where that is a loopback (reachable_address), and a
/// free TCP port there for the workers' store.
inline std::pair<std::string, int> local_address_toward(const std::string& host, int port) {
  const auto addresses = detail::resolve_tcp(host, port);
  const addrinfo* a = addresses.first();
  if (a == nullptr) {
    throw KvError("--rdzv-endpoint " + host + " does not resolve: " + addresses.error);
  }
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  const int udp = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  const bool found = udp >= 0 && ::connect(udp, a->ai_addr, a->ai_addrlen) == 0 &&
      ::getsockname(udp, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  if (udp >= 0) {
    ::close(udp);
  }
  if (!found) {
    throw KvError("no route to --rdzv-endpoint " + host);
  }
  char text[NI_MAXHOST];
  ::getnameinfo(reinterpret_cast<sockaddr*>(&local), length, text, sizeof(text), nullptr, 0, NI_NUMERICHOST);
  const auto bound = detail::bind_first(detail::resolve_tcp(text, 0, AI_NUMERICHOST), /*listen=*/false, false);
  int free_port = 0;
  if (bound.fd >= 0) {
    free_port = detail::bound_port(bound.fd);
    ::close(bound.fd);
  }
  return {reachable_address(text, host), free_port};
}

/// One node of an elastic job. See Note [Elastic rendezvous].
class ElasticAgent {
  using Verdict = RoundWatch::Verdict;

 public:
  ElasticAgent(const Options& options, const std::string& program, KeyValue& kv, bool serves_store)
      : options_(options), program_(program), kv_(kv), s_(rendezvous_settings(options)), serves_store_(serves_store) {}

  /// The job's exit code on this node.
  int run() {
    me_.id = kv_.add(s_.key("nodes"), 1);
    me_.nproc = options_.nproc_per_node;
    std::tie(me_.addr, me_.port) = local_address_toward(options_.rdzv_host, options_.rdzv_port);
    if (!options_.local_addr.empty()) {
      me_.addr = options_.local_addr; // --local-addr: where the other nodes reach this node's ranks
    }
    agree_on_run_id();
    for (int attempt = 0;; ++attempt) {
      const auto joined = join();
      if (!joined) {
        return leave(g_launcher_signal != 0 ? stopped_while_joining() : ended_code_);
      }
      last_ = *joined;
      if (last_->restarts > options_.max_restarts) {
        return leave(give_up());
      }
      const int code = run_round(*last_, attempt);
      if (code >= 0) {
        return leave(code);
      }
    }
  }

 private:
  // The run id, the same on every node (lockstep-train's default output
  // folder): --rdzv-id, else the first node's.
  void agree_on_run_id() {
    if (!options_.rdzv_id.empty()) {
      run_id_ = options_.rdzv_id;
      return;
    }
    if (me_.id == 1) {
      kv_.set(s_.key("run_id"), options_.run_id);
    }
    const auto deadline = Clock::now() + s_.join_timeout;
    std::optional<std::string> id;
    while (!(id = kv_.get(s_.key("run_id"))) && Clock::now() < deadline && g_launcher_signal == 0) {
      std::this_thread::sleep_for(Millis(20));
    }
    run_id_ = id.value_or(options_.run_id);
  }

  // This node's place in the next round that takes it; nullopt when the job
  // completed without it, or on a signal.
  std::optional<Assignment> join() {
    RoundJoin join(kv_, s_, me_, Clock::now());
    std::fprintf(stderr, "lockstep-run: this node joins round %lld of the rendezvous at %s:%d (%d to %d nodes)\n",
                 static_cast<long long>(join.round()), options_.rdzv_host.c_str(),
                 options_.rdzv_port, s_.min_nodes, s_.max_nodes);
    bool said_waiting = false;
    int64_t waited_round = -1;
    while (g_launcher_signal == 0) {
      const auto status = join.poll(Clock::now());
      if (status == RoundJoin::Status::kJoined) {
        return join.assignment();
      }
      if (status == RoundJoin::Status::kJobComplete || status == RoundJoin::Status::kJobFailed) {
        return ended_while_waiting(join);
      }
      if (join.waiting() && !said_waiting) {
        std::fprintf(stderr, "lockstep-run: round %lld runs without this node; waiting for the next round.\n",
                     static_cast<long long>(join.round()));
        waited_round = join.round();
      }
      if (said_waiting && !join.waiting()) {
        std::fprintf(stderr, "lockstep-run: round %lld ended (its members restarted, or were lost: silent for %lld "
                     "ms); this node joins round %lld.\n", static_cast<long long>(waited_round),
                     static_cast<long long>(s_.liveness_window().count()), static_cast<long long>(join.round()));
      }
      said_waiting = join.waiting();
      std::this_thread::sleep_for(seconds_to_ms(options_.monitor_interval));
    }
    return std::nullopt;
  }

  // The job ended while this node waited to join (Note [The job ends while
  // a node waits]): nullopt, with exit code 0 or 1 in ended_code_. The node
  // that serves the store tells the other waiting nodes before it stops.
  std::optional<Assignment> ended_while_waiting(const RoundJoin& join) {
    if (join.failed_nodes().empty()) {
      std::fprintf(stderr, "lockstep-run: the job completed while this node waited to join; nothing to do.\n");
    } else if (join.why().empty()) {
      std::fprintf(stderr, "lockstep-run: the job ended while this node waited to join: node(s) %s left it with a "
                   "failure (see their logs).\n", join.failed_nodes().c_str());
    } else {
      std::fprintf(stderr, "lockstep-run: the job ended while this node waited to join: node(s) %s left it with a "
                   "failure (%s); see their logs.\n", join.failed_nodes().c_str(), join.why().c_str());
    }
    ended_code_ = join.failed_nodes().empty() ? 0 : 1;
    if (serves_store_) {
      close_job(kv_, s_, join.failed_nodes(), join.why());
      linger_for_waiting_nodes();
    }
    return std::nullopt;
  }

  int stopped_by_signal() const {
    std::fprintf(stderr, "lockstep-run: stopped by signal %d; every rank was stopped.\n",
                 static_cast<int>(g_launcher_signal));
    return 128 + g_launcher_signal;
  }

  // A signal while this node waited to join a round: no rank of it ran then.
  int stopped_while_joining() const {
    std::fprintf(stderr, "lockstep-run: stopped by signal %d while this node waited to join a round; %s\n",
                 static_cast<int>(g_launcher_signal), last_ ? "its ranks of the last round had already stopped."
                                                           : "no rank had started.");
    return 128 + g_launcher_signal;
  }

  Placement placement(const Assignment& a, int attempt) const {
    Placement p;
    p.group_rank = a.group_rank;
    p.group_world_size = a.group_world_size;
    p.rank_offset = a.rank_offset;
    p.world_size = a.world_size;
    p.restart_count = static_cast<int>(a.restarts);
    p.attempt = attempt;
    p.master_addr = a.master_addr;
    p.master_port = a.master_port;
    p.round_text = ", round " + std::to_string(a.round);
    return p;
  }

  void say_round(const Assignment& a) const {
    std::fprintf(stderr, "lockstep-run: round %lld: %d node(s), %d rank(s); this node is node %d, ranks %d to %d "
                 "(restarts so far: %lld)\n", static_cast<long long>(a.round), a.group_world_size, a.world_size,
                 a.group_rank, a.rank_offset, a.rank_offset + options_.nproc_per_node - 1,
                 static_cast<long long>(a.restarts));
    if (last_world_size_ != 0 && last_world_size_ != a.world_size) {
      std::fprintf(stderr, "lockstep-run: membership changed: world size %d -> %d\n", last_world_size_, a.world_size);
    }
  }

  // Runs this node's ranks in round `a`. Returns the job's exit code, or -1
  // to join the next round.
  int run_round(const Assignment& a, int attempt) {
    say_round(a);
    last_world_size_ = a.world_size;
    Options options = options_;
    options.run_id = run_id_;
    Attempt run(options, program_, placement(a, attempt));
    RoundWatch watch(kv_, s_, a, me_.id, Clock::now());
    RoundEnd ended = RoundEnd::kNone;
    auto over = Verdict::kHealthy; // set when another node ended the round, or the job ends elsewhere
    auto next_look = Clock::now();
    const int root_cause = run.run([&] {
      if (ended != RoundEnd::kNone || over != Verdict::kHealthy || Clock::now() < next_look) {
        return ended == RoundEnd::kNone && over == Verdict::kHealthy;
      }
      next_look = Clock::now() + seconds_to_ms(options_.monitor_interval);
      const auto verdict = watch.check(Clock::now());
      if (verdict == Verdict::kRoundOver || verdict == Verdict::kMemberFailed || verdict == Verdict::kLostAfterDone) {
        over = verdict;
      }
      if (verdict == Verdict::kMemberLost || verdict == Verdict::kNodeWaiting) {
        say_change(verdict, watch, a);
        ended = watch.end(RoundEnd::kMembership, s_.liveness_window());
      }
      return ended == RoundEnd::kNone && over == Verdict::kHealthy;
    });
    run.merge_timeline();
    if (g_launcher_signal != 0) {
      const int code = stopped_by_signal();
      print_killed_on_signal(run, options_.nproc_per_node, options_.grace_seconds);
      return code;
    }
    if (root_cause >= 0) {
      print_root_cause(run.rank(root_cause));
      print_stalled_ranks(run, root_cause, options_.nproc_per_node, options_.grace_seconds);
      run.print_desync_report();
      return on_rank_failure(watch, a);
    }
    if (ended == RoundEnd::kNone && over == Verdict::kHealthy) {
      return finish(watch, a);
    }
    if (over == Verdict::kMemberFailed) {
      return failed_elsewhere(watch, a);
    }
    if (over == Verdict::kLostAfterDone) {
      return lost_after_others_finished(watch, a);
    }
    return after_round(ended != RoundEnd::kNone ? ended : watch.reason_of(s_.liveness_window()));
  }

  // How member watch.lost() went: the signal that stopped its launcher, or its silence.
  std::string how_lost(const RoundWatch& watch) const {
    const std::string code = watch.lost_code(); // 128 + N: Note [A member that leaves with a failure]
    if (!code.empty()) {
      return "its launcher was stopped by signal " + std::to_string(std::atoi(code.c_str()) - 128);
    }
    char text[64];
    std::snprintf(text, sizeof(text), "no heartbeat for %.1f s", s_.liveness_window().count() / 1000.0);
    return text;
  }

  void say_change(Verdict verdict, const RoundWatch& watch, const Assignment& a) const {
    if (verdict == Verdict::kMemberLost) {
      std::fprintf(stderr, "lockstep-run: node %d is lost: %s; starting a new round without it.\n",
                   a.group_rank_of(watch.lost()), how_lost(watch).c_str());
    } else {
      std::fprintf(stderr, "lockstep-run: a node waits to join; starting a new round with it.\n");
    }
  }

  // A rank of this node failed. A failure after another member was done
  // ends the job (Note [Which came first, a failure or a member done] in
  // tools/rendezvous.h). Else, in a round of several nodes, a change of
  // membership if, within one liveness window, a node is lost or another
  // node ends the round as one (its ranks then fail too); else a failure,
  // counted against --max-restarts. A round of one node has nobody to lose:
  // a failure at once. Returns what after_round does, or the job's exit code.
  int on_rank_failure(RoundWatch& watch, const Assignment& a) {
    const int64_t done_before = watch.record_failure();
    if (done_before > 0) {
      return failed_after_others_finished(watch, a, done_before);
    }
    if (a.group_world_size == 1) {
      return after_round(watch.end(RoundEnd::kFailure, s_.liveness_window()));
    }
    const auto window = s_.liveness_window() + s_.keep_alive_interval;
    std::fprintf(stderr, "lockstep-run: waiting up to %.1f s (a liveness window) before counting this failure: if "
                 "another node is lost meanwhile, its loss failed the rank, and the round restarts without it.\n",
                 window.count() / 1000.0);
    for (const auto until = Clock::now() + window; Clock::now() < until && g_launcher_signal == 0;) {
      const auto verdict = watch.check(Clock::now());
      if (const auto code = ended_by_others(verdict, watch, a)) {
        return *code;
      }
      if (verdict == Verdict::kMemberLost || verdict == Verdict::kNodeWaiting) {
        say_change(verdict, watch, a);
        return after_round(watch.end(RoundEnd::kMembership, s_.liveness_window()));
      }
      std::this_thread::sleep_for(seconds_to_ms(options_.monitor_interval));
    }
    return after_round(watch.end(RoundEnd::kFailure, s_.liveness_window()));
  }

  // While this node waits after a failure in the round, its own or another
  // member's: what another node's news makes of the wait (the round ended,
  // a member left with a failure, or one was lost after another finished),
  // as after_round or the job's exit code; nullopt for other news. A member
  // cannot be done after a failure (RoundWatch::mark_done), so kMembersDone
  // does not come here.
  std::optional<int> ended_by_others(Verdict verdict, RoundWatch& watch, const Assignment& a) {
    switch (verdict) {
      case Verdict::kRoundOver:
        return after_round(watch.reason_of(s_.liveness_window()));
      case Verdict::kMemberFailed:
        return failed_elsewhere(watch, a);
      case Verdict::kLostAfterDone:
        return lost_after_others_finished(watch, a);
      default:
        return std::nullopt;
    }
  }

  // This node's ranks all finished, but another member's rank had failed
  // before in this round (Note [Which came first, a failure or a member
  // done]): the round failed, and the job has not finished. This node
  // waits, beating, for the failing member to end the round, and goes on
  // into the next with the others, as after a failure of its own.
  int await_failed_round(RoundWatch& watch, const Assignment& a) {
    std::fprintf(stderr, "lockstep-run: this node's ranks finished, but a rank of another node had failed before in "
                 "this round: the round failed, so this node waits for its end and runs again with the others.\n");
    while (g_launcher_signal == 0) {
      const auto verdict = watch.check(Clock::now());
      if (const auto code = ended_by_others(verdict, watch, a)) {
        return *code;
      }
      if (verdict == Verdict::kMemberLost) { // the failing member too: nobody else would end the round
        say_change(verdict, watch, a);
        return after_round(watch.end(RoundEnd::kMembership, s_.liveness_window()));
      }
      std::this_thread::sleep_for(seconds_to_ms(options_.monitor_interval));
    }
    return stopped_by_signal();
  }

  // Note [A failure after the job finished elsewhere]: a member whose ranks
  // all succeeded has left the job for good (its outputs are written), so a
  // restart would run this node's part again alone, or wait for a round the
  // others never join and then find the job "complete" and exit 0. Neither
  // is what happened: the job failed here. This node exits 1 and ends the
  // job for every node (Note [A member that leaves with a failure]): the
  // members still running stop, and the node that serves the store, which
  // waits for every member, reports it too.
  //
  // `count` members were done before the failure; each says so right after
  // it counts itself (RoundWatch::mark_done), so their names may come late.
  int failed_after_others_finished(const RoundWatch& watch, const Assignment& a, int64_t count) {
    auto members = watch.done_members();
    for (const auto until = Clock::now() + s_.liveness_window();
         static_cast<int64_t>(members.size()) < count && Clock::now() < until; members = watch.done_members()) {
      std::this_thread::sleep_for(Millis(20));
    }
    const std::string done = members.empty() ? "another node" : a.group_ranks(members);
    std::fprintf(stderr, "lockstep-run: a rank of this node failed after node(s) %s had finished the job; a restart "
                 "cannot bring them back, so the job ends here as a failure (not restarted).\n", done.c_str());
    return fail_job("a rank failed after node(s) " + done + " had finished the job");
  }

  // A member was lost after another was done: as for a failure after
  // another member finished the job (the Note above), no round can run the
  // job again without the finished member, whose part is done and gone; a
  // round of the survivors alone would rerun theirs and report success. The
  // job failed: this node ends it for every node, naming the node lost (as
  // finish() does on the node that serves the store), and exits 1.
  int lost_after_others_finished(const RoundWatch& watch, const Assignment& a) {
    const std::string lost = std::to_string(a.group_rank_of(watch.lost()));
    const std::string done = a.group_ranks(watch.done_members());
    const std::string why = "node " + lost + " was lost (" + how_lost(watch) + ") before its ranks finished, after "
        "node(s) " + done + " had finished the job";
    std::fprintf(stderr, "lockstep-run: %s: a new round cannot bring the finished nodes back, so the job failed; this "
                 "node stops its ranks and is not restarted.\n", why.c_str());
    try {
      close_job(kv_, s_, lost, why);
    } catch (const KvError&) {
      // The store is gone: nobody is left to tell.
    }
    return 1;
  }

  // Another member left the job with a failure (Note [A member that leaves
  // with a failure]): the job failed, and no round can restart it.
  int failed_elsewhere(const RoundWatch& watch, const Assignment& a) const {
    std::fprintf(stderr, "lockstep-run: node %d left the job with a failure (exit code %s; see its log): the job "
                 "failed, so this node stops its ranks and is not restarted.\n", a.group_rank_of(watch.failed().first),
                 watch.failed().second.c_str());
    return 1;
  }

  // No restarts are left: this node gives up, and the job fails on every node.
  int give_up() {
    std::fprintf(stderr, "lockstep-run: giving up after %d restart(s).\n", options_.max_restarts);
    return fail_job("gave up after " + std::to_string(options_.max_restarts) + " restart(s) of --max-restarts " +
                    std::to_string(options_.max_restarts));
  }

  // This node leaves the job with a failure that no round can undo: it ends
  // the job for every node, naming itself and `why`, before it says it
  // leaves (Note [A member that leaves with a failure]). Returns 1.
  int fail_job(const std::string& why) {
    try {
      close_job(kv_, s_, std::to_string(last_->group_rank), why);
    } catch (const KvError&) {
      // The store is gone: nobody is left to tell.
    }
    return 1;
  }

  // After a round ended: -1 to join the next, or the exit code.
  int after_round(RoundEnd ended) {
    if (g_launcher_signal != 0) {
      return stopped_by_signal();
    }
    if (ended == RoundEnd::kMembership) {
      std::fprintf(stderr, "lockstep-run: the membership changed; not counted as a restart.\n");
      return -1;
    }
    const int64_t restarts = kv_.add(s_.key("restarts"), 0);
    if (restarts > options_.max_restarts) {
      return give_up();
    }
    const double delay = restart_delay_seconds(options_, static_cast<int>(std::max<int64_t>(restarts - 1, 0)));
    std::fprintf(stderr, "lockstep-run: restarting every rank in a new round (restart %lld of %d) in %.1f s "
                 "(--restart-delay).\n", static_cast<long long>(restarts), options_.max_restarts, delay);
    return sleep_unless_signalled(delay) ? -1 : stopped_by_signal();
  }

  // This node's ranks all succeeded (after no failure in the round: else
  // await_failed_round). The node that serves the store keeps
  // it until every other member is done, gone or lost, then ends the job
  // for waiting nodes: failed if a member left with a failure or vanished.
  int finish(RoundWatch& watch, const Assignment& a) {
    if (!watch.mark_done()) {
      return await_failed_round(watch, a);
    }
    if (!serves_store_) {
      return 0;
    }
    while (g_launcher_signal == 0 && !watch.others_finished(Clock::now())) {
      watch.beat_if_due(Clock::now());
      std::this_thread::sleep_for(seconds_to_ms(options_.monitor_interval));
    }
    if (g_launcher_signal != 0) {
      // Stopped before the others finished: the job is not complete, and
      // this launcher says so, as one stopped while its ranks run does.
      std::fprintf(stderr, "lockstep-run: stopped by signal %d while the other nodes of the round were still "
                   "running; the job did not complete.\n", static_cast<int>(g_launcher_signal));
      return stopped_by_signal();
    }
    const auto vanished_ids = watch.vanished_members(Clock::now());
    auto failed_ids = watch.failed_members();
    const std::string vanished = a.group_ranks(vanished_ids), failed = a.group_ranks(failed_ids);
    failed_ids.insert(failed_ids.end(), vanished_ids.begin(), vanished_ids.end());
    std::sort(failed_ids.begin(), failed_ids.end()); // ids run in group rank order
    close_job(kv_, s_, a.group_ranks(failed_ids), vanished.empty() ? "" : "node(s) " + vanished + " stopped "
              "answering before their ranks finished");
    if (!failed.empty()) {
      std::fprintf(stderr, "lockstep-run: this node's ranks finished, but node(s) %s left the job before theirs "
                   "had (a failure, or a signal: see their logs); the job failed.\n", failed.c_str());
    }
    if (!vanished.empty()) {
      std::fprintf(stderr, "lockstep-run: this node's ranks finished, but node(s) %s stopped answering (no heartbeat "
                   "for %.1f s) before saying theirs had; their part of the job did not finish, so the job failed.\n",
                   vanished.c_str(), s_.liveness_window().count() / 1000.0);
    }
    return failed_ids.empty() ? 0 : 1;
  }

  // Says this node leaves the job with `code`. The node that serves the
  // store then waits for the others (members_left_with_failure) and lets
  // waiting nodes read the job's end; not when a signal stopped it: the
  // others lose the store with it either way, and a launcher told to stop
  // stops within moments. It exits 1 if a member left with a failure (Note
  // [A failure after the job finished elsewhere]).
  int leave(int code) {
    if (!last_) {
      return code;
    }
    std::string failed;
    try {
      kv_.set(s_.key(last_->round, "left/" + std::to_string(me_.id)), std::to_string(code));
      if (serves_store_ && g_launcher_signal == 0) {
        failed = members_left_with_failure();
        linger_for_waiting_nodes();
      }
    } catch (const KvError&) {
      // The store is gone: nobody is left to tell.
    }
    if (code == 0 && !failed.empty()) {
      std::fprintf(stderr, "lockstep-run: this node's ranks finished, but node(s) %s left the job before theirs "
                   "had (a failure, or a signal: see their logs); the job failed.\n", failed.c_str());
      return 1;
    }
    return code;
  }

  // Waits, for two liveness windows at most (or until a signal), until the
  // other members of the last round have left too: they may still have to
  // read how the round ended. Returns the group ranks of those that left
  // with a code other than 0.
  std::string members_left_with_failure() {
    std::string failed;
    const auto until = Clock::now() + 2 * s_.liveness_window();
    for (size_t i = 0; i < last_->members.size() && Clock::now() < until && g_launcher_signal == 0;) {
      const int64_t id = last_->members[i];
      const auto left = id == me_.id ? std::optional<std::string>("0") : kv_.get(s_.key(last_->round, "left/" + std::to_string(id)));
      if (!left) {
        std::this_thread::sleep_for(seconds_to_ms(options_.monitor_interval));
        continue;
      }
      if (*left != "0") {
        failed += (failed.empty() ? "" : ", ") + std::to_string(i);
      }
      ++i;
    }
    return failed;
  }

  // Once the job's end is written, the node that serves the store keeps it
  // a few polls longer, so that nodes waiting to join read it.
  void linger_for_waiting_nodes() {
    if (kv_.get(s_.key("complete"))) {
      std::this_thread::sleep_for(seconds_to_ms(options_.monitor_interval) * 3);
    }
  }

  const Options& options_;
  std::string program_;
  KeyValue& kv_;
  RendezvousSettings s_;
  bool serves_store_;
  NodeDesc me_;
  std::string run_id_;
  int last_world_size_ = 0;
  int ended_code_ = 0; // the job's end, seen while waiting to join
  std::optional<Assignment> last_; // the last round this node was a member of
};

} // namespace tools
} // namespace lockstep
