// The checks a layer-norm backward's optional outputs must pass on every device
// (LayerNormArgs in kernels/table.h): the CPU and CUDA kernels both call them first.
#pragma once

#include "error.h"
#include "../table.h"

namespace loom {

inline void check_layer_norm_backward(const LayerNormArgs& a, const void* dx) {
  const bool sixteen = a.out_dtype == DType::bf16 || a.out_dtype == DType::f16;
  LOOM_ASSERT(!a.dx_rounded || (dx && a.dtype == DType::f32 && sixteen), "layer_norm backward: dx_rounded needs dx, ",
              "f32 x and a 16-bit out_dtype, got ", dtype_name(a.dtype), " x and ", dtype_name(a.out_dtype), " out");
  LOOM_ASSERT(!a.dx_sums || dx, "layer_norm backward: dx_sums are dx's column sums and need dx");
}

}  // namespace loom
