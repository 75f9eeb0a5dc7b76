// CUDA matrix product: cuBLAS, called so that Loom adds nothing measurable per call.
//
// cuBLAS is column-major and Loom is row-major. A row-major (r, c) buffer read as
// column-major is its transpose, so the row-major C = op(A) op(B) is computed as the
// column-major C^T (n, m) = op(B)^T op(A)^T: B goes first, A second, m and n swap, and
// each operand keeps its own transpose flag and leading dimension.
//
// f32 runs on TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32), bf16 and f16 on tensor
// cores with f32 accumulation and f32 alpha/beta, f64 in f64. With beta == 0 cuBLAS does
// not read C, so NaNs there are ignored. An alpha in device memory (GemmArgs::alpha_ptr)
// switches both scalars to device pointers, beta then read from a zero kept per device.
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
//
// Single products of f32, bf16 and f16 go through cuBLASLt with a plan per (shape, layout,
// alignment, epilogue), built once. cuBLASLt's first heuristic choice is often not the
// fastest: small outputs with a long k (a linear layer's weight gradient, (768, 768) over
// 16k tokens) want split-K, square ones a different tile. So the first product of each plan
// times up to kCandidates of the heuristic's algorithms on its own operands (3 runs each,
// CUDA events; the output is overwritten by the real product afterwards, and plans whose
// beta term is read from C itself keep the first choice) and keeps the fastest. This costs
// a few milliseconds once per shape and a synchronisation of the stream then.
// GemmArgs::autotune false takes the heuristic's first choice instead (the same algorithm
// run to run); a plan keeps both, so the setting may change from call to call. Batched and
// f64 products use cuBLAS's own GEMM calls.
//
// Epilogues (GemmArgs in kernels/table.h): bias, GELU with its pre-activation, and the GELU
// gradient run in cuBLASLt for 16-bit products; whatever cuBLASLt does not take (f32 GELU,
// products it cannot plan) runs in the passes of gemm_passes.cu, after the product on the
// same stream. Bias-gradient sums always run there: cuBLASLt's BGRAD epilogues narrow the
// algorithms a product may use, and the separate passes measured faster. An f32 C beside
// bf16/f16 A and B, and a separate c_in for the beta term, let a residual stream be summed
// by the product itself.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/core/gemm_check.h"
#include "kernels/core/precision.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm_passes.cuh"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;
constexpr int kMaxDevices = 64;

// The largest power of two up to 256 that divides the address: cuBLASLt assumes 256-byte
// aligned buffers unless told otherwise, and views into a buffer can start anywhere.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return a == 0 ? 256u : uint32_t(std::min<uintptr_t>(256, a & (~a + 1)));
}

// The cuBLASLt epilogue for a product, and which parts of GemmArgs it covers. In the
// column-major view Loom's columns are cuBLASLt's rows: a bias (n) is its bias.
std::pair<cublasLtEpilogue_t, gemm_passes::Done> lt_epilogue(const GemmArgs& g) {
  gemm_passes::Done d;
  // cuBLASLt's GELU and its gradient are approximations that stay within a 16-bit result's
  // rounding but not within f32's; f32 products take Loom's own pass for them.
  const bool sixteen_bit = g.dtype == DType::bf16 || g.dtype == DType::f16;
  if (g.epilogue != GemmEpilogue::none && !sixteen_bit) {
    d.bias = g.bias != nullptr;
    return {g.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, d};
  }
  if (g.epilogue == GemmEpilogue::gelu) {
    d.bias = d.epilogue = true;
    return {g.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX, d};
  }
  if (g.epilogue == GemmEpilogue::dgelu && !g.bias) {
    d.epilogue = true;
    return {CUBLASLT_EPILOGUE_DGELU, d};
  }
  if (g.epilogue == GemmEpilogue::none && g.bias) {
    d.bias = true;
    return {CUBLASLT_EPILOGUE_BIAS, d};
  }
  return {CUBLASLT_EPILOGUE_DEFAULT, d};
}

constexpr int kCandidates = 8;

// A cached cuBLASLt plan: descriptors for one shape, dtype and layout, and the chosen algorithm.
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  gemm_passes::Done done;    // what the epilogue covers; the rest runs in passes of its own
  cublasLtMatmulAlgo_t candidates[kCandidates]{};  // in the heuristic's order
  int count = 0;      // heuristic candidates; 0: cuBLASLt has none and the product takes cuBLAS's path
  int chosen = -1;    // the candidate timing picked; -1 until the first autotuned product
};
// dtype, compute type, transposes, m, n, k, leading dims, scalars (beta != 0, alpha read
// from memory), epilogue, aux's leading dim, and the alignment of A, B, C, bias and aux.
using LtKey = std::tuple<int, int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int64_t,
                         uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>;

