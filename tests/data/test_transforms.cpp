// Transforms and ImageDataset: exact values of the conversion and normalisation, crop and flip
// geometry, and augmentations that depend on (seed, epoch, index) only.
#include <set>
#include <thread>
#include <utility>

#include "data/dataset.h"
#include "data/transforms.h"
#include "tests/data/fixtures.h"

namespace loom::data {
namespace {

using test::synthetic_images;

// (channels, height, width) with pixels 1, 2, 3, ... in row-major order.
Image numbered(int64_t channels, int64_t height, int64_t width) {
  Image im{channels, height, width, {}};
  for (int64_t i = 0; i < channels * height * width; ++i) im.pixels.push_back(uint8_t(i + 1));
  return im;
}

TEST(Transforms, ToUnitRangeDividesBy255) {
  const std::vector<uint8_t> px = {0, 1, 51, 128, 255};
  std::vector<float> out(px.size());
  to_unit_range(px.data(), int64_t(px.size()), out.data());
  for (size_t i = 0; i < px.size(); ++i) EXPECT_EQ(out[i], float(px[i]) / 255.0f);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[4], 1.0f);
}

TEST(Transforms, NormalizeGivesExactPerChannelValues) {
  std::vector<float> x = {0.0f, 0.5f, 1.0f, 0.25f, 0.0f, 0.5f, 1.0f, 0.25f};  // (2, 4)
  normalize(x.data(), 2, 4, Normalization{{0.5f, 0.25f}, {0.5f, 0.125f}});
  EXPECT_EQ(x, (std::vector<float>{-1, 0, 1, -0.5f, -2, 2, 6, 0}));
}

TEST(Transforms, NormalizeMatchesTorchvisionArithmeticForCifar) {
  const Normalization norm = cifar10_normalization();
  std::vector<float> x(3 * 5);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i * 17 % 256) / 255.0f;
  std::vector<float> expected = x;
  for (size_t i = 0; i < x.size(); ++i) expected[i] = (x[i] - norm.mean[i / 5]) / norm.std[i / 5];
  normalize(x.data(), 3, 5, norm);
  EXPECT_EQ(x, expected);
}

TEST(Transforms, StandardNormalizationConstants) {
  EXPECT_EQ(fashion_mnist_normalization().mean, std::vector<float>{0.2860f});
  EXPECT_EQ(fashion_mnist_normalization().std, std::vector<float>{0.3530f});
  EXPECT_EQ(cifar10_normalization().mean, (std::vector<float>{0.4914f, 0.4822f, 0.4465f}));
  EXPECT_EQ(cifar10_normalization().std, (std::vector<float>{0.2470f, 0.2435f, 0.2616f}));
}

TEST(Transforms, NormalizationMustFitTheChannels) {
  std::vector<float> x(4);
  EXPECT_LOOM_ERROR(normalize(x.data(), 1, 4, cifar10_normalization()), "3 channel(s)", "images have 1");
  EXPECT_LOOM_ERROR(normalize(x.data(), 1, 4, Normalization{{0.5f}, {0.0f}}), "std must be > 0");
  EXPECT_LOOM_ERROR(normalize(x.data(), 1, 4, Normalization{{0.5f}, {}}), "1 means but 0");
}

TEST(Transforms, CropWithPaddingShiftsContentAndZeroFills) {
  const Image im = numbered(1, 3, 3);  // 1 2 3 / 4 5 6 / 7 8 9
  EXPECT_EQ(crop_padded(im, 0, 0, 3, 3, 1).pixels, (std::vector<uint8_t>{0, 0, 0, 0, 1, 2, 0, 4, 5}));
  EXPECT_EQ(crop_padded(im, 2, 2, 3, 3, 1).pixels, (std::vector<uint8_t>{5, 6, 0, 8, 9, 0, 0, 0, 0}));
  EXPECT_EQ(crop_padded(im, 1, 1, 3, 3, 1).pixels, im.pixels);
  EXPECT_EQ(crop_padded(im, 1, 0, 2, 2, 0).pixels, (std::vector<uint8_t>{4, 5, 7, 8}));
  // A window wholly in the padding is black.
  EXPECT_EQ(crop_padded(im, 0, 0, 2, 2, 2).pixels, (std::vector<uint8_t>{0, 0, 0, 0}));
}

TEST(Transforms, CropMovesEveryChannelAlike) {
  const Image im = numbered(2, 2, 2);  // channel 0: 1 2 / 3 4; channel 1: 5 6 / 7 8
  const Image out = crop_padded(im, 0, 1, 2, 2, 1);
  EXPECT_EQ(out.channels, 2);
  EXPECT_EQ(out.pixels, (std::vector<uint8_t>{0, 0, 1, 2, 0, 0, 5, 6}));
}

