#include "util/cpu_cache.h"

#include "util/torch_compat.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <new>

// AddressSanitizer's manual poisoning (poison() below). The runtime defines these;
// without it they are null.
extern "C" void __asan_poison_memory_region(void const volatile* addr, size_t size) __attribute__((weak));
extern "C" void __asan_unpoison_memory_region(void const volatile* addr, size_t size) __attribute__((weak));

namespace lockstep {
namespace detail {

// Note [CPU replicas' memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every step, each CPU replica allocates the same activations and gradients,
// megabytes of them, and frees them again. glibc serves a worker thread from
// an arena of its own and gives the arena's free top back to the kernel
// (madvise) once it passes the trim threshold, a few megabytes; the next step
// then takes a page fault for every 4 KiB it touches. The caller's thread,
// on glibc's main heap, loses far fewer: on the MLP, DataParallel took about
// 3,700 page faults a step against the single-thread ceiling's 500, and ran
// at 0.65 of the ceiling instead of 0.90 with glibc told to keep its memory
// (docs/performance.md). A library cannot set glibc's thresholds: they are
// the whole process's (mallopt) or read at start-up (MALLOC_TRIM_THRESHOLD_).
//
// So, as LibTorch does on a GPU, the replicas keep their memory. From the
// first DataParallel with CPU replicas on, LibTorch's CPU allocator is this
// one. It serves every thread as the default allocator does (c10::alloc_cpu),
// and while such a DataParallel exists, on a replica's worker (CpuCacheScope, src/dp/worker_pool.cpp) a request of
// 64 KiB or more takes an idle block of its size class first. A block
// allocated there goes back to the cache when freed, on whatever thread: a
// gradient made by a worker is freed by the caller's zero_grad(). What the
// cache holds stays within twice the replicas' largest working set
// (BlockCache), and it all goes back to the system when the last such
// DataParallel ends. Small requests, and every request of the caller's
// thread, go to glibc as before. A sharded model's CPU pass uses the cache
// the same way, on the thread that runs it (Note [A sharded step's memory]
// in src/fsdp/forward.cpp).
//
// Each block carries a header in front of it, so that the deleter knows its
// class; a pointer without one was allocated before the cache was installed,
// by the default allocator, and goes to c10::free_cpu. The cache is installed
// only over LibTorch's default allocator: an allocator the program chose
// stays, and the replicas then allocate from it.

size_t BlockCache::size_class(size_t n) {
  if (n < kMinBytes) {
    return 0;
  }
  return (n + kGranule - 1) / kGranule * kGranule;
}

void BlockCache::count_live(size_t cls) {
  live_bytes_ += cls;
  peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
}

void* BlockCache::take(size_t cls) {
  auto it = idle_.find(cls);
  if (it == idle_.end()) {
    return nullptr;
  }
  void* block = it->second.back();
  it->second.pop_back();
  if (it->second.empty()) {
    idle_.erase(it);
  }
  idle_bytes_ -= cls;
  count_live(cls);
  return block;
}

void BlockCache::add_fresh(size_t cls) {
  count_live(cls);
}

void BlockCache::release(size_t cls) {
  TORCH_INTERNAL_ASSERT(live_bytes_ >= cls);
  live_bytes_ -= cls;
}

std::vector<void*> BlockCache::give(void* block, size_t cls) {
  release(cls);
  idle_[cls].push_back(block);
  idle_bytes_ += cls;
  std::vector<void*> evicted;
  const size_t limit = 2 * peak_live_bytes_;
  while (idle_bytes_ > limit) {
    // The largest class other than this one: a block of this class is the
    // likeliest to be asked for again.
    auto victim = std::prev(idle_.end());
    if (victim->first == cls && victim != idle_.begin()) {
      --victim;
    }
    evicted.push_back(victim->second.back());
    victim->second.pop_back();
    idle_bytes_ -= victim->first;
    if (victim->second.empty()) {
      idle_.erase(victim);
    }
  }
  return evicted;
}

std::vector<void*> BlockCache::drain() {
  std::vector<void*> all;
  for (auto& entry : idle_) {
    all.insert(all.end(), entry.second.begin(), entry.second.end());
  }
  idle_.clear();
  idle_bytes_ = 0;
  return all;
}

namespace {

constexpr size_t kHeaderBytes = 64; // keeps c10's 64-byte alignment
constexpr uint64_t kMagic = 0x6c6f636b73746570; // "lockstep"

struct Header {
  uint64_t magic;
  uint64_t cls; // 0: not cached
};
static_assert(sizeof(Header) <= kHeaderBytes, "the header must fit in front of the block");

thread_local bool t_cache_on = false;


// Under AddressSanitizer an idle block is poisoned, so that a use after free
// still reports though the block is not freed.
void poison(void* base, size_t cls, bool idle) {
  auto* data = static_cast<char*>(base) + kHeaderBytes;
  if (idle && __asan_poison_memory_region != nullptr) {
    __asan_poison_memory_region(data, cls);
  } else if (!idle && __asan_unpoison_memory_region != nullptr) {
    __asan_unpoison_memory_region(data, cls);
  }
}

// The cache and its lock. Never destroyed: a block can be freed at exit, after
// static destructors.
struct CpuCache {
  std::mutex mutex;
  BlockCache blocks;
  int users = 0;
  CpuCacheStats stats;
};

CpuCache& cache() {
  static auto* instance = new CpuCache;
  return *instance;
}

// Gives a block of ours back to the system.
void to_system_memory(void* base) {
  poison(base, reinterpret_cast<const Header*>(base)->cls, /*idle=*/false);
  c10::free_cpu(base);
}

void free_block(void* data) {
  if (data == nullptr) {
    return;
  }
  c10::profiledCPUMemoryReporter().Delete(data);
  auto* base = static_cast<char*>(data) - kHeaderBytes;
  const auto* header = reinterpret_cast<const Header*>(base);
  if (header->magic != kMagic) {
    c10::free_cpu(data); // the default allocator's, from before the cache
    return;
  }
  std::vector<void*> to_system{base};
  if (header->cls != 0) {
    auto& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.users > 0) {
      poison(base, header->cls, /*idle=*/true);
      to_system = c.blocks.give(base, header->cls);
    } else {
      c.blocks.release(header->cls);
    }
  }
  for (void* block : to_system) {
    to_system_memory(block);
  }
}

// A block of n bytes, behind its header; from the cache when the calling
// thread is a replica's, the request is large enough and the cache is open.
void* allocate_base(size_t n) {
  size_t cls = t_cache_on ? BlockCache::size_class(n) : 0;
  auto& c = cache();
  if (cls != 0) {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.users == 0) {
      cls = 0;
    } else if (void* block = c.blocks.take(cls)) {
      ++c.stats.reused;
      poison(block, cls, /*idle=*/false);
      return block;
    } else {
      c.blocks.add_fresh(cls);
      ++c.stats.fresh;
    }
  }
  void* base = nullptr;
  try {
    base = c10::alloc_cpu(kHeaderBytes + (cls != 0 ? cls : n));
  } catch (...) {
    if (cls != 0) {
      std::lock_guard<std::mutex> lock(c.mutex);
      c.blocks.release(cls);
    }
    throw;
  }
  new (base) Header{kMagic, cls};
  return base;
}

class CachingCpuAllocator final : public CpuAllocatorBase {
 public:
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_block;
  }

