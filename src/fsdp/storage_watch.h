#pragma once

// Internal: a call before any operator reads given storages, on the threads
// that are in a watched pass (Note [Watching storages] in
// src/fsdp/storage_watch.cpp).

#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace lockstep {
namespace detail {

class StorageWatcher {
 public:
  virtual ~StorageWatcher() = default;
  /// Called before an operator whose arguments use the storages watched
  /// under `ids` (each once), on the operator's thread. Operators it calls
  /// itself are not watched.
  virtual void on_touch(const std::vector<size_t>& ids) = 0;
};

/// Operators on `storage` call watcher->on_touch({id, ...}) from now on.
void watch_storage(const c10::StorageImpl* storage, std::weak_ptr<StorageWatcher> watcher, size_t id);
/// Every storage `watcher` watches, forgotten.
void unwatch_storages(const StorageWatcher* watcher);

/// Operators on this thread are watched from begin_pass() until every pass
/// begun anywhere has ended (end_pass()). Autograd's engine runs backward
/// under the thread state of the call to backward(), so a pass begun before
/// forward covers the backward called on the same thread.
void begin_pass();
void end_pass();
/// Whether operators on this thread are watched now.
bool watching();

/// Operators in its scope are not watched on this thread: a watcher's own
/// work on the storages it watches.
class Unwatched {
 public:
  Unwatched();

 private:
  c10::impl::ExcludeDispatchKeyGuard guard_;
};

} // namespace detail
} // namespace lockstep
