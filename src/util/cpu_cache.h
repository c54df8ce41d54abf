#pragma once

// Internal: the memory cache of DataParallel's CPU replicas and of a sharded
// model's CPU passes. See Note [CPU replicas' memory] in src/util/cpu_cache.cpp.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

namespace lockstep {
namespace detail {

/// The cache's bookkeeping, with no lock and no memory of its own: the idle
/// blocks it holds by size class, and the bytes live and idle. Idle bytes stay
/// within twice the most bytes ever live at once; past that, the largest idle
/// blocks of other classes go first.
class BlockCache {
 public:
  /// Smaller requests are not cached: malloc serves them from its own bins,
  /// without the kernel.
  static constexpr size_t kMinBytes = size_t{64} << 10;
  /// Cached blocks are a whole number of these, so that requests a little
  /// apart share a class.
  static constexpr size_t kGranule = size_t{4} << 10;

  /// The class of a request of n bytes (its size rounded up to kGranule), or
  /// 0 for a request that is not cached.
  static size_t size_class(size_t n);

  /// An idle block of class `cls`, now counted live; nullptr if none.
  void* take(size_t cls);
  /// Counts a block of class `cls`, fresh from the system, as live.
  void add_fresh(size_t cls);
  /// Counts a live block of class `cls` as gone back to the system.
  void release(size_t cls);
  /// Takes back a live block of class `cls`. Returns the blocks to give back
  /// to the system: those evicted to keep within the limit, `block` among
  /// them if it does not fit.
  std::vector<void*> give(void* block, size_t cls);
  /// Empties the cache: returns every idle block.
  std::vector<void*> drain();

  size_t idle_bytes() const {
    return idle_bytes_;
  }
  size_t live_bytes() const {
    return live_bytes_;
  }
  size_t peak_live_bytes() const {
    return peak_live_bytes_;
  }

 private:
  void count_live(size_t cls);

  std::map<size_t, std::vector<void*>> idle_;
  size_t idle_bytes_ = 0;
  size_t live_bytes_ = 0;
  size_t peak_live_bytes_ = 0;
};

/// What the cache has done since the process started.
struct CpuCacheStats {
  int64_t fresh = 0; // cacheable blocks taken from the system
  int64_t reused = 0; // requests served from the cache
  size_t idle_bytes = 0;
  size_t live_bytes = 0;
};
CpuCacheStats cpu_cache_stats();

/// Keeps the cache open while it lives: the first one makes the cache
/// LibTorch's CPU allocator (once per process, and only over the default
/// allocator), the last one gives every idle block back to the system.
class CpuCacheUser {
 public:
  CpuCacheUser();
  ~CpuCacheUser();
  CpuCacheUser(const CpuCacheUser&) = delete;
  CpuCacheUser& operator=(const CpuCacheUser&) = delete;
};

/// Turns caching of the calling thread's CPU allocations on or off (as
/// CpuCacheScope does); returns whether it was on.
bool set_thread_cache(bool on);

/// While it lives, the calling thread's CPU allocations of kMinBytes or more
/// come from the cache, when the cache is open (`on` false: a no-op).
class CpuCacheScope {
 public:
  explicit CpuCacheScope(bool on);
  ~CpuCacheScope();
  CpuCacheScope(const CpuCacheScope&) = delete;
  CpuCacheScope& operator=(const CpuCacheScope&) = delete;

 private:
  bool previous_;
};

} // namespace detail
} // namespace lockstep
