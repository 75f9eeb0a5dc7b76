// Multi-tensor optimizer updates on CUDA: SGD (momentum, dampening, Nesterov, weight decay),
// Adam and AdamW over a whole list of tensors in one kernel launch. The per-element
// arithmetic is kernels/core/optim_math.h, shared with the CPU reference.
//
// An optimizer step is memory-bound (Adam reads 4 and writes 3 values per element) and its
// tensors range from a 768-element bias to a 38M-element embedding, so the launch is laid
// out as in PyTorch's multi_tensor_apply:
// - Every tensor is cut into chunks of kChunk elements and each chunk gets one block; tensor
//   i owns blocks [block_start[i], block_start[i + 1]). A block finds its tensor by binary
//   search over block_start (a uniform loop over constant-cached parameters, about ten steps
//   for hundreds of tensors) and walks its chunk with 16-byte loads and stores when every
//   pointer the tensor uses is 16-byte aligned (chunks start at multiples of kChunk, so
//   alignment holds for every chunk), then a scalar tail; otherwise all scalar.
// - The pointers, sizes, per-tensor scalars and block table travel as one __grid_constant__
//   kernel parameter (no copy to device memory, no extra launch to fill one), read in place
//   from the parameter bank. Since CUDA 12.1 a kernel takes up to 32764 bytes of parameters
//   on sm_70 and newer, room for about 880 SGD or 620 Adam tensors (f32) per launch; longer
//   lists take as many launches as needed, in order on the stream. GPT-2 (148 tensors) and
//   ResNet-18 (62) take one launch; short lists use a 4 KB variant of the parameter block.
// - Empty tensors take no block, and a call with none to update launches nothing.
// All four floating dtypes work; f64 computes in f64, the others in f32 with one rounding at
// each store. Adam's bias corrections are computed per tensor in double on the host.
// f32 parameters may also have their updated values stored as bf16 or f16 (autocast's
// weight copies, MultiTensorArgs::copies) in the same pass: 2 bytes more a element, where a
// cast afterwards would read the 4 again.
#include <cstdint>
#include <memory>
#include <type_traits>

#include "kernels/core/optim_math.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 16384;                 // elements per block
constexpr int64_t kMaxBlocks = int64_t(1) << 30;  // per launch, below gridDim.x's 2^31 - 1
constexpr size_t kMaxParamBytes = 32764;          // kernel parameters, CUDA 12.1+ on sm_70+
static_assert(kChunk % 8 == 0, "chunks must start 16-byte aligned for every dtype");

// ---- the updates, as the kernel applies them ------------------------------------------
// An op names its lists (x[k] of one element, in MultiTensorArgs order: params, grads,
// state1, state2), which of them it reads and writes, and what it needs per tensor (Extra).

template <class A> struct SgdOp {
  static constexpr int kLists = 3;  // param, grad, momentum_buffer
  using Extra = uint8_t;            // 1: the buffer is new (fill it with the gradient)
  optim_math::Sgd<A> math;
  bool momentum;
  const double* lr_at;  // the learning rate on the device, or null (math.lr)

  // Once a block, before the elements: the per-launch values that live on the device.
  __device__ __forceinline__ void load() {
    if (lr_at) math.lr = A(*lr_at);
  }
  __device__ __forceinline__ bool reads(int k, Extra first) const { return k < 2 || (momentum && !first); }
  __device__ __forceinline__ bool writes(int k) const { return k == 0 || (k == 2 && momentum); }
  __device__ __forceinline__ void operator()(A (&x)[kLists], Extra first) const {
    x[0] = math.step(x[0], x[1], x[2], first != 0);
  }
};

template <class A> struct AdamOp {
  static constexpr int kLists = 4;  // param, grad, exp_avg, exp_avg_sq
  using Extra = optim_math::AdamTensor<A>;
  optim_math::Adam<A> math;
  const double* scalars_at;  // AdamHyper::scalars_at, or null (the per-tensor Extra)
  Extra shared;              // from scalars_at, for every tensor

  __device__ __forceinline__ void load() {
    if (!scalars_at) return;
    shared = {A(scalars_at[0]), A(scalars_at[1])};
    math.decay = A(scalars_at[2]);
  }
  __device__ __forceinline__ bool reads(int, const Extra&) const { return true; }
  __device__ __forceinline__ bool writes(int k) const { return k != 1; }
  __device__ __forceinline__ void operator()(A (&x)[kLists], const Extra& s) const {
    x[0] = math.step(x[0], x[1], x[2], x[3], scalars_at ? shared : s);
  }
};

template <class A> struct CopyOp {
  static constexpr int kLists = 2;  // destination (params), source (grads)
  using Extra = uint8_t;

  __device__ __forceinline__ void load() {}
  __device__ __forceinline__ bool reads(int k, Extra) const { return k == 1; }
  __device__ __forceinline__ bool writes(int k) const { return k == 0; }
  __device__ __forceinline__ void operator()(A (&x)[kLists], Extra) const { x[0] = x[1]; }
};

// ---- one launch's tensors ---------------------------------------------------------------

