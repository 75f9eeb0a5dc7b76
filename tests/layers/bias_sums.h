// Bias gradients summed by the backward that writes a linear layer's output gradient
// (Options::fused_bias_sums; engine/autograd.h: set_gradient_sums_read), LayerNorm's or
// packed attention's, on any device: the layer takes the sums kept on its output's
// gradient, and only sums of the values it reads, while they are valid; LayerNorm and
// attention keep sums only when they were declared in the dtype they write; and a GPT's
// gradients and training agree with the sums on and off within the rounding of summing in
// another order. test_bias_sums.cpp runs these on the CPU, test_bias_sums_cuda.cpp on cuda:0.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/options.h"
#include "layers/models/gpt.h"
#include "layers/optim/sgd.h"
#include "tests/layers/tiny_gpt_batch.h"
#include "tests/common/option_with.h"
#include "tests/common/tensor_checks.h"

namespace loom::test {

// A linear layer with a bias, in f32 and under bf16 autocast with an f32 residual output,
// declares that it sums its output's gradient, read in its compute dtype, and takes the sums
// a probe node keeps on that gradient as its bias gradient: here sums of sevens, which no
// sum of the gradient of ones gives. The weight's gradient is still dy^T x. Sums kept for
// another dtype, or made stale by an in-place write, are not taken.
inline void expect_linear_takes_kept_sums(Device device) {
  OptionWith on(&Options::fused_bias_sums, true);
  enum class Kept { valid, other_dtype, stale };
  for (const bool autocast : {false, true})
    for (const Kept kept : {Kept::valid, Kept::other_dtype, Kept::stale}) {
      SCOPED_TRACE(std::string(autocast ? "bf16 autocast" : "f32") +
                   (kept == Kept::valid ? "" : kept == Kept::other_dtype ? ", other dtype" : ", stale"));
      manual_seed(21);
      Tensor x = randn({6, 8}).to(device), w = randn({5, 8}).to(device).set_requires_grad();
      Tensor b = randn({5}).to(device).set_requires_grad(), residual = randn({6, 5}).to(device).set_requires_grad();
      const DType read_as = autocast ? DType::bf16 : DType::f32;
      Tensor y;
      {
        AutocastGuard guard(autocast ? std::optional<DType>(DType::bf16) : std::nullopt);
        y = linear(x, w, b, residual);
      }
      ASSERT_EQ(y.dtype(), DType::f32);
      EXPECT_EQ(gradient_sums_read(y), read_as);
      Tensor out = zeros({6, 5}).to(device);
      record("probe", {y}, {out}, [&](const TensorList&) {
        Tensor dy = ones({6, 5}).to(device);
        keep_column_sums(dy, full({5}, 7.0).to(device), kept == Kept::other_dtype ? DType::f16 : read_as);
        if (kept == Kept::stale) dy.bump_version();
        return TensorList{dy};
      });
      run_backward({out}, {ones({6, 5}).to(device)});
      const Tensor want_b = kept == Kept::valid ? full({5}, 7.0) : full({5}, 6.0);
      expect_close_to_scale(b.grad(), want_b, 0, "bias gradient");
      // dy^T x, in double here: the column sums of x as the product reads it (TF32 on a GPU).
      const Tensor xr = (autocast ? x.to(DType::bf16) : x).to(Device::cpu()).to(DType::f64);
      const double tol = autocast || device.is_cpu() ? 1e-6 : 2e-3;
      expect_close_to_scale(w.grad(), matmul(ones({6, 5}, DType::f64).t(), xr), tol, "weight gradient");
    }
}

// LayerNorm's backward keeps on x's gradient its column sums when x's sums are declared in
// the dtype the kernel writes that gradient in (x's own, or y's 16-bit dtype when it also
// keeps the rounding for a 16-bit read), and not otherwise; a probe node stands for the
// product. The sums are those of the gradient the probe receives (or of its kept rounding).
inline void expect_layer_norm_keeps_declared_sums(Device device) {
  struct Case {
    const char* name;
    std::optional<DType> read_as, sums_as;  // declared on x
    bool kept;
  };
  const Case cases[] = {
      {"f32 sums", std::nullopt, DType::f32, true},
      {"bf16 sums of the rounding", DType::bf16, DType::bf16, true},
      {"bf16 sums without the rounding", std::nullopt, DType::bf16, false},
      {"f32 sums beside the rounding", DType::bf16, DType::f32, false},
      {"none declared", std::nullopt, std::nullopt, false},
  };
  Options o = options();
  o.fused_bias_sums = o.autocast_gradient_copies = true;
  OptionsGuard guard(o);
  for (const Case& c : cases)
    for (const bool tee : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (tee ? ", tee" : ""));
      manual_seed(22);
      Tensor a = randn({40, 24}).to(device).set_requires_grad(), x = randn({40, 24}).to(device);
      Tensor w = randn({24}).to(device).set_requires_grad(), b = randn({24}).to(device).set_requires_grad();
      Tensor seen, rounding, sums;
      record("probe", {a}, {x}, [&](const TensorList& g) {
        seen = g[0];
        rounding = kept_weight_copy(g[0]);
        sums = take_column_sums(g[0], c.sums_as.value_or(DType::f32));
        return TensorList{g[0]};
      });
      if (c.read_as) set_gradient_read_dtype(x, *c.read_as);
      if (c.sums_as) set_gradient_sums_read(x, *c.sums_as);
      const Tensor gy = randn({40, 24}).to(device);
      Tensor loss;
      if (tee) {
        TensorList t = layer_norm_tee(x, w, b, 1e-5, DType::bf16);
        loss = sum(add(mul(t[0], 3.0), mul(t[1].to(DType::f32), gy)));
      } else {
        loss = sum(mul(layer_norm(x, w, b, 1e-5, DType::bf16).to(DType::f32), gy));
      }
      loss.backward();
      ASSERT_TRUE(seen.defined());
      if (!c.kept) {
        EXPECT_FALSE(sums.defined());
        continue;
      }
      ASSERT_TRUE(sums.defined());
      EXPECT_EQ(sums.dtype(), DType::f32);
      const Tensor read = c.read_as ? rounding : seen;
      ASSERT_TRUE(read.defined());
      expect_close_to_scale(sums, sum(read.to(DType::f32), {0}).to(Device::cpu()), 1e-5, "sums");
    }
}

