// Dropout: in training the kept fraction is 1 - p and survivors are scaled by 1/(1-p),
// so the mean is preserved; its gradient is the same scaled mask; in eval mode it is the
// identity.
#include <gtest/gtest.h>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/dropout.h"

namespace loom::nn {
namespace {

TEST(DropoutTrain, DropsAboutPAndPreservesTheMean) {
  manual_seed(21);
  const double p = 0.3;
  const int64_t n = 200000;
  Dropout dropout(p);
  std::vector<float> y = dropout.forward(ones({n})).to_vector<float>();
  int64_t zeros_seen = 0;
  double total = 0;
  for (float v : y) {
    if (v == 0) ++zeros_seen;
    else EXPECT_FLOAT_EQ(v, float(1 / (1 - p)));
    total += v;
  }
  // Binomial: sd of the dropped fraction is sqrt(p(1-p)/n) ~ 0.001; allow 5 sd.
  EXPECT_NEAR(double(zeros_seen) / n, p, 0.005);
  EXPECT_NEAR(total / n, 1.0, 0.01);
}

TEST(DropoutTrain, GradientIsTheScaledMask) {
  manual_seed(22);
  Dropout dropout(0.5);
  Tensor x = ones({64}).set_requires_grad();
  Tensor y = dropout.forward(x);
  sum(y).backward();
  EXPECT_EQ(x.grad().to_vector<float>(), y.to_vector<float>());
}

TEST(DropoutTrain, FreshMaskEachCallAndRepeatableUnderASeed) {
  Dropout dropout(0.5);
  manual_seed(23);
  std::vector<float> first = dropout.forward(ones({256})).to_vector<float>();
  std::vector<float> second = dropout.forward(ones({256})).to_vector<float>();
  EXPECT_NE(first, second);
  manual_seed(23);
  EXPECT_EQ(dropout.forward(ones({256})).to_vector<float>(), first);
}

TEST(DropoutEval, IsTheIdentity) {
  Dropout dropout(0.9);
  dropout.eval();
  Tensor x = randn({4, 5});
  EXPECT_TRUE(dropout.forward(x).same(x));
}

TEST(DropoutEdges, ZeroKeepsAllAndOneDropsAll) {
  Tensor x = randn({10});
  EXPECT_TRUE(Dropout(0.0).forward(x).same(x));
  EXPECT_EQ(Dropout(1.0).forward(x).to_vector<float>(), std::vector<float>(10, 0.0f));
  EXPECT_THROW(Dropout(1.5), Error);
}

}  // namespace
}  // namespace loom::nn
