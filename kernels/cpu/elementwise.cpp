// Elementwise kernels on the CPU: fill, copy, arange, unary and its backward, binary, where.
// They are the reference the CUDA kernels in kernels/cuda/elementwise.cu are tested against.
//
// Every entry but arange runs through one walker. The operands' shapes and strides are
// coalesced (size-1 dimensions dropped, neighbours merged where every operand is contiguous
// across them), the element range is split over threads, and each thread walks its part
// row by row, a row being a run along the innermost dimension. A row whose operands all
// have unit stride is a plain loop the compiler vectorises; broadcast (stride 0) and
// strided rows take the general loop. Each op's math is written once, in the accumulation
// type (f32 for bf16/f16), as a template over the op so the loops inline it; it lives in
// kernels/cpu/elementwise_ops.h, beside its CUDA twin kernels/cuda/elementwise_ops.cuh.
//
// Semantics the table leaves open, shared with the CUDA kernels:
// - Integer arithmetic wraps (two's complement). Integer division truncates toward zero;
//   x / 0 is defined as 0 and MIN / -1 as MIN; x^p for p < 0 is 1 / x^-p under that rule.
// - The *_scalar ops on integers take an integral scalar, converted as an integer would be
//   (it wraps: u8 x + -1 is x - 1).
// - Float to integer truncates toward zero, saturates at the type's range, and maps NaN
//   to 0; integer to integer wraps; f64 to bf16/f16 rounds once (nearest even), not via f32.
// - maximum/minimum propagate NaN; relu and sign keep it.
#include <algorithm>
#include <array>
#include <tuple>
#include <utility>

#include "kernels/cpu/common.h"
#include "kernels/cpu/elementwise_ops.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

using namespace elementwise;

constexpr int64_t kGrain = 1 << 15;  // elements per thread hand-off

// ---- the walker ---------------------------------------------------------------------

// Calls row(len, at, step) for runs along the innermost dimension, in parallel; at[k] is
// operand k's element offset at the start of the run, step[k] its innermost stride.
template <int K, class Row>
void walk_rows(const Walk<K>& w, const Row& row) {
  const int last = w.ndim - 1;
  const int64_t inner = w.shape[last];
  int64_t n = 1;
  for (int d = 0; d < w.ndim; ++d) n *= w.shape[d];
  int64_t step[K];
  for (int k = 0; k < K; ++k) step[k] = w.strides[k][last];
  parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    int64_t idx[kMaxDims] = {}, off[K] = {};
    int64_t r = begin / inner, c = begin - r * inner;
    for (int d = last - 1; d >= 0; --d) {
      idx[d] = r % w.shape[d];
      r /= w.shape[d];
      for (int k = 0; k < K; ++k) off[k] += idx[d] * w.strides[k][d];
    }
    for (int64_t pos = begin; pos < end;) {
      const int64_t len = std::min(inner - c, end - pos);
      int64_t at[K];
      for (int k = 0; k < K; ++k) at[k] = off[k] + c * step[k];
      row(len, at, step);
      pos += len;
      c = 0;
      for (int d = last - 1; d >= 0; --d) {  // carry into the next row
        for (int k = 0; k < K; ++k) off[k] += w.strides[k][d];
        if (++idx[d] < w.shape[d]) break;
        for (int k = 0; k < K; ++k) off[k] -= w.strides[k][d] * w.shape[d];
        idx[d] = 0;
      }
    }
  });
}

template <class O, class F, class... T, size_t... J>
void run_row(int64_t n, const int64_t* at, const int64_t* st, const F& f, O* out, std::index_sequence<J...>,
             const T*... in) {
  O* o = out + at[0];
  const std::tuple<const T*...> p{(in + at[J + 1])...};
  if (st[0] == 1 && ((st[J + 1] == 1) && ...)) {
    for (int64_t i = 0; i < n; ++i) o[i] = f(std::get<J>(p)[i]...);
  } else {
    for (int64_t i = 0; i < n; ++i) o[i * st[0]] = f(std::get<J>(p)[i * st[J + 1]]...);
  }
}

