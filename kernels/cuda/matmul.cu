// CUDA matrix product: cuBLAS, called so that Loom adds nothing measurable per call.
//
// cuBLAS is column-major and Loom is row-major. A row-major (r, c) buffer read as
// column-major is its transpose, so the row-major C = op(A) op(B) is computed as the
// column-major C^T (n, m) = op(B)^T op(A)^T: B goes first, A second, m and n swap, and
// each operand keeps its own transpose flag and leading dimension.
//
// f32 runs on TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32), bf16 and f16 on tensor
// cores with f32 accumulation and f32 alpha/beta, f64 in f64. With beta == 0 cuBLAS does
// not read C, so NaNs there are ignored.
//
// One cuBLAS handle and one 32 MiB workspace per device are created on first use and
// kept for the life of the process (destroying them at exit would race the CUDA
// runtime's own teardown). This is the one place kernels allocate device memory: cuBLAS
// needs a workspace, and handing it a fixed one keeps cuBLAS from allocating behind our
// back (which also keeps calls graph-capturable once the handle exists). The handle is
// shared by every host thread, so setting its stream and workspace and issuing the
// product happen under a per-device lock; cublasSetStream also resets the workspace,
// hence cublasSetWorkspace on every call. The workspace is one per device, not one per
// stream: two products running at once on two streams of one device could both use it,
// so a device's products belong on one stream at a time (per-stream workspaces would be
// the change to make here if that ever stops holding).
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>

#include "kernels/cuda/common.cuh"
#include "kernels/core/precision.h"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;
constexpr int kMaxDevices = 64;

struct Blas {
  cublasHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::mutex mu;
};

Blas& blas_for_current_device() {
  int device = 0;
  LOOM_CUDA(cudaGetDevice(&device));
  LOOM_ASSERT(device >= 0 && device < kMaxDevices, "device ", device, " is past the ", kMaxDevices,
              " cuBLAS handles Loom keeps");
  static std::once_flag created[kMaxDevices];
  static Blas blas[kMaxDevices];
  std::call_once(created[device], [&] {
    Blas& b = blas[device];
    LOOM_CUBLAS(cublasCreate(&b.handle));
    LOOM_CUDA(cudaMalloc(&b.workspace, kWorkspaceBytes));
    // The contract is f32 accumulation for bf16/f16: forbid split-K reductions in 16 bits.
    LOOM_CUBLAS(cublasSetMathMode(b.handle, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  });
  return blas[device];
}

struct Types {
  cudaDataType_t data;
  cublasComputeType_t compute;
};

Types types_for(DType dtype) {
  switch (dtype) {
    case DType::f32: return {CUDA_R_32F, tf32_allowed() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
    case DType::f64: return {CUDA_R_64F, CUBLAS_COMPUTE_64F};
    case DType::bf16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
    case DType::f16: return {CUDA_R_16F, CUBLAS_COMPUTE_32F};
    default: LOOM_FAIL("gemm needs a floating-point dtype, got ", dtype_name(dtype));
  }
}

bool fits_int(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

}  // namespace

void gemm(const GemmArgs& g, StreamHandle stream) {
  if (g.m <= 0 || g.n <= 0 || g.batch <= 0) return;
  LOOM_CHECK(fits_int(g.m) && fits_int(g.n) && fits_int(g.k) && fits_int(g.batch) && fits_int(g.lda) &&
                 fits_int(g.ldb) && fits_int(g.ldc),
             "gemm: cuBLAS takes 32-bit sizes; got (m, n, k, batch) = (", g.m, ", ", g.n, ", ", g.k, ", ", g.batch,
             ") with leading dimensions (", g.lda, ", ", g.ldb, ", ", g.ldc, "): split the product");
  const Types t = types_for(g.dtype);
  // Scalars live on the host (the default pointer mode): f64 takes double, the rest float.
  const double alpha_d = g.alpha, beta_d = g.beta;
  const void* alpha = g.dtype == DType::f64 ? static_cast<const void*>(&alpha_d) : &g.alpha;
  const void* beta = g.dtype == DType::f64 ? static_cast<const void*>(&beta_d) : &g.beta;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  // cuBLAS rejects a leading dimension of 0 even where the matrix is empty (k == 0).
  const int lda = int(std::max<int64_t>(g.lda, 1)), ldb = int(std::max<int64_t>(g.ldb, 1));
  const int ldc = int(std::max<int64_t>(g.ldc, 1));
  const int m = int(g.m), n = int(g.n), k = int(g.k);

  Blas& blas = blas_for_current_device();
  std::lock_guard lock(blas.mu);
  LOOM_CUBLAS(cublasSetStream(blas.handle, as_cuda(stream)));
  LOOM_CUBLAS(cublasSetWorkspace(blas.handle, blas.workspace, kWorkspaceBytes));
  if (g.batch == 1) {
    LOOM_CUBLAS(cublasGemmEx(blas.handle, op_b, op_a, n, m, k, alpha, g.b, t.data, ldb, g.a, t.data, lda, beta, g.c,
                             t.data, ldc, t.compute, CUBLAS_GEMM_DEFAULT));
  } else {
    LOOM_CUBLAS(cublasGemmStridedBatchedEx(blas.handle, op_b, op_a, n, m, k, alpha, g.b, t.data, ldb, g.stride_b,
                                           g.a, t.data, lda, g.stride_a, beta, g.c, t.data, ldc, g.stride_c,
                                           int(g.batch), t.compute, CUBLAS_GEMM_DEFAULT));
  }
}

}  // namespace loom::cuda
