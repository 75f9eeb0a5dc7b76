// Storage: one allocation of bytes on one device, shared by every tensor that views it.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "engine/device.h"

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

 private:
  Device device_;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  std::function<void(void*)> deleter_;
  bool owned_ = true;
};

}  // namespace loom
