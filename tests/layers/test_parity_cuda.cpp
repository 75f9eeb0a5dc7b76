// SimpleCNN matches PyTorch on the GPU with TF32 off (see parity.h).
#include "tests/common/gpu.h"
#include "tests/layers/parity.h"

namespace loom::testing {
namespace {

TEST(SimpleCnnParityCuda, MatchesPyTorchOnTheGpuForSgdAndAdam) {
  LOOM_REQUIRE_CUDA();
  check_simplecnn_parity(Device::cuda(0));
}

}  // namespace
}  // namespace loom::testing
