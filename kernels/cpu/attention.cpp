// Scaled-dot-product attention on the CPU: the reference for the CUDA kernels.
//
// Written to be plainly the formulas of kernels/table.h, one (batch, head) at a time: the
// slices of q, k, v (and out, dout) are converted once to the accumulation type (f64 for
// f64, f32 otherwise), then each query row is a numerically stable softmax over its
// visible keys (shift by the row maximum, one exp per score). Nothing of size
// q_len x kv_len is kept: a row's scores live in a kv_len buffer. The forward runs
// threads over (b, h, block of query rows); the backward over (b, h), since dk and dv sum
// over every query row.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

constexpr int64_t kRowsPerTask = 16;

// Keys [0, visible_keys(i)) are visible to query row i.
int64_t visible_keys(const AttentionArgs& a, int64_t i) {
  return a.causal ? std::min(a.kv_len, i + 1) : a.kv_len;
}

template <class A, class T> void widen(std::vector<A>& dst, const T* src, int64_t n) {
  dst.resize(size_t(n));
  for (int64_t e = 0; e < n; ++e) dst[size_t(e)] = A(src[e]);
}

template <class A> A dot(const A* x, const A* y, int64_t n) {
  A s = 0;
  for (int64_t d = 0; d < n; ++d) s += x[d] * y[d];
  return s;
}

template <class T> void forward_typed(const AttentionArgs& a, T* out, acc_t<T>* lse, const T* q, const T* k, const T* v) {
  using A = acc_t<T>;
  const int64_t D = a.head_dim, Tq = a.q_len, Tk = a.kv_len, heads = a.batch * a.heads;
  const int64_t blocks = (Tq + kRowsPerTask - 1) / kRowsPerTask;
  const A scale = A(a.scale);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, kRowsPerTask * Tk * D));
  parallel_for(heads * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<A> kh, vh, qi, p, acc(static_cast<size_t>(D));
    int64_t loaded = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, i0 = task % blocks * kRowsPerTask;
      if (bh != loaded) {
        widen(kh, k + bh * Tk * D, Tk * D);
        widen(vh, v + bh * Tk * D, Tk * D);
        loaded = bh;
      }
      for (int64_t i = i0; i < std::min(Tq, i0 + kRowsPerTask); ++i) {
        widen(qi, q + (bh * Tq + i) * D, D);
        const int64_t n = visible_keys(a, i);
        p.resize(size_t(n));
        A m = -std::numeric_limits<A>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          p[size_t(j)] = scale * dot(qi.data(), kh.data() + j * D, D);
          m = std::max(m, p[size_t(j)]);
        }
        std::fill(acc.begin(), acc.end(), A(0));
        A l = 0;
        for (int64_t j = 0; j < n; ++j) {
          const A e = std::exp(p[size_t(j)] - m);
          l += e;
          const A* vj = vh.data() + j * D;
          for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += e * vj[d];
        }
        T* o = out + (bh * Tq + i) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = T(n > 0 ? acc[size_t(d)] / l : A(0));
        lse[bh * Tq + i] = n > 0 ? m + std::log(l) : -std::numeric_limits<A>::infinity();
      }
    }
  });
}

template <class T>
void backward_typed(const AttentionArgs& a, T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                    const T* out, const acc_t<T>* lse) {
  using A = acc_t<T>;
  const int64_t D = a.head_dim, Tq = a.q_len, Tk = a.kv_len, heads = a.batch * a.heads;
  const A scale = A(a.scale);
  parallel_for(heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> qh, kh, vh, doh, oh, dqh, dkh, dvh;
    for (int64_t bh = begin; bh < end; ++bh) {
      widen(qh, q + bh * Tq * D, Tq * D);
      widen(doh, dout + bh * Tq * D, Tq * D);
      widen(oh, out + bh * Tq * D, Tq * D);
      widen(kh, k + bh * Tk * D, Tk * D);
      widen(vh, v + bh * Tk * D, Tk * D);
      dqh.assign(size_t(Tq * D), A(0));
      dkh.assign(size_t(Tk * D), A(0));
      dvh.assign(size_t(Tk * D), A(0));
      for (int64_t i = 0; i < Tq; ++i) {
        const A* qi = qh.data() + i * D;
        const A* doi = doh.data() + i * D;
        const A di = dot(doi, oh.data() + i * D, D);
        const A l = A(lse[bh * Tq + i]);
        A* dqi = dqh.data() + i * D;
        const int64_t n = visible_keys(a, i);
        for (int64_t j = 0; j < n; ++j) {
          const A* kj = kh.data() + j * D;
          const A* vj = vh.data() + j * D;
          const A p = std::exp(scale * dot(qi, kj, D) - l);
          const A ds = p * (dot(doi, vj, D) - di);
          A* dkj = dkh.data() + j * D;
          A* dvj = dvh.data() + j * D;
          for (int64_t d = 0; d < D; ++d) {
            dvj[d] += p * doi[d];
            dkj[d] += ds * qi[d];
            dqi[d] += ds * kj[d];
          }
        }
      }
      for (int64_t e = 0; e < Tq * D; ++e) dq[bh * Tq * D + e] = T(scale * dqh[size_t(e)]);
      for (int64_t e = 0; e < Tk * D; ++e) {
        dk[bh * Tk * D + e] = T(scale * dkh[size_t(e)]);
        dv[bh * Tk * D + e] = T(dvh[size_t(e)]);
      }
    }
  });
}

}  // namespace

size_t attention_workspace_size(const AttentionArgs&) { return 0; }

void attention_forward(const AttentionArgs& args, void* out, void* lse, const void* q, const void* k, const void* v,
                       StreamHandle) {
  if (args.batch * args.heads * args.q_len == 0) return;
  dispatch_floating(args.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    forward_typed(args, static_cast<T*>(out), static_cast<acc_t<T>*>(lse), static_cast<const T*>(q),
                  static_cast<const T*>(k), static_cast<const T*>(v));
  });
}

void attention_backward(const AttentionArgs& args, void* dq, void* dk, void* dv, const void* dout, const void* q,
                        const void* k, const void* v, const void* out, const void* lse, void*, StreamHandle) {
  if (args.batch * args.heads == 0) return;
  dispatch_floating(args.dtype, "attention backward", [&](auto tag) {
    using T = decltype(tag);
    backward_typed(args, static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv), static_cast<const T*>(dout),
                   static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                   static_cast<const T*>(out), static_cast<const acc_t<T>*>(lse));
  });
}

}  // namespace loom::cpu
