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

#include "core/dtype.h"
#include "core/strided.h"

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

enum class GemmEpilogue : uint8_t { none, gelu, dgelu };

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
  // When set, alpha is read from here as the product runs instead (a scale that earlier
  // kernels computed, with no wait for them on the host): one value on the product's device,
  // f64 for f64 products and f32 for the others. Needs beta == 0 and no bias, epilogue or
  // sums.
  const void* alpha_ptr = nullptr;
  // Optional bias (n), C's dtype, added to every row after alpha and beta: C += bias
  // (a linear layer's y = x W^T + b in one pass; on CUDA a cuBLASLt epilogue).
  const void* bias = nullptr;
  // What is stored for each value v (after alpha, beta and bias); single products only:
  //   none   C = v
  //   gelu   C = gelu(v) (tanh form) and aux = v, the pre-activation a backward needs
  //   dgelu  C = v * gelu'(aux): the gradient through a GELU whose input was aux
  // aux is (m, n) of C's dtype with row stride ld_aux. On CUDA these are cuBLASLt epilogues.
  GemmEpilogue epilogue = GemmEpilogue::none;
  void* aux = nullptr;
  int64_t ld_aux = 0;
  // Optional sums, C's dtype, accumulated in f32 (f64 for f64): column_sums (n) of the stored
  // C over its rows (a bias gradient through dgelu; needs beta == 0 and no bias), and
  // row_sums_a (m) of op(A) over k (the bias gradient beside a weight gradient dW = dY^T X).
  void* column_sums = nullptr;
  void* row_sums_a = nullptr;
  // f32 C for 16-bit A and B (bf16/f16): C, c_in, bias and row_sums_a are f32, so a product
  // lands in an f32 stream (or an f32 parameter's gradient) without a 16-bit rounding or a
  // cast of its own. Single products with no epilogue or column sums only.
  bool c_f32 = false;
  // Optional input for the beta term (same dtype and row stride as C): C = alpha AB + beta
  // c_in (+ bias), C only written. A residual connection, out = x + layer(h), in the product.
  const void* c_in = nullptr;
  // CUDA, single f32/bf16/f16 products: the first product of each shape and layout times
  // cuBLASLt's candidate algorithms and keeps the fastest (true), or every product takes the
  // heuristic's first choice, the same algorithm from run to run (false). The CPU ignores it.
  bool autotune = true;
};

// Where the channel axis of a CNN op's buffers lies in memory (every activation buffer of a
// call alike; MemoryFormat in engine/tensor.h):
//   channels_first  row-major (N, C, H, W): a channel's values are planes of H * W.
//   channels_last   (N, H, W, C): each pixel's C channels contiguous.
enum class ChannelLayout : uint8_t { channels_first, channels_last };

// A 2-d convolution (cross-correlation, as in PyTorch) over NCHW contiguous buffers:
//   x (N, C_in, H, W), w (C_out, C_in / groups, KH, KW), y (N, C_out, OH, OW), with
//   OH = (H + 2 pad_h - dilation_h (KH - 1) - 1) / stride_h + 1 (likewise OW);
// or, laid out channels_last, the activations with their channels innermost in memory: x as
// (N, H, W, C_in), y as (N, OH, OW, C_out); the weight is then row-major on the CPU and laid
// out (C_out, KH, KW, C_in / groups) on CUDA, as cuDNN's NHWC kernels want it.
// Groups split C_in and C_out into `groups` equal slices, slice g of y seeing only slice g
// of x. Bias is not the kernel's business: the engine adds it with a broadcast add.
// `workspace` is device scratch of at least conv2d_workspace_size(args, pass) bytes for the
// pass being run, allocated by the caller (kernels never allocate device memory).
enum class ConvPass : uint8_t { forward, backward_data, backward_filter };