TEST(Transforms, CropOutsideThePaddedImageIsAnError) {
  const Image im = numbered(1, 3, 3);
  EXPECT_LOOM_ERROR(crop_padded(im, 1, 0, 3, 3, 0), "leaves the 3x3 image");
  EXPECT_LOOM_ERROR(crop_padded(im, 0, 0, 6, 6, 1), "at most 5x5");
  Image copy = im;
  CounterRng rng(0, 0, 0, RngDomain::augment);
  EXPECT_LOOM_ERROR(random_crop(8, 2)(copy, rng), "does not fit a 3x3 image");
}

TEST(Transforms, FlipMirrorsEveryRowOfEveryChannel) {
  Image im = numbered(2, 2, 3);
  flip_horizontal(im);
  EXPECT_EQ(im.pixels, (std::vector<uint8_t>{3, 2, 1, 6, 5, 4, 9, 8, 7, 12, 11, 10}));
}

TEST(Transforms, RandomCropTakesItsOffsetsFromTheRngAndCoversThemAll) {
  const Image im = numbered(1, 4, 4);
  const Transform crop = random_crop(4, 1);
  std::set<std::pair<int64_t, int64_t>> seen;
  for (int64_t index = 0; index < 200; ++index) {
    Image out = im;
    CounterRng rng(5, 0, index, RngDomain::augment);
    crop(out, rng);
    CounterRng replay(5, 0, index, RngDomain::augment);
    const int64_t top = replay.below(3), left = replay.below(3);
    EXPECT_EQ(out.pixels, crop_padded(im, top, left, 4, 4, 1).pixels) << "index " << index;
    seen.insert({top, left});
  }
  EXPECT_EQ(seen.size(), 9u);  // every offset in [0, 2] x [0, 2]
}

TEST(Transforms, RandomFlipFollowsItsProbability) {
  const Image im = numbered(1, 2, 2);
  int flipped = 0;
  for (int64_t index = 0; index < 400; ++index) {
    for (double p : {0.0, 1.0}) {
      Image out = im;
      CounterRng rng(1, 0, index, RngDomain::augment);
      random_horizontal_flip(p)(out, rng);
      EXPECT_EQ(out.pixels, p == 0.0 ? im.pixels : (std::vector<uint8_t>{2, 1, 4, 3}));
    }
    Image out = im;
    CounterRng rng(1, 0, index, RngDomain::augment);
    random_horizontal_flip()(out, rng);
    flipped += out.pixels != im.pixels;
  }
  EXPECT_GT(flipped, 150);
  EXPECT_LT(flipped, 250);
}

TEST(CounterRng, DrawsArePureFunctionsOfSeedEpochIndexAndDomain) {
  auto draws = [](uint64_t seed, int64_t epoch, int64_t index, RngDomain domain) {
    CounterRng rng(seed, epoch, index, domain);
    std::vector<uint32_t> v;
    for (int i = 0; i < 9; ++i) v.push_back(rng.next_u32());  // crosses a block boundary
    return v;
  };
  const auto base = draws(7, 3, 11, RngDomain::augment);
  EXPECT_EQ(base, draws(7, 3, 11, RngDomain::augment));
  EXPECT_NE(base, draws(8, 3, 11, RngDomain::augment));
  EXPECT_NE(base, draws(7, 4, 11, RngDomain::augment));
  EXPECT_NE(base, draws(7, 3, 12, RngDomain::augment));
  EXPECT_NE(base, draws(7, 3, 11, RngDomain::sampler));
  CounterRng rng(1, 0, 0, RngDomain::augment);
  for (int i = 0; i < 1000; ++i) {
    const int64_t v = rng.below(7);
    EXPECT_TRUE(v >= 0 && v < 7);
    const double u = rng.uniform();
    EXPECT_TRUE(u >= 0 && u < 1);
  }
}

ImageTransforms cifar_style(uint64_t seed) {
  return ImageTransforms{{random_crop(4, 2), random_horizontal_flip()}, Normalization{{0.5f}, {0.25f}}, seed};
}

std::vector<float> input_of(const Dataset& ds, int64_t index, int64_t epoch) {
  return ds.get(index, epoch).input.to_vector<float>();
}

