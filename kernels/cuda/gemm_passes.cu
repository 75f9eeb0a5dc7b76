// The passes beside a matrix product: kernels/cuda/gemm_passes.cuh.
#include "kernels/cuda/gemm_passes.cuh"

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise_ops.cuh"

namespace loom::cuda::gemm_passes {
namespace {

// C += bias, then the gelu or dgelu epilogue, in place.
template <class T>
__global__ void finish_kernel(T* c, int64_t ldc, const T* bias, T* aux, int64_t ld_aux, GemmEpilogue epilogue,
                              int64_t rows, int64_t n) {
  using A = acc_t<T>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / n, j = i - r * n;
    A v = to_acc(c[r * ldc + j]);
    if (bias) v += to_acc(bias[j]);
    if (epilogue == GemmEpilogue::gelu) {
      aux[r * ld_aux + j] = from_acc<T>(v);
      v = elementwise::unary_float<UnaryOp::gelu, A>(v, A(0));
    } else if (epilogue == GemmEpilogue::dgelu) {
      v = elementwise::unary_grad<UnaryOp::gelu, A>(v, to_acc(aux[r * ld_aux + j]), A(0), A(0));
    }
    c[r * ldc + j] = from_acc<T>(v);
  }
}

// out[i] = sum over p < len of x[i * step_i + p * step_p], in the accumulation type.
// Adjacent outputs (step_i == 1, the column sums of a row-major matrix) in two passes: a
// block sums kSumRows values of p for 32 adjacent outputs (8 warps, every 8th p each) into
// a row of partial sums in the cuBLAS workspace, then a thread per output adds its partial
// sums in order. Deterministic, and enough blocks to fill the GPU for (16k, 768) as for
// (16k, 50k). Else a warp per output, its lanes striding p (coalesced when step_p == 1).
constexpr int kSumCols = 32, kSumWarps = 8;
constexpr int64_t kSumRows = 256;

template <class T> __global__ void __launch_bounds__(kSumCols * kSumWarps)
    partial_sums_kernel(acc_t<T>* partial, const T* x, int64_t count, int64_t len, int64_t step_p) {
  using A = acc_t<T>;
  __shared__ A part[kSumWarps][kSumCols];
  const int lane = threadIdx.x % kSumCols, warp = threadIdx.x / kSumCols;
  const int64_t i = int64_t(blockIdx.x) * kSumCols + lane, p0 = int64_t(blockIdx.y) * kSumRows;
  const int64_t p1 = p0 + kSumRows < len ? p0 + kSumRows : len;
  A s = 0;
  if (i < count)
    for (int64_t p = p0 + warp; p < p1; p += kSumWarps) s += to_acc(x[i + p * step_p]);
  part[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && i < count) {
    for (int w = 1; w < kSumWarps; ++w) s += part[w][lane];
    partial[int64_t(blockIdx.y) * count + i] = s;
  }
}

template <class T> __global__ void add_partials_kernel(T* out, const acc_t<T>* partial, int64_t count, int chunks) {
  using A = acc_t<T>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    A s = 0;
    for (int c = 0; c < chunks; ++c) s += partial[c * count + i];
    out[i] = from_acc<T>(s);
  }
}

template <class T> __global__ void sums_warp_kernel(T* out, const T* x, int64_t count, int64_t len, int64_t step_i,
                                                    int64_t step_p) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; i < count;
       i += int64_t(gridDim.x) * blockDim.x / 32) {
    A s = 0;
    for (int64_t p = lane; p < len; p += 32) s += to_acc(x[i * step_i + p * step_p]);
    for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
    if (lane == 0) out[i] = from_acc<T>(s);
  }
}

template <class T> void sums(T* out, const T* x, int64_t count, int64_t len, int64_t step_i, int64_t step_p,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  using A = acc_t<T>;
  const int64_t chunks = std::min<int64_t>((len + kSumRows - 1) / kSumRows,
                                           int64_t(workspace_bytes / sizeof(A)) / std::max<int64_t>(count, 1));
  if (step_i == 1 && step_p != 1 && chunks >= 1 && chunks < 65536) {
    auto* partial = static_cast<A*>(workspace);
    const dim3 grid(unsigned((count + kSumCols - 1) / kSumCols), unsigned(chunks));
    // A chunk past the last covers what the workspace could not split.
    const int64_t covered = chunks * kSumRows;
    if (covered >= len) {
      partial_sums_kernel<<<grid, kSumCols * kSumWarps, 0, stream>>>(partial, x, count, len, step_p);
      LOOM_CUDA_LAUNCH();
      add_partials_kernel<<<blocks_for(count, 256), 256, 0, stream>>>(out, partial, count, int(chunks));
      LOOM_CUDA_LAUNCH();
      return;
    }
  }
  sums_warp_kernel<<<blocks_for(count, 256 / 32), 256, 0, stream>>>(out, x, count, len, step_i, step_p);
  LOOM_CUDA_LAUNCH();
}

}  // namespace

void finish(const GemmArgs& g, Done done, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (g.c_f32) {  // no epilogue or sums (check_gemm_extras): at most the bias, in f32
    if (g.bias && !done.bias) {
      finish_kernel<<<blocks_for(g.m * g.n, 256), 256, 0, stream>>>(
          static_cast<float*>(g.c), g.ldc, static_cast<const float*>(g.bias), static_cast<float*>(nullptr), 0,
          GemmEpilogue::none, g.m, g.n);
      LOOM_CUDA_LAUNCH();
    }
    return;
  }
  dispatch_floating(g.dtype, "gemm epilogue", [&](auto tag) {
    using T = decltype(tag);
    const T* bias = done.bias ? nullptr : static_cast<const T*>(g.bias);
    const GemmEpilogue epilogue = done.epilogue ? GemmEpilogue::none : g.epilogue;
    if (bias || epilogue != GemmEpilogue::none) {
      finish_kernel<<<blocks_for(g.m * g.n, 256), 256, 0, stream>>>(static_cast<T*>(g.c), g.ldc, bias,
                                                                     static_cast<T*>(g.aux), g.ld_aux, epilogue, g.m, g.n);
      LOOM_CUDA_LAUNCH();
    }
    if (g.column_sums && !done.column_sums)
      sums(static_cast<T*>(g.column_sums), static_cast<const T*>(g.c), g.n, g.m, 1, g.ldc, workspace, workspace_bytes, stream);
    if (g.row_sums_a && !done.row_sums_a) {
      const int64_t a_rs = g.trans_a ? 1 : g.lda, a_cs = g.trans_a ? g.lda : 1;
      sums(static_cast<T*>(g.row_sums_a), static_cast<const T*>(g.a), g.m, g.k, a_rs, a_cs, workspace, workspace_bytes, stream);
    }
  });
}

}  // namespace loom::cuda::gemm_passes
