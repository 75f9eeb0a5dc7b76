// Safetensors read/write: a small strict JSON reader and writer for exactly the header's
// subset (objects, strings with escapes, arrays of non-negative integers), the atomic
// file replacement behind every save, and the checks a file must pass before any number in
// it is trusted.
//
// Decisions: the header may list tensors in any order, but their byte ranges must tile
// the buffer exactly (no hole, no overlap, nothing left over), as the reference
// implementation requires. Keys other than dtype, shape and data_offsets in a tensor's
// entry are rejected rather than ignored, so a format extension fails loudly instead of
// being misread. "__metadata__" is written first and only when there is metadata, as the
// Python library does. The file is fsynced before the rename and its directory after it:
// that is the order in which the rename itself becomes durable.
#include "engine/serialization.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <optional>
#include <set>
#include <string_view>
#include <utility>

namespace loom {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian bytes; Loom copies them as they are");

namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's limit
constexpr std::string_view kMetadataKey = "__metadata__";
constexpr const char* kDTypeList = "F32, F64, BF16, F16, I32, I64, U8";

struct DTypeName {
  DType dtype;
  std::string_view name;
};
constexpr DTypeName kDTypes[] = {{DType::f32, "F32"}, {DType::f64, "F64"}, {DType::bf16, "BF16"}, {DType::f16, "F16"},
                                 {DType::i32, "I32"}, {DType::i64, "I64"}, {DType::u8, "U8"}};

std::string_view safetensors_name(DType t) {
  for (const DTypeName& d : kDTypes)
    if (d.dtype == t) return d.name;
  LOOM_ASSERT(false, "dtype ", dtype_name(t), " has no safetensors name");
}

std::optional<DType> safetensors_dtype(std::string_view name) {
  for (const DTypeName& d : kDTypes)
    if (d.name == name) return d.dtype;
  return std::nullopt;
}

// ---- JSON writer ------------------------------------------------------------------

// JSON's two-character escapes: kEscaped[i] is written as '\\' kEscapeCode[i].
constexpr std::string_view kEscaped = "\"\\\n\r\t\b\f", kEscapeCode = "\"\\nrtbf";

void append_string(std::string& out, std::string_view s) {
  out += '"';
  for (unsigned char c : s) {
    if (size_t i = kEscaped.find(char(c)); i != std::string_view::npos) {
      out += '\\';
      out += kEscapeCode[i];
    } else if (c < 0x20) {
      out += "\\u00";
      out += "0123456789abcdef"[c >> 4];
      out += "0123456789abcdef"[c & 15];
    } else {
      out += char(c);
    }
  }
  out += '"';
}

void append_uint(std::string& out, uint64_t v) {
  char buf[24];
  out.append(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

// The header JSON, padded with spaces to a multiple of 8 bytes so the buffer is aligned.
std::string make_header(const std::vector<std::pair<std::string, Tensor>>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::string h = "{";
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (auto it = metadata.begin(); it != metadata.end(); ++it) {
      if (it != metadata.begin()) h += ',';
      append_string(h, it->first);
      h += ':';
      append_string(h, it->second);
    }
    h += '}';
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (h.size() > 1) h += ',';
    append_string(h, name);
    h += ":{\"dtype\":";
    append_string(h, safetensors_name(t.dtype()));
    h += ",\"shape\":[";
    for (int d = 0; d < t.dim(); ++d) {
      if (d) h += ',';
      append_uint(h, uint64_t(t.shape()[d]));
    }
    h += "],\"data_offsets\":[";
    append_uint(h, offset);
    h += ',';
    offset += t.nbytes();
    append_uint(h, offset);
    h += "]}";
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  return h;
}

// ---- JSON reader ------------------------------------------------------------------

struct Entry {
  std::string name, dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<Entry> entries;  // in the header's order
  std::map<std::string, std::string> metadata;
};

// Recursive descent over the header's schema. Every error names the byte at which it was
// found; content errors (a duplicate, unknown or missing key) name the key too.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, std::string where) : text_(text), where_(std::move(where)) {}

  Header parse() {
    Header h;
    parse_object("the header", [&](const std::string& key) {
      if (key == kMetadataKey)
        parse_object("__metadata__", [&](const std::string& k) {
          h.metadata[k] = parse_string("the value of metadata key '" + k + "' (metadata values are strings)");
        });
      else
        h.entries.push_back(parse_entry(key));
    });
    skip_ws();
    if (pos_ != text_.size()) fail("expected only space padding after the header's closing '}', found " + found());
    return h;
  }

 private:
  // `kind` is "JSON" for syntax errors and "content" for valid JSON that breaks the schema.
  [[noreturn]] void fail(const std::string& what, const char* kind = "JSON") const {
    LOOM_FAIL(where_, "invalid header ", kind, " at byte ", pos_, " of the header (file offset ", pos_ + 8,
              "): ", what);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  std::string found() const {
    if (at_end()) return "the end of the header";
    unsigned char c = text_[pos_];
    if (c >= 0x20 && c < 0x7f) return std::string("'") + char(c) + "'";
    return "byte " + std::to_string(int(c));
  }
  void skip_ws() {
    while (!at_end() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }
  // True (and consumes it) when the next non-space character is c.
  bool accept(char c) {
    skip_ws();
    if (at_end() || text_[pos_] != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c, const std::string& expected) {
    if (!accept(c)) fail("expected " + expected + ", found " + found());
  }

  // { "key": value, ... } with unique keys; `member(key)` parses each value.
  template <class F>
  void parse_object(const std::string& what, F&& member) {
    expect('{', "'{' to open " + what);
    if (accept('}')) return;
    std::set<std::string> keys;
    do {
      skip_ws();
      size_t at = pos_;
      std::string key = parse_string("a key of " + what);
      if (!keys.insert(key).second) {
        pos_ = at;
        fail("duplicate key '" + key + "' in " + what + ": each name may appear only once", "content");
      }
      expect(':', "':' after the key '" + key + "'");
      member(key);
    } while (accept(','));
    expect('}', "',' or '}' in " + what);
  }

  std::string parse_string(const std::string& what) {
    skip_ws();
    if (at_end() || text_[pos_] != '"') fail("expected a string for " + what + ", found " + found());
    ++pos_;
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string in " + what);
      unsigned char c = text_[pos_];
      if (c == '"') break;
      if (c < 0x20)
        fail("raw control character (byte " + std::to_string(int(c)) + ") in a string: JSON needs it escaped");
      ++pos_;
      if (c != '\\') {
        out += char(c);
        continue;
      }
      if (at_end()) fail("unterminated string in " + what);
      char e = text_[pos_++];
      if (size_t i = kEscapeCode.find(e); i != std::string_view::npos) {
        out += kEscaped[i];
      } else if (e == '/') {
        out += '/';
      } else if (e == 'u') {
        append_utf8(out, parse_code_point());
      } else {
        pos_ -= 2;
        fail("invalid escape '\\" + std::string(1, e) + "' in a string");
      }
    }
    ++pos_;
    return out;
  }

  uint32_t parse_hex4() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i, ++pos_) {
      char c = at_end() ? '\0' : text_[pos_];
      int d = c >= '0' && c <= '9'   ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                     : -1;
      if (d < 0) fail("expected four hex digits after '\\u', found " + found());
      v = v * 16 + uint32_t(d);
    }
    return v;
  }
  uint32_t parse_code_point() {
    uint32_t cp = parse_hex4();
    if (cp >= 0xDC00 && cp <= 0xDFFF) fail("a low surrogate '\\u' escape without a high surrogate before it");
    if (cp < 0xD800 || cp > 0xDBFF) return cp;
    if (text_.substr(pos_, 2) != "\\u") fail("a high surrogate '\\u' escape must be followed by a low surrogate");
    pos_ += 2;
    uint32_t low = parse_hex4();
    if (low < 0xDC00 || low > 0xDFFF) fail("a high surrogate '\\u' escape must be followed by a low surrogate");
    return 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
  }
  static void append_utf8(std::string& out, uint32_t cp) {
    static constexpr unsigned char kLead[] = {0, 0, 0xC0, 0xE0, 0xF0};
    int n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    out += char(n == 1 ? cp : kLead[n] | (cp >> (6 * (n - 1))));
    for (int i = n - 2; i >= 0; --i) out += char(0x80 | ((cp >> (6 * i)) & 0x3F));
  }

  uint64_t parse_uint(const std::string& what) {
    skip_ws();
    auto digit = [&] { return !at_end() && text_[pos_] >= '0' && text_[pos_] <= '9'; };
    if (!digit()) fail("expected a non-negative integer for " + what + ", found " + found());
    size_t start = pos_;
    uint64_t v = 0;
    while (digit()) {
      if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, uint64_t(text_[pos_] - '0'), &v)) {
        pos_ = start;
        fail("the number for " + what + " does not fit in 64 bits");
      }
      ++pos_;
    }
    if (pos_ - start > 1 && text_[start] == '0') {
      pos_ = start;
      fail("a number with a leading zero for " + what + " (JSON forbids it)");
    }
    if (!at_end() && (text_[pos_] == '.' || text_[pos_] == 'e' || text_[pos_] == 'E'))
      fail("expected an integer for " + what + ", found a fraction or exponent");
    return v;
  }