// out[i] = f(in[i]...): O is out's element type, T... the inputs'.
template <class O, class... T, class F, class... S>
void apply(const F& f, const Strided& out, const S&... in) {
  static_assert(sizeof...(T) == sizeof...(S));
  constexpr int K = 1 + int(sizeof...(T));
  const Walk<K> w = coalesce<K>({&out, &in...});
  O* o = static_cast<O*>(out.data);
  const std::tuple<const T*...> p{static_cast<const T*>(in.data)...};
  walk_rows(w, [&](int64_t len, const int64_t* at, const int64_t* step) {
    std::apply([&](const T*... ptr) { run_row(len, at, step, f, o, std::index_sequence_for<T...>{}, ptr...); }, p);
  });
}

}  // namespace

// ---- entries ------------------------------------------------------------------------

void fill(const Strided& out, double value, StreamHandle) {
  dispatch_all(out.dtype, [&](auto t) {
    using T = decltype(t);
    const T v = convert<T>(value);
    apply<T>([v] { return v; }, out);
  });
}

void copy(const Strided& out, const Strided& in, StreamHandle) {
  dispatch_all(in.dtype, [&](auto from) {
    using From = decltype(from);
    dispatch_all(out.dtype, [&](auto to) {
      using To = decltype(to);
      apply<To, From>([](From v) { return convert<To>(v); }, out, in);
    });
  });
}

void arange(const Strided& out, double start, double step, StreamHandle) {
  LOOM_ASSERT(out.is_contiguous(), "arange writes a contiguous output");
  dispatch_all(out.dtype, [&](auto t) {
    using T = decltype(t);
    T* o = static_cast<T*>(out.data);
    parallel_for(out.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = convert<T>(start + double(i) * step);
    });
  });
}

void unary(UnaryOp op, const Strided& out, const Strided& in, double param, StreamHandle) {
  LOOM_ASSERT(out.dtype == in.dtype, "unary ", op_name(op), ": out and in must share a dtype");
  dispatch_all(in.dtype, [&](auto t) {
    using T = decltype(t);
    with_op(op, [&](auto c) {
      constexpr UnaryOp o = decltype(c)::value;
      if constexpr (std::is_floating_point_v<acc_t<T>>) {
        using A = acc_t<T>;
        const A p = A(param);
        apply<T, T>([p](T x) { return T(unary_float<o>(A(x), p)); }, out, in);
      } else if constexpr (integer_ok(o)) {
        const T p = integer_scalar<T>(o, param, in.dtype);
        apply<T, T>([p](T x) { return unary_int<o>(x, p); }, out, in);
      } else {
        LOOM_FAIL("unary ", op_name(o), " needs a floating-point dtype, got ", dtype_name(in.dtype));
      }
    });
  });
}

void unary_backward(UnaryOp op, const Strided& grad_in, const Strided& grad_out, const Strided& in,
                    const Strided& out, double param, StreamHandle) {
  dispatch_floating(in.dtype, "unary_backward", [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    const A p = A(param);
    with_op(op, [&](auto c) {
      constexpr UnaryOp o = decltype(c)::value;
      apply<T, T, T, T>([p](T go, T x, T y) { return T(unary_grad<o>(A(go), A(x), A(y), p)); }, grad_in,
                        grad_out, in, out);
    });
  });
}

void binary(BinaryOp op, const Strided& out, const Strided& a, const Strided& b, StreamHandle) {
  LOOM_ASSERT(a.dtype == b.dtype && out.dtype == (is_comparison(op) ? DType::u8 : a.dtype),
              "binary: a and b must share a dtype, and out must be u8 for comparisons or that dtype");
  dispatch_all(a.dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    with_op(op, [&](auto c) {
      constexpr BinaryOp o = decltype(c)::value;
      if constexpr (is_comparison(o)) {
        apply<uint8_t, T, T>([](T x, T y) { return binary_math<o>(A(x), A(y)); }, out, a, b);
      } else {
        apply<T, T, T>([](T x, T y) { return T(binary_math<o>(A(x), A(y))); }, out, a, b);
      }
    });
  });
}

void where(const Strided& out, const Strided& cond, const Strided& a, const Strided& b, StreamHandle) {
  LOOM_ASSERT(cond.dtype == DType::u8 && a.dtype == b.dtype && out.dtype == a.dtype,
              "where: cond must be u8, and a, b, out share a dtype");
  dispatch_all(a.dtype, [&](auto t) {
    using T = decltype(t);
    apply<T, uint8_t, T, T>([](uint8_t c, T x, T y) { return c ? x : y; }, out, cond, a, b);
  });
}

}  // namespace loom::cpu
