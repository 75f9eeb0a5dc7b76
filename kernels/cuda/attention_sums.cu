// The attention backward's column sums of dq, dk and dv (AttentionArgs::column_sums), for the
// bias gradient of the projection that made q, k and v. The kernels that write a gradient
// add the partial sums of what they store where they can (the Hopper backward's dK and dV,
// dQ's conversion from its accumulator); for the rest a pass here reads the stored gradient
// back, a block per row tile of a head. Then every column's total over the partials, in a
// fixed order: the sums are the same bits from run to run whenever the gradients are.
#include "kernels/cuda/attention.cuh"

namespace loom::cuda::attention {
namespace {

constexpr int kPassThreads = 128;

// Block (bh, tile): operand `which`'s partial sums over rows kSumRows tile.. of head bh, as
// stored in T, a thread a column.
template <class T>
__global__ void __launch_bounds__(kPassThreads) partials_kernel(const Params p, int which, int len, int tiles) {
  using A = acc_t<T>;
  const AttentionStrides& st = which == 0 ? p.strides.dq : which == 1 ? p.strides.dk : p.strides.dv;
  const T* base = static_cast<const T*>(which == 0 ? p.dq : which == 1 ? p.dk : p.dv);
  for (int64_t block = blockIdx.x; block < p.heads * tiles; block += gridDim.x) {
    const int64_t bh = block / tiles;
    const int tile = int(block - bh * tiles), row0 = tile * kSumRows, rows = min(kSumRows, len - row0);
    const T* head = base + p.offset(st, bh) + int64_t(row0) * st.seq;
    A* out = sum_partial<A>(p, bh, tile, which);
    for (int c = threadIdx.x; c < p.head_dim; c += kPassThreads) {
      A sum = 0;
      for (int r = 0; r < rows; ++r) sum += to_acc(head[int64_t(r) * st.seq + c]);
      out[c] = sum;
    }
  }
}

// sums[c] = the sum of partials[r][c] over r < rows, for c < cols: 32 columns a block, each
// column's rows split over kSplit threads by r mod kSplit, then added in order.
constexpr int kSplit = 8;
template <class A>
__global__ void __launch_bounds__(32 * kSplit) totals_kernel(A* sums, const A* partials, int64_t rows, int64_t cols) {
  __shared__ A part[kSplit][32];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  A sum = 0;
  if (c < cols)
    for (int64_t r = threadIdx.y; r < rows; r += kSplit) sum += partials[r * cols + c];
  part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    A total = 0;
#pragma unroll
    for (int y = 0; y < kSplit; ++y) total += part[y][threadIdx.x];
    sums[c] = total;
  }
}

}  // namespace

void column_sums(const Params& p, DType dtype, int missing, void* sums, cudaStream_t stream) {
  dispatch_floating(dtype, "attention column sums", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    for (int which = 0; which < 3; ++which) {
      const int len = which == 0 ? p.q_len : p.kv_len, tiles = int((len + kSumRows - 1) / kSumRows);
      if (!(missing >> which & 1) || len == 0) continue;
      const unsigned blocks = unsigned(std::min<int64_t>(p.heads * tiles, int64_t(1) << 20));
      partials_kernel<T><<<blocks, kPassThreads, 0, stream>>>(p, which, len, tiles);
      LOOM_CUDA_LAUNCH();
    }
    const int64_t rows = (p.heads / p.heads_per_batch) * p.sum_tiles, cols = 3 * int64_t(p.heads_per_batch) * p.head_dim;
    totals_kernel<A><<<unsigned((cols + 31) / 32), dim3(32, kSplit), 0, stream>>>(
        static_cast<A*>(sums), static_cast<const A*>(p.sum_partials), rows, cols);
    LOOM_CUDA_LAUNCH();
  });
}

}  // namespace loom::cuda::attention