  std::vector<uint64_t> parse_uint_array(const std::string& what) {
    expect('[', "'[' to open " + what);
    std::vector<uint64_t> out;
    if (accept(']')) return out;
    do out.push_back(parse_uint("an element of " + what));
    while (accept(','));
    expect(']', "',' or ']' in " + what);
    return out;
  }

  Entry parse_entry(const std::string& name) {
    Entry e;
    e.name = name;
    std::string what = "tensor '" + name + "'";
    size_t at = pos_;
    std::set<std::string> seen;
    parse_object(what, [&](const std::string& key) {
      seen.insert(key);
      if (key == "dtype") {
        e.dtype = parse_string("the dtype of " + what);
      } else if (key == "shape") {
        e.shape = parse_uint_array("the shape of " + what);
      } else if (key == "data_offsets") {
        size_t offsets_at = pos_;
        std::vector<uint64_t> o = parse_uint_array("the data_offsets of " + what);
        if (o.size() != 2) {
          pos_ = offsets_at;
          fail(
              "the data_offsets of " + what + " hold " + std::to_string(o.size()) + " numbers; expected 2 [begin, end]",
              "content");
        }
        e.begin = o[0];
        e.end = o[1];
      } else {
        fail("unknown key '" + key + "' in " + what + " (expected dtype, shape and data_offsets)", "content");
      }
    });
    for (const char* key : {"dtype", "shape", "data_offsets"}) {
      if (seen.count(key)) continue;
      pos_ = at;
      fail(what + " has no '" + key + "' (expected dtype, shape and data_offsets)", "content");
    }
    return e;
  }

