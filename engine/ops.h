// Loom's ops: the public functions over Tensors. Each family is defined in one file,
// engine/ops/<family>.cpp, which checks shapes, dtypes and devices, allocates the
// outputs, calls the device's kernel from the kernel table and records the backward
// closure next to the forward. Composite ops (built from the others) record nothing of
// their own: their gradient comes from their parts.
//
// Conventions: dims may be negative (counted from the end); binary ops broadcast as
// NumPy does and promote dtypes (f64 > f32 > f16 > bf16 > i64 > i32 > u8; a float beats
// an integer); inputs must share a device. In-place ops (ending in _) never record a
// gradient and refuse a tensor that requires one while grad mode is on.
#pragma once

#include <array>
#include <optional>
#include <utility>
#include <vector>

#include "tensor.h"

namespace loom {

// ---- creation (ops/creation.cpp) -----------------------------------------------
Tensor zeros(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
Tensor full(const Shape& shape, double value, DType dtype = DType::f32, Device device = Device::cpu());
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor empty_like(const Tensor& t);
// start, start + step, ... below end.
Tensor arange(double start, double end, double step = 1, DType dtype = DType::i64, Device device = Device::cpu());
// A tensor holding `values` (row-major) with the given shape.
Tensor from_vector(const std::vector<float>& values, const Shape& shape, Device device = Device::cpu());
Tensor from_vector(const std::vector<double>& values, const Shape& shape, Device device = Device::cpu());
Tensor from_vector(const std::vector<int64_t>& values, const Shape& shape, Device device = Device::cpu());
Tensor scalar_tensor(double value, DType dtype = DType::f32, Device device = Device::cpu());
void fill_(const Tensor& t, double value);
void zero_(const Tensor& t);

// ---- random (ops/random.cpp): Philox, same numbers on CPU and CUDA for one seed --
void manual_seed(uint64_t seed);
// The generator state (seed, offset), saved in training checkpoints.
std::pair<uint64_t, uint64_t> rng_state();
void set_rng_state(uint64_t seed, uint64_t offset);
Tensor rand(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());   // U[0, 1)
Tensor randn(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());  // N(0, 1)
void uniform_(const Tensor& t, double lo, double hi);
void normal_(const Tensor& t, double mean, double std);

// ---- copies and conversions (ops/copy.cpp) -------------------------------------
// Copies src into dst (broadcasting src, converting dtype, across devices). In place.
void copy_(const Tensor& dst, const Tensor& src);
// Differentiable conversions are the members Tensor::to(Device) and Tensor::to(DType).

// ---- shape (ops/shape.cpp): views are members of Tensor; these make new tensors --
Tensor cat(const TensorList& tensors, int dim);
Tensor stack(const TensorList& tensors, int dim);
TensorList split(const Tensor& t, int64_t split_size, int dim);
// The slices of x along dim as views, dim removed (torch.unbind); one autograd node for all.
TensorList unbind(const Tensor& x, int dim);
// Sums `t` over broadcast dimensions down to `shape` (the gradient of a broadcast).
Tensor sum_to(const Tensor& t, const Shape& shape);
Shape broadcast_shapes(const Shape& a, const Shape& b);

// ---- elementwise (ops/elementwise.cpp) -----------------------------------------
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor rsub(const Tensor& a, double b);  // b - a
Tensor rdiv(const Tensor& a, double b);  // b / a

Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor sign(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor gelu(const Tensor& x);  // tanh approximation

// Comparisons give u8 tensors (0 or 1) and no gradient.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, double b);
Tensor lt(const Tensor& a, double b);
Tensor eq(const Tensor& a, double b);
// cond ? a : b, broadcasting all three; differentiable in a and b.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

// In-place updates (no autograd): a += b, a *= s, a = a * s + b * t ...
void add_(const Tensor& a, const Tensor& b, double alpha = 1);  // a += alpha * b
void mul_(const Tensor& a, double s);
void mul_(const Tensor& a, const Tensor& b);  // a *= b, b broadcast to a's shape and cast to its dtype

// ---- reductions (ops/reduce.cpp) -----------------------------------------------
// Over `dims` (all dims when empty); keepdim keeps them as size 1.
Tensor sum(const Tensor& x, const std::vector<int>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int>& dims = {}, bool keepdim = false);
// Variance with Bessel's correction by default (correction = 1), as torch.var.
Tensor var(const Tensor& x, const std::vector<int>& dims = {}, bool keepdim = false, int correction = 1);
// Maximum over one dim: values (differentiable: the gradient goes to the first maximum)
// and indices (i64).
std::pair<Tensor, Tensor> max(const Tensor& x, int dim, bool keepdim = false);
std::pair<Tensor, Tensor> min(const Tensor& x, int dim, bool keepdim = false);
Tensor max(const Tensor& x);  // over all elements
Tensor argmax(const Tensor& x, int dim, bool keepdim = false);
Tensor argmin(const Tensor& x, int dim, bool keepdim = false);

// ---- matrix products (ops/matmul.cpp) ------------------------------------------
// (..., m, k) @ (..., k, n) with broadcast batch dims; 1-d operands as in torch.matmul.
Tensor matmul(const Tensor& a, const Tensor& b);
// A linear layer: x (..., in) @ weight (out, in)^T + bias (out; may be undefined), as
// torch.nn.functional.linear; one GEMM with the bias added in its epilogue.
// With a residual (the output's shape): residual + x W^T + bias, the sum made by the product
// itself (an f32 residual beside a bf16/f16 product gives an f32 output: a transformer's
// residual stream), so the stream costs no pass of its own.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), const Tensor& residual = Tensor());
// A transformer's MLP as one op: gelu(x W1^T + b1) W2^T + b2 with GELU in its tanh form
// (GPT-2's), x (..., in), w1 (hidden, in), w2 (out, hidden), biases optional. The GELU,
// its gradient and both bias gradients ride in the products' epilogues (engine/ops/linear.cpp).
// A residual is added as linear's is: residual + gelu_mlp(x, ...), in the second product.
Tensor gelu_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                const Tensor& residual = Tensor());

// ---- softmax and losses (ops/softmax.cpp) --------------------------------------
Tensor softmax(const Tensor& x, int dim);
Tensor log_softmax(const Tensor& x, int dim);
// Mean cross-entropy of logits (N, C) against i64 targets (N), ignoring rows whose target
// is ignore_index; label_smoothing in [0, 1). Fused: never materialises probabilities.
// The loss is in the accumulation type: f64 for f64 logits, else f32 (16-bit logits, such as a
// bf16 language-model head, are read as they are and their gradient is written in their dtype).
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100,
                     double label_smoothing = 0.0);
// cross_entropy(matmul(x, weight.t()), target, ...) for x (N, in) and weight (classes, in): a
// classifier's output layer and its loss in one op, as a language model's head. The logits'
// gradient is written over the logits by the loss kernel itself, so no second buffer of
// their size is made, and the logits are not returned. A batch of more than chunk_rows rows
// (0: a power of two of rows whose logits hold at most 2^28 values, 4096 rows for GPT-2's
// 50,257 classes) goes a chunk at a time, and when gradients are recorded both are made
// chunk by chunk in this call, so one chunk's logits exist at a time instead of all (N,
// classes) of them until backward; backward then only scales them. A batch in one chunk
// keeps its logits' gradient for backward's products. Under autocast the products run in
// bf16/f16, with the loss, and the weight's gradient over the chunks, summed in f32.
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& target, int64_t ignore_index = -100,
                            double label_smoothing = 0.0, int64_t chunk_rows = 0);

