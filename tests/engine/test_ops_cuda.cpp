// Every op of the case table runs on the GPU and matches the CPU: outputs and input
// gradients, in f32 (TF32 matrix products), bf16 and f16, with tolerances by dtype.
// The inputs are the same numbers on both devices; the upstream gradient is a fixed
// random weight. Non-contiguous inputs are among the cases (transposed views). Also: the
// fused batch_norm_relu gives the bits of batch_norm, add and relu when its residual and
// its upstream gradient lie off 16-byte alignment.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "tests/common/gpu.h"
#include "tests/common/tensor_checks.h"
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

// A (shape) view that starts one element into a larger buffer: no 16-byte alignment.
Tensor misaligned(const Shape& shape, DType dtype, MemoryFormat format) {
  Tensor dense = randn(shape, DType::f32, Device::cuda(0)).to(dtype).contiguous(format);
  Tensor big = zeros({dense.numel() + 1}, dtype, Device::cuda(0));
  Tensor view = big.slice(0, 1, dense.numel() + 1);
  {
    NoGradGuard no_grad;
    copy_(view, dense.permute(format == MemoryFormat::channels_last ? std::vector<int>{0, 2, 3, 1}
                                                                     : std::vector<int>{0, 1, 2, 3})
                    .reshape({dense.numel()}));
  }
  Tensor shaped = format == MemoryFormat::channels_last
                      ? view.reshape({shape[0], shape[2], shape[3], shape[1]}).permute({0, 3, 1, 2})
                      : view.reshape(shape);
  EXPECT_NE(reinterpret_cast<uintptr_t>(shaped.data_ptr()) % 16, 0u);
  return shaped;
}

TEST(BatchNormReluCuda, MisalignedResidualAndGradientGiveTheSeparateOpsBits) {
  LOOM_REQUIRE_CUDA();
  const Shape shape{8, 64, 8, 8};
  for (DType dtype : {DType::f32, DType::bf16})
    for (MemoryFormat format : {MemoryFormat::contiguous, MemoryFormat::channels_last}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (format == MemoryFormat::contiguous ? "" : " channels-last"));
      manual_seed(5);
      Tensor x0 = randn(shape, DType::f32, Device::cuda(0)).to(dtype).contiguous(format);
      Tensor r0 = misaligned(shape, dtype, format), g = misaligned(shape, dtype, format);
      Tensor w0 = randn({64}, DType::f32, Device::cuda(0)), b0 = randn({64}, DType::f32, Device::cuda(0));
      auto run = [&](bool fused) {
        Tensor x = x0.detach().set_requires_grad(), r = r0.detach().set_requires_grad();
        Tensor w = w0.detach().set_requires_grad(), b = b0.detach().set_requires_grad();
        Tensor y = fused ? batch_norm_relu(x, r, Tensor(), Tensor(), w, b, true)
                         : relu(add(batch_norm(x, Tensor(), Tensor(), w, b, true), r));
        y.backward(g);
        return std::vector<Tensor>{y.detach(), x.grad(), r.grad(), w.grad(), b.grad()};
      };
      const std::vector<Tensor> a = run(true), e = run(false);
      const char* names[] = {"output", "input gradient", "residual gradient", "weight gradient", "bias gradient"};
      for (size_t i = 0; i < a.size(); ++i) expect_same_bits(a[i], e[i], names[i]);
    }
}

}  // namespace
}  // namespace loom::test