  std::string_view text_;
  std::string where_;
  size_t pos_ = 0;
};

// ---- files ------------------------------------------------------------------------

// The caller passes errno first, so no argument built before it can overwrite it.
template <class... Parts>
[[noreturn]] void fail_os(int err, const Parts&... parts) {
  LOOM_FAIL(parts..., ": ", std::strerror(err));
}

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void read_exact(int fd, void* data, uint64_t n, uint64_t offset, const std::string& where, const std::string& what) {
  auto p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, std::min<uint64_t>(n, uint64_t(1) << 30), off_t(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail_os(errno, where, "reading ", what, " failed");
    LOOM_CHECK(r > 0, where, "the file ended while reading ", what, ": was it truncated while being read?");
    p += r;
    n -= uint64_t(r);
    offset += uint64_t(r);
  }
}

void write_all(int fd, const void* data, size_t n, const std::string& where, const std::string& tmp) {
  auto p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail_os(w < 0 ? errno : EIO, where, "writing '", tmp, "' failed");
    p += w;
    n -= size_t(w);
  }
}

// ---- atomic replacement -------------------------------------------------------------

std::string parent_dir(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a fifo";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Removes "<target>.tmp-<pid>" files whose pid no longer runs: saves that were killed. A
// live pid (this process's, or another save in progress) keeps its file. Pids are only
// meaningful on this host and in this pid namespace, which is where a save runs.
void remove_dead_leftovers(const std::string& target) {
  const std::string dir = parent_dir(target);
  const std::string prefix = target.substr(target.rfind('/') + 1) + ".tmp-";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;  // creating the temporary file will say what is wrong
  std::vector<std::pair<std::string, long>> dead;
  while (dirent* e = ::readdir(d)) {
    std::string_view name = e->d_name;
    if (!name.starts_with(prefix)) continue;
    std::string_view digits = name.substr(prefix.size());
    long pid = 0;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
    if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() || pid <= 0) continue;
    if (pid == long(::getpid()) || ::kill(pid_t(pid), 0) == 0 || errno != ESRCH) continue;
    dead.emplace_back(std::string(name), pid);
  }
  ::closedir(d);
  for (const auto& [name, pid] : dead) {
    const std::string leftover = dir + "/" + name;
    struct stat st {};
    if (::lstat(leftover.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::unlink(leftover.c_str()) == 0)
      std::fprintf(stderr, "loom: removed '%s' (%lld bytes), left by process %ld, which no longer runs: a save to '%s' "
                   "that was killed before it finished\n",
                   leftover.c_str(), (long long)st.st_size, pid, target.c_str());
  }
}

// The tensors' byte ranges, sorted, must tile [0, buffer_size) exactly.
void check_coverage(const std::vector<Entry>& entries, uint64_t buffer_size, const std::string& where) {
  std::vector<const Entry*> order;
  for (const Entry& e : entries) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return std::pair(a->begin, a->end) < std::pair(b->begin, b->end);
  });
  uint64_t cursor = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : order) {
    LOOM_CHECK(e->begin >= cursor, where, "tensor '", e->name, "' (bytes [", e->begin, ", ", e->end,
               ")) overlaps tensor '", prev->name, "' (bytes [", prev->begin, ", ", prev->end,
               ")): each byte of the data buffer must belong to exactly one tensor");
    LOOM_CHECK(e->begin == cursor, where, "bytes [", cursor, ", ", e->begin, ") of the data buffer, before tensor '",
               e->name, "', belong to no tensor: safetensors requires the tensors to cover the buffer without holes");
    cursor = e->end;
    prev = e;
  }
  LOOM_CHECK(
      cursor == buffer_size, where, "bytes [", cursor, ", ", buffer_size,
      ") at the end of the data buffer belong to no tensor: safetensors requires the tensors to cover it exactly");
}