// The most tensors one launch's parameters hold.
template <class Op> constexpr int max_capacity() {
  constexpr size_t per_tensor = (Op::kLists + 1) * sizeof(void*) + sizeof(int64_t) + sizeof(typename Op::Extra) +
                                sizeof(int32_t);
  constexpr size_t fixed = sizeof(Op) + 64;  // the op, count, one more block_start, padding
  return int((kMaxParamBytes - fixed) / per_tensor);
}
// Lists of up to this many tensors launch with about 4 KB of parameters rather than 32 KB
// (the driver copies all of them at every launch); ResNet-18's 62 tensors fit.
constexpr int kSmallCapacity = 64;

template <class Op, int kCap> struct Launch {
  Op op;
  int count;                       // tensors in this launch, all non-empty
  void* ptr[Op::kLists][kCap];     // [list k][tensor i]
  void* copy[kCap];                // the parameter's 16-bit copy, or null
  int64_t numel[kCap];
  typename Op::Extra extra[kCap];
  int32_t block_start[kCap + 1];   // tensor i owns blocks [block_start[i], block_start[i + 1])
};


// The tensor whose blocks include this one: the last i with block_start[i] <= blockIdx.x.
template <class Op, int kCap> __device__ __forceinline__ int tensor_of_block(const Launch<Op, kCap>& l) {
  const int32_t block = int32_t(blockIdx.x);
  int lo = 0, hi = l.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (l.block_start[mid] <= block) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// C is the type of the parameters' copies (void: none in this launch).
template <class T, class C, class Op, int kCap>
__global__ void __launch_bounds__(kThreads) multi_tensor_kernel(const __grid_constant__ Launch<Op, kCap> l) {
  using A = acc_t<T>;
  constexpr int K = Op::kLists;
  constexpr int N = int(16 / sizeof(T));
  Op op = l.op;
  op.load();
  const int i = tensor_of_block(l);
  const int64_t begin = int64_t(int32_t(blockIdx.x) - l.block_start[i]) * kChunk;
  const int64_t n = l.numel[i] - begin < kChunk ? l.numel[i] - begin : kChunk;
  const typename Op::Extra extra = l.extra[i];

  T* ptr[K];
  bool read[K], write[K];
  bool vectorized = true;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    ptr[k] = l.ptr[k][i] ? static_cast<T*>(l.ptr[k][i]) + begin : nullptr;
    read[k] = op.reads(k, extra);
    write[k] = op.writes(k);
    if (read[k] || write[k]) vectorized &= reinterpret_cast<uintptr_t>(ptr[k]) % 16 == 0;
  }
  using Copy = std::conditional_t<std::is_void_v<C>, T, C>;  // C, or a stand-in never stored
  [[maybe_unused]] Copy* copy = nullptr;
  if constexpr (!std::is_void_v<C>) {
    copy = l.copy[i] ? static_cast<C*>(l.copy[i]) + begin : nullptr;
    vectorized &= reinterpret_cast<uintptr_t>(copy) % (N * sizeof(C)) == 0;
  }

  int64_t done = 0;
  if (vectorized) {
    const int64_t packs = n / N;
    for (int64_t j = threadIdx.x; j < packs; j += kThreads) {
      Pack<T, N> pk[K];
      [[maybe_unused]] Pack<Copy, N> pc;
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (read[k]) pk[k] = reinterpret_cast<const Pack<T, N>*>(ptr[k])[j];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        A x[K];
#pragma unroll
        for (int k = 0; k < K; ++k) x[k] = read[k] ? to_acc(pk[k].v[e]) : A(0);
        op(x, extra);
#pragma unroll
        for (int k = 0; k < K; ++k) pk[k].v[e] = from_acc<T>(x[k]);
        if constexpr (!std::is_void_v<C>) pc.v[e] = from_acc<C>(x[0]);
      }
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (write[k]) reinterpret_cast<Pack<T, N>*>(ptr[k])[j] = pk[k];
      if constexpr (!std::is_void_v<C>)
        if (copy) reinterpret_cast<Pack<C, N>*>(copy)[j] = pc;
    }
    done = packs * N;
  }
  for (int64_t j = done + threadIdx.x; j < n; j += kThreads) {
    A x[K];
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] = read[k] ? to_acc(ptr[k][j]) : A(0);
    op(x, extra);
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (write[k]) ptr[k][j] = from_acc<T>(x[k]);
    if constexpr (!std::is_void_v<C>)
      if (copy) copy[j] = from_acc<C>(x[0]);
  }
}