// ---- indexing (ops/indexing.cpp) -----------------------------------------------
// Rows of `x` along dim picked by i64 `index` (1-d).
Tensor index_select(const Tensor& x, int dim, const Tensor& index);
// out[..., j, ...] = x[..., index[..., j, ...], ...] along dim; index has x's shape except at dim.
Tensor gather(const Tensor& x, int dim, const Tensor& index);
// x with src added at index along dim (out of place; differentiable in x and src).
Tensor scatter_add(const Tensor& x, int dim, const Tensor& index, const Tensor& src);
// Rows of weight (V, D) for each i64 id in `ids` (any shape): output ids.shape + (D).
Tensor embedding(const Tensor& weight, const Tensor& ids);
// A GPT's input: embedding(wte, ids) + wpe[:T] for token ids (B, T), wte (vocabulary, dim)
// and wpe (positions >= T, dim) of one floating dtype, in one pass; backward writes wpe's
// gradient (the sum over the batch) and adds the rows into wte's in one pass too.
Tensor token_position_embedding(const Tensor& wte, const Tensor& wpe, const Tensor& ids);

// ---- operators ------------------------------------------------------------------
inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, double b) { return add(a, -b); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, double b) { return mul(a, 1.0 / b); }
inline Tensor operator+(double a, const Tensor& b) { return add(b, a); }
inline Tensor operator-(double a, const Tensor& b) { return rsub(b, a); }
inline Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
inline Tensor operator/(double a, const Tensor& b) { return rdiv(b, a); }

