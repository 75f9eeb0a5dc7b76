// Scaled-dot-product attention on the CPU: the reference for the CUDA kernels.
//
// Written to be plainly the formulas of kernels/table.h, one (batch, head) at a time: the
// rows of q, k, v (and out, dout) of that head are gathered once through their strides and
// converted to the accumulation type (f64 for f64, f32 otherwise), then each query row is a
// numerically stable softmax over its visible keys (shift by the row maximum, one exp per
// score). Nothing of size q_len x kv_len is kept: a block of four rows' scores lives in a
// (4, kv_len) buffer. k (and v, in the backward) are also gathered transposed, (D, kv_len), so
// that a row's products with every key are summed across keys at once (`dots`), which
// vectorises and adds each product's terms in the same order as a plain dot product. Query
// rows go in blocks of four so that each key's and value's row is read once for the block's
// four sums; every sum still takes its terms in increasing key (or query) order. In f32 (the
// accumulation type of f32, bf16 and f16) exp is exp_f32.h's, which vectorises (the C
// library's expf is a call, one per score, that the compiler cannot); the f64 path keeps the
// C library's, and gives the same bits as a row at a time did. The loops are compiled for the
// baseline and for AVX2 (kernels/cpu/vector_isa.h: the same bits), the AVX2 copy running where
// the CPU has it.
// The forward runs threads over (b, h, block of query rows); the backward over (b, h),
// since dk and dv sum over every query row.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/cpu/exp_f32.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/vector_isa.h"

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
template <class A, class T>
LOOM_INLINE void widen(std::vector<A>& dst, const T* src, int64_t n, int64_t seq, int64_t D) {
  dst.resize(size_t(n * D));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) dst[size_t(r * D + d)] = A(src[r * seq + d]);
}

template <class A> LOOM_INLINE A dot(const A* x, const A* y, int64_t n) {
  A s = 0;
  for (int64_t d = 0; d < n; ++d) s += x[d] * y[d];
  return s;
}

// The (D, n) transpose of n rows of D elements, `seq` apart, in the accumulation type.
template <class A, class T>
LOOM_INLINE void widen_transposed(std::vector<A>& dst, const T* src, int64_t n, int64_t seq, int64_t D) {
  dst.resize(size_t(n * D));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) dst[size_t(d * n + r)] = A(src[r * seq + d]);
}

// s[j] = dot(x, row j) for j < count, from the rows' (D, n) transpose mT: each sum is dot's,
// term by term in the same order, but the loop runs across j, which vectorises, where dot's
// runs along one row's D elements and cannot without reordering. Four of x's elements are
// added a pass, so s goes through memory D / 4 times, not D.
template <class A>
LOOM_INLINE void dots(A* __restrict s, const A* x, const A* mT, int64_t n, int64_t count, int64_t D) {
  std::fill(s, s + count, A(0));
  int64_t d = 0;
  for (; d + 4 <= D; d += 4) {
    const A x0 = x[d], x1 = x[d + 1], x2 = x[d + 2], x3 = x[d + 3];
    const A *__restrict c0 = mT + d * n, *__restrict c1 = c0 + n, *__restrict c2 = c1 + n, *__restrict c3 = c2 + n;
    for (int64_t j = 0; j < count; ++j) s[j] = (((s[j] + x0 * c0[j]) + x1 * c1[j]) + x2 * c2[j]) + x3 * c3[j];
  }
  for (; d < D; ++d) {
    const A xd = x[d];
    const A* __restrict col = mT + d * n;
    for (int64_t j = 0; j < count; ++j) s[j] += xd * col[j];
  }
}

// exp in the accumulation type: f32 by kernels/cpu/exp_f32.h, so that a row's loop over its
// scores vectorises; f64 by the C library's, as the float64 gradient checks expect.
template <class A> LOOM_INLINE A exp_acc(A x) {
  if constexpr (std::is_same_v<A, float>) {
    return exp_f32(x);
  } else {
    return std::exp(x);
  }
}

// Query rows are taken kRowBlock at a time: each key's (and value's) row is read once for
// the block, and the block's accumulators take one term each from it.
constexpr int64_t kRowBlock = 4;

