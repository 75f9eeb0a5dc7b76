// Scaled-dot-product attention on CUDA: the table entries, the backward's row
// preprocessing, and the kernels for what the tensor cores do not take.
//
// bf16/f16 with head_dim 32, 64, 80, 96 or 128 and 16-byte-aligned rows (aligned bases,
// strides in multiples of 8 elements) run the flash-attention kernels of attention_mma.cu,
// whose forward an H100 or H200 replaces with attention_wgmma.cu's at head_dim 64 and 128
// (AttentionArgs::hopper).
// Everything else (f32, f64, other head_dims up to 256, unaligned views) runs the "rows"
// kernels here, which take any strides: same algorithm (online softmax
// forward; backward recomputing P from lse, dK/dV per key and dQ per query, no atomics),
// in the accumulation type on CUDA cores. A block of 8 warps gives each warp one row of its
// output (a query, or a key for dK/dV) and streams 32-row tiles of the other side through
// shared memory, where lane l takes tile row l: each lane computes one score as a dot
// product over D (rows padded to D + 1 words, so lanes hit different banks), the warp
// shuffles the scores around, and each lane accumulates D / 32 output columns.
//
// The backward first writes two (heads, q_pad) rows into the workspace: lse2 = lse log2(e)
// (+inf where no key is visible and on padding rows, so exp2(s - lse2) is 0 there) and
// Di = rowsum(dout * out); both backward kernels read them, so neither recomputes them.
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

using attention::Params;

constexpr int kRowWarps = 8;  // output rows of a block, one per warp
constexpr int kRowThreads = 32 * kRowWarps;
constexpr int kTileRows = 32;   // rows of a streamed tile, one per lane
constexpr int kMaxHeadDim = 256;
constexpr double kLog2e = 1.4426950408889634;

