// copy_many_: every pair copied (views into one flat buffer at any offset, as DDP's bucket
// slots are), nothing else in the buffer touched, and the errors for lists that disagree.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "engine/ops.h"

namespace loom {
namespace {

TEST(CopyMany, FillsSlotsOfAFlatBufferAndNothingElse) {
  manual_seed(3);
  const Shape shapes[] = {{3, 5}, {7}, {1}, {2, 2, 2}, {0}};
  Tensor flat = full({40}, -1.0);
  TensorList slots, grads;
  int64_t offset = 1;  // odd offsets: not 16-byte aligned
  for (const Shape& s : shapes) {
    Tensor g = randn(s);
    slots.push_back(flat.slice(0, offset, offset + g.numel()).view(s));
    grads.push_back(g);
    offset += g.numel() + 1;
  }
  copy_many_(slots, grads);
  for (size_t i = 0; i < grads.size(); ++i)
    EXPECT_EQ(slots[i].to_vector<float>(), grads[i].to_vector<float>()) << "pair " << i;
  EXPECT_EQ(flat.to_vector<float>()[0], -1.0f);
  EXPECT_EQ(flat.to_vector<float>()[16], -1.0f);  // the gap after the first slot
}

TEST(CopyMany, ListsThatDisagreeAreNamed) {
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([] { copy_many_({zeros({3})}, {}); }, "src has 0 entries");
  expect_error([] { copy_many_({zeros({3})}, {zeros({4})}); }, "src[0] has shape (4,)");
  expect_error([] { copy_many_({zeros({3})}, {zeros({3}, DType::f64)}); }, "src[0] is f64");
}

}  // namespace
}  // namespace loom
