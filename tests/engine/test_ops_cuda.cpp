// Every op of the case table runs on the GPU and matches the CPU: outputs and input
// gradients, in f32 (TF32 matrix products), bf16 and f16, with tolerances by dtype.
// The inputs are the same numbers on both devices; the upstream gradient is a fixed
// random weight. Non-contiguous inputs are among the cases (transposed views).
#include <gtest/gtest.h>

#include <cmath>

#include "engine/autograd.h"
#include "tests/common/gpu.h"
#include "tests/engine/op_cases.h"

namespace loom::test {
namespace {

struct Result {
  Tensor out;
  TensorList grads;
};

Result run(const OpCase& c, const TensorList& base, DType dtype, Device device) {
  TensorList inputs;
  for (const Tensor& b : base) {
    Tensor t = b.to(dtype).to(device);
    t.set_requires_grad();
    inputs.push_back(t);
  }
  Tensor out = c.fn(inputs);
  manual_seed(11);
  Tensor weight = randn(out.shape(), DType::f32).to(out.dtype()).to(device);
  sum(mul(out, weight)).backward();
  Result r{out.to(Device::cpu()).to(DType::f64), {}};
  for (const Tensor& t : inputs) r.grads.push_back(t.grad().to(Device::cpu()).to(DType::f64));
  return r;
}

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  double scale = 1e-3;
  for (double v : w) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < g.size(); ++i)
    EXPECT_NEAR(g[i], w[i], tol * (scale + std::abs(w[i]))) << what << " element " << i;
}

struct DtypeCase {
  DType dtype;
  double tol;
};

class OpsCuda : public ::testing::TestWithParam<std::tuple<OpCase, DtypeCase>> {};

TEST_P(OpsCuda, MatchesCpu) {
  LOOM_REQUIRE_CUDA();
  const auto& [c, d] = GetParam();
  if (!c.sixteen_bit && dtype_size(d.dtype) == 2) GTEST_SKIP() << c.name << " runs in f32 only (op_cases.h)";
  TensorList base = make_inputs(c);
  // The CPU reference runs in f64 on inputs already rounded to the tested dtype.
  TensorList rounded;
  for (const Tensor& b : base) rounded.push_back(b.to(d.dtype).to(DType::f64));
  Result want = run(c, rounded, DType::f64, Device::cpu());
  Result got = run(c, base, d.dtype, Device::cuda(0));
  expect_close(got.out, want.out, d.tol, c.name + " output");
  for (size_t k = 0; k < got.grads.size(); ++k)
    expect_close(got.grads[k], want.grads[k], d.tol * 2, c.name + " grad of input " + std::to_string(k));
}

INSTANTIATE_TEST_SUITE_P(Ops, OpsCuda,
                         ::testing::Combine(::testing::ValuesIn(op_cases()),
                                            ::testing::Values(DtypeCase{DType::f32, 2e-3}, DtypeCase{DType::bf16, 3e-2},
                                                              DtypeCase{DType::f16, 5e-3})),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" +
                                  std::string(dtype_name(std::get<1>(info.param).dtype));
                         });

}  // namespace
}  // namespace loom::test