template <class A> __device__ __forceinline__ A exp2_acc(A x) {
  if constexpr (std::is_same_v<A, float>) return exp2f(x);
  else return exp2(x);
}
template <class A> __device__ __forceinline__ A log2_acc(A x) {
  if constexpr (std::is_same_v<A, float>) return log2f(x);
  else return log2(x);
}
template <class A> __device__ __forceinline__ A warp_max(A x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
template <class A> __device__ __forceinline__ A warp_sum(A x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// Rows [row0, row0 + rows) of a (len, D) matrix whose rows are `ld` elements apart into
// shared memory with row stride `stride`, converted to the accumulation type; rows past
// len are zeros.
template <class T>
__device__ __forceinline__ void load_rows(acc_t<T>* dst, const T* src, int64_t ld, int row0, int rows, int len,
                                          int D, int stride) {
  for (int e = int(threadIdx.x); e < rows * D; e += kRowThreads) {
    const int r = e / D, d = e - r * D;
    dst[r * stride + d] = row0 + r < len ? to_acc(src[int64_t(row0 + r) * ld + d]) : acc_t<T>(0);
  }
}

// Queries [q0, q0 + kRowWarps) of this block, causal grids running the longest first.
__device__ __forceinline__ int row_block_start(const Params& p) {
  const int blocks = (p.q_len + kRowWarps - 1) / kRowWarps, b = int(blockIdx.x / p.heads);
  return (p.causal ? blocks - 1 - b : b) * kRowWarps;
}
// Keys [0, n) that queries [q0, q0 + kRowWarps) can see.
__device__ __forceinline__ int visible_key_end(const Params& p, int q0) {
  return p.causal ? min(p.kv_len, min(q0 + kRowWarps, p.q_len)) : p.kv_len;
}

// ---- forward ---------------------------------------------------------------------------

template <class T, int kPer> __global__ void __launch_bounds__(kRowThreads) forward_rows_kernel(const Params p) {
  using A = acc_t<T>;
  const int D = p.head_dim, SD = D + 1;
  extern __shared__ __align__(16) unsigned char smem[];
  A* sq = reinterpret_cast<A*>(smem);  // (kRowWarps, D)
  A* sk = sq + kRowWarps * D;          // (kTileRows, SD)
  A* sv = sk + kTileRows * SD;         // (kTileRows, SD)

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
  const int64_t bh = blockIdx.x % p.heads;
  const int q0 = row_block_start(p), i = q0 + warp, kv_end = visible_key_end(p, q0);
  const bool row_ok = i < p.q_len;
  const AttentionLayout& st = p.strides;
  const T* k = static_cast<const T*>(p.k) + p.offset(st.k, bh);
  const T* v = static_cast<const T*>(p.v) + p.offset(st.v, bh);
  const A scale_log2 = A(p.scale_log2);
  load_rows(sq, static_cast<const T*>(p.q) + p.offset(st.q, bh), st.q.seq, q0, kRowWarps, p.q_len, D, D);

  A o[kPer] = {};
  A m = -INFINITY, l = 0;
  for (int j0 = 0; j0 < kv_end; j0 += kTileRows) {
    __syncthreads();  // the previous tile is consumed (and sq written, on the first pass)
    load_rows(sk, k, st.k.seq, j0, kTileRows, p.kv_len, D, SD);
    load_rows(sv, v, st.v.seq, j0, kTileRows, p.kv_len, D, SD);
    __syncthreads();
    if (!row_ok) continue;  // whole warp; it still meets every barrier
    const int j = j0 + lane;
    A s = -INFINITY;
    if (j < p.kv_len && (!p.causal || j <= i)) {
      A dot = 0;
      for (int d = 0; d < D; ++d) dot += sq[warp * D + d] * sk[lane * SD + d];
      s = dot * scale_log2;
    }
    const A m_new = fmax(m, warp_max(s));
    const A base = m_new == -INFINITY ? A(0) : m_new;
    const A alpha = exp2_acc(m - base), pj = exp2_acc(s - base);
    l = l * alpha + warp_sum(pj);
    m = m_new;
#pragma unroll
    for (int e = 0; e < kPer; ++e) o[e] *= alpha;
    const int n = min(kTileRows, kv_end - j0);
    for (int jj = 0; jj < n; ++jj) {
      const A pv = __shfl_sync(0xffffffffu, pj, jj);
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        if (lane + 32 * e < D) o[e] += pv * sv[jj * SD + lane + 32 * e];
    }
  }
  if (!row_ok) return;
  T* out = static_cast<T*>(p.out) + p.offset(st.out, bh) + int64_t(i) * st.out.seq;
  const A inv = l > 0 ? A(1) / l : A(0);
#pragma unroll
  for (int e = 0; e < kPer; ++e)
    if (lane + 32 * e < D) out[lane + 32 * e] = from_acc<T>(o[e] * inv);
  if (lane == 0)
    static_cast<A*>(p.lse)[bh * p.q_len + i] = l > 0 ? (m + log2_acc(l)) / A(kLog2e) : A(-INFINITY);
}

// ---- backward --------------------------------------------------------------------------

// lse2 and Di for every (head, row < q_pad), a warp per row.
template <class T, class A>
__global__ void __launch_bounds__(256)
    backward_prep_kernel(const Params p, const T* out, const A* lse, A* lse2, A* di_out) {
  const int lane = int(threadIdx.x % 32), D = p.head_dim;
  const int64_t rows = p.heads * p.q_pad;
  for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < rows;
       row += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t bh = row / p.q_pad;
    const int i = int(row - bh * p.q_pad);
    A di = 0, l2 = INFINITY;
    if (i < p.q_len) {
      const T* dout = static_cast<const T*>(p.dout) + p.offset(p.strides.dout, bh) + int64_t(i) * p.strides.dout.seq;
      const T* o = out + p.offset(p.strides.out, bh) + int64_t(i) * p.strides.out.seq;
      for (int d = lane; d < D; d += 32) di += to_acc(dout[d]) * to_acc(o[d]);
      di = warp_sum(di);
      const A l = lse[bh * p.q_len + i];
      l2 = l == -INFINITY ? A(INFINITY) : l * A(kLog2e);
    }
    if (lane == 0) {
      lse2[row] = l2;
      di_out[row] = di;
    }
  }
}

// dQ, a warp per query row.
template <class T, int kPer> __global__ void __launch_bounds__(kRowThreads) backward_dq_rows_kernel(const Params p) {
  using A = acc_t<T>;
  const int D = p.head_dim, SD = D + 1;
  extern __shared__ __align__(16) unsigned char smem[];
  A* sq = reinterpret_cast<A*>(smem);  // (kRowWarps, D)
  A* so = sq + kRowWarps * D;          // dO: (kRowWarps, D)
  A* sk = so + kRowWarps * D;          // (kTileRows, SD)
  A* sv = sk + kTileRows * SD;         // (kTileRows, SD)

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
  const int64_t bh = blockIdx.x % p.heads;
  const int q0 = row_block_start(p), i = q0 + warp, kv_end = visible_key_end(p, q0);
  const bool row_ok = i < p.q_len;
  const AttentionLayout& st = p.strides;
  const T* k = static_cast<const T*>(p.k) + p.offset(st.k, bh);
  const T* v = static_cast<const T*>(p.v) + p.offset(st.v, bh);
  const A scale_log2 = A(p.scale_log2);
  load_rows(sq, static_cast<const T*>(p.q) + p.offset(st.q, bh), st.q.seq, q0, kRowWarps, p.q_len, D, D);
  load_rows(so, static_cast<const T*>(p.dout) + p.offset(st.dout, bh), st.dout.seq, q0, kRowWarps, p.q_len, D, D);
  const A l2 = row_ok ? static_cast<const A*>(p.lse2)[bh * p.q_pad + i] : A(0);
  const A di = row_ok ? static_cast<const A*>(p.di)[bh * p.q_pad + i] : A(0);

  A dq[kPer] = {};
  for (int j0 = 0; j0 < kv_end; j0 += kTileRows) {
    __syncthreads();
    load_rows(sk, k, st.k.seq, j0, kTileRows, p.kv_len, D, SD);
    load_rows(sv, v, st.v.seq, j0, kTileRows, p.kv_len, D, SD);
    __syncthreads();
    if (!row_ok) continue;
    const int j = j0 + lane;
    A ds = 0;
    if (j < p.kv_len && (!p.causal || j <= i)) {
      A qk = 0, ov = 0;
      for (int d = 0; d < D; ++d) {
        qk += sq[warp * D + d] * sk[lane * SD + d];
        ov += so[warp * D + d] * sv[lane * SD + d];
      }
      ds = exp2_acc(qk * scale_log2 - l2) * (ov - di);
    }
    const int n = min(kTileRows, kv_end - j0);
    for (int jj = 0; jj < n; ++jj) {
      const A dsj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        if (lane + 32 * e < D) dq[e] += dsj * sk[jj * SD + lane + 32 * e];
    }
  }
  if (!row_ok) return;
  T* out = static_cast<T*>(p.dq) + p.offset(st.dq, bh) + int64_t(i) * st.dq.seq;
  const A scale = A(p.scale);
#pragma unroll
  for (int e = 0; e < kPer; ++e)
    if (lane + 32 * e < D) out[lane + 32 * e] = from_acc<T>(dq[e] * scale);
}

// dK and dV, a warp per key row.
template <class T, int kPer> __global__ void __launch_bounds__(kRowThreads) backward_dkdv_rows_kernel(const Params p) {
  using A = acc_t<T>;
  const int D = p.head_dim, SD = D + 1;
  extern __shared__ __align__(16) unsigned char smem[];
  A* sk = reinterpret_cast<A*>(smem);  // (kRowWarps, D)
  A* sv = sk + kRowWarps * D;          // (kRowWarps, D)
  A* sq = sv + kRowWarps * D;          // (kTileRows, SD)
  A* so = sq + kTileRows * SD;         // dO: (kTileRows, SD)
  A* sl = so + kTileRows * SD;         // lse2: (kTileRows)
  A* sd = sl + kTileRows;              // Di: (kTileRows)

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
  const int64_t bh = blockIdx.x % p.heads;
  const int k0 = int(blockIdx.x / p.heads) * kRowWarps, j = k0 + warp;
  const bool key_ok = j < p.kv_len;
  const AttentionLayout& st = p.strides;
  const T* q = static_cast<const T*>(p.q) + p.offset(st.q, bh);
  const T* dout = static_cast<const T*>(p.dout) + p.offset(st.dout, bh);
  const A* lse2 = static_cast<const A*>(p.lse2) + bh * p.q_pad;
  const A* di = static_cast<const A*>(p.di) + bh * p.q_pad;
  const A scale_log2 = A(p.scale_log2);
  load_rows(sk, static_cast<const T*>(p.k) + p.offset(st.k, bh), st.k.seq, k0, kRowWarps, p.kv_len, D, D);
  load_rows(sv, static_cast<const T*>(p.v) + p.offset(st.v, bh), st.v.seq, k0, kRowWarps, p.kv_len, D, D);

  A dk[kPer] = {}, dv[kPer] = {};
  // Causal: queries before k0 see none of these keys.
  for (int i0 = p.causal ? k0 / kTileRows * kTileRows : 0; i0 < p.q_len; i0 += kTileRows) {
    __syncthreads();
    load_rows(sq, q, st.q.seq, i0, kTileRows, p.q_len, D, SD);
    load_rows(so, dout, st.dout.seq, i0, kTileRows, p.q_len, D, SD);
    if (threadIdx.x < kTileRows) {
      const int i = i0 + int(threadIdx.x);
      sl[threadIdx.x] = i < p.q_len ? lse2[i] : A(INFINITY);
      sd[threadIdx.x] = i < p.q_len ? di[i] : A(0);
    }
    __syncthreads();
    if (!key_ok) continue;
    const int i = i0 + lane;
    A pij = 0, ds = 0;
    if (i < p.q_len && (!p.causal || i >= j)) {
      A qk = 0, ov = 0;
      for (int d = 0; d < D; ++d) {
        qk += sq[lane * SD + d] * sk[warp * D + d];
        ov += so[lane * SD + d] * sv[warp * D + d];
      }
      pij = exp2_acc(qk * scale_log2 - sl[lane]);
      ds = pij * (ov - sd[lane]);
    }
    const int n = min(kTileRows, p.q_len - i0);
    for (int ii = 0; ii < n; ++ii) {
      const A pi = __shfl_sync(0xffffffffu, pij, ii), dsi = __shfl_sync(0xffffffffu, ds, ii);
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        if (lane + 32 * e < D) {
          dv[e] += pi * so[ii * SD + lane + 32 * e];
          dk[e] += dsi * sq[ii * SD + lane + 32 * e];
        }
    }
  }
  if (!key_ok) return;
  T* dk_row = static_cast<T*>(p.dk) + p.offset(st.dk, bh) + int64_t(j) * st.dk.seq;
  T* dv_row = static_cast<T*>(p.dv) + p.offset(st.dv, bh) + int64_t(j) * st.dv.seq;
  const A scale = A(p.scale);
#pragma unroll
  for (int e = 0; e < kPer; ++e)
    if (lane + 32 * e < D) {
      dk_row[lane + 32 * e] = from_acc<T>(dk[e] * scale);
      dv_row[lane + 32 * e] = from_acc<T>(dv[e]);
    }
}

// ---- launch ----------------------------------------------------------------------------

Params make_params(const AttentionArgs& a) {
  LOOM_CHECK(a.head_dim >= 1 && a.head_dim <= kMaxHeadDim, "attention on CUDA supports head_dim 1 to ", kMaxHeadDim,
             ", got ", a.head_dim);
  LOOM_CHECK(a.q_len < (int64_t(1) << 30) && a.kv_len < (int64_t(1) << 30), "attention on CUDA: sequence lengths ",
             a.q_len, " and ", a.kv_len, " are too long (at most 2^30 - 1)");
  LOOM_CHECK(a.batch * a.heads < (int64_t(1) << 31), "attention on CUDA: batch * heads = ", a.batch * a.heads,
             " is too many (at most 2^31 - 1): split the batch");
  Params p;
  p.heads = a.batch * a.heads;
  p.heads_per_batch = int(a.heads);
  const AttentionLayout& s = a.strides;
  const int64_t H = a.heads, Tq = a.q_len, Tk = a.kv_len, D = a.head_dim;
  p.strides = {s.q.resolve(H, Tq, D),    s.k.resolve(H, Tk, D),  s.v.resolve(H, Tk, D),  s.out.resolve(H, Tq, D),
               s.dout.resolve(H, Tq, D), s.dq.resolve(H, Tq, D), s.dk.resolve(H, Tk, D), s.dv.resolve(H, Tk, D)};
  p.q_len = int(a.q_len);
  p.kv_len = int(a.kv_len);
  p.q_pad = int((a.q_len + attention::kRowPad - 1) / attention::kRowPad * attention::kRowPad);
  p.head_dim = int(a.head_dim);
  p.causal = a.causal;
  p.scale = a.scale;
  p.scale_log2 = a.scale * kLog2e;
  return p;
}

bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* ptr : ptrs)
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  return true;
}

