// Autocast's kept weight copies (engine/autocast.h), on any device: the optimizers write the
// copy a cast would make, every in-place op retires a copy, and training with copies (of
// weights and of the gradients LayerNorm rounds for products) is training without them, bit
// for bit. test_weight_copies.cpp runs these on the CPU,
// test_weight_copies_cuda.cpp on cuda:0.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/options.h"
#include "layers/models/gpt.h"
#include "layers/models/simple_cnn.h"
#include "layers/optim/adam.h"
#include "layers/optim/sgd.h"
#include "tests/layers/tiny_gpt_batch.h"

namespace loom::test {

// Sets whether weight and gradient copies are kept for its scope (process-wide), then
// restores the options it found. Bias sums taken by LayerNorm stay off: whether they are
// taken follows the copies (they are sums of the rounding a product reads), and they are
// summed in another order than the product's, so on they would change bits with the copies.
class CopiesGuard {
 public:
  explicit CopiesGuard(bool on) : guard_(with_copies(on)) {}

 private:
  static Options with_copies(bool on) {
    Options o = options();
    o.autocast_weight_copies = o.autocast_gradient_copies = on;
    o.fused_bias_sums = false;
    return o;
  }
  OptionsGuard guard_;
};

inline void expect_same_values(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": no valid copy";
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> a = got.to(DType::f32).to(Device::cpu()).to_vector<float>();
  const std::vector<float> b = want.to(DType::f32).to(Device::cpu()).to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << what << ", element " << i;
}

// f32 parameters on `device`: sizes across the CUDA kernel's 16384-element chunks, and one
// a float past 16-byte alignment (a view one element into its storage), so the vector and
// the scalar stores both run.
inline TensorList copy_test_params(Device device) {
  TensorList params;
  for (int64_t n : {int64_t(3), int64_t(16384 + 5), int64_t(1) << 15, int64_t(7)})
    params.push_back(mul(randn({n}), 0.5).to(device).set_requires_grad());
  Tensor flat = randn({16384 * 2 + 2}).to(device);
  params.push_back(flat.slice(0, 1, flat.numel()).set_requires_grad());
  return params;
}

using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(const TensorList&)>;

inline std::vector<std::pair<std::string, MakeOptimizer>> copy_test_optimizers() {
  return {
      {"SGD with momentum",
       [](const TensorList& p) {
         return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
       }},
      {"AdamW", [](const TensorList& p) { return std::make_unique<optim::AdamW>(p, optim::AdamWOptions{.lr = 0.01}); }},
  };
}

// Each parameter takes a copy (as a product under autocast would), then the optimizer
// steps twice: after each step the kept copy is valid and equals the updated parameter
// cast now, element for element.
inline void expect_optimizers_write_the_cast(Device device) {
  CopiesGuard on(true);
  for (DType dtype : {DType::bf16, DType::f16})
    for (const auto& [name, make] : copy_test_optimizers()) {
      SCOPED_TRACE(name + ", " + std::string(dtype_name(dtype)));
      manual_seed(3);
      TensorList params = copy_test_params(device);
      for (const Tensor& p : params) weight_copy(p, dtype);
      std::unique_ptr<optim::Optimizer> opt = make(params);
      for (int step = 1; step <= 2; ++step) {
        for (Tensor& p : params) p.set_grad(randn(p.shape()).to(device));
        opt->step();
        for (size_t i = 0; i < params.size(); ++i) {
          const std::string what = "step " + std::to_string(step) + ", parameter " + std::to_string(i);
          expect_same_values(kept_weight_copy(params[i]), params[i].to(dtype), what);
        }
      }
    }
}

// Parameters that are slices of one storage each keep the copy the update wrote; a bias
// added beside an f32 residual is read in f32 and keeps no copy, and the optimizer steps
// over it as over any parameter.
inline void expect_shared_storage_and_f32_bias_handled(Device device) {
  CopiesGuard on(true);
  manual_seed(5);
  Tensor flat = randn({2 * 24}).to(device);
  Tensor w1 = flat.slice(0, 0, 24).view({4, 6}).set_requires_grad();
  Tensor w2 = flat.slice(0, 24, 48).view({4, 6}).set_requires_grad();
  Tensor bias = randn({4}).to(device).set_requires_grad();
  Tensor x = randn({3, 6}).to(device), residual = randn({3, 4}).to(device);
  {
    AutocastGuard guard(DType::bf16);
    Tensor y = add(linear(x, w1, bias, residual), linear(x, w2));
    sum(y).backward();
  }
  EXPECT_EQ(bias.impl()->cast_copy, nullptr) << "the f32 bias kept a copy of itself";
  ASSERT_TRUE(kept_weight_copy(w1).defined() && kept_weight_copy(w2).defined());
  for (auto& [name, make] : copy_test_optimizers()) {
    SCOPED_TRACE(name);
    std::unique_ptr<optim::Optimizer> opt = make({bias, w1, w2});
    opt->step();
    expect_same_values(kept_weight_copy(w1), w1.to(DType::bf16), "w1");
    expect_same_values(kept_weight_copy(w2), w2.to(DType::bf16), "w2");
    EXPECT_EQ(bias.impl()->cast_copy, nullptr);
  }
}

// A copy is reused while the parameter is unchanged and retired by every in-place write.
inline void expect_in_place_writes_retire_copies(Device device) {
  CopiesGuard on(true);
  const std::vector<std::pair<std::string, std::function<void(const Tensor&)>>> writes = {
      {"fill_", [](const Tensor& p) { fill_(p, 0.25); }},
      {"zero_", [](const Tensor& p) { zero_(p); }},
      {"copy_", [device](const Tensor& p) { copy_(p, randn(p.shape()).to(device)); }},
      {"add_", [device](const Tensor& p) { add_(p, randn(p.shape()).to(device), 0.5); }},
      {"mul_", [](const Tensor& p) { mul_(p, 1.5); }},
      {"uniform_", [](const Tensor& p) { uniform_(p, -1, 1); }},
      {"normal_", [](const Tensor& p) { normal_(p, 0, 1); }},
      {"copy_many_", [device](const Tensor& p) { copy_many_({p}, {randn(p.shape()).to(device)}); }},
      {"a write into a view", [](const Tensor& p) { fill_(p.slice(0, 1, 2), 3.0); }},
  };
  for (const auto& [name, write] : writes) {
    SCOPED_TRACE(name);
    manual_seed(4);
    Tensor p = randn({5, 6}).to(device).set_requires_grad();
    Tensor first = weight_copy(p, DType::bf16);
    EXPECT_TRUE(weight_copy(p, DType::bf16).same(first)) << "an unchanged parameter is cast again";
    {
      NoGradGuard no_grad;
      write(p);
    }
    EXPECT_FALSE(kept_weight_copy(p).defined()) << "the copy outlived the write";
    Tensor again = weight_copy(p, DType::bf16);
    EXPECT_FALSE(again.same(first));
    expect_same_values(again, p.to(DType::bf16), "after the write");
  }
}

// A tiny GPT under bf16 autocast trains three AdamW steps with copies and without: the
// losses and the parameters after are the same bits.
inline void expect_training_unchanged_by_copies(Device device) {
  struct Run {
    std::vector<float> losses, params;
  };
  auto train = [device](bool copies) {
    CopiesGuard guard(copies);
    manual_seed(0);
    nn::GPT model(nn::GPTConfig::named("tiny"));
    model.to(device);
    const auto [ids, targets] = tiny_gpt_batch(device);
    optim::AdamW opt(model.parameters(), {.lr = 1e-2});
    Run run;
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      AutocastGuard guard(DType::bf16);
      Tensor loss = model.loss(ids, targets);
      loss.backward();
      opt.step();
      run.losses.push_back(float(loss.item()));
    }
    for (const Tensor& p : model.parameters()) {
      const std::vector<float> v = p.to(Device::cpu()).to(DType::f32).to_vector<float>();
      run.params.insert(run.params.end(), v.begin(), v.end());
    }
    return run;
  };
  const Run with = train(true), without = train(false);
  ASSERT_EQ(with.losses.size(), without.losses.size());
  for (size_t i = 0; i < with.losses.size(); ++i) EXPECT_EQ(with.losses[i], without.losses[i]) << "step " << i;
  ASSERT_EQ(with.params.size(), without.params.size());
  for (size_t i = 0; i < with.params.size(); ++i) ASSERT_EQ(with.params[i], without.params[i]) << "element " << i;
}

