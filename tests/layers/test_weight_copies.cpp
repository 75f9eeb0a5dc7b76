// Autocast's kept weight copies on the CPU (the cases are in weight_copies.h), and what is
// kept or not.
#include "tests/layers/weight_copies.h"

namespace loom::test {
namespace {

const Device kCpu = Device::cpu();

TEST(WeightCopies, OptimizersWriteTheCopyACastWouldMake) { expect_optimizers_write_the_cast(kCpu); }

TEST(WeightCopies, EveryInPlaceWriteRetiresTheCopy) { expect_in_place_writes_retire_copies(kCpu); }

TEST(WeightCopies, TrainingIsTheSameWithAndWithoutCopies) { expect_training_unchanged_by_copies(kCpu); }

TEST(WeightCopies, SlicesOfOneStorageAndAnF32BiasAreHandled) { expect_shared_storage_and_f32_bias_handled(kCpu); }

TEST(WeightCopies, OnlyParametersKeepCopiesAndOnlyWhenSwitchedOn) {
  CopiesGuard on(true);
  Tensor plain = randn({4, 3});
  weight_copy(plain, DType::bf16);
  EXPECT_EQ(plain.impl()->cast_copy, nullptr) << "a tensor that needs no gradient kept a copy";

  Tensor p = randn({4, 3}).set_requires_grad();
  Tensor activation = mul(p, 2.0);
  weight_copy(activation, DType::bf16);
  EXPECT_EQ(activation.impl()->cast_copy, nullptr) << "a non-leaf kept a copy";

  {
    CopiesGuard off(false);
    weight_copy(p, DType::bf16);
    EXPECT_EQ(p.impl()->cast_copy, nullptr) << "a copy was kept with copies off";
  }
  Tensor kept = weight_copy(p, DType::bf16);
  EXPECT_TRUE(kept_weight_copy(p).same(kept));
}

TEST(WeightCopies, AnotherDtypeOrNewDataReplacesTheCopy) {
  CopiesGuard on(true);
  Tensor p = randn({6}).set_requires_grad();
  Tensor b = weight_copy(p, DType::bf16);
  Tensor h = weight_copy(p, DType::f16);
  EXPECT_EQ(h.dtype(), DType::f16);
  EXPECT_TRUE(kept_weight_copy(p).same(h)) << "the f16 copy did not replace the bf16 one";
  EXPECT_FALSE(weight_copy(p, DType::bf16).same(b));

  // set_data gives the parameter other values in other storage: the copy goes with the old.
  Tensor other = randn({6});
  p.set_data(other);
  EXPECT_FALSE(kept_weight_copy(p).defined());
  expect_same_values(weight_copy(p, DType::bf16), other.to(DType::bf16), "after set_data");
}

TEST(WeightCopies, Conv2dUnderAutocastReadsTheKeptCopyAsACast) {
  expect_conv_reads_the_copy_as_a_cast(kCpu, MemoryFormat::contiguous);
  expect_conv_reads_the_copy_as_a_cast(kCpu, MemoryFormat::channels_last);
}

TEST(WeightCopies, CnnTrainingIsTheSameWithAndWithoutCopies) {
  expect_cnn_training_unchanged_by_copies(kCpu, MemoryFormat::contiguous, false);
  expect_cnn_training_unchanged_by_copies(kCpu, MemoryFormat::channels_last, true);
}

TEST(WeightCopies, LinearUnderAutocastReadsTheKeptCopy) {
  CopiesGuard on(true);
  manual_seed(6);
  Tensor x = randn({3, 8}), w = randn({5, 8}).set_requires_grad(), bias = randn({5}).set_requires_grad();
  AutocastGuard guard(DType::bf16);
  Tensor y = linear(x, w, bias);
  Tensor kept = kept_weight_copy(w);
  ASSERT_TRUE(kept.defined()) << "linear under autocast kept no copy of its f32 weight";
  // A kept copy of other values would change the product: the op must read the copy.
  {
    NoGradGuard no_grad;
    copy_(kept, zeros({5, 8}, DType::bf16));
  }
  Tensor y0 = linear(x, w, bias);
  const std::vector<float> got = y0.to(DType::f32).to_vector<float>();
  const std::vector<float> b = bias.to(DType::bf16).to(DType::f32).to_vector<float>();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], b[i % 5]) << i;
}

