// Scaled-dot-product attention on the CPU: the reference for the CUDA kernels.
//
// Written to be plainly the formulas of kernels/table.h, one (batch, head) at a time: the
// rows of q, k, v (and out, dout) of that head are gathered once through their strides and
// converted to the accumulation type (f64 for f64, f32 otherwise), then each query row is a
// numerically stable softmax over its visible keys (shift by the row maximum, one exp per
// score). Nothing of size q_len x kv_len is kept: a row's scores live in a kv_len buffer.
// k (and v, in the backward) are also gathered transposed, (D, kv_len), so that a row's
// products with every key are summed across keys at once (`dots`), which vectorises and adds
// each product's terms in the same order as a plain dot product: the same bits.
// The forward runs threads over (b, h, block of query rows); the backward over (b, h),
// since dk and dv sum over every query row.
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

// One operand: head(bh) points at row 0 of head bh = b * heads + h, rows `seq` apart.
template <class T> struct Rows {
  T* base;
  AttentionStrides s;
  int64_t heads;
  Rows(T* base, const AttentionStrides& given, int64_t heads, int64_t len, int64_t head_dim)
      : base(base), s(given.resolve(heads, len, head_dim)), heads(heads) {}
  T* head(int64_t bh) const { return base + bh / heads * s.batch + bh % heads * s.head; }
};

// n rows of D elements, `seq` apart, into a dense (n, D) buffer in the accumulation type.
template <class A, class T> void widen(std::vector<A>& dst, const T* src, int64_t n, int64_t seq, int64_t D) {
  dst.resize(size_t(n * D));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) dst[size_t(r * D + d)] = A(src[r * seq + d]);
}

template <class A> A dot(const A* x, const A* y, int64_t n) {
  A s = 0;
  for (int64_t d = 0; d < n; ++d) s += x[d] * y[d];
  return s;
}

// The (D, n) transpose of n rows of D elements, `seq` apart, in the accumulation type.
template <class A, class T> void widen_transposed(std::vector<A>& dst, const T* src, int64_t n, int64_t seq, int64_t D) {
  dst.resize(size_t(n * D));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) dst[size_t(d * n + r)] = A(src[r * seq + d]);
}

// s[j] = dot(x, row j) for j < count, from the rows' (D, n) transpose mT: each sum is dot's,
// term by term in the same order (so the same bits), but the loop runs across j, which
// vectorises, where dot's runs along one row's D elements and cannot without reordering.
template <class A> void dots(A* s, const A* x, const A* mT, int64_t n, int64_t count, int64_t D) {
  std::fill(s, s + count, A(0));
  for (int64_t d = 0; d < D; ++d) {
    const A xd = x[d];
    const A* col = mT + d * n;
    for (int64_t j = 0; j < count; ++j) s[j] += xd * col[j];
  }
}

template <class T> void forward_typed(const AttentionArgs& a, T* out_ptr, acc_t<T>* lse, const T* q_ptr,
                                      const T* k_ptr, const T* v_ptr) {
  using A = acc_t<T>;
  const int64_t D = a.head_dim, Tq = a.q_len, Tk = a.kv_len, heads = a.batch * a.heads;
  const Rows<const T> q(q_ptr, a.strides.q, a.heads, Tq, D), k(k_ptr, a.strides.k, a.heads, Tk, D),
      v(v_ptr, a.strides.v, a.heads, Tk, D);
  const Rows<T> out(out_ptr, a.strides.out, a.heads, Tq, D);
  const int64_t blocks = (Tq + kRowsPerTask - 1) / kRowsPerTask;
  const A scale = A(a.scale);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, kRowsPerTask * Tk * D));
  parallel_for(heads * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<A> kt, vh, qi, p, acc(static_cast<size_t>(D));
    int64_t loaded = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, i0 = task % blocks * kRowsPerTask;
      if (bh != loaded) {
        widen_transposed(kt, k.head(bh), Tk, k.s.seq, D);
        widen(vh, v.head(bh), Tk, v.s.seq, D);
        loaded = bh;
      }
      const T* qh = q.head(bh);
      T* oh = out.head(bh);
      for (int64_t i = i0; i < std::min(Tq, i0 + kRowsPerTask); ++i) {
        widen(qi, qh + i * q.s.seq, 1, 0, D);
        const int64_t n = visible_keys(a, i);
        p.resize(size_t(n));
        A m = -std::numeric_limits<A>::infinity();
        dots(p.data(), qi.data(), kt.data(), Tk, n, D);
        for (int64_t j = 0; j < n; ++j) {
          p[size_t(j)] = scale * p[size_t(j)];
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
        T* o = oh + i * out.s.seq;
        for (int64_t d = 0; d < D; ++d) o[d] = T(n > 0 ? acc[size_t(d)] / l : A(0));
        lse[bh * Tq + i] = n > 0 ? m + std::log(l) : -std::numeric_limits<A>::infinity();
      }
    }
  });
}

