// The engine's attention ops beyond what the gradient table checks: scaled_dot_product_attention
// against its composite (matmul, softmax, where) in outputs and gradients, the default scale,
// autocast, strided views read in place; packed_self_attention against scaled_dot_product_attention
// on the permuted copies GPT used to make; and the messages users see when shapes are wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "tests/common/tensor_checks.h"

namespace loom {
namespace {

using test::expect_error;

void expect_all_close(const Tensor& a, const Tensor& b, double tol) {
  ASSERT_EQ(a.shape(), b.shape());
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i) ASSERT_NEAR(va[i], vb[i], tol) << "element " << i;
}

// softmax(q k^T scale, masked where key j > query i) v, from the primitives.
Tensor composite(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  Tensor s = mul(matmul(q, k.transpose(2, 3)), scale);
  if (causal) {
    const int64_t tq = q.size(2), tk = k.size(2);
    Tensor visible = le(arange(0, double(tk)).reshape({1, tk}), arange(0, double(tq)).reshape({tq, 1}));
    s = where(visible, s, full({}, -INFINITY, s.dtype()));
  }
  return matmul(softmax(s, -1), v);
}

TEST(AttentionOps, FusedMatchesCompositeWithGradients) {
  for (bool causal : {false, true})
    for (auto [tq, tk] : {std::pair<int64_t, int64_t>{7, 9}, {9, 7}, {6, 6}}) {
      SCOPED_TRACE(std::string(causal ? "causal " : "") + std::to_string(tq) + " queries, " + std::to_string(tk) +
                   " keys");
      manual_seed(3);
      Tensor q = randn({2, 3, tq, 5}, DType::f64).set_requires_grad();
      Tensor k = randn({2, 3, tk, 5}, DType::f64).set_requires_grad();
      Tensor v = randn({2, 3, tk, 5}, DType::f64).set_requires_grad();
      Tensor w = randn({2, 3, tq, 5}, DType::f64);
      const double scale = 0.6;
      Tensor fused = scaled_dot_product_attention(q, k, v, causal, scale);
      sum(mul(fused, w)).backward();
      TensorList grads = {q.grad(), k.grad(), v.grad()};
      for (Tensor* t : {&q, &k, &v}) t->zero_grad();
      Tensor reference = composite(q, k, v, causal, scale);
      sum(mul(reference, w)).backward();
      expect_all_close(fused, reference, 1e-12);
      expect_all_close(grads[0], q.grad(), 1e-12);
      expect_all_close(grads[1], k.grad(), 1e-12);
      expect_all_close(grads[2], v.grad(), 1e-12);
    }
}

TEST(AttentionOps, DefaultScaleIsInverseSqrtHeadDim) {
  manual_seed(4);
  Tensor q = randn({1, 2, 4, 16}), k = randn({1, 2, 4, 16}), v = randn({1, 2, 4, 16});
  expect_all_close(scaled_dot_product_attention(q, k, v, true), scaled_dot_product_attention(q, k, v, true, 0.25),
                   0);
}

TEST(AttentionOps, AutocastComputesInBf16AndGivesF32Gradients) {
  manual_seed(5);
  Tensor q = randn({1, 1, 4, 8}).set_requires_grad(), k = randn({1, 1, 4, 8}).set_requires_grad(),
         v = randn({1, 1, 4, 8}).set_requires_grad();
  Tensor out;
  {
    AutocastGuard guard(DType::bf16);
    out = scaled_dot_product_attention(q, k, v, false);
  }
  EXPECT_EQ(out.dtype(), DType::bf16);
  sum(out.to(DType::f32)).backward();
  for (const Tensor* t : {&q, &k, &v}) EXPECT_EQ(t->grad().dtype(), DType::f32);
}

TEST(AttentionOps, ShapeErrorsNameWhatToChange) {
  const Tensor x = zeros({2, 3, 4, 8});
  expect_error([&] { scaled_dot_product_attention(zeros({2, 4, 8}), x, x, false); }, "add the heads dim");
  expect_error([&] { scaled_dot_product_attention(x, x, zeros({2, 3, 5, 8}), false); }, "same shape");
  expect_error([&] { scaled_dot_product_attention(x, zeros({2, 3, 4, 6}), zeros({2, 3, 4, 6}), false); },
               "agree on batch, heads and head_dim");
  expect_error([&] { scaled_dot_product_attention(x, zeros({2, 1, 4, 8}), zeros({2, 1, 4, 8}), false); },
               "repeat them over the heads");
  expect_error([&] { scaled_dot_product_attention(x, x, x, false, NAN); }, "scale must be finite");
  expect_error([&] { scaled_dot_product_attention(x, x, zeros({2, 3, 4, 8}, DType::i64), false); },
               "floating-point");
}

TEST(AttentionOps, StridedViewsGiveWhatContiguousCopiesGive) {
  // q, k, v as (B, H, T, D) views of one (B, T, 3, H, D) tensor, read in place; the upstream
  // gradient once a transposed view, once a broadcast (from sum: all strides zero).
  manual_seed(6);
  const int64_t B = 2, T = 7, H = 3, D = 4;
  Tensor x = randn({B, T, 3, H, D}, DType::f64).set_requires_grad();
  Tensor g = randn({B, T, H, D}, DType::f64).transpose(1, 2);
  auto head = [&](const Tensor& t, int i) { return t.select(2, i).transpose(1, 2); };
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    Tensor strided = scaled_dot_product_attention(head(x, 0), head(x, 1), head(x, 2), causal);
    EXPECT_TRUE(strided.transpose(1, 2).is_contiguous()) << "the output is written in (B, T, H, D) order";
    strided.backward(g);
    Tensor grad_strided = x.grad();
    x.zero_grad();
    sum(scaled_dot_product_attention(head(x, 0), head(x, 1), head(x, 2), causal)).backward();
    Tensor grad_of_sum = x.grad();
    x.zero_grad();

    Tensor copy = x.detach().clone().set_requires_grad();
    TensorList c = {head(copy, 0).contiguous(), head(copy, 1).contiguous(), head(copy, 2).contiguous()};
    Tensor contiguous = scaled_dot_product_attention(c[0], c[1], c[2], causal);
    contiguous.backward(g.contiguous(), RetainGraph::yes);  // c's copies are run through again below
    expect_all_close(strided, contiguous, 0);
    expect_all_close(grad_strided, copy.grad(), 0);
    copy.zero_grad();
    scaled_dot_product_attention(c[0], c[1], c[2], causal).backward(ones({B, H, T, D}, DType::f64));
    expect_all_close(grad_of_sum, copy.grad(), 0);
  }
}

