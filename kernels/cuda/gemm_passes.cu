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
// Adjacent outputs (step_i == 1, the column sums of a row-major matrix, as every bias
// gradient) in two passes: a block sums a chunk of kSumRows values of p for its adjacent
// outputs (8 warps, every 8th p each) into a row of partial sums in the cuBLAS workspace,
// then a block per 32 outputs adds their partial rows (8 warps, every 8th row each).
// Deterministic, and enough blocks to fill the GPU for (16k, 768) as for (16k, 50k). When
// rows are whole 16-byte packs, a thread reads kVecCols adjacent values at once (a block
// covers 256 outputs), else one (a block covers 32). Else a warp per output, its lanes
// striding p (coalesced when step_p == 1).
constexpr int kSumCols = 32, kSumWarps = 8, kVecCols = 8;
constexpr int64_t kSumRows = 128;

template <class T, int V> __global__ void __launch_bounds__(kSumCols * kSumWarps)
    partial_sums_kernel(acc_t<T>* partial, const T* x, int64_t count, int64_t len, int64_t step_p) {
  using A = acc_t<T>;
  __shared__ A part[kSumWarps][kSumCols * V];
  const int lane = threadIdx.x % kSumCols, warp = threadIdx.x / kSumCols;
  const int64_t i0 = (int64_t(blockIdx.x) * kSumCols + lane) * V, p0 = int64_t(blockIdx.y) * kSumRows;
  const int64_t p1 = p0 + kSumRows < len ? p0 + kSumRows : len;
  A s[V] = {};
  if (i0 < count)
    for (int64_t p = p0 + warp; p < p1; p += kSumWarps) {
      const Pack<T, V> v = load<T, V>(x + i0 + p * step_p);
#pragma unroll
      for (int j = 0; j < V; ++j) s[j] += to_acc(v.v[j]);
    }
#pragma unroll
  for (int j = 0; j < V; ++j) part[warp][lane * V + j] = s[j];
  __syncthreads();
  // Thread k adds the warps' sums of the tile's output k, in warp order.
  for (int k = threadIdx.x; k < kSumCols * V; k += kSumCols * kSumWarps) {
    const int64_t i = int64_t(blockIdx.x) * kSumCols * V + k;
    if (i >= count) break;
    A t = part[0][k];
    for (int w = 1; w < kSumWarps; ++w) t += part[w][k];
    partial[int64_t(blockIdx.y) * count + i] = t;
  }
}

template <class T, class O> __global__ void __launch_bounds__(kSumCols * kSumWarps)
    add_partials_kernel(O* out, const acc_t<T>* partial, int64_t count, int chunks) {
  using A = acc_t<T>;
  __shared__ A part[kSumWarps][kSumCols];
  const int lane = threadIdx.x % kSumCols, warp = threadIdx.x / kSumCols;
  const int64_t i = int64_t(blockIdx.x) * kSumCols + lane;
  A s = 0;
  if (i < count)
    for (int c = warp; c < chunks; c += kSumWarps) s += partial[c * count + i];
  part[warp][lane] = s;
  __syncthreads();
  if (warp != 0 || i >= count) return;
  for (int w = 1; w < kSumWarps; ++w) s += part[w][lane];
  out[i] = from_acc<O>(s);
}

template <class T, class O> __global__ void sums_warp_kernel(O* out, const T* x, int64_t count, int64_t len,
                                                             int64_t step_i, int64_t step_p) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; i < count;
       i += int64_t(gridDim.x) * blockDim.x / 32) {
    A s = 0;
    for (int64_t p = lane; p < len; p += 32) s += to_acc(x[i * step_i + p * step_p]);
    for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
    if (lane == 0) out[i] = from_acc<O>(s);
  }
}

// The sums in the accumulation type, stored as O (T, or f32 beside an f32 C).
template <class T, class O> void sums(O* out, const T* x, int64_t count, int64_t len, int64_t step_i, int64_t step_p,
                                      void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  using A = acc_t<T>;
  const int64_t chunks = std::min<int64_t>((len + kSumRows - 1) / kSumRows,
                                           int64_t(workspace_bytes / sizeof(A)) / std::max<int64_t>(count, 1));
  // A chunk past the last would be needed to cover what the workspace could not split.
  if (step_i == 1 && step_p != 1 && chunks >= 1 && chunks < 65536 && chunks * kSumRows >= len) {
    auto* partial = static_cast<A*>(workspace);
    const bool packed = count % kVecCols == 0 && step_p % kVecCols == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const int64_t per_block = kSumCols * (packed ? kVecCols : 1);
    const dim3 grid(unsigned((count + per_block - 1) / per_block), unsigned(chunks));
    if (packed) partial_sums_kernel<T, kVecCols><<<grid, kSumCols * kSumWarps, 0, stream>>>(partial, x, count, len, step_p);
    else partial_sums_kernel<T, 1><<<grid, kSumCols * kSumWarps, 0, stream>>>(partial, x, count, len, step_p);
    LOOM_CUDA_LAUNCH();
    add_partials_kernel<T, O><<<unsigned((count + kSumCols - 1) / kSumCols), kSumCols * kSumWarps, 0, stream>>>(
        out, partial, count, int(chunks));
    LOOM_CUDA_LAUNCH();
    return;
  }
  sums_warp_kernel<T, O><<<blocks_for(count, 256 / 32), 256, 0, stream>>>(out, x, count, len, step_i, step_p);
  LOOM_CUDA_LAUNCH();
}

// The row sums of op(A) over k, stored as O.
template <class T, class O> void row_sums(const GemmArgs& g, void* workspace, size_t workspace_bytes,
                                          cudaStream_t stream) {
  const int64_t a_rs = g.trans_a ? 1 : g.lda, a_cs = g.trans_a ? g.lda : 1;
  sums(static_cast<O*>(g.row_sums_a), static_cast<const T*>(g.a), g.m, g.k, a_rs, a_cs, workspace, workspace_bytes,
       stream);
}

}  // namespace

void finish(const GemmArgs& g, Done done, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (g.c_f32) {  // no epilogue or column sums (check_gemm_extras): the bias and row sums, in f32
    if (g.bias && !done.bias) {
      finish_kernel<<<blocks_for(g.m * g.n, 256), 256, 0, stream>>>(
          static_cast<float*>(g.c), g.ldc, static_cast<const float*>(g.bias), static_cast<float*>(nullptr), 0,
          GemmEpilogue::none, g.m, g.n);
      LOOM_CUDA_LAUNCH();
    }
    if (g.row_sums_a) {
      if (g.dtype == DType::bf16) row_sums<__nv_bfloat16, float>(g, workspace, workspace_bytes, stream);
      else row_sums<__half, float>(g, workspace, workspace_bytes, stream);
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
    if (g.column_sums)
      sums(static_cast<T*>(g.column_sums), static_cast<const T*>(g.c), g.n, g.m, 1, g.ldc, workspace, workspace_bytes, stream);
    if (g.row_sums_a) row_sums<T, T>(g, workspace, workspace_bytes, stream);
  });
}

}  // namespace loom::cuda::gemm_passes
