// PLACEHOLDER: replaced by the random kernels.
#include "kernels/cuda/kernels.h"
#include "kernels/core/error.h"

namespace loom::cuda {

void uniform(const Strided& out, uint64_t seed, uint64_t offset, double lo, double hi, StreamHandle stream) {
  LOOM_FAIL("cuda kernel uniform is not written yet");
}

void normal(const Strided& out, uint64_t seed, uint64_t offset, double mean, double std, StreamHandle stream) {
  LOOM_FAIL("cuda kernel normal is not written yet");
}

}  // namespace loom::cuda
