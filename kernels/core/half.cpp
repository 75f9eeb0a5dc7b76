// IEEE binary16 conversions for host code (round to nearest even, subnormals kept).
#include "kernels/core/dtype.h"

#include <cstring>

namespace loom {

f16::f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mag = x & 0x7fffffffu;
  if (mag >= 0x7f800000u) {  // inf or NaN
    bits = uint16_t(sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0u));
    return;
  }
  if (mag >= 0x477ff000u) {  // rounds past the largest half: inf
    bits = uint16_t(sign | 0x7c00u);
    return;
  }
  if (mag < 0x38800000u) {  // subnormal half (or zero)
    if (mag < 0x33000000u) {
      bits = uint16_t(sign);
      return;
    }
    uint32_t exp = mag >> 23;
    uint32_t mant = (mag & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // value = mant * 2^(exp-150) = half_mant * 2^-24
    uint32_t r = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) r++;
    bits = uint16_t(sign | r);
    return;
  }
  uint32_t r = ((mag - 0x38000000u) >> 13);
  uint32_t rem = mag & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  bits = uint16_t(sign | r);
}

f16::operator float() const {
  uint32_t sign = uint32_t(bits & 0x8000u) << 16;
  uint32_t exp = (bits >> 10) & 0x1fu;
  uint32_t mant = bits & 0x3ffu;
  uint32_t x;
  if (exp == 0) {
    if (mant == 0) {
      x = sign;
    } else {  // subnormal: normalise
      exp = 113;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        exp--;
      }
      mant &= 0x3ffu;
      x = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (mant << 13);
  } else {
    x = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

}  // namespace loom
