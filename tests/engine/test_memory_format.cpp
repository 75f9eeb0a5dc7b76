// MemoryFormat: a channels-last tensor's strides and predicates, and the CNN ops keeping the
// layout of their input: each gives a channels-last output for a channels-last input, with
// the values and input gradients of the same op on the row-major input, bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom {
namespace {

constexpr MemoryFormat kLast = MemoryFormat::channels_last;

TEST(MemoryFormat, ChannelsLastStridesPutTheChannelsInnermost) {
  Tensor t = Tensor::empty({2, 3, 4, 5}, DType::f32, Device::cpu(), kLast);
  EXPECT_EQ(t.strides(), (Shape{60, 1, 15, 3}));
  EXPECT_TRUE(t.is_contiguous(kLast));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.memory_format(), kLast);
  EXPECT_EQ(format_strides({2, 3, 4, 5}, MemoryFormat::contiguous), (Shape{60, 20, 5, 1}));
}

// Where both layouts describe the memory (C = 1, H = W = 1) the strides decide, and
// contiguous(format) re-strides without a copy, as a differentiable view.
TEST(MemoryFormat, ALayoutBothFormatsDescribeIsTheOneItsStridesSpell) {
  for (Shape shape : {Shape{2, 1, 4, 5}, Shape{2, 3, 1, 1}}) {
    SCOPED_TRACE(shape_str(shape));
    Tensor t = Tensor::empty(shape, DType::f32, Device::cpu(), kLast);
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(t.memory_format(), kLast);
    Tensor row_major = randn(shape);
    EXPECT_EQ(row_major.memory_format(), MemoryFormat::contiguous);
    row_major.set_requires_grad();
    Tensor last = row_major.contiguous(kLast);
    EXPECT_EQ(last.memory_format(), kLast);
    EXPECT_EQ(last.strides(), format_strides(shape, kLast));
    EXPECT_EQ(last.data_ptr(), row_major.data_ptr());  // no copy
    EXPECT_EQ(last.to_vector<float>(), row_major.to_vector<float>());
    Tensor back = last.contiguous();
    EXPECT_EQ(back.memory_format(), MemoryFormat::contiguous);
    EXPECT_EQ(back.strides(), format_strides(shape, MemoryFormat::contiguous));
    EXPECT_EQ(back.data_ptr(), row_major.data_ptr());
    sum(mul(back, 3.0)).backward();
    EXPECT_EQ(row_major.grad().to_vector<float>(), std::vector<float>(size_t(row_major.numel()), 3.f));
  }
}

// A gradient that reaches a leaf with channels-last strides, over memory that is row-major as
// well, is kept with row-major strides, like every parameter's gradient.
TEST(MemoryFormat, ALeafGradientKeepsRowMajorStrides) {
  const Shape shape{2, 1, 4, 5};
  Tensor leaf = randn(shape);
  leaf.set_requires_grad();
  Tensor w = randn(shape).contiguous(kLast);
  Tensor y = mul(leaf.contiguous(kLast), w);
  ASSERT_EQ(y.memory_format(), kLast);
  sum(y).backward();
  EXPECT_EQ(leaf.grad().strides(), format_strides(shape, MemoryFormat::contiguous));
  EXPECT_EQ(leaf.grad().to_vector<float>(), w.to_vector<float>());
  // A transposed matrix is neither.
  Tensor m = zeros({3, 4}).t();
  EXPECT_FALSE(m.is_contiguous(kLast));
  EXPECT_EQ(m.memory_format(), MemoryFormat::contiguous);
}

TEST(MemoryFormat, ChannelsLastNeedsFourDimensions) {
  try {
    Tensor::empty({3, 4, 5}, DType::f32, Device::cpu(), kLast);
    FAIL() << "expected a loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("4-d tensors (N, C, H, W), got shape (3, 4, 5)"), std::string::npos)
        << e.what();
  }
}