struct Conv2dArgs {
  DType dtype = DType::f32;
  int64_t n = 0, c_in = 0, h = 0, w = 0;  // input (N, C_in, H, W)
  int64_t c_out = 0, kh = 0, kw = 0;      // weight (C_out, C_in / groups, KH, KW)
  int64_t out_h = 0, out_w = 0;           // output (N, C_out, OH, OW)
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dilation_h = 1, dilation_w = 1;
  int64_t groups = 1;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // CUDA: a pass runs the execution plan cuDNN's graph API built for its shapes, where one
  // exists and the pointers allow (true), or cuDNN's convolution API alone, which plans
  // inside every call (false). The CPU ignores it. The workspace size is asked for with the
  // same setting as the pass.
  bool graph_api = true;
  // CUDA: only algorithms whose results repeat bit for bit from run to run (cuDNN's engines
  // without the nondeterministic note; Options::deterministic). The CPU is deterministic.
  bool deterministic = false;
  // CUDA, with graph_api: the pass runs the fastest of cuDNN's candidate plans, timed once
  // per shape on the first such call (Options::conv_autotuning), rather than the
  // heuristics' first choice. The workspace size is asked for with the same setting.
  bool autotune = true;
  // Every activation buffer channels_last (see above), read and written as it lies (cuDNN's
  // tensor-core kernels without transposing).
  ChannelLayout layout = ChannelLayout::channels_first;
  // Backward data only: dx += the input's gradient, added to it before the one rounding to
  // the dtype (cuDNN's beta of 1), instead of dx = it. The engine sends a residual
  // network's second gradient for one tensor this way rather than summing two in a pass.
  bool accumulate = false;
};

// A 2-d pooling window over NCHW contiguous buffers: x (N, C, H, W), y (N, C, OH, OW),
// window (KH, KW) at stride (stride_h, stride_w), with pad on each side, and
// OH = (H + 2 pad_h - KH) / stride_h + 1 (floor, as PyTorch's ceil_mode=False), likewise OW.
// The engine guarantees pad <= kernel / 2, so every window holds at least one input element.
// Laid out channels_last, x, y, the indices and the gradients are (N, H, W, C)
// in memory. Max pooling's indices are ih * W + iw within the plane, in either layout.
struct Pool2dArgs {
  DType dtype = DType::f32;
  int64_t n = 0, c = 0, h = 0, w = 0;  // input (N, C, H, W)
  int64_t out_h = 0, out_w = 0;        // output (N, C, OH, OW)
  int64_t kh = 1, kw = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  ChannelLayout layout = ChannelLayout::channels_first;
  // Max pooling's forward only, null elsewhere: C values of `dtype`, one a channel, added to
  // every element of x before its window is searched, the sum rounded to `dtype` as add's
  // is. y and the indices are then those of max pooling over x + bias, in one pass over x
  // (a convolution's bias, added while pooling its output: max_pool2d_bias, engine/ops.h).
  const void* bias = nullptr;
};

// Batch normalisation over the channel axis of a contiguous (N, C, S) buffer (NCHW with
// S = H * W; S = 1 for (N, C) inputs), or of an (N, S, C) one laid out channels_last;
// the statistics and results are the same either way. x, y, dx, dy have `dtype`; every
// per-channel vector (gamma, beta, running_mean, running_var, save_mean, save_invstd,
// dgamma, dbeta) is in the accumulation type (f64 for f64, f32 otherwise), so bf16
// activations keep f32 statistics and f32 affine parameters, as cuDNN and PyTorch do.
struct BatchNormArgs {
  DType dtype = DType::f32;
  int64_t n = 0, c = 0, s = 1;
  double eps = 1e-5;
  double momentum = 0.1;  // running = (1 - momentum) * running + momentum * batch statistic
  ChannelLayout layout = ChannelLayout::channels_first;
  // A ReLU fused after the training forward's normalisation (and after the residual, when
  // one is given): y = relu(bn(x) + residual), each step rounded to `dtype` as the separate
  // ops round it (the normalised value, then the sum in the accumulation type), so the result
  // is the bits of batch_norm, add and relu run one after another. The backward then reads y
  // and takes dy where y > 0, zero elsewhere, as ReLU's own backward does.
  bool relu = false;
};

