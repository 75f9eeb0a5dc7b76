// Channels-last on the GPU, where convolutions and pooling read and write the layout
// natively (cuDNN's NHWC convolutions, Loom's NHWC pooling kernels): a ResNet-18 and a
// SimpleCNN step on a channels-last batch keep every stage's output channels-last and give
// the row-major step's loss and gradients, and the CPU's, to the rounding of cuDNN's other
// algorithms: SimpleCNN parameter by parameter, ResNet-18 (whose gradients a ReLU kink can
// move element by element) as a whole in f32 and by its loss in bf16, over three batches. A
// single convolution at each of ResNet-18's stage shapes gives the row-major output and
// gradients in both cuDNN APIs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/options.h"
#include "layers/models/resnet.h"
#include "layers/models/simple_cnn.h"
#include "tests/common/gpu.h"
#include "tests/layers/channels_last_params.h"

namespace loom::nn {
namespace {

struct Step {
  double loss = 0;
  std::vector<std::vector<double>> grads;
};

Step step(Module& model, const Tensor& x, const Tensor& labels, std::optional<DType> cast) {
  Tensor loss;
  {
    AutocastGuard guard(cast);
    loss = cross_entropy(model.forward(x).to(DType::f32), labels);
  }
  loss.backward();
  Step s{loss.item(), {}};
  for (const Tensor& p : model.parameters()) s.grads.push_back(p.grad().to_vector<double>());
  return s;
}

// The largest difference between got and want, over want's largest magnitude.
double worst_relative(const std::vector<double>& got, const std::vector<double>& want) {
  double scale = 1e-6, worst = 0;
  for (size_t j = 0; j < want.size(); ++j) {
    scale = std::max(scale, std::abs(want[j]));
    worst = std::max(worst, std::abs(got[j] - want[j]));
  }
  return worst / scale;
}

// Each gradient within tol of the largest magnitude of its row-major counterpart.
void expect_alike(const Step& got, const Step& want, double tol) {
  EXPECT_NEAR(got.loss, want.loss, tol * std::abs(want.loss));
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < want.grads.size(); ++i)
    EXPECT_LE(worst_relative(got.grads[i], want.grads[i]), tol) << "parameter " << i << " of " << want.grads.size();
}

// The whole gradient (every parameter's, end to end) within tol of `want`'s in relative L2,
// the loss within tol. A deep network's gradient is ill-conditioned element by element: an
// activation within rounding of ReLU's kink falls on either side in two runs that sum in
// other orders, which moves a few gradients by percents while the whole stays close. A wrong
// layout (data read in another order) moves the whole by its own size. The worst parameter,
// relative to its largest value, is printed beside it.
void expect_close_overall(const Step& got, const Step& want, double tol, const char* what) {
  EXPECT_NEAR(got.loss, want.loss, tol * std::abs(want.loss)) << what;
  ASSERT_EQ(got.grads.size(), want.grads.size());
  double diff = 0, norm = 0, worst = 0;
  size_t worst_at = 0;
  for (size_t i = 0; i < want.grads.size(); ++i) {
    for (size_t j = 0; j < want.grads[i].size(); ++j) {
      const double e = got.grads[i][j] - want.grads[i][j];
      diff += e * e;
      norm += want.grads[i][j] * want.grads[i][j];
    }
    if (const double w = worst_relative(got.grads[i], want.grads[i]); w > worst) worst = w, worst_at = i;
  }
  const double relative = std::sqrt(diff / std::max(norm, 1e-300));
  std::printf("%s: relative L2 %.3g; worst parameter %zu at %.3g of its largest value\n", what, relative, worst_at,
              worst);
  EXPECT_LE(relative, tol) << what;
}

// What a check compares: every parameter's gradient, the gradient as a whole, or the loss.
enum class Compare { each_parameter, whole_gradient, loss };

// One step of a fresh model (seed 9) on a batch (seed `seed`) in each layout on the GPU and,
// in f32, row-major on the CPU: each GPU layout against the CPU and against each other.
void check(const std::function<std::shared_ptr<Module>()>& make, const Shape& image, std::optional<DType> cast,
           double tol, Compare what, uint64_t seed = 5) {
  const Device dev = Device::cuda(0);
  manual_seed(seed);
  Tensor images = randn(image).to(dev);
  Tensor labels = from_vector(std::vector<int64_t>{3, 7, 1, 0}, {4}).to(dev);
  Step steps[2];
  for (int layout = 0; layout < 2; ++layout) {
    manual_seed(9);
    std::shared_ptr<Module> model = make();
    model->to(dev);
    const MemoryFormat format = layout ? MemoryFormat::channels_last : MemoryFormat::contiguous;
    steps[layout] = step(*model, images.contiguous(format), labels, cast);
  }
  auto compare = [&](const Step& got, const Step& want, const char* name) {
    if (what == Compare::whole_gradient) expect_close_overall(got, want, tol, name);
    else if (what == Compare::each_parameter) expect_alike(got, want, tol);
    else EXPECT_NEAR(got.loss, want.loss, tol * std::abs(want.loss)) << name;
  };
  if (!cast) {
    manual_seed(9);
    std::shared_ptr<Module> model = make();
    const Step cpu = step(*model, images.to(Device::cpu()), labels.to(Device::cpu()), cast);
    compare(steps[0], cpu, "row-major GPU against the CPU");
    compare(steps[1], cpu, "channels-last GPU against the CPU");
  }
  compare(steps[1], steps[0], cast ? "channels-last against row-major, bf16" : "channels-last against row-major");
}

TEST(ChannelsLastCuda, ResNet18StaysChannelsLastAndStepsLikeRowMajor) {
  LOOM_REQUIRE_CUDA();
  test::Tf32Off full_f32;
  // On the CPU alone, this step's gradient moves by 0.19% in relative L2 (3.3% on one
  // parameter) for the batch of seed 5 perturbed by 1e-7, and by 0.08% for seed 7: f32
  // rounding that puts an activation on the other side of a ReLU kink. Under bf16 autocast it
  // moves by 25% for seed 6, so there only the loss is compared; the convolution and
  // BatchNorm tests check their bf16 gradients op by op.
  for (uint64_t seed : {5, 6, 7}) {
    std::printf("batch seed %llu\n", (unsigned long long)seed);
    check([] { return resnet18(10, 3); }, {4, 3, 16, 16}, std::nullopt, 1e-2, Compare::whole_gradient, seed);
    check([] { return resnet18(10, 3); }, {4, 3, 16, 16}, DType::bf16, 5e-2, Compare::loss, seed);
  }
  // Every stage's output keeps the layout.
  const Device dev = Device::cuda(0);
  auto model = resnet18(10, 3);
  model->to(dev);
  NoGradGuard no_grad;
  Tensor h = randn({4, 3, 16, 16}).to(dev).contiguous(MemoryFormat::channels_last);
  h = relu(model->bn1->forward(model->conv1->forward(h)));
  EXPECT_EQ(h.memory_format(), MemoryFormat::channels_last);
  for (const auto& stage : model->stages) {
    h = stage->forward(h);
    EXPECT_EQ(h.memory_format(), MemoryFormat::channels_last) << shape_str(h.shape());
  }
}

// One convolution, its three gradients in both layouts, for the shapes of ResNet-18's stem
// (3 input channels) and of a later layer (64), in f32 and bf16, through cuDNN's graph API
// and its convolution API: the largest difference of each, relative to the largest value.
TEST(ChannelsLastCuda, AConvolutionsGradientsMatchRowMajor) {
  LOOM_REQUIRE_CUDA();
  test::Tf32Off full_f32;
  const Device dev = Device::cuda(0);
  struct ConvShape {
    int64_t c_in, c_out, side, kernel, stride;
  };
  for (ConvShape sh : {ConvShape{3, 64, 16, 3, 1}, ConvShape{64, 64, 16, 3, 1}, ConvShape{64, 128, 16, 3, 2},
                    ConvShape{64, 128, 16, 1, 2}, ConvShape{128, 128, 8, 3, 1}, ConvShape{256, 256, 4, 3, 1},
                    ConvShape{512, 512, 2, 3, 1}})
    for (DType dtype : {DType::f32, DType::bf16})
      for (bool graph_api : {true, false}) {
        const int64_t c_in = sh.c_in, out_side = sh.side / sh.stride;
        const int pad = int(sh.kernel / 2), stride = int(sh.stride);
        Options o = options();
        o.cudnn_graph_api = graph_api;
        OptionsGuard guard(o);
        manual_seed(3);
        Tensor x0 = randn({4, c_in, sh.side, sh.side}).to(dev).to(dtype);
        Tensor w0 = randn({sh.c_out, c_in, sh.kernel, sh.kernel}).to(dev).to(dtype);
        Tensor gy = randn({4, sh.c_out, out_side, out_side}).to(dev).to(dtype);
        std::vector<double> got[2][3];
        for (int layout = 0; layout < 2; ++layout) {
          const MemoryFormat format = layout ? MemoryFormat::channels_last : MemoryFormat::contiguous;
          Tensor x = x0.contiguous(format).detach().set_requires_grad(true);
          Tensor w = w0.detach().set_requires_grad(true);
          Tensor y = conv2d(x, w, Tensor(), {stride, stride}, {pad, pad});
          y.backward(gy.contiguous(format));
          got[layout][0] = y.contiguous().to(DType::f64).to_vector<double>();
          got[layout][1] = x.grad().contiguous().to(DType::f64).to_vector<double>();
          got[layout][2] = w.grad().contiguous().to(DType::f64).to_vector<double>();
        }
        const char* names[] = {"output", "input gradient", "filter gradient"};
        const double tol = dtype == DType::f32 ? 1e-5 : 2e-2;
        for (int k = 0; k < 3; ++k)
          EXPECT_LE(worst_relative(got[1][k], got[0][k]), tol)
              << names[k] << ", " << c_in << " to " << sh.c_out << " channels of " << sh.side << "x" << sh.side
              << ", kernel " << sh.kernel << ", stride " << sh.stride << ", " << dtype_name(dtype)
              << (graph_api ? ", graph API" : ", convolution API");
      }
}

TEST(ChannelsLastCuda, SimpleCnnWithMaxPoolingStepsLikeRowMajor) {
  LOOM_REQUIRE_CUDA();
  test::Tf32Off full_f32;
  check([] { return std::make_shared<SimpleCNN>(3, 32, 10); }, {4, 3, 32, 32}, std::nullopt, 1e-3,
        Compare::each_parameter);
  // One channel (Fashion-MNIST): the batch is re-strided, not copied, and the first
  // convolution reads a (N, 1, H, W) NHWC tensor.
  check([] { return std::make_shared<SimpleCNN>(1, 28, 10); }, {4, 1, 28, 28}, std::nullopt, 1e-3,
        Compare::each_parameter);
}

// Channels-last parameters (Module::to(MemoryFormat), as bench_cnn --channels-last lays them
// out) step as row-major ones, bit for bit, under Options::deterministic: the same cuDNN calls
// (the weights reach them channels-last either way), the optimizers updating the parameters
// as they lie.
TEST(ChannelsLastCuda, ChannelsLastParametersStepAsRowMajorOnes) {
  LOOM_REQUIRE_CUDA();
  Options o = options();
  o.deterministic = true;
  OptionsGuard guard(o);
  test::expect_same_training(Device::cuda(0), MemoryFormat::channels_last, test::momentum_sgd, "SGD on cuda:0");
  test::expect_same_training(Device::cuda(0), MemoryFormat::channels_last, test::adamw, "AdamW on cuda:0");
}

}  // namespace
}  // namespace loom::nn
