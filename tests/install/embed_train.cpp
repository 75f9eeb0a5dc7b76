// An application embedding Loom through `meson install` and pkg-config alone, as a user
// builds it: it includes <loom/...> headers and reaches every installed library. It reads
// Fashion-MNIST (data), trains SimpleCNN for a few Adam steps on the CPU (layers, engine,
// kernels), and, started by loomrun as two ranks, all-reduces a tensor over Gloo (parallel)
// and checks the sum. Prints "embed_train: ok" on success; any failure exits non-zero.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include <loom/data/idx.h>
#include <loom/data/loader.h>
#include <loom/engine/autograd.h>
#include <loom/engine/ops.h>
#include <loom/layers/models/simple_cnn.h>
#include <loom/layers/optim/adam.h>
#include <loom/parallel/init.h>

namespace {

// Five Adam steps of SimpleCNN on the first 256 training images; returns the first and last loss.
std::pair<double, double> train_a_few_steps() {
  using namespace loom;
  data::ImageSet train = data::load_fashion_mnist(data::kFashionMnistDir, data::Split::train);
  train.count = 256;
  train.pixels.resize(size_t(train.count * train.image_bytes()));
  train.labels.resize(size_t(train.count));
  manual_seed(0);
  nn::SimpleCNN model(1, 28, 10);
  optim::Adam adam(model.parameters(), {.lr = 2e-3});
  auto set = std::make_shared<data::ImageDataset>(
      train, data::ImageTransforms{.normalize = data::fashion_mnist_normalization()});
  data::DataLoader loader(set, std::make_shared<data::SequentialSampler>(train.count), {.batch_size = 64});
  double first = 0, last = 0;
  for (int repeat = 0; repeat < 2; ++repeat)
    for (data::Batch& b : loader.epoch(0)) {
      adam.zero_grad();
      Tensor loss = cross_entropy(model.forward(b.inputs), b.targets);
      loss.backward();
      adam.step();
      if (repeat == 0 && first == 0) first = loss.item();
      last = loss.item();
    }
  return {first, last};
}

}  // namespace

int main() {
  try {
    const auto [first, last] = train_a_few_steps();
    std::printf("embed_train: SimpleCNN loss %.3f -> %.3f over 8 steps\n", first, last);
    if (!(last < first)) {
      std::fprintf(stderr, "embed_train: the loss did not fall\n");
      return 1;
    }
    const loom::dist::DistContext ctx = loom::dist::init_distributed("cpu", std::chrono::seconds(60));
    if (!ctx.active) {
      std::fprintf(stderr, "embed_train: start two ranks with loomrun --nproc-per-node 2\n");
      return 1;
    }
    loom::Tensor t = loom::full({4}, double(ctx.rank + 1), loom::DType::f32, loom::Device::cpu());
    ctx.group->all_reduce(t)->wait();
    const double expected = ctx.size * (ctx.size + 1) / 2.0;
    for (int64_t i = 0; i < 4; ++i) {
      const double got = t.select(0, i).item();
      if (std::fabs(got - expected) > 0) {
        std::fprintf(stderr, "embed_train: rank %d: all-reduced element %lld is %g, expected %g\n", ctx.rank,
                     static_cast<long long>(i), got, expected);
        return 1;
      }
    }
    std::printf("embed_train: rank %d of %d: all-reduce over gloo gave %g\nembed_train: ok\n", ctx.rank,
                ctx.size, expected);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "embed_train: %s\n", e.what());
    return 1;
  }
}
