// CUDA layer normalisation over the rows of a contiguous (rows, dim) buffer.
//
// The shape that matters is GPT-2's: 16384 rows of 768 values, bf16 or f32. There a warp
// owns a row (kWarps rows in flight per block, grid-stride over rows): each lane loads its
// share of the row as 8-value vectors (one 16-byte access of bf16/f16, two of f32) into
// registers, the mean and then the centred variance are warp sums over those registers
// (two passes, so a large mean does not cancel the variance), and y is written from the same
// registers: x is read from memory once. Each block first copies weight and bias into
// shared memory in the accumulation type, whatever their dtype (absent ones as 1 and 0), so
// the row loop neither converts nor tests them.
//
// The backward's warp kernel likewise holds a row of x and dy in registers, takes the two
// row sums of the formula, writes dx (and, when asked, dx rounded to 16 bits for the
// autocast product that reads it), and adds dy * xhat and dy (and, when asked, dx as
// stored: LayerNormArgs::dx_sums) into per-lane column accumulators: a lane owns the same
// columns in every row it visits. At the end the block
// adds its warps' accumulators in warp order in shared memory and writes one partial row
// per block into the caller's scratch; a second kernel sums each column's partials in a
// fixed order. No atomics: results are bitwise reproducible run to run (the number of
// partials follows the SM count, so they may differ between GPU models).
//
// Other shapes take general paths. Rows that are not a whole number of vectors, or buffers
// that are not 16-byte aligned, are read one value per lane (in the warp kernels up to 128
// values per row; f64 always). Rows too long for a warp's registers get a block per row that
// re-reads the row for each pass (from L1/L2), and the backward's column sums then come
// from a column kernel writing the same partial rows after dx is stored.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/core/layer_norm_check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/reduce_common.cuh"

namespace loom::cuda {
namespace {

constexpr int kWarps = 8;  // rows in flight per block in the warp kernels
constexpr int kThreads = 32 * kWarps;
constexpr int kVec = 8;                  // values per vector on the vectorised paths
constexpr int kMaxPerLane = 4;           // vectors (or single values) a lane holds: rows up to 1024 (128)
constexpr int kForwardBlocksPerSm = 4;   // grid of the grid-stride forward kernels
constexpr int kBackwardBlocksPerSm = 2;  // grid of the backward warp kernel: one partial row per block

// The backward's partial rows, in order: dweight's sums, dbias's, and dx's when asked.
constexpr int kParamRows = 2, kSumRows = 3;
constexpr size_t kDefaultSharedBytes = 48 << 10;  // dynamic shared memory a launch gets unasked


template <class A> struct Pair {
  A a, b;
};

// The value of a dx element as stored: rounded to O when the rounded copy is written.
template <class O, class A> __device__ __forceinline__ A as_stored(A v, bool rounded) {
  return rounded ? to_acc(from_acc<O>(v)) : v;
}

struct Add {
  template <class A> __device__ __forceinline__ A operator()(A x, A y) const { return x + y; }
  template <class A> __device__ __forceinline__ Pair<A> operator()(Pair<A> x, Pair<A> y) const {
    return {x.a + y.a, x.b + y.b};
  }
};

__device__ __forceinline__ float inv_sqrt(float v) { return rsqrtf(v); }
__device__ __forceinline__ double inv_sqrt(double v) { return 1.0 / sqrt(v); }

// weight and bias as the kernels take them: either may be null; `dtype` is any floating one.
struct ParamRefs {
  const void* weight;
  const void* bias;
  DType dtype;
};

// Element i of a parameter vector in the accumulation type.
template <class A> __device__ __forceinline__ A param_at(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::f32: return A(static_cast<const float*>(p)[i]);
    case DType::f64: return A(static_cast<const double*>(p)[i]);
    case DType::bf16: return A(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]));
    default: return A(__half2float(static_cast<const __half*>(p)[i]));
  }
}

