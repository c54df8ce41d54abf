#include "mapped_memory.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

namespace lockstep {
namespace detail {

namespace {

struct Mapping {
  void* address;
  size_t bytes;
};

void unmap(void* context) {
  auto* mapping = static_cast<Mapping*>(context);
  ::munmap(mapping->address, mapping->bytes);
  delete mapping;
}

// Note [Pages for transient buffers].
c10::DataPtr map_pages(size_t bytes) {
  const size_t length = bytes == 0 ? 1 : bytes;
  void* address = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(address != MAP_FAILED, "lockstep: could not map ", length, " bytes for a sharded model's buffer: ",
              std::strerror(errno), ". The machine is out of memory; use fewer or smaller units.");
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
  storage->set_data_ptr_noswap(t.device().is_cpu() ? map_pages(bytes) : storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

} // namespace detail
} // namespace lockstep
