// Fixture writers for the data tests. stb_image_write is compiled in here, static, when present,
// so the tests can build tiny PNG/BMP/JPEG files at run time instead of shipping binaries.
#include "tests/data/fixtures.h"

#include <stdlib.h>
#include <zlib.h>

#include <cctype>
#include <filesystem>
#include <fstream>

#include "kernels/core/error.h"

#if LOOM_DATA_WITH_STB_IMAGE_WRITE
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wsign-compare"
#define STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_image_write.h>
#pragma GCC diagnostic pop
#endif

namespace loom::data::test {

namespace fs = std::filesystem;

TempDir::TempDir() {
  std::string tmpl = (fs::temp_directory_path() / "loom_data_XXXXXX").string();
  const char* made = mkdtemp(tmpl.data());
  if (made == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
  path_ = made;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

std::string TempDir::file(const std::string& name) const {
  const fs::path p = fs::path(path_) / name;
  fs::create_directories(p.parent_path());
  return p.string();
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write fixture " + path);
}

void write_text(const std::string& path, const std::string& text) {
  write_bytes(path, std::vector<uint8_t>(text.begin(), text.end()));
}

void write_gzip(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb9");
  if (f == nullptr) throw std::runtime_error("cannot gzopen fixture " + path);
  const int n = bytes.empty() ? 0 : gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  if (gzclose(f) != Z_OK || n != static_cast<int>(bytes.size()))
    throw std::runtime_error("cannot gzwrite fixture " + path);
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(d >> shift));
  }
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<uint8_t> pattern(size_t n, int mul, int add) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * mul + add);
  return v;
}

ImageSet synthetic_images(int64_t count, int64_t channels, int64_t height, int64_t width) {
  ImageSet set;
  set.count = count;
  set.channels = channels;
  set.height = height;
  set.width = width;
  set.pixels = pattern(static_cast<size_t>(count * channels * height * width), 37, 11);
  for (int64_t i = 0; i < count; ++i) set.labels.push_back(i % 10);
  return set;
}

bool write_image(const std::string& path, int height, int width, int channels,
                 const std::vector<uint8_t>& hwc) {
#if LOOM_DATA_WITH_STB_IMAGE_WRITE
  std::string ext = fs::path(path).extension().string();
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  int ok = 0;
  if (ext == ".png") ok = stbi_write_png(path.c_str(), width, height, channels, hwc.data(), width * channels);
  else if (ext == ".bmp") ok = stbi_write_bmp(path.c_str(), width, height, channels, hwc.data());
  else if (ext == ".jpg") ok = stbi_write_jpg(path.c_str(), width, height, channels, hwc.data(), 95);
  if (!ok) throw std::runtime_error("cannot write image fixture " + path);
  return true;
#else
  return false;
#endif
}

void expect_error(const std::function<void()>& call, const std::vector<std::string>& parts,
                  const char* file, int line) {
  ::testing::ScopedTrace trace(file, line, "EXPECT_LOOM_ERROR");
  try {
    call();
  } catch (const loom::Error& e) {
    const std::string msg = e.what();
    for (const std::string& part : parts) {
      EXPECT_NE(msg.find(part), std::string::npos) << "message lacks \"" << part << "\":\n  " << msg;
    }
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected loom::Error, got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected loom::Error, but the call returned normally";
}

}  // namespace loom::data::test