template <class A> __device__ __forceinline__ void param_store(void* p, DType dtype, int64_t i, A v) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(p)[i] = float(v); break;
    case DType::f64: static_cast<double*>(p)[i] = double(v); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(float(v)); break;
    default: static_cast<__half*>(p)[i] = __float2half(float(v)); break;
  }
}

// Copies weight (and bias, when s_b is not null) into shared memory: 1 and 0 where absent.
template <class A> __device__ void stage_params(A* s_w, A* s_b, const ParamRefs& p, int dim) {
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    s_w[i] = p.weight ? param_at<A>(p.weight, p.dtype, i) : A(1);
    if (s_b) s_b[i] = p.bias ? param_at<A>(p.bias, p.dtype, i) : A(0);
  }
  __syncthreads();
}

// ---- warp per row, the row in registers ------------------------------------------------
// Lane l holds vectors l, l + 32, ..., kPer of them; those at or past nv = dim / V are unused.

// Per row: y = (x - mean) * rstd * weight + bias; mean and rstd written. Shared memory: the
// staged weight and bias, (2, dim) in the accumulation type.
template <class T, class O, int V, int kPer>
__global__ void __launch_bounds__(kThreads)
    forward_warp_kernel(O* __restrict__ y, acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                        const T* __restrict__ x, ParamRefs p, int64_t rows, int dim, acc_t<T> eps) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  A* s_w = reinterpret_cast<A*>(smem);  // (dim)
  A* s_b = s_w + dim;                   // (dim)
  stage_params(s_w, s_b, p, dim);
  const int lane = threadIdx.x % 32, nv = dim / V;
  const A inv_dim = A(1) / A(dim);
  for (int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; r < rows; r += int64_t(gridDim.x) * kWarps) {
    const T* xr = x + r * dim;
    Pack<T, V> v[kPer] = {};
    A sum = A(0);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int vec = lane + 32 * k;
      if (vec >= nv) continue;
      v[k] = load<T, V>(xr + vec * V);
#pragma unroll
      for (int j = 0; j < V; ++j) sum += to_acc(v[k].v[j]);
    }
    const A mu = group_reduce<32>(sum, Add{}) * inv_dim;
    A sq = A(0);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (lane + 32 * k >= nv) continue;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const A d = to_acc(v[k].v[j]) - mu;
        sq += d * d;
      }
    }
    const A rs = inv_sqrt(group_reduce<32>(sq, Add{}) * inv_dim + eps);
    if (lane == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    O* yr = y + r * dim;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int vec = lane + 32 * k;
      if (vec >= nv) continue;
      const Pack<A, V> w = load<A, V>(s_w + vec * V), b = load<A, V>(s_b + vec * V);
      Pack<O, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) out.v[j] = from_acc<O>((to_acc(v[k].v[j]) - mu) * rs * w.v[j] + b.v[j]);
      store<O, V>(yr + vec * V, out);
    }
  }
}

// Stores dx's vector and, when `rounded` is not null, the same values rounded to O there
// (LayerNormArgs::dx_rounded: f32 dx beside a 16-bit dy).
template <class T, class O, int V>
__device__ __forceinline__ void store_dx(T* dx, O* rounded, int64_t at, const Pack<T, V>& out) {
  store<T, V>(dx + at, out);
  if (!rounded) return;
  Pack<O, V> low;
#pragma unroll
  for (int j = 0; j < V; ++j) low.v[j] = from_acc<O>(to_acc(out.v[j]));
  store<O, V>(rounded + at, low);
}

