// Strided attention operands for the kernel tests (CPU and CUDA suites): moves a dense
// (B, H, len, D) operand into a buffer laid out by AttentionStrides, and back, one element
// at a time, so a layout the kernels get wrong cannot agree with one the test gets right.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/table.h"

namespace loom::test {

// Element (b, h, t, d) of the dense operand goes to buf[base + b s.batch + h s.head + t s.seq + d].
inline void place(std::vector<double>& buf, int64_t base, const AttentionStrides& s, const std::vector<double>& dense,
                  int64_t B, int64_t H, int64_t len, int64_t D) {
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = 0; t < len; ++t)
      for (int64_t d = 0; d < D; ++d)
        buf[size_t(base + bh / H * s.batch + bh % H * s.head + t * s.seq + d)] = dense[size_t((bh * len + t) * D + d)];
}

// The dense (B, H, len, D) operand laid out in buf as place() lays it.
inline std::vector<double> take(const std::vector<double>& buf, int64_t base, const AttentionStrides& s, int64_t B,
                                int64_t H, int64_t len, int64_t D) {
  std::vector<double> dense(size_t(B * H * len * D));
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = 0; t < len; ++t)
      for (int64_t d = 0; d < D; ++d)
        dense[size_t((bh * len + t) * D + d)] = buf[size_t(base + bh / H * s.batch + bh % H * s.head + t * s.seq + d)];
  return dense;
}

}  // namespace loom::test