struct Blas {
  cublasHandle_t handle = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  void* zero = nullptr;  // 16 zero bytes on the device: beta (f32 or f64) beside an alpha in memory
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
    LOOM_CUDA(cudaMalloc(&b.zero, 16));
    LOOM_CUDA(cudaMemset(b.zero, 0, 16));
    LOOM_CUDA(cudaDeviceSynchronize());  // zeroed before any stream reads it, blocking or not
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

cudaDataType_t c_type(const GemmArgs& g, const Types& t) { return g.c_f32 ? CUDA_R_32F : t.data; }

// The vector cuBLASLt's bias pointer names for this epilogue: the bias it adds.
const void* lt_vector(const GemmArgs& g, cublasLtEpilogue_t epilogue) {
  switch (epilogue) {
    case CUBLASLT_EPILOGUE_BIAS:
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return g.bias;
    default: return nullptr;
  }
}

// The plan for a single product (caller holds blas.mu). In the column-major view
// cuBLASLt's A is Loom's B (n x k stored, or k x n when transposed) and its B is Loom's A.
LtPlan& lt_plan(Blas& blas, const GemmArgs& g, const Types& t, int m, int n, int k, int lda, int ldb, int ldc) {
  const auto [epilogue, done] = lt_epilogue(g);
  const uint32_t align_a = alignment_of(g.b), align_b = alignment_of(g.a), align_c = alignment_of(g.c),
                 align_vec = alignment_of(lt_vector(g, epilogue)), align_aux = alignment_of(g.aux);
  const LtKey key{int(g.dtype) * 2 + int(g.c_f32), int(t.compute), g.trans_a, g.trans_b, m, n, k, lda, ldb, ldc,
                  int(g.beta != 0.f) | (g.alpha_ptr ? 2 : 0), int(epilogue), g.aux ? g.ld_aux : 0, align_a, align_b,
                  std::min(align_c, alignment_of(g.c_in)), align_vec, align_aux};
  auto found = blas.plans.find(key);
  if (found != blas.plans.end()) return found->second;
  LtPlan p;
  p.epilogue = epilogue;
  p.done = done;
  LOOM_CUBLAS(cublasLtMatmulDescCreate(&p.desc, t.compute, CUDA_R_32F));
  const cublasOperation_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (g.alpha_ptr) {  // alpha and beta both device pointers
    const cublasLtPointerMode_t mode = CUBLASLT_POINTER_MODE_DEVICE;
    LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof(mode)));
  }
  if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    if (lt_vector(g, epilogue)) {
      const cudaDataType_t vector_type = c_type(g, t);  // the bias is in C's dtype
      LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &vector_type,
                                                 sizeof(vector_type)));
    }
    if (done.epilogue) {
      const int64_t ld = g.ld_aux;
      LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    }
  }
  LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, t.data, op_a == CUBLAS_OP_N ? n : k, op_a == CUBLAS_OP_N ? k : n, ldb));
  LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, t.data, op_b == CUBLAS_OP_N ? k : m, op_b == CUBLAS_OP_N ? m : k, lda));
  LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p.c, c_type(g, t), n, m, ldc));  // C and D alike
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
  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int count = 0;
  // Every candidate, whether this call autotunes or not: a later call may. Only the first
  // where trial runs would change what the product reads (C when beta != 0, unless it comes
  // from c_in).
  const int wanted = g.beta == 0.f || g.c_in ? kCandidates : 1;
  LOOM_CUBLAS(cublasLtMatmulAlgoGetHeuristic(blas.lt, p.desc, p.a, p.b, p.c, p.c, pref, wanted, results, &count));
  cublasLtMatmulPreferenceDestroy(pref);
  for (int i = 0; i < count; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) p.candidates[p.count++] = results[i].algo;
  return blas.plans.emplace(key, p).first->second;
}

cublasStatus_t lt_run(Blas& blas, const LtPlan& p, const cublasLtMatmulAlgo_t& algo, const GemmArgs& g,
                      const void* alpha, const void* beta, cudaStream_t stream) {
  return cublasLtMatmul(blas.lt, p.desc, alpha, g.b, p.a, g.a, p.b, beta, g.c_in ? g.c_in : g.c, p.c, g.c, p.c, &algo, blas.workspace,
                        kWorkspaceBytes, stream);
}

// Picks the plan's algorithm: the fastest candidate over three timed runs each on this
// product's own operands (beta == 0, so C is only written), or the first when there is one
// candidate or the stream is being captured into a CUDA graph (no synchronisation there).
// A candidate that fails to launch is skipped.
void choose(Blas& blas, LtPlan& p, const GemmArgs& g, const void* alpha, const void* beta, cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  LOOM_CUDA(cudaStreamIsCapturing(stream, &capturing));
  p.chosen = 0;
  if (p.count == 1 || capturing != cudaStreamCaptureStatusNone) return;
  cudaEvent_t marks[4];
  for (auto& e : marks) LOOM_CUDA(cudaEventCreate(&e));
  float best = std::numeric_limits<float>::infinity();
  for (int i = 0; i < p.count; ++i) {
    if (lt_run(blas, p, p.candidates[i], g, alpha, beta, stream) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up
    LOOM_CUDA(cudaEventRecord(marks[0], stream));
    for (int r = 1; r < 4; ++r) {
      LOOM_CUBLAS(lt_run(blas, p, p.candidates[i], g, alpha, beta, stream));
      LOOM_CUDA(cudaEventRecord(marks[r], stream));
    }
    LOOM_CUDA(cudaEventSynchronize(marks[3]));
    float runs[3];
    for (int r = 0; r < 3; ++r) LOOM_CUDA(cudaEventElapsedTime(&runs[r], marks[r], marks[r + 1]));
    std::sort(runs, runs + 3);
    if (runs[1] < best) best = runs[1], p.chosen = i;
  }
  for (auto& e : marks) LOOM_CUDA(cudaEventDestroy(e));
}

}  // namespace