// conv2d under autocast reads its f32 weight through the kept copy and gives the weight the
// gradient of the explicit casts (x.to(bf16), w.to(bf16)) bit for bit; a kept copy of other
// values changes its output, so it is the copy that is read.
inline void expect_conv_reads_the_copy_as_a_cast(Device device, MemoryFormat format) {
  CopiesGuard on(true);
  manual_seed(12);
  const Tensor x = randn({2, 3, 6, 5}).to(device).contiguous(format), gy = randn({2, 4, 6, 5}).to(device);
  Tensor w = mul(randn({4, 3, 3, 3}), 0.3).to(device).set_requires_grad();
  Tensor w_cast = w.detach().clone().set_requires_grad();
  Tensor y;
  {
    AutocastGuard guard(DType::bf16);
    y = conv2d(x, w, Tensor(), {1, 1}, {1, 1});
  }
  ASSERT_EQ(y.dtype(), DType::bf16);
  sum(mul(y.to(DType::f32), gy)).backward();
  const Tensor y_cast = conv2d(x.to(DType::bf16), w_cast.to(DType::bf16), Tensor(), {1, 1}, {1, 1});
  sum(mul(y_cast.to(DType::f32), gy)).backward();
  expect_same_values(y, y_cast, "output");
  ASSERT_TRUE(w.grad().defined());
  ASSERT_EQ(w.grad().dtype(), DType::f32);
  expect_same_values(w.grad(), w_cast.grad(), "weight gradient");
  Tensor kept = kept_weight_copy(w);
  ASSERT_TRUE(kept.defined()) << "conv2d under autocast kept no copy of its f32 weight";
  {
    NoGradGuard no_grad;
    copy_(kept, zeros({4, 3, 3, 3}, DType::bf16, device));
  }
  AutocastGuard guard(DType::bf16);
  expect_same_values(conv2d(x, w, Tensor(), {1, 1}, {1, 1}), zeros({2, 4, 6, 5}, DType::bf16, device),
                     "output from a zeroed copy");
}

