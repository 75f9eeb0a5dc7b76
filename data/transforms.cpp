#include "data/transforms.h"

#include <algorithm>
#include <cstring>

#include "kernels/core/error.h"

namespace loom::data {

void to_unit_range(const uint8_t* pixels, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = float(pixels[i]) / 255.0f;
}

void check_normalization(const Normalization& norm, int64_t channels) {
  LOOM_CHECK(norm.mean.size() == norm.std.size(), "normalization has ", norm.mean.size(), " means but ",
             norm.std.size(), " standard deviations: give one of each per channel");
  LOOM_CHECK(int64_t(norm.mean.size()) == channels, "normalization has ", norm.mean.size(),
             " channel(s) but the images have ", channels, ": use fashion_mnist_normalization() for 1 channel, ",
             "cifar10_normalization() for 3, or your own");
  for (float s : norm.std) LOOM_CHECK(s > 0, "normalization std must be > 0, got ", s);
}

void normalize(float* chw, int64_t channels, int64_t plane, const Normalization& norm) {
  check_normalization(norm, channels);
  for (int64_t c = 0; c < channels; ++c) {
    const float mean = norm.mean[size_t(c)], std = norm.std[size_t(c)];
    float* p = chw + c * plane;
    for (int64_t i = 0; i < plane; ++i) p[i] = (p[i] - mean) / std;
  }
}

Image crop_padded(const Image& image, int64_t top, int64_t left, int64_t height, int64_t width, int64_t padding) {
  const int64_t H = image.height, W = image.width, P = padding;
  LOOM_CHECK(P >= 0 && height >= 0 && width >= 0, "crop: padding and size must be >= 0, got padding ", P, ", size (",
             height, ", ", width, ")");
  LOOM_CHECK(top >= 0 && left >= 0 && top + height <= H + 2 * P && left + width <= W + 2 * P, "crop: window (",
             height, ", ", width, ") at (", top, ", ", left, ") leaves the ", H, "x", W, " image padded by ", P,
             ": use a crop size of at most ", H + 2 * P, "x", W + 2 * P);
  Image out{image.channels, height, width, std::vector<uint8_t>(size_t(image.channels * height * width), 0)};
  // Rows and columns of the window that fall on the image (the rest stays zero).
  const int64_t y0 = std::max<int64_t>(0, P - top), y1 = std::min<int64_t>(height, H + P - top);
  const int64_t x0 = std::max<int64_t>(0, P - left), x1 = std::min<int64_t>(width, W + P - left);
  if (y0 >= y1 || x0 >= x1) return out;
  for (int64_t c = 0; c < image.channels; ++c)
    for (int64_t y = y0; y < y1; ++y)
      std::memcpy(&out.pixels[size_t((c * height + y) * width + x0)],
                  &image.pixels[size_t((c * H + y + top - P) * W + x0 + left - P)], size_t(x1 - x0));
  return out;
}

void flip_horizontal(Image& image) {
  for (int64_t row = 0; row < image.channels * image.height; ++row) {
    auto begin = image.pixels.begin() + row * image.width;
    std::reverse(begin, begin + image.width);
  }
}

Transform random_crop(int64_t size, int64_t padding) {
  LOOM_CHECK(size >= 1 && padding >= 0, "random_crop: size must be >= 1 and padding >= 0, got size ", size,
             ", padding ", padding);
  return [size, padding](Image& image, CounterRng& rng) {
    const int64_t span_y = image.height + 2 * padding - size, span_x = image.width + 2 * padding - size;
    LOOM_CHECK(span_y >= 0 && span_x >= 0, "random_crop(", size, ", padding ", padding, ") does not fit a ",
               image.height, "x", image.width, " image");
    const int64_t top = rng.below(span_y + 1);
    const int64_t left = rng.below(span_x + 1);
    image = crop_padded(image, top, left, size, size, padding);
  };
}

Transform random_horizontal_flip(double p) {
  LOOM_CHECK(p >= 0 && p <= 1, "random_horizontal_flip: p must be in [0, 1], got ", p);
  return [p](Image& image, CounterRng& rng) {
    if (rng.uniform() < p) flip_horizontal(image);
  };
}

}  // namespace loom::data
