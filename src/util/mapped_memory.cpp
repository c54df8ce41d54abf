#include "util/mapped_memory.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

namespace lockstep {
namespace detail {

namespace {

// Note [Pages for transient buffers]: up to kPooledBytes of freed mappings
// are kept, by length, for the next buffer of that length. A step allocates
// the sizes the step before did, and faulting in fresh pages for every
// gathered unit, gradient buffer and bucket cost about a fifth of a step;
// the cap keeps what the pool holds below two of the large units whose
// memory sharding is there to save.
constexpr size_t kPooledBytes = 32 << 20;

struct Mapping {
  void* address;
  size_t bytes;
};

struct Pool {
  std::mutex mutex;
  std::multimap<size_t, void*> free; // by length
  size_t bytes = 0;
};

Pool& pool() {
  static auto* pool = new Pool(); // never destroyed: buffers may die during static destruction
  return *pool;
}

void unmap(void* context) {
  std::unique_ptr<Mapping> mapping(static_cast<Mapping*>(context));
  {
    auto& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    if (p.bytes + mapping->bytes <= kPooledBytes) {
      p.free.emplace(mapping->bytes, mapping->address);
      p.bytes += mapping->bytes;
      return;
    }
  }
  ::munmap(mapping->address, mapping->bytes);
}

void* pooled(size_t length) {
  auto& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  auto it = p.free.find(length);
  if (it == p.free.end()) {
    return nullptr;
  }
  void* address = it->second;
  p.free.erase(it);
  p.bytes -= length;
  return address;
}

c10::DataPtr map_pages(size_t bytes) {
  const size_t length = bytes == 0 ? 1 : bytes;
  void* address = pooled(length);
  if (address == nullptr) {
    address = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(address != MAP_FAILED, "lockstep: could not map ", length, " bytes for a sharded model's buffer: ",
                std::strerror(errno), ". The machine is out of memory; use fewer or smaller units.");
  }
  return c10::DataPtr(address, new Mapping{address, length}, &unmap, c10::Device(c10::kCPU));
}

} // namespace

torch::Tensor empty_mapped(int64_t numel, const torch::TensorOptions& options) {
  if (options.device().type() != c10::kCPU) {
    return torch::empty({numel}, options);
  }
  auto t = torch::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  allocate_mapped(t);
  return t;
}

void allocate_mapped(const torch::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (storage->nbytes() == bytes && storage->data_ptr().get() != nullptr) {
    return;
  }
  if (t.device().is_cpu()) {
    storage->set_data_ptr_noswap(map_pages(bytes));
  } else {
    // A device allocator (CUDA's caching one) allocates on the thread's
    // current device, which need not be the tensor's (cuda:1's rank on a
    // thread whose current device is 0).
    c10::OptionalDeviceGuard on(t.device());
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  }
  storage->set_nbytes(bytes);
}

} // namespace detail
} // namespace lockstep
