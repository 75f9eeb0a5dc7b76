// CIFAR binary reader. All files of a split are sized and checked (record size divides the file,
// at least one record) before anything is allocated, so a truncated data_batch_5 fails before
// four good batches are read; then one buffer of the exact total is filled.
#include "data/cifar.h"

#include <algorithm>
#include <vector>

#include "data/file_io.h"
#include "kernels/core/error.h"

namespace loom::data {

namespace {

struct Format {
  const char* name;      // for messages
  int64_t label_bytes;   // leading label bytes per record
  int64_t label_index;   // which of them is the label
  int64_t num_classes;
};

constexpr Format kCifar10{"CIFAR-10", 1, 0, 10};

Format cifar100_format(Cifar100Label which) {
  return which == Cifar100Label::fine ? Format{"CIFAR-100 (fine labels)", 2, 1, 100}
                                      : Format{"CIFAR-100 (coarse labels)", 2, 0, 20};
}

// Checks a file's size against the record size and returns its record count.
int64_t count_records(const std::string& path, const Format& f) {
  const uint64_t size = file_size(path);
  const uint64_t record = static_cast<uint64_t>(f.label_bytes + kCifarPixels);
  LOOM_CHECK(size > 0, path, ": is empty; expected ", f.name, " records of ", record, " bytes");
  LOOM_CHECK(size % record == 0, path, ": holds ", size, " bytes, not a whole number of ", f.name,
             " records of ", record, " bytes (", size / record, " records and ", size % record,
             " bytes over): truncated download, or a file of the other CIFAR format?");
  return static_cast<int64_t>(size / record);
}

ImageSet load_files(const std::vector<std::string>& paths, const Format& f) {
  std::vector<int64_t> counts;
  ImageSet s;
  for (const std::string& p : paths) {
    counts.push_back(count_records(p, f));
    s.count += counts.back();
  }
  s.channels = 3;
  s.height = 32;
  s.width = 32;
  if (!paths.empty()) s.source = paths[0];
  s.pixels.resize(static_cast<size_t>(s.count * kCifarPixels));
  s.labels.reserve(static_cast<size_t>(s.count));
  const int64_t record = f.label_bytes + kCifarPixels;
  uint8_t* dst = s.pixels.data();
  for (size_t i = 0; i < paths.size(); ++i) {
    const std::vector<uint8_t> bytes = read_whole_file(paths[i]);
    LOOM_CHECK(static_cast<int64_t>(bytes.size()) == counts[i] * record, paths[i],
               ": changed size while being read");
    for (int64_t r = 0; r < counts[i]; ++r) {
      const uint8_t* rec = bytes.data() + r * record;
      const int64_t label = rec[f.label_index];
      LOOM_CHECK(label < f.num_classes, paths[i], ": record ", r, " has label ", label, ", expected 0..",
                 f.num_classes - 1, " for ", f.name, ": corrupt file, or a file of the other CIFAR format?");
      s.labels.push_back(label);
      std::copy(rec + f.label_bytes, rec + record, dst);
      dst += kCifarPixels;
    }
  }
  return s;
}

// Class names from a names file when it exists; it must then name every class.
std::vector<std::string> load_names(const std::string& path, const Format& f) {
  if (!is_regular_file(path)) return {};
  std::vector<std::string> names = read_lines(path);
  LOOM_CHECK(static_cast<int64_t>(names.size()) == f.num_classes, path, ": names ", names.size(),
             " classes, expected ", f.num_classes, " for ", f.name, " (one name per line)");
  return names;
}

std::string require_file(const std::string& dir, const std::string& name, const char* expected) {
  const std::string p = join_path(dir, name);
  LOOM_CHECK(is_regular_file(p), dir, ": has no ", name, "; ", expected);
  return p;
}

}  // namespace

ImageSet load_cifar10_file(const std::string& path) {
  return load_files({path}, kCifar10);
}

ImageSet load_cifar10(const std::string& dir, Split split) {
  const char* expected = "expected the CIFAR-10 binary batches data_batch_1..5.bin and test_batch.bin "
                         "(the cifar-10-batches-bin folder of cifar-10-binary.tar.gz)";
  require_directory(dir, expected);
  std::vector<std::string> paths;
  if (split == Split::train) {
    for (int i = 1; i <= 5; ++i) paths.push_back(require_file(dir, "data_batch_" + std::to_string(i) + ".bin", expected));
  } else {
    paths.push_back(require_file(dir, "test_batch.bin", expected));
  }
  ImageSet s = load_files(paths, kCifar10);
  s.class_names = load_names(join_path(dir, "batches.meta.txt"), kCifar10);
  return s;
}

ImageSet load_cifar100_file(const std::string& path, Cifar100Label which) {
  return load_files({path}, cifar100_format(which));
}

ImageSet load_cifar100(const std::string& dir, Split split, Cifar100Label which) {
  const char* expected = "expected the CIFAR-100 binary files train.bin and test.bin "
                         "(the cifar-100-binary folder of cifar-100-binary.tar.gz)";
  require_directory(dir, expected);
  const Format f = cifar100_format(which);
  ImageSet s = load_files({require_file(dir, split == Split::train ? "train.bin" : "test.bin", expected)}, f);
  s.class_names = load_names(
      join_path(dir, which == Cifar100Label::fine ? "fine_label_names.txt" : "coarse_label_names.txt"), f);
  return s;
}

}  // namespace loom::data
