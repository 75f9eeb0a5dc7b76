// SimpleCNN matches PyTorch on the CPU (see parity.h).
#include "tests/layers/parity.h"

namespace loom::testing {
namespace {

TEST(SimpleCnnParity, MatchesPyTorchOnTheCpuForSgdAndAdam) { check_simplecnn_parity(Device::cpu()); }

}  // namespace
}  // namespace loom::testing
