// Reductions over the middle axis of a canonical (outer, R, inner) buffer, on CUDA.
//
// The launcher picks one of three shapes of work:
// - contiguous rows (inner == 1, R > 32): a warp per row up to R = 1024, else a block per
//   row; both read the 16-byte-aligned middle of a row with vector loads.
// - everything else (inner > 1, or short rows): a thread per output (o, i) loops over r;
//   neighbouring threads read neighbouring i, so the loads coalesce.
// - when the outputs are too few to fill the GPU and R is long (a full reduction of a big
//   tensor), R is cut into "splits": one block (rows) or thread (columns) per (output,
//   split) writes a partial result, and a second kernel on the same stream combines the
//   partials of each output with one warp.
// Kernels may not allocate, so partials live in a static __device__ scratch (one copy per
// GPU). It is cut into kSlots slots handed out round-robin, one per split launch: launches
// on one stream are ordered, and Loom runs compute on one stream per device, so a slot is
// never used by two launches at once unless kSlots split reductions are in flight on other
// streams of the same device at the same time.
//
// Partial results are (value, index) states combined by an associative, commutative rule
// (ties go to the smaller index, NaN is the extreme), so argmax/argmin return the first
// index of the extreme whatever order the threads combine in. Sums accumulate 16-bit
// floats and f32 in f32, f64 in f64, integers in i64.
#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/reduce_common.cuh"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kWarpRowMax = 1024;          // longest row a warp reduces alone
constexpr int64_t kTargetBlocks = 1024;        // about one full wave on an H100/H200 (132 SMs x 8)
constexpr int64_t kTargetThreads = kTargetBlocks * kThreads;
constexpr int64_t kMinRowChunk = 8 * kThreads;  // a split of a row gives each thread >= 8 elements
constexpr int64_t kMinColChunk = 32;            // a split of a column gives each thread >= 32 rows
constexpr int kSlots = 8;
constexpr int64_t kSlotBytes = int64_t(512) << 10;

__device__ __align__(16) unsigned char g_partials[kSlots * kSlotBytes];
std::atomic<unsigned> g_next_slot{0};

template <class T> struct RAcc { using type = acc_t<T>; };
template <> struct RAcc<int32_t> { using type = int64_t; };
template <class T> using racc_t = typename RAcc<T>::type;

constexpr bool is_arg(ReduceOp op) { return op == ReduceOp::argmax || op == ReduceOp::argmin; }
constexpr bool is_sum(ReduceOp op) { return op == ReduceOp::sum || op == ReduceOp::mean; }
constexpr bool wants_max(ReduceOp op) { return op == ReduceOp::max || op == ReduceOp::argmax; }

const char* op_name(ReduceOp op) {
  static const char* const names[] = {"sum", "mean", "max", "min", "argmax", "argmin"};
  return names[int(op)];
}

template <class A> struct State {
  A v;
  int64_t i;
};

template <class A> __device__ __forceinline__ bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) return v != v;
  else return false;
}

template <ReduceOp op, class A> __device__ __forceinline__ State<A> identity() {
  constexpr int64_t none = std::numeric_limits<int64_t>::max();
  if constexpr (is_sum(op)) return {A(0), 0};
  else if constexpr (std::is_floating_point_v<A>)
    return {wants_max(op) ? -std::numeric_limits<A>::infinity() : std::numeric_limits<A>::infinity(), none};
  else return {wants_max(op) ? std::numeric_limits<A>::lowest() : std::numeric_limits<A>::max(), none};
}

template <ReduceOp op, class A> struct Combine {
  __device__ __forceinline__ State<A> operator()(State<A> a, State<A> b) const {
    if constexpr (is_sum(op)) {
      return {a.v + b.v, 0};
    } else {
      bool an = is_nan(a.v), bn = is_nan(b.v);
      if (an != bn) return an ? a : b;
      if (an || a.v == b.v) return a.i < b.i ? a : b;
      return (wants_max(op) ? a.v > b.v : a.v < b.v) ? a : b;
    }
  }
};

template <ReduceOp op, class T, class A>
__device__ __forceinline__ void store(void* out, int64_t j, State<A> s, int64_t R) {
  if constexpr (is_arg(op)) static_cast<int64_t*>(out)[j] = s.i;
  else if constexpr (op == ReduceOp::mean) static_cast<T*>(out)[j] = from_acc<T>(s.v / A(R));
  else static_cast<T*>(out)[j] = from_acc<T>(s.v);
}

template <class A> __device__ __forceinline__ State<A>* slot_partials(int slot) {
  return reinterpret_cast<State<A>*>(g_partials + slot * kSlotBytes);
}

