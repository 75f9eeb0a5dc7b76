// exp in f32 without a call into libm, for loops that must vectorise: CPU attention takes one
// exp per visible (query, key) pair, forward and backward, and the C library's expf is a call
// the compiler cannot vectorise. Every step is a multiply, an add, a masked select, a
// conversion or a bit operation.
//
//   exp(x) = 2^n exp(r),  x = n ln 2 + r,  |r| <= ln 2 / 2
//
// n = round(x / ln 2) by the 1.5 * 2^23 trick; ln 2 is split in two parts so that n ln 2's
// first part is exact; exp(r) is its Taylor series to r^7 (the first term left out, r^8 / 8!,
// is below 5.5e-9, under a tenth of an ulp of exp(r)); 2^n is built in the exponent bits as
// 2^a 2^b with a + b = n, so that n from -150 to 128 needs no special case: results below the
// normal range round to subnormals (or 0) in the second product, above it to infinity. x is
// clamped to [-104, 89] first (beyond, exp rounds to 0 and infinity anyway). Within 2 ulp of
// exp over the normal results: 1.22 the worst over every float from -87 to 88.72283 (the
// largest whose exp is finite), tests/kernels/test_attention.cpp sweeping every 16th; within
// one subnormal step below -87; NaN gives NaN.
#pragma once

#include <bit>
#include <cstdint>

#include "masked_select.h"

namespace loom::cpu {

inline float exp_f32(float x) {
  const float c = masked_select(x > -104.f, masked_select(x < 89.f, x, 89.f), -104.f);  // NaN: -104, restored
  constexpr float kRound = 12582912.f;                                                  // 1.5 * 2^23
  const float n = (c * 1.44269504088896341f + kRound) - kRound;
  const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t k = int32_t(n), a = k >> 1, b = k - a;  // a, b in [-75, 64]: normal powers of two
  const float two_a = std::bit_cast<float>(uint32_t(a + 127) << 23);
  const float two_b = std::bit_cast<float>(uint32_t(b + 127) << 23);
  return masked_select(x == x, (p * two_a) * two_b, x);
}

}  // namespace loom::cpu
