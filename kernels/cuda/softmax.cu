// Softmax, log-softmax and fused cross-entropy on CUDA.
//
// A row (the middle axis of a canonical (outer, R, inner) buffer) is read twice: once for
// its running (max, sum of exp(x - max)) pair, kept "online" so one pass finds both, and
// once to write. Contiguous rows (inner == 1) get a warp each up to R = 1024 and a block of
// kBlock threads beyond; pairs from the threads of a group merge with warp shuffles (and
// shared memory across the warps of a block). Short rows (R <= 16) and inner > 1 get a
// thread per (o, i) looping over r; neighbouring threads read neighbouring i, so loads
// coalesce. Few long strided rows (outer * inner tiny, R huge) are slow on that path; they
// are rare and it stays correct.
//
// Cross-entropy rows are (N, C) contiguous: a warp per row up to C = 1024, else a block;
// rows of a multiple of 16 bytes in aligned buffers move in 16-byte packs, four loads in
// flight a thread. A language model's loss reads and writes (tokens, vocab) logits, and at
// 16-bit logits the per-logit arithmetic decides whether the pass keeps up with memory: one
// fmax, a subtraction, a multiply and one exp2 a logit forward, a subtraction, two
// multiplies and one exp2 backward (the target's entry is corrected by one extra store,
// not by a compare on every logit). A training step's loss asks the forward for the
// gradient too (grad_logits): the row's second pass then writes it, reading the row back
// from L2, so the logits come from memory once instead of twice.
// A target that is neither a class index nor ignore_index is a user error the engine
// checks before the call where it can; here the kernel prints the row and target with
// printf and executes __trap(), which aborts the kernel and leaves the CUDA context in an
// error state (cudaErrorLaunchFailure on the next synchronising call). It never reads
// logits[n, target] out of bounds.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/reduce_common.cuh"

