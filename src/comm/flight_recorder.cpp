#include "comm/flight_recorder.h"

#include "comm/before_abort.h"
#include "comm/collective_check.h"
#include "comm/forwarding_group.h"
#include "comm/forwarding_work.h"

#include <torch/types.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

namespace lockstep {
namespace detail {

// Note [Flight recorder]
// ~~~~~~~~~~~~~~~~~~~~~~
// When a job hangs or dies in a collective, the question is which rank
// diverged, at which collective, and what the others were doing. Every rank
// numbers the collectives of each group in the order it issues them (the
// same order on every rank, by the rules of collectives), and keeps the last
// few hundred: operation, dtype, shape, state (queued in the backend, where
// it can tell, as the mpi backend's communication thread can; started;
// completed; failed), what for (the `what` every caller
// passes: "allreduce of bucket 2 ...", "the broadcast of rank 0's buffers"),
// state and times. The record is a wrapper around the backend's GroupImpl,
// so every backend and every caller is covered, DDP's reducer, join,
// SyncBatchNorm and user calls alike. The cost is one mutex and one small
// copy per collective, a few per step.
//
// On a failed or timed-out wait, the rank writes its record: a short
// summary to stderr and the whole of it as JSON to $LOCKSTEP_TRACE_DIR (which
// lockstep-run sets), anew after each failure it survived (Note [Every
// failure dumps]). lockstep-run reads the ranks' files after a failure and
// names the first sequence number where they disagree or where some never
// arrived (tools/desync_report.h).
//
// The recorder only records: it sends nothing of its own. The check before
// each collective is the layer below (Note [Ranks agree before they send]);
// under LOCKSTEP_DEBUG=detail its errors carry the same sequence numbers as
// this record (Note [LOCKSTEP_DEBUG=detail]), and its failures reach this
// layer from wait() like the collective's own, so they are recorded and
// dumped.
//
// Over NCCL, Work::wait() only makes the current CUDA stream wait, so
// "completed" there means queued on the GPU, and a peer that never arrives is
// caught by PyTorch's own NCCL watchdog, which ends the process without this
// record: the recorder's dumps and the desync report are Gloo's and MPI's.

namespace {

using Clock = std::chrono::steady_clock;

const char* kOpNames[] = {"allreduce", "broadcast", "all_gather", "barrier", "reduce_scatter"};
enum Op : int64_t { kAllreduce = 0, kBroadcast = 1, kAllGather = 2, kBarrier = 3, kReduceScatter = 4 };
const char* kReduceNames[] = {"sum", "avg", "max", "min"};

// What the caller asked for, not what reaches the backend: an Avg is a Sum
// there unless the backend averages (Note [Average]), and a record that said "sum" for both would hide
// ranks that disagree on it from the desync report.
const char* reduction_name(ReduceOp backend_op) {
  return kReduceNames[caller_reduction(static_cast<int64_t>(backend_op))];
}

int64_t unix_ms(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

struct Entry {
  int64_t seq = 0;
  Op op = kAllreduce;
  std::string arg; // "sum", "root 0", or ""
  std::string dtype;
  int64_t numel = 0;
  std::vector<int64_t> shape;
  std::string what;
  std::string state = "started"; // "queued" at a dump while the backend has not begun it
  std::weak_ptr<Work> work; // the backend's, to ask whether it has begun
  std::string error;
  Clock::time_point started;
  std::chrono::system_clock::time_point started_wall;
  Clock::time_point ended;
};

class FlightRecorder {
 public:
  FlightRecorder(int rank, int size, std::string backend, std::chrono::milliseconds timeout, size_t capacity)
      : rank_(rank), size_(size), backend_(std::move(backend)), timeout_(timeout), capacity_(capacity) {}

  int64_t start(Op op, std::string arg, const std::vector<torch::Tensor>& tensors, const std::string& what) {
    Entry e;
    e.op = op;
    e.arg = std::move(arg);
    if (!tensors.empty()) {
      e.dtype = c10::toString(caller_dtype(tensors[0].scalar_type())); // Note [The caller's collective]
      e.shape = tensors[0].sizes().vec();
      for (const auto& t : tensors) {
        e.numel += t.numel();
      }
    }
    e.what = what;
    e.started = Clock::now();
    e.started_wall = std::chrono::system_clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    e.seq = next_seq_++;
    if (capacity_ > 0) {
      entries_.push_back(std::move(e));
      while (entries_.size() > capacity_) {
        entries_.pop_front();
      }
    }
    return next_seq_ - 1;
  }

  void attach(int64_t seq, const std::shared_ptr<Work>& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
      if (it->seq == seq) {
        it->work = work;
        return;
      }
    }
  }

  void finish(int64_t seq, const char* state, const std::string& error = "") {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
      if (it->seq == seq) {
        if (it->state == "started") {
          it->state = state;
          it->error = error;
          it->ended = Clock::now();
        }
        return;
      }
    }
  }