// Calls f(p[r], r) for r in [r0, r1) from `lane` in steps of `step`; the part of the range
// that starts on a 16-byte boundary is read 16 bytes at a time.
template <class T, class F>
__device__ __forceinline__ void for_each_in(const T* p, int64_t r0, int64_t r1, int lane, int step, F&& f) {
  constexpr int V = 16 / sizeof(T);
  struct alignas(16) Pack { T x[V]; };
  const int64_t head = int64_t((16 - reinterpret_cast<uintptr_t>(p + r0) % 16) % 16 / sizeof(T));
  const int64_t a = min(r1, r0 + head);
  for (int64_t r = r0 + lane; r < a; r += step) f(p[r], r);
  const int64_t packs = (r1 - a) / V;
  const Pack* q = reinterpret_cast<const Pack*>(p + a);
#pragma unroll 4
  for (int64_t k = lane; k < packs; k += step) {
    Pack v = q[k];
#pragma unroll
    for (int j = 0; j < V; ++j) f(v.x[j], a + k * V + j);
  }
  for (int64_t r = a + packs * V + lane; r < r1; r += step) f(p[r], r);
}

// (rows, R) contiguous; a group of kGroup threads per (row, split).
template <class T, ReduceOp op, int kGroup>
__global__ void __launch_bounds__(kThreads) reduce_rows_kernel(void* out, const T* in, int64_t rows, int64_t R,
                                                               int64_t splits, int64_t chunk, int slot) {
  using A = racc_t<T>;
  constexpr int kGroups = kThreads / kGroup;
  const int lane = threadIdx.x % kGroup;
  for (int64_t task = int64_t(blockIdx.x) * kGroups + threadIdx.x / kGroup; task < rows * splits;
       task += int64_t(gridDim.x) * kGroups) {
    const int64_t row = task / splits, r0 = (task % splits) * chunk, r1 = min(R, r0 + chunk);
    State<A> s = identity<op, A>();
    for_each_in(in + row * R, r0, r1, lane, kGroup,
                [&](T x, int64_t r) { s = Combine<op, A>{}(s, State<A>{A(to_acc(x)), r}); });
    s = group_reduce<kGroup>(s, Combine<op, A>{});
    if (lane == 0) {
      if (splits == 1) store<op, T>(out, row, s, R);
      else slot_partials<A>(slot)[task] = s;
    }
  }
}

// (outer, R, inner); a thread per (output, split), outputs fastest so loads coalesce.
template <class T, ReduceOp op>
__global__ void __launch_bounds__(kThreads) reduce_cols_kernel(void* out, const T* in, int64_t outer, int64_t R,
                                                               int64_t inner, int64_t splits, int64_t chunk, int slot) {
  using A = racc_t<T>;
  const int64_t n_out = outer * inner;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n_out * splits;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t split = t / n_out, j = t - split * n_out, o = j / inner, i = j - o * inner;
    const int64_t r0 = split * chunk, r1 = min(R, r0 + chunk);
    const T* p = in + o * R * inner + i;
    State<A> s = identity<op, A>();
    // kLoads loads issued before their values are combined, in order: a call with few
    // outputs (a channels-last bias gradient: C columns) has few threads, each walking a
    // long column, and one load in flight each would leave it waiting on memory.
    constexpr int kLoads = 16;
    int64_t r = r0;
    for (; r + kLoads <= r1; r += kLoads) {
      T v[kLoads];
#pragma unroll
      for (int k = 0; k < kLoads; ++k) v[k] = p[(r + k) * inner];
#pragma unroll
      for (int k = 0; k < kLoads; ++k) s = Combine<op, A>{}(s, State<A>{A(to_acc(v[k])), r + k});
    }
    for (; r < r1; ++r) s = Combine<op, A>{}(s, State<A>{A(to_acc(p[r * inner])), r});
    if (splits == 1) store<op, T>(out, j, s, R);
    else slot_partials<A>(slot)[j * splits + split] = s;
  }
}