// Per row: dx (when not null) from the two row sums; the block's sums of dy * xhat and dy per
// column, and with kSums of dx as stored, go to partials[blockIdx.x] (2 or 3 rows of dim)
// when partials is not null. Shared memory, in the accumulation type: the staged weight
// (dim), the block's column sums (2 or 3, dim), and with kSums each warp's sums of dx
// (kWarps, dim), which registers have no room for beside the other two at two blocks an SM.
// Four vectors a lane need more registers than two blocks an SM leave (rows of 1024 would
// spill): that instantiation runs one block an SM, its grid in two waves.
template <class T, class O, int V, int kPer, bool kSums>
__global__ void __launch_bounds__(kThreads, kPer < kMaxPerLane ? kBackwardBlocksPerSm : 1)
    backward_warp_kernel(T* __restrict__ dx, const T* __restrict__ dx_add, O* __restrict__ dx_rounded,
                         acc_t<T>* __restrict__ partials,
                         const O* __restrict__ dy, const T* __restrict__ x, const acc_t<T>* __restrict__ mean,
                         const acc_t<T>* __restrict__ rstd, ParamRefs p, int64_t rows, int dim) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  A* s_w = reinterpret_cast<A*>(smem);  // (dim)
  constexpr int kRows = kSums ? kSumRows : kParamRows;
  A* s_sum = s_w + dim;                 // (kRows, dim): dweight, dbias, dx
  A* s_dx = s_sum + kRows * dim;        // (kWarps, dim) with kSums
  if constexpr (kSums) {
    for (int i = threadIdx.x; i < kWarps * dim; i += kThreads) s_dx[i] = A(0);
  }
  stage_params<A>(s_w, nullptr, p, dim);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nv = dim / V;
  const A inv_dim = A(1) / A(dim);
  A sums_of[kParamRows][kPer][V];  // this lane's columns, summed over the warp's rows
#pragma unroll
  for (int i = 0; i < kParamRows; ++i) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) sums_of[i][k][j] = A(0);
    }
  }
  for (int64_t r = int64_t(blockIdx.x) * kWarps + warp; r < rows; r += int64_t(gridDim.x) * kWarps) {
    Pack<T, V> xv[kPer];
    Pack<O, V> gv[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int vec = lane + 32 * k;
      if (vec >= nv) continue;
      xv[k] = load<T, V>(x + r * dim + vec * V);
      gv[k] = load<O, V>(dy + r * dim + vec * V);
    }
    const A mu = mean[r], rs = rstd[r];
    Pair<A> sums{A(0), A(0)};  // sum g, sum g * xhat with g = dy * weight
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int vec = lane + 32 * k;
      if (vec >= nv) continue;
      const Pack<A, V> w = load<A, V>(s_w + vec * V);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const A xhat = (to_acc(xv[k].v[j]) - mu) * rs, gy = to_acc(gv[k].v[j]), g = gy * w.v[j];
        sums.a += g;
        sums.b += g * xhat;
        sums_of[0][k][j] += gy * xhat;
        sums_of[1][k][j] += gy;
      }
    }
    sums = group_reduce<32>(sums, Add{});
    if (!dx) continue;
    const A mean_g = sums.a * inv_dim, mean_gx = sums.b * inv_dim;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int vec = lane + 32 * k;
      if (vec >= nv) continue;
      const Pack<A, V> w = load<A, V>(s_w + vec * V);
      const Pack<T, V> add = dx_add ? load<T, V>(dx_add + r * dim + vec * V) : Pack<T, V>{};
      Pack<T, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const A xhat = (to_acc(xv[k].v[j]) - mu) * rs, g = to_acc(gv[k].v[j]) * w.v[j];
        const A extra = dx_add ? to_acc(add.v[j]) : A(0);
        out.v[j] = from_acc<T>(rs * (g - mean_g - xhat * mean_gx) + extra);
      }
      store_dx<T, O, V>(dx, dx_rounded, r * dim + vec * V, out);
      if constexpr (kSums) {  // this warp's row of s_dx: its lanes' columns, no other warp's
        A* at = s_dx + warp * dim + vec * V;
        Pack<A, V> sum = load<A, V>(at);
#pragma unroll
        for (int j = 0; j < V; ++j) sum.v[j] += as_stored<O>(to_acc(out.v[j]), dx_rounded != nullptr);
        store<A, V>(at, sum);
      }
    }
  }
  if (!partials) return;  // the same for the whole block
  // The warps' column sums, added in warp order; every warp covers every column.
  if constexpr (kSums) {
    __syncthreads();
    for (int c = threadIdx.x; c < dim; c += kThreads) {
      A sum = A(0);
      for (int w = 0; w < kWarps; ++w) sum += s_dx[w * dim + c];
      s_sum[kParamRows * dim + c] = sum;
    }
  }
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int i = 0; i < kParamRows; ++i) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const int vec = lane + 32 * k;
          if (vec >= nv) continue;
          A* at = s_sum + i * dim + vec * V;
          Pack<A, V> sum = w ? load<A, V>(at) : Pack<A, V>{};