// True when the tensor-core kernels can address these operands: every row starts a multiple
// of 16 bytes past its base (strides are multiples of 8 elements of the 2-byte dtypes), and
// row offsets inside a 64-row tile fit in an int (0 <= seq stride < 2^24). The stride of a
// size-1 axis only ever multiplies 0, so it may be anything.
bool mma_layout(const Params& p, std::initializer_list<std::pair<AttentionStrides, int>> operands) {
  auto ok = [](int64_t stride, int64_t extent) { return extent == 1 || stride % 8 == 0; };
  const int64_t batch = p.heads / p.heads_per_batch;
  for (const auto& [s, len] : operands)
    if (!ok(s.batch, batch) || !ok(s.head, p.heads_per_batch) || !ok(s.seq, len) || s.seq < 0 ||
        s.seq >= (int64_t(1) << 24))
      return false;
  return true;
}

size_t acc_size(DType dtype) { return dtype == DType::f64 ? 8 : 4; }

// Calls f(integral_constant<int, kPer>) with kPer * 32 >= head_dim.
template <class F> void with_per_lane(int head_dim, F&& f) {
  if (head_dim <= 64) f(std::integral_constant<int, 2>{});
  else if (head_dim <= 128) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

template <class Kernel>
void launch_rows(Kernel kernel, int64_t blocks, size_t smem, const char* what, const Params& p, cudaStream_t stream) {
  if (blocks == 0) return;
  LOOM_CHECK(blocks < (int64_t(1) << 31), "attention: ", blocks, " thread blocks exceed CUDA's grid limit; ",
             "split the batch");
  attention::allow_shared_memory(kernel, smem, what);
  kernel<<<unsigned(blocks), kRowThreads, smem, stream>>>(p);
  LOOM_CUDA_LAUNCH();
}

int64_t row_blocks(int64_t len) { return (len + kRowWarps - 1) / kRowWarps; }

// The rows kernels' backward: lse2 and Di into the workspace's first two rows, then dK/dV
// and dQ.
void rows_backward(const Params& p, DType dtype, const void* out, const void* lse, void* workspace, size_t rows,
                   cudaStream_t s) {
  dispatch_floating(dtype, "attention backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    if (rows > 0) {
      const unsigned blocks = blocks_for(int64_t(rows), 256 / 32);
      backward_prep_kernel<T, A><<<blocks, 256, 0, s>>>(p, static_cast<const T*>(out), static_cast<const A*>(lse),
                                                        static_cast<A*>(workspace), static_cast<A*>(workspace) + rows);
      LOOM_CUDA_LAUNCH();
    }
    const int D = p.head_dim;
    const size_t dkdv_smem = size_t(2 * kRowWarps * D + 2 * kTileRows * (D + 1) + 2 * kTileRows) * sizeof(A);
    const size_t dq_smem = size_t(2 * kRowWarps * D + 2 * kTileRows * (D + 1)) * sizeof(A);
    with_per_lane(D, [&](auto per) {
      constexpr int kPer = decltype(per)::value;
      launch_rows(backward_dkdv_rows_kernel<T, kPer>, p.heads * row_blocks(p.kv_len), dkdv_smem, "backward dk/dv",
                  p, s);
      launch_rows(backward_dq_rows_kernel<T, kPer>, p.heads * row_blocks(p.q_len), dq_smem, "backward dq", p, s);
    });
  });
}