// out[r][d] += sum over j < n[r] of coef[r][j] x_rows[j][d], for the `rows` rows of a block
// (n nondecreasing in r), each sum term by term in increasing j. x_rows is (n[rows - 1], D)
// dense; coef rows are `ld` apart.
template <class A>
LOOM_INLINE void add_combinations(A* const* out, const A* coef, int64_t ld, const int64_t* n, int64_t rows,
                                  const A* x_rows, int64_t D) {
  int64_t j = 0;
  if (rows == kRowBlock) {
    // Every row of the block sees keys below n[0]: four sums a key.
    A *__restrict o0 = out[0], *__restrict o1 = out[1], *__restrict o2 = out[2], *__restrict o3 = out[3];
    for (; j < n[0]; ++j) {
      const A c0 = coef[j], c1 = coef[ld + j], c2 = coef[2 * ld + j], c3 = coef[3 * ld + j];
      const A* __restrict x = x_rows + j * D;
      for (int64_t d = 0; d < D; ++d) {
        o0[d] += c0 * x[d];
        o1[d] += c1 * x[d];
        o2[d] += c2 * x[d];
        o3[d] += c3 * x[d];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    A* __restrict o = out[r];
    for (int64_t jr = j; jr < n[r]; ++jr) {
      const A c = coef[r * ld + jr];
      const A* __restrict x = x_rows + jr * D;
      for (int64_t d = 0; d < D; ++d) o[d] += c * x[d];
    }
  }
}

// dst[j][d] += sum over the block's rows r with j < n[r] of coef[r][j] src_r[d], in
// increasing r, for every j < n[rows - 1]: the block's terms of a sum over query rows, whose
// earlier terms came from the blocks before.
template <class A>
LOOM_INLINE void add_transposed(A* dst, const A* coef, int64_t ld, const int64_t* n, int64_t rows,
                                const A* const* src, int64_t D) {
  int64_t first = 0;  // the first row of the block that sees key j
  for (int64_t j = 0; j < n[rows - 1]; ++j) {
    while (n[first] <= j) ++first;
    A* __restrict o = dst + j * D;
    if (first == 0 && rows == kRowBlock) {
      const A c0 = coef[j], c1 = coef[ld + j], c2 = coef[2 * ld + j], c3 = coef[3 * ld + j];
      const A *__restrict s0 = src[0], *__restrict s1 = src[1], *__restrict s2 = src[2], *__restrict s3 = src[3];
      for (int64_t d = 0; d < D; ++d) o[d] = (((o[d] + c0 * s0[d]) + c1 * s1[d]) + c2 * s2[d]) + c3 * s3[d];
    } else {
      for (int64_t r = first; r < rows; ++r) {
        const A c = coef[r * ld + j];
        const A* __restrict s = src[r];
        for (int64_t d = 0; d < D; ++d) o[d] += c * s[d];
      }
    }
  }
}

// Everything a kernel's threads read: the arguments and each operand's rows.
template <class T> struct Operands {
  using A = acc_t<T>;
  const AttentionArgs& a;
  int64_t D, Tq, Tk;
  A scale;
  Rows<const T> q, k, v, out_in, dout;
  Rows<T> out, dq, dk, dv;
  // The forward writes out (out_in unused); the backward reads out_in (out null).
  Operands(const AttentionArgs& a, const T* q_ptr, const T* k_ptr, const T* v_ptr, const T* out_in_ptr, T* out_ptr,
           const T* dout_ptr, T* dq_ptr, T* dk_ptr, T* dv_ptr)
      : a(a), D(a.head_dim), Tq(a.q_len), Tk(a.kv_len), scale(A(a.scale)),
        q(q_ptr, a.strides.q, a.heads, Tq, D), k(k_ptr, a.strides.k, a.heads, Tk, D),
        v(v_ptr, a.strides.v, a.heads, Tk, D), out_in(out_in_ptr, a.strides.out, a.heads, Tq, D),
        dout(dout_ptr, a.strides.dout, a.heads, Tq, D), out(out_ptr, a.strides.out, a.heads, Tq, D),
        dq(dq_ptr, a.strides.dq, a.heads, Tq, D), dk(dk_ptr, a.strides.dk, a.heads, Tk, D),
        dv(dv_ptr, a.strides.dv, a.heads, Tk, D) {}
};

// Forward tasks [begin, end): task t is rows [t % tasks_per_head * kRowsPerTask, +
// kRowsPerTask) of head t / tasks_per_head.
template <class T> LOOM_INLINE void forward_tasks(const Operands<T>& o, acc_t<T>* lse, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t D = o.D, Tq = o.Tq, Tk = o.Tk, tasks_per_head = (Tq + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<A> kt, vh, qi, p(size_t(kRowBlock * Tk)), acc(size_t(kRowBlock * D));
  int64_t loaded = -1;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t bh = task / tasks_per_head, first_row = task % tasks_per_head * kRowsPerTask;
    if (bh != loaded) {
      widen_transposed(kt, o.k.head(bh), Tk, o.k.s.seq, D);
      widen(vh, o.v.head(bh), Tk, o.v.s.seq, D);
      loaded = bh;
    }
    const T* qh = o.q.head(bh);
    T* oh = o.out.head(bh);
    const int64_t last_row = std::min(Tq, first_row + kRowsPerTask);
    for (int64_t i0 = first_row; i0 < last_row; i0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, last_row - i0);
      int64_t n[kRowBlock];
      A l[kRowBlock];
      A* acc_rows[kRowBlock];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        widen(qi, qh + i * o.q.s.seq, 1, 0, D);
        n[r] = visible_keys(o.a, i);
        A* pr = p.data() + r * Tk;
        A m = -std::numeric_limits<A>::infinity();
        dots(pr, qi.data(), kt.data(), Tk, n[r], D);
        for (int64_t j = 0; j < n[r]; ++j) {
          pr[j] = o.scale * pr[j];
          m = std::max(m, pr[j]);
        }
        for (int64_t j = 0; j < n[r]; ++j) pr[j] = exp_acc(pr[j] - m);
        A sum = 0;
        for (int64_t j = 0; j < n[r]; ++j) sum += pr[j];
        l[r] = sum;
        lse[bh * Tq + i] = n[r] > 0 ? m + std::log(sum) : -std::numeric_limits<A>::infinity();
        acc_rows[r] = acc.data() + r * D;
        std::fill(acc_rows[r], acc_rows[r] + D, A(0));
      }
      add_combinations(acc_rows, p.data(), Tk, n, rows, vh.data(), D);
      for (int64_t r = 0; r < rows; ++r) {
        T* out = oh + (i0 + r) * o.out.s.seq;
        for (int64_t d = 0; d < D; ++d) out[d] = T(n[r] > 0 ? acc_rows[r][d] / l[r] : A(0));
      }
    }
  }
}