#pragma unroll
          for (int j = 0; j < V; ++j) sum.v[j] += sums_of[i][k][j];
          store<A, V>(at, sum);
        }
      }
    }
    __syncthreads();
  }
  A* out = partials + int64_t(blockIdx.x) * kRows * dim;
  for (int i = threadIdx.x; i < kRows * dim; i += kThreads) out[i] = s_sum[i];
}

// ---- block per row, for rows too long for registers ------------------------------------

template <class T, class O, int V>
__global__ void __launch_bounds__(kThreads)
    forward_block_kernel(O* __restrict__ y, acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                         const T* __restrict__ x, ParamRefs p, int64_t rows, int64_t dim, acc_t<T> eps) {
  using A = acc_t<T>;
  const int64_t nv = dim / V;
  const A inv_dim = A(1) / A(dim);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * dim;
    A sum = A(0);
    for (int64_t vec = threadIdx.x; vec < nv; vec += kThreads) {
      const Pack<T, V> v = load<T, V>(xr + vec * V);
#pragma unroll
      for (int j = 0; j < V; ++j) sum += to_acc(v.v[j]);
    }
    const A mu = group_reduce<kThreads>(sum, Add{}) * inv_dim;
    A sq = A(0);
    for (int64_t vec = threadIdx.x; vec < nv; vec += kThreads) {
      const Pack<T, V> v = load<T, V>(xr + vec * V);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const A d = to_acc(v.v[j]) - mu;
        sq += d * d;
      }
    }
    const A rs = inv_sqrt(group_reduce<kThreads>(sq, Add{}) * inv_dim + eps);
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    for (int64_t vec = threadIdx.x; vec < nv; vec += kThreads) {
      const Pack<T, V> v = load<T, V>(xr + vec * V);
      Pack<O, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int64_t c = vec * V + j;
        const A w = p.weight ? param_at<A>(p.weight, p.dtype, c) : A(1);
        const A b = p.bias ? param_at<A>(p.bias, p.dtype, c) : A(0);
        out.v[j] = from_acc<O>((to_acc(v.v[j]) - mu) * rs * w + b);
      }
      store<O, V>(y + r * dim + vec * V, out);
    }
  }
}