// A product with an f32 residual output under autocast declares that it reads that output's
// gradient in bf16, and reads the rounding kept on the gradient: here a consumer's gradient
// of ones keeps a "rounding" of zeros, so the weight's gradient (dy^T x) comes out zero while
// the residual, which takes the f32 gradient itself, gets the ones.
TEST(WeightCopies, ProductsReadTheRoundedGradientKeptForThem) {
  CopiesGuard on(true);
  manual_seed(9);
  Tensor x = randn({3, 8}), w = randn({5, 8}).set_requires_grad(), residual = randn({3, 5}).set_requires_grad();
  Tensor y, plain;
  {
    AutocastGuard guard(DType::bf16);
    y = linear(x, w, Tensor(), residual);
    plain = linear(x, w, Tensor());
  }
  ASSERT_EQ(y.dtype(), DType::f32);
  EXPECT_EQ(gradient_read_dtype(y), DType::bf16);
  EXPECT_EQ(gradient_read_dtype(plain), std::nullopt) << "a bf16 output's gradient is read as it comes";
  Tensor out = zeros({3, 5});
  record("probe", {y}, {out}, [](const TensorList&) {
    Tensor dy = ones({3, 5});
    set_weight_copy(dy, zeros({3, 5}, DType::bf16));
    return TensorList{dy};
  });
  run_backward({out}, {ones({3, 5})});
  expect_same_values(w.grad(), zeros({5, 8}), "weight gradient from the kept rounding");
  expect_same_values(residual.grad(), ones({3, 5}), "residual gradient, f32");
}

// LayerNorm's backward keeps dx rounded to y's 16-bit dtype on dx when, and only when, x's
// gradient is declared to be read in that dtype (a probe node stands for the product).
TEST(WeightCopies, LayerNormKeepsTheRoundingOfAGradientReadIn16Bits) {
  CopiesGuard on(true);
  for (const bool declared : {true, false})
    for (const bool tee : {true, false}) {
      SCOPED_TRACE(std::string(declared ? "declared" : "not declared") + (tee ? ", tee" : ""));
      manual_seed(10);
      Tensor a = randn({4, 24}).set_requires_grad(), x = randn({4, 24});
      Tensor w = randn({24}).set_requires_grad(), b = randn({24}).set_requires_grad();
      Tensor seen, kept;
      record("probe", {a}, {x}, [&seen, &kept](const TensorList& g) {
        seen = g[0];
        kept = kept_weight_copy(g[0]);
        return TensorList{g[0]};
      });
      if (declared) set_gradient_read_dtype(x, DType::bf16);
      Tensor loss;
      if (tee) {
        TensorList t = layer_norm_tee(x, w, b, 1e-5, DType::bf16);
        loss = sum(add(mul(t[0], 3.0), t[1].to(DType::f32)));
      } else {
        loss = sum(mul(layer_norm(x, w, b, 1e-5, DType::bf16).to(DType::f32), randn({4, 24})));
      }
      loss.backward();
      ASSERT_TRUE(seen.defined());
      if (declared) expect_same_values(kept, seen.to(DType::bf16), "kept rounding");
      else EXPECT_FALSE(kept.defined());
    }
}

// A read dtype other than the LayerNorm's output dtype gets no rounding: the kernel rounds to
// y's dtype only.
TEST(WeightCopies, LayerNormRoundsOnlyToTheDtypeDeclared) {
  CopiesGuard on(true);
  manual_seed(11);
  Tensor a = randn({3, 16}).set_requires_grad(), x = randn({3, 16});
  Tensor kept;
  record("probe", {a}, {x}, [&kept](const TensorList& g) {
    kept = kept_weight_copy(g[0]);
    return TensorList{g[0]};
  });
  set_gradient_read_dtype(x, DType::f16);
  sum(layer_norm(x, Tensor(), Tensor(), 1e-5, DType::bf16).to(DType::f32)).backward();
  EXPECT_FALSE(kept.defined()) << "a bf16 rounding was kept for an f16 read";
}

// cast_or_kept: the kept copy while the storage is unchanged; after an in-place write (or a
// bump_version for a write of one's own), a fresh cast of the new values.
TEST(WeightCopies, CastOrKeptCastsAgainOnceTheValuesChange) {
  manual_seed(12);
  Tensor g = randn({5, 4});
  Tensor stand_in = zeros({5, 4}, DType::bf16);
  set_weight_copy(g, stand_in);
  EXPECT_TRUE(cast_or_kept(g, DType::bf16).same(stand_in));
  EXPECT_FALSE(cast_or_kept(g, DType::f16).same(stand_in)) << "a bf16 copy served an f16 read";
  g.bump_version();
  Tensor fresh = cast_or_kept(g, DType::bf16);
  EXPECT_FALSE(fresh.same(stand_in));
  expect_same_values(fresh, g.to(DType::bf16), "after bump_version");
  set_weight_copy(g, stand_in);
  {
    NoGradGuard no_grad;
    add_(g, ones({5, 4}));
  }
  expect_same_values(cast_or_kept(g, DType::bf16), g.to(DType::bf16), "after add_");
}

}  // namespace
}  // namespace loom::test