// Layer normalisation over the last axis of a contiguous (rows, dim) buffer, PyTorch's
// F.layer_norm with normalized_shape (dim). x and dx have `dtype` (f32, f64, bf16, f16).
// y and dy have `out_dtype`: f64 for f64 x, else any of f32, bf16 and f16, so a 16-bit y can
// feed an autocast matrix product without a cast of its own. weight, bias, dweight and dbias
// (dim) have `param_dtype` (any floating dtype; f32 or x's dtype in practice). mean and rstd
// (rows) are in the accumulation type (f64 for f64 x, f32 otherwise): the forward saves them
// and the backward reads them instead of recomputing the statistics.
struct LayerNormArgs {
  DType dtype = DType::f32;        // x, dx
  DType out_dtype = DType::f32;    // y, dy
  DType param_dtype = DType::f32;  // weight, bias, dweight, dbias
  int64_t rows = 0, dim = 0;
  double eps = 1e-5;
  // Backward only, optional: a gradient x gets from elsewhere ((rows, dim) of x's dtype),
  // added into dx as it is stored: x feeding both a LayerNorm and a residual connection
  // gets its summed gradient without a pass of its own.
  const void* dx_add = nullptr;
  // Backward only, optional: dx once more, rounded to out_dtype ((rows, dim), each value as a
  // cast of the stored dx would round it), for f32 x with a 16-bit out_dtype. An autocast
  // product whose output feeds the LayerNorm reads its gradient in 16 bits: it takes this
  // copy instead of a cast pass of its own.
  void* dx_rounded = nullptr;
  // Backward only, optional: dx's column sums (dim, in the accumulation type: f64 for f64 x,
  // f32 otherwise), of the values as stored: dx_rounded's when it is given, else dx's. The
  // bias gradient of a product whose output this LayerNorm normalises, summed in the pass
  // that writes the product's output gradient instead of a pass of its own. Needs dx.
  void* dx_sums = nullptr;
};

// Multi-tensor optimizer updates: one call updates `count` tensors of any sizes (on CUDA in
// one launch where the pointer lists fit a launch's parameters). Parameters, gradients and
// state buffers of tensor i are contiguous with numel[i] elements, all of `dtype` (f32, f64,
// bf16 or f16; 16-bit tensors compute in f32 and round once at the store). The lists
// themselves are host arrays. state1/state2 are the optimizer's buffers: SGD's
// momentum_buffer (state1); Adam's exp_avg (state1) and exp_avg_sq (state2).
// Optionally (sgd_step and adam_step, f32 parameters only) copies[i], when not null,
// receives the updated parameter rounded to copy_dtype (bf16 or f16), exactly as a cast
// of it would: autocast's weight copies, written in the update's own pass.
struct MultiTensorArgs {
  DType dtype = DType::f32;
  int64_t count = 0;
  void* const* params = nullptr;
  const void* const* grads = nullptr;
  void* const* state1 = nullptr;
  void* const* state2 = nullptr;
  const int64_t* numel = nullptr;
  void* const* copies = nullptr;
  DType copy_dtype = DType::bf16;
};

// torch.optim.SGD's update for every element (g the gradient, p the parameter, b the buffer):
//   g += weight_decay * p;  if momentum != 0: b = first[i] ? g : momentum * b + (1 - dampening) * g,
//   g = nesterov ? g + momentum * b : b;  p -= lr * g.
// first[i] (host array, count entries) says tensor i's buffer is new; unused when momentum == 0
// (state1 may then be null).
struct SgdHyper {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  const uint8_t* first = nullptr;
  // When set, the learning rate is read from here (one double on the parameters' device) at
  // every launch instead of `lr`: a step captured in a CUDA graph then follows a schedule
  // that writes it between replays.
  const double* lr_at = nullptr;
};