namespace loom::cuda {
namespace {

constexpr int kWarpRows = 128;  // threads per block when a warp takes a row
constexpr int kBlock = 512;     // threads per block when a block takes a row
constexpr int kColThreads = 256;
constexpr int64_t kWarpRowMax = 1024;
constexpr int64_t kShortRow = 16;
constexpr int kGradBlocksPerSm = 2;  // cross-entropy writing its gradient, a block per row

template <class A> __device__ __forceinline__ A exp_acc(A x) {
  if constexpr (std::is_same_v<A, float>) return expf(x);
  else return exp(x);
}
template <class A> __device__ __forceinline__ A log_acc(A x) {
  if constexpr (std::is_same_v<A, float>) return logf(x);
  else return log(x);
}
template <class A> __device__ __forceinline__ A neg_inf() { return -std::numeric_limits<A>::infinity(); }

// Running max m and sum s of exp(x - m). A row of -inf keeps (-inf, 0) and its softmax is
// NaN, as on the CPU; a NaN or a +inf makes s NaN (a new maximum adds exp(x - x): 1, or NaN
// for +inf), so such rows are NaN throughout, as on the CPU and in PyTorch.
template <class A> struct MaxSum {
  A m, s;
};

template <class A> __device__ __forceinline__ MaxSum<A> push(MaxSum<A> a, A x) {
  if (x > a.m) return {x, a.s * exp_acc(a.m - x) + exp_acc(x - x)};
  if (x != neg_inf<A>()) a.s += exp_acc(x - a.m);
  return a;
}

struct Merge {
  template <class A> __device__ __forceinline__ MaxSum<A> operator()(MaxSum<A> a, MaxSum<A> b) const {
    A m = a.m > b.m ? a.m : b.m;
    if (m == neg_inf<A>()) return {m, a.s + b.s};
    return {m, a.s * exp_acc(a.m - m) + b.s * exp_acc(b.m - m)};
  }
};

struct Add {
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};

// A group of kGroup threads per row (a warp, or the whole block): the first row of this
// thread's group, and the step to its next one.
template <int kGroup, int kThreads> __device__ __forceinline__ int64_t first_row() {
  return int64_t(blockIdx.x) * (kThreads / kGroup) + threadIdx.x / kGroup;
}
template <int kGroup, int kThreads> __device__ __forceinline__ int64_t row_step() {
  return int64_t(gridDim.x) * (kThreads / kGroup);
}

template <class T, int kGroup, int kThreads>
__global__ void __launch_bounds__(kThreads)
    softmax_rows_kernel(T* out, const T* in, int64_t rows, int64_t R, bool log) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % kGroup;
  for (int64_t row = first_row<kGroup, kThreads>(); row < rows; row += row_step<kGroup, kThreads>()) {
    const T* x = in + row * R;
    T* y = out + row * R;
    MaxSum<A> ms{neg_inf<A>(), A(0)};
    for (int64_t r = lane; r < R; r += kGroup) ms = push(ms, to_acc(x[r]));
    ms = group_reduce<kGroup>(ms, Merge{});
    const A shift = log ? log_acc(ms.s) : A(1) / ms.s;
    for (int64_t r = lane; r < R; r += kGroup) {
      A v = to_acc(x[r]) - ms.m;
      y[r] = from_acc<T>(log ? v - shift : exp_acc(v) * shift);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kColThreads) softmax_cols_kernel(T* out, const T* in, int64_t outer, int64_t R,
                                                                   int64_t inner, bool log) {
  using A = acc_t<T>;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < outer * inner;
       j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t o = j / inner, off = o * R * inner + (j - o * inner);
    MaxSum<A> ms{neg_inf<A>(), A(0)};
    for (int64_t r = 0; r < R; ++r) ms = push(ms, to_acc(in[off + r * inner]));
    const A shift = log ? log_acc(ms.s) : A(1) / ms.s;
    for (int64_t r = 0; r < R; ++r) {
      A v = to_acc(in[off + r * inner]) - ms.m;
      out[off + r * inner] = from_acc<T>(log ? v - shift : exp_acc(v) * shift);
    }
  }
}

// softmax: gi = y * (go - sum(go * y)); log_softmax: gi = go - exp(y) * sum(go).
template <class T, class A> __device__ __forceinline__ A backward_term(T go, T y, bool log) {
  return log ? to_acc(go) : to_acc(go) * to_acc(y);
}
template <class T, class A> __device__ __forceinline__ T backward_value(T go, T y, A dot, bool log) {
  A g = to_acc(go), v = to_acc(y);
  return from_acc<T>(log ? g - exp_acc(v) * dot : v * (g - dot));
}

template <class T, int kGroup, int kThreads>
__global__ void __launch_bounds__(kThreads) softmax_backward_rows_kernel(T* gi, const T* go, const T* y, int64_t rows,
                                                                         int64_t R, bool log) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % kGroup;
  for (int64_t row = first_row<kGroup, kThreads>(); row < rows; row += row_step<kGroup, kThreads>()) {
    const int64_t base = row * R;
    A dot = 0;
    for (int64_t r = lane; r < R; r += kGroup) dot += backward_term<T, A>(go[base + r], y[base + r], log);
    dot = group_reduce<kGroup>(dot, Add{});
    for (int64_t r = lane; r < R; r += kGroup) gi[base + r] = backward_value(go[base + r], y[base + r], dot, log);
  }
}

template <class T>
__global__ void __launch_bounds__(kColThreads) softmax_backward_cols_kernel(T* gi, const T* go, const T* y,
                                                                            int64_t outer, int64_t R, int64_t inner,
                                                                            bool log) {
  using A = acc_t<T>;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < outer * inner;
       j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t o = j / inner, off = o * R * inner + (j - o * inner);
    A dot = 0;
    for (int64_t r = 0; r < R; ++r) dot += backward_term<T, A>(go[off + r * inner], y[off + r * inner], log);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t k = off + r * inner;
      gi[k] = backward_value(go[k], y[k], dot, log);
    }
  }
}

