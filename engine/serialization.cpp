// Safetensors read/write: a small strict JSON reader and writer for exactly the header's
// subset (objects, strings with escapes, arrays of non-negative integers), the atomic
// save, and the checks a file must pass before any number in it is trusted.
//
// Decisions: the header may list tensors in any order, but their byte ranges must tile
// the buffer exactly (no hole, no overlap, nothing left over), as the reference
// implementation requires. Keys other than dtype, shape and data_offsets in a tensor's
// entry are rejected rather than ignored, so a format extension fails loudly instead of
// being misread. "__metadata__" is written first and only when there is metadata, as the
// Python library does. The file is fsynced before the rename and its directory after it:
// that is the order in which the rename itself becomes durable.
#include "engine/serialization.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
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

  // Write to a temporary name beside `path`, which the guard removes unless the rename happened.
  std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  Fd fd{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (fd.fd < 0) fail_os(errno, where, "cannot create the temporary file '", tmp, "'");
  struct Remove {
    const std::string& path;
    bool keep = false;
    ~Remove() {
      if (!keep) ::unlink(path.c_str());
    }
  } remove{tmp};

  uint64_t n = header.size();
  write_all(fd.fd, &n, 8, where, tmp);
  write_all(fd.fd, header.data(), header.size(), where, tmp);
  for (const auto& [name, t] : tensors) {
    Tensor host = t.detach().to(Device::cpu()).contiguous();
    write_all(fd.fd, host.data_ptr(), host.nbytes(), where, tmp);
  }
  if (::fsync(fd.fd) != 0) fail_os(errno, where, "fsync of '", tmp, "' failed");
  if (::close(std::exchange(fd.fd, -1)) != 0) fail_os(errno, where, "closing '", tmp, "' failed");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail_os(errno, where, "cannot rename '", tmp, "' to '", path, "'");
  remove.keep = true;

  // Make the rename itself durable. Some file systems cannot fsync a directory (EINVAL).
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  Fd dir_fd{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dir_fd.fd < 0)
    fail_os(errno, where, "the file was written, but its directory '", dir, "' cannot be opened to fsync it");
  if (::fsync(dir_fd.fd) != 0 && errno != EINVAL)
    fail_os(errno, where, "the file was written, but fsync of its directory '", dir, "' failed");
}

SafetensorsFile load_safetensors(const std::string& path, Device device) {
  std::string where = "load_safetensors('" + path + "'): ";
  Fd fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) fail_os(errno, where, "cannot open the file");
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail_os(errno, where, "cannot stat the file");
  LOOM_CHECK(S_ISREG(st.st_mode), where, "not a regular file");
  uint64_t file_size = uint64_t(st.st_size);
  LOOM_CHECK(file_size >= 8, where, "the file is ", file_size,
             " bytes long, shorter than the 8-byte header length that starts every safetensors file");

  uint64_t n = 0;
  read_exact(fd.fd, &n, 8, 0, where, "the header length");
  LOOM_CHECK(n <= kMaxHeaderBytes, where, "the header length is ", n, " bytes, more than the limit of ",
             kMaxHeaderBytes, ": this is not a safetensors file, or a corrupt one");
  LOOM_CHECK(n <= file_size - 8, where, "the header length is ", n, " bytes, but only ", file_size - 8,
             " bytes follow it (file size ", file_size, "): the file is truncated or not a safetensors file");
  std::string text(n, '\0');
  read_exact(fd.fd, text.data(), n, 8, where, "the header");
  Header header = HeaderParser(text, where).parse();

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