TEST(MemoryFormat, ContiguousInAFormatKeepsTheValuesAndCopiesOnlyWhenNeeded) {
  manual_seed(1);
  Tensor x = randn({2, 3, 4, 5});
  Tensor last = x.contiguous(kLast);
  EXPECT_EQ(last.memory_format(), kLast);
  EXPECT_EQ(last.to_vector<float>(), x.to_vector<float>());
  EXPECT_TRUE(last.contiguous(kLast).same(last));
  EXPECT_EQ(last.contiguous().to_vector<float>(), x.to_vector<float>());
  EXPECT_TRUE(last.contiguous().is_contiguous());
  // The permuted view of an (N, H, W, C) array is channels-last already.
  EXPECT_EQ(randn({2, 4, 5, 3}).permute({0, 3, 1, 2}).memory_format(), kLast);
}

TEST(MemoryFormat, CastsAndClonesOfChannelsLast) {
  Tensor x = randn({2, 3, 4, 5}).contiguous(kLast);
  EXPECT_EQ(x.to(DType::bf16).memory_format(), kLast);
  EXPECT_EQ(x.to(Device::cpu()).memory_format(), kLast);
  EXPECT_TRUE(x.clone().is_contiguous());  // clone() is row-major, as contiguous() needs
}

// Every element of got within tol * max |want| of want's (bit for bit when tol is 0).
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (tol == 0) {
    EXPECT_EQ(got, want) << what;
    return;
  }
  double scale = 0;
  for (float v : want) scale = std::max(scale, double(std::fabs(v)));
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tol * scale) << what << " element " << i;
}

// Runs op on x in both layouts (x requiring a gradient), backward from the sum of the output
// times fixed weights, and checks the channels-last run's output layout, values and input
// gradient against the row-major run's: bit for bit, or within tol (relative to the largest
// value) for ops whose kernels sum in another order in each layout (the convolutions).
void expect_layout_kept(const std::string& name, const std::function<Tensor(const Tensor&)>& op,
                        const Shape& shape, bool output_channels_last = true, double tol = 0) {
  SCOPED_TRACE(name);
  manual_seed(7);
  Tensor x = randn(shape);
  std::vector<float> outputs[2], grads[2];
  for (int layout = 0; layout < 2; ++layout) {
    Tensor leaf = layout ? x.contiguous(kLast).detach() : x.detach();
    leaf.set_requires_grad();
    Tensor y = op(leaf);
    if (layout == 1 && output_channels_last) {
      EXPECT_EQ(y.memory_format(), kLast);
    }
    manual_seed(11);
    Tensor weights = randn(y.shape());
    sum(mul(y, weights)).backward();
    outputs[layout] = y.to_vector<float>();
    grads[layout] = leaf.grad().to_vector<float>();
  }
  expect_close(outputs[1], outputs[0], tol, "output");
  expect_close(grads[1], grads[0], tol, "input gradient");
}

TEST(MemoryFormat, EveryCnnOpKeepsAChannelsLastInputChannelsLast) {
  manual_seed(3);
  Tensor w = randn({4, 3, 3, 3}), b = randn({4}), gamma = randn({3}), beta = randn({3});
  Tensor bias = randn({1, 3, 1, 1}), other = randn({2, 3, 6, 5});
  const Shape s{2, 3, 6, 5};
  expect_layout_kept("conv2d", [&](const Tensor& x) { return conv2d(x, w, b, {1, 1}, {1, 1}); }, s, true, 1e-6);
  expect_layout_kept("conv2d stride 2", [&](const Tensor& x) { return conv2d(x, w, Tensor(), {2, 2}, {1, 1}); }, s,
                     true, 1e-6);
  expect_layout_kept("batch_norm", [&](const Tensor& x) {
    return batch_norm(x, Tensor(), Tensor(), gamma, beta, true);
  }, s);
  const Tensor running_mean = randn({3}), running_var = add(abs(randn({3})), 0.5);
  expect_layout_kept("batch_norm eval", [&](const Tensor& x) {
    return batch_norm(x, running_mean, running_var, gamma, beta, false);
  }, s);
  expect_layout_kept("relu", [](const Tensor& x) { return relu(x); }, s);
  expect_layout_kept("gelu", [](const Tensor& x) { return gelu(x); }, s);
  expect_layout_kept("residual add", [](const Tensor& x) { return add(x, mul(x, 0.5)); }, s);
  expect_layout_kept("bias add", [&](const Tensor& x) { return add(x, bias); }, s);
  expect_layout_kept("bias add, bias first", [&](const Tensor& x) { return add(bias, x); }, s);
  expect_layout_kept("max_pool2d", [](const Tensor& x) { return max_pool2d(x, {2, 2}); }, s);
  expect_layout_kept("avg_pool2d", [](const Tensor& x) { return avg_pool2d(x, {3, 3}, {2, 2}, {1, 1}); }, s);
  expect_layout_kept("adaptive_avg_pool2d", [](const Tensor& x) { return adaptive_avg_pool2d(x, {1, 1}); }, s,
                     false);
  expect_layout_kept("flatten", [](const Tensor& x) { return x.flatten(1); }, s, false);
  expect_layout_kept("to bf16 and back", [](const Tensor& x) { return x.to(DType::bf16).to(DType::f32); }, s);
  // A row-major operand beside a channels-last one: the values are the same either way.
  expect_layout_kept("mixed layouts", [&](const Tensor& x) { return mul(x, other); }, s);
}

