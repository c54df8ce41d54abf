#include "fsdp/storage_watch.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace lockstep {
namespace detail {

// Note [Watching storages]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// FullShard must gather a unit just before the first operator that reads
// its parameters, and may free it once another unit runs, but LibTorch's
// modules have no forward hooks, and autograd's nodes say nothing about the
// tensors they saved. Every operator, in forward and in backward, passes
// through the dispatcher, though, and each unit's parameters (and every view
// autograd saves of them) share one storage: the unit's gathered buffer,
// whose memory is released while the unit is sharded. So a boxed fallback
// on a dispatch key that watched threads include looks for those storages
// among each operator's arguments, lets the unit's owner gather it (and
// start the next unit's gather), and then calls the operator on. The
// operators under it, and those the owner calls, run with the key excluded
// again: only the outermost call of each operator is looked at.
//
// PyTorch reserves no dispatch key for a library's own mode. DeferredInit
// is the key reserved for torchdistx's deferred module initialisation, a
// Python-only project that LibTorch never registers; it sits above autograd
// and autocast, which is where the fallback must see the operators users
// call. Were another library to register a fallback on it too, loading both
// would fail at once with the dispatcher's "multiple backend fallbacks"
// error, never silently.
//
// The key is part of the thread-local state that autograd's engine captures
// when backward() is called and restores around every node, so a pass
// begun before forward covers that backward too, on the engine's threads
// included. A backward called on a thread that is not watching is the
// owner's to detect (it gathers everything first).
constexpr c10::DispatchKey kWatchKey = c10::DispatchKey::DeferredInit;

namespace {

struct Entry {
  std::weak_ptr<StorageWatcher> watcher;
  size_t id;
};

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<const c10::StorageImpl*, Entry>& registry() {
  static std::unordered_map<const c10::StorageImpl*, Entry> entries;
  return entries;
}

std::atomic<size_t> watched{0};
std::atomic<int> passes{0};

using Hits = std::vector<std::pair<std::shared_ptr<StorageWatcher>, std::vector<size_t>>>;

void note(const at::Tensor& t, Hits& hits) {
  if (!t.defined() || !t.has_storage()) {
    return;
  }
  auto it = registry().find(t.storage().unsafeGetStorageImpl());
  if (it == registry().end()) {
    return;
  }
  auto watcher = it->second.watcher.lock();
  if (!watcher) {
    return;
  }
  auto hit = std::find_if(hits.begin(), hits.end(), [&](const auto& h) { return h.first == watcher; });
  if (hit == hits.end()) {
    hits.emplace_back(watcher, std::vector<size_t>());
    hit = hits.end() - 1;
  }
  if (std::find(hit->second.begin(), hit->second.end(), it->second.id) == hit->second.end()) {
    hit->second.push_back(it->second.id);
  }
}

void note(const c10::IValue& value, Hits& hits) {
  if (value.isTensor()) {
    note(value.toTensor(), hits);
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorVector()) {
      note(t, hits);
    }
  } else if (value.isList()) { // Tensor?[]
    for (const c10::IValue& element : value.toList()) {
      if (element.isTensor()) {
        note(element.toTensor(), hits);
      }
    }
  }
}

void watch_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (passes.load() == 0) {
    // The last pass ended where this thread's state was about to be
    // restored (autograd's engine runs the end of backward under the state
    // it captured): the thread stops watching at its next operator.
    c10::impl::tls_set_dispatch_key_included(kWatchKey, false);
  }
  Unwatched unwatched;
  if (watched.load(std::memory_order_relaxed) != 0) {
    Hits hits;
    {
      std::lock_guard<std::mutex> lock(registry_mutex());
      for (const auto& value : torch::jit::last(*stack, op.schema().arguments().size())) {
        note(value, hits);
      }
    }
    for (auto& [watcher, ids] : hits) {
      watcher->on_touch(ids);
    }
  }
  op.callBoxed(stack);
}

} // namespace

TORCH_LIBRARY_IMPL(_, DeferredInit, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&watch_fallback>());
}

void watch_storage(const c10::StorageImpl* storage, std::weak_ptr<StorageWatcher> watcher, size_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[storage] = Entry{std::move(watcher), id};
  watched.store(registry().size());
}

void unwatch_storages(const StorageWatcher* watcher) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& entries = registry();
  for (auto it = entries.begin(); it != entries.end();) {
    auto owner = it->second.watcher.lock();
    it = (!owner || owner.get() == watcher) ? entries.erase(it) : std::next(it);
  }
  watched.store(entries.size());
}

void begin_pass() {
  ++passes;
  c10::impl::tls_set_dispatch_key_included(kWatchKey, true);
}

// The key stays on the threads that began passes until none is left, so a
// thread is never unwatched under another model's pass; a thread left
// watching costs each operator a look-up, never a wrong value, and drops
// the key at its first operator once no pass is left (watch_fallback).
void end_pass() {
  if (--passes == 0) {
    c10::impl::tls_set_dispatch_key_included(kWatchKey, false);
  }
}

bool watching() {
  return c10::impl::tls_is_dispatch_key_included(kWatchKey);
}

Unwatched::Unwatched() : guard_(kWatchKey) {}

} // namespace detail
} // namespace lockstep
