// Helpers shared by the test suites.
#pragma once

#include <gtest/gtest.h>

#include "kernels/core/precision.h"

namespace loom::test {

// True when Loom was built with CUDA and a GPU is visible.
bool cuda_available();

// Full f32 products on the GPU (no TF32) for the guard's lifetime, so that a GPU result
// differs from its reference by the order of sums only.
struct Tf32Off {
  bool was = tf32_allowed();
  Tf32Off() { set_tf32_allowed(false); }
  ~Tf32Off() { set_tf32_allowed(was); }
  Tf32Off(const Tf32Off&) = delete;
  Tf32Off& operator=(const Tf32Off&) = delete;
};

}  // namespace loom::test

// Skips the current test with a clear message where no GPU is visible.
#define LOOM_REQUIRE_CUDA()                                                              \
  do {                                                                                   \
    if (!::loom::test::cuda_available())                                                 \
      GTEST_SKIP() << "no CUDA GPU visible (or Loom built without CUDA): skipping";      \
  } while (0)