// True when row n is ignored; traps on a target outside [0, C) that is not ignore_index,
// naming the row as row_base + n.
__device__ __forceinline__ bool ignored_row(const int64_t* target, int64_t n, int64_t C, int64_t ignore_index,
                                            int lane, int64_t row_base = 0) {
  const int64_t t = target[n];
  if (t == ignore_index) return true;
  if (t < 0 || t >= C) {
    if (lane == 0)
      printf("loom cross_entropy: target %lld in row %lld is not a class index in [0, %lld) nor ignore_index\n",
             (long long)t, (long long)(row_base + n), (long long)C);
    __trap();
  }
  return false;
}

template <class A> struct CeState {
  MaxSum<A> ms;
  A sum;  // of the logits, for label smoothing
};

struct CeMerge {
  template <class A> __device__ __forceinline__ CeState<A> operator()(CeState<A> a, CeState<A> b) const {
    return {Merge{}(a.ms, b.ms), a.sum + b.sum};
  }
};

// 16 bytes of T, the unit of a vectorized load or store: rows whose length is a multiple of
// kPack<T> and whose buffers are 16-byte aligned are read and written a pack at a time.
template <class T> constexpr int kPack = 16 / int(sizeof(T));
constexpr int kAhead = 4;  // packs of a row a thread loads at once

template <class T> bool packable(int64_t C, const void* a, const void* b = nullptr) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return C % kPack<T> == 0 && aligned(a) && aligned(b);
}

// 2^x: for f32 the single MUFU instruction (ex2.approx.ftz: about 2 ulp, results below
// 2^-126 flushed to zero, which a sum of terms up to 1 does not see).
template <class A> __device__ __forceinline__ A exp2_acc(A x) {
  if constexpr (std::is_same_v<A, float>) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  } else {
    return exp2(x);
  }
}
template <class A> constexpr A kLog2e = A(1.4426950408889634);

// Pushes kN values x into a running (m, s), as push does, with one rescale for the whole
// group and then one subtraction, one multiply and one exp2 per value (a single MUFU
// instruction for f32): s += 2^((x - m) log2(e)). The pass then stays bound by memory, not
// by the ALU; m is one of the x, so x - m is exact near the maximum at any magnitude and lse
// = m + log(s) as on the CPU. Special cases as push: -inf adds nothing; fmax drops a NaN
// from the maximum, but its exp2 makes s NaN; +inf makes m +inf and its own term NaN.
template <class A, int kN> __device__ __forceinline__ MaxSum<A> push_pack(MaxSum<A> a, const A (&x)[kN]) {
  A hi = x[0];
#pragma unroll
  for (int j = 1; j < kN; ++j) hi = fmax(hi, x[j]);
  if (hi > a.m) {
    a.s *= exp2_acc((a.m - hi) * kLog2e<A>);
    a.m = hi;
  }
  const A base = a.m == neg_inf<A>() ? A(0) : a.m;  // nothing but -inf so far: terms of 2^-inf = 0
#pragma unroll
  for (int j = 0; j < kN; ++j) a.s += exp2_acc((x[j] - base) * kLog2e<A>);
  return a;
}

