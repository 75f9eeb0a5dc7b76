// Strided attention operands for the kernel tests (CPU and CUDA suites): moves a dense
// (B, H, len, D) operand into a buffer laid out by AttentionStrides, and back, one element
// at a time, so a layout the kernels get wrong cannot agree with one the test gets right.
// Also the column sums of the gradients (AttentionArgs::column_sums) that the backward is
// checked against.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
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

// What AttentionArgs::column_sums holds for dense (B, H, len, D) gradients dq, dk and dv: each
// (operand, head, column)'s sum over batch and rows, in double, with the sum of the
// magnitudes beside it (the scale a sum's rounding is measured against).
struct ColumnSums {
  std::vector<double> sums, magnitudes;
};
inline ColumnSums column_sums_of(const std::vector<double>& dq, const std::vector<double>& dk,
                                 const std::vector<double>& dv, int64_t B, int64_t H, int64_t Tq, int64_t Tk,
                                 int64_t D) {
  ColumnSums out{std::vector<double>(size_t(3 * H * D)), std::vector<double>(size_t(3 * H * D))};
  const std::vector<double>* grads[3] = {&dq, &dk, &dv};
  for (int64_t which = 0; which < 3; ++which) {
    const int64_t len = which == 0 ? Tq : Tk;
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t t = 0; t < len; ++t)
        for (int64_t d = 0; d < D; ++d) {
          const double x = (*grads[which])[size_t((bh * len + t) * D + d)];
          const size_t at = size_t((which * H + bh % H) * D + d);
          out.sums[at] += x;
          out.magnitudes[at] += std::abs(x);
        }
  }
  return out;
}

// Every sum within rel of the column's magnitude (the rounding of adding it up in the
// accumulation type); a column of zeros sums to exactly zero.
inline void expect_column_sums(const std::vector<double>& got, const ColumnSums& want, double rel,
                               const std::string& what) {
  ASSERT_EQ(got.size(), want.sums.size()) << what;
  int bad = 0;
  for (size_t c = 0; c < got.size() && bad < 5; ++c)
    if (!(std::abs(got[c] - want.sums[c]) <= rel * want.magnitudes[c]))
      ++bad, ADD_FAILURE() << what << " column sum " << c << ": got " << got[c] << ", want " << want.sums[c]
                           << " (magnitudes " << want.magnitudes[c] << ")";
}

}  // namespace loom::test
