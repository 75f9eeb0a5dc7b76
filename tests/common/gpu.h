// Helpers shared by the test suites.
#pragma once

#include <gtest/gtest.h>

namespace loom::test {

// True when Loom was built with CUDA and a GPU is visible.
bool cuda_available();

}  // namespace loom::test

// Skips the current test with a clear message where no GPU is visible.
#define LOOM_REQUIRE_CUDA()                                                              \
  do {                                                                                   \
    if (!::loom::test::cuda_available())                                                 \
      GTEST_SKIP() << "no CUDA GPU visible (or Loom built without CUDA): skipping";      \
  } while (0)
