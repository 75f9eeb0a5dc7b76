// linear and gelu_mlp beyond the gradient table: each against the ops it fuses (matmul,
// add, gelu) in outputs and all gradients, with and without biases, leading dims folded,
// an input that needs no gradient, and the messages users see for mismatched shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "tests/common/tensor_checks.h"

namespace loom {
namespace {

using test::expect_all_close;
using test::expect_error;

Tensor composite_linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  Tensor y = matmul(x, w.t());
  return b.defined() ? add(y, b) : y;
}

// Runs f on the leaves, back-propagates sum(f * up), and returns the output and the
// leaves' gradients (undefined tensors skipped), clearing them after.
TensorList run(const std::function<Tensor()>& f, const Tensor& up, TensorList leaves) {
  Tensor y = f();
  sum(mul(y, up)).backward();
  TensorList out{y.detach()};
  for (Tensor& t : leaves) {
    if (!t.defined()) continue;
    out.push_back(t.grad().clone());
    t.zero_grad();
  }
  return out;
}

TEST(LinearOps, GeluMlpMatchesCompositeWithGradients) {
  for (bool biases : {true, false}) {
    SCOPED_TRACE(biases ? "biases" : "no biases");
    manual_seed(5);
    Tensor x = randn({2, 3, 5}, DType::f64).set_requires_grad();
    Tensor w1 = randn({7, 5}, DType::f64).set_requires_grad(), w2 = randn({4, 7}, DType::f64).set_requires_grad();
    Tensor b1 = biases ? randn({7}, DType::f64).set_requires_grad() : Tensor();
    Tensor b2 = biases ? randn({4}, DType::f64).set_requires_grad() : Tensor();
    Tensor up = randn({2, 3, 4}, DType::f64);
    const TensorList leaves{x, w1, b1, w2, b2};
    TensorList fused = run([&] { return gelu_mlp(x, w1, b1, w2, b2); }, up, leaves);
    TensorList plain = run(
        [&] { return composite_linear(gelu(composite_linear(x, w1, b1)), w2, b2); }, up, leaves);
    ASSERT_EQ(fused.size(), plain.size());
    for (size_t i = 0; i < fused.size(); ++i) expect_all_close(fused[i], plain[i], 1e-12, "output/grad " + std::to_string(i));
  }
}

TEST(LinearOps, LinearMatchesCompositeWithGradients) {
  manual_seed(6);
  Tensor x = randn({3, 4, 6}, DType::f64).set_requires_grad();
  Tensor w = randn({5, 6}, DType::f64).set_requires_grad(), b = randn({5}, DType::f64).set_requires_grad();
  Tensor up = randn({3, 4, 5}, DType::f64);
  TensorList fused = run([&] { return linear(x, w, b); }, up, {x, w, b});
  TensorList plain = run([&] { return composite_linear(x, w, b); }, up, {x, w, b});
  for (size_t i = 0; i < fused.size(); ++i) expect_all_close(fused[i], plain[i], 1e-12, "output/grad " + std::to_string(i));
}

TEST(LinearOps, ResidualJoinsTheProduct) {
  manual_seed(9);
  Tensor x = randn({2, 3, 5}, DType::f64).set_requires_grad(), r = randn({2, 3, 4}, DType::f64).set_requires_grad();
  Tensor w1 = randn({7, 5}, DType::f64).set_requires_grad(), b1 = randn({7}, DType::f64).set_requires_grad();
  Tensor w2 = randn({4, 7}, DType::f64).set_requires_grad(), b2 = randn({4}, DType::f64).set_requires_grad();
  Tensor w = randn({4, 5}, DType::f64).set_requires_grad();
  Tensor up = randn({2, 3, 4}, DType::f64);
  const TensorList leaves{x, r, w1, b1, w2, b2, w};
  TensorList fused = run([&] { return add(gelu_mlp(x, w1, b1, w2, b2, r), linear(x, w, b2, r)); }, up, leaves);
  TensorList plain = run(
      [&] {
        return add(add(r, composite_linear(gelu(composite_linear(x, w1, b1)), w2, b2)), add(r, composite_linear(x, w, b2)));
      },
      up, leaves);
  for (size_t i = 0; i < fused.size(); ++i) expect_all_close(fused[i], plain[i], 1e-12, "output/grad " + std::to_string(i));
  // A residual the product cannot take (broadcast, or another dtype) is added after it.
  Tensor row = randn({4}, DType::f64);
  expect_all_close(linear(x, w, b2, row).detach(), add(row, composite_linear(x, w, b2)).detach(), 1e-12, "broadcast");
}

TEST(LinearOps, InputWithoutGradientStillGivesParameterGradients) {
  manual_seed(7);
  Tensor x = randn({6, 5}, DType::f64);  // no gradient wanted: the dx product is skipped
  Tensor w1 = randn({8, 5}, DType::f64).set_requires_grad(), b1 = randn({8}, DType::f64).set_requires_grad();
  Tensor w2 = randn({3, 8}, DType::f64).set_requires_grad(), b2 = randn({3}, DType::f64).set_requires_grad();
  Tensor up = randn({6, 3}, DType::f64);
  TensorList fused = run([&] { return gelu_mlp(x, w1, b1, w2, b2); }, up, {w1, b1, w2, b2});
  TensorList plain =
      run([&] { return composite_linear(gelu(composite_linear(x, w1, b1)), w2, b2); }, up, {w1, b1, w2, b2});
  for (size_t i = 0; i < fused.size(); ++i) expect_all_close(fused[i], plain[i], 1e-12, "output/grad " + std::to_string(i));
  EXPECT_FALSE(x.grad().defined());
}

// The classifier's loss against cross_entropy of matmul: the loss and both gradients, with
// ignored rows, label smoothing and an upstream gradient other than 1; then with only the
// weight wanting a gradient, and with neither (no gradient written over the logits).
TEST(LinearOps, LinearCrossEntropyMatchesCompositeWithGradients) {
  manual_seed(8);
  Tensor x = randn({6, 5}, DType::f64).set_requires_grad(), w = randn({7, 5}, DType::f64).set_requires_grad();
  Tensor target = from_vector(std::vector<int64_t>{3, -100, 0, 6, 6, 1}, {6});
  for (double eps : {0.0, 0.2}) {
    SCOPED_TRACE("label_smoothing " + std::to_string(eps));
    const Tensor up = full({}, 1.75, DType::f64);
    TensorList fused = run([&] { return linear_cross_entropy(x, w, target, -100, eps); }, up, {x, w});
    TensorList plain = run([&] { return cross_entropy(matmul(x, w.t()), target, -100, eps); }, up, {x, w});
    for (size_t i = 0; i < fused.size(); ++i) expect_all_close(fused[i], plain[i], 1e-12, "loss/grad " + std::to_string(i));
  }
  Tensor frozen = x.detach();
  TensorList fused = run([&] { return linear_cross_entropy(frozen, w, target); }, ones({}, DType::f64), {w});
  TensorList plain = run([&] { return cross_entropy(matmul(frozen, w.t()), target); }, ones({}, DType::f64), {w});
  expect_all_close(fused[1], plain[1], 1e-12, "weight grad, x frozen");
  NoGradGuard no_grad;
  expect_all_close(linear_cross_entropy(x, w, target), cross_entropy(matmul(x, w.t()), target), 1e-12, "no grad");
}

// Under bf16 autocast the f32 weight's gradient comes from the product in f32 (no bf16
// rounding of it): f32 gradients for f32 leaves, close to the composite's to bf16 rounding,
// and to the f64 loss's gradient.
TEST(LinearOps, LinearCrossEntropyUnderAutocastGivesF32Gradients) {
  manual_seed(9);
  Tensor x = randn({16, 8}).set_requires_grad(), w = randn({11, 8}).set_requires_grad();
  Tensor target = from_vector(std::vector<int64_t>{3, -100, 0, 6, 10, 1, 2, 2, 9, 4, 5, 7, 8, 0, 1, 3}, {16});
  const Tensor up = ones({});
  TensorList fused, plain;
  {
    AutocastGuard guard(DType::bf16);
    fused = run([&] { return linear_cross_entropy(x, w, target); }, up, {x, w});
    plain = run([&] { return cross_entropy(matmul(x, w.t()), target); }, up, {x, w});
  }
  Tensor x64 = x.detach().to(DType::f64).set_requires_grad(), w64 = w.detach().to(DType::f64).set_requires_grad();
  TensorList exact = run([&] { return cross_entropy(matmul(x64, w64.t()), target); }, ones({}, DType::f64), {x64, w64});
  for (size_t i = 0; i < fused.size(); ++i) {
    EXPECT_EQ(fused[i].dtype(), DType::f32) << "loss/grad " << i;
    expect_all_close(fused[i], plain[i], 2e-2, "against the composite, loss/grad " + std::to_string(i));
    expect_all_close(fused[i], exact[i].to(DType::f32), 3e-2, "against f64, loss/grad " + std::to_string(i));
  }
}

// A chunk at a time: any number of rows a chunk (one, a divisor of N, a remainder; N and
// more: one chunk) gives the composite's loss and gradients, with ignored rows, label
// smoothing, an upstream gradient other than 1 and a transposed x; under bf16 autocast the
// chunks agree with one chunk to bf16 rounding (the weight's gradient is summed over them in
// f32), at an upstream gradient of 1/3, which bf16 cannot hold. An empty batch (one chunk)
// gives a zero loss and zero gradients.
TEST(LinearOps, LinearCrossEntropyByChunksMatchesComposite) {
  manual_seed(12);
  Tensor x = randn({6, 5}, DType::f64).set_requires_grad(), w = randn({7, 5}, DType::f64).set_requires_grad();
  Tensor target = from_vector(std::vector<int64_t>{3, -100, 0, 6, 6, 1}, {6});
  const Tensor up = full({}, -0.5, DType::f64);
  TensorList plain = run([&] { return cross_entropy(matmul(x, w.t()), target, -100, 0.1); }, up, {x, w});
  for (int64_t rows : {1, 2, 4, 6, 100}) {
    SCOPED_TRACE("chunk_rows " + std::to_string(rows));
    TensorList fused = run([&] { return linear_cross_entropy(x, w, target, -100, 0.1, rows); }, up, {x, w});
    for (size_t i = 0; i < fused.size(); ++i)
      expect_all_close(fused[i], plain[i], 1e-12, "loss/grad " + std::to_string(i));
  }
  Tensor xt = x.detach().t().contiguous().set_requires_grad();  // (5, 6): x is its transpose
  TensorList transposed = run([&] { return linear_cross_entropy(xt.t(), w, target, -100, 0.1, 4); }, up, {xt, w});
  expect_all_close(transposed[0], plain[0], 1e-12, "loss, transposed x");
  expect_all_close(transposed[1], plain[1].t(), 1e-12, "x's gradient, transposed x");
  expect_all_close(transposed[2], plain[2], 1e-12, "weight's gradient, transposed x");
  Tensor xf = x.detach().to(DType::f32).set_requires_grad(), wf = w.detach().to(DType::f32).set_requires_grad();
  TensorList whole, chunked;
  {
    AutocastGuard guard(DType::bf16);
    whole = run([&] { return linear_cross_entropy(xf, wf, target); }, full({}, 1.0 / 3), {xf, wf});
    chunked = run([&] { return linear_cross_entropy(xf, wf, target, -100, 0.0, 4); }, full({}, 1.0 / 3), {xf, wf});
  }
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_EQ(chunked[i].dtype(), DType::f32) << "loss/grad " << i;
    expect_all_close(chunked[i], whole[i], 1e-2, "bf16 chunks against one chunk, loss/grad " + std::to_string(i));
  }
  Tensor none = zeros({0, 5}, DType::f64).set_requires_grad();
  TensorList empty = run([&] { return linear_cross_entropy(none, w, zeros({0}, DType::i64), -100, 0.0, 2); },
                         ones({}, DType::f64), {none, w});
  EXPECT_EQ(empty[0].item(), 0.0);
  EXPECT_EQ(empty[1].numel(), 0);
  expect_all_close(empty[2], zeros({7, 5}, DType::f64), 0.0, "weight grad of an empty batch");
}

