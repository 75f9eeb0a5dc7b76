// PLACEHOLDER: replaced by the matmul kernels.
#include "kernels/cpu/kernels.h"
#include "kernels/core/error.h"

namespace loom::cpu {

void gemm(const GemmArgs& args, StreamHandle stream) {
  LOOM_FAIL("cpu kernel gemm is not written yet");
}

}  // namespace loom::cpu
