// Pairwise summation for the CPU reference kernels (reduce.cpp, softmax.cpp): halving the
// range until a short leaf keeps the rounding error growing with log R rather than R, at
// the cost of one small buffer per level. One copy, so the references round alike.
#pragma once

#include <algorithm>
#include <cstdint>

namespace loom::cpu {

constexpr int64_t kPairwiseLeaf = 32;  // pairwise sums add up to this many rows directly

// out[c] = sum over r in [r0, r1) of f(r, c), for c < cols <= kMaxCols: pairwise over r.
template <int kMaxCols, class A, class Cols, class F>
void pairwise_cols(int64_t r0, int64_t r1, Cols cols, A* out, const F& f) {
  if (r1 - r0 <= kPairwiseLeaf) {
    std::fill(out, out + cols, A(0));
    for (int64_t r = r0; r < r1; ++r)
      for (int c = 0; c < cols; ++c) out[c] += f(r, c);
    return;
  }
  int64_t mid = r0 + (r1 - r0) / 2;
  A rest[kMaxCols];
  pairwise_cols<kMaxCols>(r0, mid, cols, out, f);
  pairwise_cols<kMaxCols>(mid, r1, cols, rest, f);
  for (int c = 0; c < cols; ++c) out[c] += rest[c];
}

}  // namespace loom::cpu