// dst rows (n, D), `seq` apart, = scale * src (n, D) dense, rounded to T.
template <class T, class A> void narrow(T* dst, int64_t seq, const std::vector<A>& src, int64_t n, int64_t D, A scale) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) dst[r * seq + d] = T(scale * src[size_t(r * D + d)]);
}

template <class T>
void backward_typed(const AttentionArgs& a, T* dq_ptr, T* dk_ptr, T* dv_ptr, const T* dout_ptr, const T* q_ptr,
                    const T* k_ptr, const T* v_ptr, const T* out_ptr, const acc_t<T>* lse) {
  using A = acc_t<T>;
  const int64_t D = a.head_dim, Tq = a.q_len, Tk = a.kv_len, heads = a.batch * a.heads;
  const Rows<const T> q(q_ptr, a.strides.q, a.heads, Tq, D), k(k_ptr, a.strides.k, a.heads, Tk, D),
      v(v_ptr, a.strides.v, a.heads, Tk, D), out(out_ptr, a.strides.out, a.heads, Tq, D),
      dout(dout_ptr, a.strides.dout, a.heads, Tq, D);
  const Rows<T> dq(dq_ptr, a.strides.dq, a.heads, Tq, D), dk(dk_ptr, a.strides.dk, a.heads, Tk, D),
      dv(dv_ptr, a.strides.dv, a.heads, Tk, D);
  const A scale = A(a.scale);
  parallel_for(heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> qh, kh, kt, vt, doh, oh, dqh, dkh, dvh, qk, dov;
    for (int64_t bh = begin; bh < end; ++bh) {
      widen(qh, q.head(bh), Tq, q.s.seq, D);
      widen(doh, dout.head(bh), Tq, dout.s.seq, D);
      widen(oh, out.head(bh), Tq, out.s.seq, D);
      widen(kh, k.head(bh), Tk, k.s.seq, D);
      widen_transposed(kt, k.head(bh), Tk, k.s.seq, D);
      widen_transposed(vt, v.head(bh), Tk, v.s.seq, D);
      qk.resize(size_t(Tk));
      dov.resize(size_t(Tk));
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
        dots(qk.data(), qi, kt.data(), Tk, n, D);   // q_i . k_j
        dots(dov.data(), doi, vt.data(), Tk, n, D);  // dout_i . v_j
        for (int64_t j = 0; j < n; ++j) {
          const A* kj = kh.data() + j * D;
          const A p = std::exp(scale * qk[size_t(j)] - l);
          const A ds = p * (dov[size_t(j)] - di);
          A* dkj = dkh.data() + j * D;
          A* dvj = dvh.data() + j * D;
          for (int64_t d = 0; d < D; ++d) {
            dvj[d] += p * doi[d];
            dkj[d] += ds * qi[d];
            dqi[d] += ds * kj[d];
          }
        }
      }
      narrow(dq.head(bh), dq.s.seq, dqh, Tq, D, scale);
      narrow(dk.head(bh), dk.s.seq, dkh, Tk, D, scale);
      narrow(dv.head(bh), dv.s.seq, dvh, Tk, D, A(1));
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
