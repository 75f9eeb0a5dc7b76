// max_pool2d_bias and Sequential's Conv2d + MaxPool2d fusion on the CPU (conv_pool_fusion.h).
#include <gtest/gtest.h>

#include "tests/layers/conv_pool_fusion.h"

namespace loom::test {
namespace {

TEST(ConvPoolFusion, MaxPoolBiasIsTheAddThenThePooling) {
  for (DType dtype : {DType::f64, DType::f32, DType::bf16})
    for (MemoryFormat format : {MemoryFormat::contiguous, MemoryFormat::channels_last}) {
      expect_max_pool_bias_is_add_then_pool(Device::cpu(), dtype, format, {{2, 2}, {2, 2}, {0, 0}});
      expect_max_pool_bias_is_add_then_pool(Device::cpu(), dtype, format, {{3, 3}, {2, 2}, {1, 1}});
    }
}

TEST(ConvPoolFusion, SequentialConvThenPoolChangesNoBit) {
  expect_sequential_fusion_changes_no_bit(Device::cpu(), MemoryFormat::contiguous);
  expect_sequential_fusion_changes_no_bit(Device::cpu(), MemoryFormat::channels_last);
}

}  // namespace
}  // namespace loom::test