// A one-channel batch laid out channels-last (Fashion-MNIST's images) runs a convolution
// channels-last, and trains as the row-major batch does; the weight's gradient is row-major.
TEST(MemoryFormat, AOneChannelBatchStartsAChannelsLastNetwork) {
  manual_seed(4);
  Tensor images = randn({3, 1, 7, 6}), w0 = randn({5, 1, 3, 3});
  std::vector<float> grads[2];
  for (int layout = 0; layout < 2; ++layout) {
    Tensor w = w0.detach();
    w.set_requires_grad();
    Tensor x = layout ? images.contiguous(kLast) : images;
    Tensor h = conv2d(x, w, Tensor(), {1, 1}, {1, 1});
    EXPECT_EQ(h.memory_format(), layout ? kLast : MemoryFormat::contiguous);
    h = max_pool2d(relu(h), {2, 2});
    EXPECT_EQ(h.memory_format(), layout ? kLast : MemoryFormat::contiguous);
    manual_seed(1);
    sum(mul(h, randn(h.shape()))).backward();
    EXPECT_TRUE(w.grad().is_contiguous());
    EXPECT_EQ(w.grad().strides(), format_strides(w.shape(), MemoryFormat::contiguous));
    grads[layout] = w.grad().to_vector<float>();
  }
  expect_close(grads[1], grads[0], 1e-6, "weight gradient");
}

// A channels-last tensor reduces in its memory order: a convolution bias's gradient (a sum
// over N, H and W) and a spatial mean need no copy of the tensor, and give the row-major
// tensor's values.
TEST(MemoryFormat, ReductionsOfChannelsLastNeedNoCopy) {
  manual_seed(2);
  Tensor x = randn({4, 8, 6, 6}, DType::f64);
  Tensor last = x.contiguous(kLast);
  for (const std::vector<int>& dims : {std::vector<int>{0, 2, 3}, std::vector<int>{2, 3}, std::vector<int>{1}}) {
    SCOPED_TRACE(dims.size());
    memory::reset_peak(Device::cpu());
    const size_t before = memory::stats(Device::cpu()).allocated;
    Tensor got = sum(last, dims);
    EXPECT_LT(memory::stats(Device::cpu()).peak_allocated - before, size_t(last.nbytes()) / 4);
    const std::vector<double> want = sum(x, dims).to_vector<double>(), have = got.to_vector<double>();
    ASSERT_EQ(have.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(have[i], want[i], 1e-12) << i;
  }
}

// Reduced dims in two runs of a row-major f32 tensor go one run at a time: no copy, and the
// float64 sum's values.
TEST(MemoryFormat, TwoRunsOfARowMajorTensorReduceWithoutACopy) {
  manual_seed(4);
  Tensor x = randn({8, 16, 12, 12});
  memory::reset_peak(Device::cpu());
  const size_t before = memory::stats(Device::cpu()).allocated;
  Tensor got = sum(x, {0, 2, 3});
  EXPECT_LT(memory::stats(Device::cpu()).peak_allocated - before, size_t(x.nbytes()) / 4);
  const std::vector<double> want = sum(x.to(DType::f64), {0, 2, 3}).to_vector<double>();
  const std::vector<float> have = got.to_vector<float>();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(have[i], want[i], 1e-4 * (1 + std::abs(want[i]))) << i;
  EXPECT_NEAR(mean(x, {0, 2, 3}).to_vector<float>()[3], want[3] / (8 * 12 * 12), 1e-6);
}

}  // namespace
}  // namespace loom
