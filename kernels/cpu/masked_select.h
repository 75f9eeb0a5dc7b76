// masked_select(take_a, a, b): a where take_a, else b, through an integer mask over the
// values' bits. No branch, and no floating-point operation inside a condition: under the
// default -ftrapping-math the compiler keeps a plain `take_a ? a : b` of floats as a branch
// (it may not speculate a floating-point operation), which random data mispredicts and which
// stops a loop from vectorising. Used by kernels/cpu/exp_f32.h, tanh_f32.h, max pooling and
// the fused BatchNorm-ReLU.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

namespace loom::cpu {

template <class V>
inline V masked_select(bool take_a, V a, V b) {
  static_assert(sizeof(V) == 4 || sizeof(V) == 8, "masked_select takes 4- or 8-byte values");
  using Bits = std::conditional_t<sizeof(V) == 8, uint64_t, uint32_t>;
  const Bits m = Bits(0) - Bits(take_a);
  return std::bit_cast<V>(Bits((std::bit_cast<Bits>(a) & m) | (std::bit_cast<Bits>(b) & ~m)));
}

}  // namespace loom::cpu