// ---- convolution and pooling (ops/conv.cpp) -------------------------------------
// Over NCHW tensors; pairs are (height, width). As torch.nn.functional's, with
// OH = (H + 2 padding - dilation (KH - 1) - 1) / stride + 1 (rounding down), likewise OW.
//
// 2-d convolution (cross-correlation) of x (N, C_in, H, W) with weight
// (C_out, C_in / groups, KH, KW), plus bias (C_out) when it is defined: (N, C_out, OH, OW).
// Differentiable in x, weight and bias; CUDA runs cuDNN (f32 on TF32).
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), std::array<int, 2> stride = {1, 1},
              std::array<int, 2> padding = {0, 0}, std::array<int, 2> dilation = {1, 1}, int groups = 1);
// Maximum over each (KH, KW) window; padding (at most half the kernel) never wins. The
// gradient goes to the first maximum of each window. Without a stride, stride = kernel.
Tensor max_pool2d(const Tensor& x, std::array<int, 2> kernel, std::array<int, 2> stride,
                  std::array<int, 2> padding = {0, 0});
Tensor max_pool2d(const Tensor& x, std::array<int, 2> kernel);
// max_pool2d(x + bias.reshape({1, C, 1, 1})) without x + bias in memory: bias (C) has x's
// dtype, and the result and the gradients of x and bias are bit for bit those of the add
// and the pooling one after the other: a convolution's bias added while pooling its output.
Tensor max_pool2d_bias(const Tensor& x, const Tensor& bias, std::array<int, 2> kernel, std::array<int, 2> stride,
                       std::array<int, 2> padding = {0, 0});
// Mean over each window, padding counted as zeros (PyTorch's count_include_pad = true).
Tensor avg_pool2d(const Tensor& x, std::array<int, 2> kernel, std::array<int, 2> stride,
                  std::array<int, 2> padding = {0, 0});
Tensor avg_pool2d(const Tensor& x, std::array<int, 2> kernel);
// Mean down to (OH, OW): (1, 1) is the mean over H and W; otherwise OH and OW must divide
// H and W (equal windows, an avg_pool2d).
Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int, 2> output_size);


// ---- normalisation (ops/norm.cpp) -----------------------------------------------
// Batch normalisation, PyTorch's F.batch_norm: x (N, C, *) normalised per channel (axis 1)
// over every other axis. training: batch statistics (biased variance), and running_mean /
// running_var (C, when defined) updated in place with `momentum` and the unbiased variance;
// otherwise the running statistics normalise. weight and bias (C) may be undefined (1 and 0).
// Differentiable in x, weight and bias. Statistics and affine parameters are f32 (f64 for f64
// x), so bf16 activations keep f32 parameters.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum = 0.1, double eps = 1e-5);
// relu(batch_norm(x, ...) + residual), residual undefined for none: the values and gradients
// of the three ops, bit for bit, with the add and the ReLU fused into the normalisation's
// kernels in training (one pass fewer over the activations each, two with a residual, and
// the ReLU's mask applied inside the backward's). residual must have x's shape; one of
// another dtype, or evaluation, runs the three ops.
Tensor batch_norm_relu(const Tensor& x, const Tensor& residual, const Tensor& running_mean, const Tensor& running_var,
                       const Tensor& weight, const Tensor& bias, bool training, double momentum = 0.1,
                       double eps = 1e-5);

// ---- layer normalisation (ops/layer_norm.cpp) -----------------------------------
// PyTorch's F.layer_norm over the last dim: x (..., D) normalised per row with the row's
// mean and biased variance, y = (x - mean) / sqrt(var + eps) * weight + bias. weight and
// bias (D) may be undefined (1 and 0); when both are given they share a dtype, f32 or x's
// typically, and their gradients come in it. One fused kernel each way; differentiable in
// x, weight and bias. y is in x's dtype, under autocast too, unless out_dtype asks for
// another: a layer whose output feeds an autocast matrix product asks for the 16-bit
// compute dtype, which saves the product a cast of its own.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5,
                  std::optional<DType> out_dtype = std::nullopt);
