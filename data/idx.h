// IDX files, the format of MNIST and Fashion-MNIST: a magic of 00 00 <type> <ndims>, ndims
// big-endian uint32 sizes, then the values row-major. Loom reads unsigned-byte IDX only (the
// type every image/label set in this format uses), plain or gzip: gzip is detected by its
// magic, so a file named .gz that was already unpacked (or the reverse) still reads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "image_set.h"

namespace loom::data {

// Where Debian's dataset-fashion-mnist package installs the real dataset.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// Largest IDX payload Loom will allocate for (8 GiB); MNIST's biggest file is 47 MB.
inline constexpr uint64_t kMaxIdxBytes = uint64_t{1} << 33;

struct IdxArray {
  std::vector<int64_t> dims;  // as the header gives them, e.g. (60000, 28, 28)
  std::vector<uint8_t> data;  // row-major, product(dims) bytes
};

// Any unsigned-byte IDX file, of any number of dimensions.
IdxArray load_idx(const std::string& path);
// A 3-dim IDX file (count, height, width) as images (count, 1, height, width); labels empty.
ImageSet load_idx_images(const std::string& path);
// A 1-dim IDX file of labels.
std::vector<int64_t> load_idx_labels(const std::string& path);

// A directory holding {train,t10k}-{images-idx3,labels-idx1}-ubyte, each plain or with .gz.
// Checks that images and labels agree in count and that every label is < 10.
ImageSet load_mnist(const std::string& dir, Split split);
// As load_mnist, with Fashion-MNIST's class names.
ImageSet load_fashion_mnist(const std::string& dir = kFashionMnistDir, Split split = Split::train);

}  // namespace loom::data