// Under NoGradGuard (evaluation) nothing is recorded and the loss is the one training gets.
TEST(LinearOps, LinearCrossEntropyRecordsNothingWithoutGradMode) {
  manual_seed(11);
  Tensor x = randn({6, 5}).set_requires_grad(), w = randn({7, 5}).set_requires_grad();
  Tensor target = from_vector(std::vector<int64_t>{0, 6, 3, -100, 2, 1}, {6});
  Tensor trained = linear_cross_entropy(x, w, target);
  Tensor evaluated;
  {
    NoGradGuard no_grad;
    evaluated = linear_cross_entropy(x, w, target);
  }
  EXPECT_FALSE(evaluated.requires_grad());
  EXPECT_EQ(evaluated.grad_fn(), nullptr);
  EXPECT_EQ(evaluated.item(), trained.item());
}

TEST(LinearOps, LinearCrossEntropyNamesBadArguments) {
  Tensor x = randn({4, 3}), w = randn({5, 3}), t = from_vector(std::vector<int64_t>{0, 1, 2, 3}, {4});
  expect_error([&] { linear_cross_entropy(x, randn({5, 2}), t); }, "weight of shape (5, 2) does not match x");
  expect_error([&] { linear_cross_entropy(randn({2, 2, 3}), w, t); }, "expects x of shape (N, in)");
  expect_error([&] { linear_cross_entropy(x, w, from_vector(std::vector<int64_t>{0, 1}, {2})); },
               "target of shape (2,) does not match x of shape (4, 3)");
  expect_error([&] { linear_cross_entropy(x, w, t, -100, 1.0); }, "label_smoothing must be in [0, 1)");
  expect_error([&] { linear_cross_entropy(x, w, t, -100, 0.0, -3); }, "chunk_rows must be 0");
  // In chunks of 2 rows the kernel sees the second chunk's rows as 0 and 1; the error names
  // the batch's row.
  expect_error([&] { linear_cross_entropy(x, w, from_vector(std::vector<int64_t>{0, 1, 2, 7}, {4}), -100, 0.0, 2); },
               "target 7 in row 3");
  expect_error([&] { linear_cross_entropy(x, w, from_vector(std::vector<int64_t>{0, 1, 5, 3}, {4})); },
               "target 5 in row 2");
}

