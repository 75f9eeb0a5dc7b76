#include "tests/engine/op_cases.h"

#include <algorithm>
#include <random>

namespace loom::test {

Tensor ids(const std::vector<int64_t>& values, const Shape& shape, Device device) {
  return from_vector(values, shape, device);
}

TensorList make_inputs(const OpCase& c) {
  std::mt19937_64 rng(std::hash<std::string>()(c.name));
  TensorList out;
  for (const InputSpec& spec : c.inputs) {
    int64_t n = shape_numel(spec.shape);
    std::vector<double> v(static_cast<size_t>(n));
    std::uniform_real_distribution<double> u(-2.0, 2.0), pos(0.5, 2.5);
    if (spec.init == Init::separated) {
      // A shuffled ramp: distinct values at least 0.1 apart, away from zero.
      for (int64_t i = 0; i < n; ++i) v[i] = (double(i) - double(n) / 2 + 0.5) * 0.25 + 0.05;
      std::shuffle(v.begin(), v.end(), rng);
    } else {
      for (auto& x : v) x = spec.init == Init::positive ? pos(rng) : u(rng);
    }
    out.push_back(from_vector(v, spec.shape));
  }
  return out;
}

namespace {
using L = const TensorList&;
const Shape S34{3, 4};

// Running statistics for the batch_norm rows: (C) in x's accumulation type on x's device,
// made fresh on every call because training updates them in place.
Tensor channel_values(const Tensor& x, const std::vector<double>& values) {
  const DType acc = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  return from_vector(values, {int64_t(values.size())}, x.device()).to(acc);
}

// x laid out channels-last (N, H, W, C in memory), through a differentiable copy.
Tensor nhwc(const Tensor& x) { return x.contiguous(MemoryFormat::channels_last); }
}  // namespace

const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cases = {
      // ---- binary, with broadcasting -------------------------------------------
      {"add", {{{3, 4}}, {{4}}}, [](L x) { return add(x[0], x[1]); }},
      {"add_bcast3", {{{2, 1, 3}}, {{4, 1}}}, [](L x) { return add(x[0], x[1]); }},
      {"sub", {{{3, 4}}, {{3, 1}}}, [](L x) { return sub(x[0], x[1]); }},
      {"mul", {{{2, 3, 4}}, {{3, 4}}}, [](L x) { return mul(x[0], x[1]); }},
      {"div", {{{3, 4}}, {{3, 4}, Init::positive}}, [](L x) { return div(x[0], x[1]); }},
      {"pow", {{S34, Init::positive}, {S34}}, [](L x) { return pow(x[0], x[1]); }},
      {"maximum", {{S34, Init::separated}, {S34, Init::separated}}, [](L x) { return maximum(x[0], x[1]); }},
      {"minimum", {{S34, Init::separated}, {{4}, Init::separated}}, [](L x) { return minimum(x[0], x[1]); }},
      {"add_noncontig", {{{4, 3}}, {{3, 4}}}, [](L x) { return add(x[0].t(), x[1]); }},
      {"where", {{S34}, {S34}}, [](L x) { return where(gt(x[0], 0.0), x[0], mul(x[1], x[1])); }},
      // ---- scalar forms ------------------------------------------------------------
      {"add_scalar", {{S34}}, [](L x) { return x[0] + 1.5; }},
      {"mul_scalar", {{S34}}, [](L x) { return x[0] * -3.0; }},
      {"pow_scalar", {{S34, Init::positive}}, [](L x) { return pow(x[0], 2.5); }},
      {"rsub_scalar", {{S34}}, [](L x) { return 2.0 - x[0]; }},
      {"rdiv_scalar", {{S34, Init::positive}}, [](L x) { return 2.0 / x[0]; }},
      // ---- unary --------------------------------------------------------------------
      {"neg", {{S34}}, [](L x) { return neg(x[0]); }},
      {"abs", {{S34, Init::separated}}, [](L x) { return abs(x[0]); }},
      {"exp", {{S34}}, [](L x) { return exp(x[0]); }},
      {"log", {{S34, Init::positive}}, [](L x) { return log(x[0]); }},
      {"sqrt", {{S34, Init::positive}}, [](L x) { return sqrt(x[0]); }},
      {"rsqrt", {{S34, Init::positive}}, [](L x) { return rsqrt(x[0]); }},
      {"tanh", {{S34}}, [](L x) { return tanh(x[0]); }},
      {"sigmoid", {{S34}}, [](L x) { return sigmoid(x[0]); }},
      {"relu", {{S34, Init::separated}}, [](L x) { return relu(x[0]); }},
      {"gelu", {{S34}}, [](L x) { return gelu(x[0]); }},
      {"unary_noncontig", {{{4, 3}}}, [](L x) { return tanh(x[0].t()); }},
      // ---- reductions -------------------------------------------------------------
      {"sum_all", {{{2, 3, 4}}}, [](L x) { return sum(x[0]); }},
      {"sum_dim", {{{2, 3, 4}}}, [](L x) { return sum(x[0], {1}); }},
      {"sum_dims_keep", {{{2, 3, 4}}}, [](L x) { return sum(x[0], {0, 2}, true); }},
      {"sum_noncontig", {{{4, 3}}}, [](L x) { return sum(x[0].t(), {1}); }},
      {"sum_two_runs", {{{2, 3, 4, 5}}}, [](L x) { return sum(x[0], {0, 2, 3}); }},
      {"mean_two_runs_keep", {{{2, 3, 4, 5}}}, [](L x) { return mean(x[0], {0, 2}, true); }},
      {"mean", {{{2, 3, 4}}}, [](L x) { return mean(x[0], {-1}); }},
      {"var", {{{3, 5}}}, [](L x) { return var(x[0], {1}); }},
      {"max_dim", {{{3, 5}, Init::separated}}, [](L x) { return max(x[0], 1).first; }},
      {"min_dim0", {{{3, 5}, Init::separated}}, [](L x) { return min(x[0], 0, true).first; }},
      {"max_all", {{{3, 5}, Init::separated}}, [](L x) { return max(x[0]); }},
      // ---- matrix products --------------------------------------------------------
      {"matmul", {{{3, 5}}, {{5, 4}}}, [](L x) { return matmul(x[0], x[1]); }},
      {"matmul_batched", {{{2, 3, 5}}, {{2, 5, 4}}}, [](L x) { return matmul(x[0], x[1]); }},
      {"matmul_bcast", {{{2, 3, 5}}, {{5, 4}}}, [](L x) { return matmul(x[0], x[1]); }},
      {"matmul_transposed", {{{5, 3}}, {{4, 5}}}, [](L x) { return matmul(x[0].t(), x[1].t()); }},
      {"matmul_vec", {{{5}}, {{5, 4}}}, [](L x) { return matmul(x[0], x[1]); }},
      {"unbind", {{{3, 2, 4}}}, [](L x) {
         TensorList p = unbind(x[0], 1);
         return add(mul(p[0], 2.0), p[1]);
       }},
      {"linear", {{{2, 3, 5}}, {{4, 5}}, {{4}}}, [](L x) { return linear(x[0], x[1], x[2]); }},
      {"linear_no_bias", {{{3, 5}}, {{4, 5}}}, [](L x) { return linear(x[0], x[1]); }},
      {"linear_strided_input", {{{5, 3}}, {{4, 5}}, {{4}}}, [](L x) { return linear(x[0].t(), x[1], x[2]); }},
      {"gelu_mlp", {{{2, 3, 5}}, {{6, 5}}, {{6}}, {{4, 6}}, {{4}}},
       [](L x) { return gelu_mlp(x[0], x[1], x[2], x[3], x[4]); }},
      {"linear_residual", {{{2, 3, 5}}, {{4, 5}}, {{4}}, {{2, 3, 4}}},
       [](L x) { return linear(x[0], x[1], x[2], x[3]); }},
      {"gelu_mlp_residual", {{{2, 3, 5}}, {{6, 5}}, {{6}}, {{4, 6}}, {{4}}, {{2, 3, 4}}},
       [](L x) { return gelu_mlp(x[0], x[1], x[2], x[3], x[4], x[5]); }},
      {"gelu_mlp_no_bias", {{{3, 5}}, {{6, 5}}, {{4, 6}}}, [](L x) { return gelu_mlp(x[0], x[1], Tensor(), x[2], Tensor()); }},
      {"gelu_mlp_strided_input", {{{5, 3}}, {{6, 5}}, {{6}}, {{4, 6}}, {{4}}},
       [](L x) { return gelu_mlp(x[0].t(), x[1], x[2], x[3], x[4]); }},
      {"matmul_matvec", {{{3, 5}}, {{5}}}, [](L x) { return matmul(x[0], x[1]); }},
      // ---- softmax and losses ------------------------------------------------------
      {"softmax", {{{3, 7}}}, [](L x) { return softmax(x[0], -1); }},
      {"softmax_dim0", {{{3, 4, 2}}}, [](L x) { return softmax(x[0], 1); }},
      {"log_softmax", {{{3, 7}}}, [](L x) { return log_softmax(x[0], 1); }},
      {"cross_entropy", {{{4, 5}}},
       [](L x) { return cross_entropy(x[0], ids({1, 0, 4, 2}, {4}, x[0].device())); }},
      {"cross_entropy_ignore_smooth", {{{4, 5}}},
       [](L x) { return cross_entropy(x[0], ids({1, -100, 4, 3}, {4}, x[0].device()), -100, 0.1); }},
      {"linear_cross_entropy", {{{4, 3}}, {{5, 3}}},
       [](L x) { return linear_cross_entropy(x[0], x[1], ids({1, 0, 4, 2}, {4}, x[0].device())); }},
      {"linear_cross_entropy_ignore_smooth", {{{4, 3}}, {{5, 3}}},
       [](L x) { return linear_cross_entropy(x[0], x[1], ids({1, -100, 4, 3}, {4}, x[0].device()), -100, 0.1); }},
      {"linear_cross_entropy_transposed_x", {{{3, 4}}, {{5, 3}}},
       [](L x) { return linear_cross_entropy(x[0].t(), x[1], ids({4, 4, 0, 2}, {4}, x[0].device())); }},
      {"linear_cross_entropy_chunks", {{{5, 3}}, {{4, 3}}},
       [](L x) { return linear_cross_entropy(x[0], x[1], ids({1, -100, 3, 0, 2}, {5}, x[0].device()), -100, 0.1, 2); }},
      // ---- attention: the CPU kernel's f64 gradients; on CUDA, D = 32 in bf16/f16 takes
      // the tensor-core kernels and the others the rows kernels -------------------------
      {"sdpa", {{{1, 2, 5, 4}}, {{1, 2, 5, 4}}, {{1, 2, 5, 4}}},
       [](L x) { return scaled_dot_product_attention(x[0], x[1], x[2], false); }},
      {"sdpa_causal", {{{2, 1, 6, 3}}, {{2, 1, 6, 3}}, {{2, 1, 6, 3}}},
       [](L x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); }},
      {"sdpa_causal_more_keys_scale", {{{1, 2, 3, 4}}, {{1, 2, 5, 4}}, {{1, 2, 5, 4}}},
       [](L x) { return scaled_dot_product_attention(x[0], x[1], x[2], true, 0.7); }},
      {"sdpa_causal_fewer_keys", {{{1, 1, 5, 4}}, {{1, 1, 3, 4}}, {{1, 1, 3, 4}}},
       [](L x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); }},
      {"sdpa_head_dim32_causal", {{{1, 2, 9, 32}}, {{1, 2, 9, 32}}, {{1, 2, 9, 32}}},
       [](L x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); }},
      {"sdpa_noncontig", {{{1, 5, 2, 4}}, {{1, 2, 5, 4}}, {{1, 5, 2, 4}}},
       [](L x) {
         return scaled_dot_product_attention(x[0].permute({0, 2, 1, 3}), x[1], x[2].permute({0, 2, 1, 3}), false);
       }},
      {"sdpa_qkv_views_head_dim32_causal", {{{1, 9, 3, 2, 32}}},
       [](L x) {
         auto head = [&](int i) { return x[0].select(2, i).transpose(1, 2); };  // (B, H, T, D) views
         return scaled_dot_product_attention(head(0), head(1), head(2), true);
       }},
      // packed_self_attention: qkv (B, T, 3C) read in place (a column slice of a wider
      // buffer too); a transposed qkv, whose last dim is not stride 1, is copied first
      {"packed_attention", {{{2, 5, 12}}}, [](L x) { return packed_self_attention(x[0], 2, false); }},
      {"packed_attention_causal_scale", {{{2, 6, 18}}}, [](L x) { return packed_self_attention(x[0], 3, true, 0.7); }},
      {"packed_attention_head_dim32_causal", {{{1, 9, 192}}},
       [](L x) { return packed_self_attention(x[0], 2, true); }},
      {"packed_attention_sliced", {{{2, 5, 14}}},
       [](L x) { return packed_self_attention(x[0].slice(2, 1, 13), 2, true); }},
      {"packed_attention_transposed", {{{2, 12, 5}}},
       [](L x) { return packed_self_attention(x[0].transpose(1, 2), 2, false); }},
      // ---- indexing ---------------------------------------------------------------
      {"index_select", {{{5, 3}}}, [](L x) { return index_select(x[0], 0, ids({4, 0, 4, 2}, {4}, x[0].device())); }},
      {"index_select_dim1", {{{2, 5, 3}}},
       [](L x) { return index_select(x[0], 1, ids({1, 1, 3}, {3}, x[0].device())); }},
      {"token_position_embedding", {{{7, 3}}, {{5, 3}}},
       [](L x) { return token_position_embedding(x[0], x[1], ids({1, 6, 0, 1, 2, 2, 5, 1}, {2, 4}, x[0].device())); }},
      {"embedding", {{{6, 4}}}, [](L x) { return embedding(x[0], ids({5, 0, 5, 1, 2, 0}, {2, 3}, x[0].device())); }},
      {"gather", {{{3, 4}}},
       [](L x) { return gather(x[0], 1, ids({0, 3, 3, 1, 2, 2, 0, 0, 1}, {3, 3}, x[0].device())); }},
      {"scatter_add", {{{3, 4}}, {{3, 2}}},
       [](L x) { return scatter_add(x[0], 1, ids({0, 0, 3, 1, 2, 2}, {3, 2}, x[0].device()), x[1]); }},
      // ---- shapes -----------------------------------------------------------------
      {"reshape", {{{2, 6}}}, [](L x) { return x[0].reshape({3, -1}) * x[0].reshape({3, 4}); }},
      {"permute", {{{2, 3, 4}}}, [](L x) { return x[0].permute({2, 0, 1}).contiguous(); }},
      {"slice_step", {{{6, 4}}}, [](L x) { return x[0].slice(0, 1, 6, 2) * 2.0; }},
      {"select", {{{3, 4}}}, [](L x) { return x[0].select(1, -1); }},
      {"expand", {{{3, 1}}}, [](L x) { return x[0].expand({2, 3, 4}) * 1.0; }},
      {"squeeze_unsqueeze", {{{3, 1, 4}}}, [](L x) { return x[0].squeeze(1).unsqueeze(0); }},
      {"cat", {{{2, 3}}, {{4, 3}}}, [](L x) { return cat({x[0], x[1]}, 0); }},
      {"stack", {{{2, 3}}, {{2, 3}}}, [](L x) { return stack({x[0], x[1]}, 1); }},
      {"split", {{{5, 2}}}, [](L x) { return split(x[0], 2, 0)[2] * 3.0; }},
      {"clone", {{S34}}, [](L x) { return x[0].clone(); }},
      // ---- convolution and pooling
      {"conv3x3_pad1_bias", {{{2, 3, 5, 5}}, {{4, 3, 3, 3}}, {{4}}},
       [](L x) { return conv2d(x[0], x[1], x[2], {1, 1}, {1, 1}); }},
      {"conv3x3_stride2", {{{2, 2, 7, 6}}, {{3, 2, 3, 3}}},
       [](L x) { return conv2d(x[0], x[1], Tensor(), {2, 2}, {1, 0}); }},
      {"conv3x3_dilation2", {{{1, 2, 7, 7}}, {{2, 2, 3, 3}}},
       [](L x) { return conv2d(x[0], x[1], Tensor(), {1, 1}, {2, 1}, {2, 2}); }},
      {"conv3x3_groups2_bias", {{{2, 4, 5, 5}}, {{6, 2, 3, 3}}, {{6}}},
       [](L x) { return conv2d(x[0], x[1], x[2], {1, 1}, {1, 1}, {1, 1}, 2); }},
      {"conv1x1_bias", {{{2, 3, 4, 4}}, {{5, 3, 1, 1}}, {{5}}}, [](L x) { return conv2d(x[0], x[1], x[2]); }},
      {"conv_rect_kernel_stride", {{{1, 2, 5, 7}}, {{3, 2, 2, 3}}},
       [](L x) { return conv2d(x[0], x[1], Tensor(), {1, 2}, {0, 1}); }},
      {"conv3x3_residual", {{{2, 3, 5, 5}}, {{3, 3, 3, 3}}},
       [](L x) {
         const Tensor y = conv2d(x[0], x[1], Tensor(), {1, 1}, {1, 1});
         return add(y, mul(x[0], 3.0));
       }},
      {"shortcut_conv3x3", {{{2, 3, 5, 5}}, {{3, 3, 3, 3}}},
       [](L x) {
         const Tensor shortcut = mul(x[0], 3.0);
         return add(shortcut, conv2d(x[0], x[1], Tensor(), {1, 1}, {1, 1}));
       }},
      {"conv_noncontig", {{{2, 5, 5, 3}}, {{4, 3, 3, 3}}},
       [](L x) { return conv2d(x[0].permute({0, 3, 1, 2}), x[1], Tensor(), {1, 1}, {1, 1}); }},
      {"max_pool2x2", {{{2, 3, 4, 6}, Init::separated}}, [](L x) { return max_pool2d(x[0], {2, 2}); }},
      {"max_pool3x3_stride2_pad1", {{{1, 2, 7, 7}, Init::separated}},
       [](L x) { return max_pool2d(x[0], {3, 3}, {2, 2}, {1, 1}); }},
      {"max_pool2x2_bias", {{{2, 3, 4, 6}, Init::separated}, {{3}}},
       [](L x) { return max_pool2d_bias(x[0], x[1], {2, 2}, {2, 2}); }},
      {"avg_pool2x2", {{{2, 3, 4, 6}}}, [](L x) { return avg_pool2d(x[0], {2, 2}); }},
      {"avg_pool3x3_stride2_pad1", {{{1, 2, 7, 6}}},
       [](L x) { return avg_pool2d(x[0], {3, 3}, {2, 2}, {1, 1}); }},
      {"adaptive_avg_pool_1x1", {{{2, 3, 4, 4}}}, [](L x) { return adaptive_avg_pool2d(x[0], {1, 1}); }},
      // ---- the CNN ops on channels-last inputs (MemoryFormat), each output channels-last
      {"conv3x3_bias_channels_last", {{{2, 3, 5, 5}}, {{4, 3, 3, 3}}, {{4}}},
       [](L x) { return conv2d(nhwc(x[0]), x[1], x[2], {1, 1}, {1, 1}); }},
      {"conv3x3_stride2_channels_last", {{{2, 2, 7, 6}}, {{3, 2, 3, 3}}},
       [](L x) { return conv2d(nhwc(x[0]), x[1], Tensor(), {2, 2}, {1, 0}); }},
      // x through a convolution and a shortcut, each made first: the backward runs the later
      // one first, so in *_residual the convolution adds its input gradient into the
      // shortcut's (record_accumulating), in shortcut_* the sum is the pass's own.
      {"conv3x3_residual_channels_last", {{{2, 3, 5, 5}}, {{3, 3, 3, 3}}},
       [](L x) {
         const Tensor h = nhwc(x[0]);
         const Tensor y = conv2d(h, x[1], Tensor(), {1, 1}, {1, 1});
         return add(y, mul(h, 3.0));
       }},
      {"shortcut_conv3x3_channels_last", {{{2, 3, 5, 5}}, {{3, 3, 3, 3}}},
       [](L x) {
         const Tensor h = nhwc(x[0]);
         const Tensor shortcut = mul(h, 3.0);
         return add(shortcut, conv2d(h, x[1], Tensor(), {1, 1}, {1, 1}));
       }},
      {"max_pool2x2_channels_last", {{{2, 3, 4, 6}, Init::separated}},
       [](L x) { return max_pool2d(nhwc(x[0]), {2, 2}); }},
      {"max_pool3x3_bias_channels_last", {{{1, 2, 7, 6}, Init::separated}, {{2}}},
       [](L x) { return max_pool2d_bias(nhwc(x[0]), x[1], {3, 3}, {2, 2}, {1, 1}); }},
      {"avg_pool3x3_channels_last", {{{1, 2, 7, 6}}},
       [](L x) { return avg_pool2d(nhwc(x[0]), {3, 3}, {2, 2}, {1, 1}); }},
      {"adaptive_avg_pool_1x1_channels_last", {{{2, 3, 4, 4}}},
       [](L x) { return adaptive_avg_pool2d(nhwc(x[0]), {1, 1}); }},
      {"relu_channels_last", {{{2, 3, 3, 4}, Init::separated}}, [](L x) { return relu(nhwc(x[0])); }},
      {"bias_gradient_sum_channels_last", {{{2, 3, 3, 4}}}, [](L x) { return sum(nhwc(x[0]), {0, 2, 3}); }},
      {"spatial_mean_channels_last", {{{2, 3, 3, 4}}}, [](L x) { return mean(nhwc(x[0]), {2, 3}); }},
      {"residual_add_channels_last", {{{2, 3, 3, 4}}, {{2, 3, 3, 4}}}, [](L x) { return nhwc(x[0]) + nhwc(x[1]); }},
      {"bias_add_channels_last", {{{2, 3, 3, 4}}, {{1, 3, 1, 1}}}, [](L x) { return nhwc(x[0]) + x[1]; }},
      {"mixed_layouts_mul", {{{2, 3, 3, 4}}, {{2, 3, 3, 4}}}, [](L x) { return nhwc(x[0]) * x[1]; }},
      {"adaptive_avg_pool_2x3", {{{1, 2, 4, 6}}}, [](L x) { return adaptive_avg_pool2d(x[0], {2, 3}); }},
      // ---- normalisation ------------------------------------------------------------
      {"batch_norm_train_4d_affine", {{{3, 2, 2, 3}}, {{2}}, {{2}}},
       [](L x) { return batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], true); }},
      {"batch_norm_train_channels_last", {{{3, 2, 2, 3}}, {{2}}, {{2}}},
       [](L x) { return batch_norm(nhwc(x[0]), Tensor(), Tensor(), x[1], x[2], true); }},
      {"batch_norm_relu_residual", {{{3, 2, 2, 3}}, {{2}}, {{2}}, {{3, 2, 2, 3}}},
       [](L x) { return batch_norm_relu(x[0], x[3], Tensor(), Tensor(), x[1], x[2], true); }, false},
      {"batch_norm_relu_channels_last", {{{3, 2, 2, 3}}, {{2}}, {{2}}, {{3, 2, 2, 3}}},
       [](L x) { return batch_norm_relu(nhwc(x[0]), nhwc(x[3]), Tensor(), Tensor(), x[1], x[2], true); },
       false},
      {"batch_norm_relu_no_residual", {{{4, 3, 5}}, {{3}}},
       [](L x) {
         return batch_norm_relu(x[0], Tensor(), channel_values(x[0], {0.5, -1, 0}), channel_values(x[0], {1, 2, 0.5}),
                                x[1], Tensor(), true, 0.3, 1e-3);
       },
       false},
      {"batch_norm_relu_eval", {{{2, 3, 2, 2}}, {{3}}, {{2, 3, 2, 2}}},
       [](L x) {
         return batch_norm_relu(x[0], x[2], channel_values(x[0], {0.5, -1, 0.25}), channel_values(x[0], {1.5, 0.5, 2}),
                                x[1], Tensor(), false);
       },
       false},
      {"batch_norm_train_2d", {{{5, 3}}},
       [](L x) { return batch_norm(x[0], Tensor(), Tensor(), Tensor(), Tensor(), true); }},
      {"batch_norm_train_3d_running_stats", {{{4, 3, 5}}, {{3}}},
       [](L x) {
         return batch_norm(x[0], channel_values(x[0], {0.5, -1, 0}), channel_values(x[0], {1, 2, 0.5}), x[1],
                           Tensor(), true, 0.3, 1e-3);
       }},
      {"batch_norm_train_noncontig", {{{3, 4}}, {{3}}},
       [](L x) { return batch_norm(x[0].t(), Tensor(), Tensor(), Tensor(), x[1], true); }},
      {"batch_norm_eval_4d_affine", {{{2, 3, 2, 2}}, {{3}}, {{3}}},
       [](L x) {
         return batch_norm(x[0], channel_values(x[0], {0.5, -1, 0.25}), channel_values(x[0], {1.5, 0.5, 2}), x[1],
                           x[2], false);
       }},
      {"batch_norm_eval_channels_last", {{{2, 3, 2, 2}}, {{3}}, {{3}}},
       [](L x) {
         return batch_norm(nhwc(x[0]), channel_values(x[0], {0.5, -1, 0.25}), channel_values(x[0], {1.5, 0.5, 2}),
                           x[1], x[2], false);
       }},
      {"batch_norm_eval_2d", {{{4, 3}}},
       [](L x) {
         return batch_norm(x[0], channel_values(x[0], {0.1, 0.2, -0.3}), channel_values(x[0], {0.8, 1.2, 3}),
                           Tensor(), Tensor(), false);
       }},
      {"layer_norm_affine", {{{2, 3, 5}}, {{5}}, {{5}}}, [](L x) { return layer_norm(x[0], x[1], x[2]); }},
      {"layer_norm_no_affine", {{{4, 7}}}, [](L x) { return layer_norm(x[0], Tensor(), Tensor(), 1e-3); }},
      {"layer_norm_weight_only_noncontig", {{{6, 3}}, {{12}}},
       [](L x) { return layer_norm(x[0].t(), x[1].slice(0, 0, 12, 2), Tensor()); }},
      {"layer_norm_vectors_dim16", {{{3, 16}}, {{16}}, {{16}}}, [](L x) { return layer_norm(x[0], x[1], x[2]); }},
      // Both outputs used, so the passed-through input's gradient meets the LayerNorm's in
      // the kernel (single values, vectors, and a block per row on CUDA).
      {"layer_norm_tee", {{{3, 7}}, {{7}}, {{7}}},
       [](L x) { TensorList t = layer_norm_tee(x[0], x[1], x[2]); return add(mul(t[0], 0.5), t[1]); }},
      {"layer_norm_tee_vectors_dim64", {{{4, 64}}, {{64}}, {{64}}},
       [](L x) { TensorList t = layer_norm_tee(x[0], x[1], x[2]); return mul(t[0], t[1]); }},
      {"layer_norm_tee_block_dim1100", {{{2, 1100}}, {{1100}}, {{1100}}},
       [](L x) { TensorList t = layer_norm_tee(x[0], x[1], x[2]); return add(t[0], t[1]); }},
  };
  return cases;
}

}  // namespace loom::test
