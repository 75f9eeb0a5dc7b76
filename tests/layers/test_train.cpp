// End to end on the CPU: a 2-layer MLP (Sequential of Linear, ReLU, Linear) fits a smooth
// function of two inputs with Adam, and its loss falls at least five-fold in 200 steps.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/optim/adam.h"
#include "layers/sequential.h"

namespace loom::nn {
namespace {

TEST(TrainMlp, AdamCutsTheLossFiveFoldIn200Steps) {
  manual_seed(0);
  const int64_t n = 256;
  Tensor x = add(mul(rand({n, 2}), 4.0), -2.0);  // U[-2, 2)^2
  std::vector<float> xs = x.to_vector<float>(), ys(n);
  for (int64_t i = 0; i < n; ++i) ys[i] = std::sin(1.5f * xs[2 * i]) + 0.5f * xs[2 * i + 1] * xs[2 * i + 1];
  Tensor y = from_vector(ys, {n, 1});

  Sequential mlp({std::make_shared<Linear>(2, 32), std::make_shared<ReLU>(), std::make_shared<Linear>(32, 1)});
  optim::Adam adam(mlp.parameters(), {.lr = 0.01});
  auto loss_fn = [&] {
    Tensor err = sub(mlp.forward(x), y);
    return mean(mul(err, err));
  };
  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    adam.zero_grad();
    Tensor loss = loss_fn();
    if (step == 0) first = loss.item();
    loss.backward();
    adam.step();
  }
  {
    NoGradGuard no_grad;
    last = loss_fn().item();
  }
  EXPECT_LT(last, first / 5) << "loss went from " << first << " to " << last;
}

}  // namespace
}  // namespace loom::nn
