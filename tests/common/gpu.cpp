#include "tests/common/gpu.h"

#include "kernels/config.h"

#if LOOM_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace loom::test {

bool cuda_available() {
#if LOOM_WITH_CUDA
  static const bool available = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return available;
#else
  return false;
#endif
}

}  // namespace loom::test