// Under bf16 autocast, f32 weights and biases get f32 gradients straight from the products
// (no bf16 rounding of them): close to the f64 op's, with and without an f32 residual.
TEST(LinearOps, F32ParametersUnderAutocastGetF32GradientsFromTheProducts) {
  manual_seed(10);
  for (bool residual : {false, true}) {
    SCOPED_TRACE(residual ? "f32 residual" : "no residual");
    Tensor x = randn({2, 9, 16}).set_requires_grad(), r = randn({2, 9, 8}).set_requires_grad();
    Tensor w1 = mul(randn({24, 16}), 0.3).set_requires_grad(), b1 = mul(randn({24}), 0.3).set_requires_grad();
    Tensor w2 = mul(randn({8, 24}), 0.3).set_requires_grad(), b2 = mul(randn({8}), 0.3).set_requires_grad();
    Tensor w = mul(randn({8, 16}), 0.3).set_requires_grad();
    Tensor up = randn({2, 9, 8});
    TensorList leaves{x, w1, b1, w2, b2, w};
    if (residual) leaves.push_back(r);
    TensorList fused;
    {
      AutocastGuard guard(DType::bf16);
      fused = run([&] {
        Tensor res = residual ? r : Tensor();
        return add(gelu_mlp(x, w1, b1, w2, b2, res), linear(x, w, b2, res));
      }, up, leaves);
    }
    TensorList leaves64;
    for (const Tensor& t : leaves) leaves64.push_back(t.detach().to(DType::f64).set_requires_grad());
    TensorList exact = run([&] {
      const TensorList& l = leaves64;
      Tensor res = residual ? l.back() : Tensor();
      return add(gelu_mlp(l[0], l[1], l[2], l[3], l[4], res), linear(l[0], l[5], l[4], res));
    }, up.to(DType::f64), leaves64);
    for (size_t i = 1; i < fused.size(); ++i) {
      EXPECT_EQ(fused[i].dtype(), DType::f32) << "gradient " << i;
      expect_all_close(fused[i], exact[i].to(DType::f32), 5e-2, "gradient " + std::to_string(i));
    }
  }
}

TEST(LinearOps, MismatchedShapesNameTheArgument) {
  Tensor x = randn({2, 5}), w1 = randn({7, 5}), w2 = randn({4, 7});
  expect_error([&] { gelu_mlp(x, randn({7, 6}), Tensor(), w2, Tensor()); }, "w1 of shape (7, 6)");
  expect_error([&] { gelu_mlp(x, w1, Tensor(), randn({4, 6}), Tensor()); }, "w2 of shape (4, 6)");
  expect_error([&] { gelu_mlp(x, w1, randn({6}), w2, Tensor()); }, "bias of shape (6,)");
  expect_error([&] { linear(x, randn({3, 4}), Tensor()); }, "weight of shape (3, 4)");
}

TEST(LinearOps, EmptyInputsGiveEmptyOutputs) {
  Tensor y = gelu_mlp(randn({0, 5}), randn({7, 5}), randn({7}), randn({4, 7}), randn({4}));
  EXPECT_EQ(y.shape(), (Shape{0, 4}));
}

}  // namespace
}  // namespace loom
