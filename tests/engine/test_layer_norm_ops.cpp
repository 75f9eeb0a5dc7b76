// The engine's layer_norm beyond what the gradient table checks: the fused op against the
// composite it replaced (mean, sub, mul, rsqrt) in outputs and gradients, output dtypes
// (out_dtype, autocast, f32 parameters over bf16 activations), empty inputs, and the
// messages users see when arguments are wrong.
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

// LayerNorm as Loom built it before the fused op existed.
Tensor composite(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  Tensor centred = sub(x, mean(x, {-1}, true));
  Tensor y = mul(centred, rsqrt(add(mean(mul(centred, centred), {-1}, true), eps)));
  if (weight.defined()) y = mul(y, weight);
  return bias.defined() ? add(y, bias) : y;
}

TEST(LayerNormOps, FusedMatchesCompositeWithGradients) {
  for (const Shape& shape : {Shape{2, 3, 5}, Shape{4, 768}, Shape{3, 1000}})
    for (bool affine : {true, false}) {
      SCOPED_TRACE(shape_str(shape) + (affine ? " affine" : " plain"));
      manual_seed(8);
      const int64_t dim = shape.back();
      Tensor x = add(mul(randn(shape, DType::f64), 2.0), 0.5).set_requires_grad();
      Tensor w = affine ? add(randn({dim}, DType::f64), 1.0).set_requires_grad() : Tensor();
      Tensor b = affine ? randn({dim}, DType::f64).set_requires_grad() : Tensor();
      Tensor up = randn(shape, DType::f64);
      TensorList leaves = affine ? TensorList{x, w, b} : TensorList{x};

      Tensor fused = layer_norm(x, w, b, 1e-5);
      sum(mul(fused, up)).backward();
      TensorList fused_grads;
      for (Tensor& t : leaves) {
        fused_grads.push_back(t.grad().clone());
        t.zero_grad();
      }
      Tensor reference = composite(x, w, b, 1e-5);
      sum(mul(reference, up)).backward();
      expect_all_close(fused, reference, 1e-12, "y");
      for (size_t k = 0; k < leaves.size(); ++k)
        expect_all_close(fused_grads[k], leaves[k].grad(), 1e-10, "gradient " + std::to_string(k));
    }
}

TEST(LayerNormOps, OutDtypeIsWrittenByTheKernelAndDifferentiable) {
  manual_seed(2);
  Tensor x = randn({5, 16}).set_requires_grad();
  Tensor w = add(randn({16}), 1.0).set_requires_grad(), b = randn({16}).set_requires_grad();
  Tensor up = randn({5, 16});
  Tensor y32 = layer_norm(x, w, b, 1e-5);
  sum(mul(y32, up)).backward();
  TensorList want{x.grad().clone(), w.grad().clone(), b.grad().clone()};
  for (Tensor t : {x, w, b}) t.zero_grad();

  Tensor y16 = layer_norm(x, w, b, 1e-5, DType::bf16);
  EXPECT_EQ(y16.dtype(), DType::bf16);
  expect_all_close(y16, y32, 8e-3, "bf16 y");
  sum(mul(y16.to(DType::f32), up)).backward();
  EXPECT_EQ(x.grad().dtype(), DType::f32);
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  // The upstream gradient reaches the kernel rounded to bf16: about 3 significant digits.
  for (size_t k = 0; k < 3; ++k)
    expect_all_close(TensorList{x, w, b}[k].grad(), want[k], 3e-2, "gradient " + std::to_string(k));

  Tensor y64 = layer_norm(x.to(DType::f64), Tensor(), Tensor(), 1e-5, DType::f32);  // f64 runs, then converts
  EXPECT_EQ(y64.dtype(), DType::f32);
  expect_all_close(y64, layer_norm(x, Tensor(), Tensor(), 1e-5), 1e-6, "f64 to f32 y");
}

TEST(LayerNormOps, OutputKeepsInputDtypeUnderAutocast) {
  Tensor x = randn({3, 8});
  AutocastGuard autocast(DType::bf16);
  EXPECT_EQ(layer_norm(x, ones({8}), zeros({8})).dtype(), DType::f32);
  EXPECT_EQ(layer_norm(x.to(DType::bf16), ones({8}), zeros({8})).dtype(), DType::bf16);
  EXPECT_EQ(layer_norm(x, ones({8}), zeros({8}), 1e-5, DType::bf16).dtype(), DType::bf16);
}

TEST(LayerNormOps, Bf16ActivationsWithF32ParametersGetF32ParameterGradients) {
  manual_seed(6);
  Tensor x = randn({4, 24}).to(DType::bf16).set_requires_grad();
  Tensor w = add(randn({24}), 1.0).set_requires_grad(), b = randn({24}).set_requires_grad();
  Tensor y = layer_norm(x, w, b);
  EXPECT_EQ(y.dtype(), DType::bf16);
  Tensor up = randn({4, 24});
  sum(mul(y.to(DType::f32), up)).backward();
  EXPECT_EQ(x.grad().dtype(), DType::bf16);
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  EXPECT_EQ(b.grad().dtype(), DType::f32);
  // Against f64 on the same (bf16-rounded) numbers.
  Tensor x64 = x.detach().to(DType::f64).set_requires_grad();
  Tensor w64 = w.detach().to(DType::f64).set_requires_grad(), b64 = b.detach().to(DType::f64).set_requires_grad();
  Tensor y64 = layer_norm(x64, w64, b64);
  sum(mul(y64, up.to(DType::bf16).to(DType::f64))).backward();
  expect_all_close(y, y64, 1e-2, "y");
  expect_all_close(x.grad(), x64.grad(), 2e-2, "dx");
  expect_all_close(w.grad(), w64.grad(), 1e-2, "dweight");
  expect_all_close(b.grad(), b64.grad(), 1e-2, "dbias");
}

TEST(LayerNormOps, EmptyBatchGivesEmptyOutputAndZeroParameterGradients) {
  Tensor w = ones({5}).set_requires_grad(), b = zeros({5}).set_requires_grad();
  Tensor y = layer_norm(zeros({0, 5}), w, b);
  EXPECT_EQ(y.shape(), (Shape{0, 5}));
  sum(y).backward();
  EXPECT_EQ(w.grad().to_vector<float>(), std::vector<float>(5, 0.f));
  EXPECT_EQ(b.grad().to_vector<float>(), std::vector<float>(5, 0.f));
}

TEST(LayerNormOps, WrongArgumentsSayWhatWasExpected) {
  Tensor x = zeros({2, 5});
  expect_error([&] { layer_norm(x, ones({4}), Tensor()); }, "weight must have shape (5) for input (2, 5)");
  expect_error([&] { layer_norm(x, Tensor(), ones({5, 1})); }, "bias must have shape (5)");
  expect_error([&] { layer_norm(x, ones({5}), zeros({5}, DType::bf16)); }, "weight is f32 but bias is bf16");
  expect_error([&] { layer_norm(x, Tensor(), Tensor(), 1e-5, DType::i64); }, "out_dtype must be a floating");
  expect_error([&] { layer_norm(zeros({2, 5}, DType::i64), Tensor(), Tensor()); }, "floating-point");
  expect_error([&] { layer_norm(scalar_tensor(1.0), Tensor(), Tensor()); }, "at least 1 dim");
  expect_error([&] { layer_norm(x, Tensor(), Tensor(), -1.0); }, "eps must not be negative");
}

}  // namespace
}  // namespace loom
