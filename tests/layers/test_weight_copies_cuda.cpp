// Autocast's kept weight copies on cuda:0: the optimizers' CUDA kernels write, in their own
// pass, the copy a cast would make (16-byte and scalar stores, past the 16384-element
// chunks), and training with copies is training without them, bit for bit.
#include "tests/common/gpu.h"
#include "tests/layers/weight_copies.h"

namespace loom::test {
namespace {

const Device kGpu = Device::cuda(0);

TEST(WeightCopiesCuda, OptimizersWriteTheCopyACastWouldMake) {
  LOOM_REQUIRE_CUDA();
  expect_optimizers_write_the_cast(kGpu);
}

TEST(WeightCopiesCuda, EveryInPlaceWriteRetiresTheCopy) {
  LOOM_REQUIRE_CUDA();
  expect_in_place_writes_retire_copies(kGpu);
}

TEST(WeightCopiesCuda, SlicesOfOneStorageAndAnF32BiasAreHandled) {
  LOOM_REQUIRE_CUDA();
  expect_shared_storage_and_f32_bias_handled(kGpu);
}

TEST(WeightCopiesCuda, TrainingIsTheSameWithAndWithoutCopies) {
  LOOM_REQUIRE_CUDA();
  expect_training_unchanged_by_copies(kGpu);
}

TEST(WeightCopiesCuda, Conv2dUnderAutocastReadsTheKeptCopyAsACast) {
  LOOM_REQUIRE_CUDA();
  expect_conv_reads_the_copy_as_a_cast(kGpu, MemoryFormat::contiguous);
  expect_conv_reads_the_copy_as_a_cast(kGpu, MemoryFormat::channels_last);
}

TEST(WeightCopiesCuda, CnnTrainingIsTheSameWithAndWithoutCopies) {
  LOOM_REQUIRE_CUDA();
  expect_cnn_training_unchanged_by_copies(kGpu, MemoryFormat::contiguous, false);
  expect_cnn_training_unchanged_by_copies(kGpu, MemoryFormat::channels_last, false);
  expect_cnn_training_unchanged_by_copies(kGpu, MemoryFormat::channels_last, true);
}

}  // namespace
}  // namespace loom::test