// Writes row `row`'s gradient g = gr (softmax(x) - (1 - eps) [c == t] - eps / C) with lse
// = l, or zeros for an ignored row; xt = x[t], read by the caller before any of the row was
// written, so that g may be x itself (each thread reads each of its values before writing
// it, and the target's entry is corrected from xt).
template <class T, int kGroup>
__device__ __forceinline__ void write_row_grad(T* g, const T* x, bool ignored, acc_t<T> l, int64_t t, T xt,
                                               acc_t<T> gr, int64_t C, double eps, bool packed, int lane) {
  using A = acc_t<T>;
  constexpr int P = kPack<T>;
  if (ignored) {  // no gradient, whatever the logits
    if (packed)
      for (int64_t i = lane; i < C / P; i += kGroup) store<T, P>(g + i * P, Pack<T, P>{});
    else
      for (int64_t c = lane; c < C; c += kGroup) g[c] = from_acc<T>(A(0));
    return;
  }
  const A spread = A(eps / double(C));
  // softmax = 2^((x - lse) log2(e)): x - lse is exact near the row's maximum at any
  // magnitude, then one multiply and one exp2. The target's own entry, which also loses
  // 1 - eps, is written again below.
  auto softmax = [&](T xc) { return exp2_acc((to_acc(xc) - l) * kLog2e<A>); };
  auto value = [&](T xc) { return from_acc<T>(gr * (softmax(xc) - spread)); };
  if (packed) {
    auto write_pack = [&](int64_t i, const Pack<T, P>& pk) {
      Pack<T, P> out;
#pragma unroll
      for (int j = 0; j < P; ++j) out.v[j] = value(pk.v[j]);
      store<T, P>(g + i * P, out);
    };
    const int64_t packs = C / P;
    int64_t i = lane;
    for (; i + (kAhead - 1) * kGroup < packs; i += kAhead * kGroup) {  // as the forward: loads ahead
      Pack<T, P> pk[kAhead];
#pragma unroll
      for (int k = 0; k < kAhead; ++k) pk[k] = load<T, P>(x + (i + k * kGroup) * P);
#pragma unroll
      for (int k = 0; k < kAhead; ++k) write_pack(i + k * kGroup, pk[k]);
    }
    for (; i < packs; i += kGroup) write_pack(i, load<T, P>(x + i * P));
  } else {
    for (int64_t c = lane; c < C; c += kGroup) g[c] = value(x[c]);
  }
  // The thread that wrote the target's entry overwrites it: its own later store, so no
  // other thread's ordering matters.
  if ((packed ? t / P : t) % kGroup == lane) g[t] = from_acc<T>(gr * (softmax(xt) - A(1 - eps) - spread));
}

