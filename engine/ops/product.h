// The 2-d matrix product the ops build on: how gemm reads a tensor's last two dims, and
// one product with its GemmArgs extras (bias, epilogue, sums). Internal to engine/ops.
#pragma once

#include <functional>

#include "engine/ops/dispatch.h"

namespace loom::ops {

// How gemm can read the last two dims of t (rows, cols): directly (row stride ld),
// transposed (column-major storage), or, when neither, a packed copy.
struct Operand {
  Tensor t;
  bool trans = false;
  int64_t ld = 0;
};
Operand as_operand(const Tensor& t);

// c (m, n) = a (m, k) @ b (k, n), a new tensor; a and b are 2-d of one dtype and device and
// may be transposed views; c is f32 when c_f32 (16-bit a and b), else their dtype. `extras`
// fills bias, epilogue, sums and c_in before the call. No autograd: callers record their own.
Tensor product_2d(const Tensor& a, const Tensor& b, const std::function<void(GemmArgs&)>& extras = {},
                  bool c_f32 = false);

}  // namespace loom::ops