void gemm(const GemmArgs& g, StreamHandle stream) {
  if (g.m <= 0 || g.n <= 0 || g.batch <= 0) return;
  LOOM_CHECK(fits_int(g.m) && fits_int(g.n) && fits_int(g.k) && fits_int(g.batch) && fits_int(g.lda) &&
                 fits_int(g.ldb) && fits_int(g.ldc),
             "gemm: cuBLAS takes 32-bit sizes; got (m, n, k, batch) = (", g.m, ", ", g.n, ", ", g.k, ", ", g.batch,
             ") with leading dimensions (", g.lda, ", ", g.ldb, ", ", g.ldc, "): split the product");
  LOOM_CHECK(!g.bias || g.batch == 1, "gemm: a bias needs a single product, got a batch of ", g.batch);
  check_gemm_extras(g);
  const Types t = types_for(g.dtype);
  Blas& blas = blas_for_current_device();
  // Scalars live on the host (the default pointer mode): f64 takes double, the rest float.
  // An alpha in device memory puts both on the device, beta from the zeros kept for it.
  const double alpha_d = g.alpha, beta_d = g.beta;
  const void* alpha = g.alpha_ptr ? g.alpha_ptr : g.dtype == DType::f64 ? static_cast<const void*>(&alpha_d) : &g.alpha;
  const void* beta = g.alpha_ptr ? blas.zero : g.dtype == DType::f64 ? static_cast<const void*>(&beta_d) : &g.beta;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  // cuBLAS rejects a leading dimension of 0 even where the matrix is empty (k == 0).
  const int lda = int(std::max<int64_t>(g.lda, 1)), ldb = int(std::max<int64_t>(g.ldb, 1));
  const int ldc = int(std::max<int64_t>(g.ldc, 1));
  const int m = int(g.m), n = int(g.n), k = int(g.k);
  cudaStream_t s = as_cuda(stream);

  std::lock_guard lock(blas.mu);
  if (g.batch == 1 && g.dtype != DType::f64 && k > 0) {
    LtPlan& plan = lt_plan(blas, g, t, m, n, k, lda, ldb, ldc);
    if (plan.count > 0) {
      // Pointers change from call to call; the descriptor is shared under the lock.
      if (const void* vector = lt_vector(g, plan.epilogue))
        LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vector, sizeof(vector)));
      if (plan.done.epilogue)
        LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux,
                                                   sizeof(g.aux)));
      if (g.autotune && plan.chosen < 0) choose(blas, plan, g, alpha, beta, s);
      const cublasLtMatmulAlgo_t& algo = plan.candidates[g.autotune ? plan.chosen : 0];
      LOOM_CUBLAS(lt_run(blas, plan, algo, g, alpha, beta, s));
      gemm_passes::finish(g, plan.done, blas.workspace, kWorkspaceBytes, s);
      return;
    }
  }
  if (g.c_in && g.beta != 0.f) {  // cuBLAS reads the beta term from C itself
    const size_t elem = g.c_f32 ? sizeof(float) : dtype_size(g.dtype);
    LOOM_CUDA(cudaMemcpy2DAsync(g.c, size_t(ldc) * elem, g.c_in, size_t(ldc) * elem, size_t(n) * elem, size_t(m),
                                cudaMemcpyDeviceToDevice, s));
  }
  LOOM_CUBLAS(cublasSetStream(blas.handle, s));
  LOOM_CUBLAS(cublasSetWorkspace(blas.handle, blas.workspace, kWorkspaceBytes));
  LOOM_CUBLAS(cublasSetPointerMode(blas.handle, g.alpha_ptr ? CUBLAS_POINTER_MODE_DEVICE : CUBLAS_POINTER_MODE_HOST));
  if (g.batch == 1) {
    LOOM_CUBLAS(cublasGemmEx(blas.handle, op_b, op_a, n, m, k, alpha, g.b, t.data, ldb, g.a, t.data, lda, beta, g.c,
                             c_type(g, t), ldc, t.compute, CUBLAS_GEMM_DEFAULT));
  } else {
    LOOM_CUBLAS(cublasGemmStridedBatchedEx(blas.handle, op_b, op_a, n, m, k, alpha, g.b, t.data, ldb, g.stride_b,
                                           g.a, t.data, lda, g.stride_a, beta, g.c, t.data, ldc, g.stride_c,
                                           int(g.batch), t.compute, CUBLAS_GEMM_DEFAULT));
  }
  // A product cuBLASLt could not plan (f64, k == 0, batched): every extra in a pass after it.
  gemm_passes::finish(g, gemm_passes::Done{}, blas.workspace, kWorkspaceBytes, s);
}

}  // namespace loom::cuda