// dx only; the parameter sums come from column_partials_kernel.
template <class T, class O, int V>
__global__ void __launch_bounds__(kThreads)
    backward_block_kernel(T* __restrict__ dx, const T* __restrict__ dx_add, O* __restrict__ dx_rounded,
                          const O* __restrict__ dy, const T* __restrict__ x, const acc_t<T>* __restrict__ mean,
                          const acc_t<T>* __restrict__ rstd, ParamRefs p, int64_t rows, int64_t dim) {
  using A = acc_t<T>;
  const int64_t nv = dim / V;
  const A inv_dim = A(1) / A(dim);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const A mu = mean[r], rs = rstd[r];
    // g and xhat of element j of a loaded pair of vectors.
    auto terms = [=](const Pack<T, V>& xv, const Pack<O, V>& gv, int64_t vec, int j, A& g, A& xhat) {
      const A w = p.weight ? param_at<A>(p.weight, p.dtype, vec * V + j) : A(1);
      g = to_acc(gv.v[j]) * w;
      xhat = (to_acc(xv.v[j]) - mu) * rs;
    };
    Pair<A> sums{A(0), A(0)};
    for (int64_t vec = threadIdx.x; vec < nv; vec += kThreads) {
      const Pack<T, V> xv = load<T, V>(x + r * dim + vec * V);
      const Pack<O, V> gv = load<O, V>(dy + r * dim + vec * V);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        A g, xhat;
        terms(xv, gv, vec, j, g, xhat);
        sums.a += g;
        sums.b += g * xhat;
      }
    }
    sums = group_reduce<kThreads>(sums, Add{});
    const A mean_g = sums.a * inv_dim, mean_gx = sums.b * inv_dim;
    for (int64_t vec = threadIdx.x; vec < nv; vec += kThreads) {
      const Pack<T, V> xv = load<T, V>(x + r * dim + vec * V);
      const Pack<O, V> gv = load<O, V>(dy + r * dim + vec * V);
      const Pack<T, V> add = dx_add ? load<T, V>(dx_add + r * dim + vec * V) : Pack<T, V>{};
      Pack<T, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        A g, xhat;
        terms(xv, gv, vec, j, g, xhat);
        out.v[j] = from_acc<T>(rs * (g - mean_g - xhat * mean_gx) + (dx_add ? to_acc(add.v[j]) : A(0)));
      }
      store_dx<T, O, V>(dx, dx_rounded, r * dim + vec * V, out);
    }
  }
}

// Block (column tile of 32, partial p) sums dy * xhat and dy, and with `stored` (the dx
// kernel's output: dx, or dx_rounded when `rounded`) dx as stored, over rows
// [p * rows_per_partial, (p + 1) * rows_per_partial): a warp-wide row of columns, the block's
// warps taking every kWarps-th row, then adding up in warp order. Partial rows as the warp
// kernel writes them: 2, or 3 with `stored`.
template <class T, class O>
__global__ void __launch_bounds__(kThreads)
    column_partials_kernel(acc_t<T>* __restrict__ partials, const O* __restrict__ dy, const T* __restrict__ x,
                           const void* __restrict__ stored, bool rounded, const acc_t<T>* __restrict__ mean,
                           const acc_t<T>* __restrict__ rstd, int64_t rows, int64_t dim, int64_t rows_per_partial) {
  using A = acc_t<T>;
  __shared__ Pair<A> s[kWarps][32];
  __shared__ A s_dx[kWarps][32];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t c = int64_t(blockIdx.x) * 32 + tx;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_partial, r1 = min(rows, r0 + rows_per_partial);
  Pair<A> acc{A(0), A(0)};
  A acc_dx = A(0);
  if (c < dim) {
    for (int64_t r = r0 + ty; r < r1; r += kWarps) {
      const A gy = to_acc(dy[r * dim + c]);
      acc.a += gy * (to_acc(x[r * dim + c]) - mean[r]) * rstd[r];
      acc.b += gy;
      if (stored)
        acc_dx += rounded ? to_acc(static_cast<const O*>(stored)[r * dim + c])
                          : to_acc(static_cast<const T*>(stored)[r * dim + c]);
    }
  }
  s[ty][tx] = acc;
  s_dx[ty][tx] = acc_dx;
  __syncthreads();
  if (ty != 0 || c >= dim) return;
  for (int w = 1; w < kWarps; ++w) {
    acc = Add{}(acc, s[w][tx]);
    acc_dx += s_dx[w][tx];
  }
  const int n_rows = stored ? kSumRows : kParamRows;
  A* out = partials + int64_t(blockIdx.y) * n_rows * dim + c;
  out[0] = acc.a;
  out[dim] = acc.b;
  if (stored) out[2 * dim] = acc_dx;
}

// The column sums from n partial rows of `n_rows` rows of dim: dweight and dbias (either may
// be null, in `dtype`) from the first two, and dx_sums (in the accumulation type) from the
// third when n_rows is 3. A column tile of 32 per block, the warps taking every kWarps-th
// partial into kReduceChains sums (so that a thread has that many loads in flight: the grid
// is only dim / 32 blocks), then adding up in warp order.
constexpr int kReduceChains = 4;

