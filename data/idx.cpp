// IDX reader. The header is read and checked against the file (or, for gzip, against the most
// the compressed file can inflate to, and against kMaxIdxBytes) before any allocation, and the
// stream must end exactly where the header says, so a truncated download, a wrong file or a
// corrupt header is reported with the path and the sizes involved, never read as garbage.
#include "data/idx.h"

#include <string_view>

#include "data/file_io.h"
#include "kernels/core/error.h"

namespace loom::data {

namespace {

const char* idx_type_name(uint8_t type) {
  switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return "unknown";
  }
}

std::string describe(const std::vector<int64_t>& dims) {
  std::string s;
  if (dims.size() == 1) {
    s = std::to_string(dims[0]) + " labels";
  } else if (dims.size() == 3) {
    s = std::to_string(dims[0]) + " images of " + std::to_string(dims[1]) + "x" + std::to_string(dims[2]);
  } else {
    s = "dims ";
    for (size_t i = 0; i < dims.size(); ++i) {
      if (i) s += 'x';
      s += std::to_string(dims[i]);
    }
  }
  return s;
}

// Reads an IDX file; `want_ndims` (0: any) is checked before the payload is touched, so an
// images/labels mix-up fails at once with a hint.
IdxArray read_idx(const std::string& path, size_t want_ndims) {
  InputFile in(path);
  uint8_t magic[4];
  in.read(magic, 4, "the 4-byte IDX magic");
  LOOM_CHECK(magic[0] == 0 && magic[1] == 0, path, ": not an IDX file: it starts with ",
             hex_bytes(magic, 4), ", expected 00 00 08 <ndims> (MNIST/Fashion-MNIST format)");
  LOOM_CHECK(magic[2] == 0x08, path, ": IDX value type 0x", hex_bytes(magic + 2, 1), " (",
             idx_type_name(magic[2]), ") is not supported; Loom reads unsigned-byte IDX (type 0x08)");
  const size_t ndims = magic[3];
  LOOM_CHECK(ndims > 0, path, ": IDX header says 0 dimensions (magic ", hex_bytes(magic, 4),
             "), expected at least 1");
  if (want_ndims != 0 && ndims != want_ndims) {
    const char* hint = ndims == 1 ? ": is this a labels file?" : ndims == 3 ? ": is this an images file?" : "";
    LOOM_FAIL(path, ": IDX header says ", ndims, " dimensions (magic ", hex_bytes(magic, 4),
              "), expected ", want_ndims, " (", want_ndims == 3 ? "count, height, width" : "count", ")", hint);
  }

  std::vector<uint8_t> raw(4 * ndims);
  in.read(raw.data(), raw.size(), "the IDX dimension sizes");
  IdxArray out;
  // The product saturates just past kMaxIdxBytes, so it cannot overflow however large the dims.
  uint64_t bytes = 1;
  bool any_zero = false;
  for (size_t i = 0; i < ndims; ++i) {
    const uint8_t* p = raw.data() + 4 * i;
    const uint64_t d = (uint64_t{p[0]} << 24) | (uint64_t{p[1]} << 16) | (uint64_t{p[2]} << 8) | p[3];
    out.dims.push_back(static_cast<int64_t>(d));
    any_zero = any_zero || d == 0;
    bytes = d != 0 && bytes > kMaxIdxBytes / d ? kMaxIdxBytes + 1 : bytes * d;
  }
  if (any_zero) bytes = 0;
  const bool over_cap = bytes > kMaxIdxBytes;
  const uint64_t header = 4 + 4 * ndims;
  LOOM_CHECK(!over_cap, path, ": header says ", describe(out.dims), ", more than Loom's cap of ",
             kMaxIdxBytes, " bytes for one IDX file: corrupt header?");
  const std::string claim = describe(out.dims) + " (" + std::to_string(bytes) + " bytes)";
  if (in.is_gzip()) {
    LOOM_CHECK(bytes <= in.max_remaining(), path, ": header says ", claim, " but a gzip file of ",
               in.file_bytes(), " bytes inflates to at most ", in.max_remaining() + header,
               " bytes: corrupt header or truncated download?");
  } else {
    LOOM_CHECK(bytes == in.max_remaining(), path, ": header says ", claim, " but the file holds ",
               in.max_remaining(), " bytes after its ", header, "-byte header",
               bytes > in.max_remaining() ? ": truncated download?" : ": wrong file, or a corrupt header?");
  }

  out.data.resize(bytes);
  in.read(out.data.data(), bytes, "the IDX data; header says " + claim);
  in.expect_end(claim + " after a " + std::to_string(header) + "-byte header");
  return out;
}

}  // namespace

IdxArray load_idx(const std::string& path) { return read_idx(path, 0); }

ImageSet load_idx_images(const std::string& path) {
  IdxArray a = read_idx(path, 3);
  ImageSet s;
  s.count = a.dims[0];
  s.channels = 1;
  s.height = a.dims[1];
  s.width = a.dims[2];
  s.pixels = std::move(a.data);
  s.source = path;
  return s;
}

std::vector<int64_t> load_idx_labels(const std::string& path) {
  const IdxArray a = read_idx(path, 1);
  return std::vector<int64_t>(a.data.begin(), a.data.end());
}

namespace {

// `dir`/`name`, or `dir`/`name`.gz when only that exists.
std::string find_idx(const std::string& dir, const std::string& name) {
  const std::string plain = join_path(dir, name);
  if (is_regular_file(plain)) return plain;
  const std::string gz = plain + ".gz";
  if (is_regular_file(gz)) return gz;
  LOOM_FAIL(dir, ": holds neither ", name, " nor ", name, ".gz; expected the four MNIST-format files "
            "{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]");
}

ImageSet load_idx_pair(const std::string& dir, Split split, std::vector<std::string> names) {
  require_directory(dir, "expected a directory of MNIST-format IDX files "
                         "(for Fashion-MNIST: apt-get install dataset-fashion-mnist)");
  const std::string base = split == Split::train ? "train" : "t10k";
  const std::string images_path = find_idx(dir, base + "-images-idx3-ubyte");
  const std::string labels_path = find_idx(dir, base + "-labels-idx1-ubyte");
  ImageSet s = load_idx_images(images_path);
  s.labels = load_idx_labels(labels_path);
  LOOM_CHECK(static_cast<int64_t>(s.labels.size()) == s.count, labels_path, ": holds ",
             s.labels.size(), " labels but ", images_path, " holds ", s.count,
             " images; expected one label per image (files from different downloads?)");
  for (size_t i = 0; i < s.labels.size(); ++i) {
    LOOM_CHECK(s.labels[i] < 10, labels_path, ": label ", s.labels[i], " at index ", i,
               " is out of range; expected labels 0..9");
  }
  s.class_names = std::move(names);
  return s;
}

}  // namespace

ImageSet load_mnist(const std::string& dir, Split split) {
  return load_idx_pair(dir, split, {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"});
}

ImageSet load_fashion_mnist(const std::string& dir, Split split) {
  return load_idx_pair(dir, split, {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                                    "Shirt", "Sneaker", "Bag", "Ankle boot"});
}

}  // namespace loom::data
