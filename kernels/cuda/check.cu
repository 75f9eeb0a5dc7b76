#include "kernels/cuda/check.h"

#include <cublas_v2.h>

namespace loom::detail {

void throw_status(const char* library, const char* call, const char* file, int line, long code, const char* what) {
  throw Error(str(library, " error ", code, " (", what ? what : "unknown", ") from ", call, " at ", file, ":", line));
}

const char* cublas_status_string(int status) { return cublasGetStatusString(cublasStatus_t(status)); }

}  // namespace loom::detail
