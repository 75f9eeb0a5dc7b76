#include "engine/storage.h"

#include "engine/allocator.h"

namespace loom {

Storage::Storage(Device device, size_t nbytes, StreamHandle stream)
    : device_(device), data_(memory::allocate(device, nbytes, stream)), nbytes_(nbytes) {}

Storage::Storage(Device device, void* data, size_t nbytes, std::function<void(void*)> deleter)
    : device_(device), data_(data), nbytes_(nbytes), deleter_(std::move(deleter)), owned_(false) {}

Storage::~Storage() {
  if (owned_)
    memory::release(device_, data_);
  else if (deleter_)
    deleter_(data_);
}

}  // namespace loom