  nlohmann::json to_json(size_t index) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = Clock::now();
    nlohmann::json collectives = nlohmann::json::array();
    for (const auto& e : entries_) {
      std::string state = e.state;
      if (state == "started") {
        const auto work = e.work.lock();
        state = work != nullptr && !work->started() ? "queued" : "started";
      }
      nlohmann::json c = {{"seq", e.seq}, {"op", kOpNames[e.op]}, {"arg", e.arg}, {"dtype", e.dtype},
                          {"numel", e.numel}, {"shape", e.shape}, {"what", e.what}, {"state", state},
                          {"started_unix_ms", unix_ms(e.started_wall)}};
      if (e.state == "started") { // queued or started: not ended
        c["waited_ms"] = std::chrono::duration_cast<std::chrono::milliseconds>(now - e.started).count();
      } else {
        c["duration_ms"] = std::chrono::duration<double, std::milli>(e.ended - e.started).count();
      }
      if (!e.error.empty()) {
        c["error"] = e.error;
      }
      collectives.push_back(std::move(c));
    }
    return {{"index", index}, {"backend", backend_}, {"rank", rank_}, {"size", size_},
            {"timeout_ms", timeout_.count()}, {"issued", next_seq_}, {"collectives", std::move(collectives)}};
  }

  int rank() const {
    return rank_;
  }

 private:
  const int rank_;
  const int size_;
  const std::string backend_;
  const std::chrono::milliseconds timeout_;
  const size_t capacity_;
  mutable std::mutex mutex_;
  std::deque<Entry> entries_;
  int64_t next_seq_ = 0;
};

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::vector<std::weak_ptr<FlightRecorder>>& registry() {
  static std::vector<std::weak_ptr<FlightRecorder>> recorders;
  return recorders;
}

// Note [Every failure dumps]: whether a collective completed since the last
// dump, or none was made (trivially destructible: the dump before an abort
// may run while the process exits).
std::atomic<bool> g_dump_due{true};

// set_process_rank's, or -1 (trivially destructible, as above).
std::atomic<int> g_process_rank{-1};

// The dump, with the recorder of the group whose collective failed (nullptr: unknown).
void dump_records(const std::string& reason, const FlightRecorder* failed);

size_t trace_buffer_size() {
  const char* text = std::getenv("LOCKSTEP_TRACE_BUFFER_SIZE");
  if (text == nullptr || *text == '\0') {
    return kDefaultTraceBufferSize;
  }
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  TORCH_CHECK(end != text && *end == '\0' && value >= 0, "lockstep: environment variable LOCKSTEP_TRACE_BUFFER_SIZE=\"",
              text, "\" is malformed; expected how many collectives to keep, 0 or more (0: none).");
  return static_cast<size_t>(value);
}

class RecordedWork : public ForwardingWork {
 public:
  RecordedWork(std::shared_ptr<Work> inner, std::shared_ptr<FlightRecorder> recorder, int64_t seq)
      : ForwardingWork(std::move(inner)), recorder_(std::move(recorder)), seq_(seq) {}
  void wait() override {
    try {
      inner_->wait();
    } catch (const c10::Error& e) {
      recorder_->finish(seq_, "failed", e.what_without_backtrace());
      dump_records(e.what_without_backtrace(), recorder_.get());
      throw;
    }
    recorder_->finish(seq_, "completed");
    g_dump_due.store(true, std::memory_order_relaxed);
  }

 private:
  std::shared_ptr<FlightRecorder> recorder_;
  int64_t seq_;
};

class RecordedGroup : public ForwardingGroup {
 public:
  RecordedGroup(std::shared_ptr<GroupImpl> inner, size_t capacity)
      : ForwardingGroup(std::move(inner)),
        recorder_(std::make_shared<FlightRecorder>(inner_->rank(), inner_->size(), inner_->backend(), inner_->timeout(),
                                                   capacity)) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().push_back(recorder_);
  }

