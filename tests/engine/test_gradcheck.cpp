// Every differentiable op passes a float64 central finite-difference check on the CPU:
// the gradient of L = sum(f(x) * w), w a fixed random weight, against (L(x+h) - L(x-h)) / 2h
// for every element of every input.
#include <gtest/gtest.h>

#include "engine/autograd.h"
#include "tests/engine/op_cases.h"

namespace loom::test {
namespace {

double loss_value(const OpCase& c, const TensorList& inputs, const Tensor& weight) {
  NoGradGuard no_grad;
  return sum(mul(c.fn(inputs).to(DType::f64), weight)).item();
}

class Gradcheck : public ::testing::TestWithParam<OpCase> {};

TEST_P(Gradcheck, AnalyticMatchesFiniteDifferences) {
  const OpCase& c = GetParam();
  TensorList inputs = make_inputs(c);
  for (Tensor& t : inputs) t.set_requires_grad();
  Tensor out = c.fn(inputs);
  manual_seed(7);
  Tensor weight = randn(out.shape(), DType::f64);
  sum(mul(out, weight)).backward();

  constexpr double h = 1e-6;
  for (size_t k = 0; k < inputs.size(); ++k) {
    ASSERT_TRUE(inputs[k].grad().defined()) << c.name << ": input " << k << " got no gradient";
    std::vector<double> analytic = inputs[k].grad().to_vector<double>();
    double* x = inputs[k].data<double>();
    for (int64_t i = 0; i < inputs[k].numel(); ++i) {
      double saved = x[i];
      x[i] = saved + h;
      double up = loss_value(c, inputs, weight);
      x[i] = saved - h;
      double down = loss_value(c, inputs, weight);
      x[i] = saved;
      double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(analytic[i], numeric, 1e-6 + 1e-5 * std::abs(numeric))
          << c.name << ": input " << k << ", element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, Gradcheck, ::testing::ValuesIn(op_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace loom::test