 protected:
  c10::DataPtr allocate_block(size_t n) const override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) {
      return {nullptr, nullptr, &free_block, cpu};
    }
    void* data = static_cast<char*>(allocate_base(n)) + kHeaderBytes;
    c10::profiledCPUMemoryReporter().New(data, n);
    return {data, data, &free_block, cpu};
  }
};

// Made at static initialisation, before the program starts a thread, and
// never destroyed: once installed, every thread that allocates calls it,
// and c10's table of allocators, which publishes it, takes no lock, so it
// must not be made by whichever thread installs it (ranks as threads may
// allocate while another installs it).
CachingCpuAllocator* const g_allocator = new CachingCpuAllocator;

// Whether the cache is LibTorch's CPU allocator: installed on first use, over
// the default allocator only.
bool installed() {
  static const bool done = [] {
    if (c10::GetCPUAllocator() == c10::GetDefaultCPUAllocator()) {
      c10::SetCPUAllocator(g_allocator);
    }
    return c10::GetCPUAllocator() == g_allocator;
  }();
  return done;
}

} // namespace

CpuCacheStats cpu_cache_stats() {
  auto& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  CpuCacheStats stats = c.stats;
  stats.idle_bytes = c.blocks.idle_bytes();
  stats.live_bytes = c.blocks.live_bytes();
  return stats;
}

CpuCacheUser::CpuCacheUser() {
  if (installed()) {
    auto& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    ++c.users;
  }
}

CpuCacheUser::~CpuCacheUser() {
  if (!installed()) {
    return;
  }
  std::vector<void*> idle;
  {
    auto& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (--c.users == 0) {
      idle = c.blocks.drain();
    }
  }
  for (void* block : idle) {
    to_system_memory(block);
  }
}

bool set_thread_cache(bool on) {
  const bool previous = t_cache_on;
  t_cache_on = on;
  return previous;
}

CpuCacheScope::CpuCacheScope(bool on) : previous_(set_thread_cache(on)) {}

CpuCacheScope::~CpuCacheScope() {
  t_cache_on = previous_;
}

} // namespace detail
} // namespace lockstep
