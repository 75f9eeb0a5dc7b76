// Safetensors files: round trips of every dtype and shape, the writer's exact bytes, the
// headers the Python library writes, the atomic save (a failed save leaves the old file
// alone), and one hand-built corrupt file per check the loader makes, each of which must
// fail with a message naming the file and the problem.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "engine/serialization.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using Named = std::vector<std::pair<std::string, Tensor>>;

// A fresh directory under /tmp, removed with everything in it.
struct TempDir {
  std::string path;
  TempDir() {
    char name[] = "/tmp/loom_safetensors_XXXXXX";
    EXPECT_NE(::mkdtemp(name), nullptr) << std::strerror(errno);
    path = name;
  }
  ~TempDir() {
    ::chmod(path.c_str(), 0700);
    fs::remove_all(path);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
    return out;
  }
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::string length_prefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((n >> (8 * i)) & 0xff);
  return out;
}

// The 8-byte little-endian length, then `header`, then `data`.
std::string st_file(const std::string& header, const std::string& data = "") {
  return length_prefix(header.size()) + header + data;
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a loom::Error holding '" << parts.front() << "'";
  } catch (const Error& e) {
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' missing from: " << e.what();
  }
}

// Same dtype, shape and bytes; the loaded tensor is contiguous on the CPU.
void expect_same(const Tensor& loaded, const Tensor& original) {
  ASSERT_EQ(loaded.dtype(), original.dtype());
  ASSERT_EQ(loaded.shape(), original.shape());
  // Tensor::is_contiguous() says false for some empty shapes such as (2, 0, 3).
  EXPECT_TRUE(loaded.numel() == 0 || loaded.is_contiguous());
  Tensor want = original.contiguous();
  EXPECT_EQ(std::memcmp(loaded.data_ptr(), want.data_ptr(), want.nbytes()), 0);
}

TEST(SafetensorsRoundTrip, EveryDtypeAndShape) {
  TempDir dir;
  const std::vector<Shape> shapes = {{}, {0}, {1}, {5}, {2, 3}, {2, 0, 3}, {2, 1, 3, 2}};
  Named saved;
  for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    for (const Shape& shape : shapes) {
      Tensor values = arange(0, double(shape_numel(shape)), 1, DType::f64).reshape(shape);
      if (is_floating(dtype)) values = values * 0.5 - 1.25;
      saved.emplace_back(std::string(dtype_name(dtype)) + shape_str(shape), values.to(dtype));
    }
  }
  save_safetensors(dir.file("all.safetensors"), saved);
  SafetensorsFile loaded = load_safetensors(dir.file("all.safetensors"));
  ASSERT_EQ(loaded.tensors.size(), saved.size());
  EXPECT_TRUE(loaded.metadata.empty());
  for (size_t i = 0; i < saved.size(); ++i) {
    SCOPED_TRACE(saved[i].first);
    EXPECT_EQ(loaded.tensors[i].first, saved[i].first);
    EXPECT_TRUE(loaded.tensors[i].second.device().is_cpu());
    expect_same(loaded.tensors[i].second, saved[i].second);
  }
}

TEST(SafetensorsRoundTrip, NonContiguousInputsAreSavedContiguous) {
  TempDir dir;
  Tensor base = arange(0, 24, 1, DType::f32).reshape({4, 6});
  Named saved = {{"transposed", base.t()},
                 {"stepped", base.slice(1, 1, 6, 2)},
                 {"expanded", base.select(0, 2).unsqueeze(0).expand({3, 6})},
                 {"permuted_i64", base.to(DType::i64).reshape({2, 2, 6}).permute({2, 0, 1})},
                 {"requires_grad", base.clone().set_requires_grad()}};
  save_safetensors(dir.file("views.safetensors"), saved);
  std::map<std::string, Tensor> loaded = load_safetensors_map(dir.file("views.safetensors"));
  ASSERT_EQ(loaded.size(), saved.size());
  for (const auto& [name, t] : saved) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(loaded.count(name));
    expect_same(loaded[name], t.detach());
    EXPECT_EQ(loaded[name].to_vector<double>(), t.to_vector<double>());
    EXPECT_FALSE(loaded[name].requires_grad());
  }
}