// {x, layer_norm(x, ...)}: x passed through beside its LayerNorm, for a pre-norm residual
// block where x is both normalised and added back. Use the first output as the residual:
// its gradient then reaches this op's backward and is added inside the LayerNorm kernel,
// instead of a separate pass summing x's two gradients.
TensorList layer_norm_tee(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5,
                          std::optional<DType> out_dtype = std::nullopt);

// ---- fused optimizer updates (ops/optim.cpp) ------------------------------------
// In-place multi-tensor updates with torch.optim's arithmetic (kernels/table.h gives the
// formulas): every tensor of a call on one device, one floating dtype per call, each dense
// in its parameter's layout (row-major, or channels-last with the parameter's shape for a
// channels-last 4-d parameter); on CUDA one kernel launch covers all of them. Not recorded
// by autograd.
//
// SGD: a momentum buffer that is undefined on entry is created (as the gradient) and stored
// back into `momentum_buffers`; with momentum 0 the buffers are not used. `lr_at`, when
// defined (one f64 on the parameters' device), holds the learning rate the kernel reads in
// place of `lr`: a captured step's (engine/cuda_graph.h).
void sgd_update_fused(const TensorList& params, const TensorList& grads, TensorList& momentum_buffers, double lr,
                      double momentum, double dampening, double weight_decay, bool nesterov,
                      const Tensor& lr_at = Tensor());
// dst[i] = src[i] for every pair (same shapes, one device and floating dtype, src[i] dense
// in dst[i]'s layout as above):
// one kernel launch on CUDA, as DDP gathers a bucket's gradients. Not recorded by autograd.
void copy_many_(const TensorList& dst, const TensorList& src);
// Adam (decoupled = false: L2 decay added to the gradient) and AdamW (decoupled = true);
// steps[i] is tensor i's step count including this update (>= 1).
// `scalars_at`, when defined (three f64 on the parameters' device), holds what the kernel
// reads in place of lr and the steps: lr / (1 - beta1^t), sqrt(1 - beta2^t) and
// 1 - lr * weight_decay, for a captured step (engine/cuda_graph.h); every steps[i] is then t.
void adam_update_fused(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                       const TensorList& exp_avg_sqs, const std::vector<int64_t>& steps, double lr, double beta1,
                       double beta2, double eps, double weight_decay, bool decoupled,
                       const Tensor& scalars_at = Tensor());

// ---- attention (ops/attention.cpp) ----------------------------------------------
// Fused attention, torch.nn.functional.scaled_dot_product_attention without attn_mask or
// dropout: softmax(q k^T * scale) v for q (B, H, T_q, D), k and v (B, H, T_kv, D), giving
// (B, H, T_q, D). scale defaults to 1 / sqrt(D). causal masks key j from query i when
// j > i (top-left aligned, as PyTorch's is_causal, also when T_q != T_kv); a query that
// sees no key gives zeros. Differentiable in q, k and v; nothing of size T_q x T_kv is
// stored. Runs in the autocast dtype under a guard, as matmul does. On CUDA, bf16/f16
// with D in {32, 64, 80, 96, 128} use the tensor-core (flash-attention) kernels; other
// dtypes and D up to 256 a slower CUDA-core path. Views whose last dim is stride 1 (such
// as x.view({B, T, H, D}).transpose(1, 2)) are read in place, not copied. The output is laid
// out (B, T_q, H, D) in memory and returned as its (B, H, T_q, D) view: out.transpose(1, 2)
// is contiguous, so it reshapes to (B, T_q, H * D) without a copy.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    std::optional<double> scale = std::nullopt);
// Multi-head self-attention straight from a qkv projection: qkv (B, T, 3C) holds q | k | v
// along its last dim, each C = heads * D wide and split into heads of D columns, exactly as
// qkv.view({B, T, 3, heads, D}) reads it. Gives (B, T, C), the heads' outputs side by side
// ((B, T, heads, D) order), ready for the output projection. The same attention as
// scaled_dot_product_attention on the permuted slices, but without a copy either way: the
// kernels read q, k and v where they lie, and the backward writes dq, dk and dv into one
// (B, T, 3C) gradient. scale 0 means 1 / sqrt(D). Autocast as scaled_dot_product_attention.
Tensor packed_self_attention(const Tensor& qkv, int64_t heads, bool causal, double scale = 0);

}  // namespace loom
