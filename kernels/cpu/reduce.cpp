// PLACEHOLDER: replaced by the reduce kernels.
#include "kernels/cpu/kernels.h"
#include "kernels/core/error.h"

namespace loom::cpu {

void reduce(ReduceOp op, void* out, const void* in, DType dtype, int64_t outer, int64_t R, int64_t inner,
            StreamHandle stream) {
  LOOM_FAIL("cpu kernel reduce is not written yet");
}

}  // namespace loom::cpu
