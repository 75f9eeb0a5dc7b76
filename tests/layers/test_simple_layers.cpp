// The stateless and table layers: Sequential's chaining and naming, activations against
// their formulas, Flatten's shapes and Embedding's rows and initialisation.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "engine/ops.h"
#include "layers/activation.h"
#include "layers/embedding.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/sequential.h"

namespace loom::nn {
namespace {

TEST(LayersSequential, ChainsStagesInOrder) {
  Sequential seq({std::make_shared<Flatten>(), std::make_shared<Linear>(6, 4), std::make_shared<Tanh>()});
  seq.append(std::make_shared<ReLU>());
  EXPECT_EQ(seq.size(), 4u);
  EXPECT_EQ(seq[1]->type_name(), "Linear");
  EXPECT_THROW(seq[4], Error);
  Tensor x = randn({5, 2, 3});
  Tensor expected = relu(tanh(seq[1]->forward(x.reshape({5, 6}))));
  EXPECT_EQ(seq.forward(x).to_vector<float>(), expected.to_vector<float>());
}

TEST(LayersActivation, MatchFormulas) {
  std::vector<float> xs = {-2.0f, -0.5f, 0.0f, 0.7f, 3.0f};
  Tensor x = from_vector(xs, {5});
  std::vector<float> r = ReLU().forward(x).to_vector<float>(), t = Tanh().forward(x).to_vector<float>(),
                     g = GELU().forward(x).to_vector<float>();
  for (size_t i = 0; i < xs.size(); ++i) {
    double v = xs[i];
    EXPECT_FLOAT_EQ(r[i], float(std::max(v, 0.0)));
    EXPECT_NEAR(t[i], std::tanh(v), 1e-6);
    double gelu_tanh = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    EXPECT_NEAR(g[i], gelu_tanh, 1e-6);
  }
}

TEST(LayersFlatten, KeepsTheBatchDimensionByDefault) {
  EXPECT_EQ(Flatten().forward(zeros({2, 3, 4, 5})).shape(), (Shape{2, 60}));
  EXPECT_EQ(Flatten(0).forward(zeros({2, 3, 4})).shape(), (Shape{24}));
  EXPECT_EQ(Flatten(1, 2).forward(zeros({2, 3, 4, 5})).shape(), (Shape{2, 12, 5}));
}

TEST(LayersEmbedding, LooksUpRowsAndStartsStandardNormal) {
  manual_seed(31);
  Embedding table(1000, 16);
  std::vector<float> w = table.weight.to_vector<float>();
  double mean = 0, sq = 0;
  for (float v : w) mean += v / double(w.size()), sq += double(v) * v / double(w.size());
  EXPECT_NEAR(mean, 0, 0.02);
  EXPECT_NEAR(sq - mean * mean, 1, 0.03);

  Tensor ids = from_vector(std::vector<int64_t>{3, 999, 3}, {1, 3});
  Tensor rows = table.forward(ids);
  EXPECT_EQ(rows.shape(), (Shape{1, 3, 16}));
  std::vector<float> got = rows.to_vector<float>();
  for (int64_t j = 0; j < 16; ++j) {
    EXPECT_EQ(got[j], w[3 * 16 + j]);
    EXPECT_EQ(got[16 + j], w[999 * 16 + j]);
  }
  sum(rows).backward();
  std::vector<float> grad = table.weight.grad().to_vector<float>();
  EXPECT_EQ(grad[3 * 16], 2.0f);  // row 3 was read twice
  EXPECT_EQ(grad[999 * 16], 1.0f);
  EXPECT_EQ(grad[0], 0.0f);
  EXPECT_THROW(table.forward(zeros({2})), Error);
}

// A GPT's input in one op: the two lookups and their sum, with both gradients.
TEST(LayersEmbedding, TokenAndPositionEmbeddingsMatchTheirSum) {
  manual_seed(32);
  Embedding wte(11, 8), wpe(6, 8);
  Tensor ids = from_vector(std::vector<int64_t>{3, 10, 3, 0, 7, 7, 1, 3}, {2, 4});
  Tensor up = randn({2, 4, 8});
  Tensor fused = token_position_embedding(wte.weight, wpe.weight, ids);
  sum(mul(fused, up)).backward();
  Tensor g_wte = wte.weight.grad().clone(), g_wpe = wpe.weight.grad().clone();
  wte.weight.zero_grad(), wpe.weight.zero_grad();
  Tensor plain = add(wte.forward(ids), wpe.forward(arange(0, 4, 1, DType::i64)));
  sum(mul(plain, up)).backward();
  EXPECT_EQ(fused.to_vector<float>(), plain.to_vector<float>());
  auto near = [](const Tensor& a, const Tensor& b, const char* what) {
    std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
    ASSERT_EQ(x.size(), y.size()) << what;
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], y[i], 1e-6) << what << " element " << i;
  };
  near(g_wte, wte.weight.grad(), "wte gradient");
  near(g_wpe, wpe.weight.grad(), "wpe gradient");  // rows 4 and 5, past T, are zero in both
  try {
    token_position_embedding(wte.weight, wpe.weight, from_vector(std::vector<int64_t>{1, 11}, {1, 2}));
    ADD_FAILURE() << "id 11 of a vocabulary of 11 did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("index 11 at position 1"), std::string::npos) << e.what();
  }
  try {
    token_position_embedding(wte.weight, wpe.weight, zeros({1, 7}, DType::i64));
    ADD_FAILURE() << "7 tokens with 6 positions did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a sequence of 7 tokens is longer than the 6 positions"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace loom::nn
