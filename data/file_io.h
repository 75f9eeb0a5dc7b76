// File plumbing shared by the readers. Every binary reader opens its input through InputFile,
// which detects gzip by its 1f 8b magic (never by the file name) and knows the most bytes the
// stream can still hold, so a reader can check what a header claims before allocating for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

// Deflate cannot compress better than about 1032:1, so a gzip file of n bytes inflates to at
// most this many times n; a header announcing more is corrupt (or the file is truncated).
inline constexpr uint64_t kMaxDeflateRatio = 1032;

// Size of a regular file (symlinks followed). Throws naming the path when it is missing,
// a directory, or unreadable.
uint64_t file_size(const std::string& path);
bool is_regular_file(const std::string& path);
// Throws "<path>: no such directory" (plus `hint`, which says what belongs there) unless
// `path` is a directory.
void require_directory(const std::string& path, std::string_view hint);
std::string join_path(const std::string& dir, std::string_view name);
// True for names that start with '.', which every directory walk skips.
bool is_hidden(std::string_view name);
// Reads a whole file (its size comes from the filesystem, not from anything the file says).
std::vector<uint8_t> read_whole_file(const std::string& path);
// Non-empty lines of a small text file, trailing whitespace and '\r' removed.
std::vector<std::string> read_lines(const std::string& path);
// "1f 8b 08 00" for error messages.
std::string hex_bytes(const uint8_t* p, size_t n);

class InputFile {
 public:
  explicit InputFile(std::string path);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  const std::string& path() const { return path_; }
  bool is_gzip() const { return gz_ != nullptr; }
  uint64_t file_bytes() const { return file_bytes_; }
  // Bytes of the (inflated) stream consumed so far.
  uint64_t offset() const { return offset_; }
  // Upper bound on the bytes still to come: exact for a plain file; for gzip, the deflate
  // ratio limit applied to the compressed size.
  uint64_t max_remaining() const;

  // Reads exactly n bytes; throws naming the file and `what` when the stream ends first or
  // fails to inflate.
  void read(void* dst, size_t n, std::string_view what);
  // Throws unless the stream is exhausted. For gzip it also compares the file's last 8 bytes,
  // the trailer (CRC-32 and length), with the data read: zlib checks a trailer that is there,
  // but says nothing when the file ends before it, so a file cut short by a few bytes would
  // otherwise read as whole. (A file of several concatenated gzip members fails this check:
  // recompress it as one.)
  // `expected` describes what the file should have held, for the message.
  void expect_end(std::string_view expected);

 private:
  size_t read_some(void* dst, size_t n);
  [[noreturn]] void fail_inflate();
  void check_gzip_trailer();

  std::string path_;
  uint64_t file_bytes_ = 0;
  uint64_t offset_ = 0;
  unsigned long crc_ = 0;  // CRC-32 of the inflated bytes so far
  std::FILE* plain_ = nullptr;
  void* gz_ = nullptr;  // gzFile; kept opaque so this header does not pull in zlib.h
};

}  // namespace loom::data
