// One status-check macro family for every NVIDIA library Loom calls. Each names the
// call, the file and the line, and the library's own words for the status, and throws
// loom::Error. LOOM_CUDA_LAUNCH checks a kernel launch right after it is issued.
#pragma once

#include <cuda_runtime.h>

#include "../core/error.h"

namespace loom::detail {
[[noreturn]] void throw_status(const char* library, const char* call, const char* file, int line, long code,
                               const char* what);
const char* cublas_status_string(int status);
}  // namespace loom::detail

#define LOOM_STATUS_CHECK(library, call, ok, to_string)                                               \
  do {                                                                                                \
    auto loom_status_ = (call);                                                                       \
    if (loom_status_ != (ok)) [[unlikely]]                                                            \
      ::loom::detail::throw_status(library, #call, __FILE__, __LINE__, long(loom_status_),            \
                                   to_string(loom_status_));                                          \
  } while (0)

#define LOOM_CUDA(call) LOOM_STATUS_CHECK("CUDA", call, cudaSuccess, cudaGetErrorString)
#define LOOM_CUBLAS(call) \
  LOOM_STATUS_CHECK("cuBLAS", call, CUBLAS_STATUS_SUCCESS, ::loom::detail::cublas_status_string)
#define LOOM_CUDNN(call) LOOM_STATUS_CHECK("cuDNN", call, CUDNN_STATUS_SUCCESS, cudnnGetErrorString)
#define LOOM_NCCL(call) LOOM_STATUS_CHECK("NCCL", call, ncclSuccess, ncclGetErrorString)
#define LOOM_CUDA_LAUNCH() LOOM_CUDA(cudaGetLastError())