// Row tiles a batch in the column sums' partials (Params::sum_tiles).
int64_t sum_tiles(const AttentionArgs& a) {
  return (std::max(a.q_len, a.kv_len) + attention::kSumRows - 1) / attention::kSumRows;
}

// Bytes of the column sums' partials at the workspace's end (0 without column_sums).
size_t sum_partials_size(const AttentionArgs& a) {
  if (!a.column_sums) return 0;
  return size_t(a.batch * sum_tiles(a) * 3 * a.heads * a.head_dim) * acc_size(a.dtype);
}

}  // namespace

size_t attention_workspace_size(const AttentionArgs& args) {
  const int64_t q_pad = (args.q_len + attention::kRowPad - 1) / attention::kRowPad * attention::kRowPad;
  const size_t rows = size_t(args.batch * args.heads * q_pad);
  // The tensor-core backward's f32 dQ accumulator, after lse2 and Di.
  const size_t dq_acc = attention::dq_by_atomics(args) ? rows * args.head_dim * 4 : 0;
  return 2 * rows * acc_size(args.dtype) + dq_acc + sum_partials_size(args);
}

void attention_forward(const AttentionArgs& args, void* out, void* lse, const void* q, const void* k, const void* v,
                       StreamHandle stream) {
  if (args.batch * args.heads * args.q_len == 0) return;
  Params p = make_params(args);
  p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse;
  cudaStream_t s = as_cuda(stream);
  const AttentionLayout& st = p.strides;
  if (attention::mma_supported(args.dtype, args.head_dim) && aligned16({q, k, v, out}) &&
      mma_layout(p, {{st.q, p.q_len}, {st.k, p.kv_len}, {st.v, p.kv_len}, {st.out, p.q_len}})) {
    if (args.hopper && attention::wgmma_supported(args.dtype, args.head_dim))
      attention::wgmma_forward(p, args.dtype, s);
    else
      attention::mma_forward(p, args.dtype, s);
    return;
  }
  dispatch_floating(args.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    const size_t smem = size_t(kRowWarps * p.head_dim + 2 * kTileRows * (p.head_dim + 1)) * sizeof(acc_t<T>);
    with_per_lane(p.head_dim, [&](auto per) {
      launch_rows(forward_rows_kernel<T, decltype(per)::value>, p.heads * row_blocks(p.q_len), smem, "forward", p, s);
    });
  });
}