// Combines the `splits` partials of each output: a warp per output.
template <class T, ReduceOp op>
__global__ void __launch_bounds__(kThreads) reduce_finish_kernel(void* out, int64_t n_out, int64_t splits, int64_t R,
                                                                 int slot) {
  using A = racc_t<T>;
  const State<A>* partials = slot_partials<A>(slot);
  const int lane = threadIdx.x % 32;
  for (int64_t j = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; j < n_out;
       j += int64_t(gridDim.x) * (kThreads / 32)) {
    State<A> s = identity<op, A>();
    for (int64_t k = lane; k < splits; k += 32) s = Combine<op, A>{}(s, partials[j * splits + k]);
    s = group_reduce<32>(s, Combine<op, A>{});
    if (lane == 0) store<op, T>(out, j, s, R);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Splits of R for n_out outputs: enough to reach `want` workers, each split at least
// min_chunk long, all partials inside one slot.
int64_t pick_splits(int64_t want, int64_t n_out, int64_t R, int64_t min_chunk, int64_t slot_states) {
  return std::max<int64_t>(1, std::min({want / n_out, ceil_div(R, min_chunk), slot_states / n_out}));
}

template <class T, ReduceOp op>
void reduce_typed(void* out, const T* in, int64_t outer, int64_t R, int64_t inner, cudaStream_t stream) {
  constexpr int64_t slot_states = kSlotBytes / sizeof(State<racc_t<T>>);
  const int64_t n_out = outer * inner;
  int64_t splits = 1, chunk = R;
  int slot = 0;
  auto split = [&](int64_t want) {
    if (want <= 1) return;
    chunk = ceil_div(R, want);
    splits = ceil_div(R, chunk);
    slot = int(g_next_slot.fetch_add(1, std::memory_order_relaxed) % kSlots);
  };
  if (inner == 1 && R > 32 && R <= kWarpRowMax) {
    reduce_rows_kernel<T, op, 32>
        <<<blocks_for(outer, kThreads / 32), kThreads, 0, stream>>>(out, in, outer, R, 1, R, 0);
    LOOM_CUDA_LAUNCH();
    return;
  }
  if (inner == 1 && R > 32) {
    split(pick_splits(kTargetBlocks, n_out, R, kMinRowChunk, slot_states));
    reduce_rows_kernel<T, op, kThreads>
        <<<blocks_for(outer * splits, 1), kThreads, 0, stream>>>(out, in, outer, R, splits, chunk, slot);
  } else {
    split(pick_splits(kTargetThreads, n_out, R, kMinColChunk, slot_states));
    reduce_cols_kernel<T, op>
        <<<blocks_for(n_out * splits, kThreads), kThreads, 0, stream>>>(out, in, outer, R, inner, splits, chunk, slot);
  }
  LOOM_CUDA_LAUNCH();
  if (splits > 1) {
    reduce_finish_kernel<T, op><<<blocks_for(n_out, kThreads / 32), kThreads, 0, stream>>>(out, n_out, splits, R, slot);
    LOOM_CUDA_LAUNCH();
  }
}

template <class F> void with_op(ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::sum: return f(std::integral_constant<ReduceOp, ReduceOp::sum>{});
    case ReduceOp::mean: return f(std::integral_constant<ReduceOp, ReduceOp::mean>{});
    case ReduceOp::max: return f(std::integral_constant<ReduceOp, ReduceOp::max>{});
    case ReduceOp::min: return f(std::integral_constant<ReduceOp, ReduceOp::min>{});
    case ReduceOp::argmax: return f(std::integral_constant<ReduceOp, ReduceOp::argmax>{});
    case ReduceOp::argmin: return f(std::integral_constant<ReduceOp, ReduceOp::argmin>{});
  }
  LOOM_ASSERT(false, "unknown ReduceOp ", int(op));
}

}  // namespace

void reduce(ReduceOp op, void* out, const void* in, DType dtype, int64_t outer, int64_t R, int64_t inner,
            StreamHandle stream) {
  LOOM_CHECK(is_floating(dtype) || dtype == DType::i32 || dtype == DType::i64, "reduce ", op_name(op),
             " needs a floating-point, i32 or i64 input, got ", dtype_name(dtype), ": convert it first");
  LOOM_CHECK(op != ReduceOp::mean || is_floating(dtype), "reduce mean needs a floating-point input, got ",
             dtype_name(dtype), ": convert it to f32 first (the mean of integers is not an integer)");
  LOOM_CHECK(R > 0 || is_sum(op), "reduce ", op_name(op),
             " over an empty axis (size 0) has no value; only sum (0) and mean (NaN) are defined there");
  if (outer * inner == 0) return;
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, uint8_t>) {
      with_op(op, [&](auto op_tag) {
        constexpr ReduceOp o = decltype(op_tag)::value;
        if constexpr (o != ReduceOp::mean || !std::is_integral_v<T>)
          reduce_typed<T, o>(out, static_cast<const T*>(in), outer, R, inner, as_cuda(stream));
      });
    }
  });
}

}  // namespace loom::cuda
