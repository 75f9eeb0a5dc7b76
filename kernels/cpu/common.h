// Shared by the CPU kernels: the C++ element type of each DType, the accumulation type,
// dtype dispatch, and strided iteration.
#pragma once

#include <cstdint>

#include "../core/dtype.h"
#include "../core/error.h"
#include "../core/strided.h"

namespace loom::cpu {

template <class T> struct Acc { using type = T; };
template <> struct Acc<bf16> { using type = float; };
template <> struct Acc<f16> { using type = float; };
template <class T> using acc_t = typename Acc<T>::type;

template <class F>
void dispatch_all(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(bf16{});
    case DType::f16: return f(f16{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u8: return f(uint8_t{});
  }
  LOOM_ASSERT(false, "unknown dtype");
}

template <class F>
void dispatch_floating(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(bf16{});
    case DType::f16: return f(f16{});
    default: LOOM_FAIL(what, " needs a floating-point dtype, got ", dtype_name(dtype));
  }
}

// Element offset of the i-th element (row-major over s.shape) in s.
inline int64_t strided_offset(const Strided& s, int64_t i) {
  int64_t off = 0;
  for (int d = s.ndim - 1; d >= 0; --d) {
    int64_t q = i / s.shape[d];
    off += (i - q * s.shape[d]) * s.strides[d];
    i = q;
  }
  return off;
}

}  // namespace loom::cpu
