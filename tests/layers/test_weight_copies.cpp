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

}  // namespace
}  // namespace loom::test
