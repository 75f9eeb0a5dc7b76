// File plumbing shared by the readers: sizes, directory checks, and InputFile, the one place
// that knows about plain versus gzip streams. See file_io.h for why.
#include "data/file_io.h"

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "kernels/core/error.h"

namespace loom::data {

namespace fs = std::filesystem;

uint64_t file_size(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  LOOM_CHECK(fs::exists(st), path, ": no such file");
  LOOM_CHECK(!fs::is_directory(st), path, ": is a directory, expected a file");
  LOOM_CHECK(fs::is_regular_file(st), path, ": is not a regular file");
  const uintmax_t n = fs::file_size(path, ec);
  LOOM_CHECK(!ec, path, ": cannot read its size (", ec.message(), ")");
  return n;
}

bool is_regular_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

void require_directory(const std::string& path, std::string_view hint) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  LOOM_CHECK(fs::exists(st), path, ": no such directory; ", hint);
  LOOM_CHECK(fs::is_directory(st), path, ": is not a directory; ", hint);
}

std::string join_path(const std::string& dir, std::string_view name) {
  return (fs::path(dir) / fs::path(name)).string();
}

bool is_hidden(std::string_view name) { return !name.empty() && name.front() == '.'; }

std::vector<uint8_t> read_whole_file(const std::string& path) {
  const uint64_t n = file_size(path);
  std::vector<uint8_t> bytes;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  LOOM_CHECK(f != nullptr, path, ": cannot open (", std::strerror(errno), ")");
  bytes.resize(n);
  const size_t got = n ? std::fread(bytes.data(), 1, n, f) : 0;
  std::fclose(f);
  LOOM_CHECK(got == n, path, ": read ", got, " of its ", n, " bytes: file changed or unreadable");
  return bytes;
}

std::vector<std::string> read_lines(const std::string& path) {
  const std::vector<uint8_t> bytes = read_whole_file(path);
  std::vector<std::string> lines;
  std::string line;
  auto flush = [&] {
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
    if (!line.empty()) lines.push_back(line);
    line.clear();
  };
  for (uint8_t b : bytes) {
    if (b == '\n') flush();
    else line.push_back(static_cast<char>(b));
  }
  flush();
  return lines;
}

std::string hex_bytes(const uint8_t* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    if (i) s.push_back(' ');
    s.push_back(digits[p[i] >> 4]);
    s.push_back(digits[p[i] & 15]);
  }
  return s;
}

InputFile::InputFile(std::string path) : path_(std::move(path)) {
  file_bytes_ = file_size(path_);
  plain_ = std::fopen(path_.c_str(), "rb");
  LOOM_CHECK(plain_ != nullptr, path_, ": cannot open (", std::strerror(errno), ")");
  uint8_t magic[2] = {0, 0};
  const size_t got = std::fread(magic, 1, 2, plain_);
  if (got == 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
    std::fclose(plain_);
    plain_ = nullptr;
    gzFile gz = gzopen(path_.c_str(), "rb");
    LOOM_CHECK(gz != nullptr, path_, ": cannot open as gzip (", std::strerror(errno), ")");
    gzbuffer(gz, 1 << 17);
    gz_ = gz;
  } else {
    std::rewind(plain_);
  }
}

InputFile::~InputFile() {
  if (plain_) std::fclose(plain_);
  if (gz_) gzclose(static_cast<gzFile>(gz_));
}

uint64_t InputFile::max_remaining() const {
  if (!gz_) return file_bytes_ - offset_;
  const uint64_t cap = file_bytes_ * kMaxDeflateRatio;
  return cap > offset_ ? cap - offset_ : 0;
}

void InputFile::fail_inflate() {
  int err = Z_OK;
  std::string msg = gzerror(static_cast<gzFile>(gz_), &err);
  if (msg.starts_with(path_ + ": ")) msg.erase(0, path_.size() + 2);  // zlib prefixes the path
  LOOM_FAIL(path_, ": gzip data fails to inflate (zlib: ", msg,
            "): the file is corrupt; download it again");
}

size_t InputFile::read_some(void* dst, size_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  size_t done = 0;
  if (plain_) {
    done = n ? std::fread(out, 1, n, plain_) : 0;
    LOOM_CHECK(!std::ferror(plain_), path_, ": read error after ", offset_ + done, " bytes (",
               std::strerror(errno), ")");
  } else {
    auto* gz = static_cast<gzFile>(gz_);
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
      const int got = gzread(gz, out + done, chunk);
      if (got < 0) fail_inflate();
      crc_ = crc32(crc_, out + done, static_cast<unsigned>(got));
      done += static_cast<size_t>(got);
      if (static_cast<unsigned>(got) < chunk) break;
    }
    if (done < n) {
      // A short read is either a clean end of stream or a stream that stopped mid-way; zlib
      // reports the latter as Z_BUF_ERROR ("unexpected end of file"), which is a truncation.
      int err = Z_OK;
      gzerror(gz, &err);
      if (err != Z_OK && err != Z_BUF_ERROR) fail_inflate();
    }
  }
  offset_ += done;
  return done;
}

void InputFile::read(void* dst, size_t n, std::string_view what) {
  const uint64_t start = offset_;
  const size_t got = read_some(dst, n);
  if (got == n) return;
  if (gz_) {
    LOOM_FAIL(path_, ": gzip stream ended after ", start + got, " inflated bytes, in the middle of ",
              what, " (needed ", n, " bytes at offset ", start, "): truncated download?");
  }
  LOOM_FAIL(path_, ": file ends after ", start + got, " bytes, in the middle of ", what,
            " (needed ", n, " bytes at offset ", start, "): truncated download?");
}

void InputFile::check_gzip_trailer() {
  uint8_t t[8] = {};
  std::FILE* f = std::fopen(path_.c_str(), "rb");
  LOOM_CHECK(f != nullptr, path_, ": cannot open again to read its gzip trailer (", std::strerror(errno), ")");
  const bool read = file_bytes_ >= 18 && std::fseek(f, -8, SEEK_END) == 0 && std::fread(t, 1, 8, f) == 8;
  std::fclose(f);
  const uint32_t crc = uint32_t(t[0]) | uint32_t(t[1]) << 8 | uint32_t(t[2]) << 16 | uint32_t(t[3]) << 24;
  const uint32_t length = uint32_t(t[4]) | uint32_t(t[5]) << 8 | uint32_t(t[6]) << 16 | uint32_t(t[7]) << 24;
  LOOM_CHECK(read && crc == uint32_t(crc_) && length == uint32_t(offset_), path_,
             ": the gzip trailer (CRC-32 and length, its last 8 bytes) does not match the ", offset_,
             " bytes it inflates to: the file is truncated or corrupt (gzip -t rejects it too); download it again");
}

void InputFile::expect_end(std::string_view expected) {
  uint8_t probe[64];
  const size_t got = read_some(probe, sizeof probe);
  if (got == 0 && gz_) check_gzip_trailer();
  if (got == 0) return;
  if (plain_) {
    LOOM_FAIL(path_, ": holds ", file_bytes_, " bytes, more than expected (", expected,
              "): wrong file, or a header that does not describe it?");
  }
  LOOM_FAIL(path_, ": gzip stream holds more than expected (", expected,
            "): wrong file, or a header that does not describe it?");
}

}  // namespace loom::data
