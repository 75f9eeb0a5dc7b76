// Window arithmetic of 2-d pooling, shared by the CPU and CUDA pooling kernels so the two
// cannot disagree on which input elements a window covers. Both directions are here: the
// input span an output reads (forward), and the outputs whose windows cover an input
// element (backward, computed as a gather so no two threads write one element and the
// sums are deterministic without atomics). One axis at a time; rows and columns alike.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LOOM_HOST_DEVICE inline
#endif

namespace loom::pool {

struct Span {
  int64_t begin, end;  // [begin, end)
};

// Input positions read by output position o, clipped to [0, size): the padding outside
// contributes nothing (max) or zeros (average).
LOOM_HOST_DEVICE Span input_span(int64_t o, int64_t stride, int64_t pad, int64_t kernel, int64_t size) {
  const int64_t start = o * stride - pad;
  return {start < 0 ? 0 : start, start + kernel < size ? start + kernel : size};
}

// Output positions whose windows contain input position i, clipped to [0, out_size):
// o * stride - pad <= i < o * stride - pad + kernel.
LOOM_HOST_DEVICE Span output_span(int64_t i, int64_t stride, int64_t pad, int64_t kernel, int64_t out_size) {
  const int64_t lo = i + pad - kernel + 1;  // smallest o * stride allowed
  const int64_t begin = lo <= 0 ? 0 : (lo + stride - 1) / stride;
  const int64_t last = (i + pad) / stride;  // i + pad >= 0 always
  return {begin, last + 1 < out_size ? last + 1 : out_size};
}

}  // namespace loom::pool
