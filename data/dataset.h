// Datasets: examples by index, written straight into a batch buffer.
//
// The loader asks a Dataset for example i of epoch e and gives it the place in the batch
// (pinned host memory, when the batch goes to a GPU) to write it to, so an example is
// converted once and never copied again on the host. get_into is called from several worker
// threads at once and must not change the dataset; the epoch is an argument so that random
// augmentation can be a pure function of (seed, epoch, index).
//
// ImageDataset serves images (IDX, CIFAR, image folders) with their labels; TokenWindowDataset
// serves next-token windows of a token stream for language models.
#pragma once

#include <cstdint>

#include "image_set.h"
#include "token_shard.h"
#include "transforms.h"
#include "../engine/tensor.h"

namespace loom::data {

// What one example looks like; a batch of B is (B, ...input_shape) and (B, ...target_shape).
struct ExampleSpec {
  Shape input_shape;               // e.g. (C, H, W) for an image, (T,) for a token window
  DType input_dtype = DType::f32;  // f32 or i64
  Shape target_shape;              // () for a class label, (T,) for next-token targets
};

// One example as CPU tensors, for inspection and tests (the loader never builds these).
struct Example {
  Tensor input;   // input_shape, input_dtype
  Tensor target;  // target_shape, i64
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual ExampleSpec spec() const = 0;
  // Writes example `index` (0 <= index < size()) as seen in `epoch` into `input`
  // (numel(input_shape) values of input_dtype) and `target` (numel(target_shape) values).
  virtual void get_into(int64_t index, int64_t epoch, void* input, int64_t* target) const = 0;

  Example get(int64_t index, int64_t epoch = 0) const;
};

// The transforms an ImageDataset applies: augmentations on the 8-bit image, then scaling to
// [0, 1] and `normalize`. `seed` keys the augmentations' randomness.
struct ImageTransforms {
  std::vector<Transform> augment;
  Normalization normalize;
  uint64_t seed = 0;
};

// Labelled images, (C, H, W) f32 inputs and i64 class targets. The input shape is that of
// the augmented image (a random crop may change it), taken from example 0 at construction;
// an example whose augmentation gives another shape is an error.
class ImageDataset : public Dataset {
 public:
  explicit ImageDataset(ImageSet images, ImageTransforms transforms = {});

  int64_t size() const override { return images_.count; }
  ExampleSpec spec() const override { return spec_; }
  void get_into(int64_t index, int64_t epoch, void* input, int64_t* target) const override;

  const ImageSet& images() const { return images_; }
  const ImageTransforms& transforms() const { return transforms_; }

 private:
  ImageSet images_;
  ImageTransforms transforms_;
  ExampleSpec spec_;
};

// Non-overlapping windows of a token stream: example i is tokens [iT, iT + T) as input and
// [iT + 1, iT + T + 1) as target, both i64 (T,), so size() = (ntok - 1) / T. With a random
// sampler this is nanoGPT's training batch without overlap between windows of one epoch.
class TokenWindowDataset : public Dataset {
 public:
  TokenWindowDataset(TokenShard tokens, int64_t context);

  int64_t size() const override { return (int64_t(tokens_.tokens.size()) - 1) / context_; }
  ExampleSpec spec() const override { return {{context_}, DType::i64, {context_}}; }
  void get_into(int64_t index, int64_t epoch, void* input, int64_t* target) const override;

 private:
  TokenShard tokens_;
  int64_t context_;
};

}  // namespace loom::data
