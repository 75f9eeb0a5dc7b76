// Reductions over the middle axis of a canonical (outer, R, inner) buffer, on the CPU.
//
// This is the reference the CUDA kernels are tested against, so accuracy comes first:
// sums are pairwise (rounding error grows with log R, not R), 16-bit floats accumulate in
// f32, f32 in f32, f64 in f64 and integers in i64. max/min propagate NaN; argmax/argmin
// return the first index of the extreme value, NaN counting as the extreme.
//
// Work is split over output rows: contiguous rows (inner == 1) one at a time, otherwise
// tiles of up to kTile neighbouring columns so the loop over r reads whole cache lines.
// The tile code takes its column count and stride as template types, so rows run it with
// compile-time 1s (std::integral_constant) and their loops compile as plain row loops.
// A few very long rows (a full reduction) are cut into chunks whose partial results are
// combined in order, so a single row still uses every thread.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pairwise.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

constexpr int kTile = 64;                   // columns per work item when inner > 1
constexpr int64_t kChunk = int64_t(1) << 16;  // elements per chunk of a split row
constexpr int64_t kMaxChunks = 64;

// Integers accumulate in i64: no overflow for any realistic R, and wrapping to i32 at the
// end gives the same bits as wrapping at every step.
template <class T> using racc_t = std::conditional_t<std::is_integral_v<T>, int64_t, acc_t<T>>;

template <class A> bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) return std::isnan(v);
  else return false;
}

constexpr bool is_arg(ReduceOp op) { return op == ReduceOp::argmax || op == ReduceOp::argmin; }
constexpr bool is_sum(ReduceOp op) { return op == ReduceOp::sum || op == ReduceOp::mean; }
constexpr bool wants_max(ReduceOp op) { return op == ReduceOp::max || op == ReduceOp::argmax; }

const char* op_name(ReduceOp op) {
  static const char* const names[] = {"sum", "mean", "max", "min", "argmax", "argmin"};
  return names[int(op)];
}

// The running result of one output: a value and, for argmax/argmin, its index.
template <class A> struct State {
  A v;
  int64_t i;
};

// True when x, seen after the current extreme `best`, replaces it: strictly more extreme,
// or the first NaN. Scanning in index order, ties keep the earlier index.
template <ReduceOp op, class A> bool replaces(A x, A best) {
  if (is_nan(best)) return false;
  if (is_nan(x)) return true;
  return wants_max(op) ? x > best : x < best;
}

// Combines two partial results in either order; ties go to the smaller index.
template <ReduceOp op, class A> State<A> combine(State<A> a, State<A> b) {
  if constexpr (is_sum(op)) {
    return {a.v + b.v, 0};
  } else {
    if (is_nan(a.v) != is_nan(b.v)) return is_nan(a.v) ? a : b;
    if (is_nan(a.v) || a.v == b.v) return a.i < b.i ? a : b;
    return replaces<op>(a.v, b.v) ? a : b;
  }
}

using One = std::integral_constant<int, 1>;

// Reduces rows [r0, r1) (r1 > r0) of `cols` columns that start at x and lie `stride` apart.
template <ReduceOp op, class T, class Stride, class Cols, class A = racc_t<T>>
void reduce_tile(const T* x, Stride stride, int64_t r0, int64_t r1, Cols cols, State<A>* out) {
  if constexpr (is_sum(op)) {
    A sum[kTile];
    pairwise_cols<kTile>(r0, r1, cols, sum, [&](int64_t r, int c) { return A(x[r * stride + c]); });
    for (int c = 0; c < cols; ++c) out[c] = {sum[c], 0};
  } else {
    for (int c = 0; c < cols; ++c) out[c] = {A(x[r0 * stride + c]), r0};
    for (int64_t r = r0 + 1; r < r1; ++r) {
      const T* row = x + r * stride;
      for (int c = 0; c < cols; ++c) {
        A v = A(row[c]);
        if (replaces<op>(v, out[c].v)) out[c] = {v, r};
      }
    }
  }
}

template <ReduceOp op, class T, class A> void store(void* out, int64_t j, State<A> s, int64_t R) {
  if constexpr (is_arg(op)) {
    static_cast<int64_t*>(out)[j] = s.i;
  } else if constexpr (op == ReduceOp::mean) {
    static_cast<T*>(out)[j] = T(s.v / A(R));
  } else {
    static_cast<T*>(out)[j] = T(s.v);
  }
}

template <ReduceOp op, class T>
void reduce_typed(void* out, const T* in, int64_t outer, int64_t R, int64_t inner) {
  using A = racc_t<T>;
  if (R == 0) {  // only sum and mean get here: 0 and 0 / 0
    for (int64_t j = 0; j < outer * inner; ++j) store<op, T>(out, j, State<A>{A(0), 0}, R);
    return;
  }
  if (inner == 1 && outer < num_threads() && R >= 2 * kChunk) {
    int64_t chunks = std::min(kMaxChunks, (R + kChunk - 1) / kChunk);
    int64_t per = (R + chunks - 1) / chunks;
    for (int64_t o = 0; o < outer; ++o) {
      State<A> part[kMaxChunks];
      parallel_for(chunks, 1, [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k)
          reduce_tile<op>(in + o * R, One{}, k * per, std::min(R, (k + 1) * per), One{}, &part[k]);
      });
      State<A> s = part[0];
      for (int64_t k = 1; k < chunks; ++k) s = combine<op>(s, part[k]);
      store<op, T>(out, o, s, R);
    }
    return;
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (R * std::min<int64_t>(inner, kTile)));
  if (inner == 1) {
    parallel_for(outer, grain, [&](int64_t b, int64_t e) {
      State<A> s;
      for (int64_t o = b; o < e; ++o) {
        reduce_tile<op>(in + o * R, One{}, 0, R, One{}, &s);
        store<op, T>(out, o, s, R);
      }
    });
    return;
  }
  const int64_t tiles = (inner + kTile - 1) / kTile;
  parallel_for(outer * tiles, grain, [&](int64_t b, int64_t e) {
    State<A> s[kTile];
    for (int64_t item = b; item < e; ++item) {
      int64_t o = item / tiles, i0 = (item % tiles) * kTile;
      int cols = int(std::min<int64_t>(kTile, inner - i0));
      reduce_tile<op>(in + o * R * inner + i0, inner, 0, R, cols, s);
      for (int c = 0; c < cols; ++c) store<op, T>(out, o * inner + i0 + c, s[c], R);
    }
  });
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
          reduce_typed<o>(out, static_cast<const T*>(in), outer, R, inner);
      });
    }
  });
}

}  // namespace loom::cpu
