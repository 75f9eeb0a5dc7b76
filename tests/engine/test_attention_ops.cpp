// The engine's scaled_dot_product_attention beyond what the gradient table checks: the
// fused op against its composite (matmul, softmax, where) in outputs and gradients, the
// default scale, autocast, and the messages users see when shapes are wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom {
namespace {

template <class F> void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected a loom::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

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

}  // namespace
}  // namespace loom
