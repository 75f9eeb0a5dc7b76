// linear and gelu_mlp on the GPU against the CPU: bf16 and f32 (TF32) through cuBLASLt's
// epilogues (bias, GELU with its pre-activation, DGELU) and Loom's bias-gradient passes,
// at GPT-like widths and at widths whose rows are not 16-byte
// aligned in bf16 (7 and 13), where cuBLASLt may have no plan and the separate passes run;
// the bias sums over rows in one chunk and in several (300 and 270 rows).
// The reference is the same op on the CPU in f64 from the same (rounded) values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "tests/common/gpu.h"
#include "tests/common/tensor_checks.h"

namespace loom {
namespace {

double tolerance(DType dt) { return dt == DType::bf16 ? 3e-2 : 5e-3; }

struct Case {
  int64_t rows, in, hidden, out;
};

TEST(LinearOpsCuda, GeluMlpMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::bf16, DType::f32})
    for (const Case c : {Case{96, 64, 256, 64}, Case{300, 32, 128, 40}, Case{33, 40, 160, 24}, Case{10, 7, 13, 5}})
      for (bool biases : {true, false}) {
        const std::string what = std::string(dtype_name(dt)) + " rows " + std::to_string(c.rows) + " in " +
                                 std::to_string(c.in) + " hidden " + std::to_string(c.hidden) +
                                 (biases ? " biases" : " no biases");
        SCOPED_TRACE(what);
        manual_seed(11);
        // Values rounded to dt first, so both devices start from the same numbers.
        auto draw = [&](Shape s, double scale) { return mul(randn(s, DType::f64), scale).to(dt).to(DType::f64); };
        TensorList host{draw({c.rows, c.in}, 1.0), draw({c.hidden, c.in}, 0.2), biases ? draw({c.hidden}, 0.2) : Tensor(),
                        draw({c.out, c.hidden}, 0.1), biases ? draw({c.out}, 0.1) : Tensor()};
        Tensor up = draw({c.rows, c.out}, 1.0);
        TensorList cpu_leaves, gpu_leaves;
        for (const Tensor& t : host) {
          cpu_leaves.push_back(t.defined() ? t.clone().set_requires_grad() : Tensor());
          gpu_leaves.push_back(t.defined() ? t.to(gpu).to(dt).set_requires_grad() : Tensor());
        }
        auto go = [](const TensorList& l, const Tensor& u) {
          Tensor y = gelu_mlp(l[0], l[1], l[2], l[3], l[4]);
          sum(mul(y, u)).backward();
          return y;
        };
        Tensor want = go(cpu_leaves, up), got = go(gpu_leaves, up.to(gpu).to(dt));
        test::expect_close_to_scale(got, want, tolerance(dt), what + " output");
        for (size_t i = 0; i < host.size(); ++i)
          if (host[i].defined())
            test::expect_close_to_scale(gpu_leaves[i].grad(), cpu_leaves[i].grad(), 2 * tolerance(dt),
                         what + " gradient " + std::to_string(i));
      }
}

// A bf16 product joining an f32 residual stream (the f32-output path, bias kept in f32),
// against the CPU doing the same in f64.
TEST(LinearOpsCuda, ResidualInF32BesideBf16ProductsMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  for (int64_t out : {int64_t(64), int64_t(13)}) {
    SCOPED_TRACE("out " + std::to_string(out));
    manual_seed(13);
    auto draw = [](Shape s, double scale) { return mul(randn(s, DType::f64), scale).to(DType::bf16).to(DType::f64); };
    TensorList host{draw({3, 22, 48}, 1.0), draw({96, 48}, 0.2), draw({96}, 0.2), draw({out, 96}, 0.1),
                    draw({out}, 0.1), draw({3, 22, out}, 1.0), draw({out, 48}, 0.2)};
    Tensor up = draw({3, 22, out}, 1.0);
    TensorList cpu, dev;
    for (size_t i = 0; i < host.size(); ++i) {
      cpu.push_back(host[i].clone().set_requires_grad());
      // Parameters and the residual stay f32 on the GPU, as a model's are; autocast makes the products bf16.
      dev.push_back(host[i].to(gpu).to(DType::f32).set_requires_grad());
    }
    auto go = [](const TensorList& l, const Tensor& u) {
      Tensor y = add(gelu_mlp(l[0], l[1], l[2], l[3], l[4], l[5]), linear(l[0], l[6], l[4], l[5]));
      sum(mul(y, u)).backward();
      return y;
    };
    Tensor want = go(cpu, up), got;
    {
      AutocastGuard autocast(DType::bf16);
      got = go(dev, up.to(gpu).to(DType::f32));
    }
    EXPECT_EQ(got.dtype(), DType::f32);
    test::expect_close_to_scale(got, want, tolerance(DType::bf16), "output");
    for (size_t i = 0; i < host.size(); ++i)
      test::expect_close_to_scale(dev[i].grad(), cpu[i].grad(), 2 * tolerance(DType::bf16), "gradient " + std::to_string(i));
  }
}

