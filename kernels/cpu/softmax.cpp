// PLACEHOLDER: replaced by the softmax kernels.
#include "kernels/cpu/kernels.h"
#include "kernels/core/error.h"

namespace loom::cpu {

void softmax(void* out, const void* in, DType dtype, int64_t outer, int64_t R, int64_t inner, bool log,
             StreamHandle stream) {
  LOOM_FAIL("cpu kernel softmax is not written yet");
}

void softmax_backward(void* grad_in, const void* grad_out, const void* out, DType dtype, int64_t outer,
                      int64_t R, int64_t inner, bool log, StreamHandle stream) {
  LOOM_FAIL("cpu kernel softmax_backward is not written yet");
}

void cross_entropy(float* loss, float* lse, const void* logits, DType dtype, const int64_t* target, int64_t N,
                   int64_t C, int64_t ignore_index, double label_smoothing, StreamHandle stream) {
  LOOM_FAIL("cpu kernel cross_entropy is not written yet");
}

void cross_entropy_backward(void* grad_logits, const void* logits, const float* lse, const int64_t* target,
                            const float* grad_row, DType dtype, int64_t N, int64_t C, int64_t ignore_index,
                            double label_smoothing, StreamHandle stream) {
  LOOM_FAIL("cpu kernel cross_entropy_backward is not written yet");
}

}  // namespace loom::cpu