// packed_self_attention's backward keeps on qkv's (B, T, 3C) gradient its column sums when
// they are declared in the dtype it computes in (qkv's, bf16 here, or f32), and not when
// declared otherwise, not declared, or with fused_bias_sums off; a probe node stands for the
// qkv projection. Head size 64 and 2 x 100 rows: on an H100 or H200 the Hopper backward
// sums dK and dV, dQ's conversion dQ, over tiles the last of which is short.
inline void expect_attention_keeps_declared_sums(Device device) {
  struct Case {
    const char* name;
    DType dtype;
    std::optional<DType> sums_as;
    bool fused, kept;
  };
  const Case cases[] = {
      {"bf16 sums", DType::bf16, DType::bf16, true, true},
      {"f32 sums", DType::f32, DType::f32, true, true},
      {"f32 sums of bf16", DType::bf16, DType::f32, true, false},
      {"none declared", DType::bf16, std::nullopt, true, false},
      {"fused_bias_sums off", DType::bf16, DType::bf16, false, false},
  };
  for (const Case& c : cases)
    for (const bool causal : {true, false}) {
      SCOPED_TRACE(std::string(c.name) + (causal ? ", causal" : ""));
      OptionWith fused(&Options::fused_bias_sums, c.fused);
      manual_seed(23);
      Tensor a = randn({2, 100, 3 * 128}).to(device).to(c.dtype).set_requires_grad();
      Tensor qkv = randn({2, 100, 3 * 128}).to(device).to(c.dtype);
      Tensor seen, sums;
      bool any_kept = false;  // sums of any dtype on the gradient
      record("probe", {a}, {qkv}, [&](const TensorList& g) {
        seen = g[0];
        any_kept = g[0].impl()->column_sums != nullptr;
        sums = take_column_sums(g[0], c.sums_as.value_or(c.dtype));
        return TensorList{g[0]};
      });
      if (c.sums_as) set_gradient_sums_read(qkv, *c.sums_as);
      const Tensor gy = randn({2, 100, 128}).to(device);
      sum(mul(packed_self_attention(qkv, 2, causal).to(DType::f32), gy)).backward();
      ASSERT_TRUE(seen.defined());
      EXPECT_EQ(any_kept, c.kept);
      if (!c.kept) continue;
      ASSERT_TRUE(sums.defined());
      EXPECT_EQ(sums.dtype(), DType::f32);
      expect_close_to_scale(sums, sum(seen.to(DType::f32), {0, 1}).to(Device::cpu()), 1e-5, "sums");
    }
}

// A tiny GPT's gradients after one step, and its losses and weights after three steps of
// SGD, with the sums taken by LayerNorm and without, in f32 and under bf16 autocast. The
// first gradients differ only in the bias gradients' order of summation; later steps also
// in what that moves (a product's operand rounded to TF32 or bf16 the other way).
inline void expect_gpt_unchanged_by_fused_sums(Device device) {
  struct Run {
    std::vector<float> losses;
    TensorList first_grads, params;
  };
  for (const bool autocast : {false, true}) {
    SCOPED_TRACE(autocast ? "bf16 autocast" : "f32");
    auto train = [&](bool fused) {
      OptionWith guard(&Options::fused_bias_sums, fused);
      manual_seed(0);
      nn::GPT model(nn::GPTConfig::named("tiny"));
      model.to(device);
      const auto [ids, targets] = tiny_gpt_batch(device);
      optim::SGD opt(model.parameters(), {.lr = 0.1});
      Run run;
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        AutocastGuard ac(autocast ? std::optional<DType>(DType::bf16) : std::nullopt);
        Tensor loss = model.loss(ids, targets);
        loss.backward();
        if (step == 0)
          for (const Tensor& p : model.parameters()) run.first_grads.push_back(p.grad().detach().clone());
        opt.step();
        run.losses.push_back(float(loss.item()));
      }
      for (const Tensor& p : model.parameters()) run.params.push_back(p.detach().clone());
      return run;
    };
    const Run with = train(true), without = train(false);
    ASSERT_EQ(with.first_grads.size(), without.first_grads.size());
    for (size_t i = 0; i < with.first_grads.size(); ++i)
      expect_close_to_scale(with.first_grads[i], without.first_grads[i].to(Device::cpu()), 1e-5,
                            "gradient of parameter " + std::to_string(i));
    const double tol = device.is_cpu() ? (autocast ? 2e-3 : 2e-5) : (autocast ? 1e-2 : 1e-3);
    for (size_t i = 0; i < with.losses.size(); ++i)
      EXPECT_NEAR(with.losses[i], without.losses[i], tol * (1 + std::abs(without.losses[i]))) << "step " << i;
    for (size_t i = 0; i < with.params.size(); ++i)
      expect_close_to_scale(with.params[i], without.params[i].to(Device::cpu()), tol, "parameter " + std::to_string(i));
  }
}

}  // namespace loom::test