// Per row: lse and the loss; with grad (not null), also the row's gradient for grad_row = 1,
// from a second pass over the row (the block's rows in flight are few enough that it reads
// them from L2, not memory).
template <class T, int kGroup, int kThreads>
__global__ void __launch_bounds__(kThreads) cross_entropy_kernel(acc_t<T>* loss, acc_t<T>* lse, const T* logits,
                                                                 const int64_t* target, int64_t N, int64_t C,
                                                                 int64_t ignore_index, double eps, bool packed,
                                                                 T* grad, int64_t row_base) {
  using A = acc_t<T>;
  constexpr int P = kPack<T>;
  const int lane = threadIdx.x % kGroup;
  for (int64_t row = first_row<kGroup, kThreads>(); row < N; row += row_step<kGroup, kThreads>()) {
    const bool ignored = ignored_row(target, row, C, ignore_index, lane, row_base);
    const T* x = logits + row * C;
    const int64_t t = ignored ? 0 : target[row];
    const T xt = x[t];  // before the reduction below, which orders it before any write of the row
    CeState<A> st{{neg_inf<A>(), A(0)}, A(0)};
    if (packed) {
      // kAhead packs are loaded before any is used, so each thread keeps that many loads in
      // flight (one at a time leaves the pass bound by latency), then added to the state with
      // one rescale for all of them.
      auto push_packs = [&](const auto& pk) {
        constexpr int kN = sizeof(pk) / sizeof(pk[0]);
        A v[kN * P];
#pragma unroll
        for (int k = 0; k < kN; ++k)
#pragma unroll
          for (int j = 0; j < P; ++j) {
            v[k * P + j] = to_acc(pk[k].v[j]);
            st.sum += v[k * P + j];
          }
        st.ms = push_pack(st.ms, v);
      };
      const int64_t packs = C / P;
      int64_t i = lane;
      for (; i + (kAhead - 1) * kGroup < packs; i += kAhead * kGroup) {
        Pack<T, P> pk[kAhead];
#pragma unroll
        for (int k = 0; k < kAhead; ++k) pk[k] = load<T, P>(x + (i + k * kGroup) * P);
        push_packs(pk);
      }
      for (; i < packs; i += kGroup) {
        const Pack<T, P> pk[1] = {load<T, P>(x + i * P)};
        push_packs(pk);
      }
    } else {
      for (int64_t c = lane; c < C; c += kGroup) {
        A v = to_acc(x[c]);
        st.ms = push(st.ms, v);
        st.sum += v;
      }
    }
    st = group_reduce<kGroup>(st, CeMerge{});  // a block's reduction synchronises the block
    A l = st.ms.m + log_acc(st.ms.s);
    if constexpr (kGroup == 32) {
      // A warp's butterfly leaves each lane a sum in its own order: all take lane 0's lse, the
      // one stored (so the gradient is the backward's, bit for bit). The shuffle and the
      // barrier after it also order every lane's reads of the row before any write.
      l = __shfl_sync(0xffffffffu, l, 0);
      __syncwarp();
    }
    if (lane == 0) {
      lse[row] = l;
      // Without label smoothing the mean of the logits takes no part (it is -inf in a row
      // with a masked logit, and 0 * inf would make the loss NaN).
      const A smooth = eps != 0 ? A(eps) * (l - st.sum / A(C)) : A(0);
      loss[row] = ignored ? A(0) : A(1 - eps) * (l - to_acc(xt)) + smooth;
    }
    if (grad) write_row_grad<T, kGroup>(grad + row * C, x, ignored, l, t, xt, A(1), C, eps, packed, lane);
  }
}

template <class T, int kGroup, int kThreads>
__global__ void __launch_bounds__(kThreads) cross_entropy_backward_kernel(T* grad, const T* logits, const acc_t<T>* lse,
                                                                          const int64_t* target, const acc_t<T>* grad_row,
                                                                          int64_t N, int64_t C, int64_t ignore_index,
                                                                          double eps, bool packed) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % kGroup;
  for (int64_t row = first_row<kGroup, kThreads>(); row < N; row += row_step<kGroup, kThreads>()) {
    const T* x = logits + row * C;
    const bool ignored = ignored_row(target, row, C, ignore_index, lane);
    const int64_t t = ignored ? 0 : target[row];
    write_row_grad<T, kGroup>(grad + row * C, x, ignored, A(lse[row]), t, x[t], A(grad_row[row]), C, eps, packed,
                              lane);
  }
}

// Calls launch(group, threads) with a warp per row (group 32) for rows up to kWarpRowMax
// long, else a block per row (group = threads = kBlock); both are integral_constants.
template <class F> void launch_rows(int64_t len, F&& launch) {
  if (len <= kWarpRowMax) launch(std::integral_constant<int, 32>{}, std::integral_constant<int, kWarpRows>{});
  else launch(std::integral_constant<int, kBlock>{}, std::integral_constant<int, kBlock>{});
  LOOM_CUDA_LAUNCH();
}

}  // namespace

void softmax(void* out, const void* in, DType dtype, int64_t outer, int64_t R, int64_t inner, bool log,
             StreamHandle stream) {
  if (outer * R * inner == 0) return;
  dispatch_floating(dtype, log ? "log_softmax" : "softmax", [&](auto tag) {
    using T = decltype(tag);
    auto* y = static_cast<T*>(out);
    auto* x = static_cast<const T*>(in);
    cudaStream_t s = as_cuda(stream);
    if (inner == 1 && R > kShortRow) {
      launch_rows(R, [&](auto group, auto threads) {
        constexpr int G = decltype(group)::value, N = decltype(threads)::value;
        softmax_rows_kernel<T, G, N><<<blocks_for(outer, N / G), N, 0, s>>>(y, x, outer, R, log);
      });
    } else {
      softmax_cols_kernel<T><<<blocks_for(outer * inner, kColThreads), kColThreads, 0, s>>>(y, x, outer, R, inner, log);
      LOOM_CUDA_LAUNCH();
    }
  });
}

