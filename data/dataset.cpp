#include "data/dataset.h"

#include "kernels/core/error.h"

namespace loom::data {

Example Dataset::get(int64_t index, int64_t epoch) const {
  const ExampleSpec s = spec();
  Example ex{Tensor::empty(s.input_shape, s.input_dtype), Tensor::empty(s.target_shape, DType::i64)};
  get_into(index, epoch, ex.input.data_ptr(), ex.target.data<int64_t>());
  return ex;
}

namespace {

void check_index(int64_t index, int64_t size, const char* what) {
  LOOM_CHECK(index >= 0 && index < size, what, ": index ", index, " is out of range for ", size, " examples");
}

// Example `index`'s image after the augmentations of `epoch`.
Image augmented(const ImageSet& set, const ImageTransforms& transforms, int64_t index, int64_t epoch) {
  const uint8_t* src = set.image(index);
  Image image{set.channels, set.height, set.width, std::vector<uint8_t>(src, src + set.image_bytes())};
  CounterRng rng(transforms.seed, epoch, index, RngDomain::augment);
  for (const Transform& t : transforms.augment) t(image, rng);
  return image;
}

}  // namespace

ImageDataset::ImageDataset(ImageSet images, ImageTransforms transforms)
    : images_(std::move(images)), transforms_(std::move(transforms)) {
  const ImageSet& s = images_;
  LOOM_CHECK(s.count >= 0 && int64_t(s.pixels.size()) == s.count * s.image_bytes(), "ImageDataset: ", s.pixels.size(),
             " pixel bytes do not hold ", s.count, " images of (", s.channels, ", ", s.height, ", ", s.width, ")");
  LOOM_CHECK(int64_t(s.labels.size()) == s.count, "ImageDataset needs one label per image: the set has ", s.count,
             " images and ", s.labels.size(), " labels");
  spec_ = {{s.channels, s.height, s.width}, DType::f32, {}};
  if (!transforms_.augment.empty() && s.count > 0) {
    const Image probe = augmented(s, transforms_, 0, 0);
    spec_.input_shape = {probe.channels, probe.height, probe.width};
  }
  if (!transforms_.normalize.empty()) check_normalization(transforms_.normalize, spec_.input_shape[0]);
}

void ImageDataset::get_into(int64_t index, int64_t epoch, void* input, int64_t* target) const {
  check_index(index, images_.count, "ImageDataset");
  const int64_t C = spec_.input_shape[0], plane = spec_.input_shape[1] * spec_.input_shape[2];
  float* out = static_cast<float*>(input);
  if (transforms_.augment.empty()) {
    to_unit_range(images_.image(index), C * plane, out);
  } else {
    const Image image = augmented(images_, transforms_, index, epoch);
    LOOM_CHECK((Shape{image.channels, image.height, image.width} == spec_.input_shape),
               "ImageDataset: the augmentations made image ", index, " (", image.channels, ", ", image.height, ", ",
               image.width, ") but image 0 ", shape_str(spec_.input_shape),
               ": every example of a batch needs one shape (crop to a fixed size)");
    to_unit_range(image.pixels.data(), C * plane, out);
  }
  if (!transforms_.normalize.empty()) normalize(out, C, plane, transforms_.normalize);
  *target = images_.labels[size_t(index)];
}

TokenWindowDataset::TokenWindowDataset(TokenShard tokens, int64_t context)
    : tokens_(std::move(tokens)), context_(context) {
  LOOM_CHECK(context_ >= 1, "TokenWindowDataset: context must be >= 1, got ", context_);
  LOOM_CHECK(int64_t(tokens_.tokens.size()) > context_, "TokenWindowDataset: ", tokens_.tokens.size(),
             " tokens do not make one window of ", context_, " (it needs ", context_ + 1,
             " with the shifted target): use a shorter context or more text");
}

void TokenWindowDataset::get_into(int64_t index, int64_t, void* input, int64_t* target) const {
  check_index(index, size(), "TokenWindowDataset");
  const uint16_t* src = tokens_.tokens.data() + index * context_;
  int64_t* in = static_cast<int64_t*>(input);
  for (int64_t t = 0; t < context_; ++t) {
    in[t] = src[t];
    target[t] = src[t + 1];
  }
}

}  // namespace loom::data
