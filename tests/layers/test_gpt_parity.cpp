// Loom's GPT matches PyTorch on the CPU in float64 (see parity.h).
#include "tests/layers/parity.h"

namespace loom::testing {
namespace {

// The reference is float64 stored as f32 (6e-8 relative per element), and GPT::loss takes
// the cross-entropy of f32 logits whatever the model's dtype, so the f64 model carries f32
// rounding through the loss and its gradient. Measured against the fixture: at most 3e-8
// (logits 2.5e-8, loss 7.5e-9). 1e-6 leaves room for other compilers and summation orders,
// and is a hundred times tighter than the f32 test: a formula that is merely close (GELU's
// erf form, LayerNorm's unbiased variance, AdamW without bias correction) fails it.
constexpr double kF64Tol = 1e-6;

TEST(GptParity, MatchesPyTorchInFloat64OnTheCpu) {
  LOOM_REQUIRE_GPT_PARITY_FIXTURE();
  check_gpt_parity(Device::cpu(), DType::f64, kF64Tol);
}

}  // namespace
}  // namespace loom::testing