  std::shared_ptr<Work> allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op, std::string what) override {
    return run(kAllreduce, reduction_name(op), tensors, what,
               [&] { return inner_->allreduce(tensors, op, what); });
  }
  std::shared_ptr<Work> broadcast(std::vector<torch::Tensor>& tensors, int root, std::string what) override {
    return run(kBroadcast, "root " + std::to_string(root), tensors, what,
               [&] { return inner_->broadcast(tensors, root, what); });
  }
  std::shared_ptr<Work> all_gather(std::vector<torch::Tensor>& outputs, torch::Tensor& input, std::string what) override {
    std::vector<torch::Tensor> inputs{input};
    return run(kAllGather, "", inputs, what, [&] { return inner_->all_gather(outputs, input, what); });
  }
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, torch::Tensor& input, ReduceOp op, std::string what) override {
    std::vector<torch::Tensor> inputs{input};
    return run(kReduceScatter, reduction_name(op), inputs, what,
               [&] { return inner_->reduce_scatter(output, input, op, what); });
  }
  std::shared_ptr<Work> barrier(std::string what) override {
    std::vector<torch::Tensor> none;
    return run(kBarrier, "", none, what, [&] { return inner_->barrier(what); });
  }

 private:
  template <typename Issue>
  std::shared_ptr<Work> run(Op op, std::string arg_text, const std::vector<torch::Tensor>& tensors,
                            const std::string& what, Issue issue) {
    const int64_t seq = recorder_->start(op, std::move(arg_text), tensors, what);
    std::shared_ptr<Work> work;
    try {
      work = issue();
    } catch (const c10::Error& e) {
      recorder_->finish(seq, "failed", e.what_without_backtrace());
      dump_records(e.what_without_backtrace(), recorder_.get());
      throw;
    }
    recorder_->attach(seq, work);
    return std::make_shared<RecordedWork>(std::move(work), recorder_, seq);
  }

  std::shared_ptr<FlightRecorder> recorder_;
};

} // namespace

std::shared_ptr<GroupImpl> recorded(std::shared_ptr<GroupImpl> impl) {
  static std::once_flag dump_before_abort;
  std::call_once(dump_before_abort, [] { on_before_abort(dump_flight_records); }); // src/comm/before_abort.h
  const size_t capacity = trace_buffer_size();
  if (capacity == 0) {
    return impl;
  }
  return std::make_shared<RecordedGroup>(std::move(impl), capacity);
}

