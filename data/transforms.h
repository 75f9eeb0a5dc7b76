// Image transforms: plain functions over one image, and the random augmentations built on them.
//
// An example goes through two stages. Augmentations (random crop, flip, or any function of
// the same type) work on the 8-bit image (channels, height, width), as torchvision's run
// before ToTensor; then the pixels are scaled to [0, 1] and normalised per channel in one
// pass straight into the batch buffer. Keeping the tail fixed lets a GPU-resident dataset
// produce the same values with tensor ops, and zero padding stays a black pixel as in
// torchvision, whatever the normalisation.
//
// Random transforms draw from the example's CounterRng, seeded by (seed, epoch, index): an
// example's augmentation does not depend on the worker thread that built it, and resuming
// at epoch e, batch b repeats it exactly.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "random.h"

namespace loom::data {

// One 8-bit image in flight through the augmentations.
struct Image {
  int64_t channels = 0, height = 0, width = 0;
  std::vector<uint8_t> pixels;  // (channels, height, width), row-major

  uint8_t at(int64_t c, int64_t y, int64_t x) const { return pixels[size_t((c * height + y) * width + x)]; }
};

// An augmentation: changes the image in place (its size too), drawing from the rng.
using Transform = std::function<void(Image& image, CounterRng& rng)>;

// Per-channel normalisation, (x - mean[c]) / std[c], after scaling to [0, 1]; empty: none.
struct Normalization {
  std::vector<float> mean, std;
  bool empty() const { return mean.empty(); }
};

// The statistics of the training sets, as torchvision users quote them.
inline Normalization fashion_mnist_normalization() { return {{0.2860f}, {0.3530f}}; }
inline Normalization cifar10_normalization() {
  return {{0.4914f, 0.4822f, 0.4465f}, {0.2470f, 0.2435f, 0.2616f}};
}

// ---- plain functions -------------------------------------------------------------
// out[i] = pixels[i] / 255 in f32, as torchvision's ToTensor.
void to_unit_range(const uint8_t* pixels, int64_t count, float* out);
// In place over (channels, plane) floats: (x - mean[c]) / std[c] in f32, as
// torchvision's Normalize. Throws unless norm has one mean and one std > 0 per channel.
void normalize(float* chw, int64_t channels, int64_t plane, const Normalization& norm);
// Checks that `norm` fits images of `channels` channels (what normalize() would check).
void check_normalization(const Normalization& norm, int64_t channels);
// The (height, width) window at (top, left) of `image` padded by `padding` zero pixels on
// every side; top and left are in padded coordinates, so (padding, padding) is the original
// position. Throws when the window leaves the padded image.
Image crop_padded(const Image& image, int64_t top, int64_t left, int64_t height, int64_t width, int64_t padding);
// Mirrors every row.
void flip_horizontal(Image& image);

// ---- random augmentations -----------------------------------------------------------
// A size x size window of the image padded by `padding` zeros, at top and left drawn (in that
// order) uniformly from [0, H + 2 padding - size] and [0, W + 2 padding - size]. CIFAR-10's
// usual augmentation is random_crop(32, 4).
Transform random_crop(int64_t size, int64_t padding = 0);
// Flips with probability p (one draw).
Transform random_horizontal_flip(double p = 0.5);

}  // namespace loom::data
