// Module: PyTorch's dotted names, state dicts that round-trip in place, strict-mode errors
// that name every problem, and moves that keep every holder's handle valid.
#include <gtest/gtest.h>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/optim/sgd.h"
#include "layers/sequential.h"

namespace loom::nn {
namespace {

// features = Sequential(Linear(4, 3), ReLU, Linear(3, 2)), head = Linear(2, 1, no bias),
// and a buffer: the shape of a small torch model.
class Net : public Module {
 public:
  Net() {
    features = register_module("features", std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
                                               std::make_shared<Linear>(4, 3), std::make_shared<ReLU>(),
                                               std::make_shared<Linear>(3, 2)}));
    scale = register_buffer("scale", full({2}, 0.5));
    head = register_module("head", std::make_shared<Linear>(2, 1, Bias::no));
  }
  Tensor forward(const Tensor& x) override { return head->forward(mul(features->forward(x), scale)); }
  std::string type_name() const override { return "Net"; }

  std::shared_ptr<Sequential> features;
  std::shared_ptr<Linear> head;
  Tensor scale;
};

std::vector<std::string> keys(const NamedTensors& named) {
  std::vector<std::string> out;
  for (const auto& [name, _] : named) out.push_back(name);
  return out;
}

std::string load_error(Module& m, const NamedTensors& state) {
  try {
    m.load_state_dict(state);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ModuleNames, FollowPyTorchDottedNamesInRegistrationOrder) {
  Net net;
  EXPECT_EQ(keys(net.named_parameters()),
            (std::vector<std::string>{"features.0.weight", "features.0.bias", "features.2.weight", "features.2.bias",
                                      "head.weight"}));
  EXPECT_EQ(keys(net.named_buffers()), (std::vector<std::string>{"scale"}));
  EXPECT_EQ(keys(net.state_dict()), (std::vector<std::string>{"scale", "features.0.weight", "features.0.bias",
                                                              "features.2.weight", "features.2.bias", "head.weight"}));
  EXPECT_EQ(net.num_parameters(), 4 * 3 + 3 + 3 * 2 + 2 + 2);
  std::vector<std::string> modules;
  for (const auto& [name, _] : net.named_modules()) modules.push_back(name);
  EXPECT_EQ(modules, (std::vector<std::string>{"", "features", "features.0", "features.1", "features.2", "head"}));
}

TEST(ModuleNames, RefusesDuplicateOrDottedNames) {
  Net net;
  EXPECT_THROW(net.register_parameter("scale", zeros({1})), Error);
  EXPECT_THROW(net.register_buffer("a.b", zeros({1})), Error);
  EXPECT_THROW(net.register_module("", std::make_shared<ReLU>()), Error);
}

TEST(ModuleNames, TiedParameterIsListedOnceButSavedUnderEachName) {
  // GPT ties its output projection to its token embedding: one tensor under two names.
  Sequential seq;
  auto a = std::make_shared<Linear>(3, 3, Bias::no);
  auto tied = std::make_shared<Module>();
  tied->register_parameter("weight", a->weight);
  seq.append(a);
  seq.append(tied);
  EXPECT_EQ(keys(seq.named_parameters()), (std::vector<std::string>{"0.weight"}));
  EXPECT_EQ(keys(seq.state_dict()), (std::vector<std::string>{"0.weight", "1.weight"}));
  EXPECT_EQ(seq.num_parameters(), 9);
}

TEST(ModuleStateDict, RoundTripsIntoTheSameTensors) {
  manual_seed(1);
  Net source;
  manual_seed(2);
  Net target;
  fill_(source.scale, 3.0);
  Tensor weight_handle = target.features->named_children()[0].second->named_parameters()[0].second;
  target.load_state_dict(source.state_dict());
  NamedTensors a = source.state_dict(), b = target.state_dict();
  ASSERT_EQ(keys(a), keys(b));
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i].second.to_vector<float>(), b[i].second.to_vector<float>()) << a[i].first;
  // In place: the handle taken before the load sees the loaded values.
  EXPECT_EQ(weight_handle.to_vector<float>(), a[1].second.to_vector<float>());
  EXPECT_TRUE(weight_handle.requires_grad());
}

