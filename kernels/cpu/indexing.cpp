// PLACEHOLDER: replaced by the indexing kernels.
#include "kernels/cpu/kernels.h"
#include "kernels/core/error.h"

namespace loom::cpu {

void index_select(void* out, const void* in, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
                  int64_t R, int64_t inner, StreamHandle stream) {
  LOOM_FAIL("cpu kernel index_select is not written yet");
}

void index_add(void* out, const void* src, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
               int64_t R, int64_t inner, StreamHandle stream) {
  LOOM_FAIL("cpu kernel index_add is not written yet");
}

void gather(void* out, const void* in, const int64_t* index, int64_t J, DType dtype, int64_t outer, int64_t R,
            int64_t inner, StreamHandle stream) {
  LOOM_FAIL("cpu kernel gather is not written yet");
}

void scatter_add(void* out, const void* src, const int64_t* index, int64_t J, DType dtype, int64_t outer,
                 int64_t R, int64_t inner, StreamHandle stream) {
  LOOM_FAIL("cpu kernel scatter_add is not written yet");
}

}  // namespace loom::cpu