template <class A>
__global__ void __launch_bounds__(kThreads)
    param_reduce_kernel(void* dweight, void* dbias, DType dtype, A* __restrict__ dx_sums,
                        const A* __restrict__ partials, int n, int n_rows, int64_t dim) {
  __shared__ A s[kSumRows][kWarps][32];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t c = int64_t(blockIdx.x) * 32 + tx;
  A acc[kSumRows] = {};
  if (c < dim) {
    A chain[kReduceChains][kSumRows] = {};
    auto add = [&](A* into, int k) {
#pragma unroll
      for (int i = 0; i < kSumRows; ++i) {
        if (i < n_rows) into[i] += partials[(int64_t(k) * n_rows + i) * dim + c];
      }
    };
    int k = ty;
    for (; k + (kReduceChains - 1) * kWarps < n; k += kReduceChains * kWarps) {
#pragma unroll
      for (int u = 0; u < kReduceChains; ++u) add(chain[u], k + u * kWarps);
    }
    for (; k < n; k += kWarps) add(chain[0], k);
#pragma unroll
    for (int u = 0; u < kReduceChains; ++u) {
#pragma unroll
      for (int i = 0; i < kSumRows; ++i) acc[i] += chain[u][i];
    }
  }
#pragma unroll
  for (int i = 0; i < kSumRows; ++i) s[i][ty][tx] = acc[i];
  __syncthreads();
  if (ty != 0 || c >= dim) return;
  for (int w = 1; w < kWarps; ++w) {
#pragma unroll
    for (int i = 0; i < kSumRows; ++i) acc[i] += s[i][w][tx];
  }
  if (dweight) param_store(dweight, dtype, c, acc[0]);
  if (dbias) param_store(dbias, dtype, c, acc[1]);
  if (dx_sums) dx_sums[c] = acc[2];
}

// ---- launch planning -------------------------------------------------------------------

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

size_t acc_size(DType dtype) { return dtype == DType::f64 ? sizeof(double) : sizeof(float); }

// Partial rows of the parameter sums: one per block of the backward warp kernel.
int64_t partial_count(const LayerNormArgs& a) {
  return std::clamp<int64_t>(ceil_div(a.rows, kWarps), 1, int64_t(sm_count()) * kBackwardBlocksPerSm);
}

// How a call runs: 8-value vectors or single values, and how many of them a lane of the warp
// kernels holds; per_lane = 0 when the row does not fit and a block takes each row.
struct Layout {
  bool vec;
  int per_lane;
};

Layout layout_for(const LayerNormArgs& a, std::initializer_list<const void*> buffers) {
  bool vec = a.dtype != DType::f64 && a.dim % kVec == 0;
  for (const void* b : buffers) vec = vec && (!b || reinterpret_cast<uintptr_t>(b) % 16 == 0);
  const int64_t per_lane = ceil_div(vec ? a.dim / kVec : a.dim, 32);
  return {vec, per_lane <= kMaxPerLane ? int(per_lane) : 0};
}

// Calls f(T{}, O{}) with the element types of x (and dx) and of y (and dy).
template <class F> void dispatch_io(const LayerNormArgs& a, const char* what, F&& f) {
  dispatch_floating(a.dtype, what, [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, double>) {
      LOOM_ASSERT(a.out_dtype == DType::f64, what, ": f64 input needs f64 output, got ", dtype_name(a.out_dtype));
      f(t, double{});
    } else {
      switch (a.out_dtype) {
        case DType::f32: return f(t, float{});
        case DType::bf16: return f(t, __nv_bfloat16{});
        case DType::f16: return f(t, __half{});
        default:
          LOOM_ASSERT(false, what, ": output dtype must be f32, bf16 or f16 for ", dtype_name(a.dtype),
                      " input, got ", dtype_name(a.out_dtype));
      }
    }
  });
}

template <int N> using Int = std::integral_constant<int, N>;