// Packs the non-empty tensors of `a` into launches of up to kCap tensors, in order;
// extra_of(i) gives tensor i's per-tensor value.
template <class T, class C, int kCap, class Op, class ExtraOf>
void launch_packed(const MultiTensorArgs& a, const Op& op, const ExtraOf& extra_of, cudaStream_t stream) {
  using L = Launch<Op, kCap>;
  static_assert(kCap > 0 && sizeof(L) <= kMaxParamBytes, "the launch parameters exceed what a kernel takes");
  constexpr int K = Op::kLists;
  void* const* lists[4] = {a.params, const_cast<void* const*>(a.grads), a.state1, a.state2};
  auto l = std::make_unique<L>();  // up to 32 KB: kept off the stack
  l->op = op;
  int64_t blocks = 0;
  auto flush = [&] {
    if (l->count == 0) return;
    l->block_start[l->count] = int32_t(blocks);
    multi_tensor_kernel<T, C, Op, kCap><<<unsigned(blocks), kThreads, 0, stream>>>(*l);
    LOOM_CUDA_LAUNCH();
    l->count = 0;
    blocks = 0;
  };
  for (int64_t i = 0; i < a.count; ++i) {
    const int64_t n = a.numel[i];
    if (n == 0) continue;
    const int64_t need = (n + kChunk - 1) / kChunk;
    if (l->count == kCap || blocks + need > kMaxBlocks) flush();
    const int c = l->count++;
    for (int k = 0; k < K; ++k) l->ptr[k][c] = lists[k] ? lists[k][i] : nullptr;
    l->copy[c] = a.copies ? a.copies[i] : nullptr;
    l->numel[c] = n;
    l->extra[c] = extra_of(i);
    l->block_start[c] = int32_t(blocks);
    blocks += need;
  }
  flush();
}

// Checks every tensor before anything launches, then launches at the size the list needs.
template <class T, class Op, class ExtraOf>
void launch_all(const MultiTensorArgs& a, const Op& op, const ExtraOf& extra_of, cudaStream_t stream) {
  int64_t nonempty = 0;
  for (int64_t i = 0; i < a.count; ++i) {
    const int64_t n = a.numel[i];
    LOOM_ASSERT(n >= 0, "tensor ", i, " has a negative size");
    LOOM_ASSERT(n == 0 || (a.params[i] && a.grads[i]), "tensor ", i, " has no parameter or gradient pointer");
    LOOM_CHECK(n <= kMaxBlocks * kChunk, "optimizer step: tensor ", i, " has ", n,
               " elements; one launch covers at most ", kMaxBlocks * kChunk);
    nonempty += n > 0;
  }
  if (nonempty == 0) return;
  auto sized = [&](auto copy_tag) {
    using C = typename decltype(copy_tag)::type;
    if (nonempty <= kSmallCapacity) launch_packed<T, C, kSmallCapacity>(a, op, extra_of, stream);
    else launch_packed<T, C, max_capacity<Op>()>(a, op, extra_of, stream);
  };
  if (!a.copies) return sized(std::type_identity<void>{});
  if constexpr (std::is_same_v<T, float>) {
    if (a.copy_dtype == DType::bf16) return sized(std::type_identity<__nv_bfloat16>{});
    LOOM_ASSERT(a.copy_dtype == DType::f16, "optimizer step: copies are bf16 or f16, not ", dtype_name(a.copy_dtype));
    return sized(std::type_identity<__half>{});
  } else {
    LOOM_ASSERT(false, "optimizer step: 16-bit copies are written from f32 parameters only");
  }
}

}  // namespace

void sgd_step(const MultiTensorArgs& a, const SgdHyper& h, StreamHandle stream) {
  if (a.count == 0) return;
  const bool momentum = h.momentum != 0;
  LOOM_ASSERT(a.params && a.grads && a.numel, "sgd_step: params, grads and numel are required");
  LOOM_ASSERT(!momentum || (a.state1 && h.first), "sgd_step: momentum needs buffers and first");
  dispatch_floating(a.dtype, "sgd_step", [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    const SgdOp<A> op{optim_math::Sgd<A>::make(h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov),
                      momentum, h.lr_at};
    launch_all<T>(a, op, [&](int64_t i) { return uint8_t(momentum && h.first[i] ? 1 : 0); }, as_cuda(stream));
  });
}

void adam_step(const MultiTensorArgs& a, const AdamHyper& h, StreamHandle stream) {
  if (a.count == 0) return;
  LOOM_ASSERT(a.params && a.grads && a.numel && a.state1 && a.state2 && h.step,
              "adam_step: params, grads, numel, exp_avg, exp_avg_sq and step are required");
  for (int64_t i = 0; i < a.count; ++i)
    LOOM_ASSERT(h.step[i] >= 1, "adam_step: tensor ", i, " has step ", h.step[i], "; steps count from 1");
  dispatch_floating(a.dtype, "adam_step", [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    const AdamOp<A> op{optim_math::Adam<A>::make(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled),
                       h.scalars_at, {}};
    auto scalars = [&](int64_t i) { return optim_math::adam_tensor_scalars<A>(h.lr, h.beta1, h.beta2, h.step[i]); };
    launch_all<T>(a, op, scalars, as_cuda(stream));
  });
}

void multi_tensor_copy(const MultiTensorArgs& a, StreamHandle stream) {
  if (a.count == 0) return;
  LOOM_ASSERT(a.params && a.grads && a.numel, "multi_tensor_copy: destinations, sources and numel are required");
  dispatch_floating(a.dtype, "multi_tensor_copy", [&](auto t) {
    using T = decltype(t);
    launch_all<T>(a, CopyOp<acc_t<T>>{}, [](int64_t) { return uint8_t(0); }, as_cuda(stream));
  });
}

}  // namespace loom::cuda