// SimpleCNN under bf16 autocast with SGD (momentum): training with kept weight copies, the
// convolutions' included, is training without them, bit for bit; the batch in `format`, and
// with `weights_channels_last` the 4-d weights laid out channels-last (Module::to).
inline void expect_cnn_training_unchanged_by_copies(Device device, MemoryFormat format, bool weights_channels_last) {
  auto train = [&](bool copies) {
    CopiesGuard guard(copies);
    manual_seed(3);
    nn::SimpleCNN model(3, 16, 10);
    model.to(device);
    if (weights_channels_last) model.to(MemoryFormat::channels_last);
    const Tensor x = randn({4, 3, 16, 16}).to(device).contiguous(format);
    const Tensor targets = from_vector(std::vector<int64_t>{1, 7, 3, 0}, {4}).to(device);
    optim::SGD opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
    std::vector<float> out;
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      Tensor loss;
      {
        AutocastGuard autocast(DType::bf16);
        loss = cross_entropy(model.forward(x).to(DType::f32), targets);
      }
      loss.backward();
      opt.step();
      out.push_back(float(loss.item()));
    }
    for (const Tensor& p : model.parameters()) {
      const std::vector<float> v = p.contiguous().to(Device::cpu()).to_vector<float>();
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  };
  const std::vector<float> with = train(true), without = train(false);
  ASSERT_EQ(with.size(), without.size());
  for (size_t i = 0; i < with.size(); ++i) ASSERT_EQ(with[i], without[i]) << "value " << i << " (losses first)";
}

}  // namespace loom::test