TEST(SafetensorsRoundTrip, MetadataWithEscapesAndUnicode) {
  TempDir dir;
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"quote\"back\\slash", "line\nbreak\ttab\rreturn\b\f"},
      {"control", std::string("\x01\x1f", 2)},
      {"unicode", "caf\xc3\xa9 \xf0\x9f\x98\x80"},
      {"", "empty key"},
      {"empty value", ""},
  };
  save_safetensors(dir.file("meta.safetensors"), {{"x", ones({2})}}, metadata);
  SafetensorsFile loaded = load_safetensors(dir.file("meta.safetensors"));
  EXPECT_EQ(loaded.metadata, metadata);
  ASSERT_EQ(loaded.tensors.size(), 1u);
  EXPECT_EQ(loaded.tensors[0].second.to_vector<double>(), (std::vector<double>{1, 1}));
}

TEST(SafetensorsRoundTrip, EmptyFileHoldsNoTensors) {
  TempDir dir;
  save_safetensors(dir.file("empty.safetensors"), {});
  EXPECT_EQ(read_bytes(dir.file("empty.safetensors")), st_file("{}      "));
  SafetensorsFile loaded = load_safetensors(dir.file("empty.safetensors"));
  EXPECT_TRUE(loaded.tensors.empty());
  EXPECT_TRUE(loaded.metadata.empty());
}

TEST(SafetensorsFormat, WriterIsByteExact) {
  TempDir dir;
  Tensor a = from_vector(std::vector<float>{1.0f, -2.0f}, {2});
  Tensor b = from_vector(std::vector<float>{1, 2, 3}, {1, 3}).to(DType::u8);
  save_safetensors(dir.file("tiny.safetensors"), {{"a", a}, {"b", b}}, {{"format", "pt"}});
  // 140 bytes of JSON, padded with 4 spaces to 144 = 0x90; then 1.0f, -2.0f, 1, 2, 3.
  const std::string expected =
      std::string("\x90\0\0\0\0\0\0\0", 8) +
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"U8","shape":[1,3],"data_offsets":[8,11]}}    )" +
      std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0\x01\x02\x03", 11);
  EXPECT_EQ(read_bytes(dir.file("tiny.safetensors")), expected);
}

TEST(SafetensorsFormat, ReadsHeadersInThePythonLibrarysStyle) {
  TempDir dir;
  const std::string data("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);  // 1.0f, 2.0f
  const std::vector<std::string> headers = {
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}})",
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}}      )",
      R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"format": "pt"}})",
      "{\n  \"a\" :\t{ \"dtype\" : \"F32\" ,\r\n \"shape\" : [ 2 ] , \"data_offsets\" : [ 0 , 8 ] } ,\n"
      "  \"__metadata__\" : { \"format\" : \"pt\" }\n}\n  ",
      R"({"__metadata__":{"format":"p\u0074"},"\u0061":{"data_offsets":[0,8],"shape":[2],"dtype":"F32"}})",
  };
  for (const std::string& header : headers) {
    SCOPED_TRACE(header);
    write_bytes(dir.file("py.safetensors"), st_file(header, data));
    SafetensorsFile f = load_safetensors(dir.file("py.safetensors"));
    EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
    ASSERT_EQ(f.tensors.size(), 1u);
    EXPECT_EQ(f.tensors[0].first, "a");
    EXPECT_EQ(f.tensors[0].second.to_vector<double>(), (std::vector<double>{1, 2}));
  }
}

TEST(SafetensorsFormat, DecodesSurrogatePairs) {
  TempDir dir;
  write_bytes(dir.file("s.safetensors"), st_file(R"({"__metadata__":{"smile":"\ud83d\ude00 \u00e9"}})"));
  EXPECT_EQ(load_safetensors(dir.file("s.safetensors")).metadata.at("smile"), "\xf0\x9f\x98\x80 \xc3\xa9");
}

TEST(SafetensorsSave, ReplacesTheFileAndLeavesNoTemporary) {
  TempDir dir;
  save_safetensors(dir.file("ckpt.safetensors"), {{"w", zeros({3})}});
  save_safetensors(dir.file("ckpt.safetensors"), {{"w", ones({3})}});
  EXPECT_EQ(dir.names(), std::vector<std::string>{"ckpt.safetensors"});
  EXPECT_EQ(load_safetensors_map(dir.file("ckpt.safetensors")).at("w").to_vector<double>(),
            (std::vector<double>{1, 1, 1}));
}

TEST(SafetensorsSave, UnwritableLocationNamesThePathAndTheOsError) {
  TempDir dir;
  write_bytes(dir.file("plain_file"), "x");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dir.file("no/such/dir/ckpt.safetensors"), "No such file or directory"},
      {dir.file("plain_file/ckpt.safetensors"), "Not a directory"},
  };
  for (const auto& [path, os_error] : cases) {
    expect_error([&] { save_safetensors(path, {{"w", ones({2})}}); }, {"save_safetensors('" + path + "')", os_error});
  }
}