// Calls f(Int<V>{}, Int<kPer>{}) for the warp kernels. Single values always take
// kPer = kMaxPerLane: rows of at most 128 values are not worth more instantiations.
template <class T, class F> void with_warp_layout(const Layout& l, F&& f) {
  if constexpr (!std::is_same_v<T, double>) {
    if (l.vec) {
      switch (l.per_lane) {
        case 1: return f(Int<kVec>{}, Int<1>{});
        case 2: return f(Int<kVec>{}, Int<2>{});
        case 3: return f(Int<kVec>{}, Int<3>{});
        default: return f(Int<kVec>{}, Int<4>{});
      }
    }
  }
  f(Int<1>{}, Int<kMaxPerLane>{});
}

// Calls f(Int<V>{}) for the block kernels.
template <class T, class F> void with_width(bool vec, F&& f) {
  if constexpr (!std::is_same_v<T, double>) {
    if (vec) return f(Int<kVec>{});
  }
  f(Int<1>{});
}

}  // namespace

void layer_norm_forward(const LayerNormArgs& a, void* y, void* mean, void* rstd, const void* x, const void* weight,
                        const void* bias, StreamHandle stream) {
  if (a.rows == 0 || a.dim == 0) return;
  const ParamRefs p{weight, bias, a.param_dtype};
  const Layout l = layout_for(a, {x, y});
  cudaStream_t s = as_cuda(stream);
  dispatch_io(a, "layer_norm", [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    using A = acc_t<T>;
    auto* ys = static_cast<O*>(y);
    auto* ms = static_cast<A*>(mean);
    auto* rs = static_cast<A*>(rstd);
    const auto* xs = static_cast<const T*>(x);
    const int64_t max_blocks = int64_t(sm_count()) * kForwardBlocksPerSm;
    if (l.per_lane > 0) {
      with_warp_layout<T>(l, [&](auto v, auto per) {
        constexpr int V = decltype(v)::value, kPer = decltype(per)::value;
        const unsigned grid = unsigned(std::min(ceil_div(a.rows, kWarps), max_blocks));
        forward_warp_kernel<T, O, V, kPer><<<grid, kThreads, 2 * size_t(a.dim) * sizeof(A), s>>>(
            ys, ms, rs, xs, p, a.rows, int(a.dim), A(a.eps));
        LOOM_CUDA_LAUNCH();
      });
    } else {
      with_width<T>(l.vec, [&](auto v) {
        constexpr int V = decltype(v)::value;
        const unsigned grid = unsigned(std::min(a.rows, max_blocks));
        forward_block_kernel<T, O, V><<<grid, kThreads, 0, s>>>(ys, ms, rs, xs, p, a.rows, a.dim, A(a.eps));
        LOOM_CUDA_LAUNCH();
      });
    }
  });
}

// Partial rows a backward call writes: dweight's and dbias's sums, and dx's when asked. The
// scratch is sized for three either way, so that a caller may size it before setting dx_sums.
int partial_rows(const LayerNormArgs& a) { return a.dx_sums ? kSumRows : kParamRows; }

size_t layer_norm_workspace_size(const LayerNormArgs& a) {
  if (a.rows == 0 || a.dim == 0) return 0;
  return size_t(partial_count(a)) * kSumRows * size_t(a.dim) * acc_size(a.dtype);
}