TEST(ModuleStateDict, StrictModeNamesMissingAndUnexpectedKeys) {
  Net net;
  NamedTensors state = net.state_dict();
  state.erase(state.begin() + 2);  // features.0.bias
  state.emplace_back("features.3.weight", zeros({2, 2}));
  std::string message = load_error(net, state);
  EXPECT_NE(message.find("missing from the file: features.0.bias"), std::string::npos) << message;
  EXPECT_NE(message.find("in the file but not in the model: features.3.weight"), std::string::npos) << message;

  LoadResult result = net.load_state_dict(state, Strict::no);
  EXPECT_EQ(result.missing_keys, (std::vector<std::string>{"features.0.bias"}));
  EXPECT_EQ(result.unexpected_keys, (std::vector<std::string>{"features.3.weight"}));
}

TEST(ModuleStateDict, ShapeMismatchSaysBothShapes) {
  Module model;
  model.register_module("fc1", std::make_shared<Linear>(1600, 128));
  Module file_model;
  file_model.register_module("fc1", std::make_shared<Linear>(3136, 128));
  EXPECT_EQ(load_error(model, file_model.state_dict()),
            "load_state_dict: fc1.weight has shape (128, 3136) in the file but (128, 1600) in the model");
  // A mismatch is an error even when not strict, and nothing is copied.
  Tensor before = model.state_dict()[1].second.clone();
  NamedTensors partial = file_model.state_dict();
  partial[1].second = ones({128});
  EXPECT_THROW(model.load_state_dict(partial, Strict::no), Error);
  EXPECT_EQ(model.state_dict()[1].second.to_vector<float>(), before.to_vector<float>());
}

TEST(ModuleMode, TrainAndEvalReachEveryDescendant) {
  Net net;
  EXPECT_TRUE(net.is_training());
  net.eval();
  for (const auto& [name, m] : net.named_modules()) EXPECT_FALSE(m->is_training()) << name;
  net.train();
  for (const auto& [name, m] : net.named_modules()) EXPECT_TRUE(m->is_training()) << name;
}

TEST(ModuleTo, DtypeMovesParametersInPlaceAndTheOptimizerKeepsWorking) {
  manual_seed(3);
  Net net;
  optim::SGD sgd(net.parameters(), {.lr = 0.1, .momentum = 0.9});
  Tensor x = randn({5, 4});
  sum(net.forward(x)).backward();
  sgd.step();  // creates f32 momentum buffers
  net.zero_grad();

  net.to(DType::f64);
  for (const auto& [name, p] : net.named_parameters()) EXPECT_EQ(p.dtype(), DType::f64) << name;
  EXPECT_EQ(net.scale.dtype(), DType::f64);
  // The optimizer's handles are the module's: it sees f64 parameters without being told.
  for (const Tensor& p : sgd.param_groups()[0].params) EXPECT_EQ(p.dtype(), DType::f64);

  std::vector<double> before = net.head->weight.to_vector<double>();
  sum(net.forward(x.to(DType::f64))).backward();
  std::vector<double> grad = net.head->weight.grad().to_vector<double>();
  std::vector<double> buffer = sgd.state(net.head->weight)->buffers.at("momentum_buffer").to_vector<double>();
  sgd.step();
  std::vector<double> after = net.head->weight.to_vector<double>();
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_NEAR(after[i], before[i] - 0.1 * (0.9 * buffer[i] + grad[i]), 1e-6) << i;
  EXPECT_EQ(sgd.state(net.head->weight)->buffers.at("momentum_buffer").dtype(), DType::f64);
}

TEST(ModuleTo, MovesGradientsWithTheParameters) {
  Linear layer(2, 2);
  sum(layer.forward(ones({1, 2}))).backward();
  layer.to(DType::f64);
  EXPECT_EQ(layer.weight.grad().dtype(), DType::f64);
  layer.zero_grad();
  EXPECT_FALSE(layer.weight.grad().defined());
}

}  // namespace
}  // namespace loom::nn