// Checks an entry against the buffer and returns its dtype and shape.
std::pair<DType, Shape> check_entry(const Entry& e, uint64_t buffer_size, const std::string& where) {
  std::string what = "tensor '" + e.name + "'";
  std::optional<DType> dtype = safetensors_dtype(e.dtype);
  LOOM_CHECK(dtype, where, what, " has dtype '", e.dtype, "', which Loom does not read (expected one of ", kDTypeList,
             ")");
  LOOM_CHECK(e.shape.size() <= 8, where, what, " has ", e.shape.size(), " dimensions; Loom tensors have at most 8");
  Shape shape;
  uint64_t bytes = dtype_size(*dtype);
  bool overflow = false;
  for (uint64_t d : e.shape) {
    overflow = overflow || d > uint64_t(INT64_MAX) || __builtin_mul_overflow(bytes, d, &bytes);
    shape.push_back(int64_t(std::min<uint64_t>(d, INT64_MAX)));
  }
  LOOM_CHECK(!overflow && bytes <= uint64_t(INT64_MAX), where, what, " has a shape whose size overflows 64 bits");
  LOOM_CHECK(e.begin <= e.end, where, what, " has data_offsets [", e.begin, ", ", e.end,
             "] that end before they begin (expected begin <= end)");
  LOOM_CHECK(e.end - e.begin == bytes, where, what, " of dtype ", e.dtype, " and shape ", shape_str(shape), " needs ",
             bytes, " bytes, but its data_offsets [", e.begin, ", ", e.end, "] span ", e.end - e.begin);
  LOOM_CHECK(e.end <= buffer_size, where, what, " has data_offsets [", e.begin, ", ", e.end,
             "] outside the data buffer, which holds ", buffer_size, " bytes: the file is truncated or corrupt");
  return {*dtype, shape};
}

}  // namespace

