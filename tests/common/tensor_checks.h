// Checks the engine's op tests share: an op's error message, closeness element by element
// relative to each value, and closeness relative to the reference's largest magnitude (a
// GPU result against the CPU's, where 16-bit rounding scales with the data).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/ops.h"

namespace loom::test {

// f() throws a loom::Error whose message contains needle.
template <class F> void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected a loom::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// got and want hold the same bits (the sign of a zero counts), in the same dtype and shape, on
// any devices and in any layouts.
inline void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const Tensor a = got.to(Device::cpu()).contiguous(), b = want.to(Device::cpu()).contiguous();
  EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0) << what;
}

// ||a - b|| / ||b|| over all elements, both brought to the CPU in f64.
inline double relative_difference(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to(Device::cpu()).to(DType::f64).to_vector<double>();
  const std::vector<double> y = b.to(Device::cpu()).to(DType::f64).to_vector<double>();
  EXPECT_EQ(x.size(), y.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    diff += (x[i] - y[i]) * (x[i] - y[i]);
    norm += y[i] * y[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

// |a - b| <= tol * (1 + |b|) element by element.
inline void expect_all_close(const Tensor& a, const Tensor& b, double tol, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i)
    ASSERT_NEAR(va[i], vb[i], tol * (1 + std::abs(vb[i]))) << what << " element " << i;
}

// |got - want| <= tol * (max(1, max |want|) + |want|) element by element; got may be on the
// GPU. Reports the first five elements off.
inline void expect_close_to_scale(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<double> g = got.to(Device::cpu()).to_vector<double>(), w = want.to_vector<double>();
  double scale = 1.0;
  for (double e : w) scale = std::max(scale, std::abs(e));
  int bad = 0;
  for (size_t i = 0; i < g.size() && bad < 5; ++i)
    if (!(std::abs(g[i] - w[i]) <= tol * (scale + std::abs(w[i]))))
      ++bad, ADD_FAILURE() << what << " element " << i << ": cuda " << g[i] << ", cpu " << w[i];
}

}  // namespace loom::test
