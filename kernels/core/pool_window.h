// Window arithmetic of 2-d pooling, shared by the CPU and CUDA pooling kernels so the two
// cannot disagree on which input elements a window covers. Both directions are here: the
// input span an output reads (forward), and the outputs whose windows cover an input
// element (backward, computed as a gather so no two threads write one element and the
// sums are deterministic without atomics). One axis at a time; rows and columns alike.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace loom::pool {

// I: the index type, int64_t on the CPU; the CUDA kernels use int32_t where every index of
// a call fits, since 64-bit division costs the GPU several times 32-bit's.
template <class I> struct SpanOf {
  I begin, end;  // [begin, end)
};
using Span = SpanOf<int64_t>;

// Input positions read by output position o, clipped to [0, size): the padding outside
// contributes nothing (max) or zeros (average).
template <class I> LOOM_HOST_DEVICE SpanOf<I> input_span(I o, I stride, I pad, I kernel, I size) {
  const I start = o * stride - pad;
  return {start < 0 ? I(0) : start, start + kernel < size ? start + kernel : size};
}

// Division by a fixed positive number, as the output spans need it: plainly here; the CUDA
// kernels pass a divisor that multiplies and shifts instead (kernels/cuda/pool.cu), with
// the same quotients.
template <class I> struct PlainDivisor {
  I d;
  LOOM_HOST_DEVICE I value() const { return d; }
  LOOM_HOST_DEVICE I div(I n) const { return n / d; }
};

// Output positions whose windows contain input position i, clipped to [0, out_size):
// o * stride - pad <= i < o * stride - pad + kernel. Every division has a dividend >= 0.
template <class I, class Divisor>
LOOM_HOST_DEVICE SpanOf<I> output_span_by(I i, Divisor stride, I pad, I kernel, I out_size) {
  const I lo = i + pad - kernel + 1;  // smallest o * stride allowed
  const I begin = lo <= 0 ? I(0) : stride.div(lo + stride.value() - 1);
  const I last = stride.div(i + pad);  // i + pad >= 0 always
  return {begin, last + 1 < out_size ? last + 1 : out_size};
}

template <class I> LOOM_HOST_DEVICE SpanOf<I> output_span(I i, I stride, I pad, I kernel, I out_size) {
  return output_span_by(i, PlainDivisor<I>{stride}, pad, kernel, out_size);
}

}  // namespace loom::pool