// torch.optim.Adam / AdamW's update, step[i] >= 1 being tensor i's step count after this one:
//   decoupled (AdamW): p *= 1 - lr * weight_decay;  else (Adam): g += weight_decay * p;
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;
//   p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps).
// Arithmetic in the accumulation type (scalars computed in double on the host).
struct AdamHyper {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool decoupled = false;
  const int64_t* step = nullptr;
  // When set, three doubles on the parameters' device, for every tensor of the call: the
  // step size lr / (1 - beta1^t), sqrt(1 - beta2^t) and the decoupled shrink 1 - lr *
  // weight_decay, read at every launch in place of what `lr` and `step` give: a step
  // captured in a CUDA graph then follows the step count and the schedule between replays.
  const double* scalars_at = nullptr;
};

// Where one attention operand's rows lie: element strides of its batch, head and sequence
// axes; the head_dim axis is always stride 1. All zero (the default) means contiguous
// (B, H, T, D): {heads * len * head_dim, len * head_dim, head_dim}. A layout that really
// has all three strides zero (one row broadcast everywhere) must be passed as a copy.
struct AttentionStrides {
  int64_t batch = 0, head = 0, seq = 0;

  // These strides, or the contiguous ones of (heads, len, head_dim) when left at the default.
  constexpr AttentionStrides resolve(int64_t heads, int64_t len, int64_t head_dim) const {
    if (batch == 0 && head == 0 && seq == 0) return {heads * len * head_dim, len * head_dim, head_dim};
    return *this;
  }
};

// The strides of every operand the attention kernels read or write (lse is always contiguous).
struct AttentionLayout {
  AttentionStrides q, k, v, out, dout, dq, dk, dv;
};