namespace {

std::vector<std::shared_ptr<FlightRecorder>> live_recorders() {
  std::vector<std::shared_ptr<FlightRecorder>> recorders;
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (const auto& weak : registry()) {
    if (auto r = weak.lock()) {
      recorders.push_back(std::move(r));
    }
  }
  return recorders;
}

nlohmann::json record_of(const std::vector<std::shared_ptr<FlightRecorder>>& recorders, int rank,
                         const std::string& reason) {
  nlohmann::json record = {{"rank", rank}, {"pid", static_cast<int64_t>(::getpid())}, {"reason", reason},
                           {"dumped_unix_ms", unix_ms(std::chrono::system_clock::now())}, {"groups", nlohmann::json::array()}};
  for (size_t i = 0; i < recorders.size(); ++i) {
    record["groups"].push_back(recorders[i]->to_json(i));
  }
  return record;
}

// Writes the record to $LOCKSTEP_TRACE_DIR, where set, through a partial file
// renamed once whole; returns where the whole record is, for the summary.
std::string write_record(const nlohmann::json& record, int rank) {
  const char* dir = std::getenv("LOCKSTEP_TRACE_DIR");
  if (dir == nullptr || *dir == '\0') {
    return "set LOCKSTEP_TRACE_DIR (lockstep-run --log-dir does) for the whole record";
  }
  const std::string path = std::string(dir) + "/lockstep_trace_rank" + std::to_string(rank) + ".json";
  const std::string partial = path + ".partial";
  std::ofstream out(partial);
  out << record.dump(1) << "\n";
  out.close();
  if (out && std::rename(partial.c_str(), path.c_str()) == 0) {
    return "whole record: " + path;
  }
  const std::string why = std::strerror(errno);
  std::remove(partial.c_str());
  return "could not write the whole record to " + path + " (" + why + "; LOCKSTEP_TRACE_DIR must be a folder this "
         "process can write)";
}

// One collective of the record as a line of the summary.
std::string summary_line(const nlohmann::json& c) {
  std::string text = "  #" + std::to_string(c["seq"].get<int64_t>()) + " " + c["op"].get<std::string>();
  if (!c["arg"].get<std::string>().empty()) {
    text += " (" + c["arg"].get<std::string>() + ")";
  }
  if (c["op"] != "barrier") {
    text += " of " + std::to_string(c["numel"].get<int64_t>()) + " " + c["dtype"].get<std::string>();
  }
  if (c["what"] != c["op"]) {
    text += ", " + c["what"].get<std::string>();
  }
  char state[64];
  if (c.contains("waited_ms")) {
    std::snprintf(state, sizeof(state), "%s, waited %.1f s", c["state"].get<std::string>().c_str(),
                  c["waited_ms"].get<double>() / 1000.0);
  } else {
    std::snprintf(state, sizeof(state), "%s after %.1f ms", c["state"].get<std::string>().c_str(),
                  c["duration_ms"].get<double>());
  }
  return text + ": " + state + "\n";
}

// The group a summary shows: the one whose collective failed, where known
// (`failed`, an index into the record's groups, or -1); else, for a dump
// before an abort, the first whose last collective did not complete.
size_t summarised_group(const nlohmann::json& groups, int64_t failed) {
  if (failed >= 0) {
    return static_cast<size_t>(failed);
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& collectives = groups[i]["collectives"];
    if (!collectives.empty() && collectives.back()["state"] != "completed") {
      return i;
    }
  }
  return 0;
}

// The summary for stderr: the last few collectives of the group that failed.
// Where the process has several groups it names that one, and its rank in it.
std::string summary_of(const nlohmann::json& record, int64_t failed, const std::string& where) {
  const auto& groups = record["groups"];
  const size_t shown_group = summarised_group(groups, failed);
  const auto& group = groups[shown_group];
  const auto& collectives = group["collectives"];
  std::string in_group;
  if (groups.size() > 1) {
    in_group = " in group " + std::to_string(shown_group) + " (its rank " + std::to_string(group["rank"].get<int>()) +
        " of " + std::to_string(group["size"].get<int>()) + ")";
  }
  std::string text = "lockstep: rank " + std::to_string(record["rank"].get<int>()) + ": flight recorder, the last "
      "collectives of this rank" + in_group + " (" + where + "):\n";
  const size_t shown = std::min<size_t>(collectives.size(), 5);
  for (size_t k = collectives.size() - shown; k < collectives.size(); ++k) {
    text += summary_line(collectives[k]);
  }
  return text;
}

// Note [Every failure dumps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A failure may be survived: a disagreement refused before anything was
// sent leaves the ranks paired, and a program may catch it and go on. So a
// failure after a collective has completed since the last dump writes the
// record anew, over the last, and the file (and lockstep-run's desync
// report from it) tells of the newest. The failures that follow one without
// a collective completing between them (a broken group's queued
// collectives, cleanup in catch blocks) are its consequences: the record
// keeps the first's reason, and stderr gets one summary.
void dump_records(const std::string& reason, const FlightRecorder* failed) {
  // One dump at a time; one that waits long for another's (the dump before an
  // abort, beside a thread stuck in its write) gives up. Never destroyed, as above.
  static auto* dumping = new std::timed_mutex();
  std::unique_lock<std::timed_mutex> lock(*dumping, std::defer_lock);
  if (!lock.try_lock_for(std::chrono::seconds(2)) || !g_dump_due.exchange(false)) {
    return;
  }
  const auto recorders = live_recorders();
  if (recorders.empty()) {
    return;
  }
  const int given = g_process_rank.load();
  const int rank = given >= 0 ? given : recorders.front()->rank();
  const auto record = record_of(recorders, rank, reason);
  const auto at = std::find_if(recorders.begin(), recorders.end(), [&](const auto& r) { return r.get() == failed; });
  const int64_t failed_index = at == recorders.end() ? -1 : at - recorders.begin();
  const std::string where = write_record(record, rank);
  std::fputs(summary_of(record, failed_index, where).c_str(), stderr);
  std::fflush(stderr);
}

} // namespace

void dump_flight_records(const std::string& reason) {
  dump_records(reason, nullptr);
}

void set_process_rank(int rank) {
  g_process_rank.store(rank);
}

} // namespace detail
} // namespace lockstep
