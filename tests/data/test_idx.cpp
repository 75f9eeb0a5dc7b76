// IDX reader tests: plain and gzip fixtures (gzip detected by content, not name), the MNIST
// directory layout, every failure the reader promises to name, and the real Fashion-MNIST
// from Debian's dataset-fashion-mnist when it is installed.
#include <filesystem>

#include "data/idx.h"
#include "tests/data/fixtures.h"

namespace loom::data::test {
namespace {

// 3 images of 4x5, labels 0..2.
const std::vector<uint8_t> kPixels = pattern(3 * 4 * 5);
const std::vector<uint8_t> kLabels = {2, 0, 1};

void expect_fixture_images(const ImageSet& s) {
  EXPECT_EQ(s.count, 3);
  EXPECT_EQ(s.channels, 1);
  EXPECT_EQ(s.height, 4);
  EXPECT_EQ(s.width, 5);
  EXPECT_EQ(s.pixels, kPixels);
}

// Writes an MNIST-style directory; `gz` chooses .gz files.
void write_mnist_dir(const TempDir& t, const std::string& base, bool gz, const std::vector<uint8_t>& labels = kLabels) {
  const auto put = gz ? write_gzip : write_bytes;
  const std::string ext = gz ? ".gz" : "";
  put(t.file(base + "-images-idx3-ubyte" + ext), idx_bytes({3, 4, 5}, kPixels));
  put(t.file(base + "-labels-idx1-ubyte" + ext), idx_bytes({static_cast<uint32_t>(labels.size())}, labels));
}

TEST(Idx, ReadsPlainImagesAndLabels) {
  TempDir t;
  write_bytes(t.file("img"), idx_bytes({3, 4, 5}, kPixels));
  write_bytes(t.file("lab"), idx_bytes({3}, kLabels));
  expect_fixture_images(load_idx_images(t.file("img")));
  EXPECT_EQ(load_idx_labels(t.file("lab")), (std::vector<int64_t>{2, 0, 1}));
}

TEST(Idx, DetectsGzipByMagicNotName) {
  TempDir t;
  write_gzip(t.file("gzip-without-suffix"), idx_bytes({3, 4, 5}, kPixels));
  write_bytes(t.file("plain-named.gz"), idx_bytes({3, 4, 5}, kPixels));
  expect_fixture_images(load_idx_images(t.file("gzip-without-suffix")));
  expect_fixture_images(load_idx_images(t.file("plain-named.gz")));
}

TEST(Idx, LoadIdxKeepsAnyDims) {
  TempDir t;
  write_bytes(t.file("a"), idx_bytes({2, 3, 2, 1}, pattern(12)));
  const IdxArray a = load_idx(t.file("a"));
  EXPECT_EQ(a.dims, (std::vector<int64_t>{2, 3, 2, 1}));
  EXPECT_EQ(a.data, pattern(12));
}

TEST(Idx, MnistDirectoryPlainOrGzip) {
  for (bool gz : {false, true}) {
    TempDir t;
    write_mnist_dir(t, "train", gz);
    write_mnist_dir(t, "t10k", !gz);
    for (Split split : {Split::train, Split::test}) {
      const ImageSet s = load_fashion_mnist(t.path(), split);
      expect_fixture_images(s);
      EXPECT_EQ(s.labels, (std::vector<int64_t>{2, 0, 1}));
      ASSERT_EQ(s.class_names.size(), 10u);
      EXPECT_EQ(s.class_names[9], "Ankle boot");
    }
    EXPECT_EQ(load_mnist(t.path(), Split::train).class_names[3], "3");
  }
}

// ---- failures: each names the file and the problem ----------------------------------------

TEST(IdxErrors, MissingFile) {
  TempDir t;
  EXPECT_LOOM_ERROR(load_idx_images(t.file("nope")), t.file("nope"), "no such file");
}

TEST(IdxErrors, WrongMagic) {
  TempDir t;
  write_text(t.file("html"), "<html>not found</html>");
  EXPECT_LOOM_ERROR(load_idx_images(t.file("html")), t.file("html"), "not an IDX file", "3c 68 74 6d",
                    "expected 00 00 08");
}

TEST(IdxErrors, UnsupportedValueType) {
  TempDir t;
  std::vector<uint8_t> b = idx_bytes({2}, {0, 0, 0, 0, 0, 0, 0, 0});
  b[2] = 0x0D;
  write_bytes(t.file("f32"), b);
  EXPECT_LOOM_ERROR(load_idx(t.file("f32")), t.file("f32"), "float32", "not supported");
}

TEST(IdxErrors, LabelsFileGivenAsImages) {
  TempDir t;
  write_bytes(t.file("lab"), idx_bytes({3}, kLabels));
  write_bytes(t.file("img"), idx_bytes({3, 4, 5}, kPixels));
  EXPECT_LOOM_ERROR(load_idx_images(t.file("lab")), t.file("lab"), "1 dimensions", "expected 3",
                    "labels file?");
  EXPECT_LOOM_ERROR(load_idx_labels(t.file("img")), t.file("img"), "3 dimensions", "expected 1",
                    "images file?");
}

TEST(IdxErrors, TruncatedHeader) {
  TempDir t;
  write_bytes(t.file("short"), {0, 0, 8, 3, 0, 0});
  EXPECT_LOOM_ERROR(load_idx_images(t.file("short")), t.file("short"), "file ends after 6 bytes",
                    "dimension sizes");
}

TEST(IdxErrors, DimsDisagreeWithFileSize) {
  TempDir t;
  std::vector<uint8_t> b = idx_bytes({60000, 28, 28}, pattern(1000000));
  write_bytes(t.file("train-images-idx3-ubyte"), b);
  EXPECT_LOOM_ERROR(load_idx_images(t.file("train-images-idx3-ubyte")), t.file("train-images-idx3-ubyte"),
                    "header says 60000 images of 28x28 (47040000 bytes) but the file holds 1000000 bytes "
                    "after its 16-byte header: truncated download?");
  write_bytes(t.file("long"), idx_bytes({3, 4, 5}, pattern(61)));
  EXPECT_LOOM_ERROR(load_idx_images(t.file("long")), t.file("long"), "header says 3 images of 4x5 (60 bytes)",
                    "holds 61 bytes", "wrong file");
}

TEST(IdxErrors, HeaderOverCapFailsBeforeAllocating) {
  TempDir t;
  write_bytes(t.file("huge"), idx_bytes({4000000000u, 4000000000u, 4000000000u}, {}));
  EXPECT_LOOM_ERROR(load_idx_images(t.file("huge")), t.file("huge"), "4000000000 images of 4000000000x4000000000",
                    "cap");
}

TEST(IdxErrors, GzipHeaderClaimsMoreThanCanInflate) {
  TempDir t;
  write_gzip(t.file("tiny.gz"), idx_bytes({60000, 28, 28}, {}));
  EXPECT_LOOM_ERROR(load_idx_images(t.file("tiny.gz")), t.file("tiny.gz"), "47040000 bytes",
                    "inflates to at most");
}

TEST(IdxErrors, TruncatedGzip) {
  TempDir t;
  write_gzip(t.file("full.gz"), idx_bytes({300, 40, 50}, pattern(300 * 40 * 50, 13, 5)));
  std::vector<uint8_t> b = read_bytes(t.file("full.gz"));
  b.resize(b.size() / 2);
  write_bytes(t.file("half.gz"), b);
  EXPECT_LOOM_ERROR(load_idx_images(t.file("half.gz")), t.file("half.gz"), "gzip stream ended",
                    "truncated download?");
}

TEST(IdxErrors, CorruptGzipFailsToInflate) {
  TempDir t;
  write_gzip(t.file("full.gz"), idx_bytes({300, 40, 50}, pattern(300 * 40 * 50, 13, 5)));
  std::vector<uint8_t> b = read_bytes(t.file("full.gz"));
  for (size_t i = 20; i < b.size() - 8; i += 3) b[i] ^= 0x5a;
  write_bytes(t.file("bad.gz"), b);
  EXPECT_LOOM_ERROR(load_idx_images(t.file("bad.gz")), t.file("bad.gz"), "gzip data fails to inflate",
                    "zlib:", "corrupt");
}

TEST(IdxErrors, GzipChecksumMismatch) {
  TempDir t;
  // Big enough that the payload inflates straight into the caller's buffer, so the trailer's
  // CRC is checked only when the reader makes sure the stream has ended.
  write_gzip(t.file("ok.gz"), idx_bytes({300, 40, 50}, pattern(300 * 40 * 50, 13, 5)));
  std::vector<uint8_t> b = read_bytes(t.file("ok.gz"));
  b[b.size() - 8] ^= 0xff;  // the CRC-32 in the gzip trailer
  write_bytes(t.file("crc.gz"), b);
  EXPECT_LOOM_ERROR(load_idx_images(t.file("crc.gz")), t.file("crc.gz"), "fails to inflate", "incorrect data check");
}

// A file cut short by 1 to 9 bytes still inflates to every byte of data (the cut falls in
// the 8-byte trailer, or in the deflate end marker): gzip -t rejects it, and so must the
// reader, for small payloads (read in one piece) and large ones alike. A trailer whose
// length is wrong is a corrupt file too.
TEST(IdxErrors, GzipTrailerCutShortOrWrongIsRejected) {
  TempDir t;
  for (int64_t count : {3, 300}) {
    write_gzip(t.file("ok.gz"), idx_bytes({uint32_t(count), 40, 50}, pattern(size_t(count) * 40 * 50, 13, 5)));
    const std::vector<uint8_t> whole = read_bytes(t.file("ok.gz"));
    EXPECT_EQ(load_idx_images(t.file("ok.gz")).count, count);
    for (size_t cut = 1; cut <= 9; ++cut) {
      SCOPED_TRACE("images " + std::to_string(count) + ", cut " + std::to_string(cut));
      write_bytes(t.file("cut.gz"), std::vector<uint8_t>(whole.begin(), whole.end() - int64_t(cut)));
      EXPECT_LOOM_ERROR(load_idx_images(t.file("cut.gz")), t.file("cut.gz"), "truncated");
    }
    std::vector<uint8_t> wrong_length = whole;
    wrong_length[wrong_length.size() - 4] ^= 0x01;  // ISIZE, the length in the trailer
    write_bytes(t.file("len.gz"), wrong_length);
    EXPECT_LOOM_ERROR(load_idx_images(t.file("len.gz")), t.file("len.gz"), "fails to inflate");
  }
}

TEST(IdxErrors, MissingDirectory) {
  TempDir t;
  EXPECT_LOOM_ERROR(load_fashion_mnist(t.file("absent")), t.file("absent"), "no such directory",
                    "dataset-fashion-mnist");
}

TEST(IdxErrors, DirectoryWithoutFiles) {
  TempDir t;
  write_mnist_dir(t, "train", false);
  EXPECT_LOOM_ERROR(load_fashion_mnist(t.path(), Split::test), t.path(), "t10k-images-idx3-ubyte.gz");
}

TEST(IdxErrors, ImageAndLabelCountsDisagree) {
  TempDir t;
  write_mnist_dir(t, "train", false, {1, 2});
  EXPECT_LOOM_ERROR(load_mnist(t.path(), Split::train), t.file("train-labels-idx1-ubyte"), "2 labels",
                    "3 images");
}

TEST(IdxErrors, LabelOutOfRange) {
  TempDir t;
  write_mnist_dir(t, "train", true, {1, 12, 2});
  EXPECT_LOOM_ERROR(load_mnist(t.path(), Split::train), t.file("train-labels-idx1-ubyte.gz"),
                    "label 12 at index 1", "0..9");
}

// ---- the real dataset ------------------------------------------------------------------------

TEST(FashionMnist, RealDatasetWhenInstalled) {
  if (!std::filesystem::exists(kFashionMnistDir))
    GTEST_SKIP() << kFashionMnistDir << " not found; apt-get install dataset-fashion-mnist to run this test";
  const ImageSet train = load_fashion_mnist();
  const ImageSet test = load_fashion_mnist(kFashionMnistDir, Split::test);
  for (const ImageSet* s : {&train, &test}) {
    EXPECT_EQ(s->channels, 1);
    EXPECT_EQ(s->height, 28);
    EXPECT_EQ(s->width, 28);
    EXPECT_EQ(s->pixels.size(), static_cast<size_t>(s->count * 28 * 28));
    ASSERT_EQ(s->labels.size(), static_cast<size_t>(s->count));
    std::vector<int64_t> per_class(10);
    for (int64_t l : s->labels) {
      ASSERT_LT(l, 10);
      ++per_class[l];
    }
    for (int64_t n : per_class) EXPECT_EQ(n, s->count / 10);  // Fashion-MNIST is balanced
  }
  EXPECT_EQ(train.count, 60000);
  EXPECT_EQ(test.count, 10000);
}

}  // namespace
}  // namespace loom::data::test