void attention_backward(const AttentionArgs& args, void* dq, void* dk, void* dv, const void* dout, const void* q,
                        const void* k, const void* v, const void* out, const void* lse, void* workspace,
                        StreamHandle stream) {
  if (args.batch * args.heads == 0) {
    if (args.column_sums)
      LOOM_CUDA(cudaMemsetAsync(args.column_sums, 0, size_t(3 * args.heads * args.head_dim) * acc_size(args.dtype),
                                as_cuda(stream)));
    return;
  }
  Params p = make_params(args);
  p.q = q, p.k = k, p.v = v, p.dout = dout, p.dq = dq, p.dk = dk, p.dv = dv;
  const size_t rows = size_t(p.heads) * size_t(p.q_pad);
  LOOM_ASSERT(rows == 0 || workspace != nullptr, "attention backward needs a workspace of ",
              attention_workspace_size(args), " bytes");
  p.lse2 = workspace;
  p.di = static_cast<char*>(workspace) + rows * acc_size(args.dtype);
  const bool atomics = attention::dq_by_atomics(args);
  char* next = static_cast<char*>(workspace) + 2 * rows * acc_size(args.dtype);
  if (atomics) {
    p.dq_acc = reinterpret_cast<float*>(next);
    next += rows * size_t(p.head_dim) * sizeof(float);
  }
  cudaStream_t s = as_cuda(stream);
  if (args.column_sums) {
    LOOM_ASSERT(workspace != nullptr, "attention backward's column sums need a workspace of ",
                attention_workspace_size(args), " bytes");
    p.sum_partials = next;
    p.sum_tiles = int(sum_tiles(args));
    LOOM_CUDA(cudaMemsetAsync(next, 0, sum_partials_size(args), s));
  }
  const AttentionLayout& st = p.strides;
  int summed = 0;  // the operands whose partial sums the kernels wrote
  if (attention::mma_supported(args.dtype, args.head_dim) &&
      aligned16({q, k, v, out, dout, dq, dk, dv, workspace}) &&
      mma_layout(p, {{st.q, p.q_len}, {st.k, p.kv_len}, {st.v, p.kv_len}, {st.out, p.q_len}, {st.dout, p.q_len},
                     {st.dq, p.q_len}, {st.dk, p.kv_len}, {st.dv, p.kv_len}})) {
    summed = attention::mma_backward(p, out, lse, args.dtype, atomics, args.hopper, s);
  } else {
    rows_backward(p, args.dtype, out, lse, workspace, rows, s);
  }
  if (args.column_sums) attention::column_sums(p, args.dtype, 7 & ~summed, args.column_sums, s);
}

}  // namespace loom::cuda
