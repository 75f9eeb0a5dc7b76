// The 2-d matrix product the ops build on: how gemm reads a tensor's last two dims, and
// one product with its GemmArgs extras (bias, epilogue, sums). Internal to engine/ops.
#pragma once

#include <functional>
#include <initializer_list>

#include "dispatch.h"

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
// The same product written into c (m, n), whose rows may be apart (rows of a wider tensor;
// unit column stride): of the operands' dtype, or f32 for bf16/f16 ones.
// With extras' beta != 0 the product adds to what c holds.
void product_2d_into(const Tensor& c, const Tensor& a, const Tensor& b,
                     const std::function<void(GemmArgs&)>& extras = {});

// f32 parameters under 16-bit products (autocast's master weights): the products read
// 16-bit copies made without a node (the kept weight copies of engine/autocast.h), and
// the parameters' gradients come out of their products in f32 (GemmArgs::c_f32), bias
// sums too, with no 16-bit rounding and no cast pass. Else the casts are the
// differentiable to() and gradients come back through them.
bool f32_params(DType t, std::initializer_list<Tensor> params);

// The tensor an op computes with, and the one its node takes as input: p cast to `dtype`
// with a node (then both are the cast), or, for f32_params, the cast without one and p itself.
struct Param {
  Tensor used, input;
};
Param param(const Tensor& p, DType dtype, bool f32);

}  // namespace loom::ops
