// CIFAR-10 and CIFAR-100 in their "binary version" (cifar-10-binary.tar.gz, cifar-100-binary.tar.gz):
// files of fixed-size records, label byte(s) then 3072 pixel bytes, 1024 each of red, green and
// blue, row-major 32x32 — already (channels, height, width), so records copy straight in.
// There is no header: a file's record count is its size over the record size, which must divide.
#pragma once

#include <string>

#include "image_set.h"

namespace loom::data {

inline constexpr int64_t kCifarPixels = 3 * 32 * 32;

// Which label a CIFAR-100 record's two label bytes (coarse, then fine) yields.
enum class Cifar100Label { fine, coarse };

// One CIFAR-10 file (data_batch_N.bin or test_batch.bin): (count, 3, 32, 32), labels < 10.
ImageSet load_cifar10_file(const std::string& path);
// The cifar-10-batches-bin directory: train is data_batch_1..5.bin in order, test is
// test_batch.bin. Class names come from batches.meta.txt when present.
ImageSet load_cifar10(const std::string& dir, Split split);

// One CIFAR-100 file (train.bin or test.bin): labels < 100 (fine) or < 20 (coarse).
ImageSet load_cifar100_file(const std::string& path, Cifar100Label which = Cifar100Label::fine);
// The cifar-100-binary directory; class names from fine_label_names.txt or
// coarse_label_names.txt when present.
ImageSet load_cifar100(const std::string& dir, Split split, Cifar100Label which = Cifar100Label::fine);

}  // namespace loom::data