void layer_norm_backward(const LayerNormArgs& a, void* dx, void* dweight, void* dbias, const void* dy, const void* x,
                         const void* mean, const void* rstd, const void* weight, void* workspace,
                         StreamHandle stream) {
  const bool sums = a.dx_sums != nullptr, params = dweight || dbias || sums;  // params: any column sums
  if (a.dim == 0 || (!dx && !params)) return;
  check_layer_norm_backward(a, dx);
  cudaStream_t s = as_cuda(stream);
  if (a.rows == 0) {  // no rows: zero sums, nothing else to write
    const size_t bytes = size_t(a.dim) * dtype_size(a.param_dtype);
    if (dweight) LOOM_CUDA(cudaMemsetAsync(dweight, 0, bytes, s));
    if (dbias) LOOM_CUDA(cudaMemsetAsync(dbias, 0, bytes, s));
    if (sums) LOOM_CUDA(cudaMemsetAsync(a.dx_sums, 0, size_t(a.dim) * acc_size(a.dtype), s));
    return;
  }
  LOOM_ASSERT(!params || workspace, "layer_norm backward: dweight, dbias and dx_sums need the scratch of "
                                    "layer_norm_workspace_size (", layer_norm_workspace_size(a), " bytes)");
  const ParamRefs p{weight, nullptr, a.param_dtype};
  const Layout l = layout_for(a, {dx, dy, x, a.dx_add, a.dx_rounded});
  const int64_t n = partial_count(a);
  dispatch_io(a, "layer_norm backward", [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    using A = acc_t<T>;
    auto* dxs = static_cast<T*>(dx);
    const auto* adds = static_cast<const T*>(a.dx_add);
    auto* rounded = static_cast<O*>(a.dx_rounded);
    auto* partials = static_cast<A*>(workspace);
    const auto* dys = static_cast<const O*>(dy);
    const auto* xs = static_cast<const T*>(x);
    const auto* ms = static_cast<const A*>(mean);
    const auto* rs = static_cast<const A*>(rstd);
    int64_t used = n;  // partial rows written
    if (l.per_lane > 0) {
      with_warp_layout<T>(l, [&](auto v, auto per) {
        constexpr int V = decltype(v)::value, kPer = decltype(per)::value;
        const size_t smem = (params ? 1 + partial_rows(a) + (sums ? kWarps : 0) : 1) * size_t(a.dim) * sizeof(A);
        LOOM_ASSERT(smem <= kDefaultSharedBytes, "layer_norm backward: ", smem, " bytes of shared memory for rows of ",
                    a.dim, " exceed the ", kDefaultSharedBytes, " a launch gets without opting in");
        auto launch = [&](auto kernel) {
          kernel<<<unsigned(n), kThreads, smem, s>>>(dxs, adds, rounded, params ? partials : nullptr, dys, xs, ms, rs,
                                                     p, a.rows, int(a.dim));
          LOOM_CUDA_LAUNCH();
        };
        if (sums) launch(backward_warp_kernel<T, O, V, kPer, true>);
        else launch(backward_warp_kernel<T, O, V, kPer, false>);
      });
    } else {
      if (dx) {
        with_width<T>(l.vec, [&](auto v) {
          constexpr int V = decltype(v)::value;
          const unsigned grid = unsigned(std::min(a.rows, int64_t(sm_count()) * kForwardBlocksPerSm));
          backward_block_kernel<T, O, V><<<grid, kThreads, 0, s>>>(dxs, adds, rounded, dys, xs, ms, rs, p, a.rows,
                                                            a.dim);
          LOOM_CUDA_LAUNCH();
        });
      }
      if (params) {
        const int64_t per_partial = ceil_div(a.rows, n);
        used = ceil_div(a.rows, per_partial);
        const dim3 grid(unsigned(ceil_div(a.dim, 32)), unsigned(used));
        const void* stored = !sums ? nullptr : a.dx_rounded ? a.dx_rounded : dx;
        column_partials_kernel<T, O><<<grid, kThreads, 0, s>>>(partials, dys, xs, stored, a.dx_rounded != nullptr, ms,
                                                               rs, a.rows, a.dim, per_partial);
        LOOM_CUDA_LAUNCH();
      }
    }
    if (params) {
      param_reduce_kernel<A><<<unsigned(ceil_div(a.dim, 32)), kThreads, 0, s>>>(
          dweight, dbias, a.param_dtype, static_cast<A*>(a.dx_sums), partials, int(used), partial_rows(a), a.dim);
      LOOM_CUDA_LAUNCH();
    }
  });
}

}  // namespace loom::cuda
