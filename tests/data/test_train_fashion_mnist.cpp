// End to end on the CPU with real data: the guide's SimpleCNN trained on the first 2,000
// Fashion-MNIST training images (Debian's dataset-fashion-mnist) for two epochs through the
// DataLoader; the loss falls and test accuracy on 1,000 test images is far above chance
// (10%). Skips, saying what to install, where the dataset is missing.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>

#include "data/idx.h"
#include "data/loader.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/models/simple_cnn.h"
#include "layers/optim/adam.h"

namespace loom::data {
namespace {

void keep_first(ImageSet* set, int64_t n) {
  set->count = n;
  set->pixels.resize(size_t(n * set->image_bytes()));
  set->labels.resize(size_t(n));
}

TEST(TrainFashionMnist, SimpleCnnLearnsFrom2000ImagesInTwoEpochs) {
  if (!std::filesystem::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz") &&
      !std::filesystem::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte"))
    GTEST_SKIP() << "Fashion-MNIST is not installed in " << kFashionMnistDir
                 << " (apt-get install dataset-fashion-mnist)";
  ImageSet train = load_fashion_mnist(kFashionMnistDir, Split::train);
  ImageSet test = load_fashion_mnist(kFashionMnistDir, Split::test);
  keep_first(&train, 2000);
  keep_first(&test, 1000);

  manual_seed(0);
  nn::SimpleCNN model(1, 28, 10);
  optim::Adam adam(model.parameters(), {.lr = 2e-3});
  auto train_set = std::make_shared<ImageDataset>(train, ImageTransforms{.normalize = fashion_mnist_normalization()});
  DataLoader loader(train_set, std::make_shared<RandomSampler>(train.count, 0),
                    {.batch_size = 50, .num_workers = 1, .drop_last = DropLast::yes});
  std::vector<double> losses;
  for (int64_t epoch = 0; epoch < 2; ++epoch)
    for (Batch& b : loader.epoch(epoch)) {
      adam.zero_grad();
      Tensor loss = cross_entropy(model.forward(b.inputs), b.targets);
      loss.backward();
      adam.step();
      losses.push_back(loss.item());
    }
  ASSERT_EQ(losses.size(), 80u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += losses[size_t(i)] / 5, last += losses[losses.size() - 1 - size_t(i)] / 5;
  EXPECT_LT(last, 0.5 * first) << "mean loss of the first five steps " << first << ", of the last five " << last;

  NoGradGuard no_grad;
  model.eval();
  auto test_set = std::make_shared<ImageDataset>(test, ImageTransforms{.normalize = fashion_mnist_normalization()});
  DataLoader test_loader(test_set, std::make_shared<SequentialSampler>(test.count), {.batch_size = 500});
  int64_t correct = 0;
  for (Batch& b : test_loader.epoch(0))
    correct += int64_t(sum(eq(argmax(model.forward(b.inputs), 1), b.targets).to(DType::f32)).item());
  const double accuracy = double(correct) / double(test.count);
  EXPECT_GT(accuracy, 0.6) << "test accuracy " << accuracy << " (chance is 0.1)";
  std::printf("SimpleCNN, 2,000 images, 2 epochs: loss %.3f -> %.3f, test accuracy %.1f%%\n", first, last,
              accuracy * 100);
}

}  // namespace
}  // namespace loom::data