// What CausalSelfAttention computed before packed_self_attention: q, k, v permuted out of the
// projection into contiguous (B, H, T, D) copies, attention, and the heads put back side by side.
Tensor sdpa_on_permuted_copies(const Tensor& qkv, int64_t H, bool causal, double scale) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
  TensorList q_k_v = unbind(qkv.view({B, T, 3, H, C / H}).permute({2, 0, 3, 1, 4}).contiguous(), 0);
  Tensor y = scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2], causal,
                                          scale != 0 ? std::optional<double>(scale) : std::nullopt);
  return y.transpose(1, 2).reshape({B, T, C});
}

TEST(AttentionOps, PackedMatchesSdpaOnPermutedCopiesWithGradients) {
  for (bool causal : {false, true})
    for (double scale : {0.0, 0.4})
      for (DType dt : {DType::f64, DType::f32}) {
        SCOPED_TRACE(std::string(causal ? "causal " : "") + "scale " + std::to_string(scale) + " " +
                     std::string(dtype_name(dt)));
        manual_seed(7);
        const int64_t B = 2, T = 9, H = 3, D = 4, C = H * D;
        Tensor qkv = randn({B, T, 3 * C}, dt).set_requires_grad();
        Tensor w = randn({B, T, C}, dt);
        Tensor packed = packed_self_attention(qkv, H, causal, scale);
        EXPECT_EQ(packed.shape(), (Shape{B, T, C}));
        EXPECT_TRUE(packed.is_contiguous());
        sum(mul(packed, w)).backward();
        Tensor grad = qkv.grad();
        qkv.zero_grad();
        Tensor reference = sdpa_on_permuted_copies(qkv, H, causal, scale);
        sum(mul(reference, w)).backward();
        // The CPU kernels do the same arithmetic in either layout.
        expect_all_close(packed, reference, 0);
        EXPECT_EQ(grad.shape(), qkv.shape());
        expect_all_close(grad, qkv.grad(), 0);
      }
}

TEST(AttentionOps, PackedTakesBroadcastAndStridedGradients) {
  manual_seed(8);
  Tensor qkv = randn({2, 5, 24}, DType::f64).set_requires_grad();
  sum(packed_self_attention(qkv, 2, true)).backward();  // a broadcast gradient: all strides zero
  Tensor grad_of_sum = qkv.grad();
  qkv.zero_grad();
  packed_self_attention(qkv, 2, true).backward(ones({2, 5, 8}, DType::f64));
  expect_all_close(grad_of_sum, qkv.grad(), 0);
  qkv.zero_grad();
  Tensor g = randn({2, 8, 5}, DType::f64);
  packed_self_attention(qkv, 2, true).backward(g.transpose(1, 2));  // last dim stride 5
  Tensor grad_strided = qkv.grad();
  qkv.zero_grad();
  packed_self_attention(qkv, 2, true).backward(g.transpose(1, 2).contiguous());
  expect_all_close(grad_strided, qkv.grad(), 0);
}

TEST(AttentionOps, PackedAutocastComputesInBf16AndGivesF32Gradients) {
  manual_seed(9);
  Tensor qkv = randn({1, 4, 48}).set_requires_grad();
  Tensor out;
  {
    AutocastGuard guard(DType::bf16);
    out = packed_self_attention(qkv, 2, true);
  }
  EXPECT_EQ(out.dtype(), DType::bf16);
  Tensor reference = sdpa_on_permuted_copies(qkv.detach().to(DType::bf16), 2, true, 0);
  expect_all_close(out, reference, 0);
  sum(out.to(DType::f32)).backward();
  EXPECT_EQ(qkv.grad().dtype(), DType::f32);
  EXPECT_EQ(qkv.grad().shape(), qkv.shape());
}

TEST(AttentionOps, PackedShapeErrorsNameWhatToChange) {
  expect_error([] { packed_self_attention(zeros({2, 3, 4, 8}), 2, true); }, "call scaled_dot_product_attention");
  expect_error([] { packed_self_attention(zeros({2, 4, 20}), 2, true); }, "multiple of 3 * heads = 6");
  expect_error([] { packed_self_attention(zeros({2, 4, 24}), 0, true); }, "heads must be positive");
  expect_error([] { packed_self_attention(zeros({2, 4, 24}), 2, true, INFINITY); }, "scale must be finite");
  expect_error([] { packed_self_attention(zeros({2, 4, 24}, DType::i64), 2, true); }, "floating-point");
  expect_error([] { packed_self_attention(Tensor(), 2, true); }, "qkv");
}

}  // namespace
}  // namespace loom
