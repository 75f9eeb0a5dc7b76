// tanh in f32 without a call into libm: the C library's tanhf is a call the compiler cannot
// vectorise, and GELU runs it twice an element (forward and backward). Here every step is a
// multiply, an add, a divide, a masked select or a bit operation, so loops over it vectorise
// with the baseline instruction set.
//
//   tanh(x) = sign(x) e / (e + 2),  e = expm1(2 |x|),  |x| clamped to 9 (beyond it, tanh
//   differs from 1 by at most 3.1e-8, about half an ulp)
//
// expm1(z) for z <= 1 is its Taylor series to z^11 (the first term left out, z^12 / 12!, is
// below 2.1e-9 of z); above 1, exp(z) - 1 with exp(z) from kernels/cpu/exp_f32.h. The result
// is within 3 ulp of tanh, 2.4 the worst seen (tests/kernels/test_elementwise.cpp sweeps every
// 32nd float from 1e-30 to 10 against the f64 tanh). NaN gives NaN, +-inf gives +-1, and the sign of zero is kept.
#pragma once

#include <cmath>

#include "exp_f32.h"
#include "masked_select.h"

namespace loom::cpu {

inline float tanh_f32(float x) {
  const float a = std::fabs(x);
  const float z = masked_select(a < 9.f, 2.f * a, 18.f);  // NaN: 18, restored at the end
  // Small z: expm1 by its series, Horner from z^11 / 11! down.
  float s = 1.f / 39916800.f;
  s = s * z + 1.f / 3628800.f;
  s = s * z + 1.f / 362880.f;
  s = s * z + 1.f / 40320.f;
  s = s * z + 1.f / 5040.f;
  s = s * z + 1.f / 720.f;
  s = s * z + 1.f / 120.f;
  s = s * z + 1.f / 24.f;
  s = s * z + 1.f / 6.f;
  s = s * z + 0.5f;
  const float small = (s * z) * z + z;
  // Large z: exp(z) - 1.
  const float large = exp_f32(z) - 1.f;
  const float e = masked_select(z <= 1.f, small, large);
  const float t = std::copysign(e / (e + 2.f), x);
  return masked_select(x == x, t, x);
}

}  // namespace loom::cpu
