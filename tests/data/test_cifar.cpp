// CIFAR-10/100 binary reader tests on records written at run time: layout (records are already
// channels-first), batch order, class names, and each failure naming the file.
#include "data/cifar.h"
#include "tests/data/fixtures.h"

namespace loom::data::test {
namespace {

// `n` records, each label bytes `labels(i)` then pixels pattern(3072, 1, seed + i).
std::vector<uint8_t> records(int n, const std::function<std::vector<uint8_t>(int)>& labels, int seed) {
  std::vector<uint8_t> out;
  for (int i = 0; i < n; ++i) {
    const std::vector<uint8_t> l = labels(i);
    const std::vector<uint8_t> px = pattern(kCifarPixels, 1, seed + i);
    out.insert(out.end(), l.begin(), l.end());
    out.insert(out.end(), px.begin(), px.end());
  }
  return out;
}

std::vector<uint8_t> cifar10_records(int n, int seed) {
  return records(n, [](int i) { return std::vector<uint8_t>{static_cast<uint8_t>(i % 10)}; }, seed);
}

std::string lines(int n, const std::string& prefix) {
  std::string s;
  for (int i = 0; i < n; ++i) s += prefix + std::to_string(i) + "\r\n";
  return s + "\n";
}

TEST(Cifar, ReadsCifar10BatchChannelsFirst) {
  TempDir t;
  write_bytes(t.file("b.bin"), cifar10_records(4, 100));
  const ImageSet s = load_cifar10_file(t.file("b.bin"));
  EXPECT_EQ(s.count, 4);
  EXPECT_EQ(s.channels, 3);
  EXPECT_EQ(s.height, 32);
  EXPECT_EQ(s.width, 32);
  EXPECT_EQ(s.labels, (std::vector<int64_t>{0, 1, 2, 3}));
  // Record 2's pixel bytes are (i + 102) mod 256; pixel (c=1, y=0, x=5) is byte 1024 + 5.
  EXPECT_EQ(s.image(2)[1 * 1024 + 5], static_cast<uint8_t>(1029 + 102));
  EXPECT_TRUE(s.class_names.empty());
}

TEST(Cifar, Cifar10DirectoryConcatenatesBatchesInOrderWithNames) {
  TempDir t;
  for (int b = 1; b <= 5; ++b) write_bytes(t.file("data_batch_" + std::to_string(b) + ".bin"), cifar10_records(2, b * 10));
  write_bytes(t.file("test_batch.bin"), cifar10_records(3, 0));
  write_text(t.file("batches.meta.txt"), lines(10, "class"));
  const ImageSet train = load_cifar10(t.path(), Split::train);
  EXPECT_EQ(train.count, 10);
  EXPECT_EQ(train.image(8)[0], 50);  // batch 5, record 0
  EXPECT_EQ(train.image(9)[0], 51);
  ASSERT_EQ(train.class_names.size(), 10u);
  EXPECT_EQ(train.class_names[7], "class7");
  EXPECT_EQ(load_cifar10(t.path(), Split::test).count, 3);
}

TEST(Cifar, Cifar100FineAndCoarse) {
  TempDir t;
  auto labels = [](int i) { return std::vector<uint8_t>{static_cast<uint8_t>(19 - i), static_cast<uint8_t>(90 + i)}; };
  write_bytes(t.file("train.bin"), records(3, labels, 7));
  write_text(t.file("fine_label_names.txt"), lines(100, "fine"));
  const ImageSet fine = load_cifar100(t.path(), Split::train);
  EXPECT_EQ(fine.labels, (std::vector<int64_t>{90, 91, 92}));
  EXPECT_EQ(fine.class_names[99], "fine99");
  const ImageSet coarse = load_cifar100(t.path(), Split::train, Cifar100Label::coarse);
  EXPECT_EQ(coarse.labels, (std::vector<int64_t>{19, 18, 17}));
  EXPECT_TRUE(coarse.class_names.empty());
  EXPECT_EQ(coarse.image(1)[0], 8);
}

TEST(CifarErrors, TruncatedFile) {
  TempDir t;
  std::vector<uint8_t> b = cifar10_records(3, 0);
  b.erase(b.end() - 100, b.end());
  write_bytes(t.file("data_batch_1.bin"), b);
  EXPECT_LOOM_ERROR(load_cifar10_file(t.file("data_batch_1.bin")), t.file("data_batch_1.bin"), "9119 bytes",
                    "not a whole number", "3073 bytes", "truncated");
}

TEST(CifarErrors, Cifar100FileReadAsCifar10) {
  TempDir t;
  write_bytes(t.file("train.bin"), records(3, [](int) { return std::vector<uint8_t>{1, 2}; }, 0));
  EXPECT_LOOM_ERROR(load_cifar10_file(t.file("train.bin")), t.file("train.bin"), "other CIFAR format");
}

TEST(CifarErrors, EmptyFile) {
  TempDir t;
  write_bytes(t.file("test_batch.bin"), {});
  EXPECT_LOOM_ERROR(load_cifar10_file(t.file("test_batch.bin")), t.file("test_batch.bin"), "is empty");
}

TEST(CifarErrors, LabelOutOfRange) {
  TempDir t;
  write_bytes(t.file("test.bin"), records(2, [](int i) { return std::vector<uint8_t>{3, static_cast<uint8_t>(99 + i)}; }, 0));
  EXPECT_LOOM_ERROR(load_cifar100_file(t.file("test.bin")), t.file("test.bin"), "record 1 has label 100",
                    "0..99");
}

TEST(CifarErrors, MissingBatchNamed) {
  TempDir t;
  for (int b = 1; b <= 4; ++b) write_bytes(t.file("data_batch_" + std::to_string(b) + ".bin"), cifar10_records(1, 0));
  EXPECT_LOOM_ERROR(load_cifar10(t.path(), Split::train), t.path(), "no data_batch_5.bin");
}

TEST(CifarErrors, TruncatedLaterBatchFailsFirst) {
  TempDir t;
  for (int b = 1; b <= 5; ++b) write_bytes(t.file("data_batch_" + std::to_string(b) + ".bin"), cifar10_records(b == 5 ? 0 : 1, 0));
  EXPECT_LOOM_ERROR(load_cifar10(t.path(), Split::train), t.file("data_batch_5.bin"), "is empty");
}

TEST(CifarErrors, MissingDirectory) {
  TempDir t;
  EXPECT_LOOM_ERROR(load_cifar100(t.file("gone"), Split::test), t.file("gone"), "no such directory",
                    "test.bin");
}

TEST(CifarErrors, NamesFileWithWrongCount) {
  TempDir t;
  write_bytes(t.file("test_batch.bin"), cifar10_records(1, 0));
  write_text(t.file("batches.meta.txt"), lines(9, "c"));
  EXPECT_LOOM_ERROR(load_cifar10(t.path(), Split::test), t.file("batches.meta.txt"), "names 9 classes",
                    "expected 10");
}

}  // namespace
}  // namespace loom::data::test
