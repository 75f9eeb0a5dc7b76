// CPU indexing kernels over canonical (outer, R, inner) buffers: index_select and gather
// read rows picked by an index, index_add and scatter_add accumulate into them.
//
// Every index is checked against [0, R) before anything is written, so a bad index is a
// loom::Error naming the value and where it sits, and the output is left untouched.
// The accumulating kernels are deterministic: two updates can collide only when they
// share (o, i) (the outer and inner coordinates), so threads split over (o, block of
// inner) and walk j in order, the same order on every run and thread count.
#include <algorithm>
#include <type_traits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

// Inner elements per accumulation task: small enough to spread a single (1, R, C)
// embedding gradient over threads, large enough to stream whole cache lines.
constexpr int64_t kInnerBlock = 64;

// Checks index (outer, J, inner) against [0, R); positions are reported as (o, j, i).
void check_indices(const char* op, const int64_t* index, int64_t outer, int64_t J, int64_t inner, int64_t R) {
  parallel_for(outer * J * inner, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t v = index[p];
      if (v >= 0 && v < R) [[likely]] continue;
      if (outer == 1 && inner == 1)
        LOOM_FAIL(op, ": index ", v, " at position ", p, " is out of range for a dimension of size ", R,
                  " (expected 0 <= index < ", R, ")");
      LOOM_FAIL(op, ": index ", v, " at position (", p / (J * inner), ", ", p / inner % J, ", ", p % inner,
                ") is out of range for a dimension of size ", R, " (expected 0 <= index < ", R, ")");
    }
  });
}

template <class T>
void add_into(T& dst, T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) dst = T(float(dst) + float(v));
  else dst = T(dst + v);  // u8 wraps modulo 256, as on the GPU
}

// Grain that gives each task at least ~32k elements of work.
int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(work_per_item, 1));
}

}  // namespace

void index_select(void* out, const void* in, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
                  int64_t R, int64_t inner, StreamHandle) {
  check_indices("index_select", index, 1, n_index, 1, R);
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(in);
    T* dst = static_cast<T*>(out);
    parallel_for(outer * n_index, grain_for(inner), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t o = r / n_index, j = r % n_index;
        std::copy_n(src + (o * R + index[j]) * inner, inner, dst + r * inner);
      }
    });
  });
}

void index_add(void* out, const void* src, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
               int64_t R, int64_t inner, StreamHandle) {
  check_indices("index_add", index, 1, n_index, 1, R);
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* s = static_cast<const T*>(src);
    T* dst = static_cast<T*>(out);
    const int64_t blocks = (inner + kInnerBlock - 1) / kInnerBlock;
    parallel_for(outer * blocks, grain_for(n_index * std::min(inner, kInnerBlock)), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t o = t / blocks, i0 = t % blocks * kInnerBlock, i1 = std::min(inner, i0 + kInnerBlock);
        for (int64_t j = 0; j < n_index; ++j) {
          T* row = dst + (o * R + index[j]) * inner;
          const T* from = s + (o * n_index + j) * inner;
          for (int64_t i = i0; i < i1; ++i) add_into(row[i], from[i]);
        }
      }
    });
  });
}

void gather(void* out, const void* in, const int64_t* index, int64_t J, DType dtype, int64_t outer, int64_t R,
            int64_t inner, StreamHandle) {
  check_indices("gather", index, outer, J, inner, R);
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(in);
    T* dst = static_cast<T*>(out);
    parallel_for(outer * J, grain_for(inner), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* plane = src + r / J * R * inner;
        const int64_t* idx = index + r * inner;
        T* row = dst + r * inner;
        for (int64_t i = 0; i < inner; ++i) row[i] = plane[idx[i] * inner + i];
      }
    });
  });
}

void scatter_add(void* out, const void* src, const int64_t* index, int64_t J, DType dtype, int64_t outer,
                 int64_t R, int64_t inner, StreamHandle) {
  check_indices("scatter_add", index, outer, J, inner, R);
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* s = static_cast<const T*>(src);
    T* dst = static_cast<T*>(out);
    const int64_t blocks = (inner + kInnerBlock - 1) / kInnerBlock;
    parallel_for(outer * blocks, grain_for(J * std::min(inner, kInnerBlock)), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t o = t / blocks, i0 = t % blocks * kInnerBlock, i1 = std::min(inner, i0 + kInnerBlock);
        T* plane = dst + o * R * inner;
        for (int64_t j = 0; j < J; ++j) {
          const int64_t* idx = index + (o * J + j) * inner;
          const T* from = s + (o * J + j) * inner;
          for (int64_t i = i0; i < i1; ++i) add_into(plane[idx[i] * inner + i], from[i]);
        }
      }
    });
  });
}

void embedding_sum(void* out, const void* wte, const void* wpe, const int64_t* ids, int64_t B, int64_t T, int64_t C,
                   int64_t V, DType dtype, StreamHandle) {
  check_indices("embedding", ids, 1, B * T, 1, V);
  dispatch_floating(dtype, "embedding", [&](auto tag) {
    using T_ = decltype(tag);
    using A = acc_t<T_>;
    const T_* tok = static_cast<const T_*>(wte);
    const T_* pos = static_cast<const T_*>(wpe);
    T_* y = static_cast<T_*>(out);
    parallel_for(B * T, grain_for(C), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T_* a = tok + ids[r] * C;
        const T_* b = pos + r % T * C;
        for (int64_t c = 0; c < C; ++c) y[r * C + c] = T_(A(a[c]) + A(b[c]));
      }
    });
  });
}

void embedding_sum_backward(void* d_wte, void* d_wpe, const void* grad, const int64_t* ids, int64_t B, int64_t T,
                            int64_t C, int64_t V, DType dtype, StreamHandle) {
  if (d_wte) check_indices("embedding backward", ids, 1, B * T, 1, V);
  dispatch_floating(dtype, "embedding backward", [&](auto tag) {
    using T_ = decltype(tag);
    using A = acc_t<T_>;
    const T_* g = static_cast<const T_*>(grad);
    auto* dt = static_cast<T_*>(d_wte);
    auto* dp = static_cast<T_*>(d_wpe);
    // Threads split the columns and walk the rows in order, as index_add: deterministic.
    const int64_t blocks = (C + kInnerBlock - 1) / kInnerBlock;
    parallel_for(blocks, grain_for(B * T * std::min(C, kInnerBlock)), [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t c0 = k * kInnerBlock, c1 = std::min(C, c0 + kInnerBlock);
        for (int64_t t = 0; dp && t < T; ++t)
          for (int64_t c = c0; c < c1; ++c) {
            A s = 0;
            for (int64_t b = 0; b < B; ++b) s += A(g[(b * T + t) * C + c]);
            dp[t * C + c] = T_(s);
          }
        for (int64_t r = 0; dt && r < B * T; ++r)
          for (int64_t c = c0; c < c1; ++c) add_into(dt[ids[r] * C + c], g[r * C + c]);
      }
    });
  });
}

}  // namespace loom::cpu
