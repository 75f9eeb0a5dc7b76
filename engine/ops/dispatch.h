// What every op file needs: the kernel table of a tensor's device, the Strided view a
// kernel takes, the stream to launch on, and the common argument checks. Internal to
// engine/ops.
#pragma once

#include <string>

#include "../autograd.h"
#include "../ops.h"
#include "../../kernels/table.h"

namespace loom::ops {

inline const KernelTable& kernels(Device device) {
  return device.is_cpu() ? cpu_kernel_table() : cuda_kernel_table();
}

// The compute stream of the tensor's device (null on the CPU).
inline StreamHandle stream(const Tensor& t) { return compute_stream(t.device()); }

// A kernel's pointer to t's data, or null for an undefined (optional) tensor.
inline void* ptr_or_null(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

inline Strided strided(const Tensor& t) {
  Strided s;
  LOOM_CHECK(t.dim() <= kMaxDims, "tensors have at most ", kMaxDims, " dimensions, got shape ", shape_str(t.shape()));
  s.data = t.data_ptr();
  s.dtype = t.dtype();
  s.ndim = t.dim();
  for (int i = 0; i < s.ndim; ++i) {
    s.shape[i] = t.shape()[i];
    s.strides[i] = t.strides()[i];
  }
  return s;
}

// t's elements as one row, in memory order: a 1-d view over what a tensor dense in any
// MemoryFormat holds, for elementwise kernels whose operands share one layout (they then
// take their contiguous, vectorised path whatever the layout).
inline Strided flat(const Tensor& t) {
  LOOM_ASSERT(t.is_contiguous(t.memory_format()), "flat: ", shape_str(t.shape()), " is not dense");
  Strided s;
  s.data = t.data_ptr();
  s.dtype = t.dtype();
  s.ndim = 1;
  s.shape[0] = t.numel();
  s.strides[0] = 1;
  return s;
}

// Whether x is a channels-last tensor (MemoryFormat).
inline bool channels_last(const Tensor& x) { return x.defined() && x.memory_format() == MemoryFormat::channels_last; }

// The CNN kernels' ChannelLayout (kernels/table.h) of a MemoryFormat, and back.
inline ChannelLayout channel_layout(MemoryFormat format) {
  return format == MemoryFormat::channels_last ? ChannelLayout::channels_last : ChannelLayout::channels_first;
}
inline MemoryFormat memory_format(ChannelLayout layout) {
  return layout == ChannelLayout::channels_last ? MemoryFormat::channels_last : MemoryFormat::contiguous;
}

// A Strided view of `t` broadcast to `shape` (stride 0 on broadcast dimensions).
Strided broadcast_strided(const Tensor& t, const Shape& shape);

void check_same_device(const Tensor& a, const Tensor& b, const char* op);
void check_floating(const Tensor& t, const char* op);
void check_defined(const Tensor& t, const char* op, const char* arg);
DType promote(DType a, DType b);

// Normalises dims (negative, duplicates) for a reduction over `ndim` dims; empty = all.
std::vector<int> reduction_dims(const std::vector<int>& dims, int ndim, const char* op);

// Sizes of the canonical (outer, R, inner) view of a contiguous tensor around `dim`.
struct OuterRInner {
  int64_t outer = 1, R = 1, inner = 1;
};
OuterRInner around_dim(const Shape& shape, int dim);

}  // namespace loom::ops
