#include "engine/storage.h"

#include "engine/allocator.h"

namespace loom {
namespace {
uint64_t next_version() {
  static std::atomic<uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}
}  // namespace

Storage::Storage(Device device, size_t nbytes, StreamHandle stream)
    : device_(device), data_(memory::allocate(device, nbytes, stream)), nbytes_(nbytes), version_(next_version()) {}

Storage::Storage(Device device, void* data, size_t nbytes, std::function<void(void*)> deleter)
    : device_(device),
      data_(data),
      nbytes_(nbytes),
      deleter_(std::move(deleter)),
      owned_(false),
      version_(next_version()) {}

void Storage::bump_version() { version_.store(next_version(), std::memory_order_relaxed); }

Storage::~Storage() {
  if (owned_)
    memory::release(device_, data_);
  else if (deleter_)
    deleter_(data_);
}

}  // namespace loom
