// Storage: one allocation of bytes on one device, shared by every tensor that views it.
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

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  // Changes whenever Loom's in-place ops write these bytes (copy_, fill_, optimizer
  // updates, collectives; Tensor::bump_version() for writes made any other way). Values
  // come from one process-wide counter, so no two storages, and no two states of one, ever
  // share a version: a copy derived from the data, stamped with the version it saw, is
  // valid exactly while the version is unchanged (autocast's weight casts rely on this).
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version();

 private:
  Device device_;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  std::function<void(void*)> deleter_;
  bool owned_ = true;
  std::atomic<uint64_t> version_;
};

}  // namespace loom
