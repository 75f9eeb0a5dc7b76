// Bias gradients summed by LayerNorm's and packed attention's backward
// (tests/layers/bias_sums.h) on cuda:0: the CUDA kernels' sums are the ones taken, and a GPT
// trains the same with them as without.
#include "tests/common/gpu.h"
#include "tests/layers/bias_sums.h"

namespace loom::test {
namespace {

const Device kGpu = Device::cuda(0);

TEST(BiasSumsCuda, LinearTakesTheSumsKeptOnItsOutputGradient) {
  LOOM_REQUIRE_CUDA();
  expect_linear_takes_kept_sums(kGpu);
}

TEST(BiasSumsCuda, LayerNormKeepsSumsOnlyWhenDeclaredInTheDtypeItWrites) {
  LOOM_REQUIRE_CUDA();
  expect_layer_norm_keeps_declared_sums(kGpu);
}

TEST(BiasSumsCuda, AttentionKeepsSumsOnlyWhenDeclaredInTheDtypeItComputesIn) {
  LOOM_REQUIRE_CUDA();
  expect_attention_keeps_declared_sums(kGpu);
}

TEST(BiasSumsCuda, GptGradientsAndTrainingAgreeWithAndWithoutThem) {
  LOOM_REQUIRE_CUDA();
  expect_gpt_unchanged_by_fused_sums(kGpu);
}

}  // namespace
}  // namespace loom::test
