// copy_many_ on the GPU: one launch for a list of f32 and of bf16 pairs of mixed sizes (a
// 16k-element chunk boundary and a tail), slots at aligned and odd offsets of one buffer
// (vector and scalar paths), compared bit for bit with the sources.
#include <gtest/gtest.h>

#include <string>

#include "engine/ops.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

TEST(CopyManyCuda, CopiesBitForBit) {
  LOOM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    manual_seed(4);
    const int64_t sizes[] = {16384 + 9, 8, 5, 100000, 1};
    Tensor flat = full({140000}, -1.0, dt, gpu);
    TensorList slots, grads;
    int64_t offset = 0;
    for (int64_t n : sizes) {
      grads.push_back(randn({n}, DType::f32, gpu).to(dt));
      slots.push_back(flat.slice(0, offset, offset + n));
      offset += n + (n % 2 ? 3 : 8);  // aligned and odd starts alike
    }
    copy_many_(slots, grads);
    for (size_t i = 0; i < grads.size(); ++i)
      EXPECT_EQ(slots[i].to(DType::f32).to_vector<float>(), grads[i].to(DType::f32).to_vector<float>()) << "pair " << i;
    EXPECT_EQ(flat.slice(0, 16384 + 9, 16384 + 12).to(DType::f32).to_vector<float>(), std::vector<float>(3, -1.0f));
  }
}

}  // namespace
}  // namespace loom