void softmax_backward(void* grad_in, const void* grad_out, const void* out, DType dtype, int64_t outer,
                      int64_t R, int64_t inner, bool log, StreamHandle stream) {
  if (outer * R * inner == 0) return;
  dispatch_floating(dtype, log ? "log_softmax backward" : "softmax backward", [&](auto tag) {
    using T = decltype(tag);
    auto* gi = static_cast<T*>(grad_in);
    auto* go = static_cast<const T*>(grad_out);
    auto* y = static_cast<const T*>(out);
    cudaStream_t s = as_cuda(stream);
    if (inner == 1 && R > kShortRow) {
      launch_rows(R, [&](auto group, auto threads) {
        constexpr int G = decltype(group)::value, N = decltype(threads)::value;
        softmax_backward_rows_kernel<T, G, N><<<blocks_for(outer, N / G), N, 0, s>>>(gi, go, y, outer, R, log);
      });
    } else {
      softmax_backward_cols_kernel<T>
          <<<blocks_for(outer * inner, kColThreads), kColThreads, 0, s>>>(gi, go, y, outer, R, inner, log);
      LOOM_CUDA_LAUNCH();
    }
  });
}

void cross_entropy(void* loss, void* lse, const void* logits, DType dtype, const int64_t* target, int64_t N,
                   int64_t C, int64_t ignore_index, double label_smoothing, void* grad_logits, int64_t row_base,
                   StreamHandle stream) {
  LOOM_CHECK(C > 0 || N == 0, "cross_entropy needs at least one class, got logits of shape (", N, ", 0)");
  if (N == 0) return;
  dispatch_floating(dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    launch_rows(C, [&](auto group, auto threads) {
      constexpr int G = decltype(group)::value, kN = decltype(threads)::value;
      // Writing the gradient, a block per row re-reads its row from L2: at most
      // kGradBlocksPerSm rows in flight an SM keep every row there until its second pass.
      unsigned grid = blocks_for(N, kN / G);
      if (grad_logits && G == kN) grid = std::min<unsigned>(grid, unsigned(sm_count() * kGradBlocksPerSm));
      cross_entropy_kernel<T, G, kN><<<grid, kN, 0, as_cuda(stream)>>>(
          static_cast<acc_t<T>*>(loss), static_cast<acc_t<T>*>(lse), static_cast<const T*>(logits), target, N, C,
          ignore_index, label_smoothing, packable<T>(C, logits, grad_logits), static_cast<T*>(grad_logits),
          row_base);
    });
  });
}

void cross_entropy_backward(void* grad_logits, const void* logits, const void* lse, const int64_t* target,
                            const void* grad_row, DType dtype, int64_t N, int64_t C, int64_t ignore_index,
                            double label_smoothing, StreamHandle stream) {
  if (N * C == 0) return;
  dispatch_floating(dtype, "cross_entropy backward", [&](auto tag) {
    using T = decltype(tag);
    launch_rows(C, [&](auto group, auto threads) {
      constexpr int G = decltype(group)::value, kN = decltype(threads)::value;
      cross_entropy_backward_kernel<T, G, kN><<<blocks_for(N, kN / G), kN, 0, as_cuda(stream)>>>(
          static_cast<T*>(grad_logits), static_cast<const T*>(logits), static_cast<const acc_t<T>*>(lse), target,
          static_cast<const acc_t<T>*>(grad_row), N, C, ignore_index, label_smoothing,
          packable<T>(C, logits, grad_logits));
    });
  });
}

}  // namespace loom::cuda
