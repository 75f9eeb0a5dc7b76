// What a kernel sees of a tensor: a raw pointer, a dtype, and a shape with strides in
// elements. kernels/ knows nothing of Tensor, autograd or devices; the engine hands
// kernels these plain descriptors, which keeps every kernel testable on its own.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "dtype.h"
#include "error.h"

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

// K operands of one shape (the output first), coalesced: size-1 dimensions dropped and
// neighbours merged where every operand is contiguous across them. The CPU and CUDA
// elementwise kernels both walk this form, so it is built in one place, on the host.
template <int K>
struct Walk {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[K][kMaxDims] = {};
};

template <int K>
Walk<K> coalesce(const std::array<const Strided*, K>& ops) {
  const Strided& ref = *ops[0];
  for (const Strided* s : ops) {
    LOOM_ASSERT(s->ndim == ref.ndim && std::equal(ref.shape, ref.shape + ref.ndim, s->shape),
                "elementwise operands must have the output's shape");
  }
  Walk<K> w;
  for (int d = 0; d < ref.ndim; ++d) {
    if (ref.shape[d] == 1) continue;
    bool merge = w.ndim > 0;
    for (int k = 0; k < K && merge; ++k) merge = w.strides[k][w.ndim - 1] == ops[k]->strides[d] * ref.shape[d];
    if (!merge) w.shape[w.ndim++] = 1;
    w.shape[w.ndim - 1] *= ref.shape[d];
    for (int k = 0; k < K; ++k) w.strides[k][w.ndim - 1] = ops[k]->strides[d];
  }
  if (w.ndim == 0) w.shape[w.ndim++] = 1;  // a scalar: one row of one element
  return w;
}

}  // namespace loom
