// Values as the raw bytes of a floating dtype (f32, f64, bf16, f16), and back: how the
// kernel tests build inputs for, and read outputs from, kernels that take untyped pointers.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/core/dtype.h"

namespace loom::test {

inline std::vector<uint8_t> encode(const std::vector<double>& v, DType dt) {
  const size_t es = dtype_size(dt);
  std::vector<uint8_t> b(v.size() * es);
  for (size_t e = 0; e < v.size(); ++e) {
    uint8_t* p = b.data() + e * es;
    const float f = float(v[e]);
    const bf16 h(f);
    const f16 g(f);
    switch (dt) {
      case DType::f32: std::memcpy(p, &f, 4); break;
      case DType::f64: std::memcpy(p, &v[e], 8); break;
      case DType::bf16: std::memcpy(p, &h.bits, 2); break;
      case DType::f16: std::memcpy(p, &g.bits, 2); break;
      default: ADD_FAILURE() << "not a float dtype";
    }
  }
  return b;
}

inline std::vector<double> decode(const std::vector<uint8_t>& b, DType dt) {
  const size_t es = dtype_size(dt);
  std::vector<double> v(b.size() / es);
  for (size_t e = 0; e < v.size(); ++e) {
    const uint8_t* p = b.data() + e * es;
    float f;
    bf16 h;
    f16 g;
    switch (dt) {
      case DType::f32: std::memcpy(&f, p, 4), v[e] = f; break;
      case DType::f64: std::memcpy(&v[e], p, 8); break;
      case DType::bf16: std::memcpy(&h.bits, p, 2), v[e] = float(h); break;
      case DType::f16: std::memcpy(&g.bits, p, 2), v[e] = float(g); break;
      default: ADD_FAILURE() << "not a float dtype";
    }
  }
  return v;
}

}  // namespace loom::test