template <class T> void forward_typed(const AttentionArgs& a, T* out_ptr, acc_t<T>* lse, const T* q_ptr,
                                      const T* k_ptr, const T* v_ptr) {
  const Operands<T> o(a, q_ptr, k_ptr, v_ptr, nullptr, out_ptr, nullptr, nullptr, nullptr, nullptr);
  const int64_t tasks_per_head = (o.Tq + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, kRowsPerTask * o.Tk * o.D));
  parallel_for(a.batch * a.heads * tasks_per_head, grain, [&](int64_t begin, int64_t end) {
    vector_isa::run_copy([&]() LOOM_INLINE_LAMBDA { forward_tasks(o, lse, begin, end); });
  });
}

// dst rows (n, D), `seq` apart, = scale * src (n, D) dense, rounded to T.
template <class T, class A>
LOOM_INLINE void narrow(T* dst, int64_t seq, const std::vector<A>& src, int64_t n, int64_t D, A scale) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) dst[r * seq + d] = T(scale * src[size_t(r * D + d)]);
}

// Backward of heads [begin, end). With P the probabilities and dS = P (dP - rowsum(dout o)),
// dP = dout v^T:
//   dv = P^T dout,  dk = scale dS^T q,  dq = scale dS k
// A block of query rows at a time: its rows of P and dS, then its terms of every sum.
template <class T>
LOOM_INLINE void backward_heads(const Operands<T>& o, const acc_t<T>* lse, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t D = o.D, Tq = o.Tq, Tk = o.Tk;
  std::vector<A> qh, kh, kt, vt, doh, oh, dqh, dkh, dvh;
  std::vector<A> p(size_t(kRowBlock * Tk)), ds(size_t(kRowBlock * Tk));
  for (int64_t bh = begin; bh < end; ++bh) {
    widen(qh, o.q.head(bh), Tq, o.q.s.seq, D);
    widen(doh, o.dout.head(bh), Tq, o.dout.s.seq, D);
    widen(oh, o.out_in.head(bh), Tq, o.out_in.s.seq, D);
    widen(kh, o.k.head(bh), Tk, o.k.s.seq, D);
    widen_transposed(kt, o.k.head(bh), Tk, o.k.s.seq, D);
    widen_transposed(vt, o.v.head(bh), Tk, o.v.s.seq, D);
    dqh.assign(size_t(Tq * D), A(0));
    dkh.assign(size_t(Tk * D), A(0));
    dvh.assign(size_t(Tk * D), A(0));
    for (int64_t i0 = 0; i0 < Tq; i0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, Tq - i0);
      int64_t n[kRowBlock];
      A* dq_rows[kRowBlock];
      const A *q_rows[kRowBlock], *do_rows[kRowBlock];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const A* qi = qh.data() + i * D;
        const A* doi = doh.data() + i * D;
        const A di = dot(doi, oh.data() + i * D, D);
        const A l = A(lse[bh * Tq + i]);
        n[r] = visible_keys(o.a, i);
        A* pr = p.data() + r * Tk;
        A* dsr = ds.data() + r * Tk;
        dots(pr, qi, kt.data(), Tk, n[r], D);    // q_i . k_j
        dots(dsr, doi, vt.data(), Tk, n[r], D);  // dout_i . v_j
        for (int64_t j = 0; j < n[r]; ++j) {
          const A pj = exp_acc(o.scale * pr[j] - l);
          dsr[j] = pj * (dsr[j] - di);
          pr[j] = pj;
        }
        dq_rows[r] = dqh.data() + i * D;
        q_rows[r] = qi;
        do_rows[r] = doi;
      }
      add_combinations(dq_rows, ds.data(), Tk, n, rows, kh.data(), D);
      add_transposed(dkh.data(), ds.data(), Tk, n, rows, q_rows, D);
      add_transposed(dvh.data(), p.data(), Tk, n, rows, do_rows, D);
    }
    narrow(o.dq.head(bh), o.dq.s.seq, dqh, Tq, D, o.scale);
    narrow(o.dk.head(bh), o.dk.s.seq, dkh, Tk, D, o.scale);
    narrow(o.dv.head(bh), o.dv.s.seq, dvh, Tk, D, A(1));
  }
}


