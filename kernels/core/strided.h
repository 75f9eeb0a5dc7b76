// What a kernel sees of a tensor: a raw pointer, a dtype, and a shape with strides in
// elements. kernels/ knows nothing of Tensor, autograd or devices; the engine hands
// kernels these plain descriptors, which keeps every kernel testable on its own.
#pragma once

#include <cstdint>

#include "kernels/core/dtype.h"

namespace loom {

constexpr int kMaxDims = 8;

// A stream handle as the kernels receive it: a cudaStream_t for CUDA kernels,
// ignored (nullptr) by CPU kernels. Every launcher takes it last.
using StreamHandle = void*;

struct Strided {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements; 0 for a broadcast dimension

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const {
    int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }
};

}  // namespace loom