std::string resolve_output_path(const std::string& path) {
  LOOM_CHECK(!path.empty(), "an empty path names no file to write");
  std::string p = path;
  for (int links = 0;; ++links) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0) {
      if (errno == ENOENT) return p;  // a new file; its directory is checked when it is created
      fail_os(errno, "'", path, "'", p == path ? "" : " (a link to '" + p + "')", ": cannot look at it");
    }
    if (S_ISLNK(st.st_mode)) {
      LOOM_CHECK(links < 40, "'", path, "': too many levels of symbolic links");
      std::string link(size_t(st.st_size > 0 ? st.st_size : 4096) + 1, '\0');
      ssize_t n = ::readlink(p.c_str(), link.data(), link.size());
      if (n < 0) fail_os(errno, "'", path, "': cannot read the symbolic link '", p, "'");
      link.resize(size_t(n));
      p = link.starts_with('/') || p.find('/') == std::string::npos ? link : parent_dir(p) + "/" + link;
      continue;
    }
    LOOM_CHECK(S_ISREG(st.st_mode), "'", path, "'", p == path ? "" : " (a link to '" + p + "')", " is ",
               file_kind(st.st_mode), ", not a regular file: nothing was written; give the path of a file");
    return p;
  }
}

void check_output_path(const std::string& path, const std::string& flag) {
  const std::string named = flag.empty() ? "'" + path + "'" : flag + " " + path;
  std::string target;
  try {
    target = resolve_output_path(path);
  } catch (const Error& e) {
    LOOM_FAIL(flag.empty() ? "" : flag + ": ", e.what());
  }
  const std::string probe = target + ".probe-" + std::to_string(::getpid());
  Fd fd{::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600)};
  if (fd.fd < 0) {
    const int err = errno;
    const std::string dir = parent_dir(target);
    struct stat dir_st {};
    if (err == ENOENT && ::stat(dir.c_str(), &dir_st) != 0)
      LOOM_FAIL(named, ": the directory '", dir, "' does not exist: create it first");
    fail_os(err, named, ": cannot create a file in '", dir, "' (tried '", probe,
            "'): choose a directory this user can write to");
  }
  ::unlink(probe.c_str());
}