// AttentionArgs::column_sums from the gradients as written: each (operand, head, column)'s
// sum over batch and rows, in double, then rounded once to the accumulation type.
template <class T> void column_sums(const Operands<T>& o, acc_t<T>* sums) {
  using A = acc_t<T>;
  const int64_t H = o.a.heads, D = o.D;
  const Rows<T>* grads[3] = {&o.dq, &o.dk, &o.dv};
  const int64_t lens[3] = {o.Tq, o.Tk, o.Tk};
  parallel_for(3 * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sum(static_cast<size_t>(D));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t which = task / H, h = task % H;
      const Rows<T>& g = *grads[which];
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t b = 0; b < o.a.batch; ++b) {
        const T* rows = g.head(b * H + h);
        for (int64_t t = 0; t < lens[which]; ++t)
          for (int64_t d = 0; d < D; ++d) sum[size_t(d)] += double(A(rows[t * g.s.seq + d]));
      }
      for (int64_t d = 0; d < D; ++d) sums[task * D + d] = A(sum[size_t(d)]);
    }
  });
}

template <class T>
void backward_typed(const AttentionArgs& a, T* dq_ptr, T* dk_ptr, T* dv_ptr, const T* dout_ptr, const T* q_ptr,
                    const T* k_ptr, const T* v_ptr, const T* out_ptr, const acc_t<T>* lse) {
  const Operands<T> o(a, q_ptr, k_ptr, v_ptr, out_ptr, nullptr, dout_ptr, dq_ptr, dk_ptr, dv_ptr);
  parallel_for(a.batch * a.heads, 1, [&](int64_t begin, int64_t end) {
    vector_isa::run_copy([&]() LOOM_INLINE_LAMBDA { backward_heads(o, lse, begin, end); });
  });
  if (a.column_sums) column_sums(o, static_cast<acc_t<T>*>(a.column_sums));
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
  if (args.batch * args.heads == 0) {
    const size_t acc_bytes = args.dtype == DType::f64 ? sizeof(double) : sizeof(float);
    if (args.column_sums) std::memset(args.column_sums, 0, size_t(3 * args.heads * args.head_dim) * acc_bytes);
    return;
  }
  dispatch_floating(args.dtype, "attention backward", [&](auto tag) {
    using T = decltype(tag);
    backward_typed(args, static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv), static_cast<const T*>(dout),
                   static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                   static_cast<const T*>(out), static_cast<const acc_t<T>*>(lse));
  });
}

}  // namespace loom::cpu
