// Multi-tensor optimizer updates on the CPU: the reference the CUDA kernels in
// kernels/cuda/optim.cu are tested against. The per-element arithmetic is
// kernels/core/optim_math.h, shared with CUDA.
//
// The tensors of a call are laid end to end as one index space (a prefix sum of their
// sizes), and parallel_for splits that space, so many small tensors share a thread hand-off
// and one large tensor spreads over every thread. Each thread walks its range tensor by
// tensor; 16-bit values are widened to f32, updated, and rounded once at the store.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/core/optim_math.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per thread hand-off

template <class T> T* list_at(void* const* list, int64_t i) { return list ? static_cast<T*>(list[i]) : nullptr; }

// Calls body(i, begin, end) over element ranges [begin, end) of tensor i, covering every
// element of every tensor once, in parallel.
template <class Body>
void for_each_range(const MultiTensorArgs& a, const Body& body) {
  std::vector<int64_t> start(size_t(a.count) + 1, 0);
  for (int64_t i = 0; i < a.count; ++i) {
    LOOM_ASSERT(a.numel[i] >= 0, "tensor ", i, " has a negative size");
    start[size_t(i) + 1] = start[size_t(i)] + a.numel[i];
  }
  parallel_for(start.back(), kGrain, [&](int64_t begin, int64_t end) {
    // The last tensor starting at or before `begin`: empty tensors before it are skipped.
    int64_t i = int64_t(std::upper_bound(start.begin(), start.end(), begin) - start.begin()) - 1;
    while (begin < end) {
      const int64_t stop = std::min(end, start[size_t(i) + 1]);
      if (stop > begin) body(i, begin - start[size_t(i)], stop - start[size_t(i)]);
      begin = stop;
      ++i;
    }
  });
}

void check_lists(const MultiTensorArgs& a, const char* op) {
  LOOM_ASSERT(a.count == 0 || (a.params && a.grads && a.numel), op, ": params, grads and numel are required");
  LOOM_ASSERT(!a.copies || (a.dtype == DType::f32 && (a.copy_dtype == DType::bf16 || a.copy_dtype == DType::f16)),
              op, ": 16-bit copies are written from f32 parameters only");
}

// copies[i][k] = p[k] rounded, for k in [begin, end), when tensor i has a copy.
template <class T> void write_copy(const MultiTensorArgs& a, int64_t i, const T* p, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<T, float>) {
    if (!a.copies || !a.copies[i]) return;
    auto round_into = [&](auto* c) {
      using C = std::remove_pointer_t<decltype(c)>;
      for (int64_t k = begin; k < end; ++k) c[k] = C(p[k]);
    };
    if (a.copy_dtype == DType::bf16) round_into(static_cast<bf16*>(a.copies[i]));
    else round_into(static_cast<f16*>(a.copies[i]));
  }
}

}  // namespace

void sgd_step(const MultiTensorArgs& a, const SgdHyper& h, StreamHandle) {
  check_lists(a, "sgd_step");
  const bool momentum = h.momentum != 0;
  LOOM_ASSERT(a.count == 0 || !momentum || (a.state1 && h.first), "sgd_step: momentum needs buffers and first");
  dispatch_floating(a.dtype, "sgd_step", [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    const auto math =
        optim_math::Sgd<A>::make(h.lr_at ? *h.lr_at : h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov);
    for_each_range(a, [&](int64_t i, int64_t begin, int64_t end) {
      T* p = list_at<T>(a.params, i);
      const T* g = static_cast<const T*>(a.grads[i]);
      T* b = momentum ? list_at<T>(a.state1, i) : nullptr;
      const bool first = momentum && h.first[i];
      for (int64_t k = begin; k < end; ++k) {
        A buf = b && !first ? A(b[k]) : A(0);
        p[k] = T(math.step(A(p[k]), A(g[k]), buf, first));
        if (b) b[k] = T(buf);
      }
      write_copy(a, i, p, begin, end);
    });
  });
}

void adam_step(const MultiTensorArgs& a, const AdamHyper& h, StreamHandle) {
  check_lists(a, "adam_step");
  LOOM_ASSERT(a.count == 0 || (a.state1 && a.state2 && h.step), "adam_step: exp_avg, exp_avg_sq and step are required");
  dispatch_floating(a.dtype, "adam_step", [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    auto math = optim_math::Adam<A>::make(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled);
    std::vector<optim_math::AdamTensor<A>> scalars(size_t(a.count));
    for (int64_t i = 0; i < a.count; ++i) {
      LOOM_ASSERT(h.step[i] >= 1, "adam_step: tensor ", i, " has step ", h.step[i], "; steps count from 1");
      scalars[size_t(i)] = h.scalars_at ? optim_math::AdamTensor<A>{A(h.scalars_at[0]), A(h.scalars_at[1])}
                                        : optim_math::adam_tensor_scalars<A>(h.lr, h.beta1, h.beta2, h.step[i]);
    }
    if (h.scalars_at) math.decay = A(h.scalars_at[2]);
    for_each_range(a, [&](int64_t i, int64_t begin, int64_t end) {
      T* p = list_at<T>(a.params, i);
      const T* g = static_cast<const T*>(a.grads[i]);
      T* m = list_at<T>(a.state1, i);
      T* v = list_at<T>(a.state2, i);
      const optim_math::AdamTensor<A> s = scalars[size_t(i)];
      for (int64_t k = begin; k < end; ++k) {
        A mk = A(m[k]), vk = A(v[k]);
        p[k] = T(math.step(A(p[k]), A(g[k]), mk, vk, s));
        m[k] = T(mk);
        v[k] = T(vk);
      }
      write_copy(a, i, p, begin, end);
    });
  });
}

void multi_tensor_copy(const MultiTensorArgs& a, StreamHandle) {
  check_lists(a, "multi_tensor_copy");
  const size_t elem = dtype_size(a.dtype);
  for (int64_t i = 0; i < a.count; ++i)
    if (a.numel[i] > 0) std::memcpy(a.params[i], a.grads[i], size_t(a.numel[i]) * elem);
}

}  // namespace loom::cpu
