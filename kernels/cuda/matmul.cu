// PLACEHOLDER: replaced by the matmul kernels.
#include "kernels/cuda/kernels.h"
#include "kernels/core/error.h"

namespace loom::cuda {

void gemm(const GemmArgs& args, StreamHandle stream) {
  LOOM_FAIL("cuda kernel gemm is not written yet");
}

}  // namespace loom::cuda