TEST(LinearOpsCuda, LinearBiasGradientMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::bf16, DType::f32})
    for (int64_t out : {int64_t(48), int64_t(13)}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " out " + std::to_string(out));
      manual_seed(12);
      // 270 rows: the bias sums take three chunks of rows, the last one short.
      Tensor x = randn({270, 32}, DType::f64).to(dt).to(DType::f64), w = randn({out, 32}, DType::f64).to(dt).to(DType::f64);
      Tensor b = randn({out}, DType::f64).to(dt).to(DType::f64), up = randn({270, out}, DType::f64).to(dt).to(DType::f64);
      TensorList cpu{x.clone().set_requires_grad(), w.clone().set_requires_grad(), b.clone().set_requires_grad()};
      TensorList dev{x.to(gpu).to(dt).set_requires_grad(), w.to(gpu).to(dt).set_requires_grad(),
                     b.to(gpu).to(dt).set_requires_grad()};
      sum(mul(linear(cpu[0], cpu[1], cpu[2]), up)).backward();
      sum(mul(linear(dev[0], dev[1], dev[2]), up.to(gpu).to(dt))).backward();
      for (int i = 0; i < 3; ++i) test::expect_close_to_scale(dev[i].grad(), cpu[i].grad(), 2 * tolerance(dt), "gradient " + std::to_string(i));
    }
}

// The classifier's loss with its output layer, against the CPU in f64 from the same values:
// in one chunk (the logits' gradient kept for backward) and in several of 64 and 128 rows
// (both gradients made in the forward call, the weight's summed over the chunks, in f32 for
// bf16 products), with ignored rows and an upstream gradient of 1/3, which bf16 cannot hold.
// The gradients are compared times the rows counted, so that they are not small against the
// tolerance's floor of 1 (a zero gradient fails). bf16 comes two ways:
// f32 parameters under autocast (a language model's tied head) and bf16 leaves; f32 runs in
// TF32. 77 classes make rows that are not 16-byte aligned in bf16.
TEST(LinearOpsCuda, LinearCrossEntropyByChunksMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  enum class Mode { autocast, bf16_leaves, f32 };
  for (Mode mode : {Mode::autocast, Mode::bf16_leaves, Mode::f32})
    for (int64_t classes : {int64_t(1000), int64_t(77)})
      for (int64_t chunk : {int64_t(0), int64_t(64), int64_t(128)}) {
        const DType dt = mode == Mode::f32 ? DType::f32 : DType::bf16;
        const std::string what = std::string(mode == Mode::autocast ? "autocast" : dtype_name(dt)) + " classes " +
                                 std::to_string(classes) + " chunk_rows " + std::to_string(chunk);
        SCOPED_TRACE(what);
        manual_seed(14);
        auto draw = [&](Shape s, double scale) { return mul(randn(s, DType::f64), scale).to(dt).to(DType::f64); };
        const int64_t rows = 300;
        Tensor x = draw({rows, 64}, 1.0), w = draw({classes, 64}, 0.2);
        std::vector<int64_t> ids(static_cast<size_t>(rows));
        double counted = 0;
        for (int64_t i = 0; i < rows; ++i) {
          ids[size_t(i)] = i % 7 == 3 ? -100 : (i * 37) % classes;
          counted += ids[size_t(i)] != -100;
        }
        Tensor target = from_vector(ids, {rows});
        TensorList cpu{x.clone().set_requires_grad(), w.clone().set_requires_grad()};
        const DType leaf = mode == Mode::bf16_leaves ? DType::bf16 : DType::f32;
        TensorList dev{x.to(gpu).to(leaf).set_requires_grad(), w.to(gpu).to(leaf).set_requires_grad()};
        Tensor want = linear_cross_entropy(cpu[0], cpu[1], target);
        mul(want, 1.0 / 3).backward();
        Tensor got;
        {
          AutocastGuard autocast(mode == Mode::autocast ? std::optional<DType>(DType::bf16) : std::nullopt);
          got = linear_cross_entropy(dev[0], dev[1], target.to(gpu), -100, 0.0, chunk);
          mul(got, 1.0 / 3).backward();
        }
        test::expect_close_to_scale(got, want, tolerance(dt), what + " loss");
        for (int i = 0; i < 2; ++i) {
          EXPECT_EQ(dev[i].grad().dtype(), leaf) << what << " gradient " << i;
          test::expect_close_to_scale(mul(dev[i].grad().to(DType::f32), counted), mul(cpu[i].grad(), counted),
                                      2 * tolerance(dt), what + " gradient " + std::to_string(i) + " times the count");
        }
      }
}

}  // namespace
}  // namespace loom
