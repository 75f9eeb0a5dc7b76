#include "engine/storage.h"

#include "engine/allocator.h"
#include "kernels/core/error.h"

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

void Storage::release() {
  LOOM_CHECK(owned_, "Storage::release: only memory Loom allocated can be released; this storage wraps memory "
             "it does not own");
  if (released_) return;
  memory::release(device_, data_);
  data_ = nullptr;
  released_ = true;
}

void Storage::acquire(StreamHandle stream) {
  if (!released_) return;
  data_ = memory::allocate(device_, nbytes_, stream);
  released_ = false;
  bump_version();
}

void* Storage::data_after_acquire_hook() const {
  LOOM_CHECK(acquire_hook_, "the data of a released storage (", nbytes_,
             " bytes) was asked for: a sharded parameter's full values are read outside the step that gathers "
             "them (read the sharded scheme's full state dict instead)");
  acquire_hook_();
  LOOM_CHECK(!released_, "a storage's acquire hook returned without acquiring it (call acquire() in the hook)");
  return data_;
}

Storage::~Storage() {
  if (released_) return;
  if (owned_)
    memory::release(device_, data_);
  else if (deleter_)
    deleter_(data_);
}

}  // namespace loom
