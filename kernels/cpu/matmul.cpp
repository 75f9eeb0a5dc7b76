// CPU matrix product: a cache-blocked GEMM in the BLIS style, with no BLAS underneath.
//
// C (m, n) is cut into (MC x NC) blocks. A task for cpu::parallel_for is one column block of
// one batch entry and a run of its row blocks (as long a run as still gives every thread two
// tasks, and at most kMaxRun), so threads never share output. Within a task, K is walked in KC-deep slices: the
// slice of op(B) is packed once into NR-column panels and serves the whole run, the slice of
// op(A) into MR-row slivers for each row block, both k-major and already
// converted to the accumulation type (so transposes, strides and bf16/f16 cost nothing
// past the packing). A micro-kernel then multiplies one sliver by one panel into an
// MR x NR register tile (kernels/cpu/gemm_micro.h: FMA tiles on AVX2 and AVX-512, plain
// loops elsewhere; the tile's size, chosen at run time, sets the packing). Tiles add into
// a per-task accumulator, and alpha and beta are applied once at the end, so 16-bit outputs
// are rounded once and beta == 0 never reads C (NaNs in C are ignored, as BLAS does).
#include <algorithm>
#include <cstring>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <vector>

#include "kernels/core/gemm_check.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/elementwise_ops.h"
#include "kernels/cpu/gemm_micro.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/vector_isa.h"

