// The kernel table: every kernel Loom has, one entry per operation, one table per device.
//
// The engine's ops look up `kernels_for(device)` and call an entry; nothing registers
// itself statically and no op switches over devices. A new op family adds its entries
// here, its CPU functions in kernels/cpu/<family>.cpp and its CUDA functions in
// kernels/cuda/<family>.cu, and one line each in kernels/cpu/table.cpp and
// kernels/cuda/table.cu. The CPU entries are the reference the CUDA ones are tested
// against.
//
// Conventions that hold for every entry:
// - The stream is the last argument (a cudaStream_t for CUDA, ignored on the CPU).
// - Kernels never allocate device memory and never synchronise; they may launch work
//   asynchronously on the stream. Shapes and dtypes were checked by the engine; a kernel
//   asserts only what it cannot work without.
// - Floating-point kernels accumulate bf16/f16 in f32 and f32 in f32 (f64 in f64).
// - "Canonical (outer, R, inner)" means a contiguous buffer viewed as a 3-d array whose
//   middle axis is the one being reduced, normalised, indexed or gathered over.
#pragma once

#include <cstdint>

#include "kernels/core/dtype.h"
#include "kernels/core/strided.h"

namespace loom {

// Unary elementwise ops. `param` is the scalar of the *_scalar ops and the exponent of
// pow_scalar; the others ignore it. gelu is the tanh form (as GPT-2 uses).
enum class UnaryOp : uint8_t {
  neg, abs, exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu, sign,
  add_scalar,  // x + param
  mul_scalar,  // x * param
  pow_scalar,  // x ^ param
  rsub_scalar, // param - x
  rdiv_scalar, // param / x
};

// Binary elementwise ops. Comparisons write u8 (0 or 1); the others write the input dtype.
enum class BinaryOp : uint8_t { add, sub, mul, div, pow, maximum, minimum, eq, ne, lt, le, gt, ge };

constexpr bool is_comparison(BinaryOp op) { return op >= BinaryOp::eq; }

// Reductions over the middle axis of a canonical (outer, R, inner) buffer.
// sum, mean, max, min write the input dtype (accumulating in f32 for 16-bit floats);
// argmax and argmin write i64 (the first index of the extreme value; NaN counts as the extreme).
enum class ReduceOp : uint8_t { sum, mean, max, min, argmax, argmin };

// Row-major batched matrix product: for each b < batch,
//   C_b (m, n) = alpha * op(A_b) (m, k) @ op(B_b) (k, n) + beta * C_b
// where op(A) is A or A^T (trans_a). Leading dimensions are row strides in elements,
// batch strides are in elements (0 broadcasts an operand over the batch).
// f32 runs on TF32 tensor cores on CUDA; bf16 and f16 accumulate in f32.
// A, B and C share one dtype (f32, f64 (CPU only), bf16, f16).
struct GemmArgs {
  DType dtype = DType::f32;
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0, batch = 1;
  const void* a = nullptr;
  int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 0, stride_b = 0;
  void* c = nullptr;
  int64_t ldc = 0, stride_c = 0;
  float alpha = 1.f, beta = 0.f;
};

struct KernelTable {
  // out[i] = value, out of any dtype and strides.
  void (*fill)(const Strided& out, double value, StreamHandle stream);
  // out[i] = convert(in[i]): same shape, any strides (in may have stride-0 broadcast
  // dimensions), any pair of dtypes. Float to integer truncates toward zero.
  void (*copy)(const Strided& out, const Strided& in, StreamHandle stream);
  // out = 0, 1, 2, ... scaled: out[i] = start + i * step, out contiguous.
  void (*arange)(const Strided& out, double start, double step, StreamHandle stream);

  // out[i] = op(in[i]); out and in same shape and dtype (floating for all but neg/abs/sign
  // and the *_scalar ops); in may be strided, out is contiguous.
  void (*unary)(UnaryOp op, const Strided& out, const Strided& in, double param, StreamHandle stream);
  // grad_in[i] = grad_out[i] * op'(in[i]) for the differentiable unary ops, given the
  // input and the forward output (either may be what the formula needs; both are
  // passed, same shape). All four contiguous, same dtype.
  void (*unary_backward)(UnaryOp op, const Strided& grad_in, const Strided& grad_out, const Strided& in,
                         const Strided& out, double param, StreamHandle stream);
  // out[i] = a[i] op b[i]; a and b already broadcast to out's shape (stride 0 where
  // broadcast) and of one dtype; out contiguous (u8 for comparisons, else a's dtype).
  void (*binary)(BinaryOp op, const Strided& out, const Strided& a, const Strided& b, StreamHandle stream);
  // out[i] = cond[i] ? a[i] : b[i]; cond u8, a/b/out one dtype, all broadcast to out's
  // shape, out contiguous.
  void (*where)(const Strided& out, const Strided& cond, const Strided& a, const Strided& b, StreamHandle stream);