// Fused scaled-dot-product attention over (B, H, T, D) operands: q, out, dout and dq
// (batch, heads, q_len, head_dim), k, v, dk and dv (batch, heads, kv_len, head_dim), all of
// `dtype`, each laid out as `strides` says (contiguous by default; any strides with a
// stride-1 head_dim, so q, k and v can be column slices of one (B, T, 3C) projection and out a
// (B, T, C) buffer in (B, T, H, D) order). Outputs must not overlap each other or the inputs.
// For each (b, h), with S the scores and i, j query and key rows:
//   S[i, j] = scale * sum_d q[i, d] k[j, d]                       (scale given, any finite value)
//   visible(i, j) = !causal || j <= i                             (top-left aligned: PyTorch's
//                   is_causal; with q_len != kv_len query i still sees keys 0..i)
//   lse[i] = log sum_{visible j} exp(S[i, j])                     (-inf when no key is visible)
//   P[i, j] = exp(S[i, j] - lse[i]) where visible, else 0
//   out[i, :] = sum_j P[i, j] v[j, :]                             (0 when no key is visible)
// lse (batch, heads, q_len), contiguous, is in the accumulation type (f64 for f64, else f32):
// the forward saves it and the backward recomputes P from it instead of storing P.
// Backward, given dout = dL/dout (same shape as out):
//   Di = sum_d dout[i, d] out[i, d]          (equals sum_j P[i, j] dP[i, j])
//   dP[i, j] = sum_d dout[i, d] v[j, d],     dS[i, j] = P[i, j] (dP[i, j] - Di)
//   dq[i, :] = scale sum_j dS[i, j] k[j, :], dk[j, :] = scale sum_i dS[i, j] q[i, :],
//   dv[j, :] = sum_i P[i, j] dout[i, :]
// dq, dk and dv are written in full (zeros where nothing is visible). On CUDA, bf16/f16 with
// head_dim 32, 64, 80, 96 or 128 run on tensor cores with P and dS rounded to the input type
// before their products, as flash attention does; other cases keep them in f32. The tensor
// cores move 16-byte rows: they take an operand whose base is 16-byte aligned and whose
// strides are multiples of 8 elements (those of size-1 axes aside); anything else runs the
// CUDA-core kernels, which take any strides.
struct AttentionArgs {
  DType dtype = DType::f32;
  int64_t batch = 0, heads = 0, q_len = 0, kv_len = 0, head_dim = 0;
  bool causal = false;
  double scale = 1.0;
  AttentionLayout strides;
  // CUDA tensor-core backward: dQ in a kernel of its own, the same bits from run to run
  // (true), or summed with atomics into an f32 accumulator in the workspace, in an order
  // that varies (false: two products fewer a tile pair). The workspace size is asked for
  // with the same setting. The other kernels, and the CPU's, are deterministic either way.
  bool deterministic = false;
  // CUDA on an H100 or H200 (compute capability 9.0) in a build for it: the Hopper kernels
  // (warpgroup products, bf16/f16, head_dim 64 or 128; the backward with dQ by atomics)
  // where true, else the tensor-core kernels every target runs. Results agree within f32
  // rounding.
  bool hopper = true;
  // Where set, the backward also writes the column sums of dq, dk and dv as stored: for each
  // head h and column d, the sum over batch and rows of dq[b, h, t, d], then dk's and dv's
  // likewise, into 3 * heads * head_dim values of the accumulation type (f64 for f64, else
  // f32), in that order. Over a packed (B, T, 3C) gradient of q | k | v these are its column
  // sums: the bias gradient of the projection that made qkv. The workspace size is asked
  // for with it set. On CUDA's tensor cores with dQ by atomics (not deterministic), dq's sums
  // are taken as its conversion from the f32 accumulator stores it, and on the Hopper
  // kernels dK's and dV's from the tiles they store, before those leave shared memory; the
  // rest (and the CPU's) by a pass over the stored gradient.
  void* column_sums = nullptr;
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
  // and loss[n] = 0 where target[n] == ignore_index. loss and lse (N) are in the accumulation
  // type: f64 for f64 logits, f32 for the others.
  // A target outside [0, C) that is not ignore_index is a user error: the CPU kernel
  // throws; the CUDA kernel traps (the engine checks targets before calling where it can).
  // grad_logits, when not null, also receives the gradient of the sum of the rows' losses,
  // written as cross_entropy_backward writes it with grad_row = 1: a training step's loss
  // then reads its logits once. It may be logits itself (each row is read whole before any
  // of it is written).
  // row_base is the index in the caller's batch of row 0 (a chunk's first row): the row a
  // bad target's error names is row_base + n.
  void (*cross_entropy)(void* loss, void* lse, const void* logits, DType dtype, const int64_t* target,
                        int64_t N, int64_t C, int64_t ignore_index, double label_smoothing, void* grad_logits,
                        int64_t row_base, StreamHandle stream);
  // grad_logits[n, c] = grad_row[n] * (softmax(logits[n])[c] - (1 - eps) * [c == t] - eps / C),
  // zero on ignored rows. grad_row (N) and lse (from the forward) are in the accumulation type.
  void (*cross_entropy_backward)(void* grad_logits, const void* logits, const void* lse, const int64_t* target,
                                 const void* grad_row, DType dtype, int64_t N, int64_t C, int64_t ignore_index,
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
  // Token and position embeddings summed, a GPT's input: for ids (B, T) i64,
  //   out (B, T, C)[b, t] = wte (V, C)[ids[b, t]] + wpe (>= T, C)[t]
  // (floating dtype, all contiguous). An id outside [0, V) is a user error: the CPU kernel
  // throws before writing; the CUDA kernel traps.
  void (*embedding_sum)(void* out, const void* wte, const void* wpe, const int64_t* ids, int64_t B, int64_t T,
                        int64_t C, int64_t V, DType dtype, StreamHandle stream);
  // Its gradient from grad (B, T, C): d_wte[ids[b, t]] += grad[b, t] (d_wte (V, C) holds what
  // to add to, zeros for a fresh gradient; atomic on CUDA) and d_wpe[t] = sum_b grad[b, t]
  // for t < T (its later rows untouched). Either output may be null.
  void (*embedding_sum_backward)(void* d_wte, void* d_wpe, const void* grad, const int64_t* ids, int64_t B,
                                 int64_t T, int64_t C, int64_t V, DType dtype, StreamHandle stream);

  // Counter-based random numbers (Philox4x32-10): element i of the contiguous `out`
  // takes word (i % 4) of the Philox block for counter (offset + i / 4) and key seed, so
  // the CPU and CUDA produce the same numbers for the same (seed, offset).
  // uniform: lo + (hi - lo) * u, u = (word >> 8) * 2^-24 (24 bits for f64 too), a value rounding onto hi becomes lo;
  // normal: mean + std * z, Box-Muller on words (2p, 2p + 1), p = (i % 4) / 2, cos for even i, sin for odd.
  // The exact arithmetic is kernels/core/philox.h, shared by both devices.
  void (*uniform)(const Strided& out, uint64_t seed, uint64_t offset, double lo, double hi, StreamHandle stream);
  void (*normal)(const Strided& out, uint64_t seed, uint64_t offset, double mean, double std, StreamHandle stream);

  // ---- convolution and pooling (NCHW contiguous, floating dtypes) ------------------
  // Bytes of device scratch the pass needs for these shapes on the current device: 0 on
  // the CPU (which keeps its own host scratch); on CUDA it also fixes the cuDNN algorithm
  // for (shapes, dtype, pass), cached, so the pass then runs with exactly this much.
  size_t (*conv2d_workspace_size)(const Conv2dArgs& args, ConvPass pass);
  // y = conv(x, w), y written (not accumulated). f32 may run on TF32 on CUDA.
  void (*conv2d_forward)(const Conv2dArgs& args, void* y, const void* x, const void* w, StreamHandle stream);
  // dx = dL/dx given dy = dL/dy: the transposed convolution of dy with w; dx written.
  void (*conv2d_backward_data)(const Conv2dArgs& args, void* dx, const void* dy, const void* w,
                               StreamHandle stream);
  // dw = dL/dw given x and dy, summed over the batch; dw written.
  void (*conv2d_backward_filter)(const Conv2dArgs& args, void* dw, const void* x, const void* dy,
                                 StreamHandle stream);
  // y = max over each window (padding never wins); indices (N, C, OH, OW) i64 = ih * W + iw,
  // the position within its input plane of the first maximum in row-major window order
  // (a NaN counts as the maximum, the last NaN seen wins, as PyTorch). With args.bias, of
  // x + bias (Pool2dArgs).
  void (*max_pool2d_forward)(const Pool2dArgs& args, void* y, int64_t* indices, const void* x,
                             StreamHandle stream);
  // dx (N, C, H, W) = sum of dy over the outputs whose index points at each input element;
  // dx written in full (zeros where nothing points). Deterministic: no atomics.
  void (*max_pool2d_backward)(const Pool2dArgs& args, void* dx, const void* dy, const int64_t* indices,
                              StreamHandle stream);
  // y = mean over each window, padding counted as zeros (count_include_pad = true, so the
  // divisor is always KH * KW).
  void (*avg_pool2d_forward)(const Pool2dArgs& args, void* y, const void* x, StreamHandle stream);
  // dx = sum over the windows covering each input element of dy / (KH * KW); dx written.
  void (*avg_pool2d_backward)(const Pool2dArgs& args, void* dx, const void* dy, StreamHandle stream);

  // ---- batch normalisation (BatchNormArgs) ---------------------------------------------
  // Training: per channel, mean and biased variance over (N, S); invstd = 1 / sqrt(var + eps);
  // y = (x - mean) * invstd * gamma + beta; save_mean and save_invstd written; the running
  // statistics (when not null) updated with the unbiased variance (var * M / (M - 1), M = N S).
  // gamma/beta null mean 1 and 0 (affine = false). With args.relu, y = relu(that + residual),
  // residual (x's dtype and layout) null for none; without it residual must be null.
  void (*batch_norm_forward_train)(const BatchNormArgs& args, void* y, void* save_mean, void* save_invstd,
                                   void* running_mean, void* running_var, const void* x, const void* gamma,
                                   const void* beta, const void* residual, StreamHandle stream);
  // Inference: y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta.
  void (*batch_norm_forward_eval)(const BatchNormArgs& args, void* y, const void* x, const void* gamma,
                                  const void* beta, const void* running_mean, const void* running_var,
                                  StreamHandle stream);
  // Backward of the training forward, xhat = (x - save_mean) * save_invstd:
  //   dbeta = sum dy, dgamma = sum dy * xhat (over N, S; both written, never null);
  //   dx = gamma * invstd / M * (M dy - dbeta - xhat * dgamma)   (gamma null means 1).
  // With args.relu, dy is first masked by the forward's output y (dy where y > 0, else 0),
  // and dresidual (when not null) gets the masked dy: the residual's gradient. Without it y
  // and dresidual must be null.
  void (*batch_norm_backward)(const BatchNormArgs& args, void* dx, void* dgamma, void* dbeta, const void* dy,
                              const void* x, const void* gamma, const void* save_mean, const void* save_invstd,
                              const void* y, void* dresidual, StreamHandle stream);

  // ---- layer normalisation (LayerNormArgs) ---------------------------------------------
  // Per row: mean and biased variance (correction 0) over dim, rstd = 1 / sqrt(var + eps),
  //   y = (x - mean) * rstd * weight + bias      (weight null means 1, bias null means 0);
  // mean and rstd written.
  void (*layer_norm_forward)(const LayerNormArgs& args, void* y, void* mean, void* rstd, const void* x,
                             const void* weight, const void* bias, StreamHandle stream);
  // Bytes of device scratch layer_norm_backward needs for these shapes on the current device
  // when it writes dweight, dbias or dx_sums (0 on the CPU); the caller allocates it, 16-byte
  // aligned.
  size_t (*layer_norm_workspace_size)(const LayerNormArgs& args);
  // Backward of the forward, xhat = (x - mean) * rstd, g = dy * weight, means over the row:
  //   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
  //   dweight = sum over rows of dy * xhat, dbias = sum over rows of dy,
  //   dx_sums = sum over rows of dx as stored (LayerNormArgs::dx_sums).
  // Each of dx, dweight, dbias may be null (not wanted). Deterministic: no atomics.
  void (*layer_norm_backward)(const LayerNormArgs& args, void* dx, void* dweight, void* dbias, const void* dy,
                              const void* x, const void* mean, const void* rstd, const void* weight,
                              void* workspace, StreamHandle stream);

  // ---- optimizers (MultiTensorArgs) ----------------------------------------------------
  void (*sgd_step)(const MultiTensorArgs& args, const SgdHyper& hyper, StreamHandle stream);
  void (*adam_step)(const MultiTensorArgs& args, const AdamHyper& hyper, StreamHandle stream);
  // params[i] = grads[i] for every tensor (a gather into, or scatter out of, a flat buffer:
  // DDP's gradient buckets), one floating dtype; on CUDA one launch for the list.
  void (*multi_tensor_copy)(const MultiTensorArgs& args, StreamHandle stream);

  // ---- attention (AttentionArgs) -------------------------------------------------------
  // Bytes of device scratch attention_backward needs for these shapes (0 on the CPU); the
  // caller allocates it, aligned to 16 bytes.
  size_t (*attention_workspace_size)(const AttentionArgs& args);
  // out and lse from q, k, v; nothing of size q_len x kv_len is stored.
  void (*attention_forward)(const AttentionArgs& args, void* out, void* lse, const void* q, const void* k,
                            const void* v, StreamHandle stream);
  // dq, dk, dv (written) from dout and the forward's inputs, out and lse.
  void (*attention_backward)(const AttentionArgs& args, void* dq, void* dk, void* dv, const void* dout,
                             const void* q, const void* k, const void* v, const void* out, const void* lse,
                             void* workspace, StreamHandle stream);
};

const KernelTable& cpu_kernel_table();
// Throws loom::Error when Loom was built without CUDA.
const KernelTable& cuda_kernel_table();

}  // namespace loom
