// ImageSet: what every image reader (IDX, CIFAR, image folders) returns. Plain host data, no
// tensors: the readers need nothing of the engine, and an ImageDataset (data/dataset.h) with
// the DataLoader (data/loader.h) turns these vectors into batches of tensors later (or copies
// them to the GPU whole).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::data {

// Which half of a dataset that ships with a fixed train/test split.
enum class Split { train, test };

struct ImageSet {
  std::vector<uint8_t> pixels;           // (count, channels, height, width), row-major
  int64_t count = 0, channels = 0, height = 0, width = 0;
  std::vector<int64_t> labels;           // (count,); empty when the source has no labels
  std::vector<std::string> class_names;  // label -> name; empty when the source names none
  // Where the images came from, for messages: the IDX file, the first CIFAR batch file, or
  // an image folder's first image.
  std::string source;

  int64_t image_bytes() const { return channels * height * width; }
  // One image's pixels: (channels, height, width).
  const uint8_t* image(int64_t i) const { return pixels.data() + i * image_bytes(); }
};

}  // namespace loom::data
