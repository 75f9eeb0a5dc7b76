// Shared helpers for the data tests: a temp directory per test, writers for fixture files
// (plain, gzip, IDX, images), and EXPECT_LOOM_ERROR, which asserts that a call throws
// loom::Error whose message contains each given piece (the file path and the problem).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/data_config.h"
#include "data/image_set.h"

namespace loom::data::test {

class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  // path()/name, creating the parent folders of name.
  std::string file(const std::string& name) const;

 private:
  std::string path_;
};

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes);
void write_text(const std::string& path, const std::string& text);
void write_gzip(const std::string& path, const std::vector<uint8_t>& bytes);
std::vector<uint8_t> read_bytes(const std::string& path);

// An unsigned-byte IDX file's bytes: magic 00 00 08 ndims, big-endian dims, then `data`.
std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data);
// n bytes with the pattern (i * mul + add) mod 256.
std::vector<uint8_t> pattern(size_t n, int mul = 7, int add = 3);

// count images of (channels, height, width) with varied pixels (pattern(.., 37, 11)) and
// labels i % 10, for the dataset and loader tests.
ImageSet synthetic_images(int64_t count, int64_t channels, int64_t height, int64_t width);

// Writes an image of (height, width, channels) interleaved pixels, in the format named by the
// extension (.png, .bmp, .jpg). Returns false when Loom's build has no stb_image_write.
bool write_image(const std::string& path, int height, int width, int channels,
                 const std::vector<uint8_t>& hwc);
inline constexpr bool kCanWriteImages = LOOM_DATA_WITH_STB_IMAGE && LOOM_DATA_WITH_STB_IMAGE_WRITE;

void expect_error(const std::function<void()>& call, const std::vector<std::string>& parts,
                  const char* file, int line);

}  // namespace loom::data::test

#define EXPECT_LOOM_ERROR(call, ...) \
  ::loom::data::test::expect_error([&] { (void)(call); }, {__VA_ARGS__}, __FILE__, __LINE__)
