// Storage: one allocation of bytes on one device, shared by every tensor that views it.
//
// An owned storage can give its memory back and take new memory of the same size later,
// staying the same object (release / acquire). Every tensor that views it, and every copy
// an op saved for backward through detach(), sees whatever the storage holds after the
// acquire: that is how a sharded-parameter scheme (parallel/fsdp.h) frees a parameter's
// full values between uses without breaking a single reference. Asking a released storage
// for its data runs its acquire hook when it has one (the hook must acquire() and fill it),
// and is an error otherwise.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "device.h"

namespace loom {

class Storage {
 public:
  // Allocates nbytes on device (CUDA through the caching allocator, for `stream`).
  Storage(Device device, size_t nbytes, StreamHandle stream = nullptr);
  // Wraps memory Loom does not own; `deleter` (may be empty) runs when the last tensor goes.
  Storage(Device device, void* data, size_t nbytes, std::function<void(void*)> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const {
    if (released_) [[unlikely]]
      return data_after_acquire_hook();
    return data_;
  }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  // Changes whenever Loom's in-place ops write these bytes (copy_, fill_, optimizer
  // updates, collectives; Tensor::bump_version() for writes made any other way). Values
  // come from one process-wide counter, so no two storages, and no two states of one, ever
  // share a version: a copy derived from the data, stamped with the version it saw, is
  // valid exactly while the version is unchanged (autocast's weight casts rely on this).
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version();

  // ---- release and re-acquire in place (see the header comment) ----------------------
  // Returns the memory to the allocator; nbytes() is kept. Only storages Loom allocated
  // can be released. Releasing a released storage does nothing.
  void release();
  // Allocates nbytes() again (on `stream`, as the constructor) for a released storage; the
  // contents are undefined until written. Bumps the version. Acquiring a held storage does
  // nothing.
  void acquire(StreamHandle stream = nullptr);
  bool is_released() const { return released_; }
  // Runs when data() is asked of this storage while it is released; it must acquire() it
  // (and fill it). An empty function removes the hook.
  void set_acquire_hook(std::function<void()> hook) { acquire_hook_ = std::move(hook); }

 private:
  void* data_after_acquire_hook() const;

  Device device_;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  std::function<void(void*)> deleter_;
  bool owned_ = true;
  bool released_ = false;
  std::function<void()> acquire_hook_;
  std::atomic<uint64_t> version_;
};

}  // namespace loom
