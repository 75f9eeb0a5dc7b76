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
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/cuda/common.cuh"
#include "kernels/core/precision.h"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;
constexpr int kMaxDevices = 64;

// A cached cuBLASLt plan: descriptors for one shape, dtype and layout, and the chosen algorithm.
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;  // false: cuBLASLt had no algorithm; the product runs without the epilogue
};
// dtype, transposes, m, n, k, leading dims, beta != 0, and the alignment of A, B, C and bias.
using LtKey = std::tuple<int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, uint32_t,
                         uint32_t, uint32_t, uint32_t>;

// The largest power of two up to 256 that divides the address: cuBLASLt assumes 256-byte
// aligned buffers unless told otherwise, and views into a buffer can start anywhere.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return a == 0 ? 256u : uint32_t(std::min<uintptr_t>(256, a & (~a + 1)));
}

// C (rows, n; row stride ldc) += bias (n), for products cuBLASLt could not plan.
template <class T> __global__ void add_bias_rows_kernel(T* c, const T* bias, int64_t rows, int64_t n, int64_t ldc) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / n, j = i - r * n;
    c[r * ldc + j] = from_acc<T>(to_acc(c[r * ldc + j]) + to_acc(bias[j]));
  }
}

void add_bias_rows(const GemmArgs& g, cudaStream_t stream) {
  const int64_t total = g.m * g.n;
  const int blocks = int(std::min<int64_t>((total + 255) / 256, 65535));
  switch (g.dtype) {
    case DType::f32: add_bias_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<float*>(g.c), static_cast<const float*>(g.bias), g.m, g.n, g.ldc); break;
    case DType::f64: add_bias_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<double*>(g.c), static_cast<const double*>(g.bias), g.m, g.n, g.ldc); break;
    case DType::bf16: add_bias_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(g.c), static_cast<const __nv_bfloat16*>(g.bias), g.m, g.n, g.ldc); break;
    case DType::f16: add_bias_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<__half*>(g.c), static_cast<const __half*>(g.bias), g.m, g.n, g.ldc); break;
    default: LOOM_FAIL("gemm: no bias for ", dtype_name(g.dtype));
  }
  LOOM_CUDA(cudaGetLastError());
}

struct Blas {
  cublasHandle_t handle = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  std::mutex mu;
  std::map<LtKey, LtPlan> plans;  // under mu; never freed (process lifetime, as the handle)
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
    LOOM_CUBLAS(cublasLtCreate(&b.lt));
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

// The plan for a product with a bias epilogue (caller holds blas.mu). In the column-major
// view cuBLASLt's A is Loom's B (n x k stored, or k x n when transposed) and its B is Loom's A.
const LtPlan& lt_plan(Blas& blas, const GemmArgs& g, const Types& t, int m, int n, int k, int lda, int ldb, int ldc) {
  const uint32_t align_a = alignment_of(g.b), align_b = alignment_of(g.a), align_c = alignment_of(g.c),
                 align_bias = alignment_of(g.bias);
  const LtKey key{int(g.dtype), g.trans_a, g.trans_b, m, n, k, lda, ldb, ldc, g.beta != 0.f,
                  align_a, align_b, align_c, align_bias};
  auto found = blas.plans.find(key);
  if (found != blas.plans.end()) return found->second;
  LtPlan p;
  const cudaDataType_t scale = g.dtype == DType::f64 ? CUDA_R_64F : CUDA_R_32F;
  LOOM_CUBLAS(cublasLtMatmulDescCreate(&p.desc, t.compute, scale));
  const cublasOperation_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  const cudaDataType_t bias_type = t.data;  // the bias is in C's dtype
  LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, t.data, op_a == CUBLAS_OP_N ? n : k, op_a == CUBLAS_OP_N ? k : n, ldb));
  LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, t.data, op_b == CUBLAS_OP_N ? k : m, op_b == CUBLAS_OP_N ? m : k, lda));
  LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p.c, t.data, n, m, ldc));
  cublasLtMatmulPreference_t pref = nullptr;
  LOOM_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  LOOM_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // f32 accumulation for 16-bit data: split-K partial sums may only be added in the compute type.
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  LOOM_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                                   sizeof(reduction)));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c}};
  for (const auto& [attribute, bytes] : aligns)
    LOOM_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &bytes, sizeof(bytes)));
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  LOOM_CUBLAS(cublasLtMatmulAlgoGetHeuristic(blas.lt, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &count));
  cublasLtMatmulPreferenceDestroy(pref);
  p.found = count > 0 && result.state == CUBLAS_STATUS_SUCCESS;
  p.algo = result.algo;
  return blas.plans.emplace(key, p).first->second;
}

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
  if (g.bias) {
    LOOM_CHECK(g.batch == 1, "gemm: a bias needs a single product, got a batch of ", g.batch);
    const LtPlan& plan = lt_plan(blas, g, t, m, n, k, lda, ldb, ldc);
    if (!plan.found) {  // the plain product, then the bias in a pass of its own
      GemmArgs plain = g;
      plain.bias = nullptr;
      blas.mu.unlock();
      gemm(plain, stream);
      add_bias_rows(g, as_cuda(stream));
      blas.mu.lock();  // the lock_guard unlocks it on return
      return;
    }
    LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
    LOOM_CUBLAS(cublasLtMatmul(blas.lt, plan.desc, alpha, g.b, plan.a, g.a, plan.b, beta, g.c, plan.c, g.c, plan.c,
                               &plan.algo, blas.workspace, kWorkspaceBytes, as_cuda(stream)));
    return;
  }
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
