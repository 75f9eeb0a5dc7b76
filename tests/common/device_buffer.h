// A GPU buffer for kernel-level tests: cudaMalloc'd, filled from and read back to host
// vectors. Only for tests/; the engine allocates through its caching allocator.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "kernels/cuda/check.h"

namespace loom::test {

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { LOOM_CUDA(cudaMalloc(&ptr_, n ? n * sizeof(T) : 1)); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    LOOM_CUDA(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return static_cast<T*>(ptr_); }
  size_t size() const { return n_; }
  std::vector<T> to_host() const {
    std::vector<T> host(n_);
    LOOM_CUDA(cudaDeviceSynchronize());
    LOOM_CUDA(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t n_;
};

}  // namespace loom::test