TEST(SafetensorsSave, ReadOnlyDirectoryNamesThePathAndTheOsError) {
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: a read-only directory is still writable";
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path.c_str(), 0500), 0);
  std::string path = dir.file("ckpt.safetensors");
  expect_error([&] { save_safetensors(path, {{"w", ones({2})}}); }, {path, "Permission denied"});
}

TEST(SafetensorsSave, FailedSaveLeavesTheExistingFileUntouched) {
  TempDir dir;
  std::string path = dir.file("ckpt.safetensors");
  save_safetensors(path, {{"w", ones({4})}}, {{"step", "1"}});
  const std::string before = read_bytes(path);
  struct Case {
    const char* what;
    Named tensors;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"undefined", {{"w", zeros({4})}, {"b", Tensor()}}, {path, "tensor 'b' (index 1) is undefined"}},
      {"duplicate", {{"w", zeros({4})}, {"w", zeros({2})}}, {path, "two tensors are named 'w'"}},
      {"empty name", {{"w", zeros({4})}, {"", zeros({2})}}, {path, "index 1 has an empty name"}},
      {"reserved name", {{"__metadata__", zeros({4})}}, {path, "'__metadata__' names the metadata"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    expect_error([&] { save_safetensors(path, c.tensors, {{"step", "2"}}); }, c.parts);
    EXPECT_EQ(read_bytes(path), before);
    EXPECT_EQ(dir.names(), std::vector<std::string>{"ckpt.safetensors"});
  }
}

TEST(SafetensorsLoad, MissingFileNamesThePathAndTheOsError) {
  TempDir dir;
  std::string path = dir.file("absent.safetensors");
  expect_error([&] { load_safetensors(path); }, {"load_safetensors('" + path + "')", "No such file or directory"});
}

// One hand-built file per check; each message must name the file and hold `parts`.
struct CorruptCase {
  const char* name;
  std::string bytes;
  std::vector<std::string> parts;
};

std::string f32_entry(const std::string& name, const std::string& shape, uint64_t begin, uint64_t end) {
  return "\"" + name + "\":{\"dtype\":\"F32\",\"shape\":" + shape + ",\"data_offsets\":[" + std::to_string(begin) +
         "," + std::to_string(end) + "]}";
}

std::vector<CorruptCase> corrupt_cases() {
  const std::string d8(8, '\x11'), d12(12, '\x11');
  return {
      {"empty_file", "", {"0 bytes long, shorter than the 8-byte header length"}},
      {"shorter_than_8_bytes", "abc", {"3 bytes long, shorter than the 8-byte"}},
      {"header_longer_than_file",
       length_prefix(100) + "{}",
       {"header length is 100 bytes, but only 2 bytes follow", "truncated"}},
      {"header_absurdly_large",
       length_prefix(uint64_t(1) << 40) + "{}",
       {"header length is 1099511627776 bytes, more than the limit of 100000000"}},
      {"not_json", st_file("hello"), {"invalid header JSON at byte 0", "expected '{' to open the header, found 'h'"}},
      {"missing_colon", st_file(R"({"a" {}})"), {"at byte 5", "expected ':' after the key 'a'"}},
      {"unterminated_object", st_file(R"({"__metadata__":{})"), {"at byte 18", "',' or '}' in the header"}},
      {"trailing_garbage", st_file("{} x"), {"at byte 3", "only space padding"}},
      {"raw_newline_in_string", st_file("{\"a\nb\":{}}"), {"at byte 3", "raw control character"}},
      {"bad_escape", st_file(R"({"a\q":{}})"), {"at byte 3", "invalid escape '\\q'"}},
      {"lone_surrogate", st_file(R"({"__metadata__":{"k":"\udc00"}})"), {"low surrogate"}},
      {"metadata_not_string", st_file(R"({"__metadata__":{"step":1}})"), {"metadata values are strings"}},
      {"negative_dim",
       st_file(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})"),
       {"expected a non-negative integer for an element of the shape of tensor 'a', found '-'"}},
      {"fractional_offset",
       st_file(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4.0]}})", "abcd"),
       {"fraction or exponent"}},
      {"leading_zero", st_file(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,04]}})", "abcd"), {"leading zero"}},
      {"number_too_large",
       st_file(R"({"a":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,0]}})"),
       {"does not fit in 64 bits"}},
      {"three_offsets",
       st_file(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4,8]}})"),
       {"hold 3 numbers; expected 2 [begin, end]"}},
      {"missing_shape",
       st_file(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", "abcd"),
       {"tensor 'a' has no 'shape'"}},
      {"unknown_key",
       st_file(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4],"extra":1}})", "abcd"),
       {"unknown key 'extra' in tensor 'a'"}},
      {"duplicate_name",
       st_file("{" + f32_entry("w", "[1]", 0, 4) + "," + f32_entry("w", "[1]", 4, 8) + "}", d8),
       {"duplicate key 'w' in the header"}},
      {"duplicate_metadata", st_file(R"({"__metadata__":{},"__metadata__":{}})"), {"duplicate key '__metadata__'"}},
      {"unknown_dtype",
       st_file(R"({"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", "x"),
       {"tensor 'a' has dtype 'F8_E4M3'", "expected one of F32, F64, BF16, F16, I32, I64, U8"}},
      {"too_many_dims",
       st_file("{" + f32_entry("a", "[1,1,1,1,1,1,1,1,1]", 0, 4) + "}", "abcd"),
       {"has 9 dimensions; Loom tensors have at most 8"}},
      {"size_overflow", st_file("{" + f32_entry("a", "[4294967296,4294967296]", 0, 0) + "}"), {"overflows 64 bits"}},
      {"span_mismatch",
       st_file("{" + f32_entry("a", "[3]", 0, 8) + "}", d8),
       {"tensor 'a' of dtype F32 and shape (3,) needs 12 bytes, but its data_offsets [0, 8] span 8"}},
      {"end_before_begin", st_file("{" + f32_entry("a", "[0]", 8, 4) + "}", d8), {"end before they begin"}},
      {"offsets_outside_buffer",
       st_file("{" + f32_entry("a", "[4]", 0, 16) + "}", d8),
       {"data_offsets [0, 16] outside the data buffer, which holds 8 bytes"}},
      {"hole_between",
       st_file("{" + f32_entry("a", "[1]", 0, 4) + "," + f32_entry("b", "[1]", 8, 12) + "}", d12),
       {"bytes [4, 8) of the data buffer, before tensor 'b', belong to no tensor"}},
      {"hole_at_start", st_file("{" + f32_entry("a", "[1]", 4, 8) + "}", d8), {"bytes [0, 4)", "before tensor 'a'"}},
      {"trailing_bytes",
       st_file("{" + f32_entry("a", "[1]", 0, 4) + "}", d8),
       {"bytes [4, 8) at the end of the data buffer belong to no tensor"}},
      {"overlap",
       st_file("{" + f32_entry("a", "[2]", 0, 8) + "," + f32_entry("b", "[2]", 4, 12) + "}", d12),
       {"tensor 'b' (bytes [4, 12)) overlaps tensor 'a' (bytes [0, 8))"}},
  };
}

