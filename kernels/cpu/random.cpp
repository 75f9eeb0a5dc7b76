// PLACEHOLDER: replaced by the random kernels.
#include "kernels/cpu/kernels.h"
#include "kernels/core/error.h"

namespace loom::cpu {

void uniform(const Strided& out, uint64_t seed, uint64_t offset, double lo, double hi, StreamHandle stream) {
  LOOM_FAIL("cpu kernel uniform is not written yet");
}

void normal(const Strided& out, uint64_t seed, uint64_t offset, double mean, double std, StreamHandle stream) {
  LOOM_FAIL("cpu kernel normal is not written yet");
}

}  // namespace loom::cpu