namespace loom::cpu {
namespace {

// Cache blocks: a KC x NC panel of B (128 KiB in f32) stays in L2 while the MC x KC
// slivers of A (96 KiB) stream past it; one MR x KC sliver and one KC x NR panel sit in L1.
constexpr int64_t kMC = 96, kKC = 256, kNC = 128;
// Row blocks a task runs over one packed B panel at most: their accumulators (384 KiB in
// f32) stay in L2 from one KC slice to the next.
constexpr int64_t kMaxRun = 8;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// The micro-kernel tile in use for accumulation type A.
template <class A>
const gemm_micro::Tile<A>& tile() {
  if constexpr (std::is_same_v<A, double>) return gemm_micro::active().f64;
  else return gemm_micro::active().f32;
}

#if defined(__x86_64__) && defined(__GNUC__)
// dst[p * width + r] = src[r * row_stride + p] for r < width and p < cols, f32, for a width of
// 6 or a multiple of 8: eight columns of eight rows at a time through registers, transposed by
// shuffles (rows 6 and 7 repeat row 5 for a width of 6, and only six values a column are
// stored), the columns past the last eight one by one. Moves values only: the packed panel
// is the same whichever way it was written.
LOOM_AVX2_NO_FMA void pack_rows_avx2(float* dst, const float* src, int64_t row_stride, int64_t cols, int width) {
  int64_t p = 0;
  for (; p + 8 <= cols; p += 8) {
    for (int r0 = 0; r0 < width; r0 += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(src + std::min(r0 + i, width - 1) * row_stride + p);
      const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
      const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
      const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
      const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
      const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
      // Column p + i: element j of each row, in row order.
      const __m256 c[8] = {_mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
                           _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
                           _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
                           _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
      for (int i = 0; i < 8; ++i) {
        float* out = dst + (p + i) * width + r0;
        if (width == 6) {
          _mm_storeu_ps(out, _mm256_castps256_ps128(c[i]));
          _mm_storel_pi(reinterpret_cast<__m64*>(out + 4), _mm256_extractf128_ps(c[i], 1));
        } else {
          _mm256_storeu_ps(out, c[i]);
        }
      }
    }
  }
  for (; p < cols; ++p)
    for (int r = 0; r < width; ++r) dst[p * width + r] = src[r * row_stride + p];
}
#endif

// dst[p * width + r] = src[p * col_stride + r] for r < width and p < cols, when width is one
// of Widths (a copy of a fixed size a column); false, copying nothing, for any other width.
template <int... Widths, class A>
bool copy_columns_of(A* dst, const A* src, int64_t col_stride, int64_t cols, int width) {
  auto copy = [&](auto w) {
    constexpr int W = decltype(w)::value;
    for (int64_t p = 0; p < cols; ++p) std::memcpy(dst + p * W, src + p * col_stride, W * sizeof(A));
  };
  return ((width == Widths ? (copy(std::integral_constant<int, Widths>{}), true) : false) || ...);
}

// Packs rows [0, rows) x columns [0, cols) of a strided matrix into groups of `width` rows
// (zero-padded), each group stored column by column: dst[group][col][row in group].
// Packing A uses it directly (rows = M slice, cols = K slice); packing B uses it on the
// transposed view (rows = N slice, cols = K slice).
// A group's rows lying side by side in memory (row_stride 1) are copied a column at a time;
// rows lying along memory (col_stride 1, a row-major A or a transposed B) are read a row at
// a time and written `width` apart (in f32, a full group on a CPU with AVX2: transposed eight
// by eight, pack_rows_avx2); any other layout goes element by element.
template <class A, class T>
void pack(A* dst, const T* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols, int width) {
  for (int64_t g = 0; g < rows; g += width, dst += cols * width) {
    const int valid = int(std::min<int64_t>(width, rows - g));
    const T* base = src + g * row_stride;
    if (row_stride == 1) {
      if constexpr (std::is_same_v<A, T>) {
        // A full group of the micro-kernels' widths: each column a copy of a size the compiler
        // knows, so it moves in a few vector registers instead of a loop a column.
        if (valid == width && copy_columns_of<6, 8, 16, 32>(dst, base, col_stride, cols, width)) continue;
      }
      for (int64_t p = 0; p < cols; ++p) {
        const T* col = base + p * col_stride;
        A* out = dst + p * width;
        for (int r = 0; r < valid; ++r) out[r] = A(col[r]);
        for (int r = valid; r < width; ++r) out[r] = A(0);
      }
    } else if (col_stride == 1) {
#if defined(__x86_64__) && defined(__GNUC__)
      if constexpr (std::is_same_v<A, float> && std::is_same_v<T, float>) {
        if (valid == width && (width == 6 || width % 8 == 0) && vector_isa::avx2_copies_on()) {
          pack_rows_avx2(dst, base, row_stride, cols, width);
          continue;
        }
      }
#endif
      for (int r = 0; r < width; ++r) {
        A* out = dst + r;
        if (r >= valid) {
          for (int64_t p = 0; p < cols; ++p) out[p * width] = A(0);
          continue;
        }
        const T* row = base + r * row_stride;
        for (int64_t p = 0; p < cols; ++p) out[p * width] = A(row[p]);
      }
    } else {
      for (int64_t p = 0; p < cols; ++p) {
        const T* col = base + p * col_stride;
        A* out = dst + p * width;
        for (int r = 0; r < valid; ++r) out[r] = A(col[r * row_stride]);
        for (int r = valid; r < width; ++r) out[r] = A(0);
      }
    }
  }
}

template <class T, class A>
LOOM_INLINE T store(A v) {
  if constexpr (std::is_same_v<T, A>) return v;
  else return T(float(v));
}

// One block's accumulator (mc rows of nc values, nc_pad apart) into C: alpha, beta, bias and
// the epilogue, each a loop of its own over the accumulator's row (updated in place), so that
// each vectorises, GELU's tanh included. Compiled for the baseline and for AVX2
// (kernels/cpu/vector_isa.h: the same bits).
template <class T, class O, class A>
LOOM_INLINE void finish_block(const GemmArgs& g, A alpha, A beta, A* acc_rows, int64_t nc_pad, int64_t mc, int64_t nc,
                              O* c, const O* c_in, const O* bias, T* aux) {
  for (int64_t i = 0; i < mc; ++i) {
    A* v = acc_rows + i * nc_pad;
    O* row = c + i * g.ldc;
    const O* row_in = c_in + i * g.ldc;
    if (alpha != A(1))
      for (int64_t j = 0; j < nc; ++j) v[j] *= alpha;
    if (beta != A(0))
      for (int64_t j = 0; j < nc; ++j) v[j] += beta * A(row_in[j]);
    if (bias)
      for (int64_t j = 0; j < nc; ++j) v[j] += A(bias[j]);
    T* aux_row = aux ? aux + i * g.ld_aux : nullptr;
    switch (g.epilogue) {
      case GemmEpilogue::none:
        for (int64_t j = 0; j < nc; ++j) row[j] = store<O>(v[j]);
        break;
      case GemmEpilogue::gelu:
        for (int64_t j = 0; j < nc; ++j) {
          aux_row[j] = store<T>(v[j]);
          row[j] = store<O>(elementwise::unary_float<UnaryOp::gelu, A>(v[j], A(0)));
        }
        break;
      case GemmEpilogue::dgelu:
        for (int64_t j = 0; j < nc; ++j)
          row[j] = store<O>(elementwise::unary_grad<UnaryOp::gelu, A>(v[j], A(aux_row[j]), A(0), A(0)));
        break;
    }
  }
}


// T: A's and B's element type; O: C's (T, or f32 for c_f32).
template <class T, class O = T>
void gemm_typed(const GemmArgs& g) {
  using A = acc_t<T>;
  const gemm_micro::Tile<A> micro = tile<A>();
  const int MR = micro.mr, NR = micro.nr;
  const int64_t m_blocks = (g.m + kMC - 1) / kMC, n_blocks = (g.n + kNC - 1) / kNC;
  // A task is one column block of one batch entry and a run of row blocks: each KC slice of
  // its B panel is packed once and serves every row block of the run. Runs are as long as
  // still gives each thread two tasks.
  const int64_t columns = g.batch * n_blocks;
  const int64_t wanted_runs = std::clamp<int64_t>((2 * num_threads() + columns - 1) / columns, 1, m_blocks);
  const int64_t run = std::min(kMaxRun, (m_blocks + wanted_runs - 1) / wanted_runs);
  const int64_t runs = (m_blocks + run - 1) / run;
  const int64_t tasks = columns * runs;
  const int64_t mc_full = round_up(kMC, MR), nc_full = round_up(kNC, NR);
  // Element (i, p) of op(A) is at a[i * a_rs + p * a_cs]; element (p, j) of op(B) at
  // b[p * b_ks + j * b_js].
  const int64_t a_rs = g.trans_a ? 1 : g.lda, a_cs = g.trans_a ? g.lda : 1;
  const int64_t b_ks = g.trans_b ? 1 : g.ldb, b_js = g.trans_b ? g.ldb : 1;
  const A alpha = g.alpha_ptr ? *static_cast<const A*>(g.alpha_ptr) : A(g.alpha), beta = A(g.beta);
  // Group small tasks so a tiny product is not spread over threads.
  const int64_t task_flops = std::min(g.m, run * kMC) * std::min(g.n, kNC) * std::max<int64_t>(g.k, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / task_flops);

  parallel_for(tasks, grain, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<A> a_pack, b_pack, c_tiles;
    a_pack.resize(size_t(mc_full * kKC));
    b_pack.resize(size_t(nc_full * kKC));
    c_tiles.resize(size_t(run * mc_full * nc_full));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bi = t / (n_blocks * runs), jb = t / runs % n_blocks, ib0 = t % runs * run;
      const int64_t ib1 = std::min(m_blocks, ib0 + run);
      const int64_t j0 = jb * kNC, nc = std::min(kNC, g.n - j0), nc_pad = round_up(nc, NR);
      const T* b = static_cast<const T*>(g.b) + bi * g.stride_b + j0 * b_js;
      // Row block ib's accumulator: mc x nc_pad at this offset in c_tiles.
      auto tile_of = [&](int64_t ib) { return c_tiles.data() + (ib - ib0) * mc_full * nc_pad; };

      std::fill(c_tiles.begin(), c_tiles.begin() + (ib1 - ib0) * mc_full * nc_pad, A(0));
      for (int64_t p0 = 0; p0 < g.k; p0 += kKC) {
        const int64_t kc = std::min(kKC, g.k - p0);
        pack<A>(b_pack.data(), b + p0 * b_ks, b_js, b_ks, nc, kc, NR);
        for (int64_t ib = ib0; ib < ib1; ++ib) {
          const int64_t i0 = ib * kMC, mc = std::min(kMC, g.m - i0), mc_pad = round_up(mc, MR);
          const T* a = static_cast<const T*>(g.a) + bi * g.stride_a + i0 * a_rs;
          pack<A>(a_pack.data(), a + p0 * a_cs, a_rs, a_cs, mc, kc, MR);
          A* acc = tile_of(ib);
          for (int64_t jr = 0; jr < nc_pad; jr += NR)
            for (int64_t ir = 0; ir < mc_pad; ir += MR)
              micro.fn(kc, a_pack.data() + ir * kc, b_pack.data() + jr * kc, acc + ir * nc_pad + jr, nc_pad);
        }
      }
      for (int64_t ib = ib0; ib < ib1; ++ib) {
        const int64_t i0 = ib * kMC, mc = std::min(kMC, g.m - i0);
        A* acc_rows = tile_of(ib);
        O* c = static_cast<O*>(g.c) + bi * g.stride_c + i0 * g.ldc + j0;
        const O* c_in = g.c_in ? static_cast<const O*>(g.c_in) + i0 * g.ldc + j0 : c;
        const O* bias = g.bias ? static_cast<const O*>(g.bias) + j0 : nullptr;
        T* aux = g.aux ? static_cast<T*>(g.aux) + (i0 * g.ld_aux + j0) : nullptr;
        vector_isa::run_copy([&]() LOOM_INLINE_LAMBDA {
          finish_block<T>(g, alpha, beta, acc_rows, nc_pad, mc, nc, c, c_in, bias, aux);
        });
      }
    }
  });
}

// The sums beside the product, in passes of their own: column sums of the stored C
// (threads split the columns), and row sums of op(A) over k (threads split the rows). Each
// sum takes its terms in increasing row (or k) order. The column sums, and the row sums of a
// transposed A (columns of the stored matrix), walk memory along rows, adding a row's run
// into a run of sums, so that the loop vectorises and reads memory in order instead of one
// column at a time.
template <class T> void column_sums(const GemmArgs& g) {
  using A = acc_t<T>;
  const T* c = static_cast<const T*>(g.c);
  T* out = static_cast<T*>(g.column_sums);
  parallel_for(g.n, 64, [&](int64_t j0, int64_t j1) {
    std::vector<A> s(size_t(j1 - j0), A(0));
    for (int64_t i = 0; i < g.m; ++i) {
      const T* row = c + i * g.ldc + j0;
      for (int64_t j = 0; j < j1 - j0; ++j) s[size_t(j)] += A(row[j]);
    }
    for (int64_t j = j0; j < j1; ++j) out[j] = store<T>(s[size_t(j - j0)]);
  });
}

template <class T, class O = T> void row_sums_a(const GemmArgs& g) {
  using A = acc_t<T>;
  const T* a = static_cast<const T*>(g.a);
  O* out = static_cast<O*>(g.row_sums_a);
  parallel_for(g.m, 16, [&](int64_t i0, int64_t i1) {
    if (g.trans_a) {
      // op(A)'s row i is column i of the stored (k, m) matrix: walk the stored rows.
      std::vector<A> s(size_t(i1 - i0), A(0));
      for (int64_t p = 0; p < g.k; ++p) {
        const T* row = a + p * g.lda + i0;
        for (int64_t i = 0; i < i1 - i0; ++i) s[size_t(i)] += A(row[i]);
      }
      for (int64_t i = i0; i < i1; ++i) out[i] = store<O>(s[size_t(i - i0)]);
      return;
    }
    for (int64_t i = i0; i < i1; ++i) {
      const T* row = a + i * g.lda;
      A sum = 0;
      for (int64_t p = 0; p < g.k; ++p) sum += A(row[p]);
      out[i] = store<O>(sum);
    }
  });
}

}  // namespace

void gemm(const GemmArgs& args, StreamHandle) {
  if (args.m <= 0 || args.n <= 0 || args.batch <= 0) return;
  check_gemm_extras(args);
  dispatch_floating(args.dtype, "gemm", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
      if (args.c_f32) {
        gemm_typed<T, float>(args);
        if (args.row_sums_a) row_sums_a<T, float>(args);
        return;
      }
    }
    gemm_typed<T>(args);
    if (args.column_sums) column_sums<T>(args);
    if (args.row_sums_a) row_sums_a<T>(args);
  });
}

}  // namespace loom::cpu