TEST(SafetensorsLoad, EveryCorruptFileNamesItsProblem) {
  TempDir dir;
  for (const CorruptCase& c : corrupt_cases()) {
    SCOPED_TRACE(c.name);
    std::string path = dir.file(std::string(c.name) + ".safetensors");
    write_bytes(path, c.bytes);
    try {
      load_safetensors(path);
      ADD_FAILURE() << "expected a loom::Error";
    } catch (const Error& e) {
      std::string message = e.what();
      EXPECT_NE(message.find("load_safetensors('" + path + "')"), std::string::npos) << message;
      for (const std::string& p : c.parts)
        EXPECT_NE(message.find(p), std::string::npos) << "'" << p << "' missing from: " << message;
    }
  }
}

TEST(SafetensorsLoad, OutOfOrderOffsetsThatTileTheBufferAreFine) {
  TempDir dir;
  std::string header =
      "{" + f32_entry("b", "[1]", 4, 8) + "," + f32_entry("a", "[1]", 0, 4) + "," + f32_entry("e", "[0]", 8, 8) + "}";
  write_bytes(dir.file("ok.safetensors"), st_file(header, std::string("\0\0\x80\x3f\0\0\0\x40", 8)));
  SafetensorsFile f = load_safetensors(dir.file("ok.safetensors"));
  ASSERT_EQ(f.tensors.size(), 3u);
  EXPECT_EQ(f.tensors[0].first, "b");  // the header's order
  EXPECT_EQ(f.tensors[0].second.item(), 2.0);
  EXPECT_EQ(f.tensors[1].second.item(), 1.0);
  EXPECT_EQ(f.tensors[2].second.numel(), 0);
}

}  // namespace
}  // namespace loom