AtomicFile::AtomicFile(const std::string& path, std::string where)
    : where_(where.empty() ? "'" + path + "': " : std::move(where)) {
  try {
    target_ = resolve_output_path(path);
  } catch (const Error& e) {
    LOOM_FAIL(where_, e.what());
  }
  remove_dead_leftovers(target_);
  tmp_ = target_ + ".tmp-" + std::to_string(::getpid());
  ::unlink(tmp_.c_str());  // an earlier process's with the same pid, or this one's
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (fd_ < 0) fail_os(errno, where_, "cannot create the temporary file '", tmp_, "'");
  // The new file takes the old one's permissions and, where this user may, its owner.
  struct stat st {};
  if (::stat(target_.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    if (::fchmod(fd_, st.st_mode & 07777) != 0) {
      const int err = errno;
      ::close(std::exchange(fd_, -1));
      ::unlink(tmp_.c_str());
      fail_os(err, where_, "cannot give '", tmp_, "' the permissions of '", target_, "'");
    }
    if (st.st_uid != ::geteuid() || st.st_gid != ::getegid()) {
      [[maybe_unused]] int ignored = ::fchown(fd_, st.st_uid, st.st_gid);
    }
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t bytes) {
  LOOM_ASSERT(fd_ >= 0 && !committed_, "AtomicFile::write after commit");
  write_all(fd_, data, bytes, where_, tmp_);
}

void AtomicFile::commit() {
  LOOM_ASSERT(fd_ >= 0 && !committed_, "AtomicFile::commit twice");
  if (::fsync(fd_) != 0) fail_os(errno, where_, "fsync of '", tmp_, "' failed");
  if (::close(std::exchange(fd_, -1)) != 0) fail_os(errno, where_, "closing '", tmp_, "' failed");
  // Checked again: the target may have become something else while the file was written.
  struct stat st {};
  if (::lstat(target_.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    LOOM_FAIL(where_, "'", target_, "' became ", file_kind(st.st_mode), " while the file was written; it was left alone");
  if (::rename(tmp_.c_str(), target_.c_str()) != 0)
    fail_os(errno, where_, "cannot rename '", tmp_, "' to '", target_, "'");
  committed_ = true;

  // The rename itself made durable. Some file systems cannot fsync a directory (EINVAL).
  const std::string dir = parent_dir(target_);
  Fd dir_fd{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dir_fd.fd < 0)
    fail_os(errno, where_, "the file was written, but its directory '", dir, "' cannot be opened to fsync it");
  if (::fsync(dir_fd.fd) != 0 && errno != EINVAL)
    fail_os(errno, where_, "the file was written, but fsync of its directory '", dir, "' failed");
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::string where = "save_safetensors('" + path + "'): ";
  std::set<std::string_view> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    LOOM_CHECK(t.defined(), where, "tensor '", name, "' (index ", i, ") is undefined; nothing was written");
    LOOM_CHECK(!name.empty(), where, "the tensor at index ", i, " has an empty name; nothing was written");
    LOOM_CHECK(name != kMetadataKey, where, "'__metadata__' names the metadata and cannot name a tensor (index ", i,
               "); nothing was written");
    LOOM_CHECK(names.insert(name).second, where, "two tensors are named '", name,
               "'; names must be unique; nothing was written");
  }
  std::string header = make_header(tensors, metadata);
  LOOM_CHECK(header.size() <= kMaxHeaderBytes, where, "the header would take ", header.size(),
             " bytes, more than readers accept (", kMaxHeaderBytes, "): save fewer tensors or less metadata per file");

  AtomicFile file(path, where);
  uint64_t n = header.size();
  file.write(&n, 8);
  file.write(header.data(), header.size());
  for (const auto& [name, t] : tensors) {
    Tensor host = t.detach().to(Device::cpu()).contiguous();
    file.write(host.data_ptr(), host.nbytes());
  }
  file.commit();
}

namespace {

// An open safetensors file with its header read and parsed (the tensors not yet).
struct OpenedFile {
  Fd fd{-1};
  uint64_t file_size = 0, header_bytes = 0;
  Header header;
};

void open_and_read_header(const std::string& path, const std::string& where, OpenedFile& f) {
  f.fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd.fd < 0) fail_os(errno, where, "cannot open the file");
  struct stat st {};
  if (::fstat(f.fd.fd, &st) != 0) fail_os(errno, where, "cannot stat the file");
  LOOM_CHECK(S_ISREG(st.st_mode), where, "not a regular file");
  const uint64_t file_size = f.file_size = uint64_t(st.st_size);
  LOOM_CHECK(file_size >= 8, where, "the file is ", file_size,
             " bytes long, shorter than the 8-byte header length that starts every safetensors file");

  uint64_t n = 0;
  read_exact(f.fd.fd, &n, 8, 0, where, "the header length");
  LOOM_CHECK(n <= kMaxHeaderBytes, where, "the header length is ", n, " bytes, more than the limit of ",
             kMaxHeaderBytes, ": this is not a safetensors file, or a corrupt one");
  LOOM_CHECK(n <= file_size - 8, where, "the header length is ", n, " bytes, but only ", file_size - 8,
             " bytes follow it (file size ", file_size, "): the file is truncated or not a safetensors file");
  std::string text(n, '\0');
  read_exact(f.fd.fd, text.data(), n, 8, where, "the header");
  f.header_bytes = n;
  f.header = HeaderParser(text, where).parse();
}

}  // namespace

std::map<std::string, std::string> load_safetensors_metadata(const std::string& path) {
  OpenedFile f;
  open_and_read_header(path, "load_safetensors('" + path + "'): ", f);
  return std::move(f.header.metadata);
}

SafetensorsFile load_safetensors(const std::string& path, Device device) {
  std::string where = "load_safetensors('" + path + "'): ";
  OpenedFile f;
  open_and_read_header(path, where, f);
  const uint64_t file_size = f.file_size, n = f.header_bytes;
  Header& header = f.header;
  Fd& fd = f.fd;

  uint64_t buffer_size = file_size - 8 - n;
  std::vector<std::pair<DType, Shape>> layouts;
  for (const Entry& e : header.entries) layouts.push_back(check_entry(e, buffer_size, where));
  check_coverage(header.entries, buffer_size, where);

  SafetensorsFile out;
  out.metadata = std::move(header.metadata);
  for (size_t i = 0; i < header.entries.size(); ++i) {
    const Entry& e = header.entries[i];
    Tensor host = Tensor::empty(layouts[i].second, layouts[i].first, Device::cpu());
    read_exact(fd.fd, host.data_ptr(), host.nbytes(), 8 + n + e.begin, where, "tensor '" + e.name + "'");
    out.tensors.emplace_back(e.name, host.to(device));
  }
  return out;
}

std::map<std::string, Tensor> load_safetensors_map(const std::string& path, Device device) {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : load_safetensors(path, device).tensors) out.emplace(name, std::move(t));
  return out;
}

}  // namespace loom