TEST(ImageDataset, WithoutAugmentationScalesThenNormalizes) {
  const ImageSet set = synthetic_images(3, 2, 2, 2);
  const ImageDataset ds(set, ImageTransforms{{}, Normalization{{0.5f, 0.25f}, {0.5f, 0.125f}}, 0});
  EXPECT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.spec().input_shape, (Shape{2, 2, 2}));
  EXPECT_EQ(ds.spec().input_dtype, DType::f32);
  EXPECT_EQ(ds.spec().target_shape, Shape{});
  const Example ex = ds.get(2);
  const std::vector<float> got = ex.input.to_vector<float>();
  for (int64_t i = 0; i < 8; ++i) {
    const float x = float(set.image(2)[i]) / 255.0f;
    EXPECT_EQ(got[size_t(i)], i < 4 ? (x - 0.5f) / 0.5f : (x - 0.25f) / 0.125f);
  }
  EXPECT_EQ(ex.target.item(), 2.0);
}

TEST(ImageDataset, AugmentationDependsOnSeedEpochAndIndexOnly) {
  const ImageSet set = synthetic_images(16, 1, 4, 4);
  const ImageDataset ds(set, cifar_style(42)), same(set, cifar_style(42)), other_seed(set, cifar_style(43));
  int epoch_changes = 0, seed_changes = 0;
  for (int64_t i = 0; i < 16; ++i) {
    const std::vector<float> a = input_of(ds, i, 3);
    EXPECT_EQ(a, input_of(ds, i, 3));
    EXPECT_EQ(a, input_of(same, i, 3));
    epoch_changes += a != input_of(ds, i, 4);
    seed_changes += a != input_of(other_seed, i, 3);
  }
  EXPECT_GT(epoch_changes, 8);
  EXPECT_GT(seed_changes, 8);

  // Built on other threads, in another order: the same values.
  std::vector<std::vector<float>> from_threads(16);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int64_t i = 15 - t; i >= 0; i -= 4) from_threads[size_t(i)] = input_of(ds, i, 3);
    });
  for (auto& th : threads) th.join();
  for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(from_threads[size_t(i)], input_of(ds, i, 3)) << "index " << i;
}

TEST(ImageDataset, InputShapeFollowsTheAugmentation) {
  const ImageDataset ds(synthetic_images(4, 3, 6, 6), ImageTransforms{{random_crop(4)}, {}, 0});
  EXPECT_EQ(ds.spec().input_shape, (Shape{3, 4, 4}));
  EXPECT_EQ(ds.get(3, 1).input.shape(), (Shape{3, 4, 4}));
}

TEST(ImageDataset, ExamplesOfAnotherShapeAreAnError) {
  const Transform uneven = [](Image& im, CounterRng&) {
    if (im.pixels[0] % 2 == 1) im = crop_padded(im, 0, 0, 2, 2, 0);
  };
  ImageSet set = synthetic_images(2, 1, 4, 4);
  set.pixels[0] = 2;   // image 0 keeps its shape
  set.pixels[16] = 3;  // image 1 is cropped
  const ImageDataset ds(set, ImageTransforms{{uneven}, {}, 0});
  EXPECT_LOOM_ERROR(ds.get(1), "image 1 (1, 2, 2)", "image 0 (1, 4, 4)", "one shape");
}

TEST(ImageDataset, ChecksLabelsAndIndices) {
  ImageSet set = synthetic_images(3, 1, 2, 2);
  set.labels.pop_back();
  EXPECT_LOOM_ERROR(ImageDataset(set), "one label per image", "3 images and 2 labels");
  const ImageDataset ds(synthetic_images(3, 1, 2, 2));
  EXPECT_LOOM_ERROR(ds.get(3), "index 3 is out of range for 3 examples");
  EXPECT_LOOM_ERROR(ImageDataset(synthetic_images(3, 1, 2, 2), ImageTransforms{{}, cifar10_normalization(), 0}),
                    "3 channel(s)", "images have 1");
}

TEST(TokenWindowDataset, TargetsAreInputsShiftedByOne) {
  TokenShard shard;
  for (uint16_t t = 0; t < 11; ++t) shard.tokens.push_back(uint16_t(100 + t));
  const TokenWindowDataset ds(shard, 3);
  EXPECT_EQ(ds.size(), 3);  // (11 - 1) / 3
  EXPECT_EQ(ds.spec().input_dtype, DType::i64);
  const Example ex = ds.get(2);
  EXPECT_EQ(ex.input.to_vector<int64_t>(), (std::vector<int64_t>{106, 107, 108}));
  EXPECT_EQ(ex.target.to_vector<int64_t>(), (std::vector<int64_t>{107, 108, 109}));
  EXPECT_LOOM_ERROR(TokenWindowDataset(shard, 11), "11 tokens do not make one window of 11");
}

}  // namespace
}  // namespace loom::data