  // out (outer, inner) = op over r of in (outer, R, inner); both contiguous.
  void (*reduce)(ReduceOp op, void* out, const void* in, DType dtype, int64_t outer, int64_t R, int64_t inner,
                 StreamHandle stream);

  // Softmax (or log-softmax when log is true) over the middle axis of (outer, R, inner).
  void (*softmax)(void* out, const void* in, DType dtype, int64_t outer, int64_t R, int64_t inner, bool log,
                  StreamHandle stream);
  // grad_in from grad_out and the forward output `out`:
  //   softmax:     gi = y * (go - sum_r(go * y))
  //   log_softmax: gi = go - exp(y) * sum_r(go)
  void (*softmax_backward)(void* grad_in, const void* grad_out, const void* out, DType dtype, int64_t outer,
                           int64_t R, int64_t inner, bool log, StreamHandle stream);

  // Fused cross-entropy over logits (N, C) contiguous of `dtype`, targets i64 (N).
  // For each row n: lse[n] = logsumexp(logits[n]);
  //   loss[n] = (1 - eps) * (lse - logits[n, t]) + eps * (lse - mean_c logits[n, c])
  // and loss[n] = 0 where target[n] == ignore_index. loss and lse are f32 (N).
  // A target outside [0, C) that is not ignore_index is a user error: the CPU kernel
  // throws; the CUDA kernel traps (the engine checks targets before calling where it can).
  void (*cross_entropy)(float* loss, float* lse, const void* logits, DType dtype, const int64_t* target,
                        int64_t N, int64_t C, int64_t ignore_index, double label_smoothing, StreamHandle stream);
  // grad_logits[n, c] = grad_row[n] * (softmax(logits[n])[c] - (1 - eps) * [c == t] - eps / C),
  // zero on ignored rows. grad_row is f32 (N), lse from the forward.
  void (*cross_entropy_backward)(void* grad_logits, const void* logits, const float* lse, const int64_t* target,
                                 const float* grad_row, DType dtype, int64_t N, int64_t C, int64_t ignore_index,
                                 double label_smoothing, StreamHandle stream);

  void (*gemm)(const GemmArgs& args, StreamHandle stream);

  // Indexing over canonical (outer, R, inner) buffers, all contiguous, index i64.
  // index_select: out (outer, n_index, inner)[o, j, i] = in[o, index[j], i]
  void (*index_select)(void* out, const void* in, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
                       int64_t R, int64_t inner, StreamHandle stream);
  // index_add: out (outer, R, inner)[o, index[j], i] += src (outer, n_index, inner)[o, j, i]
  void (*index_add)(void* out, const void* src, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
                    int64_t R, int64_t inner, StreamHandle stream);
  // gather: out (outer, J, inner)[o, j, i] = in (outer, R, inner)[o, index[o, j, i], i]
  void (*gather)(void* out, const void* in, const int64_t* index, int64_t J, DType dtype, int64_t outer, int64_t R,
                 int64_t inner, StreamHandle stream);
  // scatter_add: out (outer, R, inner)[o, index[o, j, i], i] += src (outer, J, inner)[o, j, i]
  void (*scatter_add)(void* out, const void* src, const int64_t* index, int64_t J, DType dtype, int64_t outer,
                      int64_t R, int64_t inner, StreamHandle stream);

  // Counter-based random numbers (Philox4x32-10): element i of the contiguous `out`
  // takes word (i % 4) of the Philox block for counter (offset + i / 4) and key seed, so
  // the CPU and CUDA produce the same numbers for the same (seed, offset).
  // uniform: lo + (hi - lo) * u, u = (word >> 8) * 2^-24 (24 bits for f64 too), a value rounding onto hi becomes lo;
  // normal: mean + std * z, Box-Muller on words (2p, 2p + 1), p = (i % 4) / 2, cos for even i, sin for odd.
  // The exact arithmetic is kernels/core/philox.h, shared by both devices.
  void (*uniform)(const Strided& out, uint64_t seed, uint64_t offset, double lo, double hi, StreamHandle stream);
  void (*normal)(const Strided& out, uint64_t seed, uint64_t offset, double mean, double std, StreamHandle stream);
};

const KernelTable& cpu_kernel_table();
// Throws loom::Error when Loom was built without CUDA.
const KernelTable& cuda_kernel_table();

}  // namespace loom
